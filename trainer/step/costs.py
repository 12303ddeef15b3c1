"""What XLA says of a compiled program, per device: its cost analysis and its memory analysis
(`CompiledCosts`), read by tools.aot, tools.memory_check and the pipeline's start-up report
(trainer/step/pipelined.py)."""
from __future__ import annotations

from typing import NamedTuple


class CompiledCosts(NamedTuple):
  """What XLA says of a compiled program, per device: cost analysis and memory analysis."""
  xla_flops: float | None  # cost_analysis()'s "flops" (loop bodies once, Pallas kernels not)
  xla_bytes: float | None  # cost_analysis()'s "bytes accessed" (loop bodies once)
  argument_bytes: int
  output_bytes: int  # outputs not aliased to (donated) inputs
  temp_bytes: int
  code_bytes: int

  @property
  def total_bytes(self) -> int:
    """What the program holds on a device while it runs: arguments + temporaries + outputs
    not aliased to donated inputs + code."""
    return self.argument_bytes + self.temp_bytes + self.output_bytes + self.code_bytes


def compiled_costs(compiled) -> CompiledCosts:
  """The `CompiledCosts` of a compiled program (`jax.stages.Compiled`)."""
  mem = compiled.memory_analysis()
  get = lambda name: int(getattr(mem, name, 0) or 0) if mem is not None else 0
  cost = compiled.cost_analysis()
  cost = cost[0] if isinstance(cost, (list, tuple)) and cost else cost
  xla_flops = float(cost.get("flops", 0.0)) if isinstance(cost, dict) else None
  xla_bytes = float(cost.get("bytes accessed", 0.0)) if isinstance(cost, dict) else None
  return CompiledCosts(
      xla_flops=xla_flops, xla_bytes=xla_bytes or None,
      argument_bytes=get("argument_size_in_bytes"),
      output_bytes=max(get("output_size_in_bytes") - get("alias_size_in_bytes"), 0),
      temp_bytes=get("temp_size_in_bytes"), code_bytes=get("generated_code_size_in_bytes"))

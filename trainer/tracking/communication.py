"""What crosses DiLoCo's replicas, read from the compiled programs, next to data parallelism's.

`measure(program, inner, outer)` reads the compiled inner and outer steps of a DiLoCo run
(`sharding.collectives`) and keeps the collectives whose device groups join devices of two
different replicas, and compiles the plain data-parallel step of the same config on the same
devices in the same order (the `replica` axis folded into `data`, `sharding.mesh.fold_replicas`:
what the run would be without DiLoCo) to count its collectives that join two of those device
blocks. Bytes are per device: each collective's array (an all-reduce's operand, an all-gather's
result, ...; `sharding/collectives.py`), times the runs of any loop around it. The inner step
must have none (a non-zero count is reported as the bug it is); the outer step's are spread
over its H inner steps.

A replica's block of devices is what may sit behind a slower link (a slice of its own, a host),
so these bytes are those DiLoCo saves on that link; the traffic inside a replica (FSDP
all-gathers, tensor-parallel reductions) is the same in both and not counted.
"""
from __future__ import annotations

import dataclasses
import time

from sharding.collectives import (collectives, crossing, format_bytes, total_bytes,
                                  unattributed)
from sharding.mesh import fold_replicas, replica_count
from trainer.step.program import Program


@dataclasses.dataclass(frozen=True)
class Communication:
  replicas: int
  inner_steps: int
  # Bytes per device; None where a collective runs in a loop whose trip count is unknown, or
  # where a transfer between slices cannot be placed (`unplaced`).
  inner_bytes: float | None  # per inner step, over collectives that cross replicas
  inner_ops: int  # how many such collectives the inner step has (0, or a bug)
  outer_bytes: float | None  # per outer step
  data_parallel_bytes: float | None  # per step of plain data parallelism
  data_parallel_compile_seconds: float = 0.0  # what compiling that step to count it took
  # Transfers between slices in the three programs whose replicas the HLO does not say (a
  # replica of several slices: `sharding.collectives.unattributed`).
  unplaced: int = 0

  @property
  def per_step(self) -> float | None:
    if self.inner_bytes is None or self.outer_bytes is None:
      return None
    return self.inner_bytes + self.outer_bytes / self.inner_steps

  def lines(self) -> list[str]:
    inner = ("0 B (no collective joins two replicas)"
             if not self.inner_ops and self.inner_bytes is not None else
             f"{_size(None)} (no collective inside a slice joins two replicas)"
             if not self.inner_ops else
             f"{_size(self.inner_bytes)} in {self.inner_ops} collective(s) that join replicas "
             "(a bug: the inner step must not communicate across replicas)")
    out = [f"communication across the {self.replicas} replicas, bytes per device from the "
           f"compiled programs: inner step {inner}; outer step {_size(self.outer_bytes)} every "
           f"{self.inner_steps} steps = {_size(self.per_step)} per step"]
    ratio = (f", {self.data_parallel_bytes / self.per_step:.1f}x DiLoCo's"
             if self.per_step and self.data_parallel_bytes else "")
    out.append(f"plain data parallelism on the same devices: "
               f"{_size(self.data_parallel_bytes)} per step between the same device blocks"
               f"{ratio} (its step compiled to count them in "
               f"{self.data_parallel_compile_seconds:.1f}s)")
    if self.unplaced:
      out.append(f"{self.unplaced} transfer(s) between slices could not be placed: a replica "
                 "spans several slices and the compiled program does not name the slices a "
                 "transfer joins, so the bytes that include them are unknown (with one replica "
                 "per slice, or several per slice, they are counted)")
    return out

  def row(self) -> dict:
    """For metrics.jsonl (an `{"event": "communication"}` row)."""
    return {"comm/replicas": self.replicas, "comm/inner_steps": self.inner_steps,
            "comm/inner_step_bytes": self.inner_bytes, "comm/inner_step_ops": self.inner_ops,
            "comm/outer_step_bytes": self.outer_bytes, "comm/bytes_per_step": self.per_step,
            "comm/data_parallel_bytes_per_step": self.data_parallel_bytes,
            "comm/data_parallel_compile_seconds": self.data_parallel_compile_seconds}


def replica_labels(mesh) -> list[int]:
  """The replica of each position in the mesh's device order (the programs' device assignment):
  `replica` is the outermost axis, so replica r holds a contiguous block."""
  n, m = mesh.devices.size, replica_count(mesh)
  return [p // (n // m) for p in range(n)]


def slice_labels(mesh) -> list[int]:
  """The slice (`device.slice_index`; 0 without one) of each position in the mesh's device
  order."""
  return [getattr(d, "slice_index", 0) or 0 for d in mesh.devices.flat]


def crossing_bytes(compiled, labels, slices=None) -> tuple[float | None, int, int]:
  """(bytes per device per execution, count, unplaced) of the collectives of a compiled program
  that join devices of different `labels`; `unplaced`: the transfers between `slices` that
  cannot be placed (a replica of several slices: `sharding.collectives.unattributed`). The
  bytes are None if one runs in a loop of unknown count or if some transfer is unplaced."""
  ops = collectives(compiled.as_text() or "")
  found, unknown = crossing(ops, labels, slices), unattributed(ops, labels, slices)
  return (None if unknown else total_bytes(found)), len(found), len(unknown)


def measure(program: Program, inner, outer, num_micro: int | None = None) -> Communication:
  """The `Communication` of a DiLoCo `program` from its compiled inner and outer steps, and of
  plain data parallelism's step (for `num_micro` micro-batches, default the config's), compiled
  here to be counted (its compile time is reported: it is start-up time DiLoCo runs spend)."""
  labels, slices = replica_labels(program.mesh), slice_labels(program.mesh)
  inner_bytes, inner_ops, inner_unplaced = crossing_bytes(inner, labels, slices)
  outer_bytes, _, outer_unplaced = crossing_bytes(outer, labels, slices)
  cfg = program.cfg.copy_and_resolve_references()
  cfg.optim.diloco.replicas = 0
  t0 = time.perf_counter()
  dp = Program(cfg, fold_replicas(program.mesh)).compile(num_micro)
  seconds = time.perf_counter() - t0
  dp_bytes, _, dp_unplaced = crossing_bytes(dp, labels, slices)
  return Communication(program.diloco.replicas, program.diloco.inner_steps, inner_bytes,
                       inner_ops, outer_bytes, dp_bytes, seconds,
                       inner_unplaced + outer_unplaced + dp_unplaced)


def _size(n: float | None) -> str:
  return format_bytes(n, "an unknown number of bytes (a loop of unknown trip count, or an "
                         "unplaced transfer)")

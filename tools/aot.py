"""Ahead-of-time compile of the real train step for hardware this machine does not have.

    python -m tools.aot --config configs/lm_1b.py --topology v5e:4x4
    python -m tools.aot --config configs/lm_8b.py --topology v5:4x4x4 --config.mesh.fsdp=-1
    python -m tools.aot --config configs/lm_125m.py --topology v5e:2x2 --config.mesh.dcn_data=2
    python -m tools.aot --config configs/lm_125m.py --topology v5e:2x2 \\
        --config.optim.diloco.replicas=2 --config.optim.diloco.inner_steps=32

Compiles the program `train.py` runs (`trainer.step.program.Program` on the config's mesh) for
the devices of a TPU topology (libtpu's compiler: `pip install -e ".[tpu]"`), of several slices
(`mesh.dcn_*`), of a replica each (DiLoCo) or of GPUs, on this CPU machine, and prints per chip
the memory against the HBM, the step's FLOPs and the roofline (`tools.roofline`). A program that
does not fit fails with one line naming the knob to turn (exit 2).
What it compiles, what the numbers are, topologies: docs/aot.md
"""
from __future__ import annotations

import os

os.environ.setdefault("JAX_PLATFORMS", "cpu")  # before jax is imported: this tool never runs a step
os.environ.setdefault("ALLOW_MULTIPLE_LIBTPU_LOAD", "1")  # several libtpu users at once

import contextlib  # noqa: E402
import dataclasses  # noqa: E402
import json  # noqa: E402
import math  # noqa: E402
import sys  # noqa: E402
import time  # noqa: E402

import jax  # noqa: E402
import numpy as np  # noqa: E402
from jax.sharding import Mesh  # noqa: E402

from models.attention import resolve_impl  # noqa: E402
from models.sizes import flops_per_token, param_counts  # noqa: E402
from sharding.mesh import data_parallel_size  # noqa: E402
from trainer.config.cli import CliParser, load  # noqa: E402
from trainer.config import ConfigError  # noqa: E402
from trainer.config.checks import validate  # noqa: E402
from sharding.collectives import collectives, format_bytes, total_bytes  # noqa: E402
from sharding.pipeline import count as pipeline_count  # noqa: E402
from tools.roofline import Roofline, idle_flops, kernel_flops, remat_mfu_bound  # noqa: E402
from tools.targets import (  # noqa: E402, F401  (tpu_target etc.: this tool's API, for tests)
    AotError,
    Target,
    config_slices,
    config_target,
    gpu_target,
    libtpu_available,
    make_target,
    tpu_target,
)
from trainer.step.costs import CompiledCosts, compiled_costs  # noqa: E402, F401  (this tool's API)
from trainer.errors import first_line  # noqa: E402
from trainer.tracking.peaks import GiB  # noqa: E402
from trainer.tracking import communication  # noqa: E402
from trainer.step.program import Program, run_mesh  # noqa: E402

EXIT_USER_ERROR = 2
# Custom calls that mark a compiled Pallas kernel: Mosaic on TPU, Triton and Mosaic GPU on GPU.
KERNEL_CALLS = ("tpu_custom_call", "__gpu$xla.gpu.triton", "mosaic_gpu_v2")


# ----------------------------------------------------------------------------------------------
# The report


@dataclasses.dataclass
class Report:
  config: str
  topology: str
  chips: int
  hosts: int
  device_kind: str
  mesh: dict
  attention: str
  kernel_calls: int  # compiled Pallas kernels (Mosaic / Triton custom calls) in the program
  params: int
  compile_seconds: float
  argument_bytes: int  # per device: state + batch
  state_bytes: int  # per device: the train state alone
  temp_bytes: int
  output_bytes: int  # outputs not aliased to (donated) inputs
  code_bytes: int
  hbm_bytes: float | None
  model_flops: float  # per optimizer step, all chips (models.sizes.flops_per_token)
  xla_flops: float | None  # per chip, as cost_analysis() counts them (information only)
  xla_bytes: float | None  # per chip, cost_analysis()'s "bytes accessed" (loop bodies once)
  peak_flops: float | None  # per chip, bf16
  hbm_bandwidth: float | None  # per chip, bytes/s
  tokens_per_step: int
  remat_mfu_bound: float  # MFU ceiling from recomputation alone
  kernel_flops: float = 0.0  # per step, all chips: model FLOPs inside compiled kernels (attention)
  loops: int = 0  # while loops in the lowered program (`while_loops`)
  # DiLoCo: the bytes that cross replicas, next to data parallelism's (trainer/tracking/communication.py)
  communication: list = dataclasses.field(default_factory=list)
  # bytes per chip per step of each kind of collective (sharding.collectives; None: a loop of
  # unknown trip count around one)
  collective_bytes: dict = dataclasses.field(default_factory=dict)
  # pipeline stages (mesh.stage > 1): the counted bubble and bytes between stages
  # (sharding.pipeline.count), and the FLOPs the stages execute in their idle ticks
  pipeline: dict = dataclasses.field(default_factory=dict)
  idle_flops: float = 0.0
  outer_step_bytes: int | None = None  # DiLoCo: the outer step's memory sum, as total_bytes

  @property
  def total_bytes(self) -> int:
    return self.argument_bytes + self.temp_bytes + self.output_bytes + self.code_bytes

  @property
  def roofline(self) -> Roofline:
    return Roofline(
        device_kind=self.device_kind, chips=self.chips, model_flops=self.model_flops,
        tokens_per_step=self.tokens_per_step, remat_mfu_bound=self.remat_mfu_bound,
        peak_flops=self.peak_flops, hbm_bandwidth=self.hbm_bandwidth, xla_flops=self.xla_flops,
        xla_bytes=self.xla_bytes, kernel_flops=self.kernel_flops, idle_flops=self.idle_flops)

  def lines(self) -> list[str]:
    gib = lambda b: f"{b / GiB:.2f} GiB"
    mesh = " ".join(f"{k}={v}" for k, v in self.mesh.items() if v > 1) or "1 device"
    hbm = (f" of {gib(self.hbm_bytes)} HBM ({self.total_bytes / self.hbm_bytes:.0%})"
           if self.hbm_bytes else " (HBM of this chip unknown)")
    out = [
        f"{self.config} on {self.topology}: {self.chips} x {self.device_kind}, {self.hosts} "
        f"host(s); mesh {mesh}; {_count(self.params)} params; attention {self.attention}"
        f" ({self.kernel_calls} compiled kernel calls); compiled in {self.compile_seconds:.1f}s",
        f"  memory per chip: arguments {gib(self.argument_bytes)} (train state "
        f"{gib(self.state_bytes)}) + temporaries {gib(self.temp_bytes)} + outputs "
        f"{gib(self.output_bytes)} + code {gib(self.code_bytes)} = {gib(self.total_bytes)}{hbm}",
        f"  FLOPs per step: model {self.model_flops:.3e} ({self.tokens_per_step:,} tokens)"
        + (f"; XLA's cost analysis {self.xla_flops:.3e} per chip (scan bodies once, Pallas "
           "kernels not at all: for information)" if self.xla_flops else ""),
    ]
    if self.attention in ("flash_triton", "flash_mosaic", "splash") and not self.kernel_calls:
      out.append(f"  note: no compiled {self.attention} kernel in the program: it was lowered in "
                 "interpret mode (the kernel chose that from this machine's backend, not the "
                 "target's), so the kernel itself was not compiled for the target")
    if self.collective_bytes:
      out.append("  collectives per chip per step: " + ", ".join(
          f"{kind} {format_bytes(n)}" for kind, n in self.collective_bytes.items()))
    if self.pipeline:
      out.append(f"  {self.pipeline['line']}")
      out.extend(f"    schedule {row}" for row in self.pipeline.get("table", []))
    out += self.roofline.lines()
    return out + [f"  {line}" for line in self.communication]

  def markdown_row(self) -> str:
    mesh = " ".join(f"{k}={v}" for k, v in self.mesh.items() if v > 1) or "-"
    seconds = self.roofline.step_seconds
    step = f"{seconds * 1e3:,.0f} ms" if seconds else "?"
    hbm = f" / {self.hbm_bytes / GiB:.0f}" if self.hbm_bytes else ""
    return (f"| {self.config} | {_count(self.params)} | {self.topology} ({self.chips} x "
            f"{self.device_kind}) | {mesh} | {self.total_bytes / GiB:.1f}{hbm} GiB | {step} | "
            f"{self.remat_mfu_bound:.0%} |")

  def to_json(self) -> dict:
    d = dataclasses.asdict(self)
    d.update(total_bytes=self.total_bytes, **self.roofline.to_json())
    return d


def _count(n: float) -> str:
  if n >= 1e9:
    return f"{n / 1e9:.1f}B"
  return f"{n / 1e6:.0f}M" if n >= 1e7 else f"{n / 1e6:.2f}M"


def per_device_bytes(tree) -> int:
  """Bytes one device holds of a tree of (abstract) sharded arrays."""
  total = 0
  for leaf in jax.tree.leaves(tree):
    shape = leaf.sharding.shard_shape(leaf.shape)
    total += math.prod(shape) * np.dtype(leaf.dtype).itemsize
  return total


def is_out_of_memory(e: BaseException) -> bool:
  text = str(e)
  return "RESOURCE_EXHAUSTED" in text or "Ran out of memory" in text or "out of memory" in text


def oom_advice(cfg, sizes: dict, target: Target, state_bytes: int) -> str:
  """Which knob to turn, judged from what takes the memory."""
  hbm = target.hbm_bytes
  n = len(target.devices)
  if hbm and state_bytes > 0.6 * hbm:
    fsdp_hint = ("" if sizes["fsdp"] == n else
                 f"mesh.fsdp=-1 (now {sizes['fsdp']}) to shard it over all {n} chips, or ")
    return (f"the train state alone is {state_bytes / GiB:.1f} GiB per chip: {fsdp_hint}"
            "a topology with more chips")
  knobs = []
  if cfg.model.remat != "full":
    knobs.append(f"model.remat=full (now {cfg.model.remat!r}) to recompute activations")
  micro = cfg.data.micro_batch_size or cfg.data.global_batch_size
  dp = data_parallel_size(sizes)
  if micro // dp > 1:
    half = micro // 2
    while half % dp:
      half -= 1
    if half >= dp and cfg.data.global_batch_size % half == 0:
      knobs.append(f"data.micro_batch_size={half} (now {micro}; {micro // dp} sequences per chip "
                   "per micro-batch) for fewer activations at the same global batch")
  local_seq = cfg.data.seq_len // sizes["sequence"]
  if local_seq >= 4096 and n % (2 * sizes["sequence"]) == 0:
    knobs.append(f"mesh.sequence={2 * sizes['sequence']} (now {sizes['sequence']}; "
                 f"{local_seq} tokens of each sequence per chip) to split long sequences "
                 "further (ring attention)")
  if not knobs:
    knobs.append("a topology with more chips (the activations of one sequence per chip do not "
                 "fit)")
  return "activations take the memory (train state is only " \
         f"{state_bytes / GiB:.1f} GiB per chip): turn " + ", or ".join(knobs)


@contextlib.contextmanager
def no_persistent_cache():
  """Keep target executables out of JAX's persistent cache: this machine could not load them
  (and reading one back fails noisily), and a later CPU run must not find them."""
  # Whether the cache is used is decided once per process, so in a process that already uses
  # it (tests) the entry is kept out by making no compile slow enough to be written.
  before = (jax.config.jax_enable_compilation_cache,
            jax.config.jax_persistent_cache_min_compile_time_secs)
  jax.config.update("jax_enable_compilation_cache", False)
  jax.config.update("jax_persistent_cache_min_compile_time_secs", 1e9)
  try:
    yield
  finally:
    jax.config.update("jax_enable_compilation_cache", before[0])
    jax.config.update("jax_persistent_cache_min_compile_time_secs", before[1])


def target_mesh(cfg, target: Target, config_name: str = "config") -> tuple[dict, Mesh]:
  """The config validated against the target's devices (as train.py validates against its
  own), and the mesh training builds on them: `sharding.make_mesh`, the one mesh builder (through
  `trainer.step.program.run_mesh`, which adds a DiLoCo run's `replica` axis)."""
  try:
    return validate(cfg, target.devices), run_mesh(cfg, target.devices)
  except ConfigError as e:
    raise AotError(f"{config_name} on {target.name}: {e}") from None


def compile_report(cfg, target: Target, config_name: str = "config") -> Report:
  """Compile the train step of `cfg` for `target`; raise AotError with advice if it fails."""
  sizes, mesh = target_mesh(cfg, target, config_name)
  program = Program(cfg, mesh)
  # Abstract arguments are made outside the mesh context: under a mesh of compile-only devices
  # even creating an abstract optimizer state would try to run on them.
  state = program.abstract_state()
  batch = program.abstract_batch()
  state_bytes = per_device_bytes(state)
  t0 = time.perf_counter()
  try:
    with jax.set_mesh(mesh), no_persistent_cache():
      attention = resolve_impl(cfg.model.attention, mesh.abstract_mesh, dtype=cfg.model.dtype,
                               head_dim=program.model_cfg.dim_per_head,
                               seq_len=cfg.data.seq_len, segments=True)  # training's batches
      lowered = program.jitted_step().lower(state, batch)
      compiled = lowered.compile()
  except Exception as e:  # noqa: BLE001
    if not is_out_of_memory(e):
      raise
    hbm = (f", {target.hbm_bytes / GiB:.0f} GiB HBM per chip" if target.hbm_bytes else "")
    raise AotError(
        f"{config_name} does not fit {target.name} ({len(target.devices)} x {target.kind}{hbm}): "
        f"the compiler says \"{first_line(e, with_type=False)}\"; "
        f"{oom_advice(cfg, sizes, target, state_bytes)}") from None
  seconds = time.perf_counter() - t0
  report = _report(cfg, target, config_name, program, mesh, attention, compiled, seconds,
                   state_bytes, while_loops(lowered))
  text = compiled.as_text() or ""
  ops = collectives(text)
  report.collective_bytes = {kind: total_bytes([op for op in ops if op.kind == kind])
                             for kind in dict.fromkeys(op.kind for op in ops)}
  if program.pipeline is not None:  # the bubble and the bytes between stages, counted
    pipe = program.pipeline
    weights = program.slot_flops() if pipe.explicit else None
    found = pipeline_count(pipe, program.num_micro, text, mesh, weights)
    report.pipeline = {"line": found.line(), **found.row(),
                       "table": found.table.rows() if found.table is not None else []}
    if found.table is not None:  # idle slots (the head, a piece on every stage, has none)
      report.idle_flops = idle_flops(program.model_cfg, cfg.data.seq_len, report.tokens_per_step,
                                     found.bubble, 1 - found.bubble, pipe.remat_stage)
    elif found.ticks is not None:
      report.idle_flops = idle_flops(program.model_cfg, cfg.data.seq_len,
                                     report.tokens_per_step, found.idle, found.busy,
                                     pipe.remat_stage)
  report.compiled = compiled  # not a field (not in the JSON): for callers that read the program
  if program.diloco is not None:  # its outer step, and plain data parallelism's step, compiled
    with no_persistent_cache():
      outer = program.compile_outer()
      report.communication = communication.measure(program, compiled, outer).lines()
    report.outer_step_bytes = compiled_costs(outer).total_bytes
  if report.hbm_bytes and report.total_bytes > report.hbm_bytes:
    # The compiler accepted it, but its own numbers say it cannot be resident at once.
    raise AotError(
        f"{config_name} does not fit {target.name} ({report.chips} x {target.kind}, "
        f"{report.hbm_bytes / GiB:.0f} GiB HBM per chip): the compiled step needs "
        f"{report.total_bytes / GiB:.1f} GiB per chip (temporaries "
        f"{report.temp_bytes / GiB:.1f} GiB); {oom_advice(cfg, sizes, target, state_bytes)}")
  return report


def while_loops(lowered) -> int:
  """The while loops of a lowered program (a layer scan is one): XLA's cost analysis counts a
  loop's body once, so its FLOPs and bytes cover every op only when this is 0."""
  return lowered.as_text().count("stablehlo.while")


def _report(cfg, target, config_name, program, mesh, attention, compiled, seconds,
            state_bytes, loops: int) -> Report:
  costs = compiled_costs(compiled)
  text = compiled.as_text() or ""
  kernel_calls = sum(text.count(f'custom_call_target="{name}"') for name in KERNEL_CALLS)
  model_cfg = program.model_cfg
  seq = cfg.data.seq_len
  tokens = cfg.data.global_batch_size * seq
  return Report(
      config=config_name, topology=target.name, chips=len(target.devices), hosts=target.hosts,
      device_kind=target.kind, mesh=dict(mesh.shape), attention=attention,
      kernel_calls=kernel_calls, params=param_counts(model_cfg)["total"],
      compile_seconds=seconds,
      argument_bytes=costs.argument_bytes, state_bytes=state_bytes,
      temp_bytes=costs.temp_bytes, output_bytes=costs.output_bytes,
      code_bytes=costs.code_bytes, hbm_bytes=target.hbm_bytes,
      model_flops=flops_per_token(model_cfg, seq)["total"] * tokens, xla_flops=costs.xla_flops,
      xla_bytes=costs.xla_bytes, peak_flops=target.peak_flops,
      hbm_bandwidth=target.hbm_bandwidth, tokens_per_step=tokens,
      remat_mfu_bound=remat_mfu_bound(model_cfg, seq, program.pipeline is not None
                                      and program.pipeline.remat_stage),
      kernel_flops=kernel_flops(model_cfg, seq, tokens, kernel_calls), loops=loops)


# ----------------------------------------------------------------------------------------------
# Command line


def build_parser() -> CliParser:
  parser = CliParser("-m tools.aot", __doc__)
  parser.add_argument("--topology", required=True, help="e.g. v5e:2x2, v4:2x2x1, v6e:4x4")
  parser.add_argument("--json", default="", help="also write the report to this JSON file")
  parser.add_argument("--markdown", action="store_true", help="print a docs table row too")
  return parser


def parse_args(argv: list[str]):
  """(options, config overrides); a mistake is a one-line ConfigError."""
  return build_parser().parse(argv)


def main(argv: list[str]) -> int:
  try:
    args, overrides = parse_args(argv)
    name = os.path.splitext(os.path.basename(args.config))[0]
    cfg = load(args.config, overrides)
    target = config_target(cfg, args.topology)  # DiLoCo: a copy of the topology per replica
    report = compile_report(cfg, target, name)
  except (ConfigError, AotError) as e:
    print(f"error: {e}", file=sys.stderr)
    return EXIT_USER_ERROR
  print("\n".join(report.lines()))
  if args.markdown:
    print(report.markdown_row())
  if args.json:
    with open(args.json, "w") as f:
      json.dump(report.to_json(), f, indent=1)
  return 0


if __name__ == "__main__":
  sys.exit(main(sys.argv[1:]))

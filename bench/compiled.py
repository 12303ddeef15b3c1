"""Our train step, the plain jit+optax step and nanodo's, compiled ahead of time for one TPU chip.

    python bench/compiled.py [--nanodo_dir DIR] [--size 3m,25m] [--topology v5e:1x1]
        [--dtypes bfloat16] [--attention xla,auto] [--config.a.b=v ...]

No TPU is needed: libtpu's compiler builds each program for one compile-only chip of
`--topology` (`tools.targets.make_target`), as `tools.aot` does. Per matched model (SIZES of
bench/baseline.py) and compute dtype (`--dtypes`: our `model.dtype`, and the same `dtype` field
of nanodo's config; parameters, optimizer state, norms, softmax and the loss are fp32 in all
three) it compiles:

  * ours: the step `train.py` runs (`trainer.program.Program`, through `tools.aot.compile_report`),
    once per `--attention` (`xla`: the einsum attention the other two also run; `auto`: what
    training picks on TPU, splash attention, a Mosaic kernel);
  * plain: bench/baseline.py's `plain_step` (jit + optax.adamw, the same Transformer module);
  * nanodo: bench/nanodo.py's `Nanodo` (google-deepmind/nanodo's own model, optimizer, loss,
    metrics and train step) when `--nanodo_dir` is a nanodo checkout; otherwise one line says
    why it is skipped.

For each it prints XLA's cost analysis of the compiled program (FLOPs and bytes accessed per
step), its memory (arguments, outputs not aliased to donated inputs, temporaries), the roofline
lower bound on the step time (`tools.roofline.Roofline`: the model's FLOPs at the chip's bf16
peak vs the bytes accessed at its HBM bandwidth; all three models have the same FLOPs per token
to 0.05%, so they share the compute term and differ by their bytes), and ours/plain and
ours/nanodo ratios. Each kind of row ends with a markdown table for docs/performance.md.

Fairness: XLA's cost analysis counts the body of a while loop once. Our layers are a scan, so
ours and plain (the same module) are compiled with `model.scan_unroll = num_layers`: the scan is
fully unrolled and no layer is in a loop (nanodo's layers are a Python loop). The `loops` column
counts the while loops in each lowered program, so a count that still hides work shows. XLA
does not count the FLOPs inside a Pallas kernel (splash attention) at all, and counts a kernel's
bytes as its operands and results: the `auto` row's FLOPs are low by the attention's, its bytes
are those of the kernel's inputs and outputs rather than of the softmax it keeps on chip.
"""
from __future__ import annotations

import os

os.environ.setdefault("JAX_PLATFORMS", "cpu")  # compile only: no step runs here
os.environ.setdefault("ALLOW_MULTIPLE_LIBTPU_LOAD", "1")  # as tools/aot.py

import dataclasses  # noqa: E402
import sys  # noqa: E402

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, ROOT)
from bench import baseline  # noqa: E402  (SIZES, load_sized, plain_step)
from bench import nanodo as nanodo_bench  # noqa: E402

MiB = 2**20


@dataclasses.dataclass
class Row:
  """One compiled step: XLA's cost analysis and memory analysis, and its roofline."""
  name: str
  flops: float | None  # XLA's cost analysis, per step
  bytes: float | None  # XLA's "bytes accessed", per step
  argument_bytes: int
  output_bytes: int  # outputs not aliased to donated inputs
  temp_bytes: int
  loops: int  # while loops in the lowered program (their bodies are counted once)
  roofline: object  # tools.roofline.Roofline
  kernel_calls: int = 0

  def cells(self) -> list[str]:
    r = self.roofline
    return [self.name, f"{self.flops / 1e9:,.4g}" if self.flops else "?",
            f"{self.bytes / 1e9:,.4g}" if self.bytes else "?",
            f"{self.argument_bytes / MiB:,.1f}", f"{self.output_bytes / MiB:,.1f}",
            f"{self.temp_bytes / MiB:,.1f}", str(self.loops),
            f"{r.seconds * 1e3:,.3f}" if r.seconds else "?",
            ("memory" if r.seconds > r.compute_seconds else "compute") if r.seconds else "?",
            f"{r.mfu:.0%}" if r.mfu else "?"]


HEADER = ["step", "XLA GFLOPs", "GB accessed", "args MiB", "out MiB", "temp MiB", "loops",
          "roofline ms", "bound", "MFU <="]


def one_chip(topology: str):
  """A compile-only target of one chip of `topology` (its first device)."""
  from tools.targets import Target, make_target  # noqa: PLC0415
  target = make_target(topology)
  if len(target.devices) == 1:
    return target
  return Target(f"1 chip of {topology}", target.devices[:1])


def _abstract(tree, device):
  """ShapeDtypeStructs of `tree`'s arrays, placed on the compile-only `device`."""
  import jax  # noqa: PLC0415
  sharding = jax.sharding.SingleDeviceSharding(device)
  return jax.tree.map(lambda x: jax.ShapeDtypeStruct(x.shape, x.dtype, sharding=sharding), tree)


def compiled_row(name: str, lowered, target, ours_report) -> Row:
  """Compile `lowered` for the target and read its costs, as tools.aot reads ours."""
  from tools import aot  # noqa: PLC0415
  from tools.roofline import Roofline  # noqa: PLC0415
  with aot.no_persistent_cache():  # target executables stay out of the cache
    costs = aot.compiled_costs(lowered.compile())
  # The same model FLOPs as ours (nanodo's GELU MLP of 4 d has SwiGLU's of 2/3 x 4 d to 0.05%),
  # no rematerialisation (plain: our model_cfg, remat "none"; nanodo: remat False), no kernels.
  roofline = Roofline(device_kind=target.kind, chips=1, model_flops=ours_report.model_flops,
                      tokens_per_step=ours_report.tokens_per_step, remat_mfu_bound=1.0,
                      peak_flops=target.peak_flops, hbm_bandwidth=target.hbm_bandwidth,
                      xla_flops=costs.xla_flops or None, xla_bytes=costs.xla_bytes)
  return Row(name, costs.xla_flops or None, costs.xla_bytes, costs.argument_bytes,
             costs.output_bytes, costs.temp_bytes, aot.while_loops(lowered), roofline)


def ours_row(cfg, target, label: str) -> tuple[Row, object]:
  """Our step through tools.aot's compile (the one `train.py` runs), and its report."""
  from tools import aot  # noqa: PLC0415
  report = aot.compile_report(cfg, target, label)
  name = f"ours ({report.attention})"
  return Row(name, report.xla_flops, report.xla_bytes, report.argument_bytes,
             report.output_bytes, report.temp_bytes, report.loops, report.roofline,
             report.kernel_calls), report


def plain_row(cfg, target, ours_report) -> Row:
  """bench/baseline.py's plain jit + optax step on our model (attention xla), for the target."""
  import jax  # noqa: PLC0415

  from models.llama import ModelConfig  # noqa: PLC0415
  from sharding.mesh import make_mesh  # noqa: PLC0415
  # its state and tokens made on this machine's CPU; only their shapes go to the target
  plain = baseline.Plain(cfg, ModelConfig.from_config(cfg.model))
  args = _abstract((plain.params, plain.opt_state, plain.inputs, plain.targets),
                   target.devices[0])
  # traced under the target's one-device mesh, as on that machine: the model's choices by
  # platform (models/rope.py's tables) see the target's, not this CPU's
  with jax.set_mesh(make_mesh(cfg.mesh, target.devices[:1])):
    lowered = plain.step.lower(*args)
  return compiled_row("plain", lowered, target, ours_report)


def nanodo_row(cfg, target, ours_report) -> Row:
  """bench/nanodo.py's nanodo step (nanodo's model in `model.dtype`), for the target."""
  from models.llama import ModelConfig  # noqa: PLC0415
  # nanodo's own state, initialised on this machine's CPU; only its shapes go to the target
  theirs = nanodo_bench.Nanodo(cfg, ModelConfig.from_config(cfg.model).vocab_size)
  args = _abstract((theirs.state, theirs.tokens), target.devices[0])
  return compiled_row("nanodo", theirs.step.lower(*args), target, ours_report)


def ratios(ours: Row, other: Row) -> str:
  """ours/other of XLA's FLOPs, bytes accessed and the roofline bound (below 1: ours does less),
  and the throughput ratio that bound allows (above 1: ours can be faster)."""
  f = lambda a, b: f"{a / b:.3f}" if a and b else "?"
  bound, other_bound = ours.roofline.seconds, other.roofline.seconds
  return (f"{ours.name}/{other.name}: FLOPs {f(ours.flops, other.flops)}, bytes accessed "
          f"{f(ours.bytes, other.bytes)}, roofline {f(bound, other_bound)} (bound tokens/s "
          f"ratio {f(other_bound, bound)})")


def table(rows: list[Row]) -> list[str]:
  out = ["| " + " | ".join(HEADER) + " |", "|" + "---|" * len(HEADER)]
  return out + ["| " + " | ".join(row.cells()) + " |" for row in rows]


def compare(label: str, cfg, target, *, dtype: str, attentions: list[str],
            nanodo_skip: str | None) -> list[str]:
  """The rows and ratios of one matched model in one compute dtype (printed as they come)."""
  from tools.targets import first_line  # noqa: PLC0415
  base = cfg.copy_and_resolve_references()
  base.model.update(dtype=dtype, scan_unroll=base.model.num_layers)
  lines = [f"\n{label} in {dtype}: {baseline.describe(base).rsplit(', attention', 1)[0]}; "
           f"model.dtype={dtype} (nanodo dtype={dtype}), params fp32"]
  print(lines[0], flush=True)
  ours, report = [], None
  for attention in attentions:
    run = base.copy_and_resolve_references()
    run.model.attention = attention
    try:
      row, rep = ours_row(run, target, label)
    except Exception as e:  # noqa: BLE001  e.g. a kernel that does not lower: say so
      lines.append(f"  ours (attention={attention}) does not compile for {target.name}: "
                   f"{first_line(e)}")
      print(lines[-1], flush=True)
      continue
    ours.append(row)
    report = report or rep
  if report is None:
    return lines
  base.model.attention = "xla"
  others = [plain_row(base, target, report)]
  if nanodo_skip:
    lines.append(f"  nanodo: skipped ({nanodo_skip})")
  else:
    try:
      others.append(nanodo_row(base, target, report))
    except Exception as e:  # noqa: BLE001
      lines.append(f"  nanodo's step does not compile for {target.name}: {first_line(e)}")
  lines += ["  " + x for x in table(ours + others)]
  for row in ours:
    lines += ["  " + ratios(row, other) for other in others]
  for row in ours:
    if row.kernel_calls:
      lines.append(f"  {row.name}: {row.kernel_calls} Pallas kernel calls, whose FLOPs XLA does "
                   "not count and whose bytes are their operands and results")
  print("\n".join(lines[1:]), flush=True)
  return lines


def build_parser():
  from trainer.cli import CliParser  # noqa: PLC0415
  parser = CliParser("bench/compiled.py", __doc__, config=False)
  parser.add_argument("--nanodo_dir", default="", metavar="DIR",
                      help="a checkout of github.com/google-deepmind/nanodo (else no nanodo row)")
  parser.add_argument("--topology", default="v5e:1x1",
                      help="TPU topology whose first chip the programs are compiled for")
  parser.add_argument("--dtypes", default="bfloat16",
                      help="compute dtypes (model.dtype, nanodo's dtype), comma-separated: "
                      "bfloat16 (default), float32 (each dtype is as many compiles again)")
  parser.add_argument("--attention", default="xla,auto",
                      help="our model.attention values, one row each (plain and nanodo: xla)")
  baseline.add_size_args(parser, "matched models to compile, of " + ", ".join(baseline.SIZES)
                         + " (default both), or none")
  return parser


def main(argv=None) -> int:
  from models.params import DTYPES  # noqa: PLC0415
  from trainer.config import ConfigError  # noqa: PLC0415
  from tools.targets import AotError  # noqa: PLC0415
  try:  # a mistake in the command line, the config or the topology: one line, exit 2
    args, configs = baseline.load_sized(build_parser(), argv)
    dtypes = args.dtypes.split(",")
    for dtype in dtypes:
      if dtype not in DTYPES:
        raise ConfigError(f"--dtypes {dtype!r}: use a comma-separated list of "
                          f"{', '.join(DTYPES)}")
    nanodo_skip = ("no --nanodo_dir given" if not args.nanodo_dir else
                   nanodo_bench.find_nanodo(args.nanodo_dir))
    target = one_chip(args.topology)
  except (ConfigError, AotError) as e:
    print(f"error: {e}", file=sys.stderr)
    return 2
  print(f"target     {target.name}: 1 x {target.kind}, {target.peak_flops / 1e12:.0f} TFLOP/s "
        f"bf16, {target.hbm_bandwidth / 1e9:.0f} GB/s HBM; compile only (libtpu)")
  print("layers     ours and plain with model.scan_unroll = num_layers (no loop: XLA's cost "
        "analysis counts a loop body once); nanodo's are a Python loop; `loops` = while loops "
        "left in the lowered program (0: every op counted; a 1-layer scan is a loop of one trip)")
  for label, cfg in configs:
    for dtype in dtypes:
      compare(label, cfg, target, dtype=dtype, attentions=args.attention.split(","),
              nanodo_skip=nanodo_skip)
  return 0


if __name__ == "__main__":
  sys.exit(main())

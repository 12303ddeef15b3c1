"""Our train step against the plain jit + optax step (and nanodo's), compiled ahead of time for
one chip, and what ours does that the plain step does not, kernel by kernel.

    python bench/compiled.py [--nanodo_dir DIR] [--size 3m,25m] [--topology v5e:1x1]
        [--dtypes bfloat16] [--attention xla,auto] [--config.a.b=v ...]
    python bench/compiled.py --topology h100:1 --size d768-s1024,d768-s2048,d2048-s2048 \\
        --attention auto                                        # issue 34: the GPU programs

No TPU or GPU is needed (one compile-only chip of `--topology`, as `tools.aot`). Per model,
dtype and `--attention` value it compiles ours, plain+docs (the plain step fed our segment ids),
plain (no segment ids) and nanodo's step, and prints each one's FLOPs, bytes, memory, kernel
launches and roofline bound, then the kernel diffs ours vs plain+docs and plain+docs vs plain.
What each program is, how FLOPs and bytes are counted, fairness:
docs/performance.md#the-compiled-programs-compared
"""
from __future__ import annotations

import os

os.environ.setdefault("JAX_PLATFORMS", "cpu")  # compile only: no step runs here
os.environ.setdefault("ALLOW_MULTIPLE_LIBTPU_LOAD", "1")  # as tools/aot.py

import dataclasses  # noqa: E402
import sys  # noqa: E402

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, ROOT)
from bench import baseline  # noqa: E402  (SIZES, SHAPES, load_sized, plain_step)
from bench import nanodo as nanodo_bench  # noqa: E402
from tools.hlo import Module, diff  # noqa: E402
from trainer.config import ConfigError  # noqa: E402
from trainer.config.cli import CliParser  # noqa: E402
from trainer.errors import first_line  # noqa: E402

MiB = 2**20
DIFF_LINES = 12  # kernels listed per side of a diff (the costliest), the rest summed


@dataclasses.dataclass
class Row:
  """One compiled step: its costs and memory, its roofline, and its kernels."""
  name: str
  flops: float | None  # per step: XLA's cost analysis, or the HLO count (`counted`)
  bytes: float | None  # per step, likewise
  argument_bytes: int
  output_bytes: int  # outputs not aliased to donated inputs
  temp_bytes: int
  loops: int  # while loops in the lowered program
  roofline: object  # tools.roofline.Roofline
  kernels: list  # tools.hlo.Kernel, every launch of the step
  kernel_calls: int = 0
  counted: bool = False  # costs counted from the HLO (no cost analysis from the compiler)

  def cells(self) -> list[str]:
    r = self.roofline
    return [self.name, f"{self.flops / 1e9:,.4g}" if self.flops else "?",
            f"{self.bytes / 1e9:,.4g}" if self.bytes else "?",
            f"{self.argument_bytes / MiB:,.1f}", f"{self.output_bytes / MiB:,.1f}",
            f"{self.temp_bytes / MiB:,.1f}", str(self.loops),
            str(sum(k.trips for k in self.kernels)),
            f"{r.seconds * 1e3:,.3f}" if r.seconds else "?",
            ("memory" if r.seconds > r.compute_seconds else "compute") if r.seconds else "?",
            f"{r.mfu:.0%}" if r.mfu else "?"]


HEADER = ["step", "GFLOPs", "GB accessed", "args MiB", "out MiB", "temp MiB", "loops",
          "launches", "roofline ms", "bound", "MFU <="]


def one_chip(topology: str):
  """A compile-only target of one chip of `topology` (its first device)."""
  from tools.targets import Target, make_target  # noqa: PLC0415  start-up
  target = make_target(topology)
  if len(target.devices) == 1:
    return target
  return Target(f"1 chip of {topology}", target.devices[:1])


def _abstract(tree, device):
  """ShapeDtypeStructs of `tree`'s arrays, placed on the compile-only `device`."""
  import jax  # noqa: PLC0415  start-up
  sharding = jax.sharding.SingleDeviceSharding(device)
  return jax.tree.map(lambda x: jax.ShapeDtypeStruct(x.shape, x.dtype, sharding=sharding), tree)


def _row(name: str, compiled, loops: int, target, ours_report, kernel_calls: int = 0,
         remat_bound: float = 1.0) -> Row:
  """A compiled step's costs: XLA's cost analysis where given, else counted from its HLO."""
  from tools import aot  # noqa: PLC0415  start-up
  from tools.roofline import Roofline  # noqa: PLC0415  start-up
  costs = aot.compiled_costs(compiled)
  kernels = Module(compiled.as_text()).kernels()
  counted = not costs.xla_bytes
  flops = sum(k.total_flops for k in kernels) if counted else costs.xla_flops or None
  nbytes = sum(k.bytes for k in kernels) if counted else costs.xla_bytes
  roofline = Roofline(device_kind=target.kind, chips=1, model_flops=ours_report.model_flops,
                      tokens_per_step=ours_report.tokens_per_step, remat_mfu_bound=remat_bound,
                      peak_flops=target.peak_flops, hbm_bandwidth=target.hbm_bandwidth,
                      xla_flops=flops, xla_bytes=nbytes)
  return Row(name, flops, nbytes, costs.argument_bytes, costs.output_bytes, costs.temp_bytes,
             loops, roofline, kernels, kernel_calls, counted)


def ours_row(cfg, target, label: str) -> tuple[Row, object]:
  """Our step through tools.aot's compile (the one `train.py` runs), and its report."""
  from tools import aot  # noqa: PLC0415  start-up
  report = aot.compile_report(cfg, target, label)
  row = _row(f"ours ({report.attention})", report.compiled, report.loops, target, report,
             report.kernel_calls, report.remat_mfu_bound)
  return row, report


def plain_row(cfg, target, ours_report, *, documents: bool) -> Row:
  """bench/baseline.py's plain jit + optax step on our model (`documents`: fed the segment ids
  ours is fed), compiled for the target."""
  import jax  # noqa: PLC0415  start-up

  from models.llama import ModelConfig  # noqa: PLC0415  start-up
  from sharding.mesh import make_mesh  # noqa: PLC0415  start-up
  from tools import aot  # noqa: PLC0415  start-up
  from models.attention import resolve_impl  # noqa: PLC0415  start-up
  # its state and tokens made on this machine's CPU; only their shapes go to the target
  plain_model = ModelConfig.from_config(cfg.model)
  plain = baseline.Plain(cfg, plain_model, documents=documents)
  args = _abstract((plain.params, plain.opt_state, *plain.args()), target.devices[0])
  # traced under the target's one-device mesh, as on that machine: the model's choices by
  # platform (attention, RoPE tables) see the target's, not this CPU's
  with jax.set_mesh(make_mesh(cfg.mesh, target.devices[:1])):
    lowered = plain.step.lower(*args)
    # the attention it runs: `auto` chooses by whether there are segment ids
    attention = resolve_impl(cfg.model.attention, dtype=cfg.model.dtype,
                             head_dim=plain_model.dim_per_head, seq_len=cfg.data.seq_len,
                             segments=documents)
  with aot.no_persistent_cache():  # target executables stay out of the cache
    compiled = lowered.compile()
  name = f"plain{'+docs' if documents else ''} ({attention})"
  return _row(name, compiled, aot.while_loops(lowered), target, ours_report,
              remat_bound=ours_report.remat_mfu_bound)


def nanodo_row(cfg, target, ours_report) -> Row:
  """bench/nanodo.py's nanodo step (nanodo's model in `model.dtype`), for the target."""
  from models.llama import ModelConfig  # noqa: PLC0415  start-up
  from tools import aot  # noqa: PLC0415  start-up
  # nanodo's own state, initialised on this machine's CPU; only its shapes go to the target
  theirs = nanodo_bench.Nanodo(cfg, ModelConfig.from_config(cfg.model).vocab_size)
  lowered = theirs.step.lower(*_abstract((theirs.state, theirs.tokens), target.devices[0]))
  with aot.no_persistent_cache():
    compiled = lowered.compile()
  return _row("nanodo", compiled, aot.while_loops(lowered), target, ours_report)


def ratios(ours: Row, other: Row) -> str:
  """ours/other of FLOPs, bytes and the roofline bound (below 1: ours does less), and the
  throughput ratio that bound allows (above 1: ours can be faster)."""
  f = lambda a, b: f"{a / b:.3f}" if a and b else "?"
  bound, other_bound = ours.roofline.seconds, other.roofline.seconds
  return (f"{ours.name}/{other.name}: FLOPs {f(ours.flops, other.flops)}, bytes accessed "
          f"{f(ours.bytes, other.bytes)}, roofline {f(bound, other_bound)} (bound tokens/s "
          f"ratio {f(other_bound, bound)})")


def table(rows: list[Row]) -> list[str]:
  out = ["| " + " | ".join(HEADER) + " |", "|" + "---|" * len(HEADER)]
  return out + ["| " + " | ".join(row.cells()) + " |" for row in rows]


def kernel_diff(a: Row, b: Row, target, title: str) -> list[str]:
  """The kernels `a` launches that `b` does not and the other way round (`tools.hlo.diff`),
  the costliest first, with their bytes, FLOPs and time at the chip's rates."""
  peak, bandwidth = target.peak_flops, target.hbm_bandwidth
  out = [f"  {a.name} vs {b.name}: {title}"]
  sides = diff(a.kernels, b.kernels)
  for name, kernels in zip((a.name, b.name), sides):
    seconds = lambda k: k.seconds(peak, bandwidth)
    kernels = sorted(kernels, key=seconds, reverse=True)
    total = sum(map(seconds, kernels))
    out.append(f"    only in {name}: {sum(k.trips for k in kernels)} launches, "
               f"{sum(k.bytes for k in kernels) / 1e6:,.1f} MB, "
               f"{sum(k.total_flops for k in kernels) / 1e9:,.1f} GFLOP, {total * 1e6:,.1f} us "
               f"at the roofline ({total / a.roofline.seconds:.2%} of {a.name}'s bound)"
               if a.roofline.seconds else "")
    for k in kernels[:DIFF_LINES]:
      out.append(f"      {seconds(k) * 1e6:9.1f} us  x{k.trips:<3} {k.bytes / 1e6:10.1f} MB "
                 f"{k.total_flops / 1e9:8.1f} GF  {k.describe()}")
    if len(kernels) > DIFF_LINES:
      rest = kernels[DIFF_LINES:]
      out.append(f"      ... and {len(rest)} more ({sum(map(seconds, rest)) * 1e6:,.1f} us, "
                 f"{sum(k.bytes for k in rest) / 1e6:,.2f} MB)")
  net = lambda f: sum(map(f, sides[0])) - sum(map(f, sides[1]))
  launches = net(lambda k: k.trips)
  out.append(f"    net: {a.name} {launches:+d} launches, {net(lambda k: k.bytes) / 1e6:+,.1f} MB, "
             f"{net(lambda k: k.seconds(peak, bandwidth)) * 1e6:+,.1f} us at the roofline")
  return out


def compare(label: str, cfg, target, *, dtype: str, attentions: list[str],
            nanodo_skip: str | None) -> list[str]:
  """The rows, ratios and kernel diffs of one model in one compute dtype (printed as they
  come)."""
  base = cfg.copy_and_resolve_references()
  base.model.dtype = dtype
  if target.platform == "tpu":  # XLA's cost analysis: no layer in a loop (module docstring)
    base.model.scan_unroll = base.model.num_layers
  lines = [f"\n{label} in {dtype}: {baseline.describe(base).rsplit(', attention', 1)[0]}; "
           f"model.dtype={dtype} (nanodo dtype={dtype}), params fp32"]
  print(lines[0], flush=True)
  rows, groups, report = [], [], None
  for attention in attentions:
    run = base.copy_and_resolve_references()
    run.model.attention = attention
    try:
      ours, rep = ours_row(run, target, label)
    except Exception as e:  # noqa: BLE001  e.g. a kernel that does not lower: say so
      lines.append(f"  ours (attention={attention}) does not compile for {target.name}: "
                   f"{first_line(e, with_type=False)}")
      print(lines[-1], flush=True)
      continue
    report = report or rep
    docs = plain_row(run, target, rep, documents=True)
    plain = plain_row(run, target, rep, documents=False)
    rows += [ours, docs, plain]
    groups.append((ours, docs, plain))
  if report is None:
    return lines
  if nanodo_skip:
    lines.append(f"  nanodo: skipped ({nanodo_skip})")
  else:
    try:
      xla = base.copy_and_resolve_references()
      xla.model.attention = "xla"
      rows.append(nanodo_row(xla, target, report))
    except Exception as e:  # noqa: BLE001
      lines.append(f"  nanodo's step does not compile for {target.name}: {first_line(e, with_type=False)}")
  lines += ["  " + x for x in table(rows)]
  for ours, docs, plain in groups:
    lines += ["  " + ratios(ours, docs), "  " + ratios(ours, plain)]
    if rows[-1].name == "nanodo" and ours.name == "ours (xla)":
      lines.append("  " + ratios(ours, rows[-1]))
  for ours, docs, plain in groups:
    lines += kernel_diff(ours, docs, target, "what our step adds to the same model work")
    lines += kernel_diff(docs, plain, target, "what keeping packed documents apart costs")
    if ours.kernel_calls:
      lines.append(f"  {ours.name}: {ours.kernel_calls} Pallas kernel calls, whose FLOPs XLA "
                   "does not count and whose bytes are their operands and results")
  print("\n".join(lines[1:]), flush=True)
  return lines


def build_parser():
  parser = CliParser("bench/compiled.py", __doc__, config=False)
  parser.add_argument("--nanodo_dir", default="", metavar="DIR",
                      help="a checkout of github.com/google-deepmind/nanodo (else no nanodo row)")
  parser.add_argument("--topology", default="v5e:1x1",
                      help="TPU topology whose first chip the programs are compiled for, or "
                      "h100:1 (jax's CUDA plugin)")
  parser.add_argument("--dtypes", default="bfloat16",
                      help="compute dtypes (model.dtype, nanodo's dtype), comma-separated: "
                      "bfloat16 (default), float32 (each dtype is as many compiles again)")
  parser.add_argument("--attention", default="xla,auto",
                      help="model.attention values, ours and the plain steps each (nanodo: xla)")
  baseline.add_size_args(parser, "models to compile, of " + ", ".join(SIZES)
                         + " (default 3m,25m), or none")
  return parser


SIZES = {**baseline.SIZES, **baseline.SHAPES}  # the matched models and issue 25's shapes


def main(argv=None) -> int:
  from models.params import DTYPES  # noqa: PLC0415  start-up
  from tools.targets import AotError  # noqa: PLC0415  start-up
  try:  # a mistake in the command line, the config or the topology: one line, exit 2
    args, configs = baseline.load_sized(build_parser(), argv, sizes=SIZES)
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
  compiler = "libtpu" if target.platform == "tpu" else "jax's CUDA plugin"
  print(f"target     {target.name}: 1 x {target.kind}, {target.peak_flops / 1e12:.0f} TFLOP/s "
        f"bf16, {target.hbm_bandwidth / 1e9:.0f} GB/s HBM; compile only ({compiler})")
  if target.platform == "tpu":
    print("layers     ours and plain with model.scan_unroll = num_layers (no loop: XLA's cost "
          "analysis counts a loop body once); nanodo's are a Python loop; `loops` = while loops "
          "left in the lowered program (0: every op counted)")
  else:
    print("costs      counted from the optimized HLO (tools/hlo.py: matmul FLOPs, every loop "
          "trip; no cost analysis for a program compiled without its GPU)")
  for label, cfg in configs:
    for dtype in dtypes:
      compare(label, cfg, target, dtype=dtype, attentions=args.attention.split(","),
              nanodo_skip=nanodo_skip)
  return 0


if __name__ == "__main__":
  sys.exit(main())

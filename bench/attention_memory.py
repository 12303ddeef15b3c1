"""Per-device attention memory of ring attention vs unsharded attention, and causal work balance.

  python bench/attention_memory.py                      # about 8 minutes on 2 busy CPU cores
  python bench/attention_memory.py --seq 2048,4096 --devices 2,4 --budget-mib 0   # quicker
  python bench/attention_memory.py --target h100:8 [--kv-heads 2]   # compiled for GPUs, ~1.5 min

Nothing is run: every number is XLA's buffer assignment of the compiled program, per device, on
8 fake CPU devices (or compile-only H100s with `--target`): `temp` (what the program allocates
besides its arguments and outputs) and `total`, forward and forward+backward, for ring(jnp) vs
xla, ring(jnp) vs the same jnp blocks on 1 device, and ring(flash) vs flash. Target: ring per
device <= 1.5/N x unsharded ("xN" <= 1.5). Then the longest causal sequence that fits a
per-device budget, unsharded vs ring on 8 devices, and the causal work balance of the zig-zag
layout (max/min FLOPs per device; target <= 1.1) vs the contiguous one. Batch 1, 8 heads, head
dim 64, fp32, causal. What each comparison measures: docs/attention.md#memory-per-device
"""
from __future__ import annotations

import os
import sys
import time

os.environ["XLA_FLAGS"] = (os.environ.get("XLA_FLAGS", "") +
                           " --xla_force_host_platform_device_count=8").strip()
os.environ.setdefault("JAX_PLATFORMS", "cpu")
sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

import jax  # noqa: E402
import jax.numpy as jnp  # noqa: E402
from jax.sharding import AxisType, NamedSharding  # noqa: E402
from jax.sharding import PartitionSpec as P  # noqa: E402

from kernels import flash_attention  # noqa: E402
from models.attention import xla_attention  # noqa: E402
from sharding import ring_attention, ring_work  # noqa: E402
from tools.aot import gpu_target  # noqa: E402
from trainer.config import ConfigError  # noqa: E402
from trainer.config.cli import CliParser  # noqa: E402

HEADS, HEAD_DIM, DTYPE = 8, 64, jnp.float32
MiB = 2 ** 20
TARGET = 1.5
# What the programs are compiled for: 8 fake CPU devices (the kernel interpreted), or with
# --target the compile-only GPUs of tools/aot.py (the kernel compiled through Triton).
_target = {"devices": None, "gpu": False, "kv_heads": HEADS, "head_chunks": 1}


def _devices(n: int):
  return (_target["devices"] or jax.devices())[:max(n, 1)]


def _attention(impl: str, n: int):
  """Causal attention by `impl`: "xla" / "flash" unsharded (n = 0), or ring attention over n
  devices with "jnp" / "flash" blocks (n = 1 is the same blocks on one device, no ring)."""
  interpret = not _target["gpu"]
  if n == 0:
    if impl == "xla":
      return lambda q, k, v: xla_attention(q, k, v, causal=True)
    return lambda q, k, v: flash_attention(q, k, v, causal=True, interpret=interpret)
  mesh = jax.make_mesh((n,), ("sequence",), axis_types=(AxisType.Auto,), devices=_devices(n))
  return lambda q, k, v: ring_attention(q, k, v, mesh=mesh, causal=True, layout="zigzag",
                                        impl=impl, interpret=interpret,
                                        head_chunks=_target["head_chunks"])


def memory(seq_len: int, impl: str, n: int, backward: bool) -> dict[str, int]:
  """Per-device bytes of the compiled attention program (see `_attention` for impl, n)."""
  q_sds = jax.ShapeDtypeStruct((1, seq_len, HEADS, HEAD_DIM), DTYPE)
  kv_sds = jax.ShapeDtypeStruct((1, seq_len, _target["kv_heads"], HEAD_DIM), DTYPE)
  fn = _attention(impl, n)
  kwargs, lower = {}, {}
  if n > 1 or _target["gpu"]:  # on the GPU target, also place the unsharded program there
    mesh = jax.make_mesh((max(n, 1),), ("sequence",), axis_types=(AxisType.Auto,),
                         devices=_devices(n))
    sharding = NamedSharding(mesh, P(None, "sequence" if n > 1 else None))
    kwargs = {"in_shardings": (sharding,) * (4 if backward else 3),
              "out_shardings": (sharding,) * 3 if backward else sharding}
  if _target["gpu"]:
    lower = {"lowering_platforms": ("cuda",)}
  if backward:
    attend = fn

    def fn(q, k, v, do):
      _, vjp = jax.vjp(attend, q, k, v)
      return vjp(do)

  args = (q_sds, kv_sds, kv_sds, q_sds)[:4 if backward else 3]
  stats = jax.jit(fn, **kwargs).trace(*args).lower(**lower).compile().memory_analysis()
  temp = stats.temp_size_in_bytes
  total = (temp + stats.argument_size_in_bytes + stats.output_size_in_bytes -
           stats.alias_size_in_bytes)
  return {"temp": temp, "total": total}


COMPARISONS = {  # name: (baseline (impl, n), ring block impl)
    "ring(jnp) vs xla": (("xla", 0), "jnp"),
    "ring(jnp) vs jnp on 1 device": (("jnp", 1), "jnp"),
    "ring(flash) vs flash": (("flash", 0), "flash"),
}


def table(name, seqs, devices) -> dict[str, float]:
  """Print one comparison; -> the worst ratio x N for temp and for total."""
  (base_impl, base_n), ring_impl = COMPARISONS[name]
  print(f"\n## {name}: per-device MiB, and ring / unsharded x N (target <= {TARGET})")
  print(f"{'pass':>8} {'S':>6} {'unsharded temp/total':>22} " +
        " ".join(f"{f'N={n} temp/total':>18} {'xN temp/total':>14}" for n in devices))
  worst = {"temp": 0.0, "total": 0.0}
  for backward in (False, True):
    for S in seqs:
      base = memory(S, base_impl, base_n, backward)
      row = f"{'fwd+bwd' if backward else 'fwd':>8} {S:>6} "
      row += f"{base['temp'] / MiB:>10.1f} /{base['total'] / MiB:>9.1f} "
      for n in devices:
        ring = memory(S, ring_impl, n, backward)
        xn = {key: n * ring[key] / base[key] for key in worst}
        worst = {key: max(worst[key], xn[key]) for key in worst}
        row += (f"{ring['temp'] / MiB:>8.1f} /{ring['total'] / MiB:>8.1f} "
                f"{xn['temp']:>6.2f} /{xn['total']:>6.2f} ")
      print(row, flush=True)
  if base_impl == "flash" and not _target["gpu"]:
    operand = max(seqs) * HEADS * HEAD_DIM * jnp.dtype(DTYPE).itemsize
    print(f"unsharded flash temp at S={max(seqs)}: fwd "
          f"{memory(max(seqs), 'flash', 0, False)['temp'] / operand:.2f}, fwd+bwd "
          f"{memory(max(seqs), 'flash', 0, True)['temp'] / operand:.2f} x one [S, H, D] operand "
          "(mostly the interpreter's copies of its operands)")
  if _target["gpu"]:  # a compiled kernel's temp is its lse: no ring can be near it
    print(f"worst temp ratio x N: {worst.pop('temp'):.0f} (not judged: unsharded flash temp is "
          "only its lse)")
  for key, value in worst.items():
    print(f"worst {key} ratio x N: {value:.2f} -> {'PASS' if value <= TARGET else 'FAIL'}")
  return worst


def longest_fitting(impl: str, n: int, budget: int, granule: int) -> int:
  """Largest multiple of `granule` whose forward+backward `total` fits `budget` bytes."""
  fits = lambda S: memory(S, impl, n, True)["total"] <= budget
  lo, hi = 0, granule
  while fits(hi):
    lo, hi = hi, 2 * hi
  while hi - lo > max(granule, lo // 16):  # bisect to ~6%
    mid = (lo + hi) // 2 // granule * granule
    lo, hi = (mid, hi) if fits(mid) else (lo, mid)
  return lo


def build_parser():
  parser = CliParser("bench/attention_memory.py", __doc__, config=False)
  parser.add_argument("--seq", default="2048,4096,8192,16384")
  parser.add_argument("--devices", default="2,4,8")
  parser.add_argument("--budget-mib", type=int, default=1024, help="0: skip the budget search")
  parser.add_argument("--kv-heads", type=int, default=HEADS,
                      help=f"kv heads (grouped-query attention when < {HEADS})")
  parser.add_argument("--head-chunks", type=int, default=1,
                      help="ring attention's head_chunks: one ring per chunk of kv heads")
  parser.add_argument("--target", default="cpu",
                      help="cpu: 8 fake CPU devices; or a GPU topology of tools/aot.py, e.g. "
                           "h100:8, compile-only (the flash comparison only)")
  return parser


def main(argv=None):
  parser = build_parser()
  try:
    args = parser.parse_args(argv)
    try:
      seqs = [int(s) for s in args.seq.split(",")]
      devices = [int(n) for n in args.devices.split(",")]
    except ValueError as e:
      parser.error(f"--seq / --devices take comma-separated integers ({e})")
  except ConfigError as e:
    print(f"error: {e}", file=sys.stderr)
    return 2
  _target.update(kv_heads=args.kv_heads, head_chunks=args.head_chunks)
  comparisons = list(COMPARISONS)
  where = f"{jax.device_count()} {jax.default_backend()} devices"
  if args.target != "cpu":
    target = gpu_target(args.target)
    _target.update(devices=target.devices, gpu=True)
    comparisons = ["ring(flash) vs flash"]
    where = f"{args.target} (compile-only, {target.devices[0].device_kind})"
  start = time.time()
  print(f"jax {jax.__version__}, {where}; batch 1, {HEADS} heads, {args.kv_heads} kv heads, "
        f"head dim {HEAD_DIM}, {jnp.dtype(DTYPE).name}, causal; ring head chunks "
        f"{args.head_chunks}")

  verdicts = {name: table(name, seqs, devices) for name in comparisons}

  if args.budget_mib:
    budget = args.budget_mib * MiB
    n = max(devices)
    print(f"\n## longest causal sequence whose attention fwd+bwd fits {args.budget_mib} MiB "
          "per device (total)")
    for name in comparisons:
      (base_impl, base_n), ring_impl = COMPARISONS[name]
      alone = longest_fitting(base_impl, base_n, budget, granule=1024)
      ring = longest_fitting(ring_impl, n, budget, granule=256 * n)
      print(f"{name:>30}: unsharded {alone:>8}   ring on {n} devices {ring:>8}   "
            f"x{ring / max(alone, 1):.1f}", flush=True)

  print("\n## causal work per device (attention FLOPs ~ query-key pairs), max/min "
        "(target <= 1.1)")
  for n in devices:
    for layout in ("zigzag", "contiguous"):
      work = ring_work(max(seqs), n, layout=layout)
      needed, computed = work["needed"], work["computed"]
      print(f"N={n} {layout:>10}: needed {needed.max() / needed.min():6.3f}   "
            f"computed {computed.max() / computed.min():6.3f}")
  print(f"\n## summary: worst ring / unsharded x N (target <= {TARGET})")
  for name, worst in verdicts.items():
    print(f"{name}: " + ", ".join(
        f"{key} {value:.2f} {'PASS' if value <= TARGET else 'FAIL'}" for key, value in worst.items()))
  print(f"{time.time() - start:.0f} s")


if __name__ == "__main__":
  sys.exit(main())

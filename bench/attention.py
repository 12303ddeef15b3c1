"""Attention kernels timed against each other: our Pallas flash kernel vs cuDNN's fused
attention vs XLA, forward and forward + backward, causal.

    python bench/attention.py                       # on a GPU: issue 25's grid (~2 minutes)
    python bench/attention.py --seq 128 --head-dim 32 --heads 4 --kv-heads 4,2 --tokens 512
        # on a CPU: tiny, the flash kernel interpreted, cuDNN skipped (tests run this)
    python bench/attention.py --flash-tiles 128x64/64x64,64x64/64x64 ...   # tile A/B

Implementations (`--impls`): flash (as `model.attention=flash` picks it here), flash_triton
(with `--flash-tiles` variants), cudnn (GPU only; elsewhere skipped, the reason printed), xla.
For every case of `--seq`, `--head-dim`, `--kv-heads` and `--packed`, each implementation is
checked against an fp32 reference on a slice (reported WRONG and not timed past 5e-2 in
bf16/fp16, 1e-3 in fp32), then timed; prints milliseconds, the ratios flash/cudnn and flash/xla
(> 1: ours faster) and the fastest per case, the table `models/attention.py:choose_impl`'s GPU
rule is written from. Details: docs/performance.md#attention-kernels-timed
"""
from __future__ import annotations

import itertools
import math
import os
import statistics
import sys
import time

import numpy as np

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
from trainer.config import ConfigError  # noqa: E402
from trainer.config.cli import CliParser  # noqa: E402
from trainer.multihost import platforms  # noqa: E402

IMPLS = ("flash", "flash_triton", "cudnn", "xla")
CHECK_ROWS = 256  # queries of the first sequence each implementation is checked on (the last)


def build_parser():
  import jax  # noqa: PLC0415  start-up

  gpu = jax.default_backend() == "gpu"
  p = CliParser("bench/attention.py", __doc__, config=False)

  def ints(text):  # comma-separated integers (argparse reports a ValueError in one line)
    return [int(x) for x in text.split(",") if x]

  p.add_argument("--seq", type=ints, default=[2048, 4096, 8192] if gpu else [128])
  p.add_argument("--head-dim", type=ints, default=[64, 128] if gpu else [32])
  p.add_argument("--heads", type=int, default=16 if gpu else 4)
  p.add_argument("--kv-heads", type=ints, default=None,
                 help="kv heads per case (default: --heads and --heads/4, MHA and GQA)")
  p.add_argument("--packed", default="none,docs", help="none, docs or both (comma-separated)")
  p.add_argument("--tokens", type=int, default=16384 if gpu else 512,
                 help="tokens per call (batch = tokens / seq)")
  p.add_argument("--dtype", default="bfloat16", choices=("bfloat16", "float16", "float32"))
  p.add_argument("--impls", default=",".join(IMPLS))
  p.add_argument("--flash-tiles", default="", metavar="BQxBK/BQBxBKB,...",
                 help="extra flash variants with these tiles (forward / backward)")
  p.add_argument("--reps", type=int, default=5 if gpu else 2)
  p.add_argument("--calls", type=int, default=10 if gpu else 1)
  return p


def parse(argv):
  """The options; a mistake raises ConfigError (one line)."""
  p = build_parser()
  args, overrides = p.parse(argv)
  if overrides:
    p.error("this bench takes no --config.* overrides")
  args.kv_heads = args.kv_heads or sorted({args.heads, max(1, args.heads // 4)}, reverse=True)
  args.packed = [x for x in args.packed.split(",") if x]
  impls = [x for x in args.impls.split(",") if x]
  bad = [x for x in impls if x not in IMPLS] + [x for x in args.packed
                                                 if x not in ("none", "docs")]
  bad += [k for k in args.kv_heads if args.heads % k]
  if bad or not impls:
    p.error(f"unknown or invalid {bad}: --impls of {', '.join(IMPLS)}, --packed of none, "
            "docs, --kv-heads dividing --heads")
  args.variants = {name: None for name in impls}
  for spec in (x for x in args.flash_tiles.split(",") if x):
    try:
      fwd, bwd = spec.split("/")
      (bq, bk), (bqb, bkb) = (map(int, fwd.split("x")), map(int, bwd.split("x")))
    except ValueError:
      p.error(f"--flash-tiles {spec!r}: expected BQxBK/BQBxBKB, e.g. 128x64/64x64")
    args.variants[f"flash_triton {spec}"] = (bq, bk, bqb, bkb)
  return args


def segment_ids(batch: int, seq: int, seed: int):
  """[B, S] ids of packed documents of random lengths (>= 64 tokens, or the whole row)."""
  rng = np.random.default_rng(seed)
  ids = np.zeros((batch, seq), np.int32)
  for row in ids:
    cuts = np.sort(rng.choice(np.arange(64, seq, 64), size=min(3, seq // 64 - 1),
                              replace=False)) if seq >= 128 else []
    for i, (start, stop) in enumerate(zip([0, *cuts], [*cuts, seq])):
      row[start:stop] = i + 1
  return ids


def implementation(name: str, tiles, dtype=None, head_dim: int | None = None):
  """(fn(q, k, v, seg) -> out, None) or (None, why it cannot run here)."""
  import jax  # noqa: PLC0415  start-up

  from kernels import BlockSizes, flash_attention, flash_attention_mosaic  # noqa: PLC0415  start-up
  from models.attention import choose_impl, cudnn_attention, xla_attention  # noqa: PLC0415  start-up
  if name == "flash":  # our kernel as the model picks it on this device
    capability = getattr(jax.devices()[0], "compute_capability", None)
    chosen = choose_impl("flash", platform=jax.default_backend(), dtype=dtype,
                         head_dim=head_dim,
                         gpu_capability=float(capability) if capability else None)
    if chosen == "flash_mosaic":
      return (lambda q, k, v, seg: flash_attention_mosaic(q, k, v, causal=True,
                                                          segment_ids=seg)), None
  if name == "xla":
    return (lambda q, k, v, seg: xla_attention(q, k, v, segment_ids=seg, causal=True)), None
  if name == "cudnn":
    if jax.default_backend() != "gpu":
      return None, "cuDNN attention needs a GPU"
    return (lambda q, k, v, seg: cudnn_attention(q, k, v, segment_ids=seg, causal=True)), None
  blocks = BlockSizes(*tiles) if tiles else None
  return (lambda q, k, v, seg: flash_attention(q, k, v, causal=True, segment_ids=seg,
                                               block_sizes=blocks)), None


def check_rows(seq: int) -> slice:
  """The query rows the reference is computed for: the last CHECK_ROWS (all when fewer)."""
  return slice(max(seq - CHECK_ROWS, 0), seq)


def attend_rows(q, k, v, seg, rows: slice):
  """Causal softmax attention of queries `rows` of q [1, S, H, D] against keys [0, rows.stop),
  with segment ids [1, S] or None: plain jnp at the precision in force, in fp32."""
  import jax  # noqa: PLC0415  start-up
  import jax.numpy as jnp  # noqa: PLC0415  start-up
  H, K = q.shape[2], k.shape[2]
  q = q[:, rows] * q.shape[3] ** -0.5
  k, v = (jnp.repeat(x[:, :rows.stop], H // K, axis=2) for x in (k, v))
  scores = jnp.einsum("bshd,bthd->bhst", q, k)
  mask = jnp.arange(rows.start, rows.stop)[:, None] >= jnp.arange(rows.stop)[None, :]
  if seg is not None:
    mask = mask & (seg[:, rows, None] == seg[:, None, :rows.stop])[:, None]
  probs = jax.nn.softmax(jnp.where(mask, scores, -jnp.inf), axis=-1)
  return jnp.einsum("bhst,bthd->bshd", probs, v)


def fp32_reference(q, k, v, seg):
  """The fp32 reference on the checked rows of the first sequence (`check_rows`), at the
  highest matmul precision: by default a GPU runs fp32 dots in TF32 and a TPU in bf16 passes,
  which would make the reference as coarse as what it checks."""
  import jax  # noqa: PLC0415  start-up
  rows = check_rows(q.shape[1])
  first = lambda x: None if x is None else x[:1]
  with jax.default_matmul_precision("highest"):  # read when the function is traced, below
    return jax.jit(lambda q, k, v, seg: attend_rows(q, k, v, seg, rows))(
        first(q), first(k), first(v), first(seg))


def time_calls(fn, args, reps: int, calls: int) -> float:
  """Median seconds per call over `reps` timings of `calls` back-to-back calls."""
  import jax  # noqa: PLC0415  start-up
  for _ in range(2):
    jax.block_until_ready(fn(*args))
  times = []
  for _ in range(reps):
    t0 = time.perf_counter()
    for _ in range(calls):
      out = fn(*args)
    jax.block_until_ready(out)
    times.append((time.perf_counter() - t0) / calls)
  return statistics.median(times)


def _check_and_time(fn, inputs, reference, args) -> dict:
  """{"err", "fwd", "fwd+bwd"} of one implementation, or {"skip": why} when its output is off
  the fp32 reference (then it is not timed)."""
  import jax  # noqa: PLC0415  start-up
  import jax.numpy as jnp  # noqa: PLC0415  start-up
  q, k, v, seg, do = inputs
  fwd = jax.jit(fn)
  checked = fwd(q, k, v, seg)[:1, check_rows(q.shape[1])].astype(jnp.float32)
  err = float(jnp.max(jnp.abs(checked - reference)) / jnp.max(jnp.abs(reference)))
  if not err <= (5e-2 if q.dtype.itemsize == 2 else 1e-3):  # NaN too
    return {"skip": f"WRONG: output off the fp32 reference by {err:.1e} (max, relative to the "
                    "largest); not timed"}

  def grads(q, k, v, seg, do):
    _, vjp = jax.vjp(lambda q, k, v: fn(q, k, v, seg), q, k, v)
    return vjp(do)

  return {"err": err, "fwd": time_calls(fwd, (q, k, v, seg), args.reps, args.calls),
          "fwd+bwd": time_calls(jax.jit(grads), inputs, args.reps, args.calls)}


def run_case(args, seq: int, head_dim: int, kv_heads: int, packed: str) -> dict:
  """{impl: {"fwd": s, "fwd+bwd": s, "err": relative error}} or {impl: {"skip": why}}."""
  import jax  # noqa: PLC0415  start-up
  import jax.numpy as jnp  # noqa: PLC0415  start-up

  from models.attention import cudnn_applies  # noqa: PLC0415  start-up
  dtype = jnp.dtype(args.dtype)
  batch = max(1, args.tokens // seq)
  keys = jax.random.split(jax.random.key(seq * 1000 + head_dim * 10 + kv_heads), 4)
  q = jax.random.normal(keys[0], (batch, seq, args.heads, head_dim), jnp.float32)
  k = jax.random.normal(keys[1], (batch, seq, kv_heads, head_dim), jnp.float32)
  v = jax.random.normal(keys[2], (batch, seq, kv_heads, head_dim), jnp.float32)
  do = jax.random.normal(keys[3], q.shape, jnp.float32).astype(dtype)
  seg = None if packed == "none" else jnp.asarray(segment_ids(batch, seq, seq + head_dim))
  reference = fp32_reference(q, k, v, seg)
  q, k, v = (x.astype(dtype) for x in (q, k, v))
  out = {}
  for name, tiles in args.variants.items():
    base = name.split()[0]
    fn, why = implementation(base, tiles, dtype, head_dim)
    if fn is not None and base == "cudnn" and not cudnn_applies(dtype, head_dim, seq):
      fn, why = None, f"cuDNN takes bf16/fp16 and head dims <= 128, not {dtype.name} {head_dim}"
    if fn is None:
      out[name] = {"skip": why}
      continue
    try:
      out[name] = _check_and_time(fn, (q, k, v, seg, do), reference, args)
    except Exception as e:  # noqa: BLE001  (a variant that does not compile, e.g. its tiles)
      out[name] = {"skip": f"failed: {str(e).strip().splitlines()[0][:200]}"}
  return out


def main(argv=None):
  platforms.choose()
  import jax  # noqa: PLC0415  start-up

  try:
    args = parse(argv)
  except ConfigError as e:
    print(f"error: {e}", file=sys.stderr)
    return 2
  print(f"device 1 x {jax.devices()[0].device_kind}; {args.dtype}, causal, {args.heads} heads, "
        f"{args.tokens} tokens per call; median of {args.reps} x {args.calls} calls")
  names = list(args.variants)
  winners, skipped = [], {}
  cols = " ".join(f"{n + ' fwd':>16} {n + ' f+b':>16}" for n in names)
  print(f"{'case':<28} {cols}  {'flash/cudnn f, f+b':>19} {'flash/xla f, f+b':>17}  max err")
  for seq, head_dim, kv_heads, packed in itertools.product(args.seq, args.head_dim,
                                                           args.kv_heads, args.packed):
    heads = "MHA" if kv_heads == args.heads else f"GQA {args.heads}/{kv_heads}"
    case = f"S{seq} D{head_dim} {heads}{' packed' if packed == 'docs' else ''}"
    res = run_case(args, seq, head_dim, kv_heads, packed)
    cells = " ".join(f"{'skip':>16} {'skip':>16}" if "skip" in r else
                     f"{r['fwd'] * 1e3:>13.3f} ms {r['fwd+bwd'] * 1e3:>13.3f} ms"
                     for r in res.values())
    ratio = lambda other: (" ".join(f"{res[other][p] / res['flash'][p]:.2f}"
                                    for p in ("fwd", "fwd+bwd"))
                           if "fwd" in res.get(other, {}) and "fwd" in res.get("flash", {})
                           else "-")
    errors = max((r["err"] for r in res.values() if "err" in r), default=math.nan)
    print(f"{case:<28} {cells}  {ratio('cudnn'):>19} {ratio('xla'):>17}  {errors:.1e}")
    timed = {n: r["fwd+bwd"] for n, r in res.items() if "fwd+bwd" in r}
    winners.append((case, min(timed, key=timed.get), timed))
    skipped.update({f"{n}: skipped ({r['skip']})": None for n, r in res.items() if "skip" in r})
  print("\n".join(skipped))
  print("\nfastest forward + backward per case (the table for choose_impl's GPU rule):")
  for case, best, timed in winners:
    others = ", ".join(f"{n} x{t / timed[best]:.2f}" for n, t in timed.items() if n != best)
    print(f"  {case:<28} {best:<10} ({others})")
  return 0


if __name__ == "__main__":
  sys.exit(main())

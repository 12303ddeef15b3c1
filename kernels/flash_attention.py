"""Flash attention as a Pallas kernel: forward and backward, layout `[batch, seq, heads, dim]`.

FlashAttention (Dao et al. 2022, "FlashAttention: Fast and Memory-Efficient Exact Attention with
IO-Awareness", arXiv:2205.14135) computes softmax(q k^T / sqrt(D)) v one [block_q, block_k] tile
at a time, keeping a running row maximum and normaliser (the online softmax of Milakov &
Gimelshein 2018), so the [S, T] score matrix is never stored and memory is O(S), not O(S^2).
The backward pass recomputes the scores tile by tile from the saved log-sum-exp, as in
FlashAttention-2 (Dao 2023, arXiv:2307.08691): dQ in one kernel (a program per query block,
looping over key blocks), dK and dV in another (a program per key block, looping over query
blocks and over the query heads that share the kv head).

Shapes: q [B, S, H, D], k/v [B, T, K, D] with H a multiple of K (grouped-query attention,
Ainslie et al. 2023: query head h reads kv head h // (H/K), the convention of
`jax.nn.dot_product_attention`); segment ids [B, S] / [B, T] (a query attends only to keys with
the same id); log-sum-exp lse [B, H, S] in natural-log units. `causal` masks key t > query s
(top-left aligned when S != T). Lengths that are not block multiples and head dims that are not
powers of two are zero-padded here, and padded keys are masked by index inside the kernel.

The kernel is written for the GPU (Triton) lowering: power-of-two tiles of at least 16, refs
read with `pl.ds` slices, loops as `lax.fori_loop` with bounds that skip fully masked tiles.
On CPU it runs with `interpret=True` (the default there); on TPU the model's dispatcher uses
jax's splash attention instead (`kernels/splash.py`). It ran on an H200 in issue 25's GPU
session (the GPU tier's checks against an fp32 reference passed). jax deprecates Pallas' Triton
backend: the Mosaic GPU kernel (kernels/flash_mosaic.py) is `model.attention=flash` on Hopper,
and this one `flash_triton` (what `auto` picks on GPU for packed documents until the Mosaic
kernel has been timed; models/attention.py), kept as long as jax keeps the backend.

Two levels of API:
  * `flash_attention(q, k, v, ...)`: differentiable (`jax.custom_vjp`), optionally also
    returning the lse (differentiable too: d lse / d s = p folds into the backward's delta);
  * `forward(...)` / `backward(...)`: one attention block with explicit residuals, in fp32,
    for callers that combine key blocks themselves (ring attention,
    `sharding/ring_attention.py`). With `state=(o, lse)` the forward kernel starts each query
    tile's online softmax from the attention over earlier key blocks instead of from zero and
    returns the updated state in the same buffers (`input_output_aliases`); with
    `grads=(dq, dk, dv)` the backward kernels add into their accumulators the same way. Both
    take dynamic `bounds=(q_start, kv_stop)` and a dynamic `causal` flag: rows < q_start keep
    their state, keys >= kv_stop take no part, and the skipped tiles are not computed. A ring
    step is then one kernel call per pass, with no block output, no merge and no sliced or
    zero-padded copies of its operands. `heads=(first, count)` restricts a carried-state call to
    a range of query heads whose kv heads are all that k and v hold (the other heads of the
    state or dQ are left as they are): ring attention's head chunks.

Carried state and the interpreter. The kernels read a carried state through the aliased
output refs (on GPU the same memory as the input; the interpreter starts the output from the
input), and its input spec is the whole array, never read: Pallas' interpreter, which runs the
grid as an XLA loop carrying every operand, then passes it through untouched, so XLA holds one
buffer of state, as the GPU does. (Mosaic/TPU does not initialise output blocks from memory;
this kernel is not lowered there, see `kernels/splash.py`.)
"""
from __future__ import annotations

import dataclasses
import functools
import math

import jax
import jax.numpy as jnp
from jax import lax
from jax.experimental import pallas as pl
from jax.experimental.pallas import triton as plgpu

LOG2E = math.log2(math.e)  # exp(x) = exp2(x * log2(e)): the kernels work in base 2
LN2 = math.log(2.0)
_MIN_TILE = 16  # Triton's tl.dot needs every tile dimension >= 16


@dataclasses.dataclass(frozen=True)
class BlockSizes:
  """Tile sizes (powers of two, >= 16). Forward: a program per `block_q` queries, looping over
  `block_k` keys. Backward: dQ by `block_q_bwd` query tiles, dK/dV by `block_k_bwd` key tiles.
  The defaults are common Triton flash-attention tiles, not tuned or timed here (the kernel has
  not run on a GPU; tests check them numerically, interpreted); tune per model and device."""
  block_q: int = 128
  block_k: int = 64
  block_q_bwd: int = 64
  block_k_bwd: int = 64


@dataclasses.dataclass(frozen=True)
class _Config:
  """Everything static about one (padded, block-aligned) kernel call."""
  causal: bool
  scale: float
  block_q: int
  block_k: int
  block_q_bwd: int
  block_k_bwd: int
  kv_len: int  # true key length; keys at index >= kv_len are padding
  kv_padded: int  # key length after padding to whole tiles
  interpret: bool


def _tile(block: int, length: int) -> int:
  """A tile no longer than the (power-of-two rounded) sequence it covers."""
  return min(block, max(_MIN_TILE, pl.next_power_of_2(length)))


def _check_blocks(blocks: BlockSizes) -> None:
  for name, size in dataclasses.asdict(blocks).items():
    if size < _MIN_TILE or size & (size - 1):
      raise ValueError(f"BlockSizes.{name}={size}: tiles must be powers of two >= {_MIN_TILE} "
                       "(Triton's block shapes)")


def _check_shapes(q, k, v, seg_q, seg_kv, heads=None) -> None:
  B, S, H, D = q.shape
  if k.ndim != 4 or k.shape != v.shape or k.shape[0] != B or k.shape[3] != D:
    raise ValueError(f"flash attention: q {q.shape} and k {k.shape} / v {v.shape} do not "
                     "match as [B, S, H, D] and [B, T, K, D]")
  first, count = (0, H) if heads is None else heads
  if not (0 <= first and 0 < count and first + count <= H):
    raise ValueError(f"flash attention: heads={heads} is not a range of the {H} query heads")
  if count % k.shape[2]:
    raise ValueError(f"flash attention: {count} query heads are not a multiple of "
                     f"{k.shape[2]} kv heads")
  if first % (count // k.shape[2]):
    raise ValueError(f"flash attention: heads={heads} does not start at a kv head (groups of "
                     f"{count // k.shape[2]} query heads)")
  if (seg_q is None) != (seg_kv is None):
    raise ValueError("flash attention: give segment ids for both queries and keys, or neither")
  if seg_q is not None and (seg_q.shape != (B, S) or seg_kv.shape != (B, k.shape[1])):
    raise ValueError(f"flash attention: segment ids {seg_q.shape} / {seg_kv.shape} do not "
                     f"match [B, S] = {(B, S)} / [B, T] = {(B, k.shape[1])}")


# ----------------------------------------------------------------------------------------------
# Kernels. Refs arrive with the batch and head axes squeezed away (`None` in the BlockSpecs).


def _mask(q_idx, k_idx, seg_q, seg_k, cfg: _Config, bounds=None, rows=False):
  """[bq, bk] boolean mask of allowed (query, key) pairs, or None when nothing is masked.

  bounds: (q_start, kv_stop, causal) of an update call, read from its `bounds` ref: keys
  >= kv_stop take no part, nor (with `rows`) queries < q_start, and `causal` is dynamic."""
  mask = None

  def both(a, b):
    return b if a is None else jnp.logical_and(a, b)

  q_start = kv_stop = None
  if bounds is not None:
    q_start, kv_stop, causal = bounds
    mask = jnp.logical_or(q_idx[:, None] >= k_idx[None, :], causal == 0)
    q_start = q_start if rows else None
  if cfg.causal:
    mask = both(mask, q_idx[:, None] >= k_idx[None, :])
  if kv_stop is not None:  # also masks padded keys: kv_stop <= kv_len
    mask = both(mask, (k_idx < kv_stop)[None, :])
  elif cfg.kv_len < cfg.kv_padded:
    mask = both(mask, (k_idx < cfg.kv_len)[None, :])
  if q_start is not None:
    mask = both(mask, (q_idx >= q_start)[:, None])
  if seg_q is not None:
    mask = both(mask, seg_q[:, None] == seg_k[None, :])
  return mask


def _unpack(refs, *groups):
  """Split a kernel's refs into consecutive groups of the given sizes (0: a group of Nones)."""
  refs, out = list(refs), []
  for size, width in groups:
    out.append(tuple(refs[:size]) if size else (None,) * width)
    refs = refs[size:]
  assert not refs, refs
  return out


def _update_tiles(num_kv, qi, bq: int, bk: int, bounds):
  """Key tiles a query tile loops over in an update call: none for a tile of kept rows, none
  at or past kv_stop, and with causal none past the tile's last row."""
  q_start, kv_stop, causal = bounds
  num_kv = jnp.minimum(lax.div(kv_stop + bk - 1, bk), num_kv)
  num_kv = jnp.where(causal != 0, jnp.minimum(lax.div((qi + 1) * bq + bk - 1, bk), num_kv),
                     num_kv)
  return jnp.where((qi + 1) * bq > q_start, num_kv, 0)


def _fwd_kernel(*refs, cfg: _Config, has_segments: bool, update: bool):
  """One query tile against all key tiles, with the online softmax.

  update: the call folds its keys into a carried state instead of starting afresh. Then the
  refs include `bounds` (int32 [q_start, kv_stop, causal]) and the state (o, lse) over earlier
  keys, aliased to the outputs: the tile starts from acc = o, m = lse (base 2), l = 1, which is
  the online softmax's state after those keys with the accumulator normalised. Rows < q_start
  keep their state bit for bit; keys >= kv_stop are masked (their tiles are skipped); causal
  != 0 masks key t > query s (and skips those tiles)."""
  seg2, upd2 = 2 * has_segments, 2 * update
  (bounds_ref,), (q_ref, k_ref, v_ref), (segq_ref, segk_ref), _, (o_ref, lse_ref) = _unpack(
      refs, (int(update), 1), (3, 3), (seg2, 2), (upd2, 2), (2, 2))
  bq, bk = cfg.block_q, cfg.block_k
  T = k_ref.shape[0]
  qi = pl.program_id(0)
  q = q_ref[...]
  q_idx = qi * bq + jnp.arange(bq)
  seg_q = None if segq_ref is None else segq_ref[...]
  qk_scale = cfg.scale * LOG2E
  bounds = None
  if update:
    bounds = q_start, kv_stop, causal = bounds_ref[0], bounds_ref[1], bounds_ref[2]

  def body(j, carry):
    acc, m, l = carry
    start = pl.multiple_of(j * bk, bk)
    k = k_ref[pl.ds(start, bk), :]
    v = v_ref[pl.ds(start, bk), :]
    s = plgpu.dot(q, k, trans_b=True) * qk_scale  # [bq, bk] fp32, base-2 logits
    seg_k = None if segk_ref is None else segk_ref[pl.ds(start, bk)]
    mask = _mask(q_idx, start + jnp.arange(bk), seg_q, seg_k, cfg, bounds)
    if mask is not None:
      s = jnp.where(mask, s, -jnp.inf)
    m_new = jnp.maximum(m, jnp.max(s, axis=1))
    # A row with no allowed key so far keeps m = -inf; shift it by 0 so exp2 gives 0, not NaN.
    m_use = jnp.where(m_new == -jnp.inf, 0.0, m_new)
    p = jnp.exp2(s - m_use[:, None])
    alpha = jnp.exp2(m - m_use)
    l = alpha * l + jnp.sum(p, axis=1)
    acc = alpha[:, None] * acc + plgpu.dot(p.astype(v.dtype), v)
    return acc, m_new, l

  num_kv = T // bk
  if cfg.causal:  # key tiles past this query tile's last row are fully masked
    num_kv = jnp.minimum(lax.div((qi + 1) * bq + bk - 1, bk), num_kv)
  if update:
    o_in, lse_in = o_ref[...], lse_ref[...]  # the state, through the aliased outputs
    num_kv = _update_tiles(num_kv, qi, bq, bk, bounds)
    m_in = lse_in * LOG2E
    init = (o_in, m_in, jnp.where(m_in == -jnp.inf, 0.0, 1.0))
  else:
    init = (jnp.zeros((bq, q.shape[-1]), jnp.float32), jnp.full((bq,), -jnp.inf, jnp.float32),
            jnp.zeros((bq,), jnp.float32))
  acc, m, l = lax.fori_loop(0, num_kv, body, init)
  empty = l == 0.0  # rows with no allowed key: output 0, lse -inf (they merge as weight 0)
  l_safe = jnp.where(empty, 1.0, l)
  o = acc / l_safe[:, None]
  lse = jnp.where(empty, -jnp.inf, m + jnp.log2(l_safe)) * LN2
  if update:
    keep = q_idx < q_start
    o, lse = jnp.where(keep[:, None], o_in, o), jnp.where(keep, lse_in, lse)
  o_ref[...] = o.astype(o_ref.dtype)
  lse_ref[...] = lse


def _probs(q, k, lse2, mask, qk_scale):
  """Softmax probabilities of one tile recomputed from the saved (base-2) log-sum-exp."""
  p = jnp.exp2(plgpu.dot(q, k, trans_b=True) * qk_scale - lse2[:, None])
  return p if mask is None else jnp.where(mask, p, 0.0)


def _dq_kernel(*refs, cfg: _Config, has_segments: bool, update: bool):
  """dQ of one query tile. update: add into the carried dq (aliased) for rows >= q_start, from
  keys < kv_stop (causal if bounds say so); other rows keep theirs."""
  seg2 = 2 * has_segments
  (bounds_ref,), (q_ref, k_ref, v_ref), (segq_ref, segk_ref), (do_ref, lse_ref, delta_ref), _, (
      dq_ref,) = _unpack(refs, (int(update), 1), (3, 3), (seg2, 2), (3, 3), (int(update), 1),
                         (1, 1))
  bq, bk = cfg.block_q_bwd, cfg.block_k_bwd
  T = k_ref.shape[0]
  qi = pl.program_id(0)
  q, do = q_ref[...], do_ref[...]
  lse2 = lse_ref[...] * LOG2E
  delta = delta_ref[...]
  q_idx = qi * bq + jnp.arange(bq)
  seg_q = None if segq_ref is None else segq_ref[...]
  bounds = None
  if update:
    bounds = q_start, _, _ = bounds_ref[0], bounds_ref[1], bounds_ref[2]

  def body(j, dq):
    start = pl.multiple_of(j * bk, bk)
    k = k_ref[pl.ds(start, bk), :]
    v = v_ref[pl.ds(start, bk), :]
    seg_k = None if segk_ref is None else segk_ref[pl.ds(start, bk)]
    mask = _mask(q_idx, start + jnp.arange(bk), seg_q, seg_k, cfg, bounds)
    p = _probs(q, k, lse2, mask, cfg.scale * LOG2E)
    ds = p * (plgpu.dot(do, v, trans_b=True) - delta[:, None])
    return dq + plgpu.dot(ds.astype(k.dtype), k)

  num_kv = T // bk
  if cfg.causal:
    num_kv = jnp.minimum(lax.div((qi + 1) * bq + bk - 1, bk), num_kv)
  if update:
    num_kv = _update_tiles(num_kv, qi, bq, bk, bounds)
  dq = lax.fori_loop(0, num_kv, body, jnp.zeros((bq, q.shape[-1]), jnp.float32)) * cfg.scale
  if update:
    dq_in = dq_ref[...]  # the accumulator, through the aliased output
    dq = jnp.where((q_idx < q_start)[:, None], dq_in, dq_in + dq)
  dq_ref[...] = dq.astype(dq_ref.dtype)


def _dkv_kernel(*refs, cfg: _Config, has_segments: bool, group: int, update: bool):
  """dK, dV of one key tile. update: add into the carried dk, dv (aliased) for keys < kv_stop,
  from queries >= q_start (causal if bounds say so); other keys keep theirs."""
  seg2, upd2 = 2 * has_segments, 2 * update
  (bounds_ref,), (q_ref, k_ref, v_ref), (segq_ref, segk_ref), (do_ref, lse_ref, delta_ref), _, (
      dk_ref, dv_ref) = _unpack(refs, (int(update), 1), (3, 3), (seg2, 2), (3, 3), (upd2, 2),
                                (2, 2))
  bq, bk = cfg.block_q_bwd, cfg.block_k_bwd
  S = q_ref.shape[0]
  kj = pl.program_id(0)
  k, v = k_ref[...], v_ref[...]
  k_idx = kj * bk + jnp.arange(bk)
  seg_k = None if segk_ref is None else segk_ref[...]
  bounds = None
  if update:
    bounds = q_start, kv_stop, causal = bounds_ref[0], bounds_ref[1], bounds_ref[2]

  def over_queries(g, i, carry):
    dk, dv = carry
    start = pl.multiple_of(i * bq, bq)
    q = q_ref[pl.ds(start, bq), g, :]
    do = do_ref[pl.ds(start, bq), g, :]
    lse2 = lse_ref[g, pl.ds(start, bq)] * LOG2E
    delta = delta_ref[g, pl.ds(start, bq)]
    seg_q = None if segq_ref is None else segq_ref[pl.ds(start, bq)]
    mask = _mask(start + jnp.arange(bq), k_idx, seg_q, seg_k, cfg, bounds, rows=True)
    p = _probs(q, k, lse2, mask, cfg.scale * LOG2E)
    dv = dv + plgpu.dot(p.astype(do.dtype), do, trans_a=True)
    ds = p * (plgpu.dot(do, v, trans_b=True) - delta[:, None])
    dk = dk + plgpu.dot(ds.astype(q.dtype), q, trans_a=True)
    return dk, dv

  first = lax.div(kj * bk, bq) if cfg.causal else 0  # earlier query tiles cannot see this tile
  last = S // bq
  if update:
    first = jnp.maximum(jnp.where(causal != 0, lax.div(kj * bk, bq), 0), lax.div(q_start, bq))
    last = jnp.where(kj * bk < kv_stop, last, first)  # a tile of kept keys: no work

  def over_heads(g, carry):  # the query heads that share this kv head (GQA)
    return lax.fori_loop(first, last, functools.partial(over_queries, g), carry)

  zeros = jnp.zeros((bk, k.shape[-1]), jnp.float32)
  dk, dv = lax.fori_loop(0, group, over_heads, (zeros, zeros))
  dk = dk * cfg.scale
  if update:
    keep = (k_idx >= kv_stop)[:, None]
    dk_in, dv_in = dk_ref[...], dv_ref[...]  # the accumulators, through the aliased outputs
    dk, dv = jnp.where(keep, dk_in, dk_in + dk), jnp.where(keep, dv_in, dv_in + dv)
  dk_ref[...] = dk.astype(dk_ref.dtype)
  dv_ref[...] = dv.astype(dv_ref.dtype)


# ----------------------------------------------------------------------------------------------
# pallas_call wrappers on padded, block-aligned arrays.


def _out_struct(shape, dtype, *inputs):
  """Output type of a pallas_call; inside shard_map it must say over which mesh axes it varies
  (the union of its inputs' axes), or `check_vma=True` rejects the call."""
  mats = [getattr(jax.typeof(x), "manual_axis_type", None) for x in inputs if x is not None]
  if not mats or mats[0] is None:
    return jax.ShapeDtypeStruct(shape, dtype)
  varying = frozenset().union(*(m.varying for m in mats))
  return jax.ShapeDtypeStruct(shape, dtype, manual_axis_type=mats[0].update(varying=varying))


def _compiler_params(head_dim: int):
  return plgpu.CompilerParams(num_warps=4 if head_dim <= 64 else 8, num_stages=2)


def _whole(x):
  """The spec of a carried state's *input*: never read by the kernel, which reads and writes the
  state through the aliased output refs (they start as the input's buffer: GPU aliasing shares
  the memory, Pallas' interpreter starts the output from the input). Kept whole, the interpreter
  passes it through its grid loop untouched, so XLA holds one buffer of state, as the GPU does,
  not an input copy beside the output."""
  return pl.BlockSpec(x.shape, lambda *_: (0,) * x.ndim)


def _bounds_spec():
  """The int32 [q_start, kv_stop, causal] of an update call, read by every program."""
  return pl.BlockSpec((3,), lambda *_: (0,))


def _fwd_call(q, k, v, seg_q, seg_kv, cfg: _Config, out_dtype, state=None, bounds=None,
              heads=None):
  """-> (out [B, S, H, D], lse [B, H, S]). With `state` = (o fp32, lse) and `bounds`, the
  outputs are the state's buffers (input_output_aliases): the call updates them in place.
  heads = (first, count): only those query heads are computed (k/v hold just their kv heads);
  the state's other heads are left as they are."""
  B, S, H, D = q.shape
  T, K = k.shape[1], k.shape[2]
  first, count = (0, H) if heads is None else heads
  G, bq = count // K, cfg.block_q
  has_segments, update = seg_q is not None, state is not None
  q_spec = pl.BlockSpec((None, bq, None, D), lambda i, b, h: (b, i, first + h, 0))
  lse_spec = pl.BlockSpec((None, None, bq), lambda i, b, h: (b, first + h, i))
  in_specs, args = [], []
  if update:
    in_specs, args = [_bounds_spec()], [bounds]
  in_specs += [q_spec,
               pl.BlockSpec((None, T, None, D), lambda i, b, h: (b, 0, h // G, 0)),
               pl.BlockSpec((None, T, None, D), lambda i, b, h: (b, 0, h // G, 0))]
  args += [q, k, v]
  if has_segments:
    in_specs += [pl.BlockSpec((None, bq), lambda i, b, h: (b, i)),
                 pl.BlockSpec((None, T), lambda i, b, h: (b, 0))]
    args += [seg_q, seg_kv]
  aliases = {}
  if update:
    aliases = {len(args): 0, len(args) + 1: 1}
    in_specs += [_whole(x) for x in state]
    args += list(state)
  return pl.pallas_call(
      functools.partial(_fwd_kernel, cfg=cfg, has_segments=has_segments, update=update),
      grid=(S // bq, B, count),
      in_specs=in_specs,
      out_specs=[q_spec, lse_spec],
      out_shape=[_out_struct((B, S, H, D), out_dtype, *args),
                 _out_struct((B, H, S), jnp.float32, *args)],
      input_output_aliases=aliases,
      compiler_params=_compiler_params(D),
      interpret=cfg.interpret,
      name="flash_attention_fwd",
  )(*args)


def _bwd_call(q, k, v, seg_q, seg_kv, do, lse, delta, cfg: _Config, grad_dtypes, grads=None,
              bounds=None, heads=None):
  """-> (dq, dk, dv). With `grads` = (dq, dk, dv) accumulators and `bounds`, the outputs are
  the accumulators' buffers (input_output_aliases), updated in place. heads = (first, count):
  only those query heads (and their kv heads, all that k/v/dk/dv hold) take part; dq's other
  heads are left as they are."""
  B, S, H, D = q.shape
  T, K = k.shape[1], k.shape[2]
  first, count = (0, H) if heads is None else heads
  G, bq, bk = count // K, cfg.block_q_bwd, cfg.block_k_bwd
  has_segments, update = seg_q is not None, grads is not None
  segs = [seg_q, seg_kv] if has_segments else []
  head = [bounds] if update else []
  inputs = (*head, q, k, v, *segs, do, lse, delta)
  head_specs = [_bounds_spec()] if update else []

  # dQ: a program per (query tile, batch, query head), looping over key tiles.
  q_spec = pl.BlockSpec((None, bq, None, D), lambda i, b, h: (b, i, first + h, 0))
  dq_specs = [
      *head_specs, q_spec,
      pl.BlockSpec((None, T, None, D), lambda i, b, h: (b, 0, h // G, 0)),
      pl.BlockSpec((None, T, None, D), lambda i, b, h: (b, 0, h // G, 0)),
  ]
  if has_segments:
    dq_specs += [pl.BlockSpec((None, bq), lambda i, b, h: (b, i)),
                 pl.BlockSpec((None, T), lambda i, b, h: (b, 0))]
  dq_specs += [q_spec,
               pl.BlockSpec((None, None, bq), lambda i, b, h: (b, first + h, i)),
               pl.BlockSpec((None, None, bq), lambda i, b, h: (b, first + h, i))]
  dq_args = list(inputs)
  if update:
    dq_specs.append(_whole(grads[0]))
    dq_args.append(grads[0])
  dq = pl.pallas_call(
      functools.partial(_dq_kernel, cfg=cfg, has_segments=has_segments, update=update),
      grid=(S // bq, B, count),
      in_specs=dq_specs,
      out_specs=q_spec,
      out_shape=_out_struct(q.shape, grad_dtypes[0], *inputs),
      input_output_aliases={len(inputs): 0} if update else {},
      compiler_params=_compiler_params(D),
      interpret=cfg.interpret,
      name="flash_attention_dq",
  )(*dq_args)

  # dK, dV: a program per (key tile, batch, kv head), looping over its G query heads' tiles.
  # Query-side blocks are G heads wide, so the first kv head is block first // G.
  kv_spec = pl.BlockSpec((None, bk, None, D), lambda j, b, h: (b, j, h, 0))
  kv0 = first // G
  dkv_specs = [
      *head_specs,
      pl.BlockSpec((None, S, G, D), lambda j, b, h: (b, 0, kv0 + h, 0)),
      kv_spec, kv_spec,
  ]
  if has_segments:
    dkv_specs += [pl.BlockSpec((None, S), lambda j, b, h: (b, 0)),
                  pl.BlockSpec((None, bk), lambda j, b, h: (b, j))]
  dkv_specs += [pl.BlockSpec((None, S, G, D), lambda j, b, h: (b, 0, kv0 + h, 0)),
                pl.BlockSpec((None, G, S), lambda j, b, h: (b, kv0 + h, 0)),
                pl.BlockSpec((None, G, S), lambda j, b, h: (b, kv0 + h, 0))]
  dkv_args = list(inputs)
  if update:
    dkv_specs += [_whole(x) for x in grads[1:]]
    dkv_args += list(grads[1:])
  dk, dv = pl.pallas_call(
      functools.partial(_dkv_kernel, cfg=cfg, has_segments=has_segments, group=G, update=update),
      grid=(T // bk, B, K),
      in_specs=dkv_specs,
      out_specs=[kv_spec, kv_spec],
      out_shape=[_out_struct(k.shape, grad_dtypes[1], *inputs),
                 _out_struct(v.shape, grad_dtypes[1], *inputs)],
      input_output_aliases={len(inputs): 0, len(inputs) + 1: 1} if update else {},
      compiler_params=_compiler_params(D),
      interpret=cfg.interpret,
      name="flash_attention_dkv",
  )(*dkv_args)
  return dq, dk, dv


# ----------------------------------------------------------------------------------------------
# Padding to tiles, and the differentiable entry point.


def _pad_axis(x, axis: int, size: int, value=0):
  if x is None or x.shape[axis] == size:
    return x
  widths = [(0, 0)] * x.ndim
  widths[axis] = (0, size - x.shape[axis])
  return jnp.pad(x, widths, constant_values=value)


def _round_up(n: int, m: int) -> int:
  return -(-n // m) * m


def _setup(q, k, v, seg_q, seg_kv, *, causal, scale, block_sizes, interpret, heads=None):
  """Validate, pick tiles and padded sizes: -> (cfg, padded S, padded T, padded D)."""
  _check_shapes(q, k, v, seg_q, seg_kv, heads)
  blocks = block_sizes or BlockSizes()
  _check_blocks(blocks)
  S, T, D = q.shape[1], k.shape[1], q.shape[3]
  bq, bqb = _tile(blocks.block_q, S), _tile(blocks.block_q_bwd, S)
  bk, bkb = _tile(blocks.block_k, T), _tile(blocks.block_k_bwd, T)
  if interpret is None:
    interpret = jax.default_backend() != "gpu"
  # Powers of two: the larger tile is a multiple of the smaller.
  s_pad, t_pad = _round_up(S, max(bq, bqb)), _round_up(T, max(bk, bkb))
  cfg = _Config(causal=bool(causal), scale=float(D ** -0.5 if scale is None else scale),
                block_q=bq, block_k=bk, block_q_bwd=bqb, block_k_bwd=bkb, kv_len=T,
                kv_padded=t_pad, interpret=bool(interpret))
  return cfg, s_pad, t_pad, max(_MIN_TILE, pl.next_power_of_2(D))


def _pad_inputs(q, k, v, seg_q, seg_kv, s_pad, t_pad, d_pad):
  q = _pad_axis(_pad_axis(q, 1, s_pad), 3, d_pad)
  k = _pad_axis(_pad_axis(k, 1, t_pad), 3, d_pad)
  v = _pad_axis(_pad_axis(v, 1, t_pad), 3, d_pad)
  if seg_q is not None:  # padded keys are masked by index; the values here never match anyway
    seg_q = _pad_axis(seg_q.astype(jnp.int32), 1, s_pad, -1)
    seg_kv = _pad_axis(seg_kv.astype(jnp.int32), 1, t_pad, -2)
  return q, k, v, seg_q, seg_kv


def _bounds(bounds, causal, S: int, T: int):
  """int32 [q_start, kv_stop, causal] clipped to the true lengths (padded keys stay masked)."""
  q_start, kv_stop = (0, T) if bounds is None else bounds
  return jnp.stack([jnp.clip(jnp.asarray(q_start, jnp.int32), 0, S),
                    jnp.clip(jnp.asarray(kv_stop, jnp.int32), 0, T),
                    jnp.asarray(causal, jnp.int32)])


def forward(q, k, v, seg_q=None, seg_kv=None, *, state=None, bounds=None, heads=None,
            causal=False, scale=None, block_sizes=None, interpret=None, out_dtype=jnp.float32):
  """One attention block: -> (out [B, S, H, D] in `out_dtype`, lse [B, H, S] fp32).

  Rows with no allowed key get out = 0 and lse = -inf, so partial results over disjoint key
  blocks merge exactly with their log-sum-exps.

  state: (o [B, S, H, D] fp32, lse [B, H, S]), the attention of these queries over earlier
  keys. The block's keys are folded into it by the online softmax, inside the kernel, and the
  updated state is returned in the same buffers (input_output_aliases: in place where the
  caller's buffer is dead afterwards, as in a ring step). This is what ring attention does each
  step (sharding/ring_attention.py): no block output and no separate merge are materialised.
  The state stays normalised (o is always the exact attention over the keys seen so far, lse
  their log-sum-exp) rather than a raw accumulator with a running max and sum: the same bytes,
  one [B, H, S] array fewer, the division is per tile in registers, and the final state is
  directly the output and the residual the backward pass needs.
  bounds: (q_start, kv_stop), int32 scalars, possibly traced: only queries >= q_start are
  updated (the others keep their state bit for bit) and only keys < kv_stop take part; whole
  tiles outside are skipped. With state only; default (0, T). With state, `causal` may be a
  traced bool as well, so one call serves every step of a ring (sharding/ring_attention.py).
  heads: (first, count), static: update only query heads first .. first+count-1, whose kv heads
  are all that k and v hold (q and the state keep every head; the other heads' state is left
  as it is). With state only. Ring attention uses it to send a slice of the kv heads round the
  ring at a time without copying q or the state."""
  if (bounds is not None or heads is not None) and state is None:
    raise ValueError("flash attention: bounds= and heads= need state= (what they leave out "
                     "keeps the state)")
  cfg, s_pad, t_pad, d_pad = _setup(q, k, v, seg_q, seg_kv, causal=state is None and causal,
                                    scale=scale, block_sizes=block_sizes, interpret=interpret,
                                    heads=heads)
  S, T, D = q.shape[1], k.shape[1], q.shape[3]
  padded = _pad_inputs(q, k, v, seg_q, seg_kv, s_pad, t_pad, d_pad)
  if state is None:
    out, lse = _fwd_call(*padded, cfg, out_dtype)
  else:
    o, lse = state
    o = _pad_axis(_pad_axis(o.astype(jnp.float32), 1, s_pad), 3, d_pad)
    lse = _pad_axis(lse.astype(jnp.float32), 2, s_pad, -jnp.inf)
    out, lse = _fwd_call(*padded, cfg, jnp.float32, (o, lse), _bounds(bounds, causal, S, T),
                         heads)
  return out[:, :S, :, :D], lse[:, :, :S]


def backward(q, k, v, seg_q, seg_kv, do, lse, delta, *, grads=None, bounds=None, heads=None,
             causal=False, scale=None, block_sizes=None, interpret=None,
             grad_dtype=jnp.float32):
  """Gradients of one attention block given the residuals of the *whole* attention.

  `lse` [B, H, S] is the log-sum-exp over all keys the queries attend to (possibly more than
  this block's), `delta` [B, H, S] = sum_d(out * d_out) - d_lse for the final output. Then
  p = exp(s - lse) are this block's true probabilities and the block's dq (partial), dk, dv
  follow exactly. -> (dq, dk, dv) in `grad_dtype`.

  grads: (dq, dk, dv) fp32 accumulators to add this block's gradients to, in place
  (input_output_aliases), with `bounds` = (q_start, kv_stop) and `causal` (then possibly
  traced) as in `forward`: dq changes only for rows >= q_start, dk/dv only for keys < kv_stop,
  and only those pairs contribute. heads: (first, count) as in `forward`: q, do, lse, delta and
  dq keep every query head, k, v, dk and dv hold only the range's kv heads."""
  if (bounds is not None or heads is not None) and grads is None:
    raise ValueError("flash attention: bounds= and heads= need grads= (what they leave out "
                     "keeps its gradient)")
  cfg, s_pad, t_pad, d_pad = _setup(q, k, v, seg_q, seg_kv, causal=grads is None and causal,
                                    scale=scale, block_sizes=block_sizes, interpret=interpret,
                                    heads=heads)
  S, T, D = q.shape[1], k.shape[1], q.shape[3]
  q, k, v, seg_q, seg_kv = _pad_inputs(q, k, v, seg_q, seg_kv, s_pad, t_pad, d_pad)
  do = _pad_axis(_pad_axis(do.astype(q.dtype), 1, s_pad), 3, d_pad)
  # Padded query rows: lse = +inf makes their probabilities 0, so they contribute nothing.
  lse = _pad_axis(lse.astype(jnp.float32), 2, s_pad, jnp.inf)
  delta = _pad_axis(delta.astype(jnp.float32), 2, s_pad)
  if grads is None:
    dq, dk, dv = _bwd_call(q, k, v, seg_q, seg_kv, do, lse, delta, cfg,
                           (grad_dtype, grad_dtype))
  else:
    dq, dk, dv = grads
    grads = (_pad_axis(_pad_axis(dq.astype(jnp.float32), 1, s_pad), 3, d_pad),
             _pad_axis(_pad_axis(dk.astype(jnp.float32), 1, t_pad), 3, d_pad),
             _pad_axis(_pad_axis(dv.astype(jnp.float32), 1, t_pad), 3, d_pad))
    dq, dk, dv = _bwd_call(q, k, v, seg_q, seg_kv, do, lse, delta, cfg,
                           (jnp.float32, jnp.float32), grads, _bounds(bounds, causal, S, T),
                           heads)
  return dq[:, :S, :, :D], dk[:, :T, :, :D], dv[:, :T, :, :D]


@functools.partial(jax.custom_vjp, nondiff_argnums=(5,))
def _flash(q, k, v, seg_q, seg_kv, cfg):
  return _fwd_call(q, k, v, seg_q, seg_kv, cfg, q.dtype)


def _flash_fwd(q, k, v, seg_q, seg_kv, cfg):
  out, lse = _fwd_call(q, k, v, seg_q, seg_kv, cfg, q.dtype)
  return (out, lse), (q, k, v, seg_q, seg_kv, out, lse)


def _flash_bwd(cfg, residuals, cotangents):
  q, k, v, seg_q, seg_kv, out, lse = residuals
  d_out, d_lse = cotangents
  # d lse / d s = p, so a cotangent on lse enters exactly like -delta (FlashAttention-2 eq. 4).
  delta = jnp.einsum("bshd,bshd->bhs", out.astype(jnp.float32), d_out.astype(jnp.float32))
  delta = delta - d_lse
  dq, dk, dv = _bwd_call(q, k, v, seg_q, seg_kv, d_out.astype(q.dtype), lse, delta, cfg,
                         (q.dtype, k.dtype))
  return dq, dk, dv, None, None


_flash.defvjp(_flash_fwd, _flash_bwd)


def flash_attention(q, k, v, *, causal=False, segment_ids=None, kv_segment_ids=None,
                    scale=None, return_lse=False, block_sizes: BlockSizes | None = None,
                    interpret: bool | None = None):
  """Exact attention q [B, S, H, D], k/v [B, T, K, D] -> out [B, S, H, D] (q's dtype).

  causal: key t is masked for query s when t > s. segment_ids [B, S]: packed documents; keys
  use `kv_segment_ids` [B, T] if given, else the same ids (self-attention). scale: default
  1/sqrt(D). return_lse: also return the log-sum-exp [B, H, S] (fp32, natural log), e.g. to
  merge attention over key blocks. Inputs may be fp32 or bf16; scores, softmax and
  accumulators are fp32. interpret: None = compiled on GPU, interpreted elsewhere.
  """
  if kv_segment_ids is None and segment_ids is not None:
    if k.shape[1] != q.shape[1]:
      raise ValueError("flash attention: queries and keys differ in length; "
                       "pass kv_segment_ids as well")
    kv_segment_ids = segment_ids
  cfg, s_pad, t_pad, d_pad = _setup(q, k, v, segment_ids, kv_segment_ids, causal=causal,
                                    scale=scale, block_sizes=block_sizes, interpret=interpret)
  S, D = q.shape[1], q.shape[3]
  out, lse = _flash(*_pad_inputs(q, k, v, segment_ids, kv_segment_ids, s_pad, t_pad, d_pad), cfg)
  out, lse = out[:, :S, :, :D], lse[:, :, :S]
  return (out, lse) if return_lse else out


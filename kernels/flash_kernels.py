"""Flash attention's Pallas kernels (Triton lowering) and the pallas_call builders that run them
on padded, block-aligned arrays; kernels/flash_attention.py checks, pads and differentiates.

  _fwd_call -> (out, lse)    grid (query tile, batch, head), looping over key tiles
  _bwd_call -> (dq, dk, dv)  dQ: grid (query tile, batch, head), looping over key tiles;
                             dK/dV: grid (key tile, batch, kv head), looping over its query heads
With a carried state (`state`, `grads`) the outputs alias it and are updated in place.
Why and details: docs/attention.md#the-triton-flash-kernel
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
  """One query tile against all key tiles, with the online softmax. update: fold the keys into
  the carried (o, lse) (aliased outputs), starting from acc = o, m = lse (base 2), l = 1 (the
  online softmax's state, normalised); rows < q_start keep theirs, keys >= kv_stop are masked."""
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
  """The spec of a carried state's input, whole and never read (the kernel uses the aliased
  output): the interpreter then holds one buffer of state, as the GPU does (docs/attention.md)."""
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

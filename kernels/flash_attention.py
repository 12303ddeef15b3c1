"""Flash attention as a Pallas kernel (Triton lowering): forward and backward, `[B, S, H, D]`.

  flash_attention(q, k, v, ...)   differentiable (custom_vjp), optionally also returning the lse
  forward(...) / backward(...)    one attention block in fp32 with explicit residuals; with
                                  state=(o, lse) / grads=(dq, dk, dv) the kernels update them in
                                  place, within bounds=(q_start, kv_stop) and heads=(first,
                                  count): a step of ring attention (sharding/ring_attention.py)

q [B, S, H, D], k/v [B, T, K, D] with H a multiple of K (query head h reads kv head h // (H/K));
segment ids [B, S] / [B, T]; lse [B, H, S] in natural log; `causal` masks key t > query s. Any
length and head dim (zero-padded to tiles here). Compiled on GPU, interpreted elsewhere; the
kernels are in kernels/flash_kernels.py. Why and details: docs/attention.md#the-triton-flash-kernel
"""
from __future__ import annotations

import dataclasses
import functools

import jax
import jax.numpy as jnp
from jax.experimental import pallas as pl

from kernels.flash_kernels import _bwd_call, _Config, _fwd_call

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
  caller's buffer is dead afterwards, as in a ring step). The state stays normalised: o is the
  exact attention over the keys seen so far, lse their log-sum-exp.
  bounds: (q_start, kv_stop), int32 scalars, possibly traced: only queries >= q_start are
  updated (the others keep their state bit for bit) and only keys < kv_stop take part; whole
  tiles outside are skipped. With state only; default (0, T). With state, `causal` may be a
  traced bool as well, so one call serves every step of a ring (sharding/ring_attention.py).
  heads: (first, count), static: update only query heads first .. first+count-1, whose kv heads
  are all that k and v hold (q and the state keep every head; the other heads' state is left
  as it is). With state only."""
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

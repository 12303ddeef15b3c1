"""TPU attention: jax's shipped splash attention, adapted to `[batch, seq, heads, head_dim]`.

Splash attention (jax.experimental.pallas.ops.tpu.splash_attention; the block-sparse flash
attention MaxText uses on TPU) is a Mosaic kernel for TPUs. It takes one sequence at a time as
[heads, seq, head_dim], does not scale q, supports grouped-query attention natively (H a
multiple of K) and segment ids, and skips tiles its (static) mask rules out, e.g. the upper
triangle for causal attention. This adapter transposes, scales q, vmaps over the batch and
caches the kernel (building its mask tables is host work) per shape.

It runs on CPU only with `interpret=True` (tests use that to check the adapter); on TPU, tiles
must be multiples of 128 and the sequence a multiple of the tile.
"""
from __future__ import annotations

import functools
import math

import jax
import jax.numpy as jnp
from jax.experimental.pallas.ops.tpu.splash_attention import splash_attention_kernel as splash
from jax.experimental.pallas.ops.tpu.splash_attention import splash_attention_mask as masks


@functools.lru_cache(maxsize=32)
def _kernel(q_len: int, kv_len: int, heads: int, causal: bool, block: int, interpret: bool):
  shape = (q_len, kv_len)
  mask = masks.MultiHeadMask([masks.CausalMask(shape) if causal else masks.FullMask(shape)] * heads)
  bq, bk = math.gcd(q_len, block), math.gcd(kv_len, block)
  sizes = splash.BlockSizes(block_q=bq, block_kv=bk, block_kv_compute=bk, block_q_dkv=bq,
                            block_kv_dkv=bk, block_kv_dkv_compute=bk, block_q_dq=bq,
                            block_kv_dq=bk)
  return splash.make_splash_mha(mask, head_shards=1, q_seq_shards=1, block_sizes=sizes,
                                interpret=interpret)


def splash_attention(q_BSHD, k_BTKD, v_BTKD, *, causal=False, segment_ids=None, scale=None,
                     block: int = 512, interpret: bool = False):
  """Exact attention with splash on TPU: q [B, S, H, D], k/v [B, T, K, D] -> [B, S, H, D].

  segment_ids [B, S] (self-attention, S == T). Differentiable (splash's own custom_vjp)."""
  B, S, H, D = q_BSHD.shape
  T = k_BTKD.shape[1]
  if segment_ids is not None and S != T:
    raise ValueError("splash attention: segment ids need queries and keys of the same length")
  kernel = _kernel(S, T, H, bool(causal), block, bool(interpret))
  scale = D ** -0.5 if scale is None else scale
  q_BHSD = (q_BSHD * jnp.asarray(scale, q_BSHD.dtype)).swapaxes(1, 2)
  k_BKTD, v_BKTD = k_BTKD.swapaxes(1, 2), v_BTKD.swapaxes(1, 2)
  if segment_ids is None:
    out_BHSD = jax.vmap(kernel)(q_BHSD, k_BKTD, v_BKTD)
  else:
    seg = segment_ids.astype(jnp.int32)
    out_BHSD = jax.vmap(kernel)(q_BHSD, k_BKTD, v_BKTD, splash.SegmentIds(q=seg, kv=seg))
  return out_BHSD.swapaxes(1, 2)

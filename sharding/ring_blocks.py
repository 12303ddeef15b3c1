"""The jnp block computation of ring attention (sharding/ring_attention.py): one (query block,
key block) pair with keys in chunks and the online softmax, forward and backward, plus the exact
log-sum-exp merge of two partial results. Same contract as the flash kernel's calls: fp32
output and a natural-log lse [B, H, S]."""
from __future__ import annotations

import math

import jax.numpy as jnp
from jax import lax


def _kv_chunks(k, v, seg_k, chunk: int):
  """Keys cut into chunks for `lax.scan`: (k, v, segment ids, first key index) per chunk."""
  T = k.shape[1]
  c = T if T <= chunk else math.gcd(T, chunk)
  split = lambda x: None if x is None else jnp.moveaxis(
      x.reshape(x.shape[0], T // c, c, *x.shape[2:]), 1, 0)
  return c, (split(k), split(v), split(seg_k), jnp.arange(0, T, c))


def _scores(q_BSKGD, k_BCKD, seg_q, seg_k, start, causal, scale):
  """Scaled scores [B, K, G, S, C] of one key chunk (starting at key `start`), masked to -inf."""
  s = jnp.einsum("bskgd,bckd->bkgsc", q_BSKGD, k_BCKD, preferred_element_type=jnp.float32)
  s = s * scale
  S, C = s.shape[-2:]
  mask = None
  if causal:
    mask = jnp.arange(S)[:, None] >= start + jnp.arange(C)[None, :]
  if seg_q is not None:
    same = (seg_q[:, :, None] == seg_k[:, None, :])[:, None, None]  # [B, 1, 1, S, C]
    mask = same if mask is None else mask & same
  return s if mask is None else jnp.where(mask, s, -jnp.inf)


def block_forward(q, k, v, seg_q, seg_k, causal, scale, chunk):
  """One block in jnp, keys in chunks with the online softmax (Rabe & Staats 2021,
  "Self-attention Does Not Need O(n^2) Memory"): scores are [S, chunk], never [S, T]."""
  B, S, H, D = q.shape
  K = k.shape[2]
  q_BSKGD = q.reshape(B, S, K, H // K, D)
  _, chunks = _kv_chunks(k, v, seg_k, chunk)

  def body(carry, xs):
    acc_BSKGD, m_BKGS, l_BKGS = carry
    k_c, v_c, seg_c, start = xs
    s = _scores(q_BSKGD, k_c, seg_q, seg_c, start, causal, scale)
    m_new = jnp.maximum(m_BKGS, jnp.max(s, axis=-1))
    m_use = jnp.where(m_new == -jnp.inf, 0.0, m_new)
    p = jnp.exp(s - m_use[..., None])
    alpha = jnp.exp(m_BKGS - m_use)
    l_BKGS = alpha * l_BKGS + jnp.sum(p, axis=-1)
    pv = jnp.einsum("bkgsc,bckd->bskgd", p.astype(v.dtype), v_c,
                    preferred_element_type=jnp.float32)
    acc_BSKGD = acc_BSKGD * jnp.moveaxis(alpha, 3, 1)[..., None] + pv
    return (acc_BSKGD, m_new, l_BKGS), None

  lse_shape = jnp.zeros_like(q_BSKGD[..., 0], jnp.float32).transpose(0, 2, 3, 1)  # [B,K,G,S]
  init = (jnp.zeros_like(q_BSKGD, jnp.float32), jnp.full_like(lse_shape, -jnp.inf), lse_shape)
  (acc, m, l), _ = lax.scan(body, init, chunks)
  l_safe = jnp.where(l == 0.0, 1.0, l)
  o_BSKGD = acc / jnp.moveaxis(l_safe, 3, 1)[..., None]
  lse_BKGS = jnp.where(l == 0.0, -jnp.inf, m + jnp.log(l_safe))
  return o_BSKGD.reshape(B, S, H, D), lse_BKGS.reshape(B, H, S)


def block_backward(q, k, v, seg_q, seg_k, do, lse, delta, causal, scale, chunk):
  """Gradients of one block in jnp, one key chunk at a time: dq accumulates, dk/dv per chunk."""
  B, S, H, D = q.shape
  T, K = k.shape[1], k.shape[2]
  G = H // K
  q_BSKGD = q.reshape(B, S, K, G, D)
  do_BSKGD = do.astype(q.dtype).reshape(B, S, K, G, D)
  lse_BKGS, delta_BKGS = lse.reshape(B, K, G, S), delta.reshape(B, K, G, S)
  _, chunks = _kv_chunks(k, v, seg_k, chunk)

  def body(dq_BSKGD, xs):
    k_c, v_c, seg_c, start = xs
    s = _scores(q_BSKGD, k_c, seg_q, seg_c, start, causal, scale)
    p = jnp.where(s == -jnp.inf, 0.0, jnp.exp(s - lse_BKGS[..., None]))
    dp = jnp.einsum("bskgd,bckd->bkgsc", do_BSKGD, v_c, preferred_element_type=jnp.float32)
    ds = p * (dp - delta_BKGS[..., None])
    dq_BSKGD = dq_BSKGD + jnp.einsum("bkgsc,bckd->bskgd", ds.astype(k.dtype), k_c,
                                     preferred_element_type=jnp.float32) * scale
    dk = jnp.einsum("bkgsc,bskgd->bckd", ds.astype(q.dtype), q_BSKGD,
                    preferred_element_type=jnp.float32) * scale
    dv = jnp.einsum("bkgsc,bskgd->bckd", p.astype(do.dtype), do_BSKGD,
                    preferred_element_type=jnp.float32)
    return dq_BSKGD, (dk, dv)

  dq, (dk, dv) = lax.scan(body, jnp.zeros_like(q_BSKGD, jnp.float32), chunks)
  unchunk = lambda x: jnp.moveaxis(x, 0, 1).reshape(B, T, K, D)
  return dq.reshape(B, S, H, D), unchunk(dk), unchunk(dv)


def merge(o_BSHD, lse_BHS, ob_BSHD, lseb_BHS):
  """Exact merge of attention over two disjoint key sets from their log-sum-exps."""
  top = jnp.maximum(lse_BHS, lseb_BHS)
  top = jnp.where(top == -jnp.inf, 0.0, top)
  w, wb = jnp.exp(lse_BHS - top), jnp.exp(lseb_BHS - top)
  total = w + wb
  safe = jnp.where(total == 0.0, 1.0, total)
  to_BSH1 = lambda x: jnp.swapaxes(x / safe, 1, 2)[..., None]
  o_BSHD = o_BSHD * to_BSH1(w) + ob_BSHD * to_BSH1(wb)
  return o_BSHD, jnp.where(total == 0.0, -jnp.inf, top + jnp.log(safe))


def zeros_then(x_BS):
  """[B, S, ...] -> [B, 2S, ...]: the block is the second half, the first is zeros."""
  return jnp.concatenate([jnp.zeros_like(x_BS), x_BS], axis=1)


def then_zeros(x_BS):
  return jnp.concatenate([x_BS, jnp.zeros_like(x_BS)], axis=1)


def seq_slice(x, sl):
  """Sequence slice of an optional [B, S, ...] array."""
  return None if x is None else x[:, sl]

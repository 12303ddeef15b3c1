"""Attention dispatch: one entry point, several implementations.

`impl="xla"` is `jax.nn.dot_product_attention` (the reference every other implementation is
tested against). Packed documents are kept apart by segment ids: a query attends only to keys of
its own segment (and, when causal, not to later positions).
"""
from __future__ import annotations

import jax
import jax.numpy as jnp


def segment_mask(segment_ids_q, segment_ids_kv=None):
  """Boolean mask [B, 1, Tq, Tk]: True where query and key belong to the same document."""
  if segment_ids_kv is None:
    segment_ids_kv = segment_ids_q
  return (segment_ids_q[:, None, :, None] == segment_ids_kv[:, None, None, :])


def xla_attention(q_BSHD, k_BSKD, v_BSKD, *, segment_ids=None, causal=True):
  mask = None if segment_ids is None else segment_mask(segment_ids)
  return jax.nn.dot_product_attention(q_BSHD, k_BSKD, v_BSKD, mask=mask, is_causal=causal,
                                      implementation="xla")


def attention(q_BSHD, k_BSKD, v_BSKD, *, segment_ids=None, causal=True, impl="xla"):
  """q [B, S, H, D], k/v [B, S, K, D] with H a multiple of K -> [B, S, H, D]."""
  if impl == "xla":
    return xla_attention(q_BSHD, k_BSKD, v_BSKD, segment_ids=segment_ids, causal=causal)
  raise ValueError(f"unknown attention implementation {impl!r}")

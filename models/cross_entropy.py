"""Cross-entropy through the LM head without materialising the [B, S, V] logits.

With a real vocabulary the logits dominate activation memory: Llama 3's V = 128,256 makes the
fp32 logits of one 8k-token sequence 4 GiB, and the backward pass holds their gradient too.
`chunked_cross_entropy` runs the head and the loss one chunk of sequence positions at a time
inside a `lax.scan`: a chunk's logits [B, c, V] are formed, reduced to their log-sum-exp and the
target's logit, and dropped. The chunk function is `jax.checkpoint`ed, so the backward pass
recomputes each chunk's logits rather than keeping them: forward and backward hold one chunk's
logits at a time (and the head's gradient accumulates across chunks in the scan). The result is
the same sum as the full loss, up to fp32 rounding, at the price of one more head matmul in the
backward pass.

Chunks are strided: with n chunks, chunk k holds positions k, k + n, k + 2n, ... of every
sequence. Splitting [B, S, E] as [B, S/n, n, E] keeps the leading (possibly `sequence`-sharded)
part of the sequence axis where it was, so every device keeps its own tokens whatever shards
the sequence; the scan runs over the unsharded n axis.

The target logit is taken with a one-hot contraction rather than a gather, which stays local
when the vocabulary is split over `tensor` (vocab-parallel head, Megatron-style). Compiled on
CPU, forward + backward hold about three chunk-sized [B, c, V] fp32 buffers (the logits, their
gradient and the one-hot) where the full loss holds two full-size ones (`tests/test_cross_entropy.py`
measures it).
"""
from __future__ import annotations

import jax
import jax.numpy as jnp

from sharding.rules import constrain


def _chunk_loss(x_BcE, head_EV, targets_Bc, mask_Bc, dtype):
  logits_BcV = jnp.einsum("bce,ev->bcv", x_BcE.astype(dtype), head_EV.astype(dtype),
                          preferred_element_type=jnp.float32)
  logits_BcV = constrain(logits_BcV, ("act_batch", "act_seq", "act_vocab"))
  lse_Bc = jax.nn.logsumexp(logits_BcV, axis=-1)
  onehot_BcV = jax.nn.one_hot(targets_Bc, logits_BcV.shape[-1], dtype=jnp.float32)
  target_Bc = jnp.einsum("bcv,bcv->bc", logits_BcV, onehot_BcV)
  return jnp.sum((lse_Bc - target_Bc) * mask_Bc)


def chunked_cross_entropy(x_BSE: jax.Array, head_EV: jax.Array, targets_BS: jax.Array,
                          mask_BS: jax.Array, *, chunk: int, dtype=jnp.float32) -> jax.Array:
  """Sum over unmasked tokens of -log softmax(x @ head)[target], `chunk` positions at a time.

  x_BSE: final hidden states; head_EV: the LM head (the transposed embedding when tied);
  mask_BS: which targets count; `dtype`: the matmul's input dtype (logits are fp32).
  `chunk` must divide S."""
  B, S, E = x_BSE.shape
  if chunk <= 0 or S % chunk:
    raise ValueError(f"chunk={chunk} must divide the sequence length {S}")
  n = S // chunk  # number of chunks; chunk k holds positions k, k + n, ...
  to_chunks = lambda a: jnp.moveaxis(a.reshape(B, chunk, n, *a.shape[2:]), 2, 0)
  mask_BS = mask_BS.astype(jnp.float32)
  step = jax.checkpoint(lambda x, t, m: _chunk_loss(x, head_EV, t, m, dtype))

  def body(total, xs):
    return total + step(*xs), None

  total, _ = jax.lax.scan(body, jnp.zeros((), jnp.float32),
                          (to_chunks(x_BSE), to_chunks(targets_BS), to_chunks(mask_BS)))
  return total

"""Cross-entropy through the LM head without materialising the [B, S, V] logits.

`chunked_cross_entropy` runs the head and the loss one chunk of sequence positions at a time
inside a `lax.scan`, so forward and backward hold one chunk's logits [B, c, V] at a time. Its
forward rule (a `jax.custom_vjp`) also computes each chunk's dX and adds into dW, so the head's
three matmuls run once each and nothing is recomputed:

  chunk k = positions k, k + n, k + 2n, ...   (strided: every device keeps its own tokens)
    logits = X_k head -> lse, loss, dlogits = softmax - onehot (x mask)
    dX_k = dlogits head^T;  dW += X_k^T dlogits  (fp32)
  backward: scale the saved dX and dW by the cotangent

In fp32 the loss and gradients equal the unchunked loss's to fp32 rounding.
Why and details: docs/sharding.md#large-vocabularies
"""
from __future__ import annotations

import functools

import jax
import jax.numpy as jnp

from sharding.rules import constrain

_LOGITS = ("act_batch", "act_seq", "act_vocab")


def _logits(x_BcE, head_EV, dtype):
  logits_BcV = jnp.einsum("bce,ev->bcv", x_BcE.astype(dtype), head_EV.astype(dtype),
                          preferred_element_type=jnp.float32)
  return constrain(logits_BcV, _LOGITS)


def _token_losses(logits_BcV, targets_Bc):
  """(-log softmax(logits)[target] per token, the log-sum-exp) in fp32."""
  lse_Bc = jax.nn.logsumexp(logits_BcV, axis=-1)
  onehot_BcV = jax.nn.one_hot(targets_Bc, logits_BcV.shape[-1], dtype=jnp.float32)
  return lse_Bc - jnp.einsum("bcv,bcv->bc", logits_BcV, onehot_BcV), lse_Bc


def _chunks(a, n: int):
  """[B, S, ...] -> [n, B, S/n, ...], chunk k = positions k, k + n, ... (module docstring)."""
  B, S = a.shape[:2]
  return jnp.moveaxis(a.reshape(B, S // n, n, *a.shape[2:]), 2, 0)


def _unchunk(a):
  """The inverse of `_chunks`: [n, B, S/n, ...] -> [B, S, ...]."""
  n, B, c = a.shape[:3]
  return jnp.moveaxis(a, 0, 2).reshape(B, c * n, *a.shape[3:])


def chunked_cross_entropy(x_BSE: jax.Array, head_EV: jax.Array, targets_BS: jax.Array,
                          mask_BS: jax.Array, *, chunk: int, dtype=jnp.float32) -> jax.Array:
  """Sum over unmasked tokens of -log softmax(x @ head)[target], `chunk` positions at a time.

  x_BSE: final hidden states; head_EV: the LM head (the transposed embedding when tied);
  mask_BS: which targets count (weights); `dtype`: the matmuls' input dtype (logits are fp32).
  `chunk` must divide S."""
  S = x_BSE.shape[1]
  if chunk <= 0 or S % chunk:
    raise ValueError(f"chunk={chunk} must divide the sequence length {S}")
  return _fused(x_BSE, head_EV, targets_BS, mask_BS.astype(jnp.float32), S // chunk,
                jnp.dtype(dtype))


@functools.partial(jax.custom_vjp, nondiff_argnums=(4, 5))
def _fused(x_BSE, head_EV, targets_BS, mask_BS, n, dtype):
  """The loss alone (no gradient wanted): n chunks of logits, each reduced and dropped."""

  head_dt = head_EV.astype(dtype)  # once, not per chunk

  def body(total, xs):
    x_BcE, targets_Bc, mask_Bc = xs
    losses_Bc, _ = _token_losses(_logits(x_BcE, head_dt, dtype), targets_Bc)
    return total + jnp.sum(losses_Bc * mask_Bc), None

  xs = (_chunks(x_BSE, n), _chunks(targets_BS, n), _chunks(mask_BS, n))
  return jax.lax.scan(body, jnp.zeros((), jnp.float32), xs)[0]


def _fused_fwd(x_BSE, head_EV, targets_BS, mask_BS, n, dtype):
  """The loss, and per chunk the gradient of the loss sum (cotangent 1) contracted at once
  into dX and into dW's running fp32 sum (module docstring)."""
  head_dt = head_EV.astype(dtype)

  def body(carry, xs):
    total, dhead_EV = carry
    x_BcE, targets_Bc, mask_Bc = xs
    x_dt = x_BcE.astype(dtype)
    logits_BcV = _logits(x_dt, head_dt, dtype)
    losses_Bc, lse_Bc = _token_losses(logits_BcV, targets_Bc)
    onehot_BcV = jax.nn.one_hot(targets_Bc, logits_BcV.shape[-1], dtype=jnp.float32)
    dlogits_BcV = constrain((jnp.exp(logits_BcV - lse_Bc[..., None]) - onehot_BcV)
                            * mask_Bc[..., None], _LOGITS)
    # as autodiff of the unchunked einsum: fp32 cotangent x compute-dtype operand, fp32 result
    dx_BcE = jnp.einsum("bcv,ev->bce", dlogits_BcV, head_dt, preferred_element_type=jnp.float32)
    dhead_EV = dhead_EV + jnp.einsum("bce,bcv->ev", x_dt, dlogits_BcV,
                                     preferred_element_type=jnp.float32)
    return (total + jnp.sum(losses_Bc * mask_Bc), dhead_EV), (dx_BcE.astype(x_BcE.dtype),
                                                              losses_Bc)

  zero = (jnp.zeros((), jnp.float32), jnp.zeros(head_EV.shape, jnp.float32))
  xs = (_chunks(x_BSE, n), _chunks(targets_BS, n), _chunks(mask_BS, n))
  (total, dhead_EV), (dx, losses) = jax.lax.scan(body, zero, xs)
  return total, (_unchunk(dx), dhead_EV.astype(head_EV.dtype), _unchunk(losses))


def _fused_bwd(n, dtype, residuals, g):
  """Scale the saved gradients by the cotangent g (1 in a train step, whose objective adds the
  loss sum as it is); no cotangent for the integer targets."""
  del n, dtype
  dx_BSE, dhead_EV, losses_BS = residuals
  scale = lambda a: (g * a.astype(jnp.float32)).astype(a.dtype)
  return scale(dx_BSE), scale(dhead_EV), None, g * losses_BS


_fused.defvjp(_fused_fwd, _fused_bwd)

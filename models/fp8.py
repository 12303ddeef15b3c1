"""FP8 matmuls for the dense layers (`model.fp8`): e4m3 operands forward, e5m2 gradients backward,
one scale per tensor computed from that tensor's own absolute maximum in the same step.

  fp8_matmul(x [M, K], w [K, N]):  y  = (q(x) q(w)) s_x s_w            q: e4m3, s = amax / 448
                                   dX = (q(dY) q(w)^T) s_dY s_w        q(dY): e5m2, s = amax / 57344
                                   dW = (q(x)^T q(dY)) s_x s_dY        fp32 accumulation

Stateless (torchao's "tensorwise" recipe, Transformer Engine's "current scaling"): nothing is
carried between steps, so checkpoints are the same with it on or off. The program has the shape
XLA's GPU rewriter turns into cuBLASLt fp8 GEMMs (Hopper, Ada); elsewhere XLA computes the same
numbers by converting up. The backward keeps the fp8 operands and their scales (1 byte each).
Why and details: docs/accelerators.md#fp8
"""
from __future__ import annotations

import jax
import jax.numpy as jnp
from jax import lax

E4M3 = jnp.float8_e4m3fn  # forward operands (activations and weights)
E5M2 = jnp.float8_e5m2  # gradients of the outputs


def quantize(x, dtype):
  """(x / scale cast to the fp8 `dtype`, scale fp32 scalar) with scale = amax(|x|) / max(dtype),
  so the largest magnitude lands on the format's largest value; scale 1 for an all-zero x.
  A non-finite x gives a non-finite result (the train step's guard then skips the update)."""
  fp8_max = float(jnp.finfo(dtype).max)
  amax = jnp.max(jnp.abs(x)).astype(jnp.float32)
  scale = jnp.where(amax > 0, amax / fp8_max, jnp.float32(1.0))
  # Clip: x / scale can exceed the largest value by a rounding step, which e4m3fn (no inf)
  # would turn into NaN.
  q = jnp.clip(x.astype(jnp.float32) / scale, -fp8_max, fp8_max)
  return q.astype(dtype), scale


def _scaled_dot(a, b, contract, scale, out_dtype):
  """fp8 a . b contracting `contract` = (a's axis, b's axis), fp32 accumulation, times `scale`:
  the pattern XLA's GPU GemmRewriter fuses into one cuBLASLt fp8 GEMM."""
  y = lax.dot_general(a, b, (((contract[0],), (contract[1],)), ((), ())),
                      preferred_element_type=jnp.float32)
  return (y * scale).astype(out_dtype)


@jax.custom_vjp
def fp8_matmul(x, w):
  """x [M, K] @ w [K, N] -> [M, N] in x's dtype, through fp8 (module docstring). x and w must
  have the same (compute) dtype."""
  return _fp8_matmul_fwd(x, w)[0]


def _fp8_matmul_fwd(x, w):
  if x.dtype != w.dtype or x.ndim != 2 or w.ndim != 2:
    raise ValueError(f"fp8_matmul takes two matrices of one dtype, got {x.dtype}{x.shape} and "
                     f"{w.dtype}{w.shape}")
  qx, sx = quantize(x, E4M3)
  qw, sw = quantize(w, E4M3)
  return _scaled_dot(qx, qw, (1, 0), sx * sw, x.dtype), (qx, sx, qw, sw)


def _fp8_matmul_bwd(residuals, g):
  qx, sx, qw, sw = residuals
  qg, sg = quantize(g, E5M2)
  dx = _scaled_dot(qg, qw, (1, 1), sg * sw, g.dtype)  # dY [M, N] . W^T -> [M, K]
  dw = _scaled_dot(qx, qg, (0, 0), sx * sg, g.dtype)  # X^T . dY -> [K, N]
  return dx, dw


fp8_matmul.defvjp(_fp8_matmul_fwd, _fp8_matmul_bwd)

"""FP8 matmuls for the dense layers (`model.fp8`): e4m3 operands forward, e5m2 gradients backward,
one scale per tensor computed from that tensor's own absolute maximum in the same step.

`fp8_matmul(x [M, K], w [K, N])` is the product x w with both operands quantized to
float8_e4m3fn (3 mantissa bits, range +-448) and the gradient of the output quantized to
float8_e5m2 (2 mantissa bits, range +-57344: gradients need range more than precision); the
three products (forward, dX = dY W^T, dW = X^T dY) multiply fp8 operands with fp32 accumulation
and are then multiplied by the product of the two operands' scales. This is the recipe
torchao calls "tensorwise" dynamic scaling and Transformer Engine "current scaling", the
scale of a tensor being amax(|t|) / (the fp8 type's largest value), so t / scale fills the
fp8 range. It is stateless: nothing is carried between steps, so the train state, checkpoints
and the optimizer do not change, and a run can switch fp8 on or off when it resumes. Delayed
scaling (flax's `Fp8DotGeneralOp`, Transformer Engine's default: scales from an amax history
of earlier steps, kept as extra model state) saves the amax reduction before each cast, at the
price of state in every checkpoint, a second optimizer path for that state and scales that
lag a changing tensor; current scaling is torchao's default recipe (which torchtitan's fp8
training uses).

The shape of the program is the one XLA's GPU `GemmRewriter` turns into cuBLASLt fp8 GEMMs
(`__cublas$lt$matmul$f8`, Hopper and Ada): a `dot_general` of two fp8 operands with an fp32
result, multiplied by a scalar (the product of the scales). cuBLASLt takes one e4m3 and one
e5m2 operand, never two e5m2, which is why only the gradient is e5m2. XLA transposes and pads
the operands as cuBLASLt wants (K-major, multiples of 16). On other platforms (CPU, TPU) XLA
computes the same numbers by converting the fp8 operands up: exact in value, but no faster.

The residuals kept for the backward pass are the fp8 operands and their scales: 1 byte per
element instead of 2 (bf16), so fp8 layers also hold less activation memory.
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

"""A 1-D "SAME" convolution whose backward XLA:CPU runs at full speed inside a loop.

The gradient of `lax.conv_general_dilated` is two more convolutions: the input's (the output
gradient against the flipped kernel) and the kernel's (the input against the output gradient,
the batch contracted). Outside a loop XLA:CPU's layout pass rewrites the kernel's into the
canonical (batch, space, feature) form its fast convolution runs; inside a `lax.scan` body (the
train step's micro-batch accumulation, and the noise meter's pieces, trainer/step/train_step.py)
it does not, and the naive form runs 20-30x slower (jax-ml/jax#12868; a ResNet step at batch 2048
in two micro-batches took 10.5 s against 0.45 s in one). Here both backward convolutions are
written in the canonical form, transposes explicit, so that the step costs the same in a loop or
out of it (`python bench/conv_in_scan.py`). Values are lax's: the same sums (tests/test_conv.py).
"""
from __future__ import annotations

import jax
from jax import lax

_DN = ("NWC", "WIO", "NWC")  # [batch, length, channels], [taps, in, out]


def _same(x, w, pad):
  return lax.conv_general_dilated(x, w, (1,), [pad], dimension_numbers=_DN)


@jax.custom_vjp
def conv1d_same(x_BLC, w_KCO):
  """y[b, l, o] = sum_{t, c} x[b, l + t - lo, c] w[t, c, o], zero outside; lo = (K - 1) // 2
  (lax's and flax's "SAME")."""
  k = w_KCO.shape[0]
  return _same(x_BLC, w_KCO, ((k - 1) // 2, k // 2))


def _fwd(x_BLC, w_KCO):
  return conv1d_same(x_BLC, w_KCO), (x_BLC, w_KCO)


def _bwd(res, dy_BLO):
  x_BLC, w_KCO = res
  k = w_KCO.shape[0]
  lo, hi = (k - 1) // 2, k // 2
  # dx[b, l, c] = sum_{t, o} dy[b, l - t + lo, o] w[t, c, o]: dy against the flipped kernel with
  # in and out swapped, the padding mirrored
  dx = _same(dy_BLO, w_KCO[::-1].swapaxes(1, 2), (hi, lo))
  # dw[t, c, o] = sum_{b, l} x[b, l + t - lo, c] dy[b, l, o]: a convolution whose "batch" is the
  # input channel, whose space is the position and whose features are the batch
  dw_CKO = _same(x_BLC.transpose(2, 1, 0), dy_BLO.transpose(1, 0, 2), (lo, hi))
  return dx.astype(x_BLC.dtype), dw_CKO.transpose(1, 0, 2).astype(w_KCO.dtype)


conv1d_same.defvjp(_fwd, _bwd)


def conv_general_dilated(lhs, rhs, window_strides, padding, lhs_dilation=None, rhs_dilation=None,
                         dimension_numbers=None, feature_group_count=1, precision=None,
                         out_sharding=None, **kw):
  """`nnx.Conv(..., conv_general_dilated=conv_general_dilated)`: `conv1d_same` for the one
  convolution the ResNet uses (1-D, "SAME", stride, dilation and groups 1, flax's channels-last
  layout, default precision); anything else is lax's, unchanged."""
  plain = (lhs.ndim == 3 and padding == "SAME" and tuple(window_strides) == (1,)
           and tuple(lhs_dilation or (1,)) == (1,) and tuple(rhs_dilation or (1,)) == (1,)
           and feature_group_count == 1 and precision is None and out_sharding is None
           and not kw and lax.conv_dimension_numbers(lhs.shape, rhs.shape, dimension_numbers)
           == lax.conv_dimension_numbers(lhs.shape, rhs.shape, _DN))
  if plain:
    return conv1d_same(lhs, rhs)
  return lax.conv_general_dilated(lhs, rhs, window_strides, padding, lhs_dilation, rhs_dilation,
                                  dimension_numbers, feature_group_count, precision=precision,
                                  out_sharding=out_sharding, **kw)

"""The ResNet's 1-D convolution (models/conv.py): lax's values and gradients, written so that its
backward compiles to XLA:CPU's canonical convolutions inside a scan (the micro-batch loop), and
lax's own convolution for anything but the one case it covers."""
import re

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from flax import nnx

from models.conv import conv1d_same, conv_general_dilated

DN = ("NWC", "WIO", "NWC")


def _lax(x, w):
  return jax.lax.conv_general_dilated(x, w, (1,), "SAME", dimension_numbers=DN)


def _loss(conv):  # two layers, so the input gradient of the second reaches the first
  return lambda w, x: jnp.sum(jnp.sin(conv(jax.nn.relu(conv(x, w)), w)))


@pytest.mark.parametrize("kernel", [1, 3, 4, 5])
def test_values_and_gradients_are_laxs(kernel):
  kx, kw = jax.random.split(jax.random.key(kernel))
  x = jax.random.normal(kx, (6, 11, 4))
  w = jax.random.normal(kw, (kernel, 4, 4)) / kernel
  np.testing.assert_allclose(conv1d_same(x, w), _lax(x, w), rtol=1e-5, atol=1e-5)
  ours = jax.grad(_loss(conv1d_same), argnums=(0, 1))(w, x)
  theirs = jax.grad(_loss(_lax), argnums=(0, 1))(w, x)
  for a, b in zip(ours, theirs):
    np.testing.assert_allclose(a, b, rtol=1e-5, atol=1e-5)


def _scanned_convolutions(conv):
  """dim_labels of every convolution in the compiled gradient accumulated over a scan."""
  g = jax.grad(_loss(conv))
  x, w = jnp.ones((2, 16, 12, 8)), jnp.ones((5, 8, 8)) * 0.1
  f = lambda w, x: jax.lax.scan(lambda acc, xb: (acc + g(w, xb), None), jnp.zeros_like(w), x)[0]
  text = jax.jit(f).lower(w, x).compile().as_text()
  return re.findall(r"convolution\(.*dim_labels=(\S+?),", text)


def test_the_backward_is_canonical_inside_a_scan():
  """XLA:CPU runs (batch, space, feature) convolutions on its fast path; lax's kernel gradient
  inside a loop body is left as f0b_i0o->0bf, which runs 20-30x slower (bench/conv_in_scan.py)."""
  ours = _scanned_convolutions(conv1d_same)
  # two forward, two kernel gradients, one input gradient (the first layer's input has none)
  assert len(ours) == 5 and set(ours) == {"b0f_0io->b0f"}, ours
  assert set(_scanned_convolutions(_lax)) != {"b0f_0io->b0f"}  # what the module exists for


def test_nnx_conv_uses_it_only_where_it_applies():
  """flax's call of the one case is ours (its gradient's HLO says so); a strided convolution
  is lax's, unchanged."""
  x = jax.random.normal(jax.random.key(0), (3, 10, 4))
  for strides in (1, 2):
    ours = nnx.Conv(4, 5, (3,), strides=strides, conv_general_dilated=conv_general_dilated,
                    rngs=nnx.Rngs(0))
    plain = nnx.Conv(4, 5, (3,), strides=strides, rngs=nnx.Rngs(0))
    np.testing.assert_allclose(ours(x), plain(x), rtol=1e-5, atol=1e-5)
  layer = nnx.Conv(4, 5, (3,), conv_general_dilated=conv_general_dilated, rngs=nnx.Rngs(0))
  jaxpr = str(jax.make_jaxpr(lambda x: layer(x))(x))
  assert "custom_vjp_call" in jaxpr, jaxpr
  strided = nnx.Conv(4, 5, (3,), strides=2, conv_general_dilated=conv_general_dilated,
                     rngs=nnx.Rngs(0))
  assert "custom_vjp_call" not in str(jax.make_jaxpr(lambda x: strided(x))(x))

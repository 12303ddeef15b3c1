"""Chunked cross-entropy (`models/cross_entropy.py`): the same loss and gradients as the full
logits, and the compiled program holds one chunk's logits instead of all of them."""
import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest

from models.cross_entropy import chunked_cross_entropy


def full_loss(x_BSE, head_EV, targets_BS, mask_BS):
  logits = jnp.einsum("bse,ev->bsv", x_BSE, head_EV, preferred_element_type=jnp.float32)
  losses = optax.softmax_cross_entropy_with_integer_labels(logits, targets_BS)
  return jnp.sum(losses * mask_BS)


def _inputs(B=2, S=32, E=16, V=300, seed=0):
  k = jax.random.split(jax.random.key(seed), 4)
  x = jax.random.normal(k[0], (B, S, E))
  head = jax.random.normal(k[1], (E, V)) * 0.5
  targets = jax.random.randint(k[2], (B, S), 0, V)
  mask = jax.random.bernoulli(k[3], 0.8, (B, S)).astype(jnp.float32)
  return x, head, targets, mask


@pytest.mark.parametrize("chunk", [32, 8, 1])
def test_loss_and_gradients_equal_the_full_logits(chunk):
  x, head, targets, mask = _inputs()
  want, (gx_want, gh_want) = jax.value_and_grad(full_loss, argnums=(0, 1))(x, head, targets, mask)
  chunked = lambda x, h: chunked_cross_entropy(x, h, targets, mask, chunk=chunk)
  got, (gx, gh) = jax.jit(jax.value_and_grad(chunked, argnums=(0, 1)))(x, head)
  np.testing.assert_allclose(got, want, rtol=2e-6)
  np.testing.assert_allclose(gx, gx_want, rtol=2e-5, atol=1e-6)
  np.testing.assert_allclose(gh, gh_want, rtol=2e-5, atol=1e-6)


def test_chunk_must_divide_the_sequence():
  x, head, targets, mask = _inputs()
  with pytest.raises(ValueError, match="chunk=5 must divide the sequence length 32"):
    chunked_cross_entropy(x, head, targets, mask, chunk=5)


def _temp_bytes(fn, *args):
  return jax.jit(jax.grad(fn, argnums=(0, 1))).lower(*args).compile().memory_analysis() \
      .temp_size_in_bytes


def test_compiled_step_holds_one_chunk_of_logits():
  """fwd+bwd temp memory at V = 16k (compiled buffer assignment): the full loss keeps the
  [B, S, V] logits and their gradient; 8 chunks keep about three [B, S/8, V] buffers."""
  B, S, E, V = 2, 256, 32, 16384
  args = (jax.ShapeDtypeStruct((B, S, E), jnp.float32), jax.ShapeDtypeStruct((E, V), jnp.float32),
          jax.ShapeDtypeStruct((B, S), jnp.int32), jax.ShapeDtypeStruct((B, S), jnp.float32))
  full = _temp_bytes(full_loss, *args)
  chunked = _temp_bytes(lambda x, h, t, m: chunked_cross_entropy(x, h, t, m, chunk=S // 8), *args)
  logits = B * S * V * 4
  assert full >= 2 * logits, (full, logits)
  assert chunked < 3.2 * logits / 8, (chunked, logits)

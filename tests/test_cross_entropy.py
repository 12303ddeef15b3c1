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


# ----------------------------------------------------------------------------------------------
# In the model and the train step (`model.logits_chunk`).


@pytest.mark.parametrize("tied", [False, True])
def test_training_with_logits_chunk_equals_full_logits(tmp_path, tied):
  """Same losses, gradient norms and updates step by step on a mesh whose `tensor` axis splits
  the vocabulary and whose `sequence` axis splits the chunks' positions."""
  from conftest import metric_rows, tiny_config
  from trainer.loop import Run

  def run(chunk):
    cfg = tiny_config(**{"steps": 3, "model.logits_chunk": chunk, "model.tie_embeddings": tied,
                         "mesh.data": 1, "mesh.fsdp": 2, "mesh.tensor": 2, "mesh.sequence": 2})
    Run(cfg, str(tmp_path / f"c{chunk}")).train()
    return metric_rows(tmp_path / f"c{chunk}")

  full, chunked = run(0), run(8)
  for step in (1, 2, 3):
    for key in ("loss", "grad_norm", "update_norm", "param_norm"):
      np.testing.assert_allclose(chunked[step][key], full[step][key], rtol=2e-6, err_msg=key)


def test_logits_chunk_is_validated():
  from conftest import tiny_config
  from trainer.config import ConfigError
  from trainer.config_checks import validate
  with pytest.raises(ConfigError, match=r"model.logits_chunk=5 must divide data.seq_len=32"):
    validate(tiny_config(**{"model.logits_chunk": 5}), 8)
  with pytest.raises(ConfigError, match=r"multiple of mesh.sequence=4"):
    validate(tiny_config(**{"model.logits_chunk": 2, "mesh.data": 2, "mesh.sequence": 4}), 8)


def test_train_step_memory_with_a_large_vocabulary():
  """The compiled train step at V = 32k: chunking the loss removes the full-size logits."""
  import jax as jax_
  from conftest import tiny_config
  from sharding.mesh import make_mesh
  from trainer.program import Program

  def temp(chunk):
    cfg = tiny_config(**{"model.vocab_size": 32768, "model.logits_chunk": chunk,
                         "data.seq_len": 128, "mesh.data": 1})
    program = Program(cfg, make_mesh(cfg.mesh, jax_.devices()[:1]))
    return program.compile().memory_analysis().temp_size_in_bytes

  logits = 8 * 128 * 32768 * 4  # one [B, S, V] fp32 array
  full, chunked = temp(0), temp(16)
  assert full > 2 * logits and chunked < full - 1.5 * logits, (full, chunked, logits)

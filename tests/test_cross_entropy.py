"""Chunked cross-entropy (`models/cross_entropy.py`): the same loss and gradients as the full
logits (to fp32 rounding; bf16's dX bit for bit, its dW closer to exact), the head's matmuls
run once each (no chunk recomputed in the backward), and the compiled program holds one chunk's
logits instead of all of them."""
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


def _rel(a, b) -> float:
  a, b = np.asarray(a, np.float64), np.asarray(b, np.float64)
  return float(np.linalg.norm(a - b) / np.linalg.norm(b))


@pytest.mark.parametrize("chunk", [32, 8, 1])
def test_loss_and_gradients_equal_the_full_logits(chunk):
  """fp32: the loss, dX and dW (and the mask's cotangent) of the unchunked loss to fp32
  rounding (measured <= 4.3e-7 relative; summation order differs)."""
  x, head, targets, mask = _inputs()
  want, gwant = jax.value_and_grad(full_loss, argnums=(0, 1, 3))(x, head, targets, mask)
  chunked = lambda x, h, m: chunked_cross_entropy(x, h, targets, m, chunk=chunk)
  got, grads = jax.jit(jax.value_and_grad(chunked, argnums=(0, 1, 2)))(x, head, mask)
  np.testing.assert_allclose(got, want, rtol=1e-6)
  for what, g, w in zip(("dx", "dhead", "dmask"), grads, gwant):
    assert _rel(g, w) < 1e-6, (what, _rel(g, w))
  # without differentiation, only the loss (the primal rule): the same number
  np.testing.assert_allclose(jax.jit(chunked)(x, head, mask), got, rtol=1e-6)


def test_bf16_dx_is_the_unchunked_one_and_dw_is_closer_to_exact():
  """bf16 compute over fp32 parameters, as the model runs: dX bit for bit the unchunked loss's
  (the same mixed matmul per row, rounded once), dW summed in fp32 across chunks where autodiff
  rounds the unchunked product to bf16, so it is nearer the float64 gradient."""
  x, head, targets, mask = _inputs(S=64, V=1000)
  x = x.astype(jnp.bfloat16)

  def unchunked(x, h):
    logits = jnp.einsum("bse,ev->bsv", x, h.astype(jnp.bfloat16),
                        preferred_element_type=jnp.float32)
    return jnp.sum(optax.softmax_cross_entropy_with_integer_labels(logits, targets) * mask)

  chunked = lambda x, h: chunked_cross_entropy(x, h, targets, mask, chunk=16,
                                               dtype=jnp.bfloat16)
  want, (gx_want, gh_want) = jax.jit(jax.value_and_grad(unchunked, argnums=(0, 1)))(x, head)
  got, (gx, gh) = jax.jit(jax.value_and_grad(chunked, argnums=(0, 1)))(x, head)
  np.testing.assert_allclose(got, want, rtol=1e-6)
  assert gx.dtype == jnp.bfloat16 and gh.dtype == jnp.float32
  np.testing.assert_array_equal(np.asarray(gx, np.float32), np.asarray(gx_want, np.float32))
  x64, h64 = np.asarray(x, np.float64), np.asarray(head, np.float64)  # float64, by hand
  logits = x64 @ h64
  p = np.exp(logits - logits.max(-1, keepdims=True))
  p /= p.sum(-1, keepdims=True)
  dlogits = (p - np.eye(h64.shape[1])[np.asarray(targets)]) * np.asarray(mask)[..., None]
  exact = np.einsum("bse,bsv->ev", x64, dlogits)
  assert _rel(gh, exact) < 0.9 * _rel(gh_want, exact), (_rel(gh, exact), _rel(gh_want, exact))


def test_the_head_matmuls_run_once_each():
  """The loss and its gradients (what a train step asks: `value_and_grad`) cost the unchunked
  loss's matmul FLOPs (forward, dX, dW: 3 x 2 B S E V), not a fourth recomputing each chunk's
  logits; the loss alone costs one (tools/hlo.py counts every trip of the chunk loop)."""
  from tools.hlo import Module
  B, S, E, V = 2, 256, 32, 4096
  args = (jax.ShapeDtypeStruct((B, S, E), jnp.float32), jax.ShapeDtypeStruct((E, V), jnp.float32),
          jax.ShapeDtypeStruct((B, S), jnp.int32), jax.ShapeDtypeStruct((B, S), jnp.float32))
  chunked = lambda x, h, t, m: chunked_cross_entropy(x, h, t, m, chunk=32)
  flops = lambda fn: sum(k.total_flops for k in Module(
      jax.jit(fn).lower(*args).compile().as_text()).kernels())
  matmul = 2 * B * S * E * V
  both = flops(jax.value_and_grad(chunked, argnums=(0, 1)))
  assert both == flops(jax.value_and_grad(full_loss, argnums=(0, 1))) == 3 * matmul
  assert flops(chunked) == matmul


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
  from trainer.run.loop import Run

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
  from trainer.config.checks import validate
  with pytest.raises(ConfigError, match=r"model.logits_chunk=5 must divide data.seq_len=32"):
    validate(tiny_config(**{"model.logits_chunk": 5}), 8)
  with pytest.raises(ConfigError, match=r"multiple of mesh.sequence=4"):
    validate(tiny_config(**{"model.logits_chunk": 2, "mesh.data": 2, "mesh.sequence": 4}), 8)


def test_train_step_memory_with_a_large_vocabulary():
  """The compiled train step at V = 32k: chunking the loss removes the full-size logits."""
  import jax as jax_
  from conftest import tiny_config
  from sharding.mesh import make_mesh
  from trainer.step.program import Program

  def temp(chunk):
    cfg = tiny_config(**{"model.vocab_size": 32768, "model.logits_chunk": chunk,
                         "data.seq_len": 128, "mesh.data": 1})
    program = Program(cfg, make_mesh(cfg.mesh, jax_.devices()[:1]))
    return program.compile().memory_analysis().temp_size_in_bytes

  logits = 8 * 128 * 32768 * 4  # one [B, S, V] fp32 array
  full, chunked = temp(0), temp(16)
  assert full > 2 * logits and chunked < full - 1.5 * logits, (full, chunked, logits)

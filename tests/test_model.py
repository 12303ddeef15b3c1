"""The model: causality, document isolation, GQA, dtypes, remat, FLOP count."""
import dataclasses

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from flax import nnx

from models.llama import ModelConfig, Transformer
from models.sizes import flops_per_token, param_counts

CFG = ModelConfig(vocab_size=512, d_model=32, num_layers=2, num_heads=4, num_kv_heads=2,
                  mlp_dim=64)


@pytest.fixture(scope="module")
def model():
  return Transformer(CFG, rngs=nnx.Rngs(params=0))


@pytest.fixture(scope="module")
def forward(model):
  graphdef, params = nnx.split(model)
  return jax.jit(lambda p, t, pos, seg: nnx.merge(graphdef, p)(t, pos, seg)), params


def _tokens(seed, shape=(2, 24)):
  return jax.random.randint(jax.random.key(seed), shape, 0, 259)


def test_shapes_and_param_count(model):
  logits = model(_tokens(0))
  assert logits.shape == (2, 24, CFG.vocab_size) and logits.dtype == jnp.float32
  n = sum(x.size for x in jax.tree.leaves(nnx.state(model, nnx.Param)))
  assert n == param_counts(CFG)["total"]


def test_causal(forward):
  fwd, params = forward
  toks = _tokens(1)
  pos = jnp.broadcast_to(jnp.arange(24), toks.shape)
  seg = jnp.ones_like(toks)
  a = fwd(params, toks, pos, seg)
  b = fwd(params, toks.at[:, 15:].set(7), pos, seg)
  np.testing.assert_allclose(a[:, :15], b[:, :15], atol=1e-6)
  assert not np.allclose(a[:, 15:], b[:, 15:])


def test_packed_documents_do_not_see_each_other(forward):
  """Doc 2 in a packed row gives the same logits as doc 2 alone at the start of a row."""
  fwd, params = forward
  toks = _tokens(2, (1, 24))
  seg = jnp.array([[1] * 10 + [2] * 14])
  pos = jnp.array([list(range(10)) + list(range(14))])
  packed = fwd(params, toks, pos, seg)
  alone = fwd(params, jnp.concatenate([toks[:, 10:], toks[:, :10]], 1),
              jnp.array([list(range(14)) + list(range(10))]),
              jnp.array([[1] * 14 + [2] * 10]))
  np.testing.assert_allclose(packed[:, 10:], alone[:, :14], atol=1e-5)


def test_gqa_equals_mha_with_repeated_kv_heads():
  gqa = Transformer(CFG, rngs=nnx.Rngs(params=0))
  mha_cfg = dataclasses.replace(CFG, num_kv_heads=CFG.num_heads)
  mha = Transformer(mha_cfg, rngs=nnx.Rngs(params=0))
  group = CFG.num_heads // CFG.num_kv_heads
  for name in ("wk_EKD", "wv_EKD"):
    w = getattr(gqa.blocks.attn, name)[...]
    getattr(mha.blocks.attn, name)[...] = jnp.repeat(w, group, axis=2)
  for name in ("wq_EHD", "wo_HDE"):
    getattr(mha.blocks.attn, name)[...] = getattr(gqa.blocks.attn, name)[...]
  mha.embed_VE[...] = gqa.embed_VE[...]
  mha.lm_head_EV[...] = gqa.lm_head_EV[...]
  for name in ("w_gate_EF", "w_up_EF", "w_down_FE"):
    getattr(mha.blocks.mlp, name)[...] = getattr(gqa.blocks.mlp, name)[...]
  toks = _tokens(3)
  np.testing.assert_allclose(gqa(toks), mha(toks), atol=1e-5)


@pytest.mark.parametrize("remat", ["full", "dots"])
def test_remat_does_not_change_gradients(remat):
  toks = _tokens(4)

  def grads(cfg):
    graphdef, params = nnx.split(Transformer(cfg, rngs=nnx.Rngs(params=0)))
    loss = lambda p: jnp.mean(nnx.merge(graphdef, p)(toks) ** 2)
    return jax.jit(jax.grad(loss))(params)

  jax.tree.map(lambda a, b: np.testing.assert_allclose(a, b, rtol=1e-5, atol=1e-7),
               grads(CFG), grads(dataclasses.replace(CFG, remat=remat)))


def test_bf16_compute_is_close_to_fp32():
  toks = _tokens(5)
  f32 = Transformer(CFG, rngs=nnx.Rngs(params=0))(toks)
  bf16 = Transformer(dataclasses.replace(CFG, dtype="bfloat16"), rngs=nnx.Rngs(params=0))(toks)
  assert bf16.dtype == jnp.float32  # logits are always fp32
  np.testing.assert_allclose(bf16, f32, atol=5e-2)


def test_tied_embeddings_share_the_table():
  cfg = dataclasses.replace(CFG, tie_embeddings=True)
  m = Transformer(cfg, rngs=nnx.Rngs(params=0))
  assert not hasattr(m, "lm_head_EV")
  assert param_counts(cfg)["total"] == sum(
      x.size for x in jax.tree.leaves(nnx.state(m, nnx.Param)))


def test_flop_count_matches_xla_cost_analysis():
  """Forward FLOPs from XLA's cost analysis agree with our formula (non-causal convention).

  XLA's count includes the full (masked) attention matrix and elementwise work, so we compare
  against `causal=False` on a model wide enough for matmuls to dominate. One layer, because
  XLA counts the body of the layer scan (a while loop) once, whatever its trip count.
  """
  cfg = ModelConfig(vocab_size=512, d_model=256, num_layers=1, num_heads=4, num_kv_heads=4,
                    mlp_dim=1024)
  B, S = 2, 128
  graphdef, params = nnx.split(nnx.eval_shape(lambda: Transformer(cfg, rngs=nnx.Rngs(0))))
  toks = jax.ShapeDtypeStruct((B, S), jnp.int32)
  cost = jax.jit(lambda p, t: nnx.merge(graphdef, p)(t)).lower(params, toks).cost_analysis()
  xla_forward = cost["flops"]
  ours_forward = flops_per_token(cfg, S, causal=False)["total"] / 3 * B * S
  assert abs(xla_forward / ours_forward - 1) < 0.05, (xla_forward, ours_forward)


@pytest.mark.parametrize("buffer", [True, False])
def test_rope_tables_equal_the_direct_ones_at_any_positions(buffer):
  """As buffers, `rope_tables` looks positions in [0, S) up in one [S, d/2] table and computes
  any others directly; both ways, and in place, it gives what the rotation's own sin/cos give,
  bit for bit."""
  from models.rope import RopeScaling, _sin_cos, rope_inv_freq, rope_tables  # noqa: PLC0415
  scaling = RopeScaling(type="llama3", original_max_position_embeddings=64)
  packed = np.array([[0, 1, 2, 0, 1, 2, 3, 4], [0, 1, 2, 3, 4, 5, 6, 7]], np.int32)
  for positions in (packed, packed + 1000, packed[:, :1] + 37):  # training rows, others
    tables = jax.jit(lambda p: rope_tables(p, 16, 10_000.0, scaling, buffer=buffer))(positions)
    sin, cos = jax.jit(lambda p: _sin_cos(p, rope_inv_freq(16, 10_000.0, scaling)))(positions)
    np.testing.assert_array_equal(tables.sin[:, :, 0], sin)
    np.testing.assert_array_equal(tables.cos[:, :, 0], cos)


def test_rope_sin_cos_are_computed_once_not_in_every_layer():
  """XLA fuses a sin/cos table computed in place into every layer's rotation and evaluates it
  there again (per head, forward and backward); on CPU the model makes the tables buffers once
  (`rope_tables(buffer=True)`), so the compiled gradient holds as many sine ops with 3 unrolled
  layers as with 1."""
  def sines(layers):
    cfg = dataclasses.replace(CFG, num_layers=layers, scan_unroll=layers)
    graphdef, params = nnx.split(Transformer(cfg, rngs=nnx.Rngs(params=0)))
    tokens = jnp.zeros((2, 16), jnp.int32)
    loss = lambda p: nnx.merge(graphdef, p)(tokens).sum()
    return jax.jit(jax.grad(loss)).lower(params).compile().as_text().count(" sine(")
  assert sines(3) == sines(1) > 0

"""The step's fast paths compute what the plain formulations do (issue 14): the einsum attention
equals `jax.nn.dot_product_attention`, the 2-D `dense` equals the einsum it replaces, and a
model with both gives the losses and gradients of one built the plain way; an unrolled layer
scan equals the rolled one, end to end through the train step."""
import dataclasses
import os

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from flax import nnx

import models.attention as attention_module
import models.llama as llama
import train
from models.attention import segment_mask, xla_attention, xla_masks
from models.llama import ModelConfig, Transformer


def _qkv(seed, B=2, S=12, H=4, K=4, D=8):
  k = jax.random.split(jax.random.key(seed), 3)
  return (jax.random.normal(k[0], (B, S, H, D)), jax.random.normal(k[1], (B, S, K, D)),
          jax.random.normal(k[2], (B, S, K, D)))


def _fwd_and_grads(fn, *args):
  out, vjp = jax.vjp(fn, *args)
  cot = jax.random.normal(jax.random.key(9), out.shape)
  return out, vjp(cot)


def _reference_attention(q, k, v, *, segment_ids=None, causal=True):
  mask = None if segment_ids is None else segment_mask(segment_ids)
  return jax.nn.dot_product_attention(q, k, v, mask=mask, is_causal=causal,
                                      implementation="xla")


@pytest.mark.parametrize("kv_heads", [4, 2])
@pytest.mark.parametrize("causal", [True, False])
@pytest.mark.parametrize("packed", ["no", "segment_ids", "xla_masks"])
@pytest.mark.parametrize("block", [128, 4], ids=["one_block", "3_query_blocks"])
def test_xla_attention_equals_dot_product_attention(kv_heads, causal, packed, block,
                                                    monkeypatch):
  """Packed documents given as segment ids (masked per layer) or as the masks the model makes
  from them once for all layers (`xla_masks`)."""
  monkeypatch.setattr(attention_module, "CAUSAL_BLOCK", block)
  q, k, v = _qkv(0, K=kv_heads)
  seg = jnp.array([[1] * 5 + [2] * 7, [1] * 12], jnp.int32) if packed != "no" else None
  given = xla_masks(seg, causal=causal) if packed == "xla_masks" else seg
  got = _fwd_and_grads(lambda *a: xla_attention(*a, segment_ids=given, causal=causal), q, k, v)
  want = _fwd_and_grads(
      lambda *a: _reference_attention(*a, segment_ids=seg, causal=causal), q, k, v)
  jax.tree.map(lambda a, b: np.testing.assert_allclose(a, b, rtol=1e-5, atol=1e-5), got, want)


@pytest.mark.parametrize("contract,spec", [(1, "bse,ehd->bshd"), (2, "bshd,hde->bse"),
                                           (1, "bse,ef->bsf")])
def test_dense_equals_einsum(contract, spec):
  shapes = {"b": 2, "s": 3, "e": 8, "h": 2, "d": 4, "f": 5}
  lhs, rhs = spec.split("->")[0].split(",")
  k1, k2 = jax.random.split(jax.random.key(1))
  x = jax.random.normal(k1, [shapes[c] for c in lhs])
  w = jax.random.normal(k2, [shapes[c] for c in rhs])
  got = _fwd_and_grads(lambda x, w: llama.dense(x, w, contract), x, w)
  want = _fwd_and_grads(lambda x, w: jnp.einsum(spec, x, w), x, w)
  jax.tree.map(lambda a, b: np.testing.assert_allclose(a, b, rtol=1e-5, atol=1e-5), got, want)


def _einsum_dense(x, w, contract, fp8=False):
  """The einsum formulation the model used before `dense` (tensordot over the same axes)."""
  assert not fp8
  return jnp.tensordot(x, w, axes=contract)


CFG = ModelConfig(vocab_size=64, d_model=32, num_layers=3, num_heads=4, num_kv_heads=2,
                  mlp_dim=48, tie_embeddings=True)


def _loss_and_grads(cfg):
  graphdef, params = nnx.split(Transformer(cfg, rngs=nnx.Rngs(params=0)))
  toks = jax.random.randint(jax.random.key(2), (2, 17), 0, cfg.vocab_size)
  seg = jnp.array([[1] * 9 + [2] * 8, [1] * 17], jnp.int32)
  pos = jnp.broadcast_to(jnp.arange(16), (2, 16))

  def loss(p):
    total, n = nnx.merge(graphdef, p).loss_sums(toks[:, :-1], pos, seg[:, :-1], toks[:, 1:],
                                                jnp.ones((2, 16), bool))
    return total / n

  return jax.jit(jax.value_and_grad(loss))(params)


def test_model_equals_the_plain_formulation(monkeypatch):
  """Loss and gradients of the model with the fast paths (masks made once for all layers) ==
  with jax.nn.dot_product_attention from segment ids in every layer and einsum projections
  (GQA, packed documents), to fp32 rounding."""
  monkeypatch.setattr(attention_module, "CAUSAL_BLOCK", 8)  # two query blocks of 8
  fast = _loss_and_grads(CFG)
  monkeypatch.setattr(attention_module, "xla_attention", _reference_attention)
  monkeypatch.setattr(llama, "layer_segments", lambda ids, *a, **k: ids)  # ids in every layer
  monkeypatch.setattr(llama, "dense", _einsum_dense)
  plain = _loss_and_grads(CFG)
  np.testing.assert_allclose(fast[0], plain[0], rtol=1e-6)
  jax.tree.map(lambda a, b: np.testing.assert_allclose(a, b, rtol=1e-5, atol=1e-7),
               fast[1], plain[1])


@pytest.mark.parametrize("unroll", [2, 3])
def test_scan_unroll_does_not_change_gradients(unroll):
  rolled = _loss_and_grads(CFG)
  unrolled = _loss_and_grads(dataclasses.replace(CFG, scan_unroll=unroll))
  np.testing.assert_allclose(unrolled[0], rolled[0], rtol=1e-6)
  jax.tree.map(lambda a, b: np.testing.assert_allclose(a, b, rtol=1e-5, atol=1e-7),
               unrolled[1], rolled[1])


def test_scan_unroll_must_be_positive(tmp_path, capsys):
  tiny = os.path.join(os.path.dirname(os.path.dirname(os.path.abspath(__file__))), "configs",
                      "lm_tiny.py")
  code = train.main(["--config", tiny, "--workdir", str(tmp_path / "w"),
                     "--config.model.scan_unroll=0"])
  err = capsys.readouterr().err
  assert code == 2 and "model.scan_unroll=0: must be positive" in err, err

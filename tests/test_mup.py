"""muP (model.parametrization="mup"): equal to SP at the base width, the multipliers and
per-parameter learning rates at other widths, config validation, and a small coordinate check."""
import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest
from flax import nnx

from conftest import tiny_config
from models.llama import Attention, ModelConfig, Transformer
from optim import build_optimizer
from optim.factory import lr_multipliers
from optim.muon import base_scale, mup_shape_scale
from optim.muon import dimension_numbers as muon_dimension_numbers
from sharding import make_mesh
from tools import coord_check
from trainer.config import ConfigError, default_config
from trainer.config.checks import validate
from trainer.step.program import Program
from trainer.step.state import _logical_names


def _model(parametrization, d_model, base_width, **kw):
  cfg = ModelConfig(vocab_size=64, d_model=d_model, num_layers=2, num_heads=2, num_kv_heads=1,
                    mlp_dim=2 * d_model, parametrization=parametrization, base_width=base_width,
                    **kw)
  return Transformer(cfg, rngs=nnx.Rngs(0))


def _params(model):
  return nnx.to_pure_dict(nnx.state(model))


TOKENS = jnp.arange(24, dtype=jnp.int32).reshape(2, 12) % 64


@pytest.mark.parametrize("tie", [False, True])
def test_mup_at_base_width_is_sp(tie):
  sp, mup = _model("sp", 32, 0, tie_embeddings=tie), _model("mup", 32, 32, tie_embeddings=tie)
  assert mup.cfg.width_multiplier == 1.0
  jax.tree.map(np.testing.assert_array_equal, _params(sp), _params(mup))
  np.testing.assert_array_equal(sp(TOKENS), mup(TOKENS))


def test_mup_multipliers_at_twice_the_base_width():
  sp, mup = _model("sp", 64, 0), _model("mup", 64, 32)
  assert mup.cfg.width_multiplier == 2.0
  p_sp, p_mup = _params(sp), _params(mup)
  # Same keys: the muP init is SP's scaled, hidden matrices by 1/sqrt(m); embedding and head kept.
  for name in ("wq_EHD", "wk_EKD", "wv_EKD", "wo_HDE"):
    np.testing.assert_allclose(p_mup["blocks"]["attn"][name], p_sp["blocks"]["attn"][name]
                               / np.sqrt(2), rtol=1e-6)
  for name in ("w_gate_EF", "w_up_EF", "w_down_FE"):
    np.testing.assert_allclose(p_mup["blocks"]["mlp"][name], p_sp["blocks"]["mlp"][name]
                               / np.sqrt(2), rtol=1e-6)
  np.testing.assert_array_equal(p_mup["embed_VE"], p_sp["embed_VE"])
  np.testing.assert_array_equal(p_mup["lm_head_EV"], p_sp["lm_head_EV"])
  # Output multiplier 1/m in head(), read by both the full logits and the chunked loss.
  np.testing.assert_allclose(mup.head(), p_mup["lm_head_EV"] / 2, rtol=1e-7)
  # Attention 1/D: base head dim 16, head dim 32 -> queries times sqrt(16/32).
  assert mup.cfg.query_multiplier == pytest.approx(np.sqrt(0.5))
  x = jnp.ones((1, 3, 64))
  pos = jnp.broadcast_to(jnp.arange(3), (1, 3))
  attn = Attention(mup.cfg, rngs=nnx.Rngs(0))
  q_mup = attn.qkv(x, pos)[0]
  attn.cfg = sp.cfg  # the same weights read without muP's query multiplier
  np.testing.assert_allclose(q_mup, attn.qkv(x, pos)[0] * np.sqrt(0.5), rtol=1e-5, atol=1e-7)
  # With head_dim fixed (heads grow with width) the attention scale is SP's.
  assert _model("mup", 64, 32, head_dim=16).cfg.query_multiplier == 1.0


def _adamw():
  o = default_config().optim
  o.update(name="adamw", learning_rate=0.1, schedule="constant", warmup_steps=0,
           weight_decay=0.1, clip_norm=0.0)
  return o


def test_hidden_matrices_step_one_over_m_under_adam():
  model = _model("mup", 64, 32)
  names = _logical_names(nnx.state(model))
  params = _params(model)
  grads = jax.tree.map(lambda p: jnp.full_like(p, 0.3), params)
  updates = {}
  for m in (1.0, 2.0):
    tx, _ = build_optimizer(_adamw(), names, 10, width_multiplier=m)
    updates[m], _ = tx.update(grads, tx.init(params), params)
  mult = lr_multipliers(names, 2.0)
  assert mult["blocks"]["attn"]["wq_EHD"] == 0.5 and mult["blocks"]["mlp"]["w_down_FE"] == 0.5
  assert mult["embed_VE"] == mult["lm_head_EV"] == mult["final_norm"]["scale"] == 1.0
  flat = lambda t: jax.tree_util.tree_flatten_with_path(t)[0]
  for (path, u2), (_, u1), k in zip(flat(updates[2.0]), flat(updates[1.0]),
                                     jax.tree.leaves(mult)):
    np.testing.assert_allclose(u2, k * u1, rtol=1e-6, err_msg=jax.tree_util.keystr(path))


def test_config_keys_reach_model_and_optimizer():
  """model.parametrization / base_width through validation and Program to the update."""
  updates = {}
  for par in ("sp", "mup"):
    cfg = tiny_config(**{"model.parametrization": par, "model.base_width": 16,
                         "optim.clip_norm": 0.0})
    validate(cfg, 1)
    program = Program(cfg, make_mesh(cfg.mesh, jax.devices()[:1]))
    assert program.model_cfg.width_multiplier == (2.0 if par == "mup" else 1.0)
    params = jax.tree.map(lambda a: jnp.zeros(a.shape, a.dtype), program.spec.abstract_params)
    grads = jax.tree.map(lambda p: jnp.full(p.shape, 0.1, p.dtype), params)
    u, _ = program.tx.update(grads, program.tx.init(params), params, step=jnp.int32(5))
    updates[par] = jax.device_get(u)
  ratio = lambda key: np.abs(updates["mup"][key[0]][key[1]][key[2]]).mean() / np.abs(
      updates["sp"][key[0]][key[1]][key[2]]).mean()
  assert ratio(("blocks", "mlp", "w_up_EF")) == pytest.approx(0.5, rel=1e-3)
  np.testing.assert_allclose(updates["mup"]["embed_VE"], updates["sp"]["embed_VE"], rtol=1e-6)


def _muon_update(d_model, base_width, rms=0.2):
  """Muon's first update of a random gradient for a muP model (base width `base_width`)."""
  model = _model("mup", d_model, base_width)
  names, params = _logical_names(nnx.state(model)), _params(model)
  grads = jax.tree.map(lambda p: jax.random.normal(jax.random.key(p.size), p.shape), params)
  o = _adamw()
  o.update(name="muon", weight_decay=0.0, learning_rate=1.0, b2=0.95)
  o.muon.rms = rms
  tx, _ = build_optimizer(o, names, 10, width_multiplier=model.cfg.width_multiplier)
  return jax.jit(tx.update)(grads, tx.init(params), params)[0]


@pytest.mark.parametrize("rms", [0.2, pytest.param(0.0, marks=pytest.mark.slow)])
def test_muon_under_mup_keeps_the_spectral_step_of_the_base_width(rms):
  """muP for Muon: a hidden matrix's orthogonalised update (spectral norm ~1) is scaled by
  sqrt(fan_out / fan_in), so its spectral norm is the base width's at every width; under SP
  (rms 0.2) it is rms x sqrt(max(fan_in, fan_out)) and grows as sqrt(m). The AdamW fallback
  (embedding, head, norms) keeps muP's Adam rules: unchanged by width."""
  spec = lambda u: float(np.linalg.norm(np.asarray(u["blocks"]["mlp"]["w_up_EF"][0]), ord=2))
  base, wide, wide_sp = _muon_update(32, 32, rms), _muon_update(64, 32, rms), \
      _muon_update(64, 64, rms)
  assert spec(wide) == pytest.approx(spec(base), rel=0.05)
  if rms:
    assert spec(wide_sp) == pytest.approx(np.sqrt(2) * spec(base), rel=0.05)
  # muP's factor against SP's shape scaling at the same width: 1/sqrt(m) for rms > 0, 1 for
  # Jordan's sqrt(max(1, fan_out / fan_in)), which is already width-independent.
  dims = muon_dimension_numbers(("layers", "embed", "mlp"))
  got = mup_shape_scale(("layers", "embed", "mlp"), dims, (2, 128, 256), rms, 4.0)
  assert got == pytest.approx(base_scale(128, 256, rms) / (2.0 if rms else 1.0))
  # The router reads the stream (fan-in scales) into a fixed number of experts.
  router = ("layers", "embed", None)
  r = mup_shape_scale(router, muon_dimension_numbers(router), (2, 128, 8), rms, 4.0)
  assert r == pytest.approx(base_scale(32, 8, rms) * 0.5)
  # The embedding is the fallback's, on muP's Adam rule (lr x 1): its step does not change.
  np.testing.assert_allclose(np.abs(wide["embed_VE"]).mean(), np.abs(base["embed_VE"]).mean(),
                             rtol=0.05)


def test_muons_fallback_lr_composes_with_mups_group_multipliers():
  """optim.muon.fallback_lr under muP (m = 2): the fallback's parameters step at fallback_lr
  times muP's Adam multiplier (1 on the embedding, 1/m on a hidden matrix Muon does not take:
  one whose other axis is `experts`), Muon's matrices keep muP's shape rule at their own rate."""
  names = {"embed_VE": ("vocab", "embed"), "gate_XE": ("experts", "embed"),
           "w_EF": ("embed", "mlp")}
  params = {k: jax.random.normal(jax.random.key(i), s) for i, (k, s) in
            enumerate({"embed_VE": (16, 8), "gate_XE": (4, 8), "w_EF": (8, 12)}.items())}
  grads = jax.tree.map(lambda p: jax.random.normal(jax.random.key(p.size), p.shape), params)

  def update(fallback_lr):
    o = _adamw()
    o.update(name="muon", learning_rate=0.02, weight_decay=0.0, b2=0.95)
    o.muon.fallback_lr = fallback_lr
    tx, _ = build_optimizer(o, names, 10, width_multiplier=2.0)
    return jax.jit(tx.update)(grads, tx.init(params), params)[0]

  held, shared = update(0.005), update(0.0)
  adam = lambda k, lr: optax.adam(lr, b1=0.9, b2=0.95, eps=1e-8).update(
      grads[k], optax.adam(lr, b1=0.9, b2=0.95, eps=1e-8).init(params[k]))[0]
  np.testing.assert_allclose(held["embed_VE"], adam("embed_VE", 0.005), rtol=1e-5, atol=1e-9)
  np.testing.assert_allclose(held["gate_XE"], adam("gate_XE", 0.0025), rtol=1e-5, atol=1e-9)
  np.testing.assert_allclose(shared["gate_XE"], adam("gate_XE", 0.01), rtol=1e-5, atol=1e-9)
  np.testing.assert_array_equal(held["w_EF"], shared["w_EF"])


def test_lr_transfer_joins_runs_by_the_rate_they_hold(tmp_path):
  """`tools.lr_transfer --join`: runs that hold Muon's fallback at different rates (or none)
  are told apart by name, and each one's best rate is its own curve's vertex."""
  from tools import figures, lr_transfer  # noqa: PLC0415
  paths = []
  for fallback, best in ((0.0, 2 ** -4), (2 ** -5, 2 ** -5)):
    rows = [{"parametrization": "mup", "width": w, "depth": 2, "seed": 0, "lr": 2.0 ** e,
             "fallback_lr": fallback, "score": 2 + (e - np.log2(best)) ** 2}
            for w in (32, 128) for e in (-6, -5, -4, -3)]
    paths.append(str(tmp_path / f"{fallback}.csv"))
    figures.write_csv(paths[-1], rows)
  best = lr_transfer.optima(lr_transfer.joined(paths))
  assert best[("mup, fallback at lr", 128)] == (pytest.approx(2 ** -4), True)
  assert best[("mup, fallback 0.0312", 32)] == (pytest.approx(2 ** -5), True)


@pytest.mark.parametrize("overrides, message", [
    ({"model.parametrization": "ntk"}, "model.parametrization='ntk'"),
    ({"model.parametrization": "mup", "model.base_width": -8}, "model.base_width=-8"),
    ({"model.parametrization": "mup", "model.base_width": 10}, "not divisible by model.num_heads"),
    ({"model.parametrization": "mup", "model.base_width": 16, "optim.name": "lamb"},
     "not optim.name='lamb'"),
])
def test_config_validation(overrides, message):
  with pytest.raises(ConfigError, match=message.replace("(", r"\(")):
    validate(tiny_config(**overrides), 1)
  # At its own base width muP is SP, so any optimizer is fine; Muon has muP's rules at any.
  validate(tiny_config(**{"model.parametrization": "mup", "model.base_width": 32,
                          "optim.name": "lamb"}), 1)
  validate(tiny_config(**{"model.parametrization": "mup", "model.base_width": 16,
                          "optim.name": "muon"}), 1)


def test_coordinate_check_flat_under_mup_growing_under_sp():
  # 16 x 32 tokens per batch: with 4 x 16 the slopes' sampling noise across data seeds was
  # ~0.25 (muP block0 -0.26..0.48 after training, SP block0 0.01..0.27 at init).
  setup = coord_check.Setup(base_width=16, num_layers=1, num_heads=4, seq_len=32, batch_size=16)
  rows = coord_check.coord_check(setup, [16, 64], steps=3, lr=0.02)
  s = coord_check.slopes(rows)
  print({k: round(v, 2) for k, v in s.items()})
  # Measured over data seeds 0-3: muP block0 0.09..0.33, logits 0.01..0.09; SP block0
  # 1.88..2.44, logits 0.85..0.98 (flat is 0, linear growth 1); at init block0 |slope| <= 0.13.
  for layer, gap in (("block0", 1.0), ("logits", 0.5)):
    assert abs(s[("mup", layer)]) < 0.4, s
    assert s[("sp", layer)] > s[("mup", layer)] + gap, s
  # At init (step 0) both are flat: the difference comes from the updates.
  s0 = coord_check.slopes(rows, step=0)
  assert abs(s0[("mup", "block0")]) < 0.25 and abs(s0[("sp", "block0")]) < 0.25, s0


def test_mup_model_off_its_base_width_is_not_exported_to_hf(tmp_path):
  """Hugging Face's Llama cannot carry muP's multipliers: to-hf refuses in one line."""
  from models.hf import ConvertError
  from tools import convert
  from trainer.run.loop import Run
  Run(tiny_config(**{"steps": 1, "checkpoint.every_steps": 1, "model.parametrization": "mup",
                     "model.base_width": 16}), str(tmp_path / "run")).train()
  with pytest.raises(ConvertError, match="muP model at width multiplier 2 .* cannot be exported"):
    convert.to_hf(str(tmp_path / "run"), str(tmp_path / "hf"))

"""Optimizer factory and schedules: values at known points, masks, layer-wise trust ratio."""
import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest

from optim import build_optimizer, build_schedule, masks
from trainer.config import default_config

NAMES = {
    "embed_VE": ("vocab", "embed"),
    "lm_head_EV": ("embed", "vocab"),
    "final_norm": {"scale": ("norm",)},
    "blocks": {"norm": {"scale": ("layers", "norm")},
               "w_EF": ("layers", "embed", "mlp")},
}


def _params(seed=0):
  shapes = {"embed_VE": (16, 8), "lm_head_EV": (8, 16), "final_norm": {"scale": (8,)},
            "blocks": {"norm": {"scale": (3, 8)}, "w_EF": (3, 8, 12)}}
  leaves, tree = jax.tree.flatten(shapes, is_leaf=lambda x: isinstance(x, tuple))
  keys = jax.random.split(jax.random.key(seed), len(leaves))
  return jax.tree.unflatten(tree, [jax.random.normal(k, s) for k, s in zip(keys, leaves)])


def _optim(**kw):
  c = default_config().optim
  c.update(kw)
  return c


def test_masks_follow_logical_names():
  m = masks(NAMES)
  assert m["decay"] == {"embed_VE": False, "lm_head_EV": True, "final_norm": {"scale": False},
                        "blocks": {"norm": {"scale": False}, "w_EF": True}}
  assert m["trust_ratio"]["blocks"] == {"norm": {"scale": False}, "w_EF": True}
  assert m["trust_ratio"]["embed_VE"] is True
  assert m["stacked"]["blocks"]["w_EF"] and not m["stacked"]["lm_head_EV"]
  assert masks(NAMES, decay_embeddings=True)["decay"]["embed_VE"] is True


@pytest.mark.parametrize("schedule,points", [
    ("constant", {0: 0.0, 5: 0.5, 10: 1.0, 60: 1.0, 200: 1.0}),
    ("linear", {0: 0.0, 10: 1.0, 60: 0.55, 110: 0.1, 300: 0.1}),
    ("cosine", {0: 0.0, 10: 1.0, 60: 0.55, 110: 0.1}),
    # wsd: horizon 110, decay over the last 20% (22 steps) from step 88, linear shape
    ("wsd", {10: 1.0, 88: 1.0, 99: 0.55, 110: 0.1}),
    # poly (power 2, MLPerf's LARS): 0.1 + 0.9 (1 - t/100)^2 after the warmup
    ("poly", {10: 1.0, 35: 0.60625, 60: 0.325, 110: 0.1, 300: 0.1}),
])
def test_schedule_values(schedule, points):
  cfg = _optim(learning_rate=1.0, warmup_steps=10, decay_steps=110, min_lr_ratio=0.1,
               schedule=schedule, wsd_decay_fraction=0.2, wsd_decay_shape="linear")
  fn = build_schedule(cfg, total_steps=999)
  for step, want in points.items():
    assert float(fn(step)) == pytest.approx(want, abs=1e-6), (schedule, step)


def test_decay_steps_zero_means_total_steps():
  fn = build_schedule(_optim(learning_rate=1.0, warmup_steps=0, decay_steps=0,
                             schedule="linear", min_lr_ratio=0.0), total_steps=40)
  assert float(fn(20)) == pytest.approx(0.5)
  assert float(fn(40)) == pytest.approx(0.0)


@pytest.mark.parametrize("name", ["lamb", "lars"])
def test_trust_ratio_is_per_layer_and_spares_norms(name):
  """Each stacked layer's update norm equals lr * trust * ||w_layer|| (LAMB: trust=1)."""
  params = _params()
  grads = _params(seed=1)
  cfg = _optim(name=name, learning_rate=0.1, schedule="constant", warmup_steps=0,
               weight_decay=0.0, clip_norm=0.0, momentum=0.0, trust_coefficient=1.0, eps=0.0)
  tx, _ = build_optimizer(cfg, NAMES, 10)
  updates, _ = tx.update(grads, tx.init(params), params)
  w, u = params["blocks"]["w_EF"], updates["blocks"]["w_EF"]
  for layer in range(3):
    assert float(jnp.linalg.norm(u[layer])) == pytest.approx(
        0.1 * float(jnp.linalg.norm(w[layer])), rel=1e-5)
  # norm scales get no trust ratio: their update is the plain (Adam / SGD) update
  plain = optax.adam(0.1, b1=cfg.b1, b2=cfg.b2, eps=0.0) if name == "lamb" else optax.sgd(0.1)
  ref, _ = plain.update(grads, plain.init(params), params)
  np.testing.assert_allclose(updates["blocks"]["norm"]["scale"], ref["blocks"]["norm"]["scale"],
                             rtol=1e-5)


def test_adamw_decays_matrices_only():
  params = _params()
  zeros = jax.tree.map(jnp.zeros_like, params)
  tx, _ = build_optimizer(_optim(name="adamw", learning_rate=0.1, schedule="constant",
                                 warmup_steps=0, weight_decay=0.5, clip_norm=0.0),
                          NAMES, 10)
  updates, _ = tx.update(zeros, tx.init(params), params)
  np.testing.assert_allclose(updates["lm_head_EV"], -0.1 * 0.5 * params["lm_head_EV"], rtol=1e-6)
  assert not np.any(updates["embed_VE"]) and not np.any(updates["final_norm"]["scale"])
  assert not np.any(updates["blocks"]["norm"]["scale"])


def test_clipping_bounds_the_global_norm():
  params = _params()
  big = jax.tree.map(lambda x: 100 * x, _params(seed=2))
  tx, _ = build_optimizer(_optim(name="sgd", learning_rate=1.0, schedule="constant",
                                 warmup_steps=0, weight_decay=0.0, clip_norm=1.0, momentum=0.0),
                          NAMES, 10)
  updates, _ = tx.update(big, tx.init(params), params)
  assert float(optax.tree.norm(updates)) == pytest.approx(1.0, rel=1e-5)


# ------------------------------------------------------------------------------------------------
# Adafactor, Lion, biases, the parameter EMA, batch-size-aware updates

BIAS_NAMES = {"w_EF": ("embed", "mlp"), "b_F": ("mlp",), "norm": {"scale": ("norm",)}}


def _bias_params():
  return {"w_EF": jnp.full((4, 6), 0.5), "b_F": jnp.full((6,), 0.5),
          "norm": {"scale": jnp.ones((4,))}}


@pytest.mark.parametrize("name", ["adamw", "lamb", "lars", "sgd", "adafactor", "lion"])
def test_biases_and_norms_get_no_weight_decay(name):
  """With zero gradients only weight decay moves anything: matrices, never biases or norms."""
  params = _bias_params()
  zeros = jax.tree.map(jnp.zeros_like, params)
  tx, _ = build_optimizer(_optim(name=name, learning_rate=0.1, schedule="constant",
                                 warmup_steps=0, weight_decay=0.5, clip_norm=0.0,
                                 momentum=0.0, trust_coefficient=1.0), BIAS_NAMES, 10)
  updates, _ = jax.jit(tx.update)(zeros, tx.init(params), params)
  assert np.any(updates["w_EF"]), name
  assert not np.any(updates["b_F"]) and not np.any(updates["norm"]["scale"]), name


@pytest.mark.parametrize("name", ["lamb", "lars"])
def test_trust_ratio_leaves_biases_alone(name):
  """A bias's update is the plain optimizer's (no ||w|| / ||u|| scaling)."""
  params = _bias_params()
  grads = {"w_EF": jnp.full((4, 6), 0.3), "b_F": jnp.linspace(0.1, 1.0, 6),
           "norm": {"scale": jnp.full((4,), 0.2)}}
  cfg = _optim(name=name, learning_rate=0.1, schedule="constant", warmup_steps=0,
               weight_decay=0.0, clip_norm=0.0, momentum=0.0, trust_coefficient=1.0, eps=0.0)
  tx, _ = build_optimizer(cfg, BIAS_NAMES, 10)
  updates, _ = jax.jit(tx.update)(grads, tx.init(params), params)
  plain = optax.adam(0.1, b1=cfg.b1, b2=cfg.b2, eps=0.0) if name == "lamb" else optax.sgd(0.1)
  ref, _ = plain.update(grads, plain.init(params), params)
  np.testing.assert_allclose(updates["b_F"], ref["b_F"], rtol=1e-5)
  assert float(jnp.linalg.norm(updates["w_EF"])) == pytest.approx(
      0.1 * float(jnp.linalg.norm(params["w_EF"])), rel=1e-5)


def test_default_optimizer_state_is_unchanged():
  """No rule, meter or EMA: the state has exactly the structure of clip + adamw (checkpoints
  written before these features restore)."""
  params = _params()
  tx, _ = build_optimizer(_optim(), NAMES, 10, default_config().data)
  adamw = optax.adamw(lambda count: 1e-3, mask=masks(NAMES)["decay"])
  want = optax.chain(optax.clip_by_global_norm(1.0), adamw).init(params)
  assert jax.tree.structure(tx.init(params)) == jax.tree.structure(want)


def test_parameter_ema_tracks_the_updated_parameters():
  from optim.ema import find_ema  # noqa: PLC0415
  params = _params()
  tx, _ = build_optimizer(_optim(name="sgd", learning_rate=0.1, schedule="constant",
                                 warmup_steps=0, weight_decay=0.0, clip_norm=0.0, momentum=0.0,
                                 ema_decay=0.9), NAMES, 10)
  state = tx.init(params)
  ema = params
  for seed in (1, 2):
    grads = _params(seed)
    updates, state = tx.update(grads, state, params)
    params = optax.apply_updates(params, updates)
    ema = jax.tree.map(lambda e, p: 0.9 * e + 0.1 * p, ema, params)
  jax.tree.map(lambda a, b: np.testing.assert_allclose(a, b, rtol=1e-6), find_ema(state), ema)
  assert find_ema(optax.sgd(0.1).init(params)) is None


def test_update_at_another_batch_uses_its_hyperparameters():
  """lr_rule linear with reference 8: the update at batch 32 is 4x the one at batch 8; the EMA
  decay at batch 32 is rho ** 4 (half-life rule)."""
  from optim.ema import find_ema  # noqa: PLC0415
  data = default_config().data
  data.global_batch_size = 8
  params, grads = _params(), _params(seed=1)
  tx, schedule = build_optimizer(_optim(name="sgd", learning_rate=0.1, schedule="constant",
                                        warmup_steps=0, weight_decay=0.0, clip_norm=0.0,
                                        momentum=0.0, reference_batch_size=8, lr_rule="linear",
                                        ema_decay=0.5, ema_rule="half_life"), NAMES, 10, data)
  state = tx.init(params)
  small, s8 = tx.update(grads, state, params, batch_size=8)
  big, s32 = tx.update(grads, state, params, batch_size=32)
  jax.tree.map(lambda a, b: np.testing.assert_allclose(b, 4 * a, rtol=1e-6), small, big)
  assert float(schedule.at(32)(0)) == pytest.approx(0.4) and float(schedule(0)) == 0.1
  new = optax.apply_updates(params, big)
  want = jax.tree.map(lambda p, n: 0.5 ** 4 * p + (1 - 0.5 ** 4) * n, params, new)
  jax.tree.map(lambda a, b: np.testing.assert_allclose(a, b, rtol=1e-6), find_ema(s32), want)


@pytest.mark.parametrize("name", ["adamw", "lamb", "lars", "sgd", "adafactor", "lion"])
def test_weight_decay_is_multiplied_by_the_learning_rate(name):
  """Zero gradients: the update of a decayed matrix is -lr * wd * w, also for Adafactor (optax's
  own adafactor gives -wd * w); LAMB/LARS scale it by their trust ratio ||w|| / ||wd w||, so
  theirs is -lr * w. (Unjitted: XLA:CPU at optimisation level 0 turns Adafactor's
  0 * rsqrt(1e-30) into NaN.)"""
  params = _bias_params()
  zeros = jax.tree.map(jnp.zeros_like, params)
  tx, _ = build_optimizer(_optim(name=name, learning_rate=0.1, schedule="constant",
                                 warmup_steps=0, weight_decay=0.5, clip_norm=0.0,
                                 momentum=0.0, trust_coefficient=1.0),
                          BIAS_NAMES, 10)
  updates, _ = tx.update(zeros, tx.init(params), params)
  decay = 1.0 if name in ("lamb", "lars") else 0.5
  np.testing.assert_allclose(updates["w_EF"], -0.1 * decay * params["w_EF"], rtol=1e-5)


def test_the_trainers_step_drives_the_schedule():
  """`update(..., step=n)` applies the schedule at n whatever the optimizer's own count (which
  a skipped step does not advance); without `step`, optax's count."""
  params, grads = _params(), _params(seed=1)
  cfg = _optim(name="sgd", learning_rate=1.0, schedule="linear", warmup_steps=0, decay_steps=10,
               min_lr_ratio=0.0, weight_decay=0.0, clip_norm=0.0, momentum=0.0)
  tx, schedule = build_optimizer(cfg, NAMES, 10)
  state = tx.init(params)
  at7, _ = tx.update(grads, state, params, step=7)
  at0, _ = tx.update(grads, state, params)
  np.testing.assert_allclose(at7["lm_head_EV"], -0.3 * grads["lm_head_EV"], rtol=1e-5)
  np.testing.assert_allclose(at0["lm_head_EV"], -1.0 * grads["lm_head_EV"], rtol=1e-5)
  assert float(schedule(7)) == pytest.approx(0.3)

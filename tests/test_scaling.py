"""Batch-size rules and schedules: values at known points, in every unit, and config checks."""
import math

import jax
import numpy as np
import pytest

from conftest import tiny_config
from optim import BatchRamp, build_schedule, derive
from optim.scaling import OPTIMIZER_DEFAULTS, describe
from trainer.config import ConfigError, default_config
from trainer.config.checks import validate


def _optim(**kw):
  c = default_config().optim
  c.update(kw)
  return c


# ------------------------------------------------------------------------------------------------
# Rules


def test_defaults_change_nothing():
  """reference_batch_size 0 = the run's batch: every value is the stated one, bit for bit."""
  cfg = _optim(lr_rule="sqrt", weight_decay_rule="timescale", b2_rule="half_life",
               ema_rule="half_life", ema_decay=0.999)
  hp = derive(cfg, 256, 256)
  assert (hp.learning_rate, hp.weight_decay, hp.b2, hp.ema_decay) == (3e-3, 0.1, 0.95, 0.999)
  assert derive(_optim(reference_batch_size=64), 256, 256).learning_rate == 3e-3


@pytest.mark.parametrize("name", list(OPTIMIZER_DEFAULTS))
def test_unset_keys_take_the_optimizers_own_defaults(name):
  """learning_rate 0, weight_decay -1, b2 0, trust_coefficient 0 mean "the optimizer's default";
  a value the config states is used as stated; the start-up line says which is which."""
  own = OPTIMIZER_DEFAULTS[name]
  b2 = OPTIMIZER_DEFAULTS["adamw" if name == "muon" else name]["b2"]  # Muon's: its fallback's
  hp = derive(_optim(name=name), 16)
  assert (hp.learning_rate, hp.weight_decay, hp.b2, hp.trust_coefficient) == (
      own["learning_rate"], own["weight_decay"], b2, own["trust_coefficient"])
  cfg = _optim(name=name, learning_rate=0.25, weight_decay=0.0, b2=0.5, trust_coefficient=0.5)
  hp = derive(cfg, 16)
  assert (hp.learning_rate, hp.weight_decay, hp.b2, hp.trust_coefficient) == (0.25, 0, 0.5, 0.5)
  assert f"lr 0.003 [{name} default]" not in describe(cfg, hp)
  line = describe(_optim(name=name, weight_decay=0.0), derive(_optim(name=name), 16))
  assert f"lr {own['learning_rate']:.4g} [{name} default]" in line, line
  assert "weight_decay 0 [" not in line


def test_muons_b2_is_its_fallbacks():
  """Muon has no second moment of its own: an unset b2 is the fallback optimizer's default, the
  start-up line names that optimizer, and b2_rule is refused where the fallback has no Adam b2."""
  cfg = _optim(name="muon")
  cfg.muon.fallback = "lion"
  hp = derive(cfg, 16)
  assert hp.b2 == OPTIMIZER_DEFAULTS["lion"]["b2"] == 0.99
  assert "b2 0.99 [lion default]" in describe(cfg, hp)
  cfg.muon.fallback = "adamw"
  assert derive(cfg, 16).b2 == OPTIMIZER_DEFAULTS["adamw"]["b2"]


def test_lion_and_lars_defaults_are_the_papers():
  assert OPTIMIZER_DEFAULTS["lion"]["b2"] == 0.99  # Chen et al. 2023
  lion, adamw = OPTIMIZER_DEFAULTS["lion"], OPTIMIZER_DEFAULTS["adamw"]
  assert 3 <= adamw["learning_rate"] / lion["learning_rate"] <= 10
  assert lion["learning_rate"] * lion["weight_decay"] == pytest.approx(
      adamw["learning_rate"] * adamw["weight_decay"])  # the same per-step shrink
  assert OPTIMIZER_DEFAULTS["lars"]["trust_coefficient"] == 1e-3  # You et al. 2017


@pytest.mark.parametrize("rule,k,factor", [
    ("none", 4, 1.0), ("linear", 4, 4.0), ("sqrt", 4, 2.0), ("linear", 0.25, 0.25),
    ("sqrt", 0.25, 0.5)])
def test_learning_rate_rules(rule, k, factor):
  hp = derive(_optim(learning_rate=1e-3, reference_batch_size=64, lr_rule=rule), int(64 * k))
  assert hp.learning_rate == pytest.approx(1e-3 * factor, rel=1e-12)
  assert hp.ratio == k


@pytest.mark.parametrize("lr_rule,factor", [("linear", 1.0), ("sqrt", 2.0), ("none", 4.0)])
def test_weight_decay_keeps_the_adamw_timescale(lr_rule, factor):
  """Power Lines: tau = B / (lr * lambda * D) fixed; at 4x the batch lambda grows by 4 lr/lr'."""
  ref = _optim(learning_rate=2e-3, weight_decay=0.1, reference_batch_size=32, lr_rule=lr_rule,
               weight_decay_rule="timescale")
  hp = derive(ref, 128)
  assert hp.weight_decay == pytest.approx(0.1 * factor, rel=1e-12)
  tau = lambda b, lr, wd: b / (lr * wd)  # D is the same run length in tokens
  assert tau(128, hp.learning_rate, hp.weight_decay) == pytest.approx(tau(32, 2e-3, 0.1))
  assert derive(_optim(weight_decay=0.1, reference_batch_size=32), 128).weight_decay == 0.1


def test_b2_and_ema_keep_their_half_life_in_examples():
  """Marek et al. 2025 (b2) and Busbridge et al. 2023 (EMA): rate ** (B / B_ref)."""
  cfg = _optim(b2=0.99, ema_decay=0.999, reference_batch_size=16, b2_rule="half_life",
               ema_rule="half_life")
  for batch in (4, 16, 128):
    hp = derive(cfg, batch)
    assert hp.b2 == pytest.approx(0.99 ** (batch / 16), rel=1e-12)
    assert hp.ema_decay == pytest.approx(0.999 ** (batch / 16), rel=1e-12)
    half_life_examples = lambda rate: batch * math.log(0.5) / math.log(rate)
    assert half_life_examples(hp.b2) == pytest.approx(16 * math.log(0.5) / math.log(0.99))
  const = derive(_optim(b2=0.99, reference_batch_size=16), 128)
  assert const.b2 == 0.99


def test_describe_names_rules_and_warns_on_unbounded_adam():
  cfg = _optim(b1=0.9, b2=0.95, reference_batch_size=16, lr_rule="sqrt", b2_rule="half_life")
  text = describe(cfg, derive(cfg, 64))
  assert "lr 0.003 -> 0.006 (sqrt)" in text and "b2 0.95 -> 0.8145 (half_life)" in text
  assert "WARNING" not in text
  assert "WARNING b2 < b1^2" in describe(cfg, derive(cfg, 128))  # 0.95 ** 8 = 0.66 < 0.81


def test_describe_names_muons_fallback_rate_where_it_has_one():
  """optim.muon.fallback_lr moves with the batch as learning_rate does; 0 (the shared rate) is
  not named."""
  cfg = _optim(name="muon", learning_rate=0.02, reference_batch_size=16, lr_rule="sqrt")
  cfg.muon.fallback_lr = 0.005
  assert "fallback_lr 0.005 -> 0.01 (sqrt)" in describe(cfg, derive(cfg, 64))
  assert describe(cfg, derive(cfg, 16)).endswith(", fallback_lr 0.005")
  cfg.muon.fallback_lr = 0.0
  assert "fallback_lr" not in describe(cfg, derive(cfg, 64))


# ------------------------------------------------------------------------------------------------
# Schedules


def _values(fn, points):
  return [float(fn(p)) for p in points]


def test_units_agree_without_a_ramp():
  """Warmup 10 steps of 16 x 32 tokens = 160 examples = 5120 tokens: one curve."""
  ramp = BatchRamp.constant(16, 32)
  base = dict(learning_rate=1.0, schedule="cosine", min_lr_ratio=0.1, warmup_steps=0,
              decay_steps=0)
  by_steps = build_schedule(_optim(**{**base, "warmup_steps": 10, "decay_steps": 110}), 999, ramp)
  by_examples = build_schedule(_optim(**base, schedule_unit="examples", warmup_examples=160,
                                      decay_examples=1760), 999, ramp)
  by_tokens = build_schedule(_optim(**base, schedule_unit="tokens", warmup_tokens=5120,
                                    decay_tokens=56320), 999, ramp)
  points = [0, 5, 10, 60, 110, 200]
  want = _values(by_steps, points)
  assert want[:3] == [0.0, 0.5, 1.0] and want[4] == pytest.approx(0.1)
  np.testing.assert_allclose(_values(by_examples, points), want, rtol=1e-6, atol=1e-7)
  np.testing.assert_allclose(_values(by_tokens, points), want, rtol=1e-6, atol=1e-7)


def test_horizon_in_tokens_does_not_depend_on_steps():
  """decay_tokens fixes the curve whatever `steps` is, as decay_steps does (resume safety)."""
  ramp = BatchRamp.constant(8, 32)
  cfg = _optim(learning_rate=1.0, schedule="linear", schedule_unit="tokens", warmup_steps=0,
               warmup_tokens=2560, decay_tokens=25600, min_lr_ratio=0.0)
  a, b = build_schedule(cfg, 40, ramp), build_schedule(cfg, 4000, ramp)
  points = [0, 5, 10, 50, 100, 120]
  assert _values(a, points) == _values(b, points)
  assert _values(a, points)[2] == pytest.approx(1.0) and _values(a, points)[4] == 0.0


def test_schedule_in_tokens_follows_the_ramp():
  """Batch 8 then 32 sequences of 16 tokens (ramp at 1280 tokens = step 10). A linear decay over
  6400 tokens is a function of tokens: 0.8 at the boundary, half at 3200 tokens (step 13.75).
  The same horizon for a schedule in steps is converted once: 6400 tokens = step 20."""
  ramp = BatchRamp([(8, 0), (32, 1280)], 16)
  assert ramp.start_steps == (0, 10)
  cfg = _optim(learning_rate=1.0, schedule="linear", schedule_unit="tokens", warmup_steps=0,
               decay_tokens=6400, min_lr_ratio=0.0)
  fn = jax.jit(build_schedule(cfg, 100, ramp))
  assert float(fn(10)) == pytest.approx(1 - 1280 / 6400)  # the boundary
  assert float(fn(9)) == pytest.approx(1 - 1152 / 6400)
  assert float(fn(11)) == pytest.approx(1 - 1792 / 6400)
  steps_cfg = _optim(learning_rate=1.0, schedule="linear", warmup_steps=0, decay_steps=0,
                     decay_tokens=6400, min_lr_ratio=0.0)
  by_steps = build_schedule(steps_cfg, 100, ramp)
  # fp32 arithmetic: the end point is 0 up to rounding (2e-8 on jax 0.12)
  assert float(fn(13.75)) == pytest.approx(0.5) and float(fn(20)) == pytest.approx(0.0, abs=1e-6)
  assert float(by_steps(10)) == pytest.approx(0.5) and float(by_steps(20)) == 0.0


def test_warmup_in_examples_scales_with_the_batch():
  """Goyal et al.: warmup measured in data. 1024 examples = 64 steps at 16, 8 steps at 128."""
  cfg = _optim(learning_rate=1.0, schedule="constant", warmup_steps=0, warmup_examples=1024)
  for batch, steps in ((16, 64), (128, 8)):
    fn = build_schedule(cfg, 1000, BatchRamp.constant(batch, 64))
    assert float(fn(steps // 2)) == pytest.approx(0.5) and float(fn(steps)) == 1.0


def test_power_schedule_known_points():
  """Shen et al. 2024: min(lr, beta a n^b) after warmup, final decay of the last 20%."""
  ramp = BatchRamp.constant(4, 1000)  # 4,000 tokens per step
  cfg = _optim(learning_rate=0.02, schedule="power", power_a=4.0, power_b=-0.5, warmup_steps=10,
               decay_steps=1000, wsd_decay_fraction=0.2, wsd_decay_shape="linear",
               min_lr_ratio=0.0)
  fn = build_schedule(cfg, 1000, ramp, batch_size=4)
  law = lambda step: min(0.02, 4 * 4.0 * (step * 4000) ** -0.5)
  assert law(10) == 0.02 and law(400) < 0.02  # capped early, a power law later
  assert float(fn(5)) == pytest.approx(0.5 * law(10))  # warmup rises to the law's value
  for step in (10, 100, 400, 799):
    assert float(fn(step)) == pytest.approx(law(step), rel=1e-5), step
  assert float(fn(900)) == pytest.approx(0.5 * law(800), rel=1e-5)
  assert float(fn(1000)) == pytest.approx(0.0, abs=1e-9)
  twice = build_schedule(cfg, 1000, BatchRamp.constant(8, 1000), batch_size=8)
  assert float(twice(400)) == pytest.approx(2 * 4 * 4.0 * (400 * 8000) ** -0.5, rel=1e-5)


def test_rsqrt_schedule():
  fn = build_schedule(_optim(learning_rate=1.0, schedule="rsqrt", warmup_steps=100), 10)
  assert _values(fn, [0, 50, 100, 400, 10000]) == pytest.approx([0.0, 0.5, 1.0, 0.5, 0.1])


def test_schedule_at_a_derived_batch():
  """The schedule's peak is the rule's learning rate at the step's batch (optim.factory)."""
  from optim import build_optimizer  # noqa: PLC0415
  names = {"w": ("embed", "mlp")}
  data = tiny_config().data
  cfg = _optim(learning_rate=1e-3, schedule="constant", warmup_steps=0, reference_batch_size=8,
               lr_rule="linear")
  _, schedule = build_optimizer(cfg, names, 10, data)
  assert float(schedule(3)) == pytest.approx(1e-3)  # data.global_batch_size = 8
  assert float(schedule.at(32)(3)) == pytest.approx(4e-3)


# ------------------------------------------------------------------------------------------------
# Config checks: one line naming the key


@pytest.mark.parametrize("overrides,needle", [
    ({"optim.name": "lamb", "optim.weight_decay_rule": "timescale"},
     "optim.weight_decay_rule='timescale' needs a decay multiplied by the learning rate"),
    ({"optim.name": "sgd", "optim.b2_rule": "half_life"}, "optim.b2_rule='half_life' scales"),
    ({"optim.name": "muon", "optim.muon.fallback": "lion", "optim.b2_rule": "half_life"},
     "optim.name='muon' with optim.muon.fallback='lion' (Muon's b2 is its fallback's)"),
    ({"optim.warmup_tokens": 1000}, "optim.warmup_steps=2 and optim.warmup_tokens=1000 both"),
    ({"optim.schedule": "power", "optim.lr_rule": "sqrt"}, "set optim.lr_rule='none'"),
    ({"optim.schedule": "rsqrt", "optim.warmup_steps": 0}, "needs a warmup"),
    ({"optim.lr_rule": "cubic"}, "optim.lr_rule='cubic': choose one of none, linear, sqrt"),
    ({"optim.schedule_unit": "epochs"}, "choose one of steps, examples, tokens"),
    ({"data.batch_ramp": "8:0,16:100"}, "data.batch_ramp needs data.micro_batch_size"),
    ({"data.batch_ramp": "8:5,16:100", "data.micro_batch_size": 8},
     "first stage must start at 0"),
    ({"data.batch_ramp": "8:0,12:100", "data.micro_batch_size": 8, "data.global_batch_size": 16},
     "stage of 12 sequences is not a multiple of data.micro_batch_size=8"),
    ({"data.batch_ramp": "8:0,16:100", "data.micro_batch_size": 8, "data.global_batch_size": 24},
     "ends at 16 sequences but data.global_batch_size=24"),
    ({"optim.noise_scale_every": 5}, "splits its 8 rows into two halves"),
    ({"optim.ema_decay": 1.0}, "optim.ema_decay=1.0: must be in [0, 1)"),
])
def test_config_errors(overrides, needle):
  with pytest.raises(ConfigError, match=None) as info:
    validate(tiny_config(**overrides), 8)
  assert needle in str(info.value), str(info.value)


def test_valid_batch_science_config_passes():
  validate(tiny_config(**{"data.batch_ramp": "8:0,16:4096", "data.micro_batch_size": 8,
                          "data.global_batch_size": 16, "optim.noise_scale_every": 5,
                          "mesh.data": 4, "mesh.tensor": 2, "optim.lr_rule": "sqrt",
                          "optim.reference_batch_size": 8, "optim.ema_decay": 0.99,
                          "optim.schedule_unit": "tokens", "optim.warmup_steps": 0,
                          "optim.warmup_tokens": 512}), 8)

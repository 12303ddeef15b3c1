"""Batch-size ramp: the step <-> tokens arithmetic at its boundaries, one compile per stage size,
each stage's own hyperparameters, an exact resume across a stage boundary, and one clock: a
skipped step uses up its batch, its ramp slot and its learning-rate slot."""
import jax
import numpy as np
import pytest

from conftest import metric_rows, tiny_config, trained
from optim import BatchRamp, derive, parse_ramp
from trainer.run.loop import Run


def test_stage_boundaries():
  """Stages start at the first step whose tokens seen reach the stage's start."""
  ramp = BatchRamp(parse_ramp("4:0, 8:2_048, 16:8192"), seq_len=128)
  assert ramp.start_steps == (0, 4, 10)  # 4 x 512 = 2048; then 6 x 1024 more = 8192
  assert [ramp.batch_at(s) for s in (0, 3, 4, 9, 10, 99)] == [4, 4, 8, 8, 16, 16]
  assert [ramp.examples_before(s) for s in (0, 4, 5, 10, 11)] == [0, 16, 24, 64, 80]
  assert ramp.tokens_before(10) == 8192
  traced = jax.jit(ramp.examples_before_traced)
  assert [float(traced(s)) for s in (0, 4, 5, 10, 11)] == [0, 16, 24, 64, 80]
  assert ramp.step_at_examples(24) == 5 and ramp.step_at_examples(72) == 10.5
  assert ramp.convert(5, "steps", "tokens") == 24 * 128
  # A start that is not a multiple of the previous stage's tokens per step rounds up.
  assert BatchRamp([(4, 0), (8, 1000)], 128).start_steps == (0, 2)
  # Printed with steps counted from 1, as the loop's lines ("step 5: batch 8") count them.
  assert ramp.describe() == ("batch ramp: 4 from step 1 (0 tokens) -> 8 from step 5 (2,048 "
                             "tokens) -> 16 from step 11 (8,192 tokens)")


def test_constant_ramp():
  ramp = BatchRamp.constant(16, 32)
  assert ramp.is_constant and ramp.batch_at(10**6) == 16
  assert ramp.examples_before(7) == 112 and ramp.step_at_examples(112) == 7


@pytest.mark.parametrize("text,needle", [
    ("64", "is not BATCH:START_TOKENS"), ("64:10", "first stage must start at 0"),
    ("64:0,128:0", "stage starts must increase"), ("64:0,128:1.5", "whole number"),
    ("", "no stages")])
def test_parse_errors(text, needle):
  with pytest.raises(ValueError, match=needle):
    parse_ramp(text)


@pytest.mark.parametrize("value,needle", [
    ("seasaw", "data.batch_ramp='seasaw': did you mean 'seesaw'?"),
    ("Auto", "data.batch_ramp='Auto': did you mean 'auto'?"),
    ("64", "data.batch_ramp='64': stage '64' is not BATCH:START_TOKENS")])
def test_a_misspelled_ramp_is_named_with_what_was_meant(value, needle):
  from trainer.config import ConfigError  # noqa: PLC0415
  from trainer.config.checks import validate  # noqa: PLC0415
  with pytest.raises(ConfigError) as e:
    validate(tiny_config(**{"data.batch_ramp": value, "data.micro_batch_size": 8}), 8)
  assert str(e.value).startswith(needle), str(e.value)


# ------------------------------------------------------------------------------------------------
# A run: micro-batches of 8 rows of 32 tokens; batch 16 (2 micro-batches) for steps 1-5, 24 (3)
# for steps 6-8, 16 again from step 9. The ramp's boundaries are at 2560 tokens (5 steps x 512)
# and 4864 tokens (+ 3 x 768). Noise scale and parameter EMA on: their state must resume too.

RAMP = {"data.micro_batch_size": 8, "data.global_batch_size": 16,
        "data.batch_ramp": "16:0,24:2560,16:4864", "optim.reference_batch_size": 16,
        "optim.lr_rule": "sqrt", "optim.b2_rule": "half_life", "optim.ema_decay": 0.9,
        "optim.noise_scale_every": 2, "optim.noise_scale_min_measurements": 1,
        "optim.noise_scale_max_rse": 0,
        "checkpoint.every_steps": 5, "eval_every": 5,
        "eval_sequences": 4}


@pytest.fixture(scope="module")
def straight(tmp_path_factory, data_dir):
  return trained(tmp_path_factory.mktemp("ramp_straight"), tiny_config(steps=10, **RAMP))


def test_one_compile_per_stage_size(straight):
  """Stages of 2, 3, then 2 micro-batches, each step measuring the noise scale or not: four
  compilations, the third stage reuses the first's."""
  run, _ = straight
  assert run.ramp.start_steps == (0, 5, 8)
  assert run.steps.count == 4
  # (micro-batches, measures noise, computes the norms): every step logs here (log_every=1)
  assert sorted(run.steps.compiled) == [(2, False, True), (2, True, True), (3, False, True),
                                        (3, True, True)]


def test_each_stage_uses_its_batch_and_hyperparameters(straight):
  run, workdir = straight
  rows = metric_rows(workdir)
  assert [rows[s]["batch_size"] for s in range(1, 11)] == [16] * 5 + [24] * 3 + [16] * 2
  cfg = run.cfg.optim
  # cosine schedule (warmup 2, horizon 50) at each stage's own peak: sqrt(24/16) x at 24
  peak16, peak24 = (derive(cfg, b, 16).learning_rate for b in (16, 24))
  assert peak24 == pytest.approx(peak16 * np.sqrt(1.5))
  ratio = rows[6]["learning_rate"] / run.program.schedule.at(16)(5)
  assert ratio == pytest.approx(np.sqrt(1.5), rel=1e-5)
  assert rows[9]["learning_rate"] == pytest.approx(float(run.program.schedule.at(16)(8)))
  assert all(np.isfinite(rows[s]["noise_scale"]) for s in range(2, 11, 2))
  events = [r for r in _all_rows(workdir) if r.get("event") == "hyperparameters"]
  assert [e["hparams/batch_size"] for e in events] == [16, 24]
  assert events[1]["hparams/b2"] == pytest.approx(0.95 ** 1.5)
  assert events[1]["hparams/learning_rate"] == pytest.approx(peak24)


@pytest.mark.slow  # the default run keeps test_seesaw's resume across a doubling
def test_resume_across_a_stage_boundary_is_exact(straight, tmp_path):
  """Stop after step 5 (the next step starts stage 2), restart: losses, noise scale and the EMA's
  evaluation are identical to the run that never stopped."""
  _, straight_dir = straight
  first = Run(tiny_config(steps=5, **RAMP), str(tmp_path)).train()
  assert first.status == "done"
  resumed = Run(tiny_config(steps=10, **RAMP), str(tmp_path))
  assert resumed.train().status == "done"
  assert resumed.steps.count == 4
  want, got = metric_rows(straight_dir), metric_rows(tmp_path)
  for step in range(6, 11):
    for key in ("loss", "grad_norm", "learning_rate", "noise_scale", "param_norm"):
      if key in want[step]:
        assert got[step][key] == want[step][key], (step, key)
  evals = lambda d: {r["step"]: r for r in _all_rows(d) if "eval_loss" in r}
  assert evals(tmp_path)[10] == evals(straight_dir)[10]
  assert "eval_loss_ema" in evals(tmp_path)[10]


def _all_rows(workdir):
  import json  # noqa: PLC0415
  with open(workdir / "metrics.jsonl") as f:
    return [json.loads(line) for line in f]


def test_a_skipped_step_uses_up_its_schedule_slot(tmp_path):
  """Token-unit schedule under a ramp (batch 8 for steps 1-4, 16 from step 5), step 4 poisoned
  (skipped): the update of step 5 uses the schedule at step index 4 at batch 16, not the slot
  the skipped step left unused. With plain SGD the update is lr * gradient, so the update/grad
  norm ratio shows the rate the optimizer really applied."""
  cfg = tiny_config(steps=6, **{
      "data.micro_batch_size": 8, "data.global_batch_size": 16, "data.batch_ramp": "8:0,16:1024",
      "optim.schedule_unit": "tokens", "optim.schedule": "linear", "optim.warmup_steps": 0,
      "optim.warmup_tokens": 4096, "optim.decay_steps": 0, "optim.decay_tokens": 20000,
      "optim.name": "sgd", "optim.momentum": 0.0, "optim.weight_decay": 0.0,
      "optim.clip_norm": 0.0, "optim.learning_rate": 0.5, "trainer.debug_nan_at_step": 4})
  run = Run(cfg, str(tmp_path))
  assert run.train().status == "done"
  rows = metric_rows(tmp_path)
  assert run.ramp.start_steps == (0, 4) and rows[4]["skipped"] == 1
  for step in (3, 5, 6):  # the step's own slot: step index step - 1, that step's batch
    want = float(run.program.schedule.at(run.ramp.batch_at(step - 1))(step - 1))
    assert rows[step]["learning_rate"] == pytest.approx(want, rel=1e-6), step
    assert rows[step]["update_norm"] / rows[step]["grad_norm"] == pytest.approx(want, rel=1e-4)
  # tokens seen before step index 4: 4 x 8 x 32 = 1024, skipped batch included -> lr 0.5/4
  assert rows[5]["learning_rate"] == pytest.approx(0.5 * 1024 / 4096, rel=1e-6)

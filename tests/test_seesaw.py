"""Seesaw (`data.batch_ramp="seesaw"`, optim/ramp.py): the halvings of known schedules, the
doublings and rate cuts they become under each rule, the defaults it fills in (idempotent), a run
that logs every doubling with its cut, an exact resume across a doubling, and one-line errors for
the settings that cannot work."""
import math

import numpy as np
import pytest

from conftest import metric_rows, tiny_config, trained
from optim import BatchRamp, build_schedule, derive
from optim.schedules import halvings
from optim.seesaw import Seesaw, seesaw_defaults
from trainer.config import ConfigError, default_config
from trainer.config.checks import validate
from trainer.run.loop import Run


def _optim(**values):
  o = default_config().optim
  o.update(**{"learning_rate": 1e-2, "warmup_steps": 0, "min_lr_ratio": 0.0, **values})
  return o


def test_halvings_of_a_linear_decay():
  """1 - n/1000 is at most 2^-k from n = 1000 (1 - 2^-k): 500, 750, 875, 937.5 -> 938, ...,
  998.05 -> 999; the next (999.02 -> 1000) is past the last step."""
  got = halvings(_optim(schedule="linear"), 1000, BatchRamp.constant(8, 32))
  assert got == (500, 750, 875, 938, 969, 985, 993, 997, 999)


def test_halvings_of_a_cosine_after_its_warmup():
  """Warmup 10 steps (rising through 1/2 and 1/4: not halvings), then a cosine to 0 over 100:
  cut k at 10 + 100 arccos(2^(1-k) - 1) / pi rounded up; the last step's rate (2.5e-4) is
  under 2^-11, so there are 11 cuts, in order."""
  got = halvings(_optim(schedule="cosine", warmup_steps=10), 110, BatchRamp.constant(8, 32))
  assert got[:5] == (60, 77, 87, 94, 99)
  for k in range(2, 6):
    assert got[k - 1] == 10 + math.ceil(100 * math.acos(2.0 ** (1 - k) - 1) / math.pi)
  last = 0.5 * (1 + math.cos(math.pi * 99 / 100))
  assert len(got) == math.floor(-math.log2(last)) == 11 and list(got) == sorted(got)


def test_halvings_of_wsd_in_tokens_and_refusals():
  """WSD, linear decay over its last 20%, the schedule in tokens with the horizon in examples
  (100 steps of 8): halvings at 90, 95, 97.5 -> 98, 98.75 -> 99. A schedule that never falls
  from a peak has none to give."""
  o = _optim(schedule="wsd", wsd_decay_shape="linear", schedule_unit="tokens", decay_steps=0,
             decay_examples=800)
  assert halvings(o, 5, BatchRamp.constant(8, 32)) == (90, 95, 98, 99)
  with pytest.raises(ValueError, match="does not decay from a peak"):
    halvings(_optim(schedule="constant"), 100, BatchRamp.constant(8, 32))


def _plan_config(max_batch: int, **optim):
  """Batch 8 -> max_batch, 32-token sequences, a linear decay to 0 over 100 steps at batch 8
  (halvings at 50, 75, 88, 94, 97, 99)."""
  c = default_config()
  c.steps = 100
  c.data.update(global_batch_size=8, micro_batch_size=8, seq_len=32, batch_ramp="seesaw",
                max_batch=max_batch)
  c.optim.update(**{"schedule": "linear", "learning_rate": 1e-2, "warmup_steps": 0,
                    "min_lr_ratio": 0.0, **optim})
  return c


def _rates(c, ramp):
  """The rate of every step the run takes (each at its stage's batch, as the trainer does),
  under the config as the run fills it in (the lr rule)."""
  c = seesaw_defaults(c)[0]
  out = []
  for n in range(Seesaw.from_config(c.optim, c.data, c.steps).steps(ramp)):
    hp = derive(c.optim, ramp.batch_at(n), c.data.global_batch_size)
    out.append(float(build_schedule(c.optim, c.steps, ramp, peak=hp.learning_rate)(n)))
  return np.array(out)


def test_doublings_and_cuts_of_a_known_schedule():
  """Batch 8 doubles at the first halving (step 50: 400 sequences) and at the second (600
  sequences: 50 x 8 + 13 x 16 = 608 at step 63); the cuts after the batch reached 32 fall at
  the first steps whose sequences reach 88, 94, 97, 99 x 8: 66, 68, 69, 69; the horizon's
  800 sequences take 69 steps. AdamW's sqrt rule cuts the rate by 1/sqrt(2) per doubling and
  by 1/2 after; SGD's linear rule keeps it at each doubling."""
  c = _plan_config(32, name="adamw")
  plan = Seesaw.from_config(c.optim, c.data, c.steps)
  assert (plan.halvings, plan.rule, plan.horizon) == ((50, 75, 88, 94, 97, 99), "sqrt", 800)
  ramp = plan.ramp()
  assert ramp.stages_by_step() == [(0, 8), (50, 16), (63, 32)]
  assert ramp.cuts == (50, 63, 66, 68, 69, 69) and plan.steps(ramp) == 69
  assert ramp.examples_before(69) == 800
  lr = _rates(c, ramp)
  s = math.sqrt(2)
  want = [1.0] * 50 + [s / 2] * 13 + [0.5] * 3 + [0.25] * 2 + [0.125]
  np.testing.assert_allclose(lr, 1e-2 * np.array(want), rtol=1e-6)
  assert "batch 8 -> 16 and lr x 0.7071 from step 51; batch 16 -> 32 and lr x 0.7071 from step " \
         "64; lr x 0.5 from step 67" in ramp.describe()
  sgd = _plan_config(32, name="sgd")
  assert Seesaw.from_config(sgd.optim, sgd.data, 100).rule == "linear"
  want = [1.0] * 50 + [1.0] * 13 + [1.0] * 3 + [0.5] * 2 + [0.25]
  np.testing.assert_allclose(_rates(sgd, ramp), 1e-2 * np.array(want), rtol=1e-6)


def test_doublings_start_on_their_batch_and_the_run_stops_at_the_horizon():
  """A linear decay over 98 steps halves at step 49 (392 sequences), not a multiple of the new
  batch 16: the doubling starts at 400 (step 50), so 24 steps of 16 read the 784 of the horizon
  exactly. A horizon the last batch does not divide (808 sequences) ends at the last step not
  past it (800 sequences), and the start-up line says so."""
  c = _plan_config(16)
  c.steps = 98
  plan = Seesaw.from_config(c.optim, c.data, c.steps)
  ramp = plan.ramp()
  assert plan.halvings[0] == 49 and ramp.stages_by_step() == [(0, 8), (50, 16)]
  assert ramp.cuts[0] == 50 and plan.steps(ramp) == 74 and ramp.examples_before(74) == 784
  c = _plan_config(32, decay_examples=808)
  plan = Seesaw.from_config(c.optim, c.data, c.steps)
  ramp = plan.ramp()
  assert ramp.stages_by_step() == [(0, 8), (52, 16), (64, 32)]  # from 416 and 608 sequences
  assert plan.steps(ramp) == 70 and ramp.examples_before(70) == 800
  assert ramp.describe().endswith("in 70 steps (25,600 tokens: the last batch does not divide "
                                  "the rest)")


def test_max_batch_at_the_start_is_the_step_decay():
  """data.max_batch = global_batch_size: nothing doubles, the rate halves at every halving of the
  schedule, and the run keeps its 100 steps."""
  c = _plan_config(8)
  plan = Seesaw.from_config(c.optim, c.data, c.steps)
  ramp = plan.ramp()
  assert ramp.is_constant and ramp.cuts == plan.halvings and plan.steps(ramp) == 100
  k = np.searchsorted(np.array(plan.halvings), np.arange(100), side="right")
  np.testing.assert_allclose(_rates(c, ramp), 1e-2 * 0.5 ** k, rtol=1e-6)


def test_defaults_are_filled_in_once():
  c = _plan_config(32)
  c.data.micro_batch_size = 0
  out, notes = seesaw_defaults(c)
  assert (out.optim.lr_rule, out.data.micro_batch_size, out.optim.decay_examples,
          out.steps) == ("sqrt", 8, 800, 69)
  assert len(notes) == 4 and "steps=100 -> 69" in notes[-1]
  assert (c.steps, c.optim.lr_rule, c.optim.decay_examples) == (100, "none", 0)  # input kept
  assert seesaw_defaults(out) == (out, [])  # a filled-in config comes back the same
  early = _plan_config(32, decay_examples=800)
  early.steps = 40  # an explicit horizon and fewer steps: the run stops early
  assert seesaw_defaults(early)[0].steps == 40
  assert seesaw_defaults(tiny_config()) == (tiny_config(), [])  # no Seesaw: nothing to do


SEESAW = {"data.batch_ramp": "seesaw", "data.max_batch": 32, "data.micro_batch_size": 8,
          "optim.decay_steps": 0, "optim.schedule": "linear", "optim.warmup_steps": 0,
          "optim.min_lr_ratio": 0.0}


@pytest.mark.parametrize("values,needle", [
    ({"data.max_batch": 4}, "data.max_batch=4 is below data.global_batch_size=8, Seesaw's first"),
    ({"data.max_batch": 24}, "data.max_batch=24 is not data.global_batch_size=8 x 2^k"),
    ({"optim.name": "lion"}, "optim.name='lion' has no Seesaw rate rule"),
    ({"optim.schedule": "constant"}, "optim.schedule='constant' has none: use one of cosine"),
    ({"optim.schedule": "power"}, "optim.schedule='power' has none"),
    ({"optim.min_lr_ratio": 0.6}, "never falls to half its peak before its horizon"),
    ({"optim.decay_steps": 100, "steps": 80}, "steps=80 runs past the Seesaw run's horizon"),
    ({"data.batch_ramp": ""}, "data.max_batch=32 is Seesaw's largest batch, but "
                              "data.batch_ramp=''"),
    ({"optim.diloco.replicas": 2}, "Seesaw derives its steps, which need not end on an outer"),
])
def test_impossible_settings_are_one_line_errors(values, needle):
  cfg = tiny_config(**{"steps": 16, **SEESAW, **values})
  with pytest.raises(ConfigError) as e:
    validate(cfg, 2 if "optim.diloco.replicas" in values else 1)
  assert needle in str(e.value) and "\n" not in str(e.value)


def test_train_py_refuses_with_exit_code_2(tmp_path, capsys):
  import train  # noqa: PLC0415
  code = train.main(["--config", "configs/sweep_tiny.py", "--workdir", str(tmp_path),
                     "--config.data.batch_ramp=seesaw", "--config.data.max_batch=8"])
  err = capsys.readouterr().err.strip()
  assert code == 2 and err.count("\n") == 0
  assert err.startswith("error: data.max_batch=8 is below data.global_batch_size=16")
  assert not (tmp_path / "checkpoints").exists()


# ------------------------------------------------------------------------------------------------
# A run: batch 8 (one micro-batch of 8 rows, 32 tokens), up to 32, a linear decay to 0 over 16
# steps at batch 8 (128 sequences): halvings at 8, 12, 14, 15 -> batch 16 from step 9, 32 from
# step 11 (96 sequences read), which reads the 128 of the horizon: 11 steps.

RUN = {**SEESAW, "optim.decay_examples": 128, "checkpoint.every_steps": 0}


@pytest.fixture(scope="module")
def straight(tmp_path_factory, data_dir):
  return trained(tmp_path_factory.mktemp("seesaw_straight"), tiny_config(steps=16, **RUN))


def test_run_logs_each_doubling_with_its_cut(straight):
  run, workdir = straight
  assert run.cfg.steps == 11 and run.ramp.stages_by_step() == [(0, 8), (8, 16), (10, 32)]
  rows = metric_rows(workdir)
  assert sorted(rows) == list(range(1, 12))
  assert [rows[s]["batch_size"] for s in range(1, 12)] == [8] * 8 + [16] * 2 + [32]
  lr = np.array([rows[s]["learning_rate"] for s in range(1, 12)])
  want = [1.0] * 8 + [math.sqrt(2) / 2] * 2 + [0.5]
  np.testing.assert_allclose(lr, 1e-2 * np.array(want), rtol=1e-6)
  assert sorted({m for m, *_ in run.steps.compiled}) == [1, 2, 4] and run.steps.count == 3


def test_start_up_lines_say_the_ramp(straight, tmp_path, capsys):
  """The lines a run prints when it starts (here the resumed run's, with nothing left to do):
  what Seesaw derived, and the per-batch hyperparameters."""
  _, workdir = straight
  run = Run(tiny_config(steps=16, **RUN), str(workdir))
  assert run.train().status == "done"
  out = capsys.readouterr().out
  assert ("Seesaw (sqrt rule) of the linear schedule, halving at steps 9, 13, 15, 16 of batch 8: "
          "batch 8 -> 16 and lr x 0.7071 from step 9; batch 16 -> 32 and lr x 0.7071 from step "
          "11; lr x 0.5 from step 12; lr x 0.5 from step 12; the horizon's 4,096 tokens (16 "
          "steps at batch 8) in 11 steps") in out
  assert "Seesaw: steps=16 -> 11" in out and "Seesaw: optim.lr_rule='none' -> 'sqrt'" in out
  assert "adamw hyperparameters at batch 32 (reference 8, x4): lr 0.01 -> 0.02 (sqrt)" in out


@pytest.mark.parametrize("stop", [8, 9])
def test_resume_across_a_doubling_is_exact(straight, tmp_path, stop):
  """Stop after step 8 (the next step doubles the batch) or 9 (inside batch 16; the batch
  doubles again at step 11), by an explicit horizon and fewer steps, and restart with the full
  horizon: every row equals the run that never stopped."""
  _, straight_dir = straight
  first = Run(tiny_config(steps=stop, **RUN), str(tmp_path))
  assert first.train().status == "done" and first.cfg.steps == stop
  resumed = Run(tiny_config(steps=16, **RUN), str(tmp_path))
  assert resumed.train().status == "done"
  want, got = metric_rows(straight_dir), metric_rows(tmp_path)
  assert sorted(got) == list(range(1, 12))
  for step in range(stop + 1, 12):
    for key in ("loss", "grad_norm", "learning_rate", "batch_size", "update_norm"):
      assert got[step][key] == want[step][key], (step, key)

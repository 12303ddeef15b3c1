"""Batch autopilot (`data.batch_ramp = "auto"`, optim/autopilot.py): the rule on given
measurements, its config checks, and a run that grows its batch from the measured noise scale,
compiles each size once, logs why, and resumes bit for bit across a decision."""
import json
import math

import pytest

from conftest import metric_rows, tiny_config, trained
from optim import BatchRamp
from optim.autopilot import DELAY, AutoConfig, Autopilot
from trainer.config import ConfigError
from trainer.config.checks import validate
from trainer.run.loop import Run


def _pilot(**kw):
  cfg = AutoConfig(**{"start": 8, "max": 32, "factor": 2, "margin": 2.0, "patience": 2, **kw})
  return Autopilot(cfg, BatchRamp.constant(cfg.start, seq_len=4))


def _feed(pilot, values, every=5):
  """Noise-scale measurements at steps every, 2 every, ...; returns the changes."""
  out = []
  for i, b in enumerate(values):
    change = pilot.observe(every * (i + 1), {"noise_scale": b, "skipped": 0})
    if change is not None:
      out.append((change.measured_at, change.step, change.old, change.batch))
  return out


def test_rule_grows_after_patience_and_never_past_max():
  pilot = _pilot()
  # 17 > 2 x 8 twice in a row at steps 15, 20 -> 16 from step 22; NaN and a dip reset the
  # streak; 40 > 2 x 16 at 35, 40 -> 32 from 42; then at the cap nothing more.
  changes = _feed(pilot, [20, math.nan, 17, 17, 20, 30, 40, 40, 99, 99, 99])
  assert changes == [(20, 20 + DELAY, 8, 16), (40, 40 + DELAY, 16, 32)]
  assert pilot.ramp.stages_by_step() == [(0, 8), (21, 16), (41, 32)]
  assert [pilot.ramp.batch_at(s) for s in (20, 21, 40, 41, 10**6)] == [8, 16, 16, 32, 32]
  assert pilot.ramp.tokens_before(41) == (21 * 8 + 20 * 16) * 4  # tokens stay exact
  assert "B_simple=17 > 2 x 8 (2 rows in a row)" in pilot.changes[0].describe()
  # a skipped step's row is ignored; a change needs `patience` rows above the margin
  assert _feed(_pilot(patience=1), [1, 1, 17.0]) == [(15, 17, 8, 16)]
  skipped = _pilot(patience=1)
  assert skipped.observe(5, {"noise_scale": 99, "skipped": 1}) is None


def test_the_noise_scale_trigger_follows_its_signal():
  """signal='noise_scale_precond': the preconditioned B_simple decides (the plain one in the same
  row does not); a NaN (too few measurements) never fires."""
  pilot = _pilot(signal="noise_scale_precond", patience=1)
  row = {"noise_scale": 1.0, "noise_scale_precond": 20.0, "skipped": 0}
  change = pilot.observe(5, row)
  assert change is not None and "B_simple (preconditioned)=20 > 2 x 8" in change.describe()
  assert pilot.observe(10, {**row, "noise_scale_precond": math.nan}) is None
  assert _pilot(patience=1).observe(5, row) is None  # the plain signal: 1 <= 2 x 8


def test_a_row_the_precision_gate_left_without_value_never_fires():
  """The meter's rows while its |G|^2 is imprecise (`noise_scale_why` 3, NaN: estimates 1 +- 4)
  neither grow the batch nor count towards `patience` (the streak starts again at the first
  row with a value); once the window is precise (n ~ 64) B_simple = 50 > 2 x 8 fires after
  `patience` rows."""
  import numpy as np  # noqa: PLC0415
  from optim import noise_scale  # noqa: PLC0415
  tx, pilot = noise_scale.meter(1.0, min_measurements=8, max_rse=0.5), _pilot()
  state, whys, change = tx.init(None), [], None
  for step in range(100):
    g = 1.0 + 4.0 * (-1) ** step
    sample = noise_scale.Sample(*(np.float32(x) for x in (g + 50.0, g + 25.0, 1, 2)))
    _, state = tx.update({}, state, noise_sample=sample, step=step)
    r = noise_scale.readout(state)
    whys.append(int(r["why"]))
    change = pilot.observe(step + 1, {"noise_scale": float(r["b_simple"]), "skipped": 0})
    if change is not None:
      break
  first = whys.index(0) + 1  # the first row with a value
  assert whys[8:first - 1] == [3] * (first - 9) and 55 <= first <= 64
  assert change is not None and change.measured_at >= first + 1 and change.batch == 16


def test_norm_test_trigger():
  """Var[g_B] = tr(Sigma)/T against eta^2 |g_B|^2 (T target tokens of the step)."""
  pilot = _pilot(trigger="norm_test", eta=0.5, patience=1)
  row = {"noise_trace": 100.0, "target_tokens": 1000.0, "grad_norm": 0.5, "skipped": 0}
  assert pilot.observe(5, row) is not None  # 100 / (1000 * 0.25) = 0.4 > 0.25
  row["grad_norm"] = 0.7  # 100 / (1000 * 0.49) = 0.204 < 0.25
  assert pilot.observe(10, row) is None and pilot.streak == 0


def test_state_round_trip_replays_the_ramp():
  pilot = _pilot(patience=1)
  _feed(pilot, [17, 1, 40])
  again = _pilot(patience=1)
  again.load_state_dict(json.loads(json.dumps(pilot.state_dict())))
  assert again.ramp.stages_by_step() == pilot.ramp.stages_by_step() == [(0, 8), (6, 16),
                                                                           (16, 32)]
  assert again.changes == pilot.changes


@pytest.mark.parametrize("overrides,needle", [
    ({"data.batch_auto.max": 48}, "is not data.global_batch_size=16 x factor=2^k"),
    ({"data.batch_auto.max": 16}, "must exceed data.global_batch_size=16"),
    ({"data.batch_auto.trigger": "loss"}, "data.batch_auto.trigger='loss'"),
    ({"data.batch_auto.signal": "b_noise"}, "data.batch_auto.signal='b_noise': choose one of"),
    ({"data.batch_auto.signal": "noise_scale_precond", "optim.name": "sgd",
      "optim.b2_rule": "constant"},
     "optim.name='sgd' does not keep; use signal='noise_scale'"),
    ({"optim.warmup_tokens": 0, "optim.warmup_steps": 5},
     "optim.warmup_steps=5 would be converted through batches not yet chosen"),
    ({"optim.decay_tokens": 0}, "set the horizon as optim.decay_tokens"),
    # a schedule in steps with some lengths in steps and some in examples: ambiguous
    ({"optim.schedule_unit": "steps", "optim.warmup_tokens": 0, "optim.decay_tokens": 0,
      "optim.warmup_examples": 64}, "optim.warmup_examples=64 would be converted"),
    ({"optim.schedule_unit": "steps", "optim.schedule": "power", "optim.lr_rule": "none",
      "optim.warmup_tokens": 0, "optim.decay_tokens": 0, "optim.warmup_steps": 2,
      "optim.decay_steps": 50}, "set optim.schedule_unit='tokens'"),
])
def test_config_errors(overrides, needle):
  import jax  # noqa: PLC0415
  cfg = tiny_config(**{**AUTO, **overrides})
  with pytest.raises(ConfigError, match=needle.replace("(", r"\(").replace("^", r"\^")):
    validate(cfg, jax.devices())


def test_defaults_make_auto_one_override():
  """data.batch_ramp=auto alone on sweep_tiny (lengths in examples, a schedule in steps) and on
  a config without micro-batches or noise measurements: the defaults are filled in on a copy,
  each said in one line, and the result validates."""
  import jax  # noqa: PLC0415
  from optim.autopilot import with_defaults  # noqa: PLC0415
  from trainer.config.cli import load  # noqa: PLC0415
  cfg = load("configs/sweep_tiny.py", [("data.batch_ramp", "auto")])
  out, notes = with_defaults(cfg)
  assert (out.data.batch_auto.max, out.optim.schedule_unit) == (128, "tokens")
  assert (cfg.data.batch_auto.max, cfg.optim.schedule_unit) == (0, "steps")  # input unchanged
  assert len(notes) == 2 and "grow to 128 sequences" in notes[0]
  assert "optim.warmup_examples=256 = 16,384 tokens" in notes[1]
  assert validate(cfg, jax.devices()[:1])
  # A schedule in tokens reads the examples exactly: 256 x 64 tokens of warmup.
  from optim import BatchRamp, build_schedule  # noqa: PLC0415
  sched = build_schedule(out.optim, out.steps, BatchRamp.from_config(out.data))
  assert float(sched(8)) == pytest.approx(3e-3 * 8 * 16 / 256)  # at batch 16: 8 x 16 examples
  bare = tiny_config(**{"data.batch_ramp": "auto"})  # lm_tiny-like: all lengths in steps
  out, notes = with_defaults(bare)
  assert (out.data.micro_batch_size, out.optim.noise_scale_every, out.data.batch_auto.max,
          out.optim.schedule_unit) == (8, 2, 64, "steps")
  assert len(notes) == 3
  validate(bare, jax.devices()[:1])
  # 8 rows on 8 data-parallel devices cannot be split into two halves for the noise scale: the
  # error says that the values it names are the autopilot's defaults
  with pytest.raises(ConfigError, match="are the autopilot's default here, set them to choose"):
    validate(tiny_config(**{"data.batch_ramp": "auto", "mesh.data": 8}), 8)
  assert with_defaults(tiny_config()) == (tiny_config(), [])  # no autopilot: nothing to do


# ------------------------------------------------------------------------------------------------
# A run: micro-batches of 8 rows, start at 16 (2 micro-batches), max 64; the noise scale is
# measured every 2 steps and a margin of 0.01 makes the measured B_simple (~1-8 sequences here)
# trigger every time: 16 -> 32 from step 4 (measured at 2), 32 -> 64 from step 6 (measured at 4).
# The meter averages over the whole run (window 1): a window of one noisy measurement can read
# NaN (|G|^2 < 0), which these tests of the rule's mechanics must not depend on.

AUTO = {"data.micro_batch_size": 8, "data.global_batch_size": 16, "data.batch_ramp": "auto",
        "data.batch_auto.max": 64, "data.batch_auto.margin": 0.01,
        "data.batch_auto.patience": 1, "optim.noise_scale_every": 2,
        "optim.noise_scale_min_measurements": 1, "optim.noise_scale_max_rse": 0,
        "optim.noise_scale_window": 1.0, "optim.schedule_unit": "tokens", "optim.warmup_steps": 0, "optim.decay_steps": 0,
        "optim.warmup_tokens": 1024, "optim.decay_tokens": 40000, "optim.lr_rule": "sqrt",
        "optim.b2_rule": "half_life", "optim.ema_decay": 0.9, "checkpoint.every_steps": 0}


@pytest.fixture(scope="module")
def straight(tmp_path_factory, data_dir):
  return trained(tmp_path_factory.mktemp("auto_straight"), tiny_config(steps=8, **AUTO))


def _all_rows(workdir):
  with open(workdir / "metrics.jsonl") as f:
    return [json.loads(line) for line in f]


def test_run_grows_its_batch_and_compiles_each_size_once(straight, capsys):
  run, workdir = straight
  rows = metric_rows(workdir)
  assert [rows[s]["batch_size"] for s in range(1, 9)] == [16] * 3 + [32] * 2 + [64] * 3
  assert run.ramp.stages_by_step() == [(0, 16), (3, 32), (5, 64)]
  # each size once (plain and measuring variants): log2(64 / 16) + 1 = 3 sizes
  assert sorted({m for m, *_ in run.steps.compiled}) == [2, 4, 8]
  assert run.steps.count <= 2 * (math.log2(64 / 16) + 1)
  events = [r for r in _all_rows(workdir) if r.get("event") == "batch_change"]
  assert [(e["step"], e["old_batch"], e["batch"], e["from_step"]) for e in events] == [
      (2, 16, 32, 4), (4, 32, 64, 6)]
  b = rows[2]["noise_scale"]
  assert events[0]["reason"] == f"B_simple={b:.4g} > 0.01 x 16"
  # each stage re-derives its hyperparameters (sqrt lr rule, b2 half-life)
  hp = {e["hparams/batch_size"]: e for e in _all_rows(workdir) if e.get("event") ==
        "hyperparameters"}
  assert sorted(hp) == [16, 32, 64]
  assert hp[64]["hparams/learning_rate"] == pytest.approx(2 * hp[16]["hparams/learning_rate"])
  assert hp[32]["hparams/b2"] == pytest.approx(hp[16]["hparams/b2"] ** 2)
  # the token schedule reads the tokens really seen: step 6 (index 5) starts after
  # 3 x 16 + 2 x 32 sequences of 32 tokens
  sched = run.program.schedule.at(64)
  assert rows[6]["learning_rate"] == pytest.approx(float(sched(5)), rel=1e-6)
  assert run.ramp.tokens_before(5) == (3 * 16 + 2 * 32) * 32


@pytest.mark.parametrize("stop", [3, pytest.param(5, marks=pytest.mark.slow)])
def test_resume_replays_the_decisions_exactly(straight, tmp_path, stop):
  """Stop after step 3 (a decision taken at step 2 is pending: it starts at step 4) or 5
  (stage 32 running, 64 pending from step 6), restart to step 8: the same batches, losses
  bit for bit, the same evaluation of the EMA."""
  _, straight_dir = straight
  first = Run(tiny_config(steps=stop, **AUTO), str(tmp_path))
  assert first.train().status == "done"
  resumed = Run(tiny_config(steps=8, **AUTO), str(tmp_path))
  assert resumed.train().status == "done"
  assert resumed.ramp.stages_by_step() == [(0, 16), (3, 32), (5, 64)]
  want, got = metric_rows(straight_dir), metric_rows(tmp_path)
  for step in range(stop + 1, 9):
    for key in ("loss", "grad_norm", "learning_rate", "param_norm", "batch_size",
                "noise_scale"):
      if key in want[step]:
        assert got[step][key] == want[step][key], (step, key)


@pytest.mark.slow  # the default run keeps test_the_preconditioned_signal_in_a_run (a signal
# other than the default, in a run) and test_norm_test_trigger (the norm test's logic)
def test_norm_test_trigger_in_a_run(tmp_path, data_dir):
  """trigger='norm_test' with the default patience (2): measurements at steps 2 and 4 both fail
  the test at eta = 0.05, so the batch doubles from step 6; the event says why."""
  cfg = tiny_config(steps=6, **{**AUTO, "data.batch_auto.trigger": "norm_test",
                                "data.batch_auto.eta": 0.05, "data.batch_auto.patience": 2})
  run = Run(cfg, str(tmp_path))
  assert run.train().status == "done"
  rows = metric_rows(tmp_path)
  assert [rows[s]["batch_size"] for s in range(1, 7)] == [16] * 5 + [32]
  (event,) = [r for r in _all_rows(tmp_path) if r.get("event") == "batch_change"]
  r = rows[4]
  ratio = r["noise_trace"] / (r["target_tokens"] * r["grad_norm"] ** 2)
  assert event["step"] == 4 and event["from_step"] == 6
  assert event["reason"] == (f"norm test tr(Sigma)/(T |g|^2)={ratio:.4g} > eta^2=0.0025 "
                             "(2 rows in a row)")


def test_the_preconditioned_signal_in_a_run(tmp_path, data_dir):
  """signal='noise_scale_precond' with adamw: the rows log it beside the plain noise scale,
  and the batch follows it (16 -> 32 from step 4, measured at 2); the event says which."""
  cfg = tiny_config(steps=4, **{**AUTO, "data.batch_auto.signal": "noise_scale_precond"})
  run = Run(cfg, str(tmp_path))
  assert run.train().status == "done"
  rows = metric_rows(tmp_path)
  assert [rows[s]["batch_size"] for s in range(1, 5)] == [16] * 3 + [32]
  (event, *_) = [r for r in _all_rows(tmp_path) if r.get("event") == "batch_change"]
  b = rows[2]["noise_scale_precond"]
  assert math.isfinite(b) and b != rows[2]["noise_scale"]
  assert event["reason"] == f"B_simple (preconditioned)={b:.4g} > 0.01 x 16"


# ------------------------------------------------------------------------------------------------
# Two real processes (gloo, 4 CPU devices each) against one process with 8 devices.


@pytest.mark.slow  # two real processes; the default run keeps tests/test_multihost.py's
def test_two_processes_decide_the_same_batches_as_one(tmp_path):
  """data.batch_ramp=auto with micro-batches of 4 rows, 8 -> 32, margin 0.01 (every measurement
  fires), noise measured every 2 steps: 8 -> 16 from step 4, 16 -> 32 from step 6. Each process
  decides alone from the replicated metrics; the evidence that process 1 followed the same
  batches is its own data state (every process writes the stream's position, the windows
  consumed, with each checkpoint, here at steps 2, 4, 6, 8): equal at every checkpoint to the
  single-process run's, which consumed 8, 8, 8, 16, 16, 32, 32, 32 sequences. Losses
  equal the single process's to rtol 1e-5 (float rounding: the gradient's cross-process
  all-reduce sums in another order, as in test_multihost)."""
  from test_multihost import MODEL_ARGS, launch_beside_reference  # noqa: PLC0415
  args = MODEL_ARGS + [
      "--config.steps=8", "--config.data.micro_batch_size=4", "--config.data.batch_ramp=auto",
      "--config.data.batch_auto.max=32", "--config.data.batch_auto.margin=0.01",
      "--config.data.batch_auto.patience=1", "--config.optim.noise_scale_every=2",
      "--config.optim.noise_scale_min_measurements=1", "--config.optim.noise_scale_max_rse=0",
      "--config.optim.schedule_unit=tokens", "--config.optim.warmup_steps=0",
      "--config.optim.decay_steps=0", "--config.optim.warmup_tokens=512",
      "--config.optim.decay_tokens=20000", "--config.checkpoint.keep=10"]
  multi, single = tmp_path / "multi", tmp_path / "single"
  results = launch_beside_reference(multi, single, args, args)
  assert "batch 8 -> 16 from step 4" in results[0][1] and "batch 16 -> 32 from step 6" in \
      results[0][1]
  got, want = metric_rows(multi), metric_rows(single)
  assert [got[s]["batch_size"] for s in range(1, 9)] == [8] * 3 + [16] * 2 + [32] * 3
  assert [want[s]["batch_size"] for s in range(1, 9)] == [8] * 3 + [16] * 2 + [32] * 3
  for step in range(1, 9):
    assert got[step]["loss"] == pytest.approx(want[step]["loss"], rel=1e-5), step

  def data_states(workdir, step):
    """{file name: the data state it holds} of checkpoint `step`."""
    data = workdir / "checkpoints" / str(step) / "data"
    return {f.name: json.loads(f.read_text()) for f in sorted(data.glob("process_*.json"))}

  # The stream's position is the windows consumed: 8, 8 | 8, 16 | 16, 32 | 32, 32 sequences.
  for step, windows in ((2, 16), (4, 40), (6, 88), (8, 152)):
    mine, (ref,) = data_states(multi, step), data_states(single, step).values()
    assert sorted(mine) == ["process_0-of-2.json", "process_1-of-2.json"]
    assert ref["windows"] == windows, (step, ref)
    for name, state in mine.items():
      assert state == ref, (step, name)
  # The decisions saved with the last checkpoint are the single process's.
  from trainer.checkpoint.persistent import Checkpointer  # noqa: PLC0415
  decisions = []
  for workdir in (multi, single):
    ckpt = Checkpointer(str(workdir / "checkpoints"), keep=10, async_save=False, log=print)
    try:
      decisions.append(ckpt.saved_autopilot(8))
    finally:
      ckpt.close()
  assert decisions[0] == decisions[1]
  assert [(c["step"], c["batch"]) for c in decisions[0]["changes"]] == [(4, 16), (6, 32)]


@pytest.mark.slow  # compiles sweep_tiny at 4 batch sizes; test_defaults_make_auto_one_override
# checks the same defaults and the run tests above the autopilot in training
def test_train_py_with_auto_alone_runs_and_prints_its_defaults(tmp_path, capsys):
  """`python train.py --config configs/sweep_tiny.py --config.data.batch_ramp=auto` (a few
  steps): runs to the end, and says which defaults it filled in and what it will do."""
  import train  # noqa: PLC0415
  code = train.main(["--config", "configs/sweep_tiny.py", "--workdir", str(tmp_path),
                     "--config.data.batch_ramp=auto", "--config.steps=2",
                     "--config.log_every=1", "--config.eval_every=0",  # one compiled step
                     "--config.trainer.progress_bar=false"])
  out = capsys.readouterr().out
  assert code == 0, out
  assert "batch autopilot default: data.batch_auto.max=0: the batch may grow to 128" in out
  assert "batch autopilot default: optim.schedule_unit='steps' -> 'tokens'" in out
  assert "batch autopilot: 16 -> 32 -> 64 -> 128 sequences" in out
  assert "schedule constant in tokens: warmup 16,384" in out
  saved = json.loads((tmp_path / "config.json").read_text())  # the run's config, as it ran
  assert saved["data"]["batch_auto"]["max"] == 128 and saved["optim"]["schedule_unit"] == "tokens"

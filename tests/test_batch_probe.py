"""tools/batch_probe.py: the paper's critical-batch rule, the smoothing, the ramp it implies, the
branch configs, and the probe on a tiny run end to end (its k = 1 branch is the run continued;
the run is left untouched; the ramp overrides make a config that validates)."""
import hashlib
import json
import os

import pytest

from conftest import tiny_config
from tools import batch_probe


def test_smoothing_is_the_papers_ema():
  assert batch_probe.smoothed([4.0]) == 4.0
  assert batch_probe.smoothed([4.0, 2.0, 3.0]) == pytest.approx(0.5 * 3 + 0.25 * 2 + 0.25 * 4)


def test_critical_factor_is_the_largest_within_tolerance_of_every_smaller():
  rule = batch_probe.critical_factor
  assert rule({1: 3.00, 2: 3.005, 4: 3.02, 8: 3.1}, 0.01) == 2  # 4 is 0.02 above 1
  # 4 is within 0.01 of 1 but not of 2 (2.99 > 2.95 + 0.01): the paper's rule says all smaller
  assert rule({1: 3.00, 2: 2.95, 4: 2.99}, 0.01) == 2
  assert rule({1: 3.00, 2: 3.05, 4: 2.90}, 0.01) == 4  # beats every smaller one
  assert rule({1: 3.00, 2: 3.2}, 0.01) == 1
  assert rule({1: 3.00, 2: 3.2}, 1.0) == 2


def test_implied_stages_double_while_the_critical_batch_allows():
  stages = batch_probe.implied_stages([(1000, 16), (2000, 32), (3000, 128), (4000, 64)], 16)
  assert stages == [(16, 0), (32, 2000), (128, 3000)]  # x4 at once; never shrinks
  assert batch_probe.implied_stages([(1000, 16), (2000, 31)], 16) == [(16, 0)]


def test_branch_config_keeps_the_schedule_in_tokens_and_moves_the_rate():
  """A run at batch 8 (cosine, warmup 2 and horizon 50 steps, noise meter every 2) branched at
  step 12 at x4: ramp 8 then 32 from step 12's tokens, the reference batch pinned at 8 and
  AdamW's sqrt rule, the schedule's lengths in tokens at batch 8, evaluations every
  gcd(12, steps / evals), the meter kept but measuring nothing."""
  run = tiny_config(steps=40, **{"optim.noise_scale_every": 2, "data.micro_batch_size": 4})
  cfg = batch_probe.branch_config(run, 12, 4, tokens=4096, evals=2, eval_sequences=16,
                                  rule=batch_probe.check_run(run))
  assert cfg.data.batch_ramp == "8:0,32:3072" and cfg.data.global_batch_size == 32
  assert (cfg.data.micro_batch_size, cfg.optim.reference_batch_size, cfg.optim.lr_rule) == \
      (4, 8, "sqrt")
  assert (cfg.optim.schedule_unit, cfg.optim.warmup_tokens, cfg.optim.decay_tokens,
          cfg.optim.warmup_steps, cfg.optim.decay_steps) == ("tokens", 512, 12800, 0, 0)
  assert cfg.steps == 12 + 4 and cfg.eval_every == 2 and cfg.optim.noise_scale_every > cfg.steps
  from optim import BatchRamp, build_schedule, derive  # noqa: PLC0415
  from trainer.config.checks import validate  # noqa: PLC0415
  validate(cfg, 1)
  ramp = BatchRamp.from_config(cfg.data)
  old = build_schedule(run.optim, run.steps, peak=derive(run.optim, 8).learning_rate)
  new = build_schedule(cfg.optim, cfg.steps, ramp,
                       peak=derive(cfg.optim, 32, 32).learning_rate)
  assert float(new(12)) == pytest.approx(2 * float(old(12)), rel=1e-5)  # sqrt(4) x the run's
  # A run without a rate rule used its stated rate at its own batch: restated at its reference
  # batch (16) so that the branch at x4 gets sqrt(4) x the run's rate, b2 by the run's rules.
  ruleless = tiny_config(steps=40, **{"optim.reference_batch_size": 16,
                                      "optim.b2_rule": "half_life"})
  cfg = batch_probe.branch_config(ruleless, 12, 4, 4096, 2, 16, "sqrt")
  hp = derive(cfg.optim, 32, 32)
  assert hp.learning_rate == pytest.approx(2 * 1e-2) and hp.b2 == pytest.approx(0.95 ** 2)


def _digest(directory) -> str:
  h = hashlib.sha256()
  for root, _, files in sorted(os.walk(directory)):
    for name in sorted(files):
      path = os.path.join(root, name)
      h.update(path.encode())
      with open(path, "rb") as f:
        h.update(f.read())
  return h.hexdigest()


@pytest.fixture(scope="module")
def run_dir(tmp_path_factory, data_dir):
  """A tiny run at batch 8 (AdamW, cosine), checkpoints at steps 4 and 8, evaluated every 2
  steps on 16 validation sequences."""
  from trainer.run.loop import Run  # noqa: PLC0415
  workdir = tmp_path_factory.mktemp("probe_run")
  cfg = tiny_config(steps=8, **{"checkpoint.every_steps": 4, "eval_every": 2,
                                "eval_sequences": 16})
  assert Run(cfg, str(workdir)).train().status == "done"
  return workdir


def test_probe_on_a_tiny_run(run_dir, tmp_path, capsys):
  before = _digest(run_dir)
  out = tmp_path / "probe"
  code = batch_probe.main(["--workdir", str(run_dir), "--at", "4,8", "--factors", "2",
                           "--tokens", "1000", "--evals", "2", "--eval_sequences", "16",
                           "--tolerance", "10", "--ramp", "--keep_branches", "--b_crit", "12",
                           "--out", str(out)])
  printed = capsys.readouterr().out
  assert code == 0, printed
  assert "--tokens 1,000 -> 1,024" in printed
  assert _digest(run_dir) == before  # the run is untouched
  summary = json.loads((out / "batch_probe.json").read_text())
  assert [(p["step"], p["critical_batch"], p["censored"]) for p in summary["points"]] == [
      (4, 16, ">="), (8, 16, ">=")]
  assert summary["implied_stages"] == [[8, 0], [16, 4 * 8 * 32]]
  from tools import figures  # noqa: PLC0415
  if figures.pyplot() is not None:  # the figure, with the sweep's B_crit drawn
    assert (out / "batch_probe.png").stat().st_size > 10_000
  rows = (out / "batch_probe.csv").read_text().splitlines()
  assert len(rows) == 1 + 4 and rows[0].startswith("at_step,at_tokens,factor,batch")
  # The k = 1 branch is the run continued: its evaluations at steps 6 and 8 are the run's.
  from trainer.run.inprocess import read_rows  # noqa: PLC0415
  evals = lambda d: {r["step"]: r["eval_loss"] for r in read_rows(d) if "eval_loss" in r}
  branch, run = evals(out / "branches" / "at4_x1"), evals(run_dir)
  assert branch[6] == pytest.approx(run[6], rel=1e-5)
  assert branch[8] == pytest.approx(run[8], rel=1e-5)
  x2 = [r for r in read_rows(out / "branches" / "at4_x2") if "learning_rate" in r]
  assert [r["batch_size"] for r in x2] == [16, 16]  # 1,024 tokens at 16 x 32: two steps
  # The implied ramp is a config a plain run takes.
  from trainer.config.cli import load, parse_overrides  # noqa: PLC0415
  from trainer.config.checks import validate  # noqa: PLC0415
  overrides = (out / "ramp_overrides.txt").read_text().split()
  assert "--config.data.batch_ramp=8:0,16:1024" in overrides and "--config.steps=6" in overrides
  config = tmp_path / "tiny.py"
  config.write_text("from conftest import tiny_config\ndef get_config():\n"
                    "  return tiny_config(steps=8)\n")
  for name in ("ramp_overrides.txt", "autopilot_overrides.txt"):
    cfg = load(str(config), parse_overrides((out / name).read_text().split()))
    validate(cfg, 1)


@pytest.mark.parametrize("argv,needle", [
    (["--at", "5"], "has no checkpoint at step 5 (it has 4, 8)"),
    (["--at", "4,x"], "argument --at: '4,x': give comma-separated integers"),
    (["--at", "4", "--factors", "1"], "--factors needs integers >= 2"),
    (["--at", "4", "--config.optim.name=lion"], "optim.name='lion' has no rate rule"),
])
def test_mistakes_are_one_line(run_dir, tmp_path, capsys, argv, needle):
  code = batch_probe.main(["--workdir", str(run_dir), "--tokens", "1024",
                           "--out", str(tmp_path)] + argv)
  err = capsys.readouterr().err.strip()
  assert code == 2 and needle in err and "\n" not in err


def test_a_missing_workdir_or_an_unwritable_out_is_one_line(tmp_path, capsys):
  """Neither needs a trained run: both are said before anything is read or trained."""
  (tmp_path / "file").write_text("")
  for argv, needle in ((["--workdir", str(tmp_path / "nothing")], "nothing does not exist; give "
                        "the --workdir of a trained run"),
                       (["--workdir", str(tmp_path), "--out", str(tmp_path / "file" / "out")],
                        "out: cannot create it (Not a directory)")):
    code = batch_probe.main(argv + ["--at", "10", "--tokens", "1024"]
                            + ([] if "--out" in argv else ["--out", str(tmp_path / "o")]))
    err = capsys.readouterr().err.strip()
    assert code == 2 and needle in err and "\n" not in err, err

"""Critical-batch sweep: the McCandlish fit, target crossings, and the tool end to end."""
import csv
import json
import math
import os

import numpy as np
import pytest

from conftest import write_sweep_config
from tools import batch_sweep, figures, sweep_seeds
from tools.tradeoff import Fit, fit_tradeoff
from trainer.tracking.record import crossing, smooth


def test_fit_recovers_the_tradeoff():
  """Steps from (S/S_min - 1)(E/E_min - 1) = 1 with S_min = 300, E_min = 6000 (B_crit = 20)."""
  batches = [4, 8, 16, 32, 64, 128]
  steps = [300 + 6000 / b for b in batches]
  fit = fit_tradeoff(batches, steps)
  assert fit.s_min == pytest.approx(300) and fit.e_min == pytest.approx(6000)
  assert fit.b_crit == pytest.approx(20) and not fit.note
  for b, s in zip(batches, steps):
    e = b * s
    assert (s / fit.s_min - 1) * (e / fit.e_min - 1) == pytest.approx(1.0)


def test_fit_with_noise_is_close():
  rng = np.random.default_rng(0)
  batches = np.array([8, 16, 32, 64, 128, 256])
  steps = (500 + 20000 / batches) * np.exp(0.03 * rng.standard_normal(len(batches)))
  fit = fit_tradeoff(batches, steps)
  assert fit.b_crit == pytest.approx(40, rel=0.25)


def test_fit_degenerate_ranges():
  perfect = fit_tradeoff([8, 16, 32], [800, 400, 200])  # E constant: B_crit above the range
  assert perfect.s_min == 0 and math.isinf(perfect.b_crit)
  assert perfect.e_min == pytest.approx(6400) and "above the largest" in perfect.note
  flat = fit_tradeoff([8, 16, 32], [100, 100, 100])  # no gain from batch
  assert flat.s_min == pytest.approx(100) and flat.b_crit == pytest.approx(0, abs=1e-9)
  with pytest.raises(ValueError, match="at least two"):
    fit_tradeoff([8], [10])
  assert list(Fit(10, 100).steps([10, 100])) == [20, 11]


def test_crossing_and_smoothing():
  points = [(0, 5.0), (10, 4.0), (20, 3.0), (30, 2.0)]
  assert crossing(points, 3.5) == 15 and crossing(points, 5.5) == 0
  assert crossing(points, 1.0) is None
  assert smooth(points, 10) == [(10, 4.0), (20, 3.0)]  # a linear trend passes unchanged
  jagged = [(x, 3.0 - 0.01 * x + (0.2 if i % 2 else -0.2)) for i, x in enumerate(range(0, 90, 10))]
  assert crossing(jagged, 2.6) == pytest.approx(20.0)  # the raw curve dips below early ...
  assert crossing(smooth(jagged, 20), 2.6) == pytest.approx(40.0, abs=3)  # ... its trend at 40


def test_plot_writes_the_png(tmp_path):
  """The two-panel figure from results and their runs' noise-scale rows (matplotlib is in the
  test extra, so this runs in CI)."""
  results = []
  for i, (batch, steps) in enumerate([(8, 400.0), (16, 250.0), (32, 180.0)]):
    workdir = tmp_path / f"run{i}"
    workdir.mkdir()
    with open(workdir / "metrics.jsonl", "w") as f:
      for step in range(10, 400, 10):
        f.write(json.dumps({"step": step, "loss": 3.0, "noise_scale": 2.0 + step / 40}) + "\n")
    results.append(batch_sweep.Result(
        batch_size=batch, lr_multiplier=1.0, learning_rate=1e-3, steps=steps,
        examples=steps * batch, tokens=steps * batch * 64, noise_scale=5.0, micro_batches=4,
        final_eval_loss=2.6, steps_run=400, seconds=1.0, workdir=str(workdir), best=True))
  fit = fit_tradeoff([r.batch_size for r in results], [r.steps for r in results])
  path = tmp_path / "sweep.png"
  assert batch_sweep.plot(str(path), results, results, fit, {"b_simple_median": 5.0}, 2.7,
                          "test sweep")
  with open(path, "rb") as f:
    assert f.read(8) == b"\x89PNG\r\n\x1a\n"
  assert os.path.getsize(path) > 10_000


@pytest.mark.slow
def test_sweep_end_to_end(tmp_path, data_dir):
  """Two batch sizes of a tiny model to an easy target: CSV, JSON, plot, and a fit."""
  config = write_sweep_config(tmp_path)
  out = tmp_path / "out"
  code = batch_sweep.main(["--config", str(config), "--batch_sizes", "16,32", "--target_loss",
                           "4.5", "--out", str(out), "--eval_examples", "32",
                           "--smooth_examples", "64", "--eval_sequences", "16",
                           "--max_examples", "1600"])
  assert code == 0
  rows = list(csv.DictReader(open(out / "batch_sweep.csv")))
  assert [int(r["batch_size"]) for r in rows] == [16, 32]
  assert all(r["steps"] not in ("", "None") for r in rows), rows
  summary = json.load(open(out / "batch_sweep.json"))
  assert summary["reached"] == [16, 32] and "b_crit" in summary and "b_simple_median" in summary
  assert os.path.getsize(out / "batch_sweep.png") > 10_000  # matplotlib is in the test extra


@pytest.mark.slow  # four trainings
def test_sweep_over_seeds(tmp_path, data_dir):
  """`--seeds 2`: a sweep per seed in <out>/seed<s>, the spread of B_crit and of each batch's
  steps in batch_sweep_seeds.json, seed 0's figure as the sweep's."""
  config = write_sweep_config(tmp_path)
  out = tmp_path / "out"
  code = batch_sweep.main(["--config", str(config), "--batch_sizes", "16,32", "--target_loss",
                           "4.5", "--out", str(out), "--eval_examples", "32",
                           "--smooth_examples", "64", "--eval_sequences", "16",
                           "--max_examples", "1600", "--seeds", "2"])
  assert code == 0
  per_seed = [json.load(open(out / f"seed{s}" / "batch_sweep.json")) for s in (0, 1)]
  summary = json.load(open(out / "batch_sweep_seeds.json"))
  assert summary["seeds"] == [0, 1] and summary["b_crit"]["n"] == 2
  assert summary["b_crit"]["mean"] == pytest.approx((per_seed[0]["b_crit"] +
                                                     per_seed[1]["b_crit"]) / 2)
  assert summary["steps"]["16"]["n"] == 2
  assert os.path.getsize(out / "batch_sweep.png") > 10_000
  rows = list(csv.DictReader(open(out / "batch_sweep_seeds.csv")))
  assert [int(r["seed"]) for r in rows] == [0, 1] and {r["optimizer"] for r in rows} == {"adamw"}
  assert [float(r["b_crit"]) for r in rows] == pytest.approx([s["b_crit"] for s in per_seed])


def test_the_ema_curve_sets_the_crossing(tmp_path, data_dir, capsys, monkeypatch):
  """`--curve ema`: the run stops where the parameter EMA's eval loss reaches the target, and the
  result is that crossing (later than the raw curve's: the average lags); without an EMA in the
  config, or on the masked LM's accuracy (no EMA of it is logged), one line and exit code 2."""
  import argparse
  from trainer.config.cli import load
  from trainer.tracking.record import eval_curve, to_target
  config = write_sweep_config(tmp_path)
  cfg = load(config, [])
  cfg.optim.ema_decay = 0.9
  args = argparse.Namespace(target_loss=5.0, smooth_examples=0, max_examples=640,
                            micro_batch_size=16, eval_examples=32, eval_sequences=8,
                            target_metric="eval_loss", curve="ema")
  got, real = {}, batch_sweep.train
  def spy(*a, **kw):
    got["run"] = real(*a, **kw)
    return got["run"]
  monkeypatch.setattr(batch_sweep, "train", spy)
  r = batch_sweep.run_one(cfg, 16, 1.0, args, str(tmp_path / "b16"))
  rows, ramp = got["run"].rows, got["run"].ramp
  ema = to_target(eval_curve(rows, ramp, "eval_loss_ema"), ramp, 5.0, 0)
  raw = to_target(eval_curve(rows, ramp, "eval_loss"), ramp, 5.0, 0)
  assert r.steps is not None and r.steps == ema.steps and raw.steps < ema.steps
  assert got["run"].steps_run < 40  # stopped at the EMA's crossing, not run to its length
  sweep = ["--config", config, "--batch_sizes", "16", "--target_loss", "5", "--out",
           str(tmp_path / "out"), "--curve", "ema"]
  assert batch_sweep.main(sweep) == 2
  assert "set --config.optim.ema_decay" in capsys.readouterr().err
  assert batch_sweep.main(sweep + ["--config.optim.ema_decay=0.9", "--target_metric",
                                   "eval_masked_error"]) == 2
  assert "logs no EMA accuracy" in capsys.readouterr().err


def test_two_sweeps_compare_seed_by_seed(tmp_path, capsys):
  """batch_sweep_seeds.csv holds a row per seed (B_crit, log2 of it, the steps per batch, the
  censored batches), so two sweeps of the same seeds pair in `tools.stats`: log2 B_crit of A
  minus B, by seed, with a censored seed (no fit) left out."""
  from tools import stats
  def summary(seed, optimizer, b_crit, censored=()):
    return {"seed": seed, "optimizer": optimizer, "target_metric": "eval_error",
            "target_loss": 0.05, "b_crit": b_crit, "s_min": 10.0, "e_min": 10.0 * (b_crit or 1),
            "censored": list(censored), "steps": {32: 100.0, 64: 60.0}}
  a = sweep_seeds.seed_rows([summary(0, "lars", 64.0), summary(1, "lars", 128.0),
                             summary(2, "lars", 32.0), summary(3, "lars", None, [64])])
  b = sweep_seeds.seed_rows([summary(s, "sgd", 32.0) for s in range(4)])
  assert a[0]["log2_b_crit"] == 6.0 and a[3]["log2_b_crit"] is None and a[3]["censored"] == "64"
  assert a[0]["steps_32"] == 100.0 and a[0]["steps_64"] == 60.0
  for name, rows in (("a", a), ("b", b)):
    figures.write_csv(str(tmp_path / f"{name}.csv"), rows)
  assert stats.main([str(tmp_path / "a.csv"), str(tmp_path / "b.csv"), "--metric", "log2_b_crit",
                     "--arm", "optimizer", "--a", "lars", "--b", "sgd"]) == 0
  out = capsys.readouterr().out
  want = stats.paired({0: 6.0, 1: 7.0, 2: 5.0}, {0: 5.0, 1: 5.0, 2: 5.0})
  assert want.verdict("lars", "sgd", fmt=".4g") in out and "seeds [0, 1, 2]" in out, out
  # the two side by side: each sweep's mean steps per batch over its seeds, and the figure
  b[1]["steps_64"] = 90.0
  figures.write_csv(str(tmp_path / "b.csv"), b)
  fig = tmp_path / "both.png"
  assert sweep_seeds.main([str(tmp_path / "a.csv"), str(tmp_path / "b.csv"), "--out",
                           str(fig)]) == 0
  out = capsys.readouterr().out
  assert "lars: B_crit 74.7 (n=3); mean steps to eval_error 0.05: 32: 100.0, 64: 60.0" in out
  assert "sgd: B_crit 32 (n=4); mean steps to eval_error 0.05: 32: 100.0, 64: 67.5" in out
  assert fig.stat().st_size > 0
  figures.write_csv(str(tmp_path / "no_steps.csv"),
                    [{k: v for k, v in r.items() if not k.startswith("steps_")} for r in b])
  assert sweep_seeds.main([str(tmp_path / "no_steps.csv"), "--out", str(fig)]) == 2
  assert "no steps_<batch> columns" in capsys.readouterr().err


def test_reuse_reads_a_stopped_run_back_under_the_same_rule(tmp_path, data_dir, capsys,
                                                             monkeypatch):
  """`--reuse`: a run stopped at its target is read back from its record (the same result, no
  training); the record holds the stop rule, so another target, smoothing or length, or a
  reader that states no rule, trains it again."""
  import argparse
  from trainer.config import checks
  from trainer.config.cli import load
  from trainer.run import inprocess
  cfg = load(write_sweep_config(tmp_path), [])
  args = argparse.Namespace(target_loss=5.5, smooth_examples=0, max_examples=320,
                            micro_batch_size=16, eval_examples=32, eval_sequences=8,
                            target_metric="eval_loss", reuse=True)
  workdir = str(tmp_path / "b16")
  first = batch_sweep.run_one(cfg, 16, 1.0, args, workdir)
  assert first.steps is not None and first.steps_run < 20  # stopped at the target
  assert "[reuse]" not in capsys.readouterr().out

  def no_training(*a, **kw):  # the first thing a training does, before it clears its workdir
    raise AssertionError("trained again")
  monkeypatch.setattr(checks, "validate", no_training)
  again = batch_sweep.run_one(cfg, 16, 1.0, args, workdir)
  assert "read from its finished.json" in capsys.readouterr().out
  assert again == first
  for change in ({"target_loss": 5.4}, {"smooth_examples": 64}, {"max_examples": 640}):
    with pytest.raises(AssertionError, match="trained again"):
      batch_sweep.run_one(cfg, 16, 1.0, argparse.Namespace(**{**vars(args), **change}), workdir)
  assert inprocess.finished(batch_sweep.run_config(cfg, 16, 1.0, args), workdir) is None
  args.reuse = False
  with pytest.raises(AssertionError, match="trained again"):
    batch_sweep.run_one(cfg, 16, 1.0, args, workdir)


def steps_surface(best_mult: float, batch: int = 32):
  """Steps to a target on a synthetic loss surface: McCandlish's curve at the best rate, growing
  quadratically in log2 of the rate's distance from `best_mult`; beyond 4x the best the run
  diverges (never reaches the target)."""
  def steps(mult):
    if mult > 4 * best_mult:
      return None
    return (40 + 1600 / batch) * (1 + 0.3 * math.log2(mult / best_mult) ** 2)
  return steps


def test_bracketing_finds_an_optimum_outside_the_starting_grid():
  """The surface's best rate is x8 (x0.1) of the rule's: the grid 0.5, 1, 2 grows to 16 (0.03125)
  and stops with the best inside; a diverged run brackets; edges that stay edges are reported."""
  from tools.tradeoff import bracket, interior, next_multipliers  # noqa: PLC0415
  calls = []
  run = lambda m: calls.append(m) or steps_surface(8.0)(m)
  scores = bracket(run, [0.5, 1, 2])
  assert calls == [0.5, 1, 2, 4, 8, 16] and interior(scores)
  assert min((v, m) for m, v in scores.items())[1] == 8
  low = bracket(steps_surface(0.1), [0.5, 1, 2])
  # every run of the starting grid diverges: the grid grows both ways until one reaches
  assert sorted(low) == [0.0625, 0.125, 0.25, 0.5, 1, 2, 4] and interior(low)
  assert min((v, m) for m, v in low.items() if v)[1] == 0.125  # nearest grid point to 0.1
  # the run above the best diverges: a bracket, not a failure
  diverge = {1: 100.0, 2: 90.0, 4: None}
  assert interior(diverge) and next_multipliers(diverge) == []
  # limited extensions: still at the edge, and said so
  capped = bracket(steps_surface(64.0), [0.5, 1, 2], max_extensions=2)
  assert sorted(capped) == [0.5, 1, 2, 4, 8] and interior(capped) is False
  # several seeds / budgets: the union of what each needs; a grid of one grows both ways
  assert next_multipliers({0.5: 9.0, 1: 10.0, 2: 11.0}, {0.5: 12.0, 1: 11.0, 2: 10.0}) == [0.25, 4]
  assert next_multipliers({1: 10.0}) == [0.5, 2] and next_multipliers({1: None, 2: None}) == [0.5, 4]


def test_a_censored_point_is_an_upper_bound_in_the_fit():
  """Steps on S = 40 (1 + 32 / B); batch 4's run was below the target at its first evaluation,
  so only an upper bound (400 steps, above the true 360) is known: the censored fit recovers
  B_crit, the plain fit of the bound does not; a bound below the curve is fitted as measured."""
  b = np.array([4, 8, 16, 32, 64, 128])
  s = 40 * (1 + 32 / b)
  bounded = np.where(b == 4, 400.0, s)
  cens = b == 4
  assert fit_tradeoff(b, bounded, cens).b_crit == pytest.approx(32, rel=1e-3)
  assert abs(fit_tradeoff(b, bounded).b_crit - 32) > 2
  tight = np.where(b == 4, 300.0, s)  # the bound says at most 300: the curve must bend down
  assert fit_tradeoff(b, tight, cens).b_crit == pytest.approx(fit_tradeoff(b, tight).b_crit)


def test_the_fit_reports_its_misfit():
  """Residuals, local slopes and the residual interval: on McCandlish's curve the residuals are
  0 and slopes fall from ~1 towards 0; on a slope-0.5 power law (a sqrt rate rule's shape) the
  residuals are S-shaped, the slopes flat at 0.5, and B_crit moves with the batch window."""
  from tools.tradeoff import local_slopes, window_sensitivity  # noqa: PLC0415
  b = np.array([4, 8, 16, 32, 64, 128, 256])
  clean = fit_tradeoff(b, 50 * (1 + 32 / b))
  assert max(map(abs, clean.residuals)) < 1e-9 and clean.b_crit_lo == pytest.approx(32)
  slopes = local_slopes(b, 50 * (1 + 32 / b))
  assert slopes[0] > 0.8 and slopes[-1] < 0.2 and slopes == sorted(slopes, reverse=True)
  power = 2000 / np.sqrt(b)
  fit = fit_tradeoff(b, power)
  assert local_slopes(b, power) == pytest.approx([0.5] * 6)
  signs = np.sign(fit.residuals)
  assert signs[0] == signs[-1] and signs[3] == -signs[0]  # S-shaped: ends one way, middle other
  windows = window_sensitivity(b, power)
  assert max(windows.values()) / min(windows.values()) > 1.5
  assert fit.b_crit_lo < fit.b_crit < fit.b_crit_hi

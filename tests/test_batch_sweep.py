"""Critical-batch sweep: the McCandlish fit, target crossings, and the tool end to end."""
import csv
import json
import math
import os

import numpy as np
import pytest

from conftest import write_sweep_config
from tools import batch_sweep
from tools.batch_sweep import Fit, fit_tradeoff
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

"""The scaling lab: Zhang et al.'s 20%-overhead batch on a known curve, the estimates of one (N, D)
from synthetic seeds, the power-law fit recovering known exponents from noisy data (bootstrap and
covariance intervals), the resume rule, and the lab's command end to end."""
import csv
import json
import math
import os

import numpy as np
import pytest

from conftest import tiny_config_file
from experiments import common, scaling_cells
from experiments import critical_batch_scaling as lab
from experiments import scaling_runs
from tools import scaling_fit
from tools.tradeoff import zhang_batch
from trainer.tracking.record import target_stop


def test_zhang_batch_on_mccandlish_curve():
  """On S = S_min + E_min / B, E(B) / E(b0) = 1.2 at B = 1.2 b0 + 0.2 B_crit, exactly, on any grid
  of batches; beyond the grid it is None."""
  s_min, e_min = 40.0, 1600.0  # B_crit = 40
  batches = [256, 8, 64, 16, 128, 32]  # any order
  steps = [s_min + e_min / b for b in batches]
  assert zhang_batch(batches, steps) == pytest.approx(1.2 * 8 + 0.2 * 40)
  assert zhang_batch(batches, steps, overhead=1.0) == pytest.approx(2 * 8 + 40)
  perfect = [6400 / b for b in batches]  # steps halve with every doubling: no overhead
  assert zhang_batch(batches, perfect) is None
  # measured steps (not on the curve): E / E(8) = 1, 1.1, 1.3, 1.6; +20% between 16 and 32
  assert zhang_batch([8, 16, 32, 64], [100, 55, 32.5, 20]) == pytest.approx(24)


def test_target_stop_waits_for_min_examples():
  seen = {10: 80, 20: 240, 30: 560}
  stop = target_stop(2.6, 0, seen.__getitem__, min_examples=500)
  assert stop(20, {"eval_loss": 2.5}) is None  # below the target, but only 240 seen
  assert stop(30, {"eval_loss": 2.4}).startswith("smoothed eval_loss <= 2.6 at 240 examples")
  # a diverged run stops (it will not reach the target): non-finite, or far above its start
  stop = target_stop(2.6, 0, seen.__getitem__, min_examples=500)
  assert stop(10, {"eval_loss": 5.0}) is None and stop(20, {"eval_loss": 5.9}) is None
  assert stop(30, {"eval_loss": 6.2}).startswith("diverged: eval_loss 6.2 at 560 examples")
  assert target_stop(2.6, 0, seen.__getitem__)(10, {"eval_loss": math.nan}).startswith("diverged")


def synthetic_rows(seeds=(0, 1, 2), noise=0.03, b_crit=40.0, rng=None):
  """One (N, D)'s rows: steps on McCandlish's curve at the fastest rate (x1; the others slower,
  most at small batches), the loss after D a parabola in log2 B (lowest at 2^5.4 = 42, between
  grid points) and in log2 of the rate (lowest at x2^0.3 = 1.23e-3)."""
  rng = rng or np.random.default_rng(0)
  rows = []
  for s in seeds:
    for b in (8, 16, 32, 64, 128, 256):
      for m in (0.5, 1.0, 2.0):
        steps = 50 * (1 + b_crit / b) * (1 + 16 / b if m != 1 else 1) * math.exp(
            noise * rng.standard_normal())
        loss = 2.5 + 0.03 * (math.log2(b) - 5.4) ** 2 + 0.05 * (math.log2(m) - 0.3) ** 2 \
            + 0.002 * rng.standard_normal()
        rows.append(dict(seed=s, batch_size=b, lr_multiplier=m, learning_rate=1e-3 * m,
                         steps=steps, examples=steps * b, noise_scale=20.0 + s,
                         micro_batches=b // 8, loss_at_budget=loss))
  return rows


def test_cell_estimates_from_seeds():
  """B_crit and Zhang's batch from the fastest rate per batch, averaged over seeds, inside their
  paired bootstrap intervals; B_opt and eta_opt at the parabolas' minima, inside the grid;
  B_simple the median of the meter's values of runs with 4 or more micro-batches; the fit's
  residuals and residual-based interval beside them."""
  rows = synthetic_rows()
  est, reps = scaling_cells.cell(rows, scaling_cells.draws(200, 3))
  assert est["refused"] == "" and est["interior_cases"] == est["cases"] == 18
  assert est["b_crit"] == pytest.approx(40, rel=0.15)
  assert est["b_crit_lo"] < est["b_crit"] < est["b_crit_hi"] and est["b_crit_hi"] < 80
  assert est["b_crit_fit_lo"] < est["b_crit"] < est["b_crit_fit_hi"]
  assert set(est["residuals"]) == {8, 16, 32, 64, 128, 256} and len(est["local_slopes"]) == 5
  assert est["b_zhang"] == pytest.approx(1.2 * 8 + 0.2 * 40, rel=0.15)
  assert est["b_opt"] == pytest.approx(2 ** 5.4, rel=0.1) and est["b_opt_resolved"]
  assert est["eta_opt"] == pytest.approx(1e-3 * 2 ** 0.3, rel=0.1) and est["eta_opt_resolved"]
  assert est["b_simple"] == 21.0 and len(reps) == 200 and est["seeds"] == 3
  assert est["zhang_b0"] == 8
  # a rate grid of one: eta_opt at its edge, not resolved; B_opt at the smallest batch, neither
  edge = [dict(r, loss_at_budget=r["loss_at_budget"] + 0.3 * math.log2(r["batch_size"]))
          for r in rows if r["lr_multiplier"] == 1.0]
  est, _ = scaling_cells.cell(edge, scaling_cells.draws(20, 3))
  assert est["b_opt"] == 8 and not est["b_opt_resolved"] and not est["eta_opt_resolved"]
  # every rate, B_opt at the edge: the rate's minimum is inside its grid, but not the joint one
  edge = [dict(r, loss_at_budget=r["loss_at_budget"] + 0.3 * math.log2(r["batch_size"]))
          for r in rows]
  est, _ = scaling_cells.cell(edge, scaling_cells.draws(20, 3))
  assert not est["b_opt_resolved"] and not est["eta_opt_resolved"]
  assert est["eta_opt"] == pytest.approx(1e-3 * 2 ** 0.3, rel=0.1)


def test_a_cell_whose_fastest_rate_is_censored_is_refused():
  """One seed's fastest rate at batch 8 is x2, the grid's top: that cell says which batch and
  seed and fits nothing (no B_crit, no Zhang batch), while B_opt is still read; a seed that never
  reached the target at some batch is refused alike."""
  rows = synthetic_rows()
  edge = [dict(r, steps=10.0) if (r["seed"], r["batch_size"], r["lr_multiplier"]) == (1, 8, 2.0)
          else r for r in rows]
  est, reps = scaling_cells.cell(edge, scaling_cells.draws(20, 3))
  assert est["refused"] == "batch 8: seed 1's fastest rate is at the edge of the rates run"
  assert est["b_crit"] is None and est["b_zhang"] is None and est["b_opt"] is not None
  assert est["b_crit_lo"] is None and est["b_zhang_hi"] is None and est["b_opt_lo"] is not None
  assert est["interior_cases"] == est["cases"] - 1
  lost = [dict(r, steps=None) if (r["seed"], r["batch_size"]) == (2, 64) else r for r in rows]
  assert scaling_cells.cell(lost, scaling_cells.draws(20, 3))[0]["refused"] == \
      "batch 64: seed 2 never reached the target"


def test_a_censored_crossing_stays_in_the_cell_as_a_bound():
  """A run below its target at its first smoothed point is kept as an upper bound on the steps
  (not dropped): the batch set and b0 stay the lab's, in the point estimate and every paired
  bootstrap replicate."""
  rows = synthetic_rows()
  bound = [dict(r, steps=r["steps"] * 1.5, censored=True) if r["batch_size"] == 8 else r
           for r in rows]
  est, reps = scaling_cells.cell(bound, scaling_cells.draws(50, 3))
  assert est["refused"] == "" and est["zhang_b0"] == 8 and est["censored_batches"] == [8]
  assert est["b_crit"] == pytest.approx(40, rel=0.2)
  assert all(r["b_crit"] is not None for r in reps)
  # the paired draws: one seed index per slot, the same at every batch
  d = scaling_cells.draws(5, 3)
  assert d.shape == (5, 3)


def test_the_optimal_rate_per_batch_and_the_rules():
  """lr_opt per batch at a parabola's vertex in log rate; the sqrt rule's slope recovered with
  its interval from optima that follow lr_max / (1 + 20 / B)."""
  from tools import lr_rules  # noqa: PLC0415
  rows = []
  for b in (4, 8, 16, 32, 64, 128, 256):
    best = 1e-2 / (1 + 20 / b)
    for m in (0.25, 0.5, 1.0, 2.0, 4.0):
      lr = 3e-3 * m * math.sqrt(b / 16)
      rows.append(dict(seed=0, batch_size=b, lr_multiplier=m, learning_rate=lr,
                       steps=100 * (1 + 0.2 * math.log(lr / best) ** 2), censored=False))
  opt = scaling_cells.lr_opt(rows)
  inside = [(o["batch"], o["lr_opt"]) for o in opt if o["interior"]]
  assert len(inside) >= 5
  for b, lr in inside:
    assert lr == pytest.approx(1e-2 / (1 + 20 / b), rel=0.1)
  m = lr_rules.mccandlish(*zip(*inside))
  assert m["b_noise"] == pytest.approx(20, rel=0.2) and m["lr_max"] == pytest.approx(1e-2, rel=0.2)
  p = lr_rules.power_law(*zip(*inside))
  assert p["k_lo"] < p["k"] < p["k_hi"] and p["rms"] > m["rms"]


def synthetic_cells(a=0.5, b=0.1, noise=0.05, replicates=300, seed=0):
  """Cells y = 3 D^a N^b with multiplicative noise, and bootstrap replicates around them."""
  rng = np.random.default_rng(seed)
  cells, reps = [], []
  for n in (1e5, 3e5, 1e6):
    for d in (6.5e4, 1.3e5, 2.6e5, 5.2e5):
      truth = 3 * d ** a * n ** b
      y = truth * math.exp(noise * rng.standard_normal())
      cells.append({"params": n, "tokens": d, "b_crit": y, "b_crit_lo": y * 0.9,
                    "b_crit_hi": y * 1.1, "b_opt": y, "b_opt_resolved": n != 1e6})
      reps += [{"params": n, "tokens": d, "replicate": k,
                "b_crit": truth * math.exp(noise * rng.standard_normal()), "b_opt": y}
               for k in range(replicates)]
  return cells, reps


def test_power_law_fit_recovers_known_exponents():
  cells, reps = synthetic_cells()
  for replicates in (reps, None):  # bootstrap, then the fit's covariance
    f = scaling_fit.fit_quantity(cells, "b_crit", replicates)
    assert f["a"] == pytest.approx(0.5, abs=0.08) and f["b"] == pytest.approx(0.1, abs=0.08)
    for e, truth in (("a", 0.5), ("b", 0.1)):
      lo, hi = f[f"{e}_ci"]
      assert lo < truth < hi and hi - lo < 0.4, (f["method"], e, lo, hi)
    assert f["cells"] == 12
  assert "bootstrap over 300" in scaling_fit.fit_quantity(cells, "b_crit", reps)["method"]
  assert "covariance" in scaling_fit.fit_quantity(cells, "b_crit")["method"]
  # cells outside the grid stay out; one N left: its exponent is not fitted
  f = scaling_fit.fit_quantity([c for c in cells if c["params"] < 1e6], "b_opt")
  assert f["cells"] == 8 and f["b"] is not None
  f = scaling_fit.fit_quantity([c for c in cells if c["params"] == 1e5], "b_crit")
  assert f["b"] is None and f["a"] == pytest.approx(0.5, abs=0.15)
  assert scaling_fit.fit_quantity(cells[:1], "b_crit") is None
  # Zhang's batch only across cells measured from one reference batch b0 (the most common)
  zhang = [dict(c, b_zhang=c["b_crit"], zhang_b0=16 if i == 0 else 4) for i, c in enumerate(cells)]
  zhang[0]["b_zhang"] *= 100
  f = scaling_fit.fit_quantity(zhang, "b_zhang")
  assert f["cells"] == 11 and f["a"] == pytest.approx(0.5, abs=0.08)
  # N from another column (non-embedding): N' = N^2 halves b
  squared = [dict(c, non_embedding=c["params"] ** 2) for c in cells]
  f = scaling_fit.fit_quantity(squared, "b_crit", reps, n_key="non_embedding")
  assert f["b"] == pytest.approx(0.05, abs=0.04) and f["a"] == pytest.approx(0.5, abs=0.08)
  assert f["b_ci"][1] - f["b_ci"][0] < 0.2 and f["n"] == "non_embedding"
  assert scaling_fit.interval([1.0, 2.0, math.inf, None], 0.5) == (1.0, math.inf)


def test_the_fit_shows_its_misfit():
  """Beside the seed bootstrap, the residual-based interval; each cell's residual and the local
  exponents between budgets. A law that bends (a = 0.8 over the first two budgets, 0 after) is
  reported as structured; the clean law is not. Refused and transient cells stay out."""
  cells, reps = synthetic_cells(noise=0.01)
  clean = scaling_fit.fit_quantity(cells, "b_crit", reps)
  assert clean["a_fit_ci"][0] < 0.5 < clean["a_fit_ci"][1] and not clean["structured"]
  assert len(clean["residuals"]) == 12 and len(clean["local_a"]) == 9
  bent = [dict(c, b_crit=(min(c["tokens"], 1.3e5) ** 0.8) * (c["params"] ** 0.1)) for c in cells]
  f = scaling_fit.fit_quantity(bent, "b_crit")
  assert f["structured"] and f["lack_of_fit_p"] < 1e-6
  assert {round(x["a"], 2) for x in f["local_a"]} == {0.8, 0.0}
  out = [dict(c, refused="batch 4: ..." if i == 0 else "", transient=i == 1)
         for i, c in enumerate(cells)]
  assert scaling_fit.fit_quantity(out, "b_crit")["cells"] == 10
  assert scaling_fit.fit_quantity(out, "b_opt")["cells"] == 7  # a refusal is about B_crit only


def test_scaling_fit_command(tmp_path, capsys):
  cells, reps = synthetic_cells(replicates=50)
  path = tmp_path / "lab.csv"
  for where, rows in ((path, cells), (tmp_path / "lab_boot.csv", reps)):
    with open(where, "w", newline="") as f:
      w = csv.DictWriter(f, fieldnames=list(rows[0]))
      w.writeheader()
      w.writerows(rows)
  assert scaling_fit.main([str(path), "--quantities", "b_crit,b_opt"]) == 0
  printed = capsys.readouterr().out
  assert "b_crit ~ D^a N^b: a (D) = " in printed and "Zhang et al. 2024: a = 0.47" in printed
  assert "Step Law 2025: a = 0.571, b = 0" in printed
  fits = json.load(open(tmp_path / "lab_fit.json"))
  assert fits["b_crit"]["a"] == pytest.approx(0.5, abs=0.08)
  assert fits["b_crit"]["method"].startswith("bootstrap over 50")
  assert os.path.getsize(tmp_path / "lab_fit.png") > 10_000
  assert scaling_fit.main([str(tmp_path / "missing.csv")]) == 2
  assert scaling_fit.main([str(path), "--quantities", "b_nope"]) == 2
  assert scaling_fit.main([str(path), "--level", "95"]) == 2
  (tmp_path / "metrics.jsonl").write_text('{"step": 1}\n')
  assert scaling_fit.main([str(tmp_path / "metrics.jsonl")]) == 2
  assert "metrics.jsonl: not a .csv; give the lab's OUT.csv" in capsys.readouterr().err


def test_a_run_is_read_only_when_its_record_covers_the_stop_rule(tmp_path):
  """`covered`: the fingerprint must match, and the record must have crossed the target with
  min_examples seen (or seen max_examples); a run without result.json (killed) is retrained."""
  workdir = tmp_path / "run"
  workdir.mkdir()
  with open(workdir / "metrics.jsonl", "w") as f:  # batch 8: step k has seen 8k sequences
    for step in range(10, 110, 10):
      f.write(json.dumps({"step": step, "eval_loss": 3.0 - step / 100}) + "\n")
  j = {"workdir": str(workdir), "fingerprint": "A",
       "args": {"target_loss": 2.5, "min_examples": 400, "max_examples": 2000,
                "smooth_examples": 0}}
  covered = scaling_runs.covered
  assert not covered(j, 64)  # no result.json: killed before the end
  with open(workdir / "result.json", "w") as f:
    json.dump({"fingerprint": "A", "result": {"batch_size": 8, "steps_run": 100}}, f)
  assert covered(j, 64)  # crossed 2.5 at step 50, 800 sequences seen
  assert not covered({**j, "fingerprint": "B"}, 64)  # another config
  assert not covered({**j, "args": {**j["args"], "target_loss": 1.5}}, 64)  # not crossed
  assert not covered({**j, "args": {**j["args"], "min_examples": 1000}}, 64)
  assert covered({**j, "args": {**j["args"], "target_loss": 1.5, "max_examples": 800}}, 64)
  # the grid run at the reference batch and rate shares the reference run's record: a record
  # its rule covers also covers the reference rule (no retraining back and forth)
  args = lab.parse(lab_args(tmp_path))[0]
  ref = scaling_runs.reference_stop(args)
  Task = scaling_runs.Task
  for t, length in ((Task(16, 16, 1.0, 0), args.reference_examples),
                    (Task(16, 16, 2.0, 0), args.min_examples),
                    (Task(16, 32, 1.0, 0), args.min_examples)):
    rule = scaling_runs.grid_stop(t, 2.5, 16, args)
    assert rule["min_examples"] == length and rule["max_examples"] == args.max_examples
  assert scaling_runs.grid_stop(Task(16, 16, 1.0, 0), 2.5, 16, args)["min_examples"] >= \
      ref["max_examples"] > args.min_examples


def test_a_record_survives_an_option_added_at_its_default():
  """A record written before an option existed matches a job that holds the option at its
  default (training is as it was), not one that sets it otherwise or changes another value."""
  from trainer.config.defaults import default_config
  cfg = default_config().to_dict()
  now = dict(config=cfg, batch=8)
  old = dict(config={**cfg, "trainer": {k: v for k, v in cfg["trainer"].items()
                                        if k != "straggler_factor"}}, batch=8)
  same = lambda a, b: scaling_runs.same_fingerprint(json.dumps(a), json.dumps(b))
  assert same(old, now) and same(now, old) and same(now, now)
  changed = {**cfg, "trainer": {**cfg["trainer"], "straggler_factor": 2.5}}
  assert not same(old, dict(config=changed, batch=8))
  assert not same(old, dict(config={**cfg, "seed": cfg["seed"] + 1}, batch=8))
  assert not same(now, dict(config=cfg, batch=16))
  assert not same(dict(now, extra=1), now)  # a job setting that is not a config option


def test_a_crossing_at_the_first_smoothed_point_is_flagged(tmp_path):
  """`common.crossings(...)["first"]`: the curve is already below the target where its smoothed
  part starts, so the run may have crossed earlier: its steps are an upper bound."""
  with open(tmp_path / "metrics.jsonl", "w") as f:  # batch 8: step k has seen 8k sequences
    for step in range(10, 110, 10):
      f.write(json.dumps({"step": step, "eval_loss": 3.0 - step / 100}) + "\n")
  flags = lambda smooth, targets: [c["first"] for c in common.crossings(
      str(tmp_path), 8, 64, targets, smooth)]
  assert flags(0, [2.95, 2.9, 2.5, 1.0]) == [True, True, False, False]
  # smoothed over 160 sequences: the first point is step 20 (steps 10-30, mean 2.8)
  assert flags(160, [2.85, 2.8, 2.75]) == [True, True, False]
  early, later = common.crossings(str(tmp_path), 8, 64, [2.8, 2.75], 160)
  assert early["steps"] == pytest.approx(20) and early["first"]  # at most 20 steps
  assert later["steps"] == pytest.approx(25) and not later["first"]  # 2.8 at 20, 2.7 at 30


def lab_args(tmp_path, *more):
  config = tiny_config_file(tmp_path, "lab.py", global_batch_size=16, learning_rate=1e-2,
                            schedule="constant", warmup_steps=0, warmup_examples=16,
                            reference_batch_size=16, lr_rule="sqrt", b2=0.99,
                            b2_rule="half_life")
  return ["--config", str(config), "--quick", "--widths", "16", "--budgets", "96,128",
          "--batch_sizes", "16,32", "--micro_batch_size", "8", "--eval_fraction", "0.125",
          "--eval_sequences", "8", "--max_factor", "3", "--lr_grid", "1", "--max_extensions", "0",
          "--parametrization", "sp", "--bootstrap", "20", "--out", str(tmp_path / "out" / "lab"),
          "--workdir", str(tmp_path / "runs"), *more]


def test_lab_end_to_end_and_resume(tmp_path, data_dir, capsys):
  """One width x two batches x two seeds on a one-layer model: a row per (N, D) with its target
  (refused: one rate is no bracket), the runs' and replicates' CSVs, the figure; run again, every
  run is read from its record; a run whose result.json is gone (killed mid-run) is the only one
  retrained; --read_only reports what is pending and trains nothing."""
  argv = lab_args(tmp_path)
  assert lab.main(argv) == 0
  out = capsys.readouterr().out
  assert "width 16: 0.019M parameters" in out and "0 of 2 runs read" in out
  assert "0 of 8 (width, budget, batch, seed) cases with a crossing have their fastest rate " \
      "inside" in out and "refused (batch 16: seed 0's fastest rate is at the edge" in out
  cells = list(csv.DictReader(open(tmp_path / "out" / "lab.csv")))
  assert [(int(c["width"]), int(c["budget"])) for c in cells] == [(16, 96), (16, 128)]
  assert float(cells[0]["target"]) > float(cells[1]["target"]) > 0
  assert all(c["b_crit"] in ("", "None") and c["refused"] for c in cells), cells
  runs = list(csv.DictReader(open(tmp_path / "out" / "lab_runs.csv")))
  assert len(runs) == 2 * 2 * 2 and {r["seed"] for r in runs} == {"0", "1"}
  assert os.path.getsize(tmp_path / "out" / "lab.png") > 10_000
  assert lab.main(argv) == 0
  again = capsys.readouterr().out
  assert "2 of 2 runs read" in again and "4 of 4 runs read from their records, 0 to train" in again
  os.remove(tmp_path / "runs" / "d16" / "b32_lr1_s1" / "result.json")
  assert lab.main(argv + ["--read_only"]) == 0  # a report: what is pending, nothing trained
  assert "1 of 4 runs have no complete record yet (pending per width: d16: 1 of 4; first " \
      "d16/b32_lr1_s1)" in capsys.readouterr().out
  assert not os.path.exists(tmp_path / "runs" / "d16" / "b32_lr1_s1" / "result.json")
  assert lab.main(argv) == 0
  again = capsys.readouterr().out
  assert "3 of 4 runs read" in again and "[scaling] d16/b32_lr1_s1:" in again
  assert list(csv.DictReader(open(tmp_path / "out" / "lab.csv"))) == cells  # deterministic


def fake_train_job(best: float):
  """A stand-in for `scaling_runs.train_job` that writes a run's record without training: an eval
  loss that falls as 6 - q log(1 + examples / 16), q largest at rate multiplier `best` (a
  parabola in log2 of the rate, flat enough that no crossing is censored), evaluated every max(1, interval / batch) steps, stopped by the
  job's own rule; then result.json as the real one writes it."""
  def train(j):
    a, batch, m = j["args"], j["batch"], j["lr_multiplier"]
    q = max(0.05, 1 - 0.02 * math.log2(m / best) ** 2)
    optim = j["config"]["optim"]
    if optim["b2_rule"] == "constant" and optim["b2"] == 0.95:
      q *= 1.05  # a fixed b2 of 0.95 trains faster than the rule's
    every = max(1, round(a["eval_examples"] / batch))
    stop = target_stop(a["target_loss"], a["smooth_examples"], lambda s: s * batch,
                       a["max_examples"], a["min_examples"])
    os.makedirs(j["workdir"], exist_ok=True)
    step, why = 0, None
    with open(os.path.join(j["workdir"], "metrics.jsonl"), "w") as f:
      while why is None:
        step += every
        row = {"step": step, "eval_loss": 6 - q * math.log1p(step * batch / 16)}
        f.write(json.dumps(row) + "\n")
        why = stop(step, row)
    result = dict(batch_size=batch, lr_multiplier=m, learning_rate=1e-3 * m, steps=None,
                  examples=None, tokens=None, noise_scale=None, micro_batches=1,
                  final_eval_loss=row["eval_loss"], steps_run=step, seconds=0.0,
                  workdir=j["workdir"], best=False, final_batch=batch, lr_interior=None)
    with open(os.path.join(j["workdir"], "result.json"), "w") as f:
      json.dump({"fingerprint": j["fingerprint"], "result": result}, f)
    return result
  return train


def test_the_lab_brackets_the_rates(tmp_path, monkeypatch, capsys):
  """Every run's best rate is x4 of the rule's, outside the grid 0.5, 1, 2: the lab grows it to
  x4 in round 1 and to x8 in round 2 at every (width, batch), then stops with every fastest rate
  inside; the cells are fitted, the optimal rate per batch is x4 and inside. (Records written by
  a stand-in trainer: the lab's logic, not training, is what this checks.)"""
  monkeypatch.setattr(scaling_runs, "train_job", fake_train_job(best=4.0))
  argv = lab_args(tmp_path, "--lr_grid", "0.5,1,2", "--max_extensions", "3",
                  "--b2_grid", "0.95,0.99")
  assert lab.main(argv) == 0
  out = capsys.readouterr().out
  assert "round 1: a fastest rate at its grid's edge at 2 (width, batch): d16 b16 +x4, " \
      "d16 b32 +x4" in out and "round 2: a fastest rate at its grid's edge at 2 (width, " \
      "batch): d16 b16 +x8, d16 b32 +x8" in out and "round 3" not in out
  assert "8 of 8 (width, budget, batch, seed) cases with a crossing have their fastest rate " \
      "inside the rates run (100%)" in out and "refused" not in out
  runs = list(csv.DictReader(open(tmp_path / "out" / "lab_runs.csv")))
  assert {float(r["lr_multiplier"]) for r in runs} == {0.5, 1.0, 2.0, 4.0, 8.0}
  # b2 bracketed at the smallest and largest batch, at the fastest multiplier (x4): 0.95 is
  # faster than the rule's (the stand-in makes it so), 0.99 the same as the rule's there
  b2 = list(csv.DictReader(open(tmp_path / "out" / "lab_b2.csv")))
  assert {(int(r["batch_size"]), float(r["lr_multiplier"]), r["b2"]) for r in b2} == {
      (b, 4.0, x) for b in (16, 32) for x in ("rule", "0.95", "0.99")}
  fast = {(int(r["batch_size"]), int(r["budget"])) for r in b2 if r["faster_than_rule"] == "True"}
  assert fast == {(b, d) for b in (16, 32) for d in (96, 128)}, b2
  assert "[scaling] b2 at d16 b16 (x4; the rule's b2 0.9900)" in out
  assert "[scaling] b2 at d16 b32 (x4; the rule's b2 0.9801)" in out
  assert "a fixed b2 is faster than the rule's at d16 b16 D 96 (b2 0.95), d16 b16 D 128 (b2 " \
      "0.95), d16 b32 D 96 (b2 0.95), d16 b32 D 128 (b2 0.95)" in out
  cells = list(csv.DictReader(open(tmp_path / "out" / "lab.csv")))
  assert all(c["refused"] == "" and float(c["b_crit"]) > 0 for c in cells), cells
  lr = list(csv.DictReader(open(tmp_path / "out" / "lab_lr.csv")))
  assert [(int(r["budget"]), int(r["batch"]), r["interior"]) for r in lr] == [
      (96, 16, "True"), (96, 32, "True"), (128, 16, "True"), (128, 32, "True")]
  assert all(float(r["lr_opt"]) == pytest.approx(4e-3, rel=0.05) for r in lr)
  # capped at one extension: still at the edge, and the cells are refused
  monkeypatch.setattr(scaling_runs, "train_job", fake_train_job(best=16.0))
  (tmp_path / "capped").mkdir()
  assert lab.main(lab_args(tmp_path / "capped", "--lr_grid", "0.5,1,2",
                           "--max_extensions", "1")) == 0
  out = capsys.readouterr().out
  assert "after 1 extensions 2 (width, batch) still have a fastest rate at the edge" in out
  assert "cell d16 D 96: refused (batch 16: seed 0's fastest rate is at the edge" in out


def test_lab_refuses_before_training(tmp_path, capsys):
  (tmp_path / "afile").write_text("")
  for bad, message in ((["--budgets", "30"], "within the first smoothing window of a run at batch 32"),
                       (["--widths", "18"], "not a multiple of model.num_heads"),
                       (["--batch_sizes", "16,20"], "not a multiple of --micro_batch_size"),
                       (["--max_examples", "150"], "below the 160 sequences the reference"),
                       (["--config.optim.schedule=cosine"], "optim.schedule='constant'"),
                       (["--seeds", "0"], "--seeds and --jobs must be at least 1"),
                       (["--curve", "ema"], "give --ema_decay"),
                       (["--workdir", str(tmp_path / "afile" / "runs")], "is a file, not a dir"),
                       (["--out", str(tmp_path / "afile" / "x" / "lab")], "is a file, not a dir")):
    assert lab.main(lab_args(tmp_path, *bad)) == 2, bad
    assert message in capsys.readouterr().err
  assert not os.path.exists(tmp_path / "runs")


@pytest.mark.slow  # two worker processes, each starting jax: ~1-2 min on 2 busy cores
def test_lab_trains_in_worker_processes(tmp_path, data_dir, capsys):
  """--jobs 2 trains in spawned processes what --jobs 1 trains here: the same records."""
  assert lab.main(lab_args(tmp_path, "--jobs", "2")) == 0
  assert "0 of 2 runs read" in capsys.readouterr().out
  parallel = (tmp_path / "out" / "lab_runs.csv").read_text()
  serial = tmp_path / "serial"
  serial.mkdir()
  assert lab.main(lab_args(serial)) == 0
  strip = lambda text: [line.rsplit(",", 1)[0] for line in text.splitlines()]  # not seconds
  assert strip(parallel) == strip((serial / "out" / "lab_runs.csv").read_text())

"""B_opt from runs that end at D (experiments/scaling_anneal.py): the rates bracketed on the final
loss and B_opt found inside the batches on a stand-in loss surface whose optimum lies outside the
starting grid, a censored cell refused, and a real branch equal to the lab's constant run until
its cooldown begins."""
import csv
import json
import math
import os

import numpy as np
import pytest

from test_scaling_lab import lab_args
from experiments import scaling_anneal as anneal
from experiments import scaling_runs
from trainer.config.cli import load


def anneal_args(tmp_path, *more):
  """The lab test's command line (its one-layer config, budgets 96 and 128) over batches 2-32,
  3 seeds and rates x0.5, 1, 2 (later flags win)."""
  return lab_args(tmp_path, "--batch_sizes", "2,4,8,16,32", "--seeds", "3", "--lr_grid", "0.5,1,2",
                  "--bootstrap", "50", "--out", str(tmp_path / "out" / "anneal"), *more)


def fake_branch(best_m: float, best_b: float):
  """A stand-in for `scaling_runs.train_job`: a run's record with one evaluation at its budget,
  the final loss a bowl in (log2 batch, log2 multiplier) with its bottom at (best_b, best_m),
  plus a small per-seed offset (seeds share it across batches: paired)."""
  def train(j):
    batch, m, a = j["batch"], j["lr_multiplier"], j["args"]
    seed = j["config"]["seed"]
    steps = math.ceil(a["max_examples"] / batch)
    loss = (3 + 0.02 * math.log2(batch / best_b) ** 2 + 0.01 * math.log2(m / best_m) ** 2
            + 0.001 * seed - 0.1 * math.log2(a["max_examples"]))
    os.makedirs(j["workdir"], exist_ok=True)
    with open(os.path.join(j["workdir"], "metrics.jsonl"), "w") as f:
      f.write(json.dumps({"step": steps, "eval_loss": loss}) + "\n")
    result = dict(batch_size=batch, lr_multiplier=m, learning_rate=1e-3 * m, steps=None,
                  examples=None, tokens=None, noise_scale=None, micro_batches=1,
                  final_eval_loss=loss, steps_run=steps, seconds=0.0, workdir=j["workdir"],
                  best=False, final_batch=batch, lr_interior=None)
    with open(os.path.join(j["workdir"], "result.json"), "w") as f:
      json.dump({"fingerprint": j["fingerprint"], "result": result}, f)
    return result
  return train


def test_the_final_loss_brackets_the_rates_and_finds_b_opt(tmp_path, monkeypatch, capsys):
  """The best multiplier is x4 (outside 0.5, 1, 2) and the best batch 8: two rounds grow every
  grid to x8, every lowest loss is then inside, B_opt is 8 and inside, eta_opt the x4 rate, and
  the neighbours' losses are higher with intervals that exclude 0. Run again, every record is
  read. Capped at no extension, the cells are refused and say where."""
  monkeypatch.setattr(scaling_runs, "train_job", fake_branch(best_m=4.0, best_b=8.0))
  assert anneal.main(anneal_args(tmp_path, "--max_extensions", "3")) == 0
  out = capsys.readouterr().out
  assert "round 1: the lowest final loss at its grid's edge at 10 (width, batch, D)" in out
  assert "round 2: the lowest final loss at its grid's edge at 10" in out and "round 3" not in out
  assert "30 of 30 (width, D, batch, seed) cases have their lowest final loss inside" in out
  assert "refused" not in out
  cells = list(csv.DictReader(open(tmp_path / "out" / "anneal.csv")))
  assert [int(c["budget"]) for c in cells] == [96, 128]
  for c in cells:
    assert float(c["b_opt"]) == pytest.approx(8.0, rel=1e-6) and c["b_opt_resolved"] == "True"
    assert float(c["eta_opt"]) == pytest.approx(4e-3, rel=1e-6) and c["eta_opt_resolved"] == "True"
    assert float(c["b_opt_lo"]) == pytest.approx(8.0) == pytest.approx(float(c["b_opt_hi"]))
    assert float(c["loss_below"]) == pytest.approx(0.02) and c["loss_below_significant"] == "True"
    assert float(c["loss_above"]) == pytest.approx(0.02) and c["loss_above_significant"] == "True"
  runs = list(csv.DictReader(open(tmp_path / "out" / "anneal_runs.csv")))
  assert {float(r["lr_multiplier"]) for r in runs} == {0.5, 1.0, 2.0, 4.0, 8.0}
  assert len(runs) == 2 * 5 * 3 * 5
  assert anneal.main(anneal_args(tmp_path, "--max_extensions", "3")) == 0
  assert "150 of 150 runs read from their records, 0 to train" in capsys.readouterr().out
  (tmp_path / "capped").mkdir()
  assert anneal.main(anneal_args(tmp_path / "capped", "--max_extensions", "0")) == 0
  out = capsys.readouterr().out
  assert "0 of 30 (width, D, batch, seed) cases" in out
  assert "d16 D 96: B_opt refused (rates at their grid's edge at b2 s0" in out


def test_the_batch_at_the_grid_edge_is_not_resolved(tmp_path, monkeypatch, capsys):
  """The best batch (64) lies above the batches run: B_opt is the largest batch, not inside."""
  monkeypatch.setattr(scaling_runs, "train_job", fake_branch(best_m=1.0, best_b=64.0))
  assert anneal.main(anneal_args(tmp_path, "--max_extensions", "1")) == 0
  cells = list(csv.DictReader(open(tmp_path / "out" / "anneal.csv")))
  assert all(float(c["b_opt"]) == 32 and c["b_opt_resolved"] == "False" for c in cells), cells
  assert all(c["loss_above"] in ("", "None") for c in cells)


def test_bad_flags_are_one_line(tmp_path, capsys):
  assert anneal.main(anneal_args(tmp_path, "--decay_fraction", "0")) == 2
  assert "--decay_fraction 0.0: give the cooldown's share of D in (0, 1]" in capsys.readouterr().err
  assert not os.path.exists(tmp_path / "runs")


@pytest.mark.slow  # two real trainings (~20 s idle); test_scaling_lab's end-to-end test trains
# through the same scaling_runs jobs in the default run
def test_a_branch_is_the_constant_run_until_its_cooldown(tmp_path, data_dir):
  """A WSD run that ends at D = 256 sequences (batch 16, cooldown over the last 25%: from step
  12) and the lab's constant run of the same width, batch, rate and seed log the same training
  losses up to step 12, bit for bit, and differ after it; the branch's rate falls to ~0 at D."""
  argv = anneal_args(tmp_path, "--budgets", "256", "--batch_sizes", "8,16",
                     "--decay_fraction", "0.25", "--seeds", "1")
  args, overrides = anneal.parse(argv)
  cfg = load(args.config, [*overrides, ("log_every", "2")])
  t = anneal.Branch(16, 16, 1.0, 0, budget=256)
  branch = anneal.branch_job(cfg, t, args)
  lab_task = scaling_runs.Task(16, 16, 1.0, 0)
  constant = scaling_runs.job(lab_task, anneal.lab.task_config(cfg, lab_task, args), args,
                              dict(target_loss=-math.inf, min_examples=0, max_examples=320))
  assert branch["workdir"] != constant["workdir"]
  for j in (branch, constant):
    scaling_runs.train_job(j)
  a, b = training_rows(branch["workdir"]), training_rows(constant["workdir"])
  assert sorted(a) == list(range(2, 17, 2)) and max(b) >= 20
  before, after = [s for s in a if s <= 12], [s for s in a if s > 12]
  assert [a[s]["loss"] for s in before] == [b[s]["loss"] for s in before]
  assert a[14]["learning_rate"] < b[14]["learning_rate"] and a[16]["loss"] != b[16]["loss"]
  assert a[12]["learning_rate"] == b[12]["learning_rate"]
  assert a[16]["learning_rate"] < 0.2 * a[12]["learning_rate"]
  evals = [json.loads(x) for x in open(os.path.join(branch["workdir"], "metrics.jsonl"))
           if "eval_loss" in x]
  assert [e["step"] for e in evals] == [16] and np.isfinite(evals[0]["eval_loss"])


def training_rows(workdir) -> dict[int, dict]:
  """{step: the training row logged at that step} of a run's metrics.jsonl."""
  with open(os.path.join(workdir, "metrics.jsonl")) as f:
    rows = [json.loads(x) for x in f]
  return {r["step"]: r for r in rows if "loss" in r}

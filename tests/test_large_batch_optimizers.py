"""experiments/large_batch_optimizers.py's tuning mode: every optimizer's rate x b2 grid, the
rates grown beyond a winning edge (a diverged run brackets), each arm's best with `interior`,
a censored arm's head-to-head not called, and the tuned arms against AdamW's on paired seeds.
A stand-in trainer with a known loss surface checks the logic; one tiny run trains for real."""
import csv
import math

import pytest

from conftest import tiny_config_file
from experiments import large_batch_optimizers as lbo

STATED = {"adamw": 3e-3, "lars": 2.0}  # the stated rates (lars: optim/scaling.py's default)


def surface(best: dict, diverge_above: float = math.inf, large_cost=None):
  """A stand-in for `train_run`: final loss 2 + (log2 of the rate / the optimizer's best)^2
  + 0.05 where b2 is not 0.95 (AdamW) + 0.01 x seed (the seeds' shared offset) + 0.003 x seed^2
  for LARS (so the paired differences vary); NaN above `diverge_above` x its stated rate;
  + `large_cost[name](seed)` at batch 16 where given."""
  def train_run(cfg, workdir):
    from optim.scaling import stated  # noqa: PLC0415
    name, seed = cfg.optim.name, int(cfg.seed)
    mult = stated(cfg.optim)["learning_rate"][0] / STATED[name]
    b2_off = 0.05 if name == "adamw" and not (cfg.optim.b2_rule == "constant"
                                             and cfg.optim.b2 == 0.95) else 0.0
    loss = (2 + math.log2(mult / best[name]) ** 2 + b2_off + 0.01 * seed
            + (0.003 * seed ** 2 if name == "lars" else 0.0))
    if large_cost and cfg.data.global_batch_size == 16:
      loss += large_cost[name](seed)
    if mult > diverge_above:
      loss = math.nan
    return [(cfg.steps * cfg.data.global_batch_size, loss)], cfg.steps, 0.0
  return train_run


def run(tmp_path, *extra):
  config = tiny_config_file(tmp_path)
  out = tmp_path / "out" / "opt"
  argv = ["--config", str(config), "--batch", "16", "--reference_batch", "0", "--examples", "64",
          "--optimizers", "adamw,lars", "--evals", "2", "--eval_sequences", "8", "--out",
          str(out), "--workdir", str(tmp_path / "runs"), *extra]
  assert lbo.main(argv) == 0
  read = lambda suffix: list(csv.DictReader(open(f"{out}{suffix}.csv")))  # noqa: E731
  return read(""), {r["optimizer"]: r for r in read("_tuned")}, read("_paired")


def test_an_edge_winner_grows_the_grid(tmp_path, monkeypatch, capsys):
  """AdamW's best rate is x4, outside 0.5-2: the grid grows to x4, then x8, and x4 is inside;
  LARS's best (x1) is inside from the start; AdamW's best b2 is 0.95 of {rule, 0.95}; the tuned
  LARS against the tuned AdamW over 3 paired seeds with its t interval."""
  monkeypatch.setattr(lbo, "train_run", surface({"adamw": 4.0, "lars": 1.0}))
  runs, tuned, paired = run(tmp_path, "--lr_grid", "0.5,1,2", "--b2_grid", "rule,0.95",
                            "--seeds", "3")
  adamw, lars = tuned["adamw"], tuned["lars"]
  assert (adamw["multipliers"], float(adamw["lr_multiplier"]), adamw["b2_choice"],
          adamw["interior"]) == ("0.5/1/2/4/8", 4.0, "0.95", "True")
  assert (lars["multipliers"], float(lars["lr_multiplier"]), lars["interior"]) == (
      "0.5/1/2", 1.0, "True")
  assert float(adamw["final_eval_loss"]) == pytest.approx(2.01)  # mean over seeds 0-2
  assert len(runs) == 5 * 2 * 3 + 3 * 3  # adamw: 5 rates x 2 b2 x 3 seeds; lars: 3 x 3
  assert {r["seed"] for r in runs} == {"0", "1", "2"}
  (d,) = paired
  # lars - adamw per seed: 0, 0.003, 0.012 -> mean 0.005, sd 0.006245, t(0.975, 2) = 4.3027
  half = 4.3027 * 0.0062450 / math.sqrt(3)
  assert float(d["diff"]) == pytest.approx(0.005)
  assert (float(d["diff_lo"]), float(d["diff_hi"])) == pytest.approx((0.005 - half,
                                                                      0.005 + half), abs=1e-5)
  assert d["called"] == "True" and "no difference at this level" in d["text"]
  assert "edge" not in d["text"] and "flip" not in d["text"]
  assert "not called" not in capsys.readouterr().out


def test_what_the_large_batch_costs_each_arm_is_compared_seed_by_seed(tmp_path, monkeypatch,
                                                                     capsys):
  """At batches 16 and 8, the large batch costs AdamW 0.5 and LARS 0.2 + 0.01 x seed (the
  surface's other terms cancel within an arm): each arm is tuned at both batches, and the
  penalty row holds LARS's cost minus AdamW's over the 3 paired seeds with its t interval."""
  monkeypatch.setattr(lbo, "train_run", surface(
      {"adamw": 1.0, "lars": 1.0},
      large_cost={"adamw": lambda seed: 0.5, "lars": lambda seed: 0.2 + 0.01 * seed}))
  config = tiny_config_file(tmp_path)
  out = tmp_path / "out" / "opt"
  assert lbo.main(["--config", str(config), "--batch", "16", "--reference_batch", "8",
                   "--examples", "64", "--optimizers", "adamw,lars", "--lr_grid", "0.5,1,2",
                   "--b2_grid", "0.95", "--seeds", "3", "--out", str(out),
                   "--workdir", str(tmp_path / "runs")]) == 0
  paired = list(csv.DictReader(open(f"{out}_paired.csv")))
  assert [(d["metric"], d["batch_size"]) for d in paired] == [
      ("final_eval_loss", "16"), ("final_eval_loss", "8"), ("final_eval_loss_penalty", "16 - 8")]
  d = paired[-1]
  half = 4.3027 * 0.01 / math.sqrt(3)  # per seed -0.30, -0.29, -0.28
  assert float(d["diff"]) == pytest.approx(-0.29)
  assert (float(d["diff_lo"]), float(d["diff_hi"])) == pytest.approx((-0.29 - half,
                                                                      -0.29 + half), abs=1e-5)
  assert d["called"] == "True" and "lars lower than adamw" in d["text"]
  assert "final_eval_loss_penalty: lars - adamw = -0.29" in capsys.readouterr().out


def test_a_censored_arm_is_not_called(tmp_path, monkeypatch, capsys):
  """AdamW's best is x16: after one extension (to x4) its best is still at the edge, so its
  tuned arm is censored and the head-to-head is not called (the text says whose)."""
  monkeypatch.setattr(lbo, "train_run", surface({"adamw": 16.0, "lars": 1.0}))
  _, tuned, paired = run(tmp_path, "--lr_grid", "0.5,1,2", "--b2_grid", "0.95",
                         "--max_extensions", "1", "--seeds", "2")
  assert (tuned["adamw"]["multipliers"], tuned["adamw"]["interior"]) == ("0.5/1/2/4", "False")
  assert tuned["lars"]["interior"] == "True"
  (d,) = paired
  assert d["called"] == "False"
  assert "lars vs adamw not called: the best rate of adamw is at the edge" in d["text"]
  out = capsys.readouterr().out
  assert "adamw at batch 16: censored, its best rate x4 is at the edge of x0.5/1/2/4" in out


def test_a_diverged_run_brackets(tmp_path, monkeypatch):
  """The best rate x2 sits at the edge of 0.5-2; x4 diverges (NaN), which brackets it: the grid
  stops there and x2 is inside; b2 0.95 is inside 0.9-0.99."""
  monkeypatch.setattr(lbo, "train_run", surface({"adamw": 4.0, "lars": 1.0}, diverge_above=2.0))
  runs, tuned, _ = run(tmp_path, "--lr_grid", "0.5,1,2", "--b2_grid", "0.9,0.95,0.99",
                       "--optimizers", "adamw")
  assert (tuned["adamw"]["multipliers"], float(tuned["adamw"]["lr_multiplier"]),
          tuned["adamw"]["interior"]) == ("0.5/1/2/4", 2.0, "True")
  assert (tuned["adamw"]["b2_choice"], tuned["adamw"]["b2_interior"]) == ("0.95", "True")
  assert math.isnan(float(runs[-1]["final_eval_loss"]))


def test_the_rules_alone_are_the_old_command(tmp_path, monkeypatch):
  """`--lr_grid 1 --b2_grid rule` runs the untuned comparison of before: one run per optimizer
  and batch in `<optimizer>_b<batch>` at the rule's rate and b2, and no tuned CSV."""
  monkeypatch.setattr(lbo, "train_run", surface({"adamw": 1.0, "lars": 1.0}))
  config = tiny_config_file(tmp_path)
  out = tmp_path / "opt"
  assert lbo.main(["--config", str(config), "--batch", "16", "--reference_batch", "8",
                   "--examples", "64", "--optimizers", "adamw,lars", "--out", str(out),
                   "--workdir", str(tmp_path / "runs"), "--lr_grid", "1",
                   "--b2_grid", "rule"]) == 0
  rows = list(csv.DictReader(open(f"{out}.csv")))
  assert [(r["optimizer"], r["batch_size"], r["lr_multiplier"]) for r in rows] == [
      ("adamw", "16", "1.0"), ("lars", "16", "1.0"), ("adamw", "8", "1.0"), ("lars", "8", "1.0")]
  assert float(rows[0]["b2"]) == pytest.approx(0.99 ** 2)  # the half-life rule at 2x the batch
  assert not (tmp_path / "opt_tuned.csv").exists()
  assert lbo.main(["--config", str(config), "--b2_grid", "rule,1.5"]) == 2


@pytest.mark.slow  # three trainings, ~23 s on 2 busy cores; the stand-in tests check the logic
def test_a_tiny_grid_brackets_for_real(tmp_path, data_dir):
  """Trained for real on the tiny config: LARS at batch 16 on the 2-point grid 0.5, 1 (a best
  always at an edge) grows once; three finite runs, the tuned row names its rates."""
  runs, tuned, paired = run(tmp_path, "--optimizers", "lars", "--lr_grid", "0.5,1",
                            "--max_extensions", "1")
  assert tuned["lars"]["multipliers"] in ("0.25/0.5/1", "0.5/1/2")
  assert len(runs) == 3 and all(math.isfinite(float(r["final_eval_loss"])) for r in runs)
  assert tuned["lars"]["interior"] in ("True", "False") and paired == []

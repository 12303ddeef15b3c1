"""experiments/original_domains.py: the quick grid end to end on a stand-in trainer with a known
accuracy surface (bracketing per batch, the tuned arms, the paired intervals against the baseline,
the claims' verdicts), a censored optimum reported as censored, the recipes' rates and schedules,
and the command line's mistakes. The slow test trains the quick grid's corner for real."""
import csv
import math

import pytest

from experiments import domain_recipes as recipes
from experiments import original_domains as od

STATED = {"lars": 2.0, "sgd": 0.1, "adamw": 3e-3, "lamb": 3e-2}  # the recipes' stated rates


def surface(best: dict, ahead: dict | None = None):
  """A stand-in for `train_run`: accuracy 0.9 - 0.05 (log2(rate / the optimizer's best))^2
  + ahead[(optimizer, batch)] + 0.01 x seed + 0.002 x seed^2 for LARS / LAMB (so the paired
  differences vary), - 0.01 where AdamW's b2 is not 0.95."""
  ahead = ahead or {}

  def train_run(cfg, workdir, metric):
    from optim.scaling import stated  # noqa: PLC0415
    name, seed, batch = cfg.optim.name, int(cfg.seed), cfg.data.global_batch_size
    mult = stated(cfg.optim)["learning_rate"][0] / STATED[name]
    acc = (0.9 - 0.05 * math.log2(mult / best[name]) ** 2 + ahead.get((name, batch), 0.0)
           + 0.01 * seed + (0.002 * seed ** 2 if name in ("lars", "lamb") else 0.0)
           - (0.01 if name == "adamw" and cfg.optim.b2 != 0.95 else 0.0))
    return acc, cfg.steps, 0.0
  return train_run


def run(tmp_path, *extra, task="vision"):
  out = tmp_path / "out" / task
  argv = ["--task", task, "--quick", "--out", str(out), "--workdir", str(tmp_path / "runs"),
          *extra]
  assert od.main(argv) == 0
  read = lambda suffix: list(csv.DictReader(open(f"{out}{suffix}.csv")))  # noqa: E731
  return read(""), read("_tuned"), read("_paired")


def test_quick_grid_brackets_compares_and_calls_the_claims(tmp_path, monkeypatch, capsys):
  """Best rates inside 0.25-4 (x1) for every arm: every tuned arm is interior, its rate the best;
  LARS 0.05 ahead of SGD at batch 128 only: claim 1 holds, claim 2 (Nesterov matches) fails
  there; the paired intervals are the t intervals of the seeds' differences."""
  monkeypatch.setattr(od, "train_run", surface({"lars": 1.0, "sgd": 1.0, "adamw": 1.0},
                                               {("lars", 128): 0.05}))
  runs, tuned, paired = run(tmp_path)
  assert len(runs) == 2 * (3 + 3 + 3 * 2) * 2  # batches x (lars, sgd, adamw x 2 b2) x 2 seeds
  assert all(t["interior"] == "True" and float(t["lr_multiplier"]) == 1.0 for t in tuned)
  adamw = [t for t in tuned if t["optimizer"] == "adamw"]
  assert {t["b2"] for t in adamw} == {"0.95"}
  assert {(d["arm"], d["batch_size"]) for d in paired} == {
      ("lars", "32"), ("lars", "128"), ("adamw", "32"), ("adamw", "128")}
  d = next(d for d in paired if (d["arm"], d["batch_size"]) == ("lars", "128"))
  # lars - sgd per seed (0, 1): 0.05, 0.052: mean 0.051, sd 0.001414, t(0.975, 1) = 12.706
  assert float(d["diff"]) == pytest.approx(0.051)
  half = 12.706 * 0.0014142 / math.sqrt(2)
  assert float(d["diff_lo"]) == pytest.approx(0.051 - half, abs=1e-4)
  assert d["diff_significant"] == "True" and d["called"] == "True"
  out = capsys.readouterr().out
  assert "lars holds accuracy to a larger batch than sgd: holds: at batch 128" in out
  assert "tuned sgd matches lars: fails: lars ahead at batches [128]" in out
  assert "censored" not in out and (tmp_path / "out" / "vision.png").exists()


def test_no_difference_is_not_a_win(tmp_path, monkeypatch, capsys):
  """LAMB and AdamW equal up to the seeds' spread: claim 3 'not shown', claim 4 holds within
  the intervals (no 'ahead' inside an interval that holds 0)."""
  monkeypatch.setattr(od, "train_run", surface({"lamb": 1.0, "adamw": 1.0},
                                               {("lamb", 16): -0.001, ("lamb", 64): 0.001}))
  _, _, paired = run(tmp_path, task="mlm")
  assert all(d["diff_significant"] == "False" for d in paired)
  out = capsys.readouterr().out
  assert "larger batch than adamw: not shown: at batch 64" in out
  assert "tuned adamw matches lamb: holds within the intervals" in out


def test_a_censored_optimum_is_reported_and_not_called(tmp_path, monkeypatch, capsys):
  """LARS's best rate is x16, beyond the quick grid's x4 with no extension: its arms are
  censored, said so, their comparisons and both claims not called; with three extension rounds
  (x8, x16, x32) it is inside."""
  monkeypatch.setattr(od, "train_run", surface({"lars": 16.0, "sgd": 1.0, "adamw": 1.0}))
  _, tuned, paired = run(tmp_path, "--optimizers", "lars,sgd")
  lars = [t for t in tuned if t["optimizer"] == "lars"]
  assert all(t["interior"] == "False" and t["multipliers"] == "0.25/1/4" for t in lars)
  assert all(d["called"] == "False" and "not called" in d["text"] for d in paired)
  out = capsys.readouterr().out
  assert "lars at batch 32: censored" in out
  assert "than sgd: not called (not called, censored rate: batches [32, 128])" in out
  _, tuned, _ = run(tmp_path, "--optimizers", "lars,sgd", "--max_extensions", "3")
  assert all(t["interior"] == "True" for t in tuned if t["optimizer"] == "lars")


def test_recipes_scale_and_schedule_as_their_papers(tmp_path):
  """Goyal's SGD: 0.1 x B / 256 with Nesterov; MLPerf's LARS: poly-2, linear in B, warmup in
  epochs; label smoothing 0.1 on the vision arms; LAMB: poly-1 (linear) decay, sqrt rule."""
  from optim import derive  # noqa: PLC0415
  from trainer.config.cli import load  # noqa: PLC0415
  args, overrides = od.parse(["--task", "vision", "--quick"])
  cfg = load(args.config, overrides)
  od.budget(args, cfg)
  sgd = od.run_config(cfg, args, "sgd", 128, 1.0, "rule", 0)
  assert derive(sgd.optim, 128).learning_rate == pytest.approx(0.05)
  assert sgd.optim.nesterov and sgd.model.resnet.label_smoothing == 0.1
  lars = od.run_config(cfg, args, "lars", 32, 2.0, "rule", 0)
  assert derive(lars.optim, 32).learning_rate == pytest.approx(2.0 * 2.0 * 32 / 256)
  assert (lars.optim.schedule, lars.optim.poly_power, lars.optim.warmup_examples) == (
      "poly", 2.0, 0.5 * 2048)
  assert recipes.RECIPES["mlm", "lamb"][0]["poly_power"] == 1.0


@pytest.mark.parametrize("extra,says", [
    (["--batches", "32,96"], "--batches 96: the budget of 4096 examples"),
    (["--optimizers", "lars,lamb"], "no vision recipe for 'lamb'"),
    (["--optimizers", "lars"], "must include the baseline 'sgd'"),
])
def test_mistakes_are_one_line_exit_2(tmp_path, capsys, extra, says):
  argv = ["--task", "vision", "--quick", "--out", str(tmp_path / "o"), "--workdir",
          str(tmp_path / "r"), *extra]
  assert od.main(argv) == 2
  err = capsys.readouterr().err
  assert says in err and err.count("\n") == 1


@pytest.mark.slow
def test_quick_corner_trains_for_real(tmp_path):
  """One rate, one seed, LARS and SGD at the quick grid's batches through the real loop."""
  runs, tuned, _ = run(tmp_path, "--optimizers", "lars,sgd", "--lr_grid", "1", "--seeds", "1")
  assert len(runs) == 4 and all(0 <= float(r["accuracy"]) <= 1 for r in runs)
  assert all(t["interior"] == "False" for t in tuned)  # one rate: censored by construction

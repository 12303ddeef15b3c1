"""experiments/: reading a run's own record (examples seen through its batch changes, the target
crossing), the autopilot verdict, WSD branching (schedule algebra, and a branch restored from a
stable run's checkpoint equal to a from-scratch run of its config), and one experiment's command
end to end."""
import csv
import math
import os

import numpy as np
import pytest

from conftest import losses, tiny_config, tiny_config_file, write_sweep_config
from experiments import (autopilot_vs_fixed, common, large_batch_optimizers, muon_critical_batch,
                         schedules, seesaw, timescale)
from optim.ramp import BatchRamp


def _record():
  """A run that started at batch 8, grew to 16 from step 11 and to 32 from step 21 (as the
  autopilot writes it), evaluated every 10 steps."""
  rows = [{"step": 10, "loss": 3.0}, {"step": 10, "eval_loss": 3.0},
          {"step": 9, "event": "batch_change", "batch": 16, "old_batch": 8, "from_step": 11},
          {"step": 20, "eval_loss": 2.5}, {"step": 20, "event": "hyperparameters"},
          {"step": 19, "event": "batch_change", "batch": 32, "old_batch": 16, "from_step": 21},
          {"step": 30, "eval_loss": 2.0}, {"step": 40, "eval_loss": 1.5}]
  return rows


def test_examples_come_from_the_recorded_batch_changes():
  rows = _record()
  ramp = common.ramp_from_rows(rows, start_batch=8, seq_len=64)
  assert ramp.stages_by_step() == [(0, 8), (10, 16), (20, 32)]
  # 10 x 8, then 10 x 16, then 32 per step (not step x batch of either end)
  assert common.eval_curve(rows, ramp) == [(80, 3.0), (240, 2.5), (560, 2.0), (880, 1.5)]
  assert common.train_curve(rows, ramp) == [(80, 3.0)]
  # a resumed run writing the same decision again changes nothing; a contradiction is an error
  again = common.ramp_from_rows(rows + [rows[2]], 8, 64)
  assert again.stages_by_step() == ramp.stages_by_step()
  with pytest.raises(ValueError, match="is from 8"):
    common.ramp_from_rows(rows + [{**rows[2], "from_step": 31}], 8, 64)


def test_tokens_and_steps_to_target_through_the_ramp():
  rows = _record()
  ramp = common.ramp_from_rows(rows, 8, 64)
  curve = common.eval_curve(rows, ramp)
  got = common.to_target(curve, ramp, target=2.25, smooth_examples=0)
  # halfway between 240 and 560 examples: 400, i.e. step 20 + 160 / 32 = 25
  assert got == common.Reached(examples=400.0, tokens=400.0 * 64, steps=25.0)
  assert common.to_target(curve, ramp, target=1.0, smooth_examples=0) is None
  # smoothed over 640 examples (+-320): only 560 has a full window, averaging 2.5, 2.0, 1.5
  assert common.to_target(curve, ramp, 2.1, smooth_examples=640).examples == 560


def test_target_stop_reads_examples_from_the_run():
  seen = {10: 80, 20: 240, 30: 560}
  stop = common.target_stop(2.6, 0, seen.__getitem__, max_examples=500)
  assert stop(10, {"eval_loss": 3.0}) is None
  assert stop(20, {"eval_loss": 2.5}) == "smoothed eval_loss <= 2.6 at 240 examples"
  stop = common.target_stop(1.0, 0, seen.__getitem__, max_examples=500)
  assert stop(20, {"loss": 2.0}) is None
  assert "500 examples seen" in stop(30, {"loss": 2.0})
  # an accuracy falls to its target as its error, 1 - accuracy (the vision workload's sweep)
  stop = common.target_stop(0.25, 0, seen.__getitem__, key="eval_error")
  assert stop(10, {"eval_loss": 0.1, "eval_accuracy": 0.7}) is None
  assert stop(20, {"eval_accuracy": 0.8}) == "smoothed eval_error <= 0.25 at 240 examples"
  rows = [{"step": 1, "eval_accuracy": 0.5}, {"step": 2, "eval_loss": 1.0}]
  assert common.eval_curve(rows, BatchRamp.constant(8, 4), "eval_error") == [(8.0, 0.5)]


def test_at_targets_reads_every_target_from_one_record(tmp_path):
  """The autopilot experiment's rows: each target's crossing from the run's own record, with
  the batch the run had then and B_simple interpolated at that step."""
  import json  # noqa: PLC0415
  from tools.batch_sweep import Result  # noqa: PLC0415
  rows = _record() + [{"step": 10, "noise_scale": 4.0}, {"step": 30, "noise_scale": 8.0}]
  with open(tmp_path / "metrics.jsonl", "w") as f:
    f.writelines(json.dumps(r) + "\n" for r in rows)
  r = Result(batch_size=8, lr_multiplier=1.0, learning_rate=1e-3, steps=None, examples=None,
             tokens=None, noise_scale=None, micro_batches=1, final_eval_loss=1.5, steps_run=40,
             seconds=1.0, workdir=str(tmp_path), final_batch=32)
  got = autopilot_vs_fixed.at_targets("auto m=1", "auto", 1.0, r, [2.75, 2.25, 1.0], 0, 64)
  assert [(g["target"], g["steps"], g["examples"], g["batch_at_target"]) for g in got] == [
      (2.75, 15.0, 160.0, 16), (2.25, 25.0, 400.0, 32), (1.0, None, None, None)]
  assert got[0]["tokens"] == 160 * 64 and got[1]["noise_scale"] == pytest.approx(7.0)
  assert {g["final_batch"] for g in got} == {32}


def test_verdict_compares_with_the_best_fixed_batches():
  rows = [{"run": "B=8", "kind": "fixed", "steps": 1000.0, "tokens": 5e5},
          {"run": "B=64", "kind": "fixed", "steps": 200.0, "tokens": 8e5},
          {"run": "B=256", "kind": "fixed", "steps": None, "tokens": None},
          {"run": "auto m=1", "kind": "auto", "steps": 300.0, "tokens": 6e5},
          {"run": "auto m=2", "kind": "auto", "steps": None, "tokens": None}]
  assert autopilot_vs_fixed.verdict(rows) == [
      "auto m=1: 1.20x the tokens of the most frugal fixed batch (B=8), 1.50x the steps of the "
      "fastest (B=64)", "auto m=2: did not reach the target"]


def test_at_budget_trains_the_budget_and_evaluates_at_the_end():
  cfg = common.at_budget(tiny_config(), 32, 4096, micro=8, evals=3, eval_sequences=20)
  assert (cfg.steps, cfg.data.global_batch_size, cfg.data.micro_batch_size) == (128, 32, 8)
  assert cfg.steps % cfg.eval_every == 0 and cfg.steps // cfg.eval_every >= 3
  assert cfg.eval_sequences == 20 and cfg.checkpoint.every_steps == 0
  with pytest.raises(ValueError, match="multiples"):
    common.at_budget(tiny_config(), 24, 4096, micro=8, evals=3, eval_sequences=8)


def test_branch_schedule_is_the_stable_rate_then_a_decay_over_its_length():
  """A WSD branch decaying from step 30 over 10 steps: peak at every step before 30 (as the
  stable run, a constant schedule), then the 1-sqrt decay, reaching min_lr_ratio at 40."""
  cfg = tiny_config(**{"steps": 40, "optim.schedule_unit": "tokens", "optim.warmup_steps": 0,
                       "optim.decay_steps": 0, "optim.warmup_tokens": 8 * 32 * 4,
                       "optim.learning_rate": 1e-2})
  stable = cfg.copy_and_resolve_references()
  stable.optim.update(schedule="constant", decay_tokens=10**9)
  tokens = 8 * 32  # per step
  points = schedules.branch_points(examples=8 * 50, batch=8, ends=[0.4, 0.8],
                                   decay_fraction=0.2)
  assert points == [(10, 10, 20), (30, 10, 40)]
  schedules.branch_schedule(cfg.optim, 30 * tokens, 10 * tokens)
  lr = schedules.schedule_values(cfg, 40)
  assert lr[:30] == schedules.schedule_values(stable, 30)
  assert lr[29] == pytest.approx(1e-2) and lr[30] == pytest.approx(1e-2)  # decay starts at 30
  assert lr[31] < lr[30] and lr[39] < 1e-2 * (0.1 + 0.9 * (1 - math.sqrt(0.85)))
  full = schedules.schedule_values(cfg, 41)[40]
  assert full == pytest.approx(1e-3, rel=1e-5)
  assert schedules.power_a(3e-3, 16, 16384.0, -0.51) * 16 * 16384 ** -0.51 == \
      pytest.approx(3e-3)


def test_branch_from_a_checkpoint_equals_a_run_from_scratch(tmp_path, data_dir):
  """The experiment's branching end to end: a stable run to step 3 (checkpointed), a branch
  that restores a copy of that checkpoint and decays over 3 steps, against a fresh run of the
  branch's config: the same losses bit for bit, steps 1-3 in the stable run, 4-6 in the branch."""
  tokens = 8 * 32
  base = tiny_config(**{"steps": 6, "optim.schedule_unit": "tokens", "optim.warmup_steps": 0,
                        "optim.decay_steps": 0, "optim.warmup_tokens": 2 * tokens,
                        "optim.learning_rate": 1e-2, "checkpoint.every_steps": 0})
  stable = base.copy_and_resolve_references()
  stable.optim.update(schedule="constant", decay_tokens=10**9)
  schedules.train_stable(stable, str(tmp_path / "stable"), [3])
  branch = base.copy_and_resolve_references()
  schedules.branch_schedule(branch.optim, 3 * tokens, 3 * tokens)
  schedules.copy_checkpoint(str(tmp_path / "stable"), 3, str(tmp_path / "branch"))
  common.train(branch, str(tmp_path / "branch"), fresh=False)
  common.train(branch, str(tmp_path / "scratch"))
  stable_l, branch_l, scratch = (losses(tmp_path / d) for d in ("stable", "branch", "scratch"))
  assert sorted(branch_l) == [4, 5, 6]
  got = [stable_l[s] for s in (1, 2, 3)] + [branch_l[s] for s in (4, 5, 6)]
  assert got == [scratch[s] for s in range(1, 7)]
  assert len(set(got[3:])) == 3


@pytest.mark.slow  # the default run keeps test_an_experiment_over_seeds, the same experiment over 2 seeds
def test_large_batch_optimizers_end_to_end(tmp_path, data_dir):
  """The untuned command (the rules alone) with a tiny config: LARS and Muon at batch 16 and at
  their reference batch 8, the linear rule doubling LARS's rate, the sqrt rule Muon's by
  sqrt(2); a CSV row per run and the PNG."""
  config = tiny_config_file(tmp_path)
  out = tmp_path / "out" / "opt"
  code = large_batch_optimizers.main([
      "--config", str(config), "--batch", "16", "--reference_batch", "8", "--examples", "64",
      "--optimizers", "lars,muon", "--evals", "2", "--eval_sequences", "8", "--out", str(out),
      "--workdir", str(tmp_path / "runs"), "--lr_grid", "1", "--b2_grid", "rule"])
  assert code == 0
  rows = list(csv.DictReader(open(f"{out}.csv")))
  assert [(r["optimizer"], int(r["batch_size"]), int(r["steps"])) for r in rows] == [
      ("lars", 16, 4), ("muon", 16, 4), ("lars", 8, 8), ("muon", 8, 8)]
  lr = [float(r["learning_rate"]) for r in rows]
  assert lr[0] == pytest.approx(2 * lr[2]) and lr[1] == pytest.approx(2 ** 0.5 * lr[3])
  assert all(np.isfinite(float(r["final_eval_loss"])) for r in rows)
  assert os.path.getsize(f"{out}.png") > 10_000
  assert large_batch_optimizers.main(["--config", str(config), "--optimizers", "adam"]) == 2


def test_summarize_over_seeds():
  rows = [{"run": "a", "target": 2.7, "steps": s, "noise": n} for s, n in ((10, 1.0), (14, None),
                                                                            (12, 3.0))]
  rows.append({"run": "b", "target": 2.7, "steps": float("nan"), "noise": 2.0})
  got = {r["run"]: r for r in common.summarize(rows, ("run", "target"), ("steps", "noise"))}
  a = got["a"]
  assert (a["steps_n"], a["steps_mean"], a["steps_min"], a["steps_max"]) == (3, 12.0, 10.0, 14.0)
  assert a["steps_std"] == pytest.approx(2.0) and a["noise_n"] == 2 and a["noise_mean"] == 2.0
  assert a["steps_text"] == "12 +- 2 (10-14, 3/3)" and got["b"]["steps_text"] == "-"
  assert got["b"]["noise_n"] == 1 and math.isnan(got["b"]["noise_std"])


def test_arms_are_compared_seed_by_seed():
  """`common.paired`: each arm against the baseline at the same other keys, matched by seed (a
  seed missing in one arm is left out of both), with the t interval and a verdict that claims no
  difference where the interval holds 0."""
  rows = [{"seed": s, "arm": a, "batch_size": b, "loss": base + d}
          for s, base in ((0, 2.0), (1, 2.5), (2, 3.0))
          for b in (8, 16)
          for a, d in (("rule", 0.0), ("sqrt", 0.1 + 0.01 * s), ("noise", 0.3 * (-1) ** s))]
  rows.append({"seed": 3, "arm": "sqrt", "batch_size": 8, "loss": 9.0})  # no baseline: left out
  got = {(d["arm"], d["batch_size"]): d for d in common.paired(rows, ("arm", "batch_size"),
                                                               ("loss",), "arm", "rule")}
  assert set(got) == {("sqrt", 8), ("sqrt", 16), ("noise", 8), ("noise", 16)}
  sqrt = got[("sqrt", 8)]
  assert sqrt["diff"] == pytest.approx(0.11) and sqrt["diff_n"] == 3 and sqrt["diff_significant"]
  assert sqrt["diff_lo"] == pytest.approx(0.11 - 4.3027 * 0.01 / math.sqrt(3), abs=1e-4)
  assert "sqrt higher than rule" in sqrt["text"] and "batch_size=8" in sqrt["text"]
  noise = got[("noise", 16)]
  assert not noise["diff_significant"] and "no difference" in noise["text"]


def test_an_experiment_over_seeds(tmp_path, data_dir):
  """`--seeds 2` (the rules alone): the experiment at seeds 0 and 1, each in its own workdir
  (other losses), every row in OUT.csv with its seed, the spread in OUT_seeds.csv, the first
  seed's figure."""
  config = tiny_config_file(tmp_path)
  out = tmp_path / "out" / "opt"
  code = large_batch_optimizers.main([
      "--config", str(config), "--batch", "16", "--reference_batch", "8", "--examples", "64",
      "--optimizers", "lars", "--evals", "2", "--eval_sequences", "8", "--out", str(out),
      "--workdir", str(tmp_path / "runs"), "--seeds", "2", "--lr_grid", "1",
      "--b2_grid", "rule"])
  assert code == 0
  rows = list(csv.DictReader(open(f"{out}.csv")))
  assert [(r["seed"], int(r["batch_size"])) for r in rows] == [("0", 16), ("0", 8), ("1", 16),
                                                               ("1", 8)]
  loss = {(r["seed"], r["batch_size"]): float(r["final_eval_loss"]) for r in rows}
  assert loss[("0", "16")] != loss[("1", "16")]  # another seed: another run
  summary = {int(r["batch_size"]): r for r in csv.DictReader(open(f"{out}_seeds.csv"))}
  assert int(summary[16]["final_eval_loss_n"]) == 2
  assert float(summary[16]["final_eval_loss_mean"]) == pytest.approx(
      (loss[("0", "16")] + loss[("1", "16")]) / 2)
  assert os.path.exists(tmp_path / "runs" / "seed1" / "opt.csv")
  assert os.path.exists(f"{out}_paired.csv")  # against adamw, which this run left out: empty
  assert os.path.getsize(f"{out}.png") > 10_000
  assert large_batch_optimizers.main(["--config", str(config), "--seeds", "0"]) == 2


def test_reuse_reads_finished_runs_and_retrains_a_changed_one(tmp_path, data_dir, capsys):
  """`--reuse`: a second invocation reads every run from its finished.json (the same rows, the
  recorded seconds), `--large_only` leaves the reference batch out; a run whose config differs,
  or that was cut off before its end (no finished.json), is not read."""
  from trainer.run import inprocess
  config = tiny_config_file(tmp_path)
  args = ["--config", str(config), "--batch", "16", "--reference_batch", "8", "--examples", "64",
          "--optimizers", "lars", "--evals", "2", "--eval_sequences", "8", "--workdir",
          str(tmp_path / "runs"), "--lr_grid", "1", "--b2_grid", "rule", "--reuse"]
  first, again, large = (tmp_path / n for n in ("first", "again", "large"))
  assert large_batch_optimizers.main(args + ["--out", str(first)]) == 0
  assert "[reuse]" not in capsys.readouterr().out
  assert large_batch_optimizers.main(args + ["--out", str(again)]) == 0
  assert capsys.readouterr().out.count("read from its finished.json") == 2
  assert common.REUSE is False  # the flag holds for its command only
  rows = lambda p: list(csv.DictReader(open(f"{p}.csv")))
  assert rows(again) == rows(first)
  assert large_batch_optimizers.main(args + ["--out", str(large), "--large_only"]) == 0
  assert rows(large) == rows(first)[:1]
  run = tmp_path / "runs" / "lars_b16"
  cfg = large_batch_optimizers.optimizer_config(
      common.load(str(config), []), large_batch_optimizers.parse(args)[0], "lars", 16)
  assert inprocess.finished(cfg, str(run)) is not None
  cfg.seed += 1
  assert inprocess.finished(cfg, str(run)) is None
  os.remove(run / "finished.json")
  cfg.seed -= 1
  assert inprocess.finished(cfg, str(run)) is None


@pytest.mark.slow  # six trainings, ~30-70 s on 2 shared cores
def test_muon_critical_batch_end_to_end(tmp_path, data_dir):
  """The command with a tiny config and easy targets: AdamW and Muon at batches 16 and 32, the
  learning-rate grid at 32, trained to the lower target; a CSV row per run and target (the higher
  one read from the same records, reached earlier) with each optimizer's fitted B_crit per target,
  and the PNG."""
  config = write_sweep_config(tmp_path)
  out = tmp_path / "out" / "bcrit"
  code = muon_critical_batch.main([
      "--config", str(config), "--batch_sizes", "16,32", "--micro_batch_size", "16",
      "--targets", "5.0,5.3", "--lr_grid", "2", "--lr_grid_batches", "32",
      "--stated_lr", "adamw=0.01,muon=0.02",
      "--max_examples", "1280",
      "--eval_examples", "32", "--smooth_examples", "64", "--eval_sequences", "8",
      "--out", str(out), "--workdir", str(tmp_path / "runs")])
  assert code == 0
  rows = list(csv.DictReader(open(f"{out}.csv")))
  got = [(float(r["target"]), r["optimizer"], int(r["batch_size"]), float(r["lr_multiplier"]))
         for r in rows]
  assert got == [(t, o, b, m) for t in (5.3, 5.0) for o in ("adamw", "muon")
                 for b, m in ((16, 1), (32, 1), (32, 2))]
  assert all(r["steps"] not in ("", "None") for r in rows), rows
  steps = {g: float(r["steps"]) for g, r in zip(got, rows)}
  for (t, o, b, m), s in steps.items():
    if t == 5.3:
      assert s < steps[(5.0, o, b, m)], (o, b, m)  # the higher loss is crossed first
  lr = {(r["optimizer"], int(r["batch_size"]), float(r["lr_multiplier"])): float(r["learning_rate"])
        for r in rows}
  assert lr[("adamw", 16, 1.0)] == pytest.approx(1e-2) and lr[("muon", 16, 1.0)] == 0.02
  assert lr[("muon", 32, 2.0)] == pytest.approx(2 * 2 ** 0.5 * 0.02)  # sqrt rule, then x2
  for name in ("adamw", "muon"):
    fitted = {t: {r["b_crit"] for r in rows if r["optimizer"] == name and float(r["target"]) == t}
              for t in (5.3, 5.0)}
    assert all(len(v) == 1 for v in fitted.values()), fitted
  assert os.path.getsize(f"{out}.png") > 10_000
  for bad in (["--optimizers", "adam"], ["--stated_lr", "adam=0.1"], ["--stated_lr", "muon"],
              ["--targets", ""]):
    assert muon_critical_batch.main(["--config", str(config), *bad]) == 2, bad


def test_seesaw_runs_and_refusals():
  """The runs of part 1: cosine, the step decay (Seesaw up to the start), Seesaw up to each
  largest batch, the linear rule at the largest; each config validates. A largest batch that is
  not the start x 2^k is one line, exit code 2."""
  from trainer.config.checks import validate  # noqa: PLC0415
  args, _ = seesaw.parse(["--max_batches", "16,32", "--batch", "8", "--examples", "256"])
  names = [name for name, _ in seesaw.runs(args)]
  assert names == ["cosine", "step decay", "seesaw 16", "seesaw 32", "seesaw 32, linear rule"]
  for _, values in seesaw.runs(args):
    cfg = seesaw.part1_config(tiny_config(**{"optim.warmup_steps": 0}), args, values)
    validate(cfg, 1)
    assert cfg.steps == 32 and cfg.optim.schedule == "cosine"
  assert seesaw.main(["--max_batches", "24"]) == 2


@pytest.mark.slow  # seven trainings, ~2 min on 2 shared cores
def test_seesaw_end_to_end(tmp_path, data_dir):
  """The command with a tiny config: part 1's four runs at equal tokens (Seesaw saves steps) and
  part 2's probe, each with its CSV and PNG."""
  config = tiny_config_file(tmp_path)
  out = tmp_path / "out" / "seesaw"
  code = seesaw.main([
      "--config", str(config), "--config.optim.warmup_steps=0", "--batch", "8",
      "--examples", "128", "--max_batches", "16", "--eval_examples", "32",
      "--eval_sequences", "8", "--at", "4", "--factors", "2", "--probe_tokens", "512",
      "--out", str(out), "--workdir", str(tmp_path / "runs")])
  assert code == 0
  rows = list(csv.DictReader(open(f"{out}.csv")))
  assert [(r["run"], int(r["tokens"])) for r in rows] == [
      (name, 128 * 32) for name in ("cosine", "step decay", "seesaw 16", "seesaw 16, linear rule")]
  assert int(rows[2]["steps"]) < int(rows[1]["steps"]) == 16
  probe = list(csv.DictReader(open(f"{out}_probe.csv")))
  assert [int(r["factor"]) for r in probe] == [1, 2]
  assert os.path.getsize(f"{out}.png") > 10_000 and os.path.getsize(f"{out}_probe.png") > 10_000


def test_divergence_is_flagged():
  from experiments.linear_scaling import is_diverged  # noqa: PLC0415
  assert not is_diverged([3.5, 3.0, 2.6], 512)
  assert is_diverged([3.5, float("nan"), 2.6], 512)
  assert is_diverged([3.5, 2e5, 6.24], 512)  # blew up, then stuck at ln 512 = 6.238
  assert is_diverged([6.2383, 6.2383], 512) and is_diverged([], 512)


def test_timescale_optimum_and_exponent():
  """Power Lines' tau from a batch's weight-decay sweep: the parabola's vertex in log lambda
  where the best is inside the grid, the edge (not resolved) where it is not; lambda_opt's
  exponent in B over the resolved batches only."""
  def runs(batch, lr, losses):
    return [{"weight_decay": wd, "final_eval_loss": y, "learning_rate": lr}
            for wd, y in zip((0.1, 1.0, 10.0), losses)]
  inside = timescale.optimum(runs(8, 2e-3, [3.0, 2.0, 3.0]), 8, 4096)
  assert inside["inside"] and inside["wd_opt"] == pytest.approx(1.0)
  assert inside["tau_opt"] == pytest.approx(8 / (2e-3 * 1.0 * 4096))
  skew = timescale.optimum(runs(32, 4e-3, [3.0, 2.0, 2.5]), 32, 4096)
  assert 1.0 < skew["wd_opt"] < 10.0  # pulled towards the lower neighbour
  edge = timescale.optimum(runs(128, 8e-3, [3.0, 2.5, 2.0]), 128, 4096)
  assert not edge["inside"] and edge["wd_opt"] == 10.0
  fit = timescale.exponent([inside, {**inside, "batch_size": 32, "wd_opt": 2.0}, edge])
  assert fit["batches_inside"] == 2 and fit["wd_exponent"] == pytest.approx(0.5)
  assert math.isnan(timescale.exponent([inside, edge])["wd_exponent"])
  assert timescale.main(["--wd_grid", "0.1,1"]) == 2  # no neighbour on both sides: one line


def test_timescale_brackets_lambda_on_the_seeds_mean(tmp_path, monkeypatch):
  """A stand-in trainer with a known surface, final loss 2 + log10(lambda / best)^2, where
  best = 0.3 (1 + 0.1 (seed - 1)) (B / 8)^(0.5 + 0.05 (seed - 1)): Power Lines under the sqrt rule
  on the seeds' mean, each seed's exponent 0.45, 0.5 or 0.55; at batch 128 best is 1,000. The grid
  0.1, 0.3, 1 grows by 3 past a winning edge of the seeds' mean until the best is inside (batch 32:
  once); batch 128's stays at the edge after the extensions, is censored and left out of the fit;
  the exponent is 0.5, and its interval over the seeds holds it."""
  from trainer.run.inprocess import Trained  # noqa: PLC0415
  seen = []

  def train(cfg, workdir, **_):
    batch, wd, seed = cfg.data.global_batch_size, cfg.optim.weight_decay, cfg.seed
    best = (0.3 * (1 + 0.1 * (seed - 1)) * (batch / 8) ** (0.5 + 0.05 * (seed - 1))
            if batch < 128 else 1e3)
    seen.append((batch, seed))
    return Trained("done", cfg.steps, 0.0,
                   [{"step": cfg.steps, "eval_loss": 2 + math.log10(wd / best) ** 2}],
                   BatchRamp.constant(batch, cfg.data.seq_len), workdir)

  monkeypatch.setattr(common, "train", train)
  config = tiny_config_file(tmp_path)
  out = tmp_path / "out" / "tau"
  assert timescale.main([
      "--config", str(config), "--batch_sizes", "8,32,128", "--wd_grid", "0.1,0.3,1",
      "--wd_factor", "3", "--max_extensions", "2", "--examples", "256", "--seeds", "3",
      "--out", str(out), "--workdir", str(tmp_path / "runs")]) == 0
  rows = list(csv.DictReader(open(f"{out}.csv")))
  opt = {int(r["batch_size"]): r for r in rows if r["kind"] == "optimum"}
  assert (opt[8]["lambdas"], opt[8]["inside"]) == ("0.1/0.3/1", "True")
  assert (opt[32]["lambdas"], opt[32]["inside"]) == ("0.1/0.3/1/3", "True")
  assert (opt[128]["lambdas"], opt[128]["inside"]) == ("0.1/0.3/1/3/9", "False")  # censored
  assert sorted(set(seen)) == [(b, s) for b in (8, 32, 128) for s in (0, 1, 2)]
  assert len(seen) == 3 * (3 + 4 + 5)  # every lambda run on every seed
  assert float(opt[8]["tau_lo"]) < float(opt[8]["tau_opt"]) < float(opt[8]["tau_hi"])
  (fit,) = [r for r in rows if r["kind"] == "fit"]
  assert fit["batches_inside"] == "2"  # 128 left out
  assert float(fit["wd_exponent"]) == pytest.approx(0.5, abs=1e-6)
  assert float(fit["wd_exponent_lo"]) < 0.45 and float(fit["wd_exponent_hi"]) > 0.55
  assert timescale.main(["--config", str(config), "--wd_factor", "1"]) == 2


@pytest.mark.slow  # 12 trainings, ~1.5 min (the default run has the stand-in test above)
def test_timescale_end_to_end(tmp_path, data_dir):
  """The command with a tiny config over 2 seeds: a run per (batch, lambda, seed) at the sqrt
  rule's rate with lambda as given, a row per batch with its optimum and one with the exponent;
  the figure."""
  config = tiny_config_file(tmp_path)
  out = tmp_path / "out" / "tau"
  code = timescale.main([
      "--config", str(config), "--batch_sizes", "8,16", "--wd_grid", "0.1,1,10",
      "--max_extensions", "0", "--examples", "64", "--evals", "2", "--eval_sequences", "8",
      "--seeds", "2", "--out", str(out), "--workdir", str(tmp_path / "runs")])
  assert code == 0
  rows = list(csv.DictReader(open(f"{out}.csv")))
  run_rows = [r for r in rows if r["kind"] == "run"]
  assert [(r["batch_size"], r["weight_decay"], r["seed"]) for r in run_rows] == [
      (str(b), str(wd), str(s)) for b in (8, 16) for wd in (0.1, 1.0, 10.0) for s in (0, 1)]
  lr = {r["batch_size"]: float(r["learning_rate"]) for r in run_rows}
  assert lr["16"] == pytest.approx(2 ** 0.5 * lr["8"])
  assert [r["kind"] for r in rows[12:]] == ["optimum", "optimum", "fit"]
  for r in rows[12:14]:
    assert float(r["tau_opt"]) == pytest.approx(
        int(r["batch_size"]) / (float(r["learning_rate"]) * float(r["wd_opt"]) * 64))
  assert os.path.getsize(f"{out}.png") > 10_000


@pytest.mark.slow  # 7 trainings, ~30 s (the default run has test_an_experiment_over_seeds)
def test_schedules_end_to_end(tmp_path, data_dir):
  """The command with a tiny config: cosine, power and two WSD branches from one stable run,
  each row with its loss against the same run's cosine; the figure."""
  config = write_sweep_config(tmp_path)
  out = tmp_path / "out" / "sched"
  code = schedules.main([
      "--config", str(config), "--examples", "128", "--branches", "0.5,1", "--evals", "4",
      "--eval_sequences", "8", "--out", str(out),
      "--workdir", str(tmp_path / "runs")])
  assert code == 0
  rows = list(csv.DictReader(open(f"{out}.csv")))
  assert [r["schedule"] for r in rows] == ["cosine", "power", "wsd", "wsd"]
  assert [int(r["end_step"]) for r in rows] == [8, 8, 4, 8]
  for r in rows:
    assert float(r["loss_minus_cosine"]) == pytest.approx(
        float(r["final_eval_loss"]) - float(rows[0]["final_eval_loss"]))
  assert os.path.getsize(f"{out}.png") > 10_000


def test_help_shows_the_default_output_as_it_is():
  """`--help` said docs/docs/<name> for the default docs/<name>."""
  text = " ".join(common.parser("timescale", "doc").format_help().split())
  assert "(default docs/timescale)" in text and "docs/docs" not in text, text

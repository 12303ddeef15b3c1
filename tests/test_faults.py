"""Faults that do not crash: the straggler report, the hang watchdog and injected faults.

The report's and the watchdog's logic on made-up timings and a real `StepTimer`; the watchdog
inside a real run whose compile, evaluation and save are each longer than its timeout; two real
processes (gloo on CPU) with `slow:1:2` and a clean run, and with `hang:1:STEP` and its restart
(slow); `tools.soak` (3 faults on the test model in the default run, 10 on lm_tiny slow).
"""
import json
import os
import subprocess
import sys
import time

import numpy as np
import pytest

import train
from conftest import CACHE_DIR, losses, tiny_config
from test_multihost import MODEL_ARGS, run_processes
from trainer.config.defaults import parse_fault
from trainer.run.faults import Fault
from trainer.run.watchdog import EXIT_HUNG, HangWatchdog, timeout_for
from trainer.tracking.goodput import StepTimer
from trainer.tracking.straggler import MIN_ROWS, StragglerReport, slow_processes

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


def timings(rows: int, processes: int = 2, noise: float = 0.2, seed: int = 0) -> np.ndarray:
  """[rows, processes, parts] seconds per step: compute ~100 ms, data ~1 ms, save 0, each
  within +-`noise` (relative) of that."""
  rng = np.random.default_rng(seed)
  base = np.array([0.1, 0.001, 0.0])
  return base * rng.uniform(1 - noise, 1 + noise, (rows, processes, 3))


# --- the report's decision ------------------------------------------------------------------


def test_a_slow_process_is_named_by_its_part_from_the_third_row():
  history = timings(6)
  history[:, 1, 0] *= 2.0  # process 1 computes 2x as long
  assert slow_processes(history[:MIN_ROWS - 1], 0.2, 1.3) == []
  named = slow_processes(history[:MIN_ROWS], 0.2, 1.3)
  assert [(p, kind) for p, kind, *_ in named] == [(1, "compute")]
  assert 1.5 < named[0][2] < 2.7


def test_noise_and_parts_too_small_to_matter_name_nobody():
  history = timings(400, processes=4, noise=0.2, seed=1)  # +-20%: ratios up to 1.5 per row
  history[:, 2, 1] *= 5  # 5x the data wait, but 4 ms of a 200 ms step
  for end in range(1, len(history) + 1):
    assert slow_processes(history[:end], 0.2, 1.3) == [], end


def test_the_report_says_it_once_in_the_row_and_counts_the_time_lost():
  lines = []
  table = np.array([[0.10, 0.001, 0.0], [0.25, 0.001, 0.0]])
  report = StragglerReport(1.3, lambda parts: table, ["a", "b"], lines.append)
  rows = [report((0.1, 0.001, 0.0), 0.3, steps=10) for _ in range(4)]
  assert "straggler" not in rows[1][0] and rows[2][0]["straggler"] == "process 1 compute 2.50x"
  assert len(lines) == 1 and lines[0].startswith("straggler: process 1 (host b) is slow in "
                                                 "compute: 250.0 ms per step, 2.50x")
  assert rows[3][1] == {"slowest": 1, "lost_to_slowest": pytest.approx(1.5)}  # (0.251-0.101)x10


# --- faults ---------------------------------------------------------------------------------


@pytest.mark.parametrize("spec", ["slow:1", "slow:1:1", "hang:0:0", "hang:-1:3", "stall:0:2",
                                  "slow:a:2"])
def test_malformed_faults_are_refused(spec):
  with pytest.raises(ValueError, match="use 'slow:PROCESS:FACTOR'"):
    parse_fault(spec)


def test_a_fault_for_a_process_the_run_has_not_is_refused_before_compiling():
  import jax  # noqa: PLC0415

  from trainer.config import ConfigError  # noqa: PLC0415
  from trainer.config.checks import validate  # noqa: PLC0415
  with pytest.raises(ConfigError) as e:
    validate(tiny_config(**{"trainer.fault": "hang:1:5"}), jax.devices())
  assert str(e.value) == ("trainer.fault='hang:1:5': process 1 is not one of this run's 1 "
                          "process(es) (0..0)")


def test_slow_sleeps_factor_minus_one_times_its_own_step_time(monkeypatch):
  now, slept = [0.0], []

  def sleep(seconds):
    slept.append(seconds)
    now[0] += seconds

  monkeypatch.setattr(time, "sleep", sleep)
  fault = Fault("slow:0:3", process=0)
  for step in range(1, 6):
    fault.before_step(step, clock=lambda: now[0])
    now[0] += 0.05  # the step itself
  assert slept == pytest.approx([0.1, 0.1, 0.1])  # (3 - 1) x 50 ms, from the third step
  assert not Fault("slow:1:3", process=0).here


# --- the watchdog ---------------------------------------------------------------------------


def watch(timer, tmp_path, timeout, process=0, processes=1):
  fired = []
  dog = HangWatchdog(timer, timeout, str(tmp_path), process=process, processes=processes,
                     host="h", newest=lambda: 4, exit=fired.append).start()
  return dog, fired


def test_automatic_timeout():
  assert timeout_for(-1, [1.0]) is None and timeout_for(7, []) == 7
  assert timeout_for(0, [], False) == timeout_for(7, [], False) == 600  # before a first step
  assert timeout_for(0, []) == 600 and timeout_for(0, [0.1] * 5) == 60
  assert timeout_for(0, [10.0, 10.0, 500.0]) == 200


def test_watchdog_fires_naming_every_process_and_leaves_with_its_code(tmp_path, capsys):
  timer = StepTimer()
  timer.step_completed(3)
  os.makedirs(tmp_path / "hang")
  with timer.waiting_for_others():
    dog, fired = watch(timer, tmp_path, 0.3, processes=2)
    with open(tmp_path / "hang" / "process_1.json", "w") as f:  # the other process, firing too
      json.dump({"process": 1, "host": "h1", "phase": "step", "step": 2, "time": time.time()}, f)
    time.sleep(2.0)  # process 0 leaves 1 s after the others
  assert fired == [EXIT_HUNG]
  err = capsys.readouterr().err.strip()
  assert err == ("error: hang: no step completed within 0.3s (trainer.hang_timeout_s): process 0 "
                 "(host h) in collective after step 3, process 1 (host h1) in step after step "
                 "2; exit 5: rerun the command to resume from checkpoint 4")


def test_watchdog_does_not_count_compiles_saves_or_evaluations(tmp_path):
  timer = StepTimer()
  timer.step_completed(1)  # past the first step's floor
  dog, fired = watch(timer, tmp_path, 0.3, process=1)  # (not the lead: leaves at once)
  for phase in ("compile", "save", "eval"):
    with timer.paused(phase):
      time.sleep(0.6)
    timer.step_completed(timer.completed + 1)
  assert fired == []
  time.sleep(0.8)  # and it still watches
  assert fired == [EXIT_HUNG]
  dog.stop()


def test_watchdog_in_a_run_with_a_slow_compile_evaluation_and_save(tmp_path, monkeypatch):
  """A 1 s timeout; each compile (the first step's, under the first step's floor, and the log
  step's at step 3, past it), the evaluation and the save take 1.5 s more: the run ends normally
  (the watchdog's `fire`, which would end it with EXIT_HUNG, is recorded instead)."""
  from trainer.checkpoint.persistent import Checkpointer  # noqa: PLC0415
  from trainer.run import loop  # noqa: PLC0415
  from trainer.step.program import Program  # noqa: PLC0415

  def slowly(fn):
    def wrapper(*args, **kwargs):
      time.sleep(1.5)
      return fn(*args, **kwargs)
    return wrapper

  fired = []
  monkeypatch.setattr(HangWatchdog, "fire", lambda self, timeout: fired.append(timeout))
  monkeypatch.setattr(Program, "compile", slowly(Program.compile))
  monkeypatch.setattr(Checkpointer, "save", slowly(Checkpointer.save))
  real = loop.make_evaluator
  monkeypatch.setattr(loop, "make_evaluator", lambda *a, **k: slowly(real(*a, **k)))
  cfg = tiny_config(**{"steps": 3, "log_every": 3, "eval_every": 3,
                       "checkpoint.every_steps": 3, "trainer.hang_timeout_s": 1.0})
  run = loop.Run(cfg, str(tmp_path))
  result = run.train()
  assert (result.status, result.step, fired) == ("done", 3, [])
  assert run.steps.count == 2  # the log step's variant compiled after step 1 completed


# --- two real processes ---------------------------------------------------------------------


def rows_of(workdir) -> list[dict]:
  with open(os.path.join(workdir, "metrics.jsonl")) as f:
    return [r for r in map(json.loads, f) if "loss" in r]


@pytest.mark.slow  # two processes, 230 steps; the default run keeps the report's logic above
def test_two_processes_the_slow_one_is_named_and_a_clean_run_names_nobody(tmp_path):
  args = MODEL_ARGS + ["--config.checkpoint.every_steps=50"]
  slow = run_processes(tmp_path / "slow", 2, args + ["--config.steps=30",
                                                      "--config.trainer.fault=slow:1:2"])
  assert [code for code, _, _ in slow] == [0, 0], slow[0][2][-2000:] + slow[1][2][-2000:]
  assert "fault injection on (trainer.fault='slow:1:2')" in slow[0][1]
  named = [(r["step"], r.get("straggler")) for r in rows_of(tmp_path / "slow")]
  first = next(step for step, who in named if who)
  # the fault sleeps from step 3 (it measures two steps first): named within 3 rows of it
  assert first <= 5, named
  assert all(who == "process 1 compute " + who.split()[-1] for _, who in named[first - 1:]), named
  assert "straggler: process 1 (host " in slow[0][1] and ") is slow in compute" in slow[0][1]

  clean = run_processes(tmp_path / "clean", 2, args + ["--config.steps=200"])
  assert [code for code, _, _ in clean] == [0, 0]
  rows = rows_of(tmp_path / "clean")
  assert len(rows) == 200 and not [r for r in rows if "straggler" in r]
  assert "straggler:" not in clean[0][1]


@pytest.mark.slow  # two processes hang and restart; the default run keeps the watchdog tests above
def test_two_processes_one_hangs_the_watchdog_ends_both_and_the_restart_resumes_exactly(tmp_path):
  args = MODEL_ARGS + ["--config.steps=12", "--config.checkpoint.every_steps=4"]
  straight = run_processes(tmp_path / "straight", 2, args)
  assert [code for code, _, _ in straight] == [0, 0]
  hung = tmp_path / "hung"
  results = run_processes(hung, 2, args + ["--config.trainer.fault=hang:1:8",
                                           "--config.trainer.hang_timeout_s=10"])
  ended = time.time()
  since_last_row = ended - os.path.getmtime(hung / "metrics.jsonl")
  for code, _, err in results:
    assert code == EXIT_HUNG, err[-3000:]
    line = err.strip().splitlines()[-1]
    assert line.startswith("error: hang: no step completed within 10.0s"), line
    assert "process 0 (host" in line and "process 1 (host" in line and "in step after" in line
  assert since_last_row < 3 * 10, since_last_row
  restarted = run_processes(hung, 2, args)
  assert [code for code, _, _ in restarted] == [0, 0]
  assert "resumed from" in restarted[0][1]
  assert losses(hung) == losses(tmp_path / "straight")


# --- the soak -------------------------------------------------------------------------------


def soak(workdir, faults: int, *overrides: str) -> subprocess.CompletedProcess:
  return subprocess.run(
      [sys.executable, "-m", "tools.soak", "--config", "configs/lm_tiny.py", "--workdir",
       str(workdir), f"--faults={faults}", "--seed=3", "--hang_timeout_s=4",
       f"--config.trainer.compile_cache_dir={CACHE_DIR}", "--config.trainer.progress_bar=false",
       "--config.eval_every=0", "--config.trainer.peak_flops_per_device=1e9", *overrides],
      cwd=ROOT, capture_output=True, text=True, timeout=3000)


def test_soak_two_faults_recovers_all_bit_identical(tmp_path):
  tiny = ["--config.model.d_model=32", "--config.model.mlp_dim=64", "--config.data.seq_len=32",
          "--config.data.global_batch_size=8", "--config.steps=16", "--config.log_every=2",
          "--config.checkpoint.every_steps=4", "--config.data.prefetch=0"]
  proc = soak(tmp_path, 2, *tiny)
  assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
  summary = json.loads(proc.stdout.strip().splitlines()[-1])
  assert (summary["attempted"], summary["recovered"], summary["identical"]) == (2, 2, True)


@pytest.mark.slow  # ten faults on lm_tiny itself: minutes
def test_soak_ten_faults_on_lm_tiny(tmp_path):
  proc = soak(tmp_path, 10, "--config.steps=100", "--config.checkpoint.every_steps=10")
  assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
  summary = json.loads(proc.stdout.strip().splitlines()[-1])
  assert (summary["attempted"], summary["recovered"], summary["identical"]) == (10, 10, True)

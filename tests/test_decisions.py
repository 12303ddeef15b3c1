"""When the loop logs, saves, evaluates and stops (`trainer/run/decisions.py`): in process for one
process, and with two real processes where only one of them is sent SIGTERM."""
import json
import os
import signal
import subprocess
import sys
import threading
import time

import jax
import numpy as np
import pytest
from test_multihost import (MODEL_ARGS, ROOT, TINY, assert_ok, child_env, free_port,
                            run_processes)

from conftest import losses, tiny_config
from trainer.run.decisions import Decider, StopSignals
from trainer.run.feed import Feed
from trainer.run.loop import Run
from trainer.run.readback import MetricsWindow
from trainer.step.program import Program


def _decider(**overrides):
  return Decider(tiny_config(**overrides), StopSignals(), start=0, evaluating=True)


def test_decisions_follow_step_counts():
  d = _decider(**{"steps": 12, "log_every": 4, "eval_every": 6, "checkpoint.every_steps": 5,
                  "optim.noise_scale_every": 3})
  got = {s: d.after(s) for s in range(1, 13)}
  assert [s for s, x in got.items() if x.log] == [4, 8, 12]  # measuring steps need no row
  assert [s for s, x in got.items() if x.save] == [5, 10, 12]
  assert [s for s, x in got.items() if x.evaluate] == [6, 12]
  assert [s for s, x in got.items() if x.read] == [5, 6, 10, 12]
  assert [s for s in range(1, 13) if d.measures_noise(s)] == [3, 6, 9, 12]
  assert [s for s in range(1, 13) if d.logs(s)] == [4, 8, 12]  # known before the step
  assert got[12].final and not any(x.final for s, x in got.items() if s < 12)


def test_clock_and_signal_decisions():
  d = _decider(**{"steps": 100, "checkpoint.every_seconds": 0.05})
  assert not d.after(1).save
  time.sleep(0.06)
  assert d.after(2).save
  d.saved()
  assert not d.after(3).save
  d.signals.received = "SIGTERM"
  stop = d.after(4)
  assert stop.preempted == "SIGTERM received" and stop.save and stop.read


def test_metrics_are_read_back_only_when_a_decision_needs_them(tmp_path, monkeypatch):
  """No device-to-host transfer per step: with log_every=3 over 7 steps the loop reads the
  device at the start (its step) and then once per log step and at the end (3, 6, 7). (A save
  reads its finiteness flag too, in Orbax's background thread: not the loop's.)"""
  calls = []
  real = jax.device_get
  monkeypatch.setattr(jax, "device_get", lambda x: calls.append(
      threading.current_thread() is threading.main_thread()) or real(x))
  result = Run(tiny_config(**{"steps": 7, "log_every": 3}), str(tmp_path)).train()
  assert result.status == "done" and result.step == 7
  assert sum(calls) == 4 and len(calls) == 5, calls  # the final save's flag: background
  assert sorted(losses(tmp_path)) == [3, 6, 7]


def test_a_compile_mid_run_waits_for_the_steps_in_flight(tmp_path, monkeypatch):
  """The log steps' program (norm metrics) is compiled at the first log step, mid-run. Compile
  time is left out of `step_time`, the steps still running on the device are not: the loop waits
  for them before it pauses the timer to compile (without the wait, step 3's row read a step
  time a fifth of the others' and an MFU over 100%)."""
  events = []
  wait, compile_ = jax.block_until_ready, Program.compile
  monkeypatch.setattr(jax, "block_until_ready", lambda x: events.append("wait") or wait(x))
  monkeypatch.setattr(Program, "compile",
                      lambda self, *a, **k: events.append("compile") or compile_(self, *a, **k))
  result = Run(tiny_config(**{"steps": 4, "log_every": 3}), str(tmp_path)).train()
  assert result.status == "done" and sorted(losses(tmp_path)) == [3, 4]
  compiles = [i for i, e in enumerate(events) if e == "compile"]
  assert len(compiles) == 2, events  # the other steps' program, then the log steps'
  assert events[compiles[1] - 1] == "wait", events


def test_window_reads_flags_of_unlogged_steps():
  window = MetricsWindow()
  for step in (1, 2, 3):
    m = {"loss": np.float32(step), "skipped": np.int32(step == 2), "nonfinite": np.int32(0),
         "spike": np.int32(step == 2), "grad_norm": np.float32(1.0),
         "target_tokens": np.int32(64)}
    window.add(step, m, log=step == 3)
  first = window.read(upto=2)
  assert [(s, h["skipped"], "grad_norm" in h) for s, h, _ in first] == [(1, 0, False),
                                                                       (2, 1, False)]
  assert [(s, "grad_norm" in h) for s, h, _ in window.read()] == [(3, True)]
  assert window.read() == []


# ----------------------------------------------------------------------------------------------
# Two real processes; SIGTERM reaches only one of them.


def _start(workdir, args):
  port = free_port()
  procs = []
  for pid in range(2):
    env = child_env(4, JAX_COORDINATOR_ADDRESS=f"127.0.0.1:{port}", JAX_NUM_PROCESSES="2",
                    JAX_PROCESS_ID=str(pid))
    procs.append(subprocess.Popen(
        [sys.executable, "train.py", "--config", TINY, "--workdir", str(workdir), *args],
        cwd=ROOT, env=env, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True))
  return procs


def _logged_steps(workdir) -> int:
  path = os.path.join(workdir, "metrics.jsonl")
  if not os.path.exists(path):
    return 0
  with open(path) as f:
    rows = [json.loads(line) for line in f if line.endswith("\n")]
  return max((r["step"] for r in rows if "loss" in r), default=0)


@pytest.mark.slow  # two real processes; the default run keeps tests/test_multihost.py's
def test_sigterm_to_one_process_stops_every_process_at_one_step(tmp_path):
  """SIGTERM to process 1 only: both processes stop after the same step, write one checkpoint
  together and exit 75; the resumed run equals an uninterrupted one."""
  run = tmp_path / "run"
  args = MODEL_ARGS + ["--config.checkpoint.every_steps=0", "--config.optim.decay_steps=400"]
  procs = _start(run, args + ["--config.steps=400"])
  try:
    deadline = time.time() + 240
    while _logged_steps(run) < 5 and time.time() < deadline and procs[0].poll() is None:
      time.sleep(0.2)
    assert _logged_steps(run) >= 5, procs[0].communicate(timeout=5)
    procs[1].send_signal(signal.SIGTERM)
    out = [p.communicate(timeout=120) for p in procs]
  finally:
    for p in procs:
      if p.poll() is None:
        p.kill()
  assert [p.returncode for p in procs] == [75, 75], [o[1][-2000:] for o in out]
  stopped = int(out[0][0].split("stopped after step ")[1].split(";")[0])
  assert "preemption notice" in out[0][0] and f"checkpoint saved to" in out[0][0]
  assert sorted(os.listdir(run / "checkpoints")) == [str(stopped)]
  assert _logged_steps(run) == stopped < 400

  end = stopped + 3
  resumed = run_processes(run, 2, args + [f"--config.steps={end}"])
  assert_ok(resumed)
  assert f"checkpoints/{stopped}" in resumed[0][1]
  straight = tmp_path / "straight"
  assert_ok(run_processes(straight, 2, args + [f"--config.steps={end}"]))
  got, want = losses(run), losses(straight)
  assert sorted(got) == sorted(want) == list(range(1, end + 1))
  np.testing.assert_array_equal([got[s] for s in got], [want[s] for s in got])


def test_stop_when_ends_the_run_one_step_after_the_row(tmp_path):
  """`stop_when` sees each logged row; the run ends with the step that was running meanwhile."""
  stop = lambda step, row: "target reached" if step == 3 and "loss" in row else None
  result = Run(tiny_config(**{"steps": 20}), str(tmp_path), stop_when=stop).train()
  assert result.status == "done" and result.step == 4, result
  assert result.message == "stopped after step 4: target reached"
  assert sorted(losses(tmp_path)) == [1, 2, 3, 4]


@pytest.mark.slow  # two real processes; the default run keeps tests/test_multihost.py's
def test_two_processes_agree_on_clock_saves(tmp_path):
  """With several processes the wall clock is consulted at log steps only, and agreed: a save
  every 1 us becomes a save at every log step (3, 6) and the last one (7), on both processes."""
  args = MODEL_ARGS + ["--config.checkpoint.every_steps=0", "--config.log_every=3",
                       "--config.checkpoint.every_seconds=1e-6", "--config.checkpoint.keep=10",
                       "--config.steps=7"]
  assert_ok(run_processes(tmp_path, 2, args))
  assert sorted(os.listdir(tmp_path / "checkpoints"), key=int) == ["3", "6", "7"]


def test_data_wait_is_reported(tmp_path, monkeypatch):
  """A slow input pipeline shows as `data_wait_ms` (part of `step_time`)."""
  slow = Feed.global_batch
  monkeypatch.setattr(Feed, "global_batch",
                      lambda self, mbs: time.sleep(0.05) or slow(self, mbs))
  Run(tiny_config(**{"steps": 4, "log_every": 2}), str(tmp_path)).train()
  rows = [r for r in map(json.loads, open(tmp_path / "metrics.jsonl")) if "loss" in r]
  assert [r["step"] for r in rows] == [2, 4]
  for r in rows:
    assert 50 <= r["data_wait_ms"] <= 1e3 * r["step_time"], r

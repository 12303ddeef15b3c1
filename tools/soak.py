"""A soak of random faults: a run killed at random moments and restarted each time must end
where an uninterrupted run of the same command ends, bit for bit.

    python -m tools.soak --config configs/lm_tiny.py --workdir runs/soak [--faults 10]
        [--seed 0] [--max_seconds 1800] [--hang_timeout_s 5] [--config.KEY=VALUE ...]

Trains the config straight (WORKDIR/straight), then in WORKDIR/faulted where each of `--faults`
starts meets one fault at a random moment (within twice its even share of the steps left, at the
straight run's pace): SIGKILL, SIGTERM (save, exit 75) or a hang (`trainer.fault=hang:0:STEP`,
ended by the watchdog: exit 5), shuffled evenly; it restarts the run after each, and a last
start runs to the end. A fault is recovered when its
start ended as that fault ends one and the next resumed from the newest complete checkpoint.
Prints recoveries attempted and recovered, steps redone, goodput (`tools.goodput`), and whether
every loss and parameter equals the straight run's exactly (exit 0 only if all do). Bounded: no
fault after --max_seconds; a start 10x slower than expected is killed. docs/reliability.md#soak
"""
from __future__ import annotations

import json
import os
import random
import signal
import subprocess
import sys
import time

import numpy as np

from tools.convert import mesh_from_overrides
from tools.goodput import account, read_events
from trainer.config import ConfigError
from trainer.config.cli import CliParser, load
from trainer.multihost import platforms
from trainer.tracking.record import read_rows

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
KINDS = ("kill", "term", "hang")
EXPECTED_EXIT = {"kill": -signal.SIGKILL, "term": 75, "hang": 5}


def build_parser():
  parser = CliParser("-m tools.soak", __doc__)
  parser.add_argument("--workdir", required=True, help="the soak's directory (straight/, faulted/)")
  parser.add_argument("--faults", type=int, default=10, help="faults to inject (default 10)")
  parser.add_argument("--seed", type=int, default=0, help="seed of the faults' kinds and moments")
  parser.add_argument("--max_seconds", type=float, default=1800.0,
                      help="start no fault after this many seconds (default 1800)")
  parser.add_argument("--hang_timeout_s", type=float, default=5.0,
                      help="trainer.hang_timeout_s of a start that hangs (default 5)")
  return parser


def train_command(config: str, workdir: str, overrides: list[tuple[str, str]], *extra: str):
  return [sys.executable, "train.py", "--config", config, "--workdir", workdir,
          *(f"--config.{k}={v}" for k, v in overrides), *extra]


def events(workdir: str) -> list[dict]:
  path = os.path.join(workdir, "goodput.jsonl")
  if not os.path.exists(path):
    return []
  return read_events(path)


def last_losses(workdir: str) -> dict[int, float]:
  """{step: loss}; a step redone after a restart counts with its last record."""
  return {r["step"]: r["loss"] for r in read_rows(workdir) if "loss" in r and "event" not in r}


def same_parameters(a: str, b: str) -> tuple[bool, int]:
  """(whether the newest checkpoints of workdirs `a` and `b` hold bit-identical parameters,
  the number of arrays compared)."""
  platforms.choose()  # before jax starts, as train.py: no TPU probing without TPUs
  import jax  # noqa: PLC0415  start-up
  from trainer.checkpoint.model_dirs import restore_params  # noqa: PLC0415  start-up
  mesh = mesh_from_overrides([])
  left = jax.tree.leaves(restore_params(a, mesh)[1])
  right = jax.tree.leaves(restore_params(b, mesh)[1])
  same = len(left) == len(right) and all(
      np.array_equal(np.asarray(x), np.asarray(y)) for x, y in zip(left, right))
  return same, len(left)


class Soak:
  """The faulted run's starts (module docstring)."""

  def __init__(self, args, overrides, steps: int, pace: float, log=print):
    self.args, self.overrides, self.steps, self.pace, self.log = args, overrides, steps, pace, log
    self.dir = os.path.join(args.workdir, "faulted")
    self.rng = random.Random(args.seed)
    kinds = [KINDS[k % len(KINDS)] for k in range(args.faults)]
    self.rng.shuffle(kinds)
    self.kinds = kinds
    self.attempted = self.recovered = 0
    self.pending = None  # (fault number, kind) whose recovery the next start shows

  def _progress(self) -> int:
    """The newest complete checkpoint's step (where a restart resumes)."""
    d = os.path.join(self.dir, "checkpoints")
    steps = [int(n) for n in os.listdir(d) if n.isdigit()] if os.path.isdir(d) else []
    return max(steps, default=0)

  def _start(self, *extra: str) -> tuple[subprocess.Popen, int]:
    seen = len(events(self.dir))
    proc = subprocess.Popen(train_command(self.args.config, self.dir, self.overrides, *extra),
                            cwd=ROOT, stdout=subprocess.DEVNULL, stderr=subprocess.PIPE,
                            text=True, start_new_session=True)
    return proc, seen

  def _resumed(self, seen: int, proc: subprocess.Popen, deadline: float) -> dict | None:
    """Wait for this start's first step; its restore event (None: it ended first)."""
    while time.time() < deadline and proc.poll() is None:
      new = events(self.dir)[seen:]
      if any(e["event"] == "first_step" for e in new):
        return next(e for e in new if e["event"] == "restore")
      time.sleep(0.05)
    return None

  def _note_recovery(self, restore: dict | None, expected_from: int) -> None:
    if self.pending is None:
      return
    number, kind = self.pending
    ok = restore is not None and (restore["step"] or 0) == expected_from
    self.recovered += ok
    self.log(f"soak: fault {number} ({kind}): " + (
        f"resumed from step {expected_from}" if ok else
        f"NOT recovered (expected a resume from step {expected_from}, got {restore})"))
    self.pending = None

  def run_faults(self, began: float) -> None:
    for number, kind in enumerate(self.kinds, 1):
      if time.time() - began > self.args.max_seconds:
        self.log(f"soak: --max_seconds {self.args.max_seconds:g} passed: no more faults")
        return
      done = self._progress()
      if done >= self.steps:
        self.log(f"soak: the run finished before fault {number}; none left to fault")
        return
      # within twice the even share of the steps left, so that every fault finds steps to do
      share = 2 * (self.steps - done) / (len(self.kinds) - number + 2)
      extra = ()
      if kind == "hang":
        at = min(done + 3 + self.rng.randint(0, int(share)), self.steps)  # a step done first
        extra = (f"--config.trainer.fault=hang:0:{at}",
                 f"--config.trainer.hang_timeout_s={self.args.hang_timeout_s:g}")
      proc, seen = self._start(*extra)
      limit = time.time() + 120 + 10 * self.pace * self.steps
      restore = self._resumed(seen, proc, limit)
      self._note_recovery(restore, done)
      if kind != "hang" and proc.poll() is None:
        time.sleep(self.rng.uniform(0, share * self.pace))
        if proc.poll() is None:
          os.killpg(proc.pid, signal.SIGKILL) if kind == "kill" else proc.send_signal(
              signal.SIGTERM)
      try:
        _, err = proc.communicate(timeout=max(limit - time.time(), 1))
      except subprocess.TimeoutExpired:
        os.killpg(proc.pid, signal.SIGKILL)
        _, err = proc.communicate()
      if kind == "kill":  # the pipeline's workers share the session
        try:
          os.killpg(proc.pid, signal.SIGKILL)
        except ProcessLookupError:
          pass
      if proc.returncode == 0:
        self.log(f"soak: fault {number} ({kind}): the run finished before it; none left to "
                 "fault")
        return
      self.attempted += 1
      if proc.returncode != EXPECTED_EXIT[kind]:
        self.log(f"soak: fault {number} ({kind}): exit {proc.returncode}, expected "
                 f"{EXPECTED_EXIT[kind]}: {err.strip().splitlines()[-1:] or ''}")
        continue
      self.pending = (number, kind)

  def finish(self) -> int:
    """The last start, to the end; its exit code."""
    done = self._progress()
    proc, seen = self._start()
    limit = time.time() + 120 + 10 * self.pace * self.steps
    self._note_recovery(self._resumed(seen, proc, limit), done)
    try:
      _, err = proc.communicate(timeout=max(limit - time.time(), 1))
    except subprocess.TimeoutExpired:
      os.killpg(proc.pid, signal.SIGKILL)
      _, err = proc.communicate()
    if proc.returncode != 0:
      self.log(f"soak: the last start ended with exit {proc.returncode}: "
               f"{err.strip().splitlines()[-1:]}")
    return proc.returncode


def main(argv: list[str]) -> int:
  try:
    args, overrides = build_parser().parse(argv)
    cfg = load(args.config, overrides)
    if args.faults < 1 or args.max_seconds <= 0 or args.hang_timeout_s <= 0:
      raise ConfigError("--faults, --max_seconds and --hang_timeout_s must be positive")
  except ConfigError as e:
    print(f"error: {e}", file=sys.stderr)
    return 2
  began = time.time()
  straight = os.path.join(args.workdir, "straight")
  proc = subprocess.run(train_command(args.config, straight, overrides), cwd=ROOT,
                        capture_output=True, text=True)
  if proc.returncode != 0:
    print(f"error: the straight run failed (exit {proc.returncode}): "
          f"{proc.stderr.strip().splitlines()[-1:]}", file=sys.stderr)
    return 1
  steps_events = [e for e in events(straight) if e["event"] == "steps"]
  pace = sum(e["seconds"] for e in steps_events) / max(cfg.steps, 1)
  print(f"soak: straight run of {cfg.steps} steps, {pace * 1e3:.0f} ms per step; "
        f"{args.faults} faults")
  soak = Soak(args, overrides, cfg.steps, pace)
  soak.run_faults(began)
  code = soak.finish()
  report = account(events(soak.dir))
  want, got = last_losses(straight), last_losses(soak.dir)
  same_losses = bool(want) and want == got  # every logged step's loss, exactly
  same_params, arrays = same_parameters(straight, soak.dir) if code == 0 else (False, 0)
  identical = same_losses and same_params
  print(f"soak: recoveries attempted {soak.attempted}, recovered {soak.recovered}; steps redone "
        f"{report['steps_redone']}; goodput {100 * report['goodput']:.1f}% over "
        f"{report['restarts']} restart(s); against the straight run, the losses of {len(want)} "
        f"logged steps: {'identical' if same_losses else 'NOT identical'}, the {arrays} "
        f"parameter arrays: {'identical' if same_params else 'NOT identical'} (bit for bit)")
  print(json.dumps({"attempted": soak.attempted, "recovered": soak.recovered,
                    "steps_redone": report["steps_redone"], "goodput": report["goodput"],
                    "identical": identical, "seconds": time.time() - began}))
  ok = identical and soak.attempted == soak.recovered == args.faults
  return 0 if ok else 1


if __name__ == "__main__":
  sys.exit(main(sys.argv[1:]))

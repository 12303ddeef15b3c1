"""The hang watchdog (`HangWatchdog`): a thread that ends the run when no step completes within
`trainer.hang_timeout_s` seconds (0: `AUTO_STEPS` x the median step time, at least
`AUTO_FLOOR_S`; at least `FIRST_S` until this start has completed a step), compiles, saves and
evaluations not counted (`StepTimer.idle`; after a compile, twice its time more), so a slow
first compile, a long evaluation or a long save never trips it.

When it fires, each process writes where it was (its last phase: data, step, collective, ...,
and the last step it completed) to `<workdir>/hang/process_N.json` (the workdir is shared by
the run's processes), waits a little for the others' files, prints one line naming every
process's phase, and leaves with `EXIT_HUNG` (not preemption's 75). The newest complete
checkpoint stays as it was (a save in flight is a temporary directory a restart removes), so
rerunning the command resumes from it exactly, as after a kill. (trainer/multihost/launch.py's
`Watchdog` is the other kind: a deadline on one blocking call at start-up.)
"""
from __future__ import annotations

import contextlib
import glob
import json
import os
import socket
import sys
import threading
import time

import jax
import numpy as np

EXIT_HUNG = 5
AUTO_STEPS, AUTO_FLOOR_S, FIRST_S = 20, 60.0, 600.0
GATHER_S = 10.0  # the longest a firing process waits for the other processes' phases


def timeout_for(configured: float, step_times: list[float], started: bool = True
                ) -> float | None:
  """Seconds without a completed step before the watchdog fires; None: off. Until this start
  has completed a step, at least `FIRST_S`: the other processes may still be compiling the
  first step while this one waits for them in its first collective."""
  if configured < 0:
    return None
  if not started:
    return max(configured, FIRST_S)
  if configured > 0:
    return configured
  if not step_times:
    return FIRST_S
  return max(AUTO_FLOOR_S, AUTO_STEPS * float(np.median(step_times)))


class HangWatchdog:
  """Watches `timer` (trainer/tracking/goodput.py `StepTimer`) from a thread (module docstring).
  `on_fire(line)` runs before the exit (the goodput event of the stop); `newest()` names the
  newest complete checkpoint."""

  def __init__(self, timer, configured: float, workdir: str, *, process: int, processes: int,
               host: str, newest=lambda: None, on_fire=lambda line: None, exit=None):
    self.timer, self.configured = timer, configured
    self.dir = os.path.join(workdir, "hang")
    self.process, self.processes, self.host = process, processes, host
    self.newest, self.on_fire, self._exit = newest, on_fire, exit
    self._stop = threading.Event()
    self._thread = threading.Thread(target=self._watch, name="hang-watchdog", daemon=True)

  def start(self) -> "HangWatchdog":
    self.started = time.time()  # phases written before are an earlier start's
    if self.configured >= 0:
      self._thread.start()
    return self

  def stop(self) -> None:
    self._stop.set()

  def timeout(self) -> float | None:
    return timeout_for(self.configured, list(self.timer.step_times), self.timer.completed > 0)

  def _watch(self) -> None:
    while not self._stop.is_set():
      timeout = self.timeout()
      # a compile here since the last step: the others may take as long again for theirs
      if self.timer.idle() > timeout + 2 * self.timer.compiling:
        self.fire(timeout)
        return
      self._stop.wait(min(0.5, timeout / 10))

  def fire(self, timeout: float) -> None:
    """Say where every process was, in one line, and leave with EXIT_HUNG."""
    t = self.timer
    mine = {"process": self.process, "host": self.host, "phase": t.phase, "step": t.completed,
            "time": time.time()}
    os.makedirs(self.dir, exist_ok=True)
    path = os.path.join(self.dir, f"process_{self.process}.json")
    with open(path + ".tmp", "w") as f:
      json.dump(mine, f)
    os.replace(path + ".tmp", path)
    deadline = time.monotonic() + GATHER_S
    while True:
      found = self._read(self.started)
      if len(found) == self.processes or time.monotonic() > deadline:
        break
      time.sleep(0.1)
    if self.process == 0:  # the others leave first: the coordinator's exit would abort them
      time.sleep(1.0)
    where = ", ".join(
        f"process {p} (host {found[p]['host']}) in {found[p]['phase']} after step "
        f"{found[p]['step']}" if p in found else f"process {p}: not known (it wrote no phase)"
        for p in range(self.processes))
    newest = self.newest()
    line = (f"hang: no step completed within {timeout:.1f}s (trainer.hang_timeout_s): {where}; "
            f"exit {EXIT_HUNG}: rerun the command to resume from "
            + (f"checkpoint {newest}" if newest is not None else "the start (no checkpoint yet)"))
    try:
      self.on_fire(line)
    finally:
      print(f"error: {line}", file=sys.stderr, flush=True)
      sys.stdout.flush()
      (self._exit or os._exit)(EXIT_HUNG)  # the main thread is blocked: nothing else ends it

  def _read(self, since: float) -> dict[int, dict]:
    """The phases the run's processes wrote since `since` (older files: an earlier start's)."""
    out = {}
    for path in glob.glob(os.path.join(self.dir, "process_*.json")):
      try:
        with open(path) as f:
          entry = json.load(f)
      except (OSError, ValueError):
        continue
      if entry.get("time", 0) >= since:
        out[int(entry["process"])] = entry
    return out


@contextlib.contextmanager
def watching(timer, configured: float, workdir: str, newest, events):
  """A run's watchdog over the block, on this process; when it fires, the lead's goodput
  `events` get the run's stop (status "hung")."""
  fired = lambda line: events("stop", status="hung", step=timer.completed, message=line)
  dog = HangWatchdog(timer, configured, workdir, process=jax.process_index(),
                     processes=jax.process_count(), host=socket.gethostname(), newest=newest,
                     on_fire=fired).start()
  try:
    yield dog
  finally:
    dog.stop()

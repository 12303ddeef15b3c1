"""Where a run's time goes: the timing columns of its log rows (`StepTimer`: step_time,
data_wait_ms, tokens_per_sec, mfu) and the goodput events of every start, appended to
goodput.jsonl (`Events`, read by `python -m tools.goodput WORKDIR`); `repair_jsonl` drops the
partial last line a killed process left in metrics.jsonl.
"""
from __future__ import annotations

import collections
import contextlib
import json
import os
import time


class StepTimer:
  """Wall time per step over the window since the last log, excluding saves and evals, and the
  part of it the loop spent waiting for input (`data_wait_ms`: taking this step's micro-batches
  from the pipeline and assembling the global arrays). While the device is busy with the
  previous step, that wait is hidden; a `data_wait_ms` close to `step_time` means the input
  pipeline is the bottleneck.

  It also keeps what the straggler report (trainer/tracking/straggler.py) and the hang watchdog
  (trainer/run/watchdog.py) read: the window's seconds per part (`parts`: compute, the host's
  work on a step before the step's collectives can start on this process; data; save, how long
  checkpoint saves blocked the loop), the loop's `phase` (data, step, collective, save, eval,
  compile) and the clock of progress (`idle()`: seconds since the last step completed, less the
  time paused since)."""

  def __init__(self):
    self.start = time.perf_counter()
    self.steps = 0
    self.excluded = 0.0
    self.data_wait = 0.0
    self.compute = 0.0
    self.save = 0.0
    self.phase = "step"
    self.completed, self.completed_at = 0, time.monotonic()
    self.step_times = collections.deque(maxlen=50)  # recent steps' idle() at their completion
    self.compiling = 0.0  # seconds compiling since the last step completed
    self._paused_total, self._paused_since, self._paused_at_completion = 0.0, None, 0.0

  def step_dispatched(self):
    self.steps += 1

  def step_completed(self, step: int) -> None:
    """Step `step` finished on the device (the loop waited for it)."""
    if self.completed and step > self.completed:
      self.step_times.append(self.idle() / (step - self.completed))
    self.completed, self.completed_at, self.compiling = step, time.monotonic(), 0.0
    self._paused_at_completion = self._paused_now()

  def idle(self) -> float:
    """Seconds since the last step completed, not counting paused time (compiles, saves,
    evaluations)."""
    return time.monotonic() - self.completed_at - (self._paused_now()
                                                   - self._paused_at_completion)

  def clock(self) -> float:
    """A monotonic clock that stands still while paused (compiles, saves, evaluations)."""
    return time.monotonic() - self._paused_now()

  def _paused_now(self) -> float:
    since = self._paused_since
    return self._paused_total + (0.0 if since is None else time.monotonic() - since)

  @contextlib.contextmanager
  def paused(self, phase: str = "compile"):
    """Time that is not step time (`phase`: compile, save, eval); a save's is counted apart."""
    outer = self._paused_since is None
    if outer:
      self._paused_since = time.monotonic()
    try:
      with self._adding_to("excluded", phase), self._adding_to("save" if phase == "save" else
                                                               None, phase):
        yield
    finally:
      if outer:
        seconds = time.monotonic() - self._paused_since
        self._paused_total += seconds
        self.compiling += seconds if phase == "compile" else 0.0
        self._paused_since = None

  def waiting_for_data(self):
    return self._adding_to("data_wait", "data")

  def computing(self):
    """The host's part of a step: this process's work before the step's collectives can start."""
    return self._adding_to("compute", "step")

  def waiting_for_others(self):
    """Waiting on the devices, where every process's part of a collective meets."""
    return self._adding_to(None, "collective")

  @contextlib.contextmanager
  def _adding_to(self, total: str | None, phase: str):
    t, before, self.phase = time.perf_counter(), self.phase, phase
    try:
      yield
    finally:
      self.phase = before
      if total is not None:
        setattr(self, total, getattr(self, total) + time.perf_counter() - t)

  def annotate(self, host: dict, tokens_per_step: int, flops_token: float, peak: float) -> dict:
    """Fill in the timing columns of the window since the last call, and start a new one. The
    window's totals stay in `window`: (steps, step seconds, of which waiting for data), and its
    seconds per step by part in `parts` (compute, data, save)."""
    now = time.perf_counter()
    steps = max(self.steps, 1)
    self.window = (self.steps, max(now - self.start - self.excluded, 0.0), self.data_wait)
    self.parts = (self.compute / steps, self.data_wait / steps, self.save / steps)
    seconds = max(now - self.start - self.excluded, 1e-9) / steps
    host["step_time"] = seconds
    host["data_wait_ms"] = 1e3 * self.data_wait / steps
    host["tokens_per_sec"] = tokens_per_step / seconds
    host["mfu"] = host["tokens_per_sec"] * flops_token / peak
    self.start, self.steps, self.excluded, self.data_wait = now, 0, 0.0, 0.0
    self.compute = self.save = 0.0
    return host


def process_start_time(pid: int | str = "self") -> float | None:
  """When process `pid` (this one by default) started (wall clock, from /proc); now for this
  process and None for another where /proc cannot say (no such process)."""
  try:
    with open(f"/proc/{pid}/stat") as f:
      ticks = int(f.read().rsplit(")", 1)[1].split()[19])  # field 22, starttime after boot
    with open("/proc/uptime") as f:
      uptime = float(f.read().split()[0])
    return time.time() - (uptime - ticks / os.sysconf("SC_CLK_TCK"))
  except (OSError, ValueError, IndexError):
    return time.time() if pid == "self" else None


class Events:
  """The run's goodput events, appended to `<workdir>/goodput.jsonl` by the lead process: one
  JSON line per event, each with its wall-clock `time`, written and flushed as it happens (a
  killed process loses nothing it wrote). What the loop records (trainer/run/loop.py):

    start       {process_start, processes, devices, pid, host}: a process of the run began (each
                restart); `tools.goodput` asks whether that process still runs
    restore     {seconds, step, tier, source}: the checkpoint it resumed from (step null: fresh)
    compile     {seconds, what}: a train step (or DiLoCo outer step) compiled
    first_step  {step}: the first step of this start was dispatched
    steps       {first, last, seconds, data_wait}: the step time of a window of steps between
                two log rows (saves, evaluations and compiles excluded; read with the metrics the
                loop reads anyway, so recording costs no device sync), and the part of it spent
                waiting for input
    checkpoint  {step, tier, seconds}: how long a save blocked the loop
    eval        {step, seconds}
    stop        {status, step, message}: how this start ended (a killed process writes none)

  `python -m tools.goodput WORKDIR` turns them into goodput and where the rest of the time went.
  """

  def __init__(self, workdir: str, enabled: bool):
    self.path = os.path.join(workdir, "goodput.jsonl")
    self._file = None
    if enabled:
      repair_jsonl(self.path)
      self._file = open(self.path, "a")

  def __call__(self, event: str, **fields) -> None:
    if self._file is not None:
      self._file.write(json.dumps({"event": event, "time": time.time(), **fields}) + "\n")
      self._file.flush()

  def close(self) -> None:
    if self._file is not None:
      self._file.close()
      self._file = None


def repair_jsonl(path: str) -> None:
  """Drop a partial last line left by a process killed mid-write."""
  if not os.path.exists(path):
    return
  with open(path, "rb+") as f:
    data = f.read()
    if data and not data.endswith(b"\n"):
      f.truncate(data.rfind(b"\n") + 1)

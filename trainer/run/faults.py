"""Faults injected for tests and drills (`trainer.fault`, off by default; one line at the start
when on), beside the kills the reliability tests send from outside:

  slow:PROCESS:FACTOR  that process sleeps before each step for (FACTOR - 1) x the median of its
                       own recent step times without the sleep, so its steps take FACTOR x as
                       long (a throttled host, a noisy neighbour): the straggler report
                       (trainer/tracking/straggler.py) must name it
  hang:PROCESS:STEP    that process blocks for good before step STEP (a deadlock, a stuck driver):
                       the hang watchdog (trainer/run/watchdog.py) must end the run

Nothing else in the run changes: the steps' results are the same as without the fault.
"""
from __future__ import annotations

import collections
import threading
import time

import numpy as np

from trainer.config.defaults import parse_fault


class Fault:
  """`trainer.fault` on process `process` (the loop calls `before_step` before each step);
  `log(line)`: where the start's line goes."""

  def __init__(self, spec: str, process: int, log=None):
    self.spec = spec
    self.kind, self.process, self.value = parse_fault(spec) or (None, -1, 0.0)
    self.here = self.kind is not None and self.process == process
    self._last = None  # when the previous step started, and what it slept
    self._slept = 0.0
    self._natural = collections.deque(maxlen=20)  # recent step times without the sleep
    if log is not None and self.describe():
      log(self.describe())  # the start's line

  def describe(self) -> str | None:
    """The start's line, or None when off."""
    if self.kind is None:
      return None
    what = (f"process {self.process} sleeps to make its steps {self.value:g}x slower"
            if self.kind == "slow" else
            f"process {self.process} blocks for good before step {int(self.value)}")
    return f"fault injection on (trainer.fault={self.spec!r}): {what}"

  def before_step(self, step: int, clock=time.monotonic) -> None:
    """Before step `step` (1-based) is dispatched on this process; `clock`: one that stands
    still during compiles, saves and evaluations (`StepTimer.clock`)."""
    if not self.here:
      return
    if self.kind == "hang" and step == int(self.value):
      threading.Event().wait()  # for good: the watchdog ends the process
    if self.kind == "slow":
      now = clock()
      if self._last is not None:
        self._natural.append(now - self._last - self._slept)
      self._last, self._slept = now, 0.0  # (the sleep below runs on `clock` too)
      if len(self._natural) >= 2:
        self._slept = (self.value - 1) * float(np.median(self._natural))
        time.sleep(self._slept)

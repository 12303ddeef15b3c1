"""The compiled train steps of a run, one per variant it meets (`CompiledSteps`): a number of
micro-batches (a batch ramp's stage or the autopilot's batch), measuring the gradient noise scale
or not, computing the norm metrics of a log step or not. Each is compiled on first use and kept;
each compilation is a goodput event, and a pipelined run prints its counted bubble for the first
step compiled at each number of micro-batches (`trainer/tracking/report.py`)."""
from __future__ import annotations

import time

from trainer.tracking.report import log_pipeline


class CompiledSteps:
  """`program`: trainer/step/program.py's `Program`; `events`: the run's goodput events."""

  def __init__(self, program, events):
    self.program, self.events = program, events
    self.compiled: dict = {}  # (micro-batches, measures noise, computes norms) -> compiled step
    self.count = 0
    self._pipeline_logged: set = set()

  def key(self, num_micro: int, measure_noise: bool, logs: bool) -> tuple:
    """A step that logs shares the other steps' program unless it computes more."""
    return num_micro, measure_noise, self.program.computes_norms(logs)

  def __contains__(self, key: tuple) -> bool:
    return self.key(*key) in self.compiled

  def get(self, num_micro: int, measure_noise: bool = False, logs: bool = False):
    """The compiled train step of this variant (compiled now if it is new)."""
    key = self.key(num_micro, measure_noise, logs)
    if key not in self.compiled:
      t = time.perf_counter()
      self.compiled[key] = self.program.compile(num_micro, measure_noise=measure_noise, logs=logs)
      self.count += 1
      self.events("compile", seconds=time.perf_counter() - t,
                  what=f"train step, {num_micro} micro-batch(es)"
                  + (", noise scale" if measure_noise else "") + (", log" if logs else ""))
    return self.compiled[key]

  def log_pipeline(self, writer, num_micro: int, step: int) -> None:
    """A pipelined run's line for the first step compiled for `num_micro` micro-batches."""
    if self.program.pipeline is None or num_micro in self._pipeline_logged:
      return
    compiled = next((c for (m, noise, _), c in self.compiled.items()
                     if m == num_micro and not noise), None)
    if compiled is not None:
      self._pipeline_logged.add(num_micro)
      log_pipeline(writer, self.program, compiled, num_micro, step)

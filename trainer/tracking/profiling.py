"""A `jax.profiler` trace of a window of training steps (`trainer.profile_steps="A:B"`).

The trace starts just before step A is dispatched and stops after step B's outputs are ready
(it blocks on them, so the trace holds the whole of step B's device work). Files go to
`<workdir>/profile/plugins/profile/<timestamp>/` (`*.xplane.pb`, plus a Perfetto trace), which
`tensorboard --logdir <workdir>/profile` (Profile tab) and ui.perfetto.dev open. Steps are
1-based optimizer steps, the numbers in metrics.jsonl; every process traces the same window
(a decision from step counts only), each writing its own host's files.
"""
from __future__ import annotations

import os
from collections.abc import Callable

import jax

from trainer.config.defaults import parse_window


class ProfileWindow:
  """Call `before_step(n)` before dispatching step n and `after_step(n, outputs)` after it;
  `close()` when the run ends (stops a trace the run ended inside)."""

  def __init__(self, spec: str, workdir: str, *, log: Callable[[str], None] = print,
               create_perfetto_trace: bool = True):
    self.window = parse_window(spec)
    self.directory = os.path.join(os.path.abspath(workdir), "profile")
    self.log = log
    self.perfetto = create_perfetto_trace
    self.active = False
    self.done = False

  def before_step(self, step: int) -> None:
    if self.window is None or self.active or self.done:
      return
    first, last = self.window
    if first <= step <= last:  # also a run resumed inside the window: trace what remains
      os.makedirs(self.directory, exist_ok=True)
      jax.profiler.start_trace(self.directory, create_perfetto_trace=self.perfetto)
      self.active = True
      self.log(f"profiling steps {step}..{last} into {self.directory}")

  def after_step(self, step: int, outputs=None) -> None:
    if self.active and step >= self.window[1]:
      self._stop(outputs)

  def close(self) -> None:
    if self.active:
      self._stop(None)

  def _stop(self, outputs) -> None:
    if outputs is not None:
      jax.block_until_ready(outputs)
    jax.profiler.stop_trace()
    self.active = False
    self.done = True
    self.log(f"profile written to {self.directory} (tensorboard --logdir {self.directory})")

"""When a run logs, evaluates, checkpoints and stops (`Decider`): decided in one place, the same
on every process, since a save, an evaluation or a stop leads into collectives.

  step counts   log_every, eval_every, checkpoint.every_steps and local_every_steps, the last
                step, DiLoCo's outer steps: the same on every process by construction
  stop signals  SIGTERM / SIGINT (`StopSignals`), read after every step; with several processes
                through JAX's preemption sync service, so that all stop after the same step
  the clock     checkpoint.every_seconds: with several processes read at log steps and agreed
                (any process due: all save)

Metrics are read back only where a decision needs them (trainer/run/readback.py). Why and
details: docs/multihost.md#decisions-the-same-on-every-process.
"""
from __future__ import annotations

import dataclasses
import os
import signal
import sys
import time

import jax
from jax.experimental import multihost_utils

from optim.diloco import DiLoCoConfig
from trainer.multihost.agreement import agree_any


EXIT_INTERRUPTED = 130  # 128 + SIGINT, as a shell reports a Ctrl-C
INTERRUPTED = ("interrupted: stopped at once, without saving; rerun the command to resume from "
               "the newest checkpoint")


def interrupted_exit() -> None:
  """Leave the process now, in one line. Not by raising KeyboardInterrupt from the handler: it
  would surface wherever the main thread is, and where that is a callback whose exceptions
  Python ignores (a garbage-collection hook, a finaliser) it is printed as a traceback and lost,
  and the run goes on. The newest complete checkpoint is untouched (an interrupted save is a
  temporary directory a restart ignores)."""
  sys.stdout.flush()
  print(INTERRUPTED, file=sys.stderr, flush=True)
  os._exit(EXIT_INTERRUPTED)


class StopSignals:
  """SIGTERM / SIGINT ask the run to stop after the current step.

  One process: a Python handler sets `received`. Several processes: SIGTERM is left to JAX's
  preemption notifier (installed by `jax.distributed.initialize`), and SIGINT raises SIGTERM so
  that it takes the same agreed path; `received` then stays None (see `Decider`)."""

  def __init__(self, multi_process: bool = False):
    self.multi_process = multi_process
    self.received: str | None = None
    self._previous = {}

  def __enter__(self):
    signals = (signal.SIGINT,) if self.multi_process else (signal.SIGTERM, signal.SIGINT)
    for sig in signals:
      self._previous[sig] = signal.signal(sig, self._handle)
    return self

  def _handle(self, signum, frame):
    if self.received is not None and signum == signal.SIGINT:
      interrupted_exit()  # a second Ctrl-C stops at once
    self.received = signal.Signals(signum).name
    if self.multi_process:
      signal.raise_signal(signal.SIGTERM)  # JAX's notifier tells every process

  def __exit__(self, *exc):
    for sig, handler in self._previous.items():
      signal.signal(sig, handler)
    return False



@dataclasses.dataclass(frozen=True)
class Decision:
  """What to do after a step. `read`: read metrics back now (before a save, an evaluation or a
  stop, so that a bad step is never checkpointed or evaluated); `log` alone is read one step
  later, while the next step runs."""
  log: bool = False
  save: bool = False
  local_save: bool = False  # a save to the local tier (a persistent save due supersedes it)
  evaluate: bool = False
  final: bool = False
  preempted: str | None = None  # the reason, when a stop signal ends the run
  outer: bool = False  # a DiLoCo run's outer step follows this step (before any save or eval)

  @property
  def read(self) -> bool:
    return self.save or self.local_save or self.evaluate or self.preempted is not None


class Decider:
  """Decides after each step whether to log, evaluate, save or stop (see the module docstring)."""

  def __init__(self, cfg, signals: StopSignals, *, start: int, evaluating: bool):
    self.steps = cfg.steps
    self.log_every = cfg.log_every
    self.eval_every = cfg.eval_every if evaluating else 0
    self.noise_every = cfg.optim.noise_scale_every
    self.diloco = DiLoCoConfig.from_config(cfg.optim)
    self.save_every = cfg.checkpoint.every_steps
    self.local_every = cfg.checkpoint.local_every_steps
    self.save_seconds = cfg.checkpoint.every_seconds
    self.signals = signals
    self.multi_process = jax.process_count() > 1
    self.last_save = time.monotonic()
    if self.multi_process:
      # Every process registers its step before the first one runs, so that a notice arriving
      # now (e.g. while compiling) syncs at start + 1. Raises if the preemption service is off.
      multihost_utils.reached_preemption_sync_point(start)

  def measures_noise(self, step: int) -> bool:
    """Whether the step that ends at `step` (1-based) measures the gradient noise scale."""
    return bool(self.noise_every) and step % self.noise_every == 0

  def logs(self, step: int) -> bool:
    """Whether the step that ends at `step` (1-based) writes its metrics row (known before it
    runs: the loop picks that step's compiled variant by it). A row carries the noise meter's
    value whether or not its step measured."""
    return step % self.log_every == 0 or step == self.steps

  def saved(self) -> None:
    self.last_save = time.monotonic()

  def _preempted(self, step: int) -> str | None:
    if self.multi_process:
      if multihost_utils.reached_preemption_sync_point(step):
        return "preemption notice (SIGTERM or SIGINT on one of the processes)"
      return None
    return f"{self.signals.received} received" if self.signals.received else None

  def after(self, step: int) -> Decision:
    final = step == self.steps
    log = self.logs(step)
    due_time = False
    if self.save_seconds and (log or not self.multi_process):
      due_time = time.monotonic() - self.last_save >= self.save_seconds
      if self.multi_process:
        due_time = agree_any(due_time)
    preempted = self._preempted(step)
    save = (bool(self.save_every) and step % self.save_every == 0) or due_time or final
    evaluate = bool(self.eval_every) and (step % self.eval_every == 0 or final)
    outer = self.diloco is not None and self.diloco.is_outer_step(step)
    save = save or preempted is not None
    local = bool(self.local_every) and step % self.local_every == 0 and not save
    return Decision(log=log, save=save, local_save=local, evaluate=evaluate, final=final,
                    preempted=preempted, outer=outer)



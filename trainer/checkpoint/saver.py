"""The training loop's checkpoint saves to both tiers, and when a save counts as written (`Saver`).

A save hands the state, the data position, the config, the batch autopilot's decisions and the
topology to the persistent tier (trainer/checkpoint/persistent.py) or the local one
(trainer/checkpoint/local_tier.py), asynchronously unless it blocks (the final save, a
preemption's). A persistent save that cannot fit is refused before it starts; one that fails is
one line on stderr naming its step and cause, its partial directory removed, found at the next
save or, for a background write, at the first log step after it ended (`poll`); with several
processes it counts as written only if every process wrote it. Local saves are best effort: a
failure is said by its process and the run goes on. Why: docs/reliability.md#the-persistent-tier.
"""
from __future__ import annotations

import errno
import glob
import logging
import os
import shutil
import sys
import time
import traceback

import jax
from jax.experimental import multihost_utils

from data import pipeline
from trainer.checkpoint.integrity import NonFiniteState, checkpoint_bytes
from trainer.checkpoint.local_tier import LocalSaveSkipped, LocalTier
from trainer.checkpoint.persistent import Checkpointer
from trainer.errors import first_line
from trainer.multihost.agreement import agree_all, agree_any

ORBAX_TMP = "*.orbax-checkpoint-tmp*"  # where Orbax writes a checkpoint until it is complete


class NoSpace(OSError):
  """The checkpoint directory has less free space than the checkpoint needs."""

  def __init__(self, message: str):
    super().__init__(errno.ENOSPC, message)

  def __str__(self) -> str:
    return self.strerror


def check_space(directory: str, step: int, previous: int | None) -> None:
  """Raise NoSpace if `directory`'s filesystem has less room than checkpoint `previous` (the
  newest complete one: a save of the same state writes about as much; Orbax compresses the
  arrays, so the state's size would overstate it) takes. No check before the first save."""
  if previous is None:
    return
  try:
    free = shutil.disk_usage(directory).free
    needed = checkpoint_bytes(os.path.join(directory, str(previous)))
  except OSError:
    return  # not a filesystem we can ask: the write itself will tell
  if free < needed:
    raise NoSpace(f"no space left on device: the checkpoint of step {step} needs about "
                  f"{needed / 2**20:.2f} MiB (as checkpoint {previous}), {free / 2**20:.2f} MiB "
                  f"are free in {directory}")


def describe(error: BaseException, directory: str) -> str:
  """The cause of a failed save, in a few words."""
  if isinstance(error, (NoSpace, NonFiniteState)):
    return str(error)
  if getattr(error, "errno", None) == errno.ENOSPC or "No space left on device" in str(error):
    return f"no space left on device in {directory}"
  return first_line(error)


def remove_partial(directory: str) -> list[str]:
  """Remove the temporary directories of checkpoints that were never completed."""
  removed = []
  for path in sorted(glob.glob(os.path.join(directory, ORBAX_TMP))):
    shutil.rmtree(path, ignore_errors=True)
    removed.append(os.path.basename(path))
  return removed


class _OrbaxErrorLogs(logging.Filter):
  """Drops Orbax's ERROR records: the failures they describe reach the Saver as exceptions.
  Also asyncio's "Task exception was never retrieved" of a task of Orbax's (a write of a failed
  save whose error Orbax raised once and left in its other tasks, logged with its traceback when
  the task is collected); asyncio's records about anything else pass."""

  def filter(self, record: logging.LogRecord) -> bool:
    if record.levelno < logging.ERROR:
      return True
    if record.name == "asyncio":
      tb = record.exc_info[2] if record.exc_info else None
      files = [frame.f_code.co_filename for frame, _ in traceback.walk_tb(tb)]
      return not ("/orbax/" in record.getMessage() or any("/orbax/" in f for f in files))
    return "orbax" not in record.pathname


_FILTER = _OrbaxErrorLogs()


def _quiet_unraisable(previous):
  def hook(unraisable):
    value = unraisable.exc_value
    if isinstance(value, RuntimeError) and str(value) == "Event loop is closed":
      return  # tensorstore completing a write of a failed save after Orbax closed its loop
    previous(unraisable)
  hook.scaletrain_quiet = True
  return hook


def silence_orbax_failures() -> None:
  """Install the filters (once per process)."""
  for logger in (logging.getLogger("absl"), logging.getLogger("asyncio")):
    if _FILTER not in logger.filters:
      logger.addFilter(_FILTER)
  if not getattr(sys.unraisablehook, "scaletrain_quiet", False):
    sys.unraisablehook = _quiet_unraisable(sys.unraisablehook)


class Saver:
  """Starts checkpoints of both tiers (module docstring). `topology()`: the topology item of a
  save now; `events`: the run's goodput events (`trainer.tracking.goodput.Events`)."""

  def __init__(self, checkpointer: Checkpointer, data_spec, config: dict, timer, decider, log,
               autopilot=None, *, local: LocalTier | None = None, topology=dict,
               events=lambda *a, **k: None, to_saved=lambda state: state, run=None, warn=None):
    """`to_saved(state)`: the state as a checkpoint of either tier holds it (a circular
    pipeline's layer stack in the plain order, trainer/step/pipelined.py); `run`: the run's
    identity, in every persistent checkpoint (the local tier has its own); `warn(line, here=)`:
    where the lines of failed saves go (stderr; with `here`, a local save's, said by the process
    it failed on; `log` if None)."""
    self.checkpointer, self.data_spec, self.config = checkpointer, data_spec, config
    self.timer, self.decider, self.log = timer, decider, log
    self.warn = warn or (lambda line, here=False: log(line))
    self.autopilot, self.local, self.topology, self.events = autopilot, local, topology, events
    self.to_saved, self.run = to_saved, run
    self.failing = False
    self.nonfinite = None  # (status, message) once a save found the state not finite
    self.local_failing = None  # (first step not written, saves not written, why) in a streak
    self.local_last = None  # the last local step started
    self.last_step = None  # the last persistent step started
    self.unconfirmed = False  # whether its background write may still fail (`poll`)
    silence_orbax_failures()

  def __call__(self, step: int, state, train_iter, *, blocking: bool = False,
               finite: bool | None = None) -> bool:
    """A persistent save at `step` (every process, the same step); `finite`: whether the
    parameters are, where the loop read it back (else the save computes it). False if it failed."""
    ckpt = self.checkpointer
    t = time.perf_counter()
    with self.timer.paused("save"):
      failed_step, error = step, None
      try:
        failed_step = self.last_step  # the background write of the previous save may fail
        ckpt.wait()
        failed_step = step
        check_space(ckpt.directory, step, (ckpt.all_steps() or [None])[-1])
        ckpt.save(step, self.to_saved(state), train_iter, self.data_spec, self.config,
                  autopilot=self._autopilot(), topology=self.topology(), run=self.run,
                  finite=finite)
        self.last_step, self.unconfirmed = step, True
        if blocking:
          ckpt.wait()
      except Exception as e:  # noqa: BLE001  storage errors of any kind
        error = e
      failed = agree_any(error is not None)
      if failed:
        self._failed(failed_step or step, error)
    self.events("checkpoint", step=step, tier="persistent", seconds=time.perf_counter() - t,
                ok=not failed)
    if failed:
      return False
    if self.failing:
      self.log(f"checkpoint save at step {step} succeeded again")
    self.failing = False
    self.decider.saved()
    return True

  def poll(self) -> bool:
    """At a log step: whether the background write of the last persistent save has failed,
    found now rather than at the next save (said like one). Every process takes part while
    that write is unconfirmed (the same steps on all: a decision that leads into a collective)."""
    if not self.unconfirmed:
      return False
    ckpt, error = self.checkpointer, None
    done = not ckpt.manager.is_saving_in_progress()
    if done:
      try:
        ckpt.wait()  # returns at once: the write is over; raises its error
      except Exception as e:  # noqa: BLE001  storage errors of any kind
        error = e
    if agree_any(error is not None):
      with self.timer.paused("save"):
        self._failed(self.last_step, error)
      return True
    self.unconfirmed = not agree_all(done)
    return False

  def _failed(self, step: int, error: Exception | None) -> None:
    """A persistent save failed (on this process: `error`; None: on another): remove its partial
    directory and say so in one line, once per streak of failures."""
    removed = self._discard_partial()
    self.unconfirmed = False
    ckpt = self.checkpointer
    good = [s for s in ckpt.all_steps() if s < step]
    if isinstance(error, NonFiniteState):
      self.nonfinite = ("nonfinite", f"stopped: the parameters at step {step} are not finite, "
                        "so they were not saved; the newest checkpoint ("
                        f"{good[-1] if good else 'none'}) is the last good state")
    if not self.failing:
      reason = describe(error, ckpt.directory) if error is not None else \
          "failed on another process"
      self.warn(f"checkpoint save at step {step} failed ({reason}); "
                + (f"removed its partial {', '.join(removed)}; " if removed else "")
                + f"earlier checkpoints are untouched (newest: {good[-1] if good else 'none'})")
    self.failing = True

  def _discard_partial(self) -> list[str]:
    """After a failed save: once no process is writing any more, process 0 removes the partial
    checkpoint directories (the directory is shared). Returns their names."""
    try:
      self.checkpointer.wait()
    except Exception:  # noqa: BLE001  (the failure is being reported)
      pass
    if jax.process_count() > 1:
      multihost_utils.sync_global_devices("scaletrain: failed checkpoint save")
    return remove_partial(self.checkpointer.directory) if jax.process_index() == 0 else []

  def to_local(self, step: int, state, train_iter, finite: bool | None = None) -> bool:
    """Start a save to the local tier (every process, the same step). Never stops the run.
    An error of an earlier local write is said, never raised before this save: its peer copy
    is a collective every process must enter (whether a local step counts is agreed when it is
    restored)."""
    t = time.perf_counter()
    error = None
    with self.timer.paused("save"):
      earlier = self.local.finish_previous()  # the previous local step, if it failed
      try:
        meta = {"config": self.config, "autopilot": self._autopilot(),
                "topology": self.topology(),
                "data": pipeline.saved_state(train_iter.get_state(), self.data_spec)}
        self.local.save(step, self.to_saved(state), meta, finite=finite)
      except Exception as e:  # noqa: BLE001  full disk, storage errors: the next save retries
        error = e
    self.events("checkpoint", step=step, tier="local", seconds=time.perf_counter() - t,
                ok=error is None)
    if earlier is not None:
      self._local_failed(self.local_last, earlier)
    self.local_last = step
    if error is not None:
      self._local_failed(step, error)
      return False
    if self.local_failing and earlier is None:
      self.warn(f"local checkpoint at step {step} written again", here=True)
      self.local_failing = None
    return True

  def _local_failed(self, step: int | None, error: Exception) -> None:
    reason = str(error) if isinstance(error, (LocalSaveSkipped, NonFiniteState)) else \
        first_line(error)
    if not self.local_failing:
      self.warn(f"local checkpoint at step {step} not written ({reason}); training goes on, "
                "and the next local save tries again", here=True)
      self.local_failing = (step, 0, reason)
    first, count, _ = self.local_failing
    self.local_failing = (first, count + 1, reason)

  def summary(self) -> str | None:
    """At the end of a run: the line that says local saves stopped working, if they did."""
    if not self.local_failing:
      return None
    first, count, reason = self.local_failing
    return (f"local checkpoints failed from step {first} on: {count} local save(s) not written, "
            f"the last because {reason}")

  def _autopilot(self) -> dict | None:
    return None if self.autopilot is None else self.autopilot.state_dict()

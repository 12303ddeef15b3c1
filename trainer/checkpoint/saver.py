"""The training loop's checkpoint saves to both tiers, and when a save counts as written (`Saver`).

A save hands the state, the data position, the config, the batch autopilot's decisions and the
topology to the persistent tier (trainer/checkpoint/persistent.py) or the local one
(trainer/checkpoint/local_tier.py), asynchronously unless it blocks (the final save, a
preemption's). A persistent save that cannot fit is refused before it starts; one that fails is
one line naming its step and cause, its partial directory removed; with several processes it
counts as written only if every process wrote it. Local saves are best effort: a failure is
logged and the run goes on. Why and details: docs/reliability.md#the-persistent-tier.
"""
from __future__ import annotations

import errno
import glob
import logging
import os
import shutil
import sys
import time

import jax
from jax.experimental import multihost_utils

from data import pipeline
from trainer.checkpoint.integrity import NonFiniteState
from trainer.checkpoint.local_tier import LocalSaveSkipped, LocalTier
from trainer.checkpoint.persistent import Checkpointer
from trainer.errors import first_line
from trainer.multihost.agreement import agree_any

ORBAX_TMP = "*.orbax-checkpoint-tmp*"  # where Orbax writes a checkpoint until it is complete


class NoSpace(OSError):
  """The checkpoint directory has less free space than the checkpoint needs."""

  def __init__(self, message: str):
    super().__init__(errno.ENOSPC, message)

  def __str__(self) -> str:
    return self.strerror


def checkpoint_bytes(step_dir: str) -> int:
  """Bytes of the files of one checkpoint (their sizes, not the blocks they occupy)."""
  return sum(os.path.getsize(os.path.join(root, name))
             for root, _, names in os.walk(step_dir) for name in names)


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
  """Drops Orbax's ERROR records: the failures they describe reach the Saver as exceptions."""

  def filter(self, record: logging.LogRecord) -> bool:
    return not (record.levelno >= logging.ERROR and "orbax" in record.pathname)


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
  logger = logging.getLogger("absl")
  if _FILTER not in logger.filters:
    logger.addFilter(_FILTER)
  if not getattr(sys.unraisablehook, "scaletrain_quiet", False):
    sys.unraisablehook = _quiet_unraisable(sys.unraisablehook)


class Saver:
  """Starts checkpoints of both tiers (module docstring). `topology()`: the topology item of a
  save now; `events`: the run's goodput events (`trainer.tracking.goodput.Events`)."""

  def __init__(self, checkpointer: Checkpointer, data_spec, config: dict, timer, decider, log,
               autopilot=None, *, local: LocalTier | None = None, topology=dict,
               events=lambda *a, **k: None, to_saved=lambda state: state, run=None):
    """`to_saved(state)`: the state as a checkpoint of either tier holds it (a circular
    pipeline's layer stack in the plain order, trainer/step/pipelined.py); `run`: the run's
    identity, in every persistent checkpoint (the local tier has its own)."""
    self.checkpointer, self.data_spec, self.config = checkpointer, data_spec, config
    self.timer, self.decider, self.log = timer, decider, log
    self.autopilot, self.local, self.topology, self.events = autopilot, local, topology, events
    self.to_saved, self.run = to_saved, run
    self.failing = False
    self.local_failing = False
    self.last_step = None
    silence_orbax_failures()

  def __call__(self, step: int, state, train_iter, *, blocking: bool = False) -> bool:
    ckpt = self.checkpointer
    t = time.perf_counter()
    with self.timer.paused():
      failed_step, error = step, None
      try:
        failed_step = self.last_step  # the background write of the previous save may fail
        ckpt.wait()
        failed_step = step
        check_space(ckpt.directory, step, (ckpt.all_steps() or [None])[-1])
        ckpt.save(step, self.to_saved(state), train_iter, self.data_spec, self.config,
                  autopilot=self._autopilot(), topology=self.topology(), run=self.run)
        self.last_step = step
        if blocking:
          ckpt.wait()
      except Exception as e:  # noqa: BLE001  storage errors of any kind
        error = e
      failed = agree_any(error is not None)
      removed = self._discard_partial() if failed else []
    self.events("checkpoint", step=step, tier="persistent", seconds=time.perf_counter() - t,
                ok=not failed)
    if failed:
      if not self.failing:
        good = [s for s in ckpt.all_steps() if s < (failed_step or step)]
        reason = describe(error, ckpt.directory) if error is not None else \
            "failed on another process"
        self.log(f"checkpoint save at step {failed_step} failed ({reason}); "
                 + (f"removed its partial {', '.join(removed)}; " if removed else "")
                 + f"earlier checkpoints are untouched (newest: {good[-1] if good else 'none'})")
      self.failing = True
      return False
    if self.failing:
      self.log(f"checkpoint save at step {step} succeeded again")
    self.failing = False
    self.decider.saved()
    return True

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

  def to_local(self, step: int, state, train_iter) -> bool:
    """Start a save to the local tier (every process, the same step). Never stops the run."""
    t = time.perf_counter()
    error = None
    with self.timer.paused():
      try:
        self.local.check_for_errors()
        meta = {"config": self.config, "autopilot": self._autopilot(),
                "topology": self.topology(),
                "data": pipeline.saved_state(train_iter.get_state(), self.data_spec)}
        self.local.save(step, self.to_saved(state), meta)
      except Exception as e:  # noqa: BLE001  full disk, storage errors: the next save retries
        error = e
    self.events("checkpoint", step=step, tier="local", seconds=time.perf_counter() - t,
                ok=error is None)
    if error is not None:
      if not self.local_failing:
        reason = str(error) if isinstance(error, LocalSaveSkipped) else first_line(error)
        self.log(f"local checkpoint at step {step} not written ({reason}); training goes on, "
                 "and the next local save tries again")
      self.local_failing = True
      return False
    if self.local_failing:
      self.log(f"local checkpoint at step {step} written again")
    self.local_failing = False
    return True

  def _autopilot(self) -> dict | None:
    return None if self.autopilot is None else self.autopilot.state_dict()

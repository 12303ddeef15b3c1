"""The persistent checkpoint tier: Orbax checkpoints of the whole run (`Checkpointer`).

  <workdir>/checkpoints/<step>/
    state     the TrainState (tensorstore), restored into the shardings of the current mesh
    data      the grain iterator's position (JSON, one file per process)
    config    the resolved config (JSON)
    topology  the devices, mesh and batch history (trainer/checkpoint/elastic.py)
    run       the run's identity (trainer/checkpoint/identity.py); each item its checksums
  <workdir>/checkpoints.unreadable/    unreadable checkpoints, moved aside, never deleted

Saves are asynchronous and atomic (written under a temporary name, renamed when complete);
nothing is pickled. `restore_latest` takes the newest complete step of this tier or the local one
(trainer/checkpoint/local_tier.py), verified (trainer/checkpoint/integrity.py) and checked against
the config before it is read, and falls back past unreadable or damaged ones. Why and details:
docs/reliability.md#the-persistent-tier.
"""
from __future__ import annotations

import contextlib
import dataclasses
import json
import os
import shutil
import sys
import time
from collections.abc import Callable
from typing import Any

import jax
import orbax.checkpoint as ocp
from jax.experimental import multihost_utils

from data import pipeline
from trainer.checkpoint.data_state import DataStateHandler, DataStateRestore, DataStateSave, read_data_states
from trainer.checkpoint.integrity import (CheckedJson, CheckedStandard, all_finite, checksummed,
                                          finite_guard, verify_agreed)
from trainer.checkpoint.saved import CheckpointError, SavedShapes, UnreadableConfig, check_saved, read_saved_config
from trainer.errors import first_line
from trainer.multihost.agreement import agree_all, exchange


TMP_SUFFIX = ".orbax-checkpoint-tmp"  # what Orbax appends to a step being written
SAVE_SWITCH_INTERVAL = 2e-4  # seconds; see short_switch_interval
CheckedData = checksummed(DataStateHandler, DataStateSave, DataStateRestore)
NOT_FINITE = "it holds NaN or inf in its parameters or optimizer state"


def finite_state(state) -> bool:
  """Whether a restored state's parameters and optimizer state are finite (every process gets
  the same answer: the flag is one global value)."""
  return bool(all_finite((getattr(state, "params", state), getattr(state, "opt_state", None))))


def _use_replica_parallel_only_across_hosts() -> None:
  """Orbax's replica-parallel save splits each replicated array into per-replica slices with
  one eager `lax.slice` per slice, compiled per shape: seconds of compile on the first save and
  no gain when all replicas live in one process. Keep it only for multi-process runs, where
  it spreads the writes of replicated arrays over the hosts."""
  ocp.type_handlers.register_type_handler(
      jax.Array, ocp.type_handlers.ArrayHandler(use_replica_parallel=jax.process_count() > 1),
      override=True)


@contextlib.contextmanager
def short_switch_interval(seconds: float = SAVE_SWITCH_INTERVAL):
  """Python's GIL switch interval, shortened for the duration of a save's blocking part.

  Orbax starts about a dozen threads per save (commit futures, the event loop's executor, the
  finalize thread), and `Thread.start` returns only once the new thread has run: with the
  save's earlier threads (and the data prefetch thread) busy in Python, each start can wait a
  whole switch interval (5 ms by default) for the GIL. Profiled with py-spy, those waits were
  about half of an async save's blocking time; a 0.2 ms interval hands the GIL over sooner."""
  before = sys.getswitchinterval()
  sys.setswitchinterval(min(before, seconds))
  try:
    yield
  finally:
    sys.setswitchinterval(before)


class Checkpointer:

  def __init__(self, directory: str, *, keep: int, async_save: bool = True,
               log: Callable[[str], None] = print, integrity: bool = True,
               timeout_s: float = 300):
    """`integrity=False`: no checksums and no finiteness check (a save as it was before them;
    bench/checkpoint_overhead.py compares); `timeout_s`: how long a restore waits for the other
    processes to agree."""
    self.integrity = integrity
    _use_replica_parallel_only_across_hosts()
    self.directory = os.path.abspath(directory)
    self.log, self.timeout_s = log, timeout_s
    self._options = ocp.CheckpointManagerOptions(
        max_to_keep=keep, create=True, enable_async_checkpointing=async_save,
        # Create the step directory in the calling thread: an unwritable directory then fails
        # the save at once, instead of timing out a background signal minutes later.
        async_options=ocp.AsyncOptions(create_directories_asynchronously=False))
    self.handlers = {"state": CheckedStandard(), "data": CheckedData(),
                     **{k: CheckedJson() for k in ("config", "autopilot", "topology", "run")}}
    for handler in self.handlers.values():
      handler.sums = integrity
    self.manager = ocp.CheckpointManager(self.directory, options=self._options,
                                         item_handlers=self.handlers)

  def remove_interrupted(self) -> None:
    """Remove the temporary directories of saves that never committed (`<step>` + Orbax's tmp
    suffix, left by a process killed during a save: a double Ctrl-C, SIGKILL). Call only while
    no save of this directory can be in flight (the run holds its workdir's lock, before its
    first save); process 0 removes them (the directory is shared)."""
    if jax.process_index() != 0 or not os.path.isdir(self.directory):
      return
    for name in sorted(os.listdir(self.directory)):
      step, suffix, _ = name.partition(TMP_SUFFIX)
      path = os.path.join(self.directory, name)
      if suffix and step.isdigit() and os.path.isdir(path) and not os.path.islink(path):
        shutil.rmtree(path)
        self.log(f"removed {path}, left by a save that was interrupted before it completed")

  def latest_step(self) -> int | None:
    return self.manager.latest_step()

  def all_steps(self) -> list[int]:
    return sorted(self.manager.all_steps())

  # ------------------------------------------------------------------------------------------
  # Saving

  def check_for_errors(self) -> None:
    """Raise the error of an earlier background save, if one failed."""
    self.manager.check_for_errors()

  def save(self, step: int, state, data_iterator, data_spec: pipeline.StreamSpec,
           config: dict, autopilot: dict | None = None, topology: dict | None = None,
           run: dict | None = None, finite: bool | None = None) -> None:
    """Start saving (async unless configured otherwise). Raises on storage errors.
    `autopilot`: the batch autopilot's decisions (JSON, `optim/autopilot.py`), if it runs;
    `topology`: the devices, mesh and batch history (`trainer/checkpoint/elastic.py`); `run`: the
    run's identity (`trainer/checkpoint/identity.py`). A state
    whose parameters are not finite fails in its commit (`integrity.NonFiniteState`); `finite`:
    whether they are, where the caller knows (else it is computed, `integrity.finite_guard`)."""
    extra = {k: CheckedJson.Save(v) for k, v in
             (("autopilot", autopilot), ("topology", topology), ("run", run)) if v is not None}
    guard = finite_guard(self.handlers["state"], getattr(state, "params", state),
                         blocking=not self._options.enable_async_checkpointing, known=finite) \
        if self.integrity else contextlib.nullcontext()
    with short_switch_interval(), guard:
      self.manager.save(step, args=ocp.args.Composite(
          state=CheckedStandard.Save(state),
          data=CheckedData.Save(data_iterator, data_spec),
          config=CheckedJson.Save(config), **extra,
      ), force=True)

  def wait(self) -> None:
    """Block until background writes are done; raises if one failed."""
    self.manager.wait_until_finished()
    self.manager.check_for_errors()

  def close(self) -> None:
    try:
      self.manager.close()
    except Exception:  # noqa: BLE001  (errors were reported by wait(); closing must not mask them)
      pass

  # ------------------------------------------------------------------------------------------
  # Reading

  def saved_config(self, step: int) -> dict:
    """The config checkpoint `step` was written with; raises UnreadableConfig if it is missing
    or damaged (the checkpoint is then as unreadable as one with a damaged state: without its
    config nothing can check that it fits this run)."""
    return read_saved_config(os.path.join(self.directory, str(step)))

  def saved_autopilot(self, step: int) -> dict | None:
    """The batch autopilot's state saved with checkpoint `step`, or None if it has none."""
    return self._saved_json(step, "autopilot")

  def _saved_json(self, step: int, item: str) -> dict | None:
    path = os.path.join(self.directory, str(step), item, "metadata")
    try:
      with open(path) as f:
        return json.load(f)
    except (OSError, ValueError):
      return None

  def verify(self, step: int) -> str | None:
    """None if the files of checkpoint `step` match their checksums, else the first that does
    not (each process reads its share of the files; every process gets the same answer)."""
    return verify_agreed(os.path.join(self.directory, str(step)), self.timeout_s, step)

  def agreed_steps(self) -> list[int]:
    """The steps every process lists (a listing cache on NFS or FUSE may show one host a step
    committed a moment ago that another does not see yet): a restore iterates only these, so
    every process reads the same step."""
    steps = self.all_steps()
    if jax.process_count() == 1:
      return steps
    rows = exchange({"steps": steps}, self.timeout_s)
    return sorted(set.intersection(*(set(r["steps"]) for r in rows)))

  def check_compatible(self, step: int, abstract_state, config: dict,
                       data_spec: pipeline.StreamSpec | None = None,
                       windows_before: int | None = None) -> str | None:
    """Raise CheckpointError if checkpoint `step` was written by an incompatible config or on
    data of another tokenizer; returns the line that says how the data order changes, if it
    does (`data.pipeline.restored_state`)."""
    saved_config = self.saved_config(step)  # UnreadableConfig: restore_latest falls back
    try:
      saved_tree = self.manager.item_metadata(step)["state"].tree
    except Exception:  # noqa: BLE001  unreadable metadata: the restore attempt will report it
      saved_tree = None
    try:
      saved_data = read_data_states(os.path.join(self.directory, str(step), "data"))
    except (OSError, ValueError):
      saved_data = None  # unreadable: the restore attempt will report it
    return check_saved(f"{self.directory}/{step}", saved_config, saved_tree,
                       saved_data, abstract_state, config, data_spec, windows_before)

  def restore_step(self, step: int, abstract_state, data_spec: pipeline.StreamSpec,
                   windows_before: int | None = None):
    """(state, data iterator) of checkpoint `step`, or the first line of why it cannot be read.
    Every process settles on the same answer (one unreadable shard anywhere rejects it)."""
    iterator = iter(pipeline.dataset(data_spec))
    error = None
    try:
      restored = self.manager.restore(step, args=ocp.args.Composite(
          state=CheckedStandard.Restore(abstract_state),
          data=CheckedData.Restore(iterator, data_spec, windows_before),
      ))
      if not finite_state(restored.state):
        error = NOT_FINITE
    except Exception as e:  # noqa: BLE001  any read failure means "try the previous one"
      error = first_line(e)
    if not agree_all(error is None):
      return error or "on another process"
    return restored.state, iterator

  def restore_latest(self, abstract_state, data_spec: pipeline.StreamSpec, config: dict,
                     *, allow_fresh_start: bool = False,
                     windows_before: Callable[[int], int] | None = None,
                     local=None) -> "Restored | None":
    """The newest readable step of this tier and of `local` (the local tier), or None if there
    is none. A step of both is read from the local tier if it is complete there (faster), else
    from this one. Falls back past unreadable steps; raises CheckpointError if none is
    readable. `windows_before(step)`: the windows the steps before `step` read, where a data
    state of the earlier per-row reader continues (None: such a state is refused)."""
    steps = self.agreed_steps()
    local_steps = local.steps() if local is not None else []
    if not steps and not local_steps:
      return None
    unreadable = []
    for step in sorted(set(steps) | set(local_steps), reverse=True):
      before = windows_before(step) if windows_before is not None else None
      if step in local_steps:
        restored = restore_local(local, step, abstract_state, config, data_spec, before)
        if isinstance(restored, Restored):
          self._set_aside(unreadable)
          local.drop_newer(step)
          return restored
        self.log(f"local checkpoint {step} cannot be restored ({restored}); trying "
                 + ("the persistent one" if step in steps else "the previous one"))
      if step not in steps:
        continue
      error = note = None
      damaged = self.verify(step)  # the same on every process
      if damaged:
        error = damaged
      else:
        try:
          note = self.check_compatible(step, abstract_state, config, data_spec, before)
        except UnreadableConfig as e:  # as unreadable as a damaged state: fall back
          error = str(e)
      # Every process must settle on the same step before the (collective) restore.
      if not agree_all(error is None):
        restored = error or "on another process"
      else:
        restored = self.restore_step(step, abstract_state, data_spec, before)
      if isinstance(restored, str):
        self.log(f"checkpoint {self.directory}/{step} is {'damaged' if damaged else 'unreadable'} "
                 f"({restored}); trying the previous one")
        unreadable.append(step)
        continue
      self._set_aside(unreadable)
      if local is not None:
        local.drop_newer(step)
      if note:
        self.log(f"checkpoint {step}: {note}")
      items = {k: self._saved_json(step, k) for k in ("autopilot", "topology")}
      return Restored(*restored, step, "persistent", f"{self.directory}/{step}", items)
    tried = ", ".join(map(str, sorted(set(steps) | set(local_steps), reverse=True)))
    if not allow_fresh_start:
      raise CheckpointError(
          f"no readable checkpoint in {self.directory}"
          + (f" or {local.root}" if local is not None else "") + f" (tried steps {tried}); "
          "nothing was deleted. Inspect or move them, or pass "
          "--config.checkpoint.allow_fresh_start=true to set them aside and start over")
    self._set_aside(unreadable)
    if local is not None:
      local.drop_newer(None)
    return None

  def _set_aside(self, steps: list[int]) -> None:
    """Move unreadable checkpoints out of the manager's way, keeping them for inspection.
    Process 0 moves them (the directory is shared); the others wait for it."""
    if not steps:
      return
    if jax.process_index() == 0:
      aside = self.directory.rstrip("/") + ".unreadable"
      os.makedirs(aside, exist_ok=True)
      for step in steps:
        target = os.path.join(aside, f"{step}-{int(time.time())}")
        shutil.move(os.path.join(self.directory, str(step)), target)
        self.log(f"moved unreadable checkpoint {step} to {target}")
    if jax.process_count() > 1:
      multihost_utils.sync_global_devices("scaletrain: unreadable checkpoints set aside")
    self.manager.reload()


@dataclasses.dataclass
class Restored:
  """A restored checkpoint: the train state, the data iterator at its position, the step, the
  tier it came from ("persistent" or "local"), where exactly, and its small JSON items
  (`autopilot`, `topology`; None where it has none)."""
  state: Any
  iterator: Any
  step: int
  tier: str
  source: str
  items: dict


def restore_local(local, step: int, abstract_state, config: dict,
                  data_spec: pipeline.StreamSpec, windows_before: int | None):
  """`Restored` from local step `step` (`trainer/checkpoint/local_tier.py`), or why it cannot
  be. Its config and data position are checked like a persistent checkpoint's; every process
  takes the small items from any copy (they are the same on all)."""
  copies = [m for m in local.metas(step).values()]
  meta = copies[0] if copies else None
  if local.count > 1:
    keys = ("config", "data", "autopilot", "topology", "keys", "shapes")
    rows = exchange({k: meta[k] for k in keys} if meta else {}, local.timeout_s)
    meta = next((r for r in rows if r), None)
  if meta is None:
    return "no process has a copy"
  where = f"{local.base}/process_*/{step}"
  note = check_saved(where, meta["config"], SavedShapes(zip(meta["keys"], meta["shapes"])),
                     [meta["data"]], abstract_state, config, data_spec, windows_before)
  state, how = local.restore(step, abstract_state)
  if state is None:
    return how
  if not finite_state(state):
    return NOT_FINITE
  iterator = iter(pipeline.dataset(data_spec))
  iterator.set_state(pipeline.restored_state([meta["data"]], data_spec, windows_before)[0])
  if note:
    local.log(f"checkpoint {step}: {note}")
  return Restored(state, iterator, step, "local", f"{where} ({how})",
                  {k: meta.get(k) for k in ("autopilot", "topology")})


# ----------------------------------------------------------------------------------------------
# Parameters only, from another run (warm starts, fine-tuning)



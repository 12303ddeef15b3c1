"""Whether a checkpoint's bytes are the ones written, and never a non-finite state: shared by
both tiers.

  <step>/<item>/checksums.json   {"algorithm": "crc32", "files": {path: [bytes, crc32]}}

`checksummed(Handler)` gives an Orbax item handler both guards: in Orbax's finalize step (the
background thread of an async save, before the step is committed, on the process that commits)
it takes a CRC32 of every file of its item, so a step without its sums never counts as complete;
and a save under `finite_guard` fails in its commit if a parameter is NaN or inf, on every
process alike. `verify_item` / `verify_step` re-read the files before a restore accepts a
step. Why, costs and what is not detected: docs/reliability.md#integrity.
"""
from __future__ import annotations

import concurrent.futures
import contextlib
import json
import os
import threading
import time
import zlib

import jax
import jax.numpy as jnp
import orbax.checkpoint as ocp

from trainer.errors import first_line
from trainer.multihost.agreement import exchange

SUMS = "checksums.json"
CHUNK = 16 * 2**20  # bytes read at a time (zlib.crc32 releases the GIL on large buffers)


class NonFiniteState(ValueError):
  """A save of a state with NaN or inf in its parameters (not written)."""


def file_crc32(path: str) -> tuple[int, int]:
  """(bytes, CRC32) of one file."""
  crc, size = 0, 0
  with open(path, "rb") as f:
    while chunk := f.read(CHUNK):
      crc, size = zlib.crc32(chunk, crc), size + len(chunk)
  return size, crc


def item_files(item_dir: str) -> list[str]:
  """The files of an item, relative to it, sorted (its sums file left out)."""
  out = []
  for root, _, names in os.walk(item_dir):
    out += [os.path.relpath(os.path.join(root, n), item_dir) for n in names]
  return sorted(p for p in out if p != SUMS)


def checkpoint_bytes(step_dir: str) -> int:
  """Bytes of the files of one checkpoint (their sizes, not the blocks they occupy)."""
  return sum(os.path.getsize(os.path.join(root, name))
             for root, _, names in os.walk(step_dir) for name in names)


def write_checksums(item_dir: str) -> int:
  """Write `checksums.json` for every file of `item_dir`; returns the bytes hashed."""
  files = {p: list(file_crc32(os.path.join(item_dir, p))) for p in item_files(item_dir)}
  with open(os.path.join(item_dir, SUMS), "w") as f:
    json.dump({"algorithm": "crc32", "files": files}, f)
  return sum(size for size, _ in files.values())


def verify_item(item_dir: str, share: tuple[int, int] = (0, 1),
                required: bool = False) -> str | None:
  """None if every file listed in the item's sums (this process's `share`: (index, count) of a
  round robin over them) has its size and CRC32; else what differs, in a few words. An item
  without sums is not checked (written before they existed), unless they are `required` (a
  step of this version): then their absence is the difference."""
  path = os.path.join(item_dir, SUMS)
  if not os.path.exists(path):
    return f"{SUMS} is missing (the step was written with checksums)" if required else None
  try:
    with open(path) as f:
      files = json.load(f)["files"]
    listed = sorted(files.items())
  except (OSError, ValueError, KeyError, TypeError, AttributeError):
    return f"its {SUMS} is unreadable"
  index, count = share
  for name, expected in listed[index::count]:
    try:
      size, crc = file_crc32(os.path.join(item_dir, name))
    except OSError:
      return f"{name} is missing"
    if size != expected[0]:
      return f"{name} has {size} bytes, {expected[0]} were written"
    if crc != expected[1]:
      return f"{name} does not match its checksum (crc32 {crc:08x}, written {expected[1]:08x})"
  return None


# An item that a step of this version always has: a step holding it was written with checksums
# (persistent tier, trainer/checkpoint/identity.py), so an item of it without its sums is damage.
MARK_ITEM = "run"


def verify_step(step_dir: str, share: tuple[int, int] = (0, 1)) -> str | None:
  """`verify_item` over every item of one step (each process its `share` of every item's
  files): None, or "<item>/<file> ..." of the first difference. In a step of this version (it
  has the `run` item) every item must have its sums: a missing one is reported, not skipped."""
  items = sorted(d for d in os.listdir(step_dir) if os.path.isdir(os.path.join(step_dir, d)))
  current = MARK_ITEM in items
  for item in items:
    problem = verify_item(os.path.join(step_dir, item), share, required=current)
    if problem:
      return f"{item}/{problem}"
  return None


def verify_agreed(step_dir: str, timeout_s: float, step: int | None = None) -> str | None:
  """`verify_step` of `step_dir` with every process reading its share of the files; every
  process gets the same answer (the first problem any found). `step`: the step every process
  must be verifying (carried in the exchange: processes that paired different steps would
  restore a state mixed from both, so that is a bug, raised)."""
  try:
    problem = verify_step(step_dir, (jax.process_index(), jax.process_count()))
  except OSError as e:
    problem = first_line(e)
  if jax.process_count() > 1:
    rows = exchange({"problem": problem, "step": step}, timeout_s)
    steps = [r["step"] for r in rows]
    if len(set(steps)) > 1:
      raise AssertionError(f"processes verify different checkpoint steps {steps} (the restore "
                           "must iterate the steps every process lists)")
    problem = next((r["problem"] for r in rows if r["problem"]), None)
  return problem


@jax.jit
def _all_finite(leaves):
  return jnp.all(jnp.stack([jnp.all(jnp.isfinite(x)) for x in leaves] or [jnp.bool_(True)]))


def all_finite(tree) -> jax.Array:
  """A scalar: whether every floating value in `tree` is finite. Dispatched asynchronously:
  reading it waits for the device."""
  leaves = [x for x in jax.tree.leaves(tree)
            if isinstance(x, jax.Array) and jnp.issubdtype(x.dtype, jnp.floating)]
  return _all_finite(leaves)


class Finite:
  """The finiteness flag of one save, handed over once it is known (`set`); a save's commit
  waits for it (`check`). An async save sets it after its blocking part, so that the reduction
  over the parameters runs beside the background write instead of inside the loop's wait."""

  def __init__(self):
    self._set, self._flag = threading.Event(), None

  def set(self, flag) -> None:
    self._flag = flag
    self._set.set()

  def check(self, timeout: float | None) -> None:
    if not self._set.wait(timeout):
      raise TimeoutError("the save's finiteness check was never handed over")
    if self._flag is not None and not bool(jax.device_get(self._flag)):
      raise NonFiniteState("the state holds NaN or inf in its parameters; it is not saved")


class _AfterFinite:
  """A commit future: the item's own futures, then the save's `Finite` check."""

  def __init__(self, futures, finite: Finite):
    self.futures, self.finite = futures, finite

  def result(self, timeout: float | None = None):
    for f in self.futures:
      f.result(timeout=timeout)
    self.finite.check(timeout)


# One thread that dispatches an async save's finiteness reduction while the save's blocking part
# runs (on the CPU backend the call can take about as long as the reduction itself).
_BESIDE = concurrent.futures.ThreadPoolExecutor(1, thread_name_prefix="finite-check")


@contextlib.contextmanager
def finite_guard(handler, params, blocking: bool, known: bool | None = None):
  """Around a save whose item `handler` (a `checksummed` one) holds `params`: its commit fails
  (`NonFiniteState`) unless every parameter is finite. `known`: that flag, already read back
  (the loop's: the saved step's param_norm, trainer/run/readback.py), so nothing is computed.
  Otherwise: where the save blocks until committed the flag is computed before it; an async
  save dispatches the reduction beside its blocking part (on a thread, with one process; with
  several after it, in program order: it is a collective) and waits for that dispatch before
  it returns, so the next step cannot donate the buffers before the reduction holds them; the
  value is waited for in the commit."""
  finite = handler.guard = Finite()
  beside = None
  try:
    if known is not None:
      finite.set(known)
    elif blocking:
      finite.set(all_finite(params))
    elif jax.process_count() == 1:
      beside = _BESIDE.submit(all_finite, params)
    yield
    if not finite._set.is_set():
      finite.set(beside.result() if beside is not None else all_finite(params))
  finally:
    handler.guard = None
    if beside is not None:
      beside.exception()  # dispatched (or failed) before the buffers can be donated
    if not finite._set.is_set():
      finite.set(None)  # the save failed before its commit: nothing waits for a flag


def checksummed(handler_class, save_args, restore_args):
  """`handler_class` whose finalize writes the item's checksums (timed in `hashed`: bytes and
  seconds so far) and whose save fails in its commit when `guard` (a `Finite`, set by
  `finite_guard` around the save) says the state is not finite. Orbax finds a handler by its
  args' class: save and restore with the returned class's `Save` and `Restore` (subclasses of
  `save_args`, `restore_args`)."""

  class Checksummed(handler_class):
    guard = None
    sums = True  # False: no checksums (bench/checkpoint_overhead.py compares)

    def __init__(self, *args, **kwargs):
      super().__init__(*args, **kwargs)
      self.hashed = [0, 0.0]

    async def async_save(self, directory, *args, **kwargs):
      futures = list(await super().async_save(directory, *args, **kwargs) or [])
      return futures if self.guard is None else [_AfterFinite(futures, self.guard)]

    def finalize(self, directory) -> None:
      super().finalize(directory)
      if self.sums:
        t = time.perf_counter()
        self.hashed[0] += write_checksums(os.fspath(directory))
        self.hashed[1] += time.perf_counter() - t

  name = f"Checksummed{handler_class.__name__}"
  Checksummed.__name__ = Checksummed.__qualname__ = name
  for attr, base, kind in (("Save", save_args, "for_save"), ("Restore", restore_args,
                                                               "for_restore")):
    args = type(f"{name}{attr}", (base,), {"__module__": __name__})
    setattr(Checksummed, attr, ocp.args.register_with_handler(Checksummed, **{kind: True})(args))
  return Checksummed


# The handlers both tiers save and restore with (Orbax finds a handler by its args' class).
CheckedStandard = checksummed(ocp.StandardCheckpointHandler, ocp.args.StandardSave,
                              ocp.args.StandardRestore)
CheckedPyTree = checksummed(ocp.PyTreeCheckpointHandler, ocp.args.PyTreeSave,
                            ocp.args.PyTreeRestore)
CheckedJson = checksummed(ocp.JsonCheckpointHandler, ocp.args.JsonSave, ocp.args.JsonRestore)

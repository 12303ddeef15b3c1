"""The local checkpoint tier: frequent saves to node-local storage, each process's shards plus a
copy of its peer's, and restores from whatever copies survive (`LocalTier`).

  <checkpoint.local_dir>/<run id>/process_<i>/<step>/    one Orbax manager per process, no barrier
    state   the shards of the train state this process's devices hold, each distinct one once
    peer    the shards process i - 1 (mod the count) holds, copied one process on
    meta    JSON: the run, each item's array boxes, the layout's fingerprint, the small items

Saves are asynchronous, keep `checkpoint.local_keep` steps, make room by retiring the oldest
first, and are skipped rather than leave less than `RESERVE` of the disk free. A step restores
only if every shard every process needs under the current mesh is readable and matches its
checksums somewhere: its own copy, another process's under the same directory, or over the
interconnect (same mesh and process count as the save). Why and details:
docs/reliability.md#two-tiers-a-local-one-beside-the-persistent-one.
"""
from __future__ import annotations

import glob
import json
import os
import re
import shutil
from collections.abc import Callable

import jax
import numpy as np
import orbax.checkpoint as ocp
from jax.sharding import Mesh, NamedSharding
from jax.sharding import PartitionSpec as P

from trainer.checkpoint.identity import other_runs
from trainer.checkpoint.integrity import (CheckedJson, CheckedPyTree, checkpoint_bytes,
                                          finite_guard, verify_item)
from trainer.checkpoint.local_layout import (covered, layout_fingerprint, next_process_mesh,
                                             on_mesh, restore_target, shard_boxes, successors,
                                             volume)
from trainer.checkpoint.persistent import short_switch_interval
from trainer.checkpoint.saved import CheckpointError, leaf_keys
from trainer.errors import first_line
from trainer.multihost.agreement import exchange

RESERVE = 0.05  # fraction of the disk a local save always leaves free
PROCESS_DIR = re.compile(r"process_(\d+)$")


class LocalSaveSkipped(RuntimeError):
  """A local save that was not started (too little free space); the run goes on."""


class Damaged(ValueError):
  """An item whose files do not match their checksums."""


def unreadable(e: Exception) -> str:
  """Why an item could not be read, in a few words."""
  return f"is damaged ({e})" if isinstance(e, Damaged) else f"is unreadable ({first_line(e)})"


class LocalTier:
  """This process's local checkpoints of run `run` (its identity, trainer/checkpoint/identity.py:
  they live under `<root>/<run id>/`). `timeout_s`: how long a restore waits for the other
  processes to agree."""

  def __init__(self, root: str, mesh: Mesh, *, run: dict, keep: int, async_save: bool = True,
               log: Callable[[str], None] = print, timeout_s: float = 300):
    self.root, self.run = os.path.abspath(root), run
    self.index, self.count = jax.process_index(), jax.process_count()
    self.base = os.path.join(self.root, run["id"])  # this run's local steps, every process's
    self.dir = os.path.join(self.base, f"process_{self.index}")
    self._said: set = set()  # the unreadable metas already named
    self._made_room = False  # whether a save had to delete an old step first (said once)
    self.mesh, self.log, self.keep, self.async_save = mesh, log, keep, async_save
    self.timeout_s = timeout_s
    self.peer_mesh = next_process_mesh(mesh)
    try:
      os.makedirs(self.dir, exist_ok=True)
    except OSError as e:
      raise CheckpointError(f"checkpoint.local_dir={root!r}: cannot create {self.dir} "
                            f"({e.strerror or e}); give a directory this user can write (a "
                            "node-local disk or /dev/shm)") from None
    self.manager = self._manager(self.dir)
    self._handlers = self.manager.scaletrain_handlers
    others = other_runs(self.root, run["id"])
    if others:
      log(others)
    self._layout_key = None

  def _manager(self, directory: str, read_only: bool = False) -> ocp.CheckpointManager:
    """An Orbax manager over one process directory, for this process alone (its item handlers
    in `scaletrain_handlers`)."""
    mp = ocp.options.MultiprocessingOptions(
        primary_host=self.index, active_processes={self.index},
        barrier_sync_key_prefix=f"scaletrain_local_{self.index}")
    registry = ocp.type_handlers.create_type_handler_registry(
        (jax.Array, ocp.type_handlers.ArrayHandler(primary_host=None, replica_id=None,
                                                   use_replica_parallel=False)))
    arrays = lambda: CheckedPyTree(
        use_ocdbt=True, use_zarr3=True, multiprocessing_options=mp,
        type_handler_registry=registry)
    options = ocp.CheckpointManagerOptions(
        max_to_keep=self.keep, create=False, read_only=read_only,
        cleanup_tmp_directories=not read_only, multiprocessing_options=mp,
        enable_async_checkpointing=self.async_save,
        async_options=ocp.AsyncOptions(create_directories_asynchronously=False))
    handlers = {"state": arrays(), "peer": arrays(),
                "meta": CheckedJson(multiprocessing_options=mp)}
    manager = ocp.CheckpointManager(directory, options=options, item_handlers=handlers)
    manager.scaletrain_handlers = handlers
    return manager

  # ------------------------------------------------------------------------------------------
  # Saving

  def save(self, step: int, state, meta: dict, finite: bool | None = None) -> int:
    """Start saving `state` and the peer copy at `step`; `meta`: the JSON items the persistent
    tier saves (config, data, autopilot, topology); `finite`: whether the parameters are, where
    the caller knows (`integrity.finite_guard`). Every process calls it at the same step
    (the peer copy is a collective). Returns the bytes this process writes; raises
    LocalSaveSkipped when the disk is too full, anything else on a storage error."""
    leaves = jax.tree.leaves(state)
    with jax.set_mesh(None):  # outside the run's mesh context: a transfer to another mesh
      peer = [] if self.peer_mesh is None else \
          [jax.device_put(leaf, on_mesh(self.peer_mesh, leaf)) for leaf in leaves]
    info, size = self._layout(state, leaves, peer)
    if not self._fits(size):
      self._make_room(step, size)
    if not self._fits(size):
      free = shutil.disk_usage(self.dir).free
      raise LocalSaveSkipped(
          f"its {size / 2**20:.1f} MiB would leave less than {RESERVE:.0%} of the disk of "
          f"{self.root} free ({free / 2**20:.0f} MiB free)")
    info = {"step": step, "run": self.run, **info, **meta}
    items = {"state": CheckedPyTree.Save({f"a{i}": x for i, x in enumerate(leaves)}),
             "meta": CheckedJson.Save(info)}
    if peer:
      items["peer"] = CheckedPyTree.Save({f"a{i}": x for i, x in enumerate(peer)})
    guard = finite_guard(self._handlers["state"], getattr(state, "params", state),
                         blocking=not self.async_save, known=finite)
    with short_switch_interval(), guard:
      self.manager.save(step, args=ocp.args.Composite(**items), force=True)
    return size

  def _fits(self, size: int) -> bool:
    usage = shutil.disk_usage(self.dir)
    return usage.free - size >= RESERVE * usage.total

  def _make_room(self, step: int, size: int) -> None:
    """Delete the oldest steps this save would retire anyway (the tier holds `keep`) if that
    makes it fit (never in vain); the first time, say so."""
    steps = sorted(self.manager.all_steps())
    retire = steps[:max(len(steps) - self.keep + 1, 0)]
    freed = sum(checkpoint_bytes(os.path.join(self.dir, str(s))) for s in retire)
    usage = shutil.disk_usage(self.dir)
    if not retire or usage.free + freed - size < RESERVE * usage.total:
      return
    for s in retire:
      self.manager.delete(s)
    if not self._made_room:
      self._made_room = True
      self.log(f"local checkpoint at step {step}: deleted local step(s) "
               f"{', '.join(map(str, retire))} first to make room (the disk of {self.root} "
               f"does not hold checkpoint.local_keep={self.keep} steps and one more)")

  def _layout(self, state, leaves, peer) -> tuple[dict, int]:
    """(the meta of a save's arrays, the bytes this process writes), computed once per run (the
    shardings do not change)."""
    key = tuple((leaf.shape, leaf.sharding) for leaf in leaves)
    if self._layout_key != key:
      own, moved = [shard_boxes(leaf) for leaf in leaves], [shard_boxes(leaf) for leaf in peer]
      size = sum(volume(b) * leaf.dtype.itemsize for boxes, leaf in
                 [*zip(own, leaves), *zip(moved, peer)] for b in boxes)
      info = {"process": self.index, "processes": self.count,
              "layout": layout_fingerprint(state), "keys": leaf_keys(state),
              "shapes": [list(leaf.shape) for leaf in leaves], "own": own, "peer": moved}
      self._layout_key, self._layout_value = key, (info, size)
    return self._layout_value

  def wait(self) -> None:
    self.manager.wait_until_finished()
    self.manager.check_for_errors()

  def finish_previous(self) -> Exception | None:
    """Wait for the previous save's background write (the next save waits for it anyway; a
    local wait, no collective), so that its bytes are on the disk and its old steps deleted;
    returns its error if it failed."""
    try:
      self.wait()
    except Exception as e:  # noqa: BLE001  storage errors of any kind
      return e
    return None

  def close(self) -> None:
    try:
      self.manager.close()
    except Exception:  # noqa: BLE001  (reported by wait(); closing must not mask it)
      pass

  # ------------------------------------------------------------------------------------------
  # Finding steps

  def visible_dirs(self) -> list[str]:
    """The process directories under the root this process can see, its own first."""
    found = [d for d in glob.glob(os.path.join(self.base, "process_*"))
             if PROCESS_DIR.search(d) and os.path.isdir(d)]
    return sorted(found, key=lambda d: (d != self.dir, d))

  def metas(self, step: int | None = None) -> dict:
    """{dir: {step: meta}} of the finished steps in every visible directory (with `step`:
    {dir: meta} of that step)."""
    out = {}
    for d in self.visible_dirs():
      steps = {}
      for name in os.listdir(d):
        if name.isdigit() and os.path.exists(os.path.join(d, name, "commit_success.txt")):
          meta = self._read_meta(os.path.join(d, name, "meta"), int(name))
          if meta is not None:
            steps[int(name)] = meta
      out[d] = steps
    if step is None:
      return out
    return {d: steps[step] for d, steps in out.items() if step in steps}

  def _read_meta(self, meta_dir: str, step: int) -> dict | None:
    """A copy's meta, or None (said once per copy) if it is damaged, unreadable or another
    run's."""
    damaged, meta = verify_item(meta_dir, required=True), None  # sums came before run ids
    if damaged:
      problem = f"is damaged ({damaged})"
    else:
      try:
        with open(os.path.join(meta_dir, "metadata")) as f:
          meta = json.load(f)
        problem = "" if isinstance(meta, dict) and "keys" in meta else "holds no meta"
      except (OSError, ValueError) as e:
        problem = f"is unreadable ({first_line(e)})"
    if not problem and meta.get("run", {}).get("id") != self.run["id"]:
      problem = f"belongs to run {meta.get('run', {}).get('id')}, not this run {self.run['id']}"
    if not problem:
      return meta
    where = os.path.relpath(meta_dir, self.root)
    if where not in self._said:
      self._said.add(where)
      self.log(f"local checkpoint {step}: {where} {problem}; that copy is not used")
    return None

  def steps(self) -> list[int]:
    """Local steps any process can see (the union over processes), oldest first."""
    mine = sorted({s for steps in self.metas().values() for s in steps})
    return sorted({s for row in self._agree({"steps": mine}) for s in row["steps"]})

  def _agree(self, payload: dict) -> list[dict]:
    if self.count == 1:
      return [payload]
    return exchange(payload, self.timeout_s)

  def drop_newer(self, step: int | None) -> None:
    """Delete this process's local steps after `step` (None: all; a restore went back past them
    and the run will save those steps again), and the directories of processes the run no
    longer has (by the first current process that sees them)."""
    for s in self.manager.all_steps():
      if step is None or s > step:
        self.manager.delete(s)
    self.manager.reload()
    current = {os.path.join(self.base, f"process_{i}") for i in range(self.count)}
    visible = self.visible_dirs()
    if min((d for d in visible if d in current), default=self.dir) == self.dir:
      for d in visible:
        if d not in current:
          shutil.rmtree(d, ignore_errors=True)
          self.log(f"removed {d}: local checkpoints of a process this run no longer has")

  # ------------------------------------------------------------------------------------------
  # Restoring

  def restore(self, step: int, abstract_state) -> tuple[object | None, str]:
    """(train state or None, which copies were read / why none could be) of local step `step`
    onto the shardings of `abstract_state`. Every process calls it with the same step."""
    leaves, treedef = jax.tree.flatten(abstract_state)
    metas = self.metas(step)
    bad: set = set()
    restored: dict[int, jax.Array] = {}
    read: set = set()
    met: list[str] = []  # the copies that failed, said once the outcome is known
    while True:
      plan, missing = self._plan(metas, leaves, bad, restored)
      errors = [] if missing else self._read(step, plan, leaves, restored, bad)
      read |= {f"{os.path.basename(d)}/{item}" for (d, item) in plan}
      rows = self._agree({"missing": missing, "errors": errors, "read": sorted(read)})
      met += [e + (f" (process {i})" if self.count > 1 else "")
              for i, row in enumerate(rows) for e in row["errors"]]
      if not any(r["missing"] or r["errors"] for r in rows):
        self._say_met(step, met)
        everyone = [f"process {i}: {', '.join(r['read'])}" for i, r in enumerate(rows)]
        return treedef.unflatten([restored[i] for i in range(len(leaves))]), \
            "read " + ("; ".join(everyone) if self.count > 1 else ", ".join(sorted(read)))
      if any(r["missing"] for r in rows):
        break
    why = "; ".join(f"process {i}: {r['missing']}" for i, r in enumerate(rows) if r["missing"])
    if self._in_place(metas, abstract_state):
      state = self._over_interconnect(step, metas, leaves, treedef)
      if state is not None:
        self._say_met(step, met)
        return state, f"peer copies over the interconnect ({why})"
    return None, "; ".join(met) if met else why  # a damaged copy says more than what is missing

  def _say_met(self, step: int, met: list[str]) -> None:
    for e in met:
      self.log(f"local checkpoint {step}: {e}; read another copy")

  def _plan(self, metas, leaves, bad, restored) -> tuple[dict, str]:
    """{(dir, item): [leaf indices]} covering what this process needs of each leaf not yet
    restored (own state first, then other state copies, then peer copies), and why not ("" if
    every leaf is covered)."""
    plan: dict = {}
    sources = [(d, "state") for d in metas] + [(d, "peer") for d in metas]
    for i, leaf in enumerate(leaves):
      if i in restored:
        continue
      needed = shard_boxes(leaf)
      for d, item in sources:
        boxes = metas[d]["own" if item == "state" else "peer"]
        if (d, item) not in bad and i < len(boxes) and \
            metas[d]["shapes"][i] == list(leaf.shape) and \
            covered(needed, [tuple(map(tuple, b)) for b in boxes[i]]):
          plan.setdefault((d, item), []).append(i)
          break
      else:
        name = next(iter(metas.values()))["keys"][i] if metas else f"array {i}"
        return plan, f"no readable copy of {name} where it can see"
    return plan, ""

  def _read(self, step, plan, leaves, restored, bad) -> list[str]:
    """Read the planned items into `restored`; returns the errors (failing items go to `bad`)."""
    errors = []
    for (d, item), indices in plan.items():
      manager = self.manager if d == self.dir else self._manager(d, read_only=True)
      try:
        out = self._restore_item(manager, step, item, restore_target(leaves, indices))
        restored.update((i, out[f"a{i}"]) for i in indices)
      except Exception as e:  # noqa: BLE001  any read failure: try another copy
        bad.add((d, item))
        errors.append(f"{os.path.basename(d)}/{item} {unreadable(e)}")
      finally:
        if manager is not self.manager:
          manager.close()
    return errors

  @staticmethod
  def _restore_item(manager, step: int, item: str, target: dict) -> dict:
    problem = verify_item(os.path.join(manager.directory, str(step), item), required=True)
    if problem:
      raise Damaged(problem)
    return manager.restore(step, args=ocp.args.Composite(**{item: CheckedPyTree.Restore(
        item=target, restore_args=ocp.checkpoint_utils.construct_restore_args(target),
        partial_restore=True)}))[item]

  def _in_place(self, metas, abstract_state) -> bool:
    """Whether the interconnect path applies: several processes, the mesh and process count of
    the save (every meta this process sees says so)."""
    layout = layout_fingerprint(abstract_state)
    ok = self.peer_mesh is not None and all(m["layout"] == layout for m in metas.values())
    return all(r["ok"] for r in self._agree({"ok": ok}))

  def _over_interconnect(self, step, metas, leaves, treedef):
    """Restore in place when a process cannot see its own copy: it reads its `state` if it can,
    its `peer` item (its predecessor's shards) when the predecessor cannot, and one collective
    permutation sends every device's peer block back to the device it belongs to. None if some
    shard has no readable copy on its process or its successor."""
    everything = range(len(leaves))
    own = self._read_own(step, metas, "state", restore_target(leaves, everything))
    have_own = [r["own"] for r in self._agree({"own": own is not None})]
    peer = None
    if not have_own[(self.index - 1) % self.count]:
      peer = self._read_own(step, metas, "peer", restore_target(leaves, everything, self.peer_mesh))
    have_peer = [r["peer"] for r in self._agree({"peer": peer is not None})]
    if not all(have_own[q] or have_peer[(q + 1) % self.count] for q in range(self.count)):
      return None
    received = self._send_back([None if peer is None else peer[f"a{i}"] for i in everything],
                               leaves)
    if own is not None:
      return treedef.unflatten([own[f"a{i}"] for i in everything])
    return treedef.unflatten([
        jax.make_array_from_single_device_arrays(leaf.shape, leaf.sharding, [
            s.data.reshape(leaf.sharding.shard_shape(leaf.shape)) for s in got.addressable_shards])
        for leaf, got in zip(leaves, received)])

  def _send_back(self, peer: list, leaves) -> list:
    """Every device's block of the peer copy (`peer`: arrays on `next_process_mesh`, None where
    this process read none: zeros) sent to the device whose shard it is: one `ppermute` over all
    mesh axes, on [devices, *shard] arrays whose blocks are each device's own (no replica of one
    box is assumed equal to another, as a resharding `jax.device_put` would). Collective."""
    mesh, axes = self.mesh, tuple(self.mesh.axis_names)
    position = {d.id: k for k, d in enumerate(mesh.devices.flat)}
    moved = successors(mesh)
    perm = [(position[moved[d.id].id], position[d.id]) for d in mesh.devices.flat]
    stacked_sharding = NamedSharding(mesh, P(axes))
    stacked = []
    for leaf, array in zip(leaves, peer):
      shard = leaf.sharding.shard_shape(leaf.shape)
      blocks = {s.device.id: s.data for s in array.addressable_shards} if array is not None else {}
      stacked.append(jax.make_array_from_single_device_arrays(
          (mesh.devices.size, *shard), stacked_sharding,
          [blocks[d.id].reshape((1, *shard)) if d.id in blocks else
           jax.device_put(np.zeros((1, *shard), leaf.dtype), d)
           for d in stacked_sharding.addressable_devices]))
    specs = (P(axes),) * len(stacked)
    send = jax.shard_map(lambda *xs: tuple(jax.lax.ppermute(x, axes, perm) for x in xs),
                         mesh=mesh, in_specs=specs, out_specs=specs, check_vma=False)
    with jax.set_mesh(None):
      return jax.jit(send)(*stacked)

  def _read_own(self, step, metas, item, target) -> dict | None:
    """`item` of local step `step` in this process's own directory onto `target`, or None."""
    if self.dir not in metas:
      return None
    try:
      return self._restore_item(self.manager, step, item, target)
    except Exception as e:  # noqa: BLE001  unreadable: the agreement decides what to do
      self.log(f"local checkpoint {step}: {os.path.basename(self.dir)}/{item} {unreadable(e)}")
      return None

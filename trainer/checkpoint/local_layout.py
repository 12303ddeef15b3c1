"""Which shards of which array a process holds, and where its peer copy lives: the geometry the
local checkpoint tier (`trainer/checkpoint/local_tier.py`) saves and plans restores with.

A shard is a box, ((start, stop), ...) per dimension. A process's successor holds a copy of its
shards on `next_process_mesh`: the run's mesh with each device replaced by the device of the
same local rank on the next process.
"""
from __future__ import annotations

import hashlib

import jax
import numpy as np
from jax.sharding import Mesh, NamedSharding


def box_of(index, shape) -> tuple[tuple[int, int], ...]:
  """A shard's index (slices) as ((start, stop), ...) per dimension."""
  return tuple((s.start or 0, n if s.stop is None else s.stop) for s, n in zip(index, shape))


def shard_boxes(array) -> list:
  """The distinct boxes of an array's shards on this process's devices."""
  indices = array.sharding.addressable_devices_indices_map(array.shape)
  return sorted({box_of(i, array.shape) for i in indices.values()})


def volume(box) -> int:
  return int(np.prod([b - a for a, b in box], dtype=np.int64))


def covered(needed, boxes) -> bool:
  """Whether every box in `needed` lies within the union of `boxes` (shards of one array: they
  tile it without overlapping, so the intersections' volumes add up)."""
  def overlap(a, b):
    return volume(tuple((max(x0, y0), max(max(x0, y0), min(x1, y1)))
                         for (x0, x1), (y0, y1) in zip(a, b)))
  return all(sum(overlap(want, have) for have in boxes) == volume(want) for want in needed)


def layout_fingerprint(abstract_state) -> str:
  """What a restore in place must match: the process count, every array's shape and each
  device's box of it."""
  parts = [(tuple(leaf.shape), sorted((d.id, box_of(i, leaf.shape)) for d, i in
                                      leaf.sharding.devices_indices_map(leaf.shape).items()))
           for leaf in jax.tree.leaves(abstract_state)]
  return hashlib.sha256(repr((jax.process_count(), parts)).encode()).hexdigest()[:16]


def successors(mesh: Mesh) -> dict | None:
  """{device id: the device of the same local rank on the next process} of the mesh's devices;
  None with one process or unequal local device counts (no peer copy)."""
  count = jax.process_count()
  by_process: dict[int, list] = {}
  for d in mesh.devices.flat:
    by_process.setdefault(d.process_index, []).append(d)
  if count == 1 or len(by_process) != count or len({len(v) for v in by_process.values()}) != 1:
    return None
  for devices in by_process.values():
    devices.sort(key=lambda d: d.id)
  return {d.id: by_process[(q + 1) % count][j]
          for q, devices in by_process.items() for j, d in enumerate(devices)}


def next_process_mesh(mesh: Mesh) -> Mesh | None:
  """`mesh` with each device replaced by its successor (`successors`): where the peer copy
  lives. None where there is no peer copy."""
  moved = successors(mesh)
  if moved is None:
    return None
  return Mesh(np.vectorize(lambda d: moved[d.id], otypes=[object])(mesh.devices),
              mesh.axis_names, axis_types=mesh.axis_types)


def on_mesh(mesh: Mesh, leaf) -> NamedSharding:
  return NamedSharding(mesh, leaf.sharding.spec)


def restore_target(leaves, indices, mesh: Mesh | None = None) -> dict:
  """The abstract arrays `a<i>` of an item to restore (onto `mesh` instead of their own)."""
  return {f"a{i}": leaves[i] if mesh is None else
          jax.ShapeDtypeStruct(leaves[i].shape, leaves[i].dtype, sharding=on_mesh(mesh, leaves[i]))
          for i in indices}

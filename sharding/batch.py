"""Host data <-> global batch arrays, for any device order.

A process feeds the rows its own devices hold under the batch sharding, and only those. Which
rows those are follows from the sharding (`process_rows`), so the mesh's device order is free:
the rows of a process need not be contiguous, nor in process order, and a row that several
processes hold (the sequence or tensor axis spanning hosts) is read by each of them (a row's
window is a pure function of the step and the row, so they read the same tokens).
"""
from __future__ import annotations

from collections.abc import Sequence

import jax
import numpy as np
from jax.sharding import Sharding


def _rows_of(index, rows: int, row_axis: int) -> range:
  return range(rows)[index[row_axis]]


def process_rows(sharding: Sharding, global_shape: tuple[int, ...], row_axis: int = 0
                 ) -> tuple[int, ...]:
  """The global rows this process's devices hold, in increasing order."""
  rows = set()
  for index in sharding.addressable_devices_indices_map(global_shape).values():
    rows.update(_rows_of(index, global_shape[row_axis], row_axis))
  return tuple(sorted(rows))


def assemble(local: np.ndarray, local_rows: Sequence[int], sharding: Sharding,
             global_shape: tuple[int, ...], row_axis: int = 0) -> jax.Array:
  """A global array from this process's rows (`local` holds `local_rows`, in any order, along
  `row_axis`; every other axis is whole).

  One process holding every row: one `jax.device_put` (XLA splits it onto the devices). Several
  processes: `jax.make_array_from_process_local_data`, which maps the process's device blocks,
  in increasing row order, onto consecutive rows of `local` (ours too); a sharding whose blocks do
  not tile that way (jax refuses it as non-uniform) is assembled device by device instead."""
  if len(local_rows) != local.shape[row_axis]:
    raise ValueError(f"{local.shape[row_axis]} local rows for {len(local_rows)} row ids")
  if any(a > b for a, b in zip(local_rows, local_rows[1:])):  # put them in increasing order
    order = np.argsort(local_rows, kind="stable")
    local, local_rows = np.take(local, order, axis=row_axis), [local_rows[i] for i in order]
  if sharding.is_fully_addressable:
    if tuple(local_rows) != tuple(range(global_shape[row_axis])):
      raise ValueError(f"one process holds every row, got rows {tuple(local_rows)}")
    return jax.device_put(local, sharding)
  try:
    return jax.make_array_from_process_local_data(sharding, local, global_shape)
  except ValueError:
    return _assemble_per_device(local, local_rows, sharding, global_shape, row_axis)


def _assemble_per_device(local: np.ndarray, local_rows: Sequence[int], sharding: Sharding,
                         global_shape: tuple[int, ...], row_axis: int) -> jax.Array:
  position = {row: i for i, row in enumerate(local_rows)}
  pieces = []
  for device, index in sharding.addressable_devices_indices_map(global_shape).items():
    rows = [position[r] for r in _rows_of(index, global_shape[row_axis], row_axis)]
    block = np.take(local, rows, axis=row_axis)
    rest = tuple(slice(None) if axis == row_axis else s for axis, s in enumerate(index))
    pieces.append(jax.device_put(block[rest], device))
  return jax.make_array_from_single_device_arrays(global_shape, sharding, pieces)

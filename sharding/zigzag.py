"""The zig-zag sequence layout of causal ring attention (sharding/ring_attention.py).

Cut a sequence sharded over N devices into 2N chunks; device i holds chunks i and 2N-1-i, in
that order, so every device has the same amount of causal attention work at every ring step
and its local tokens are still in increasing global order. `zigzag` permutes a global array
into that layout (or back) with ppermutes inside shard_map, each chunk moving once; the model
does it once at its input and once at its output (models/llama.py), not per layer.
"""
from __future__ import annotations

import functools

import jax
import jax.numpy as jnp
import numpy as np
from jax import lax
from jax.sharding import PartitionSpec as P

from sharding.rules import BATCH_AXES


def zigzag_order(seq_len: int, n: int) -> np.ndarray:
  """Token indices in zig-zag order: position p of the reordered sequence holds token order[p]."""
  if seq_len % (2 * n):
    raise ValueError(f"zig-zag layout: sequence length {seq_len} is not a multiple of "
                     f"2 x {n} devices")
  chunks = np.arange(seq_len).reshape(2 * n, seq_len // (2 * n))
  return np.concatenate([np.concatenate([chunks[i], chunks[2 * n - 1 - i]]) for i in range(n)])


def _zigzag_moves(n: int):
  """For each (source slot a, destination slot b): the ppermute pairs moving chunk 2d + a of
  device d (natural layout) to slot b of the device that holds it in the zig-zag layout."""
  moves = {}
  for a in (0, 1):
    for b in (0, 1):
      pairs = []
      for d in range(n):
        chunk = 2 * d + a
        owner, slot = (chunk, 0) if chunk < n else (2 * n - 1 - chunk, 1)
        if slot == b:
          pairs.append((d, owner))
      if pairs:
        moves[a, b] = pairs
  return moves


def zigzag_local(x, axis: str, n: int, inverse: bool = False):
  """Inside shard_map: the local block [B, L, ...] of the natural layout -> of the zig-zag one
  (or back). Each chunk moves once, by ppermute; a slot receives exactly one chunk."""
  if n == 1:
    return x
  half = x.shape[1] // 2
  slots = (x[:, :half], x[:, half:])
  out = [None, None]
  for (a, b), pairs in _zigzag_moves(n).items():
    src, dst = (b, a) if inverse else (a, b)
    perm = [(t, s) for s, t in pairs] if inverse else pairs
    moved = lax.ppermute(slots[src], axis, perm)
    out[dst] = moved if out[dst] is None else out[dst] + moved  # the other pairs send zeros
  return jnp.concatenate(out, axis=1)


def split_axes(mesh, names, size: int):
  """The mesh axes among `names` (of size > 1) to split an array dimension of `size` over, as
  a PartitionSpec entry; None when there are none or they do not divide `size`."""
  axes = tuple(a for a in names if a in mesh.axis_names and mesh.shape[a] > 1)
  total = int(np.prod([mesh.shape[a] for a in axes])) if axes else 1
  if not axes or size % total:
    return None
  return axes[0] if len(axes) == 1 else axes


def current_mesh(mesh):
  mesh = jax.sharding.get_abstract_mesh() if mesh is None else mesh
  if mesh.empty:
    raise ValueError("ring attention needs a mesh: pass mesh= or call under jax.set_mesh(mesh)")
  return mesh


def zigzag(x, *, mesh=None, axis: str = "sequence", inverse: bool = False,
           batch_axes=BATCH_AXES):
  """Reorder the sequence axis (axis 1) of a global array [B, S, ...] sharded over `axis` into
  the zig-zag layout (or back with `inverse=True`), by ppermutes inside shard_map."""
  mesh = current_mesh(mesh)
  n = mesh.shape[axis]
  zigzag_order(x.shape[1], n)  # validates the length
  if n == 1:
    return x
  spec = P(split_axes(mesh, batch_axes, x.shape[0]), axis)
  return jax.shard_map(functools.partial(zigzag_local, axis=axis, n=n, inverse=inverse),
                       mesh=mesh, in_specs=spec, out_specs=spec)(x)

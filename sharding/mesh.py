"""Device mesh from the config's `mesh` block, and the NamedShardings the trainer needs."""
from __future__ import annotations

import math
from collections.abc import Mapping

import jax
from jax.sharding import AxisType, Mesh, NamedSharding
from jax.sharding import PartitionSpec as P

from sharding.rules import BATCH_AXES, MESH_AXES


class MeshError(ValueError):
  """The requested mesh cannot be built from the available devices."""


def resolve_mesh_shape(mesh_cfg: Mapping[str, int], num_devices: int) -> dict[str, int]:
  """Sizes of every mesh axis, with at most one -1 filled from the device count."""
  sizes = {name: int(mesh_cfg.get(name, 1)) for name in MESH_AXES}
  fill = [name for name, size in sizes.items() if size == -1]
  bad = [name for name, size in sizes.items() if size == 0 or size < -1]
  if bad:
    raise MeshError(f"mesh.{bad[0]}={sizes[bad[0]]}: axis sizes must be positive (or -1 = fill)")
  if len(fill) > 1:
    raise MeshError(f"mesh: only one axis may be -1 (fill), got {', '.join('mesh.' + f for f in fill)}")
  known = math.prod(size for size in sizes.values() if size != -1)
  if fill:
    if num_devices % known:
      raise MeshError(
          f"mesh.{fill[0]}=-1 cannot fill {num_devices} devices: the other axes multiply to "
          f"{known}, which does not divide {num_devices}")
    sizes[fill[0]] = num_devices // known
  product = math.prod(sizes.values())
  if product != num_devices:
    shape = ", ".join(f"{k}={v}" for k, v in sizes.items() if v != 1) or "all 1"
    raise MeshError(
        f"mesh ({shape}) has {product} devices but {num_devices} are available; make the "
        f"product of mesh.{{{','.join(MESH_AXES)}}} equal {num_devices} or set one axis to -1")
  return sizes


def make_mesh(mesh_cfg: Mapping[str, int], devices=None) -> Mesh:
  """A `jax.sharding.Mesh` with the five named axes, all of type Auto.

  `jax.make_mesh` defaults to Explicit axes, which breaks `with_sharding_constraint`; we pass
  Auto explicitly (see DESIGN.md).
  """
  devices = jax.devices() if devices is None else list(devices)
  sizes = resolve_mesh_shape(mesh_cfg, len(devices))
  shape = tuple(sizes[name] for name in MESH_AXES)
  return jax.make_mesh(shape, MESH_AXES, axis_types=(AxisType.Auto,) * len(MESH_AXES),
                       devices=devices)


def data_parallel_size(mesh_sizes: Mapping[str, int]) -> int:
  """How many ways the batch is split (the product of the batch axes)."""
  return math.prod(int(mesh_sizes.get(a, 1)) for a in BATCH_AXES)


def batch_sharding(mesh: Mesh, *, microbatched: bool = False) -> NamedSharding:
  """Sharding of a token batch [B, S], or [M, B, S] with a leading micro-batch axis."""
  spec = (BATCH_AXES, "sequence")
  return NamedSharding(mesh, P(None, *spec) if microbatched else P(*spec))


def replicated(mesh: Mesh) -> NamedSharding:
  return NamedSharding(mesh, P())


def mesh_platform(mesh) -> str:
  """The platform a program under `mesh` (a Mesh or AbstractMesh) is for: its devices' when
  known (ahead-of-time compiles for other hardware carry it), else the default backend."""
  device = None if mesh.empty else getattr(mesh, "abstract_device", None)
  return device.platform if device is not None else jax.default_backend()

"""Device mesh from the config's `mesh` block (one slice or several; with DiLoCo's `replica` axis in
front), and the NamedShardings the trainer needs."""
from __future__ import annotations

import math
from collections.abc import Mapping

import jax
import numpy as np
from jax.experimental import mesh_utils
from jax.sharding import AxisType, Mesh, NamedSharding
from jax.sharding import PartitionSpec as P

from sharding.rules import BATCH_AXES, MESH_AXES, REPLICA_AXIS


class MeshError(ValueError):
  """The requested mesh cannot be built from the available devices."""


DCN_AXES = tuple(f"dcn_{name}" for name in MESH_AXES)  # config keys: sizes across slices


def num_slices(devices) -> int:
  """How many slices the devices form: groups joined only by the slower data-center network
  (DCN), told apart by `device.slice_index` (TPU multi-slice; also multi-node GPU). Devices
  without a slice index (CPU) are one slice."""
  return len({getattr(d, "slice_index", 0) for d in devices}) or 1


def _fill(sizes: dict[str, int], total: int, prefix: str, unit: str,
          available: str) -> dict[str, int]:
  """`sizes` with at most one -1 filled so that they multiply to `total`. For the messages:
  the config keys are `mesh.<prefix><axis>`, the product counts `unit`, `available` says what
  there is."""
  key = lambda name: f"mesh.{prefix}{name}"
  bad = [name for name, size in sizes.items() if size == 0 or size < -1]
  if bad:
    raise MeshError(f"{key(bad[0])}={sizes[bad[0]]}: axis sizes must be positive (or -1 = fill)")
  fill = [name for name, size in sizes.items() if size == -1]
  if len(fill) > 1:
    raise MeshError(f"mesh: only one axis may be -1 (fill), got {', '.join(map(key, fill))}")
  known = math.prod(size for size in sizes.values() if size != -1)
  if fill:
    if total % known:
      raise MeshError(f"{key(fill[0])}=-1 cannot fill {total} {unit}: the other axes multiply "
                      f"to {known}, which does not divide {total}")
    sizes = {**sizes, fill[0]: total // known}
  product = math.prod(sizes.values())
  if product != total:
    shape = ", ".join(f"{prefix}{k}={v}" for k, v in sizes.items() if v != 1) or "all 1"
    group = ",".join(prefix + name for name in sizes)
    raise MeshError(f"mesh ({shape}) has {product} {unit} but {available}; make the product of "
                    f"mesh.{{{group}}} equal {total} or set one axis to -1")
  return sizes


def resolve_mesh(mesh_cfg: Mapping[str, int], num_devices: int, slices: int = 1,
                 replicas: int = 0) -> tuple[dict[str, int], dict[str, int]]:
  """(sizes inside a slice, sizes across slices) of every mesh axis, each with at most one -1
  filled: `mesh.<axis>` multiply to the devices of one slice, `mesh.dcn_<axis>` to `slices`.

  `replicas` M >= 1 (DiLoCo, `optim.diloco.replicas`) adds the `replica` axis in front: M is a
  multiple of the slices (each slice holds M / slices replicas) or a divisor (each replica is
  slices / M whole slices), and the axis crosses min(M, slices) slices; the other axes then
  fill one replica (the
  `mesh.dcn_*` multiply to the slices of one replica, `mesh.*` to its devices in a slice)."""
  if num_devices % slices:
    raise MeshError(f"{num_devices} devices do not split evenly into {slices} slices")
  if replicas and replicas % slices and slices % replicas:
    raise MeshError(
        f"optim.diloco.replicas={replicas} on {slices} slices: a replica must be whole slices "
        f"or lie inside one (a multiple or a divisor of {slices}), so that what crosses "
        f"replicas is what crosses slices; use e.g. {slices} or {2 * slices}")
  per_slice = num_devices // slices
  dcn_r = min(replicas, slices) if replicas else 1  # M | slices or slices | M (above)
  ici_r = replicas // dcn_r if replicas else 1
  if per_slice % ici_r:
    raise MeshError(
        f"optim.diloco.replicas={replicas} does not divide the {num_devices} devices into equal "
        f"replicas; use a divisor of {num_devices}" if slices == 1 else
        f"optim.diloco.replicas={replicas} does not split {slices} slices of {per_slice} devices "
        f"into equal replicas ({ici_r} per slice do not divide {per_slice}); use a multiple or "
        f"divisor of {slices} whose share of a slice divides {per_slice}")
  dcn = _fill({name: int(mesh_cfg.get(f"dcn_{name}", 1)) for name in MESH_AXES},
              slices // dcn_r, "dcn_", "slice(s)",
              (f"each of the {replicas} replicas (optim.diloco.replicas) spans "
               f"{slices // dcn_r} of the {slices} slices" if replicas else
               f"the devices form {slices}") +
              " (device.slice_index; usually only mesh.dcn_data crosses slices)")
  per_replica = per_slice // ici_r
  available = (f"{per_slice} are available" if slices == 1 and not replicas else
               f"each of the {slices} slices has {per_slice}" if not replicas else
               f"each of the {replicas} replicas (optim.diloco.replicas) has {per_replica}"
               + (" in a slice" if slices > 1 else ""))
  ici = _fill({name: int(mesh_cfg.get(name, 1)) for name in MESH_AXES}, per_replica, "",
              "devices", available)
  if replicas:
    ici, dcn = {REPLICA_AXIS: ici_r, **ici}, {REPLICA_AXIS: dcn_r, **dcn}
  return ici, dcn


def resolve_mesh_shape(mesh_cfg: Mapping[str, int], num_devices: int, slices: int = 1,
                       replicas: int = 0) -> dict[str, int]:
  """Size of every mesh axis over all devices (inside-slice size x across-slice size)."""
  ici, dcn = resolve_mesh(mesh_cfg, num_devices, slices, replicas)
  return {name: ici[name] * dcn[name] for name in ici}


def make_mesh(mesh_cfg: Mapping[str, int], devices=None, *, replicas: int = 0) -> Mesh:
  """A `jax.sharding.Mesh` with the six named axes (`MESH_AXES`), all of type Auto: the one mesh
  builder of training, the tools and the ahead-of-time compiles. `replicas` M >= 1 (a DiLoCo run)
  puts one more axis, `replica` of size M, in front of them (outermost: a replica is a contiguous
  block of devices, whole slices where `resolve_mesh` can make it so, else whole hosts where the
  devices' order allows); 0 (the default) builds the six-axis mesh of every other run.

  One slice: `jax.make_mesh` (it orders devices for the chips' interconnect). It defaults to
  Explicit axes, which breaks `with_sharding_constraint`, so Auto is passed.
  Several slices (devices with more than one `slice_index`, which `jax.make_mesh` refuses):
  `mesh_utils.create_hybrid_device_mesh`, jax's public builder for them; each axis is
  `mesh.dcn_<axis>` blocks of one slice's `mesh.<axis>` devices, so an axis whose DCN size is 1
  never leaves a slice. Physical axes may be split inside a slice (as `jax.make_mesh` allows
  for v5e) so that any per-slice shape that divides the slice builds.
  """
  devices = jax.devices() if devices is None else list(devices)
  slices = num_slices(devices)
  ici, dcn = resolve_mesh(mesh_cfg, len(devices), slices, replicas)
  names = tuple(ici)
  axis_types = (AxisType.Auto,) * len(names)
  if slices == 1:
    return jax.make_mesh(tuple(ici.values()), names, axis_types=axis_types, devices=devices)
  grid = mesh_utils.create_hybrid_device_mesh(
      list(ici.values()), [dcn[name] for name in names], devices, allow_split_physical_axes=True)
  return Mesh(grid, names, axis_types=axis_types)


def replica_count(mesh) -> int:
  """M of a DiLoCo mesh (the size of its `replica` axis); 1 for a mesh without one."""
  return dict(mesh.shape).get(REPLICA_AXIS, 1)


def over_replicas(sharding: NamedSharding) -> NamedSharding:
  """The sharding of an array with a leading [M] replica dimension whose every replica is laid
  out as `sharding` inside its replica."""
  return NamedSharding(sharding.mesh, P(REPLICA_AXIS, *sharding.spec))


def fold_replicas(mesh: Mesh) -> Mesh:
  """The same devices as a plain mesh: the `replica` axis merged into `data` (the replicas'
  devices become data-parallel; in the same order when no axis lies between them), what plain
  data parallelism runs on in place of DiLoCo (trainer/tracking/communication.py compares the two
  programs' communication)."""
  names = mesh.axis_names
  grid = np.moveaxis(mesh.devices, 0, names.index("data") - 1)  # replica next to data
  shape = dict(mesh.shape)
  grid = grid.reshape(*(shape[a] * (shape[REPLICA_AXIS] if a == "data" else 1)
                        for a in MESH_AXES))
  return Mesh(grid, MESH_AXES, axis_types=(AxisType.Auto,) * len(MESH_AXES))


def data_parallel_size(mesh_sizes: Mapping[str, int]) -> int:
  """How many ways the batch is split (the product of the batch axes)."""
  return math.prod(int(mesh_sizes.get(a, 1)) for a in BATCH_AXES)


def batch_sharding(mesh: Mesh, *, microbatched: bool = False) -> NamedSharding:
  """Sharding of a token batch [B, S], or [M, B, S] with a leading micro-batch axis. On a DiLoCo
  mesh the rows are split over the replicas first (replica r holds the r-th block of B/M rows:
  the global batch is the one plain data parallelism would read), then over the batch axes."""
  rows = (REPLICA_AXIS, *BATCH_AXES) if REPLICA_AXIS in mesh.axis_names else BATCH_AXES
  spec = (rows, "sequence")
  return NamedSharding(mesh, P(None, *spec) if microbatched else P(*spec))


def replicated(mesh: Mesh) -> NamedSharding:
  return NamedSharding(mesh, P())


def mesh_platform(mesh) -> str:
  """The platform a program under `mesh` (a Mesh or AbstractMesh) is for: its devices' when
  known (ahead-of-time compiles for other hardware carry it), else the default backend."""
  device = None if mesh.empty else getattr(mesh, "abstract_device", None)
  if device is None and not mesh.empty and isinstance(mesh, Mesh):  # a Mesh of real (or
    device = mesh.devices.flat[0]  # compile-only, e.g. an H100 target's) devices
  return device.platform if device is not None else jax.default_backend()

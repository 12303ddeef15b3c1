"""Compile-only target devices for `tools.aot`: TPU topologies (libtpu's compiler on this CPU
machine, `jax.experimental.topologies`) and H100 GPUs (jax's CUDA plugin, no GPU needed).

Topologies: `v4:2x2x1`, `v5:2x2x1` (v5p), `v5e:2x2`, `v6e:4x4`, ... (libtpu's names: chip
version, then chips along each axis; v4 and v5p run one megacore device per chip, as on real
hardware); `h100:8` (one node), `h100:4x8` (hosts x GPUs). Multi-slice TPU targets have as many
slices as the config's `mesh.dcn_*` sizes multiply to (`config_slices`).
"""
from __future__ import annotations

import contextlib
import dataclasses
import math
import os
import re

import jax
from jax.experimental import topologies

from sharding.mesh import DCN_AXES, num_slices
from trainer.errors import first_line
from trainer.multihost.launch import libtpu_available
from trainer.tracking.peaks import known_hbm_bandwidth, known_hbm_bytes, known_peak_flops

TOPOLOGY_RE = re.compile(r"^(v\d+[a-z]*):(\d+(?:x\d+)+)$")
MEGACORE = ("v4", "v5", "v5p")  # chips whose two TensorCores JAX drives as one device


class AotError(Exception):
  """A user error (topology, config, a program that does not fit): one line, exit code 2."""


class LibtpuMissing(AotError):
  """libtpu is not installed: nothing can be compiled for TPU here."""


@dataclasses.dataclass
class Target:
  name: str  # as given, e.g. "v5e:2x2" ("2x v5e:2x2" for two slices)
  devices: list

  @property
  def slices(self) -> int:
    return num_slices(self.devices)

  @property
  def kind(self) -> str:
    return self.devices[0].device_kind

  @property
  def platform(self) -> str:
    return self.devices[0].platform

  @property
  def hosts(self) -> int:
    return len({d.process_index for d in self.devices})

  @property
  def hbm_bytes(self) -> float | None:
    return known_hbm_bytes(self.kind)

  @property
  def peak_flops(self) -> float | None:
    return known_peak_flops(self.kind)

  @property
  def hbm_bandwidth(self) -> float | None:
    return known_hbm_bandwidth(self.kind)


@contextlib.contextmanager
def _quiet_libtpu():
  """libtpu looks for a TPU VM's worker list and accelerator type when it loads and logs a
  screenful when it finds none; tell it about a one-host VM for the duration of the load."""
  keys = {"TPU_ACCELERATOR_TYPE": "v5litepod-1", "TPU_WORKER_HOSTNAMES": "localhost"}
  saved = {k: os.environ.get(k) for k in keys}
  for k, v in keys.items():
    os.environ.setdefault(k, v)
  try:
    yield
  finally:
    for k, v in saved.items():
      if v is None:
        os.environ.pop(k, None)


def bad_topology(topology: str) -> AotError:
  return AotError(f"--topology {topology!r}: expected CHIP:AxB[xC], e.g. v5e:2x2, v4:2x2x1, "
                  "v5:2x2x1 (v5p), v6e:4x4; or h100:8, h100:2x8 (hosts x GPUs)")


def tpu_target(topology: str, slices: int = 1) -> Target:
  """Compile-only devices of a TPU topology (`v5e:2x2`, `v4:2x2x1`, ...), `slices` of them."""
  match = TOPOLOGY_RE.match(topology)
  if not match:
    raise bad_topology(topology)
  if not libtpu_available():
    raise LibtpuMissing("libtpu is not installed, so nothing can be compiled for TPU here: "
                        "pip install -e \".[tpu]\" (jax pins the libtpu it accepts)")
  # Compile-only devices through jax's public jax.experimental.topologies (no private API).
  chip = match.group(1)
  kwargs = {"chip_config_name": "megacore"} if chip in MEGACORE else {}
  dims = [int(n) for n in match.group(2).split("x")]
  if math.prod(dims) < 4:  # less than libtpu's default host of 2x2x1 chips (v5e:1x1, v6e:2x1)
    kwargs["chips_per_host_bounds"] = (dims + [1, 1])[:3]
  if slices > 1:
    kwargs["num_slices"] = slices
  try:
    with _quiet_libtpu():
      desc = topologies.get_topology_desc(topology, "tpu", **kwargs)
  except Exception as e:  # noqa: BLE001  libtpu's own words are the best explanation
    raise AotError(f"--topology {topology!r}: libtpu cannot describe it ({first_line(e, with_type=False)})") \
        from None
  name = topology if slices == 1 else f"{slices}x {topology}"
  return Target(name, list(desc.devices))


# GPU targets: XLA's GpuTargetConfigProto (what a GPU's StreamExecutor would report), written
# from NVIDIA's public H100 SXM5 numbers (132 SMs, 80 GiB HBM3 at 3.35 TB/s, 50 MiB L2, sm_90).
GPU_TARGETS = {
    "h100": """
gpu_device_info {
  threads_per_block_limit: 1024 threads_per_warp: 32 shared_memory_per_block: 49152
  shared_memory_per_core: 233472 threads_per_core_limit: 2048 core_count: 132
  fpus_per_core: 128 block_dim_limit_x: 2147483647 block_dim_limit_y: 65535
  block_dim_limit_z: 65535 memory_bandwidth: 3352320000000 l2_cache_size: 52428800
  clock_rate_ghz: 1.755 device_memory_size: 84929347584 shared_memory_per_block_optin: 232448
  cuda_compute_capability { major: 9 minor: 0 }
  registers_per_core_limit: 65536 registers_per_block_limit: 65536
}
platform_name: "CUDA"
dnn_version_info { major: 9 minor: 3 }
runtime_version { major: 12 minor: 8 }
device_description_str: "NVIDIA H100 80GB HBM3"
""",
}
GPU_TOPOLOGY_RE = re.compile(r"^(h100):(?:(\d+)x)?(\d+)$")


def gpu_target(topology: str) -> Target:
  """Compile-only devices of `hosts` x `gpus` H100s: `h100:8` (one node), `h100:4x8`.

  Needs jax's CUDA plugin (`pip install jax-cuda12-plugin==<jax version>`; no GPU or driver is
  needed to compile) and `ptxas` on the PATH."""
  match = GPU_TOPOLOGY_RE.match(topology)
  hosts, per_host = int(match.group(2) or 1), int(match.group(3))
  try:
    desc = topologies.get_topology_desc(
        match.group(1), "cuda", target_config=GPU_TARGETS[match.group(1)],
        topology=f"1x{hosts}x{per_host}")
  except (NotImplementedError, RuntimeError) as e:
    raise AotError(f"--topology {topology!r}: jax's CUDA plugin cannot describe it "
                   f"({first_line(e, with_type=False)}); pip install jax-cuda12-plugin=={jax.__version__}") \
        from None
  return Target(topology, list(desc.devices))


def topology_devices(topology: str, slices: int = 1) -> int:
  """How many devices a topology names, read from its name alone (no libtpu or CUDA plugin):
  the chips along each axis multiplied (v4 and v5p: one megacore device per chip) times
  `slices`, or hosts x GPUs. An unknown name is an AotError."""
  gpu, tpu = GPU_TOPOLOGY_RE.match(topology), TOPOLOGY_RE.match(topology)
  if gpu:
    return int(gpu.group(2) or 1) * int(gpu.group(3))
  if not tpu:
    raise bad_topology(topology)
  return math.prod(int(n) for n in tpu.group(2).split("x")) * slices


def config_slices(mesh_cfg) -> int:
  """How many slices the config's mesh spans: the product of its `mesh.dcn_*` sizes."""
  dcn = {key: int(mesh_cfg[key]) for key in DCN_AXES}
  unknown = [key for key, size in dcn.items() if size == -1]
  if unknown:
    raise AotError(f"mesh.{unknown[0]}=-1: an ahead-of-time compile has no slices to count; "
                   f"give the number of slices, e.g. --config.mesh.{unknown[0]}=2")
  return math.prod(dcn.values())


def make_target(topology: str, slices: int = 1) -> Target:
  """A TPU topology (`v5e:2x2`, ...), `slices` of them; or a GPU one (`h100:8`, `h100:2x8`)."""
  if GPU_TOPOLOGY_RE.match(topology):
    if slices != 1:
      raise AotError(f"mesh.dcn_* multiply to {slices} slices, which is for TPU topologies; "
                     "for several GPU hosts use h100:HOSTSxGPUS with the dcn_* sizes at 1")
    return gpu_target(topology)
  return tpu_target(topology, slices)


def config_target(cfg, topology: str) -> Target:
  """The target a run of `cfg` compiles for on `topology`: as many copies of it as the config's
  mesh spans slices (`config_slices`), times `optim.diloco.replicas` for DiLoCo on a TPU
  topology (a replica per copy of the topology, replicas across slices). A GPU topology
  (`h100:HOSTSxGPUS`) names all the devices: DiLoCo's replicas split them, as in training."""
  copies = config_slices(cfg.mesh)
  if not GPU_TOPOLOGY_RE.match(topology):
    copies *= max(int(cfg.optim.diloco.replicas), 1)
  return make_target(topology, copies)

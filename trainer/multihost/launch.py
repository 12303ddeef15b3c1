"""Several processes, one program: how this process joins the run (`resolve`) and the
`jax.distributed` start-up (`initialize`). First match wins:

  1. `distributed.mode="off"`: one process, whatever the environment says;
  2. the config: `distributed.{coordinator_address,num_processes,process_id}`;
  3. the environment: JAX_COORDINATOR_ADDRESS, JAX_NUM_PROCESSES, JAX_PROCESS_ID (each key
     separately: a config value beats its variable);
  4. a cluster manager jax understands (SLURM, Open MPI, a Cloud TPU slice): jax's own cluster
     detection fills in what 2-3 left unset.

Nothing found, or a count of 1: one process, nothing to initialise. A process that cannot reach
the coordinator stops after `distributed.initialization_timeout` seconds with one line
(`DistributedError`, under a `Watchdog`); the agreement check is trainer/multihost/agreement.py.
Why and details: docs/multihost.md#how-the-processes-find-each-other.
"""
from __future__ import annotations

import dataclasses
import os
import sys
import threading
from collections.abc import Mapping

import ml_collections

from trainer.config.defaults import need
from trainer.errors import first_line
from trainer.multihost import platforms

MODES = ("auto", "on", "off")
ENV_COORDINATOR = "JAX_COORDINATOR_ADDRESS"
ENV_NUM_PROCESSES = "JAX_NUM_PROCESSES"
ENV_PROCESS_ID = "JAX_PROCESS_ID"
TPU_VM = "Cloud TPU VM"


class DistributedError(RuntimeError):
  """Processes that cannot start or do not agree; train.py prints one line and exits with 2."""


@dataclasses.dataclass(frozen=True)
class Launch:
  """How this process joins the run. None fields are left to jax's cluster detection."""
  coordinator_address: str | None
  num_processes: int | None
  process_id: int | None
  source: str  # where the values came from, for messages

  def describe(self) -> str:
    who = "?" if self.process_id is None else str(self.process_id)
    many = "?" if self.num_processes is None else str(self.num_processes)
    return (f"process {who} of {many} (coordinator {self.coordinator_address or '?'}; "
            f"from {self.source})")


# ----------------------------------------------------------------------------------------------
# Where the processes come from


def _env_int(environ: Mapping[str, str], name: str) -> int | None:
  text = environ.get(name, "").strip()
  if not text:
    return None
  try:
    return int(text)
  except ValueError:
    raise DistributedError(f"environment variable {name}={text!r}: expected an integer") from None


def _cluster(environ: Mapping[str, str]) -> tuple[str, int | None] | None:
  """(name, process count if cheap to read) of a cluster manager jax can read, or None."""
  slurm = ("SLURM_JOB_ID", "SLURM_STEP_NODELIST", "SLURM_NTASKS", "SLURM_PROCID",
           "SLURM_LOCALID")
  if all(k in environ for k in slurm):
    return "SLURM", _env_int(environ, "SLURM_NTASKS")
  if "OMPI_MCA_orte_hnp_uri" in environ:
    return "Open MPI", _env_int(environ, "OMPI_COMM_WORLD_SIZE")
  hosts = environ.get("TPU_PROCESS_ADDRESSES") or environ.get("TPU_WORKER_HOSTNAMES")
  if hosts:
    return "Cloud TPU (GKE)", len(hosts.split(","))
  if _on_cloud_tpu_vm(environ):
    return TPU_VM, None  # the worker count is on the metadata server: jax reads it
  return None


def libtpu_available() -> bool:
  """Whether libtpu (the TPU runtime and compiler) is installed, where jax looks for it:
  $TPU_LIBRARY_PATH or the `libtpu` package (its public `get_library_path()`)."""
  if os.path.isfile(os.environ.get("TPU_LIBRARY_PATH", "")):
    return True
  try:
    import libtpu  # noqa: PLC0415  optional
  except ImportError:
    return False
  return os.path.isfile(libtpu.get_library_path())


def _on_cloud_tpu_vm(environ: Mapping[str, str]) -> bool:
  """Google TPU chips on this machine's PCI bus, libtpu to drive them, and JAX allowed to use
  them (no JAX_PLATFORMS that leaves TPU out)."""
  chosen = environ.get("JAX_PLATFORMS", "")
  if chosen and "tpu" not in chosen.split(","):
    return False
  return platforms.GOOGLE in platforms.pci_vendors() and libtpu_available()


def resolve(dist_cfg, environ: Mapping[str, str] | None = None) -> Launch | None:
  """How this process joins the run (see the module docstring), or None for one process."""
  environ = os.environ if environ is None else environ
  if dist_cfg.mode == "off":
    return None
  coordinator = dist_cfg.coordinator_address or environ.get(ENV_COORDINATOR) or None
  num = dist_cfg.num_processes or _env_int(environ, ENV_NUM_PROCESSES)
  pid = dist_cfg.process_id if dist_cfg.process_id >= 0 else _env_int(environ, ENV_PROCESS_ID)
  named = [k for k, v in (("coordinator_address", coordinator), ("num_processes", num),
                          ("process_id", pid)) if v is not None]
  unset = {"coordinator_address": "", "num_processes": 0, "process_id": -1}
  from_cfg = [k for k in named if dist_cfg[k] != unset[k]]
  source = ("config" if from_cfg and len(from_cfg) == len(named) else
            "environment" if not from_cfg else "config and environment")
  if named:
    if num == 1:
      return None
    if len(named) == 3:
      if not 0 <= pid < num:
        raise DistributedError(f"distributed.process_id={pid} is not in [0, num_processes="
                               f"{num}) (from the {source})")
      return Launch(coordinator, num, pid, source)
    cluster = _cluster(environ)
    if cluster is None and dist_cfg.mode != "on":
      missing = [k for k in ("coordinator_address", "num_processes", "process_id")
                 if k not in named]
      raise DistributedError(
          f"distributed: {', '.join(named)} given (from the {source}) but not "
          f"{', '.join(missing)}, and no cluster manager (SLURM, Open MPI, Cloud TPU) to ask; "
          f"set distributed.{missing[0]} (or {_env_name(missing[0])}) on every process")
    return Launch(coordinator, num, pid, f"{source} + {cluster[0] if cluster else 'jax'}")
  cluster = _cluster(environ)
  if cluster is None:
    if dist_cfg.mode == "on":
      return Launch(None, None, None, "jax's cluster detection")
    return None
  name, count = cluster
  if count is not None and count <= 1 and dist_cfg.mode != "on":
    return None
  return Launch(None, count, None, name)


def _env_name(key: str) -> str:
  return {"coordinator_address": ENV_COORDINATOR, "num_processes": ENV_NUM_PROCESSES,
          "process_id": ENV_PROCESS_ID}[key]


# ----------------------------------------------------------------------------------------------
# Start-up


def initialize(dist_cfg) -> Launch | None:
  """Join the run's processes (call before anything touches a jax backend). None: one process.

  Raises ConfigError for a malformed `distributed` block and DistributedError for values jax
  rejects. If the processes have not all joined after `initialization_timeout` seconds, this
  process prints one line naming the coordinator and exits with code 2: jax's connect blocks
  in C++ and, when its own deadline passes, aborts the process with a stack trace, so a
  watchdog thread fires first (jax is given a longer deadline). Nothing has been written then.
  """
  check_distributed(dist_cfg)
  launch = resolve(dist_cfg)
  if launch is None:
    return None
  import jax  # noqa: PLC0415  start-up

  if jax.distributed.is_initialized():
    return launch
  timeout = int(dist_cfg.initialization_timeout)
  address = launch.coordinator_address or "the coordinator jax detects"
  late = (f"{launch.describe()} could not join the run within {timeout}s: not every process "
          f"connected to the coordinator at {address}. Check that every process was started "
          f"with the same coordinator address and num_processes, that process 0 is running, and "
          f"that {address} is reachable from this host (raise "
          "distributed.initialization_timeout if hosts start slowly)")
  with Watchdog(timeout, late):
    try:
      jax.distributed.initialize(coordinator_address=launch.coordinator_address,
                                 num_processes=launch.num_processes,
                                 process_id=launch.process_id,
                                 initialization_timeout=2 * timeout + 30)
    except ValueError as e:
      if launch.source == TPU_VM and dist_cfg.mode == "auto":
        return None  # jax found no TPU workers to ask about (before connecting): one process
      raise DistributedError(f"{launch.describe()} could not start jax.distributed: "
                             f"{first_line(e)}") from None
    except Exception as e:  # noqa: BLE001  jax raises RuntimeError/JaxRuntimeError
      raise DistributedError(f"{launch.describe()} could not start jax.distributed: "
                             f"{first_line(e)}") from None
  return launch


EXIT_CODE = 2  # what train.py returns for a user error


class Watchdog:
  """Print `message` and end the process with EXIT_CODE unless the block finishes in time."""

  def __init__(self, seconds: float, message: str):
    self.timer = threading.Timer(seconds, self._fire, args=(message,))
    self.timer.daemon = True

  @staticmethod
  def _fire(message: str) -> None:
    print(f"error: {message}", file=sys.stderr, flush=True)
    os._exit(EXIT_CODE)  # the main thread is blocked inside jax's C++ connect

  def __enter__(self):
    self.timer.start()
    return self

  def __exit__(self, *exc):
    self.timer.cancel()
    return False


# ----------------------------------------------------------------------------------------------
# Agreement




def check_distributed(dist: ml_collections.ConfigDict) -> None:
  """The `distributed` block on its own (checked before jax.distributed starts)."""
  need(dist.mode in ("auto", "on", "off"),
        f"distributed.mode={dist.mode!r}: choose one of auto, on, off")
  need(dist.num_processes >= 0,
        f"distributed.num_processes={dist.num_processes}: must be >= 1 (0 = from the environment)")
  need(dist.process_id >= -1,
        f"distributed.process_id={dist.process_id}: must be >= 0 (-1 = from the environment)")
  need(not dist.num_processes or dist.process_id < dist.num_processes,
        f"distributed.process_id={dist.process_id} must be below "
        f"distributed.num_processes={dist.num_processes}")
  address = dist.coordinator_address
  host, _, port = address.rpartition(":")
  need(not address or (host and port.isdigit() and 0 < int(port) < 65536),
        f"distributed.coordinator_address={address!r}: expected host:port, e.g. 10.0.0.1:1234")
  need(dist.initialization_timeout >= 1,
        f"distributed.initialization_timeout={dist.initialization_timeout}: must be >= 1 second")

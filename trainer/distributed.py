"""Several processes, one program: `jax.distributed` start-up and the agreement check.

JAX's multi-controller runtime runs one Python process per host (per GPU under SLURM); every
process runs the same program on its own devices and the processes meet in collectives. Two
things go wrong at that scale that never do on one machine, and both used to mean a hang:

  * a process cannot reach the coordinator (wrong address, process 0 not started, a firewall):
    `initialize` waits `distributed.initialization_timeout` seconds, then fails with a message
    naming the coordinator, this process and what to check;
  * the processes do not run the same thing (a different override on one host, a stale checkout,
    a host with fewer devices): they would compile different programs and wait for each other
    in a collective forever. `check_agreement` has every process publish a fingerprint (config,
    workdir, source code, library versions, devices) in the coordinator's key-value store and
    compare all of them with process 0's before anything is compiled, so every process stops
    with the same one-line `DistributedError` naming the first difference.

Where the processes come from, first match wins (`resolve`):
  1. `distributed.mode="off"`: one process, whatever the environment says.
  2. the config: `distributed.{coordinator_address,num_processes,process_id}`;
  3. the environment: `JAX_COORDINATOR_ADDRESS`, `JAX_NUM_PROCESSES`, `JAX_PROCESS_ID`
     (each key separately: a config value beats its variable);
  4. a cluster manager jax itself understands: SLURM (`srun`, `SLURM_NTASKS` > 1), Open MPI
     (`mpirun`, `OMPI_COMM_WORLD_SIZE` > 1), a multi-host Cloud TPU slice (`TPU_WORKER_HOSTNAMES`
     or the TPU VM's metadata server); jax fills in what 2-3 left unset.
Nothing found, or a count of 1: a single process and nothing to initialise. `mode="on"` insists
on initialising (jax's own detection must then find the rest).
"""
from __future__ import annotations

import dataclasses
import hashlib
import json
import os
import sys
import threading
import time
from collections.abc import Mapping
from typing import Any

from trainer.config import check_distributed

MODES = ("auto", "on", "off")
ENV_COORDINATOR = "JAX_COORDINATOR_ADDRESS"
ENV_NUM_PROCESSES = "JAX_NUM_PROCESSES"
ENV_PROCESS_ID = "JAX_PROCESS_ID"
# Source directories whose contents every process must agree on (the program it compiles).
CODE_DIRS = ("models", "kernels", "sharding", "optim", "data", "trainer")
ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


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
  if _on_cloud_tpu_vm():
    return "Cloud TPU VM", None  # the worker count is on the metadata server: ask jax
  return None


def _on_cloud_tpu_vm() -> bool:
  """TPU chips on this machine and libtpu to drive them (what jax's own TPU set-up checks; it
  runs later, when the backend starts, so its flag cannot be read yet)."""
  try:
    from jax._src import hardware_utils, xla_bridge  # noqa: PLC0415
    chips, _ = hardware_utils.num_available_tpu_chips_and_device_id()
    return chips > 0 and xla_bridge.get_tpu_library_path() is not None
  except (ImportError, AttributeError):  # moved in a newer jax: then use mode="on" or values
    return False


def _tpu_vm_process_count() -> int:
  """Workers of this TPU slice (times slices), as jax's own TPU detection counts them."""
  from jax._src import clusters  # noqa: PLC0415
  for env in (clusters.GkeTpuCluster, clusters.GceTpuCluster):
    if env.is_env_present():
      return env.get_process_count()
  return 1


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
  if count is None and name == "Cloud TPU VM":
    count = _tpu_vm_process_count()
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
  import jax  # noqa: PLC0415

  if jax.distributed.is_initialized():
    return launch
  timeout = int(dist_cfg.initialization_timeout)
  address = launch.coordinator_address or "the coordinator jax detects"
  late = (f"{launch.describe()} could not join the run within {timeout}s: not every process "
          f"connected to the coordinator at {address}. Check that every process was started "
          f"with the same coordinator address and num_processes, that process 0 is running, and "
          f"that {address} is reachable from this host (raise "
          "distributed.initialization_timeout if hosts start slowly)")
  with _Watchdog(timeout, late):
    try:
      jax.distributed.initialize(coordinator_address=launch.coordinator_address,
                                 num_processes=launch.num_processes,
                                 process_id=launch.process_id,
                                 initialization_timeout=2 * timeout + 30)
    except Exception as e:  # noqa: BLE001  jax raises RuntimeError/ValueError/JaxRuntimeError
      raise DistributedError(f"{launch.describe()} could not start jax.distributed: "
                             f"{_first_line(e)}") from None
  return launch


EXIT_CODE = 2  # what train.py returns for a user error


class _Watchdog:
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


def _first_line(e: BaseException) -> str:
  lines = [line.strip() for line in str(e).strip().splitlines() if line.strip()]
  return f"{type(e).__name__}: {lines[0][:300] if lines else ''}"


# ----------------------------------------------------------------------------------------------
# Agreement


def code_fingerprint(root: str = ROOT) -> str:
  """sha256 over the project's Python sources that make up the compiled program."""
  h = hashlib.sha256()
  for top in CODE_DIRS:
    for dirpath, dirnames, filenames in os.walk(os.path.join(root, top)):
      dirnames[:] = sorted(d for d in dirnames if not d.startswith((".", "__")))
      for name in sorted(filenames):
        if name.endswith(".py"):
          path = os.path.join(dirpath, name)
          h.update(os.path.relpath(path, root).encode() + b"\0")
          with open(path, "rb") as f:
            h.update(f.read() + b"\0")
  return h.hexdigest()[:16]


def fingerprint(cfg, workdir: str) -> dict[str, Any]:
  """What every process of one run must have in common (the process id is left out)."""
  import flax  # noqa: PLC0415
  import jax  # noqa: PLC0415
  import jaxlib  # noqa: PLC0415
  import optax  # noqa: PLC0415

  config = cfg.to_dict()
  config.get("distributed", {}).pop("process_id", None)
  devices = jax.local_devices()
  return {
      "config": config,
      "workdir": os.path.abspath(workdir),
      "code": code_fingerprint(),
      "versions": {"jax": jax.__version__, "jaxlib": jaxlib.__version__,
                   "flax": flax.__version__, "optax": optax.__version__},
      "devices": {"local_count": len(devices), "kind": devices[0].device_kind,
                  "platform": devices[0].platform, "global_count": jax.device_count()},
  }


def _flatten(tree: Any, prefix: str = "") -> dict[str, Any]:
  if not isinstance(tree, dict):
    return {prefix.rstrip("."): tree}
  out = {}
  for key in sorted(tree):
    out.update(_flatten(tree[key], f"{prefix}{key}."))
  return out


HINTS = {
    "config": "start every process with the same config file and --config overrides",
    "workdir": "give every process the same --workdir (on storage they all share)",
    "code": "check out the same commit on every host",
    "versions": "install the same package versions on every host",
    "devices": "give every process the same number and kind of devices",
}


def first_difference(reference: dict, other: dict) -> tuple[str, Any, Any] | None:
  """(dotted key, reference value, other value) of the first difference, or None."""
  a, b = _flatten(reference), _flatten(other)
  for key in sorted(set(a) | set(b)):
    if a.get(key, "<missing>") != b.get(key, "<missing>"):
      return key, a.get(key, "<missing>"), b.get(key, "<missing>")
  return None


def describe_disagreement(prints: list[dict]) -> str | None:
  """One line naming the first process that differs from process 0 and how, or None."""
  for pid, other in enumerate(prints[1:], start=1):
    diff = first_difference(prints[0], other)
    if diff is not None:
      key, mine, theirs = diff
      group, _, name = key.partition(".")
      what = name if group == "config" else key
      return (f"processes disagree before compiling: process 0 has {what}={mine!r}, process "
              f"{pid} has {theirs!r}; {HINTS.get(group, 'make them the same')}")
  return None


_exchanges = 0


def exchange(payload: dict, timeout_s: float) -> list[dict]:
  """Every process's `payload`, in process order, through the coordinator's key-value store.

  No collective is involved, so a process that never arrives (or runs different code) makes
  the others fail after `timeout_s` with a message naming it, rather than hang."""
  import jax  # noqa: PLC0415
  from jax._src import distributed as jax_distributed  # noqa: PLC0415

  global _exchanges
  _exchanges += 1
  client = jax_distributed.global_state.client
  me, count = jax.process_index(), jax.process_count()
  prefix = f"scaletrain/agreement/{_exchanges}"
  client.key_value_set(f"{prefix}/{me}", json.dumps(payload, sort_keys=True, default=str))
  deadline = time.monotonic() + timeout_s
  out = []
  for pid in range(count):
    remaining_ms = max(int((deadline - time.monotonic()) * 1000), 1)
    try:
      out.append(json.loads(client.blocking_key_value_get(f"{prefix}/{pid}", remaining_ms)))
    except Exception:  # noqa: BLE001  a timeout (jax raises its runtime error type)
      raise DistributedError(
          f"process {pid} of {count} did not reach the agreement check within "
          f"{timeout_s:.0f}s (it may have failed earlier: see its own output; or raise "
          "distributed.initialization_timeout)") from None
  return out


def check_agreement(cfg, workdir: str) -> None:
  """Raise DistributedError unless every process runs the same config, code and devices.

  A no-op for a single process. Call after `initialize`, before compiling anything."""
  import jax  # noqa: PLC0415

  if jax.process_count() == 1:
    return
  prints = exchange(fingerprint(cfg, workdir), float(cfg.distributed.initialization_timeout))
  problem = describe_disagreement(prints)
  if problem:
    raise DistributedError(problem)

"""What every process of a run must agree on, and the collectives that agree.

`check_agreement` gathers each process's fingerprint (config, workdir, source code, library
versions, devices) with one small collective (`exchange`, under a watchdog) and stops every
process with the same one-line `DistributedError` naming the first difference, before anything
is compiled. `agree_all` / `agree_any` turn a per-process flag into one answer every process
shares (a decision that leads into a collective must be the same everywhere).
"""
from __future__ import annotations

import hashlib
import json
import os
from typing import Any

import flax
import jax
import jaxlib
import numpy as np
import optax
from jax.experimental import multihost_utils

from trainer.multihost.launch import DistributedError, Watchdog

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))


# Source directories whose contents every process must agree on (the program it compiles).
CODE_DIRS = ("models", "kernels", "sharding", "optim", "data", "trainer")


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
  """What every process of one run must have in common (the process id is left out, and the
  local checkpoint tier's directory: node-local, it may be named differently on each node)."""

  config = cfg.to_dict()
  config.get("distributed", {}).pop("process_id", None)
  config.get("checkpoint", {}).pop("local_dir", None)
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


def flatten(tree: Any, prefix: str = "") -> dict[str, Any]:
  """{"a.b": leaf} of nested dicts, keys sorted."""
  if not isinstance(tree, dict):
    return {prefix.rstrip("."): tree}
  out = {}
  for key in sorted(tree):
    out.update(flatten(tree[key], f"{prefix}{key}."))
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
  a, b = flatten(reference), flatten(other)
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


def exchange(payload: dict, timeout_s: float) -> list[dict]:
  """Every process's `payload` (JSON-able), in process order.

  Two `multihost_utils.process_allgather` collectives: the payloads' lengths, then the payloads
  padded to the longest. A collective waits for every process, so a process that never arrives
  would make the others wait for good: a watchdog ends this one with a line naming the timeout
  after `timeout_s` instead."""
  count = jax.process_count()
  if jax.device_count() != count * jax.local_device_count():
    raise DistributedError(
        f"processes disagree before compiling: this process (process {jax.process_index()}) has "
        f"{jax.local_device_count()} of the run's {jax.device_count()} devices, which is not an "
        f"equal share of {count} processes; give every process the same number and kind of "
        "devices")
  data = np.frombuffer(json.dumps(payload, sort_keys=True, default=str).encode(), np.uint8)
  late = (f"not every one of the {count} processes reached the agreement check within "
          f"{timeout_s:.0f}s (one may have failed earlier: see its own output; or raise "
          "distributed.initialization_timeout)")
  with Watchdog(timeout_s, late):
    sizes = np.asarray(multihost_utils.process_allgather(np.int32(data.size))).reshape(count)
    padded = np.zeros(int(sizes.max()), np.uint8)
    padded[:data.size] = data
    rows = np.asarray(multihost_utils.process_allgather(padded)).reshape(count, -1)
  return [json.loads(row[:n].tobytes()) for row, n in zip(rows, sizes)]


def check_agreement(cfg, workdir: str) -> None:
  """Raise DistributedError unless every process runs the same config, code and devices.

  A no-op for a single process. Call after `initialize`, before compiling anything."""
  if jax.process_count() == 1:
    return
  prints = exchange(fingerprint(cfg, workdir), float(cfg.distributed.initialization_timeout))
  problem = describe_disagreement(prints)
  if problem:
    raise DistributedError(problem)


def agree_all(ok: bool) -> bool:
  """True on every process if `ok` holds on every process (one small all-gather)."""
  if jax.process_count() == 1:
    return bool(ok)
  return bool(np.min(multihost_utils.process_allgather(np.asarray(int(ok), np.int32))))


def agree_any(flag: bool) -> bool:
  """True on every process if `flag` is True on any (one small all-gather)."""
  if jax.process_count() == 1:
    return bool(flag)
  return bool(np.max(multihost_utils.process_allgather(np.asarray(int(flag), np.int32))))


def gather_floats(values: np.ndarray) -> np.ndarray:
  """Every process's `values` (a small float vector), as [processes, len(values)]: one small
  all-gather (the straggler report's, trainer/tracking/straggler.py)."""
  values = np.asarray(values, np.float64)
  if jax.process_count() == 1:
    return values[None]
  return np.asarray(multihost_utils.process_allgather(values.astype(np.float32)),
                    np.float64).reshape(jax.process_count(), -1)

"""The run's identity: drawn at its first start, kept in `<workdir>/run.json` and in every
checkpoint of both tiers (the persistent `run` item, the local tier's meta), so that a local step
of another run is never restored (`run_identity`, `keep_identity`).

  {"id": "3f9a1c2b7d4e", "workdir": "/abs/path", "created": "2026-01-01T00:00:00Z"}

A workdir without run.json, or with the run.json of another path (a copied or moved workdir;
paths are compared as real paths, so a symlink to the same workdir is the same run), is a new
run. The local tier keeps each run's steps in a directory of its own,
`<checkpoint.local_dir>/<id>/` (trainer/checkpoint/local_tier.py). Why:
docs/reliability.md#a-local-step-belongs-to-its-run.
"""
from __future__ import annotations

import glob
import json
import os
import re
import time
import uuid

import jax

from trainer.multihost.agreement import exchange

RUN_FILE = "run.json"


def read_identity(workdir: str) -> dict | None:
  """The identity in `<workdir>/run.json`, or None (missing, unreadable, or not one)."""
  try:
    with open(os.path.join(workdir, RUN_FILE)) as f:
      found = json.load(f)
  except (OSError, ValueError):
    return None
  return found if isinstance(found, dict) and isinstance(found.get("id"), str) else None


def run_identity(workdir: str, timeout_s: float = 300) -> tuple[dict, str | None]:
  """(this run's identity, the line to log if the workdir's run.json was another path's).
  Process 0 reads or draws it, every process gets the same; nothing is written yet (a start that
  fails leaves the workdir as it was: `keep_identity` writes it once the run has started)."""
  workdir = os.path.abspath(workdir)
  identity, note = None, None
  if jax.process_index() == 0:
    identity = read_identity(workdir)
    if identity is not None and not _same_dir(identity.get("workdir"), workdir):
      note = (f"{workdir}/{RUN_FILE} names run {identity['id']} of {identity.get('workdir')} "
              "(a copied or moved workdir): this is a new run")
      identity = None
    if identity is None:
      identity = {"id": uuid.uuid4().hex[:12], "workdir": workdir,
                  "created": time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime())}
  if jax.process_count() > 1:
    lead = exchange({"identity": identity, "note": note}, timeout_s)[0]
    identity, note = lead["identity"], lead["note"]
  return identity, note


def _same_dir(saved: str | None, workdir: str) -> bool:
  """Whether run.json's workdir is this one, however it is reached (a symlink, a mount point
  named otherwise: the real paths are compared)."""
  return isinstance(saved, str) and os.path.realpath(saved) == os.path.realpath(workdir)


def keep_identity(workdir: str, identity: dict) -> None:
  """Write `<workdir>/run.json` if it does not hold this identity (the lead process)."""
  if read_identity(workdir) == identity or jax.process_index() != 0:
    return
  path = os.path.join(workdir, RUN_FILE)
  with open(path + ".tmp", "w") as f:
    json.dump(identity, f)
  os.replace(path + ".tmp", path)


def other_runs(root: str, run_id: str) -> str | None:
  """The line naming what else a local checkpoint directory holds (other runs' steps, steps of
  an earlier version without run identities), never restored by this run and left untouched;
  None if nothing."""
  others, legacy = [], False
  for name in sorted(os.listdir(root)) if os.path.isdir(root) else []:
    path = os.path.join(root, name)
    if name == run_id or not os.path.isdir(path):
      continue
    if re.fullmatch(r"process_\d+", name):
      legacy = True
    elif re.fullmatch(r"[0-9a-f]{12}", name):
      steps = sorted({int(s) for d in glob.glob(os.path.join(path, "process_*"))
                      for s in os.listdir(d) if s.isdigit()})
      workdir = _workdir_of(path, steps[-1]) if steps else None
      others.append(f"run {name}" + (f" of {workdir}" if workdir else "")
                    + f" (steps {', '.join(map(str, steps)) or 'none'})")
  if legacy:
    others.append("process_* of an earlier version, without run identities")
  if not others:
    return None
  return (f"checkpoint.local_dir={root} also holds local checkpoints of {'; '.join(others)}: "
          f"not this run's ({run_id}, under {os.path.join(root, run_id)}), never restored here "
          "and left untouched")


def _workdir_of(run_dir: str, step: int) -> str | None:
  for meta in glob.glob(os.path.join(run_dir, "process_*", str(step), "meta", "metadata")):
    try:
      with open(meta) as f:
        return json.load(f)["run"]["workdir"]
    except (OSError, ValueError, KeyError, TypeError):
      continue
  return None

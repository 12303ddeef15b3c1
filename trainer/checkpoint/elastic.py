"""Restarting on more or fewer devices: what the batch, the schedule's clock and the data
position become (`data.on_resize`, `plan`).

Every checkpoint (both tiers) holds the run's `topology` (devices, processes, mesh, data-parallel
size, micro-batch, batch history, the batch its hyperparameters are stated at); a restart compares
it with its own devices (and `as_resumed` gives the checks before compiling the batch it will run):

  keep     (default) the global batch stays `data.global_batch_size`, in more or fewer
           micro-batches; the losses continue as if nothing happened (to float reduction order)
  rescale  B' = B x dp' / dp and m' = m x dp' / dp (every device keeps its rows), the
           hyperparameters re-derived at B' by the batch rules (optim/scaling.py)

In both modes the data position and the schedule's clock stay exact; a run with a batch ramp or
the autopilot keeps its own batch plan. Why and details:
docs/reliability.md#elastic-restarts-keep-or-rescale-the-batch.
"""
from __future__ import annotations

import copy
import json
import os

import jax
import ml_collections
from jax.sharding import Mesh

from optim import BatchRamp
from sharding.mesh import MeshError, data_parallel_size, num_slices, resolve_mesh_shape


def topology(mesh: Mesh, cfg: ml_collections.ConfigDict, ramp: BatchRamp) -> dict:
  """What a checkpoint records of the devices and batches its steps ran with, and the batch its
  hyperparameters are stated at (the run's first start's, unless optim.reference_batch_size)."""
  return {"devices": jax.device_count(), "processes": jax.process_count(),
          "mesh": {k: int(v) for k, v in mesh.shape.items()},
          "data_parallel": data_parallel_size(mesh.shape),
          "micro_batch": cfg.data.micro_batch_size or cfg.data.global_batch_size,
          "stages": [[int(s), int(b)] for s, b in ramp.stages_by_step()],
          "reference_batch": cfg.optim.reference_batch_size or cfg.data.global_batch_size}


def _describe(t: dict) -> str:
  return (f"{t['devices']} device(s) in {t['processes']} process(es), data-parallel "
          f"{t['data_parallel']}")


def _ramp_text(stages: list[tuple[int, int]], seq_len: int) -> str:
  """A `data.batch_ramp` string ("BATCH:START_TOKENS,...") whose stages start at these steps."""
  ramp = BatchRamp.constant(stages[0][1], seq_len)
  for start, batch in stages[1:]:
    ramp.add_stage(batch, start)
  return ",".join(f"{b}:{t}" for b, t in zip(ramp.batches, ramp.start_tokens))


def _history(saved: dict, step: int) -> list[tuple[int, int]]:
  """The [first step, batch] stages of the steps before `step`."""
  return [(s, b) for s, b in saved["stages"] if s < step] or [(0, saved["stages"][0][1])]


def _rescaled(saved: dict, step: int, dp_now: int) -> tuple[int, int]:
  """(batch, micro-batch) under data.on_resize=rescale: the checkpoint's last ones x dp' / dp
  (both divide by dp: checked when its run started)."""
  dp = saved["data_parallel"]
  return _history(saved, step)[-1][1] // dp * dp_now, saved["micro_batch"] // dp * dp_now


# Batch rules and their "off" values (optim/scaling.py): with all off, nothing moves with B.
RULES = (("lr_rule", "none"), ("weight_decay_rule", "constant"), ("b2_rule", "constant"),
         ("ema_rule", "constant"))


def _rederived(cfg: ml_collections.ConfigDict, batch: int) -> str:
  on = [f"optim.{k}={cfg.optim[k]}" for k, off in RULES if cfg.optim.get(k, off) != off]
  if on:
    return f"hyperparameters re-derived at batch {batch} by {', '.join(on)} (below)"
  return (f"hyperparameters unchanged at batch {batch}: no batch rule is set (optim.lr_rule=none;"
          " e.g. optim.lr_rule=sqrt scales the learning rate with the batch)")


def plan(cfg: ml_collections.ConfigDict, saved: dict | None, step: int, mesh: Mesh,
         ramp: BatchRamp, config_batch: int | None = None
         ) -> tuple[ml_collections.ConfigDict | None, str | None]:
  """(the config to continue with, when it differs from `cfg`; the line to log, if any) for a
  run restored at `step` from a checkpoint with topology `saved` (None: an older checkpoint
  without one; nothing changes). `ramp`: the run's own batch ramp (the program's);
  `config_batch`: the config's data.global_batch_size before `as_resumed`."""
  if not saved:
    return None, None
  now = topology(mesh, cfg, ramp)
  resized = any(saved[k] != now[k] for k in ("devices", "processes", "mesh"))
  d = cfg.data
  if d.batch_ramp:  # a config ramp or the autopilot decides the batch
    return None, (f"resumed on {_describe(now)} (checkpoint: {_describe(saved)}); the batch "
                  "follows data.batch_ramp (data.on_resize=keep)" if resized else None)
  history = _history(saved, step)
  last = history[-1][1]
  dp, dp_now = saved["data_parallel"], now["data_parallel"]
  rescaled = d.on_resize == "rescale"
  if rescaled:
    batch, micro = _rescaled(saved, step, dp_now)
  else:
    batch, micro = d.global_batch_size, d.micro_batch_size or d.global_batch_size
  # 0 states the hyperparameters at the first start's batch, kept in the checkpoints.
  reference = cfg.optim.reference_batch_size or saved.get("reference_batch") or \
      d.global_batch_size
  stages = history + ([(step, batch)] if batch != last else [])
  where = f"resumed on {_describe(now)} (checkpoint: {_describe(saved)})"
  split = f"{batch // micro} micro-batch(es) of {micro} per step"
  notes = []
  if batch == last:
    line = f"{where}: global batch {batch} kept, {split} (data.on_resize={d.on_resize})" \
        if resized else None
  else:
    why = f"data.on_resize=rescale, data-parallel {dp} -> {dp_now}" if rescaled else \
        "the config's data.global_batch_size"
    line = (f"batch {last} -> {batch} sequences from step {step + 1} ({why}), {split}; "
            f"{_rederived(cfg, batch)}; the schedule's clock "
            f"({cfg.optim.schedule_unit}) counts the earlier steps at their batches"
            + (f"; {where}" if resized else ""))
  if rescaled and config_batch not in (None, last, batch):
    notes.append(f"global batch {batch} from the checkpoint (data.on_resize=rescale; "
                 f"data.global_batch_size={config_batch} sets a fresh run's)")
  if reference != (cfg.optim.reference_batch_size or d.global_batch_size):
    notes.append(f"hyperparameters stay stated at batch {reference}, the run's first start's "
                 "(optim.reference_batch_size=0; set it to state them at another batch)")
  line = "; ".join([x for x in [line, *notes] if x]) or None
  if len(stages) == 1 and batch == d.global_batch_size and micro == (d.micro_batch_size or batch) \
      and reference == (cfg.optim.reference_batch_size or d.global_batch_size):
    return None, line
  new = copy.deepcopy(cfg)
  new.optim.reference_batch_size = reference
  new.data.global_batch_size = batch
  new.data.micro_batch_size = micro
  if len(stages) > 1:
    new.data.batch_ramp = _ramp_text(stages, d.seq_len)
  return new, line


def as_resumed(cfg: ml_collections.ConfigDict, workdir: str, devices) -> ml_collections.ConfigDict:
  """`cfg` with the batch a restart in `workdir` will run on `devices`, for the checks before
  compiling: under data.on_resize=rescale, the newest checkpoint's batch scaled to them (what
  `plan` derives after the restore); else `cfg` itself."""
  d = cfg.data
  found = _newest_topology(os.path.join(workdir, "checkpoints")) \
      if d.on_resize == "rescale" and not d.batch_ramp else None
  if found is None:
    return cfg
  try:
    sizes = resolve_mesh_shape(cfg.mesh, len(devices), num_slices(devices),
                               cfg.optim.diloco.replicas)
  except MeshError:
    return cfg  # the checks say what is wrong with the mesh
  new = copy.deepcopy(cfg)
  new.data.global_batch_size, new.data.micro_batch_size = _rescaled(
      found[1], found[0], data_parallel_size(sizes))
  return new


def _newest_topology(directory: str) -> tuple[int, dict] | None:
  """(step, topology) of the newest checkpoint under `directory` that records one, or None."""
  steps = sorted((int(n) for n in os.listdir(directory) if n.isdigit()), reverse=True) \
      if os.path.isdir(directory) else []
  for step in steps:
    try:
      with open(os.path.join(directory, str(step), "topology", "metadata")) as f:
        saved = json.load(f)
      _rescaled(saved, step, 1)  # the fields the rescale reads
      return step, saved
    except (OSError, ValueError, KeyError, TypeError, IndexError, ZeroDivisionError):
      continue
  return None

"""Restarting on more or fewer devices: what the batch, the schedule's clock and the data
position become (`data.on_resize`, `plan`).

Every checkpoint (both tiers) holds the run's `topology` (devices, processes, mesh, data-parallel
size, micro-batch, batch history); a restart compares it with its own devices:

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

import jax
import ml_collections
from jax.sharding import Mesh

from optim import BatchRamp
from sharding.mesh import data_parallel_size


def topology(mesh: Mesh, cfg: ml_collections.ConfigDict, ramp: BatchRamp) -> dict:
  """What a checkpoint records of the devices and batches its steps ran with."""
  return {"devices": jax.device_count(), "processes": jax.process_count(),
          "mesh": {k: int(v) for k, v in mesh.shape.items()},
          "data_parallel": data_parallel_size(mesh.shape),
          "micro_batch": cfg.data.micro_batch_size or cfg.data.global_batch_size,
          "stages": [[int(s), int(b)] for s, b in ramp.stages_by_step()]}


def _describe(t: dict) -> str:
  return (f"{t['devices']} device(s) in {t['processes']} process(es), data-parallel "
          f"{t['data_parallel']}")


def _ramp_text(stages: list[tuple[int, int]], seq_len: int) -> str:
  """A `data.batch_ramp` string ("BATCH:START_TOKENS,...") whose stages start at these steps."""
  ramp = BatchRamp.constant(stages[0][1], seq_len)
  for start, batch in stages[1:]:
    ramp.add_stage(batch, start)
  return ",".join(f"{b}:{t}" for b, t in zip(ramp.batches, ramp.start_tokens))


def plan(cfg: ml_collections.ConfigDict, saved: dict | None, step: int, mesh: Mesh,
         ramp: BatchRamp) -> tuple[ml_collections.ConfigDict | None, str | None]:
  """(the config to continue with, when it differs from `cfg`; the line to log, if any) for a
  run restored at `step` from a checkpoint with topology `saved` (None: an older checkpoint
  without one; nothing changes). `ramp`: the run's own batch ramp (the program's)."""
  if not saved:
    return None, None
  now = topology(mesh, cfg, ramp)
  resized = any(saved[k] != now[k] for k in ("devices", "processes", "mesh"))
  d = cfg.data
  if d.batch_ramp:  # a config ramp or the autopilot decides the batch
    return None, (f"resumed on {_describe(now)} (checkpoint: {_describe(saved)}); the batch "
                  "follows data.batch_ramp (data.on_resize=keep)" if resized else None)
  history = [(s, b) for s, b in saved["stages"] if s < step] or [(0, saved["stages"][0][1])]
  last = history[-1][1]
  dp, dp_now = saved["data_parallel"], now["data_parallel"]
  rescaled = d.on_resize == "rescale"
  if rescaled:  # from the checkpoint's batch; both divide by dp (checked when its run started)
    batch, micro = last // dp * dp_now, saved["micro_batch"] // dp * dp_now
  else:
    batch, micro = d.global_batch_size, d.micro_batch_size or d.global_batch_size
  stages = history + ([(step, batch)] if batch != last else [])
  where = f"resumed on {_describe(now)} (checkpoint: {_describe(saved)})"
  split = f"{batch // micro} micro-batch(es) of {micro} per step"
  if batch == last:
    line = f"{where}: global batch {batch} kept, {split} (data.on_resize={d.on_resize})" \
        if resized else None
  else:
    why = f"data.on_resize=rescale, data-parallel {dp} -> {dp_now}" if rescaled else \
        "the config's data.global_batch_size"
    line = (f"batch {last} -> {batch} sequences from step {step + 1} ({why}), {split}; "
            f"hyperparameters re-derived at batch {batch} (below); the schedule's clock "
            f"({cfg.optim.schedule_unit}) counts the earlier steps at their batches"
            + (f"; {where}" if resized else ""))
  if len(stages) == 1:
    return None, line
  new = copy.deepcopy(cfg)
  new.optim.reference_batch_size = cfg.optim.reference_batch_size or d.global_batch_size
  new.data.global_batch_size = batch
  new.data.micro_batch_size = micro
  new.data.batch_ramp = _ramp_text(stages, d.seq_len)
  return new, line

"""Restarting on more or fewer devices: what the batch, the schedule's clock and the data
position become (`data.on_resize`).

Every checkpoint (both tiers) holds the run's `topology`: devices, processes, mesh, the
data-parallel size (mesh.data x fsdp x expert), the micro-batch, and the batch history as
[first step, batch] stages. A restart compares it with its own devices:

  keep     (default) the global batch stays the config's `data.global_batch_size`; more or
           fewer devices take more or fewer micro-batches (`data.micro_batch_size` of the
           restart). A step's sequences do not depend on micro-batching, devices or processes
           (docs/data.md), so the losses continue as if nothing happened (up to the order of
           float reductions).
  rescale  the batch follows the data-parallel devices: B' = B x dp' / dp (B the checkpoint's
           last batch), and the micro-batch m' = m x dp' / dp, so every device keeps its rows
           per step and per micro-batch (a restart takes them from the checkpoint, not from
           `data.global_batch_size` and `micro_batch_size`, which set a fresh run's). The hyperparameters are re-derived at B' by the batch
           rules from the values stated at the reference batch (`optim.reference_batch_size`,
           0 = the config's `data.global_batch_size`; optim/scaling.py).

What stays exact across a resize, in both modes:
  * the data position: the checkpoint's count of windows read; step r + 1 reads the windows
    [g, g + B') of the same order, so no sequence is skipped or read twice;
  * the schedule's clock: the batch history becomes the run's batch ramp (the stages before the
    resize, then B' from the restored step), which the schedules read (optim/ramp.py). With
    `optim.schedule_unit="steps"` the clock is the optimizer step, so the learning rate at step
    n is the curve's value at n at any batch (and `steps` still ends the run); with "examples"
    or "tokens" the clock is the sequences or tokens the applied steps consumed, summed over the
    history, so the schedule continues from exactly the tokens seen (lengths are then best given
    in that unit, as a batch ramp's are).
The resize is said in one line; the hyperparameters at every batch of the history are printed
and written to metrics.jsonl as at any start (trainer/tracking/report.py).

Runs whose config sets a batch ramp or the batch autopilot (`data.batch_ramp`) keep their own
batch plan: a resize there is `keep` (the config checks refuse `rescale` with them).
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

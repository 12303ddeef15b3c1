"""Runs that tools and experiments drive: a run's own record (its metrics.jsonl, the examples
seen through its batch changes, its eval curve and where it crossed a target loss), training one
config in-process, and branching a run from one of its checkpoints (the config it was written with, its schedule's
lengths in tokens).

Every run trains through `trainer.loop.Run` exactly as train.py does (the same data order,
checkpoints and metrics.jsonl), in this process, in a workdir of its own. Examples seen are read
from the run's record, never computed as step x batch: a run's batch can change (a ramp, or the
batch autopilot's decisions, logged as `batch_change` events), so the examples before step n are
those of the run's ramp (`ramp_from_rows` rebuilds the autopilot's from its events). The tools
(tools/batch_sweep.py, tools/batch_probe.py) and the experiments (experiments/common.py
re-exports these) share them; this module is below both, so no tool imports an experiment.
"""
from __future__ import annotations

import dataclasses
import json
import math
import os
import shutil
import time
from collections.abc import Callable

from tools.batch_sweep import crossing, smooth

# ------------------------------------------------------------------------------------------------
# A run's own record (no jax)


def read_rows(workdir: str) -> list[dict]:
  """Every row of a run's metrics.jsonl (training, evaluation and event rows)."""
  with open(os.path.join(workdir, "metrics.jsonl")) as f:
    return [json.loads(line) for line in f if line.strip()]


def ramp_from_rows(rows: list[dict], start_batch: int, seq_len: int):
  """The batch of every step as the run recorded it: `start_batch`, changed by each
  `batch_change` event (`from_step` is 1-based) in the order they were written. A run without
  events had a constant batch."""
  from optim.ramp import BatchRamp  # noqa: PLC0415  (jax.numpy only inside traced helpers)
  ramp = BatchRamp.constant(int(start_batch), int(seq_len))
  seen = set()
  for r in rows:
    if r.get("event") != "batch_change":
      continue
    key = (int(r["from_step"]), int(r["batch"]))
    if key in seen:  # a resumed run may write an event again: same decision, same stage
      continue
    seen.add(key)
    if int(r["old_batch"]) != ramp.batches[-1]:
      raise ValueError(f"batch_change at step {r['step']} is from {r['old_batch']}, but the "
                       f"record's batch was {ramp.batches[-1]}")
    ramp.add_stage(int(r["batch"]), int(r["from_step"]) - 1)
  return ramp


def eval_curve(rows: list[dict], ramp, key: str = "eval_loss") -> list[tuple[float, float]]:
  """[(examples seen at the evaluation, value)] of the run's evaluation rows."""
  return [(float(ramp.examples_before(r["step"])), float(r[key])) for r in rows
          if key in r and "event" not in r]


def train_curve(rows: list[dict], ramp, key: str = "loss") -> list[tuple[float, float]]:
  """[(examples seen after the step, value)] of the logged training rows."""
  return [(float(ramp.examples_before(r["step"])), float(r[key])) for r in rows
          if key in r and "event" not in r and "eval_loss" not in r]


@dataclasses.dataclass(frozen=True)
class Reached:
  """Where a run's smoothed eval curve crossed the target: examples, tokens and (fractional,
  through the run's ramp) optimizer steps."""
  examples: float
  tokens: float
  steps: float


def to_target(curve: list[tuple[float, float]], ramp, target: float,
              smooth_examples: float) -> Reached | None:
  """Examples, tokens and steps at which the eval curve, averaged over a centered window of
  `smooth_examples` examples (`tools.batch_sweep.smooth`), first falls to `target`
  (interpolated between evaluations); None if it never does."""
  examples = crossing(smooth(curve, smooth_examples / 2), target)
  if examples is None:
    return None
  return Reached(examples, examples * ramp.seq_len, ramp.step_at_examples(examples))


def target_stop(target: float, smooth_examples: float, examples_at: Callable[[int], float],
                max_examples: float = math.inf) -> Callable[[int, dict], str | None]:
  """A `Run(stop_when=...)` callback: stop once the smoothed eval curve (examples from
  `examples_at(step)`, the run's ramp) is at or below `target`, or `max_examples` are seen."""
  evals: list[tuple[float, float]] = []

  def stop_when(step: int, row: dict) -> str | None:
    seen = examples_at(step)
    if "eval_loss" in row:
      evals.append((seen, row["eval_loss"]))
      low = [x for x, y in smooth(evals, smooth_examples / 2) if y <= target]
      if low:
        return f"smoothed eval loss <= {target} at {low[0]:,.0f} examples"
    if seen >= max_examples:
      return f"{max_examples:,.0f} examples seen without reaching eval loss {target}"
    return None

  return stop_when


# ------------------------------------------------------------------------------------------------
# Training in-process, and branching


@dataclasses.dataclass
class Trained:
  status: str
  steps_run: int
  seconds: float
  rows: list[dict]
  ramp: object  # optim.ramp.BatchRamp rebuilt from the record
  workdir: str

  @property
  def final_eval(self) -> float | None:
    evals = [r["eval_loss"] for r in self.rows if "eval_loss" in r]
    return evals[-1] if evals else None


def train(cfg, workdir: str, *, stop=None, fresh: bool = True,
          keep_checkpoints: bool = False) -> Trained:
  """Train `cfg` in `workdir` through `trainer.loop.Run` (validated first: a config mistake is a
  ConfigError before anything compiles). `fresh` clears the workdir first (the experiments own
  their run directories); otherwise the run resumes from its checkpoints as train.py would.
  `stop(run)` returns the run's `stop_when(step, row)` callback (it may read the live ramp,
  `run.ramp`). A run that diverges under `trainer.nonfinite_policy="stop"` is a result (status
  "nonfinite"); any other early end raises."""
  import jax  # noqa: PLC0415
  from trainer.config_checks import validate  # noqa: PLC0415
  from trainer.loop import Run  # noqa: PLC0415
  validate(cfg, jax.devices())
  if fresh and os.path.exists(workdir):
    shutil.rmtree(workdir)
  run = Run(cfg, workdir)
  if stop is not None:
    run.stop_when = stop(run)
  t0 = time.perf_counter()
  result = run.train()
  seconds = time.perf_counter() - t0
  if result.status not in ("done", "nonfinite"):
    raise RuntimeError(f"run in {workdir} ended {result.status}: {result.message}")
  if not keep_checkpoints:
    shutil.rmtree(os.path.join(workdir, "checkpoints"), ignore_errors=True)
  rows = read_rows(workdir)
  # The autopilot's ramp from its recorded decisions; a configured ramp is the run's own.
  d = run.cfg.data
  ramp = ramp_from_rows(rows, d.global_batch_size, d.seq_len) if d.batch_ramp in ("", "auto") \
      else run.ramp
  return Trained(result.status, result.step, seconds, rows, ramp, workdir)


def copy_checkpoint(source_workdir: str, step: int, workdir: str) -> None:
  """A fresh `workdir` holding only checkpoint `step` of `source_workdir` (the branch resumes
  from it as a restarted run would)."""
  if os.path.exists(workdir):
    shutil.rmtree(workdir)
  os.makedirs(os.path.join(workdir, "checkpoints"))
  shutil.copytree(os.path.join(source_workdir, "checkpoints", str(step)),
                  os.path.join(workdir, "checkpoints", str(step)))


def load_run(workdir: str, step: int):
  """The config checkpoint `step` of the run in `workdir` was written with (ConfigDict)."""
  from trainer.checkpoint import CheckpointError  # noqa: PLC0415
  from trainer.cli import from_dict  # noqa: PLC0415
  from trainer.config import ConfigError  # noqa: PLC0415
  from trainer.inference import source_config  # noqa: PLC0415
  directory = os.path.join(workdir, "checkpoints")
  have = sorted(int(n) for n in os.listdir(directory) if n.isdigit()) \
      if os.path.isdir(directory) else []
  if step not in have:
    raise ConfigError(f"{workdir} has no checkpoint at step {step} (it has "
                      f"{', '.join(map(str, have)) or 'none'}); train the run with "
                      "--config.checkpoint.every_steps dividing the steps to branch from and "
                      "--config.checkpoint.keep covering them")
  try:
    _, saved = source_config(os.path.join(directory, str(step)))
  except CheckpointError as e:
    raise ConfigError(str(e)) from None
  return from_dict(saved, f"{directory}/{step}")


def schedule_in_tokens(cfg) -> dict:
  """{optim key: value} giving every length of the run's schedule in tokens at its batch (the
  shape the run had, kept in tokens at any batch), the horizon included."""
  from optim.ramp import UNITS, BatchRamp  # noqa: PLC0415
  from optim.schedules import length  # noqa: PLC0415
  ramp = BatchRamp.constant(cfg.data.global_batch_size, cfg.data.seq_len)
  out = {f"{what}_{u}": 0 for what in ("warmup", "decay") for u in UNITS}
  out["warmup_tokens"] = int(round(length(cfg.optim, "warmup", "tokens", ramp)))
  out["decay_tokens"] = int(round(length(cfg.optim, "decay", "tokens", ramp,
                                         default_steps=cfg.steps)))
  out["schedule_unit"] = "tokens"
  return out

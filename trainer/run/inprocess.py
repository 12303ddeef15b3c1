"""Training a config in this process, as train.py would (`train`), and branching a run from one
of its checkpoints (`copy_checkpoint`, `load_run`: the config it was written with;
`schedule_in_tokens`: its schedule's lengths in tokens). For the research tools (batch sweep,
branching probe) and the experiments; each run trains through `trainer.run.loop.Run` in a workdir
of its own, with the same data order, checkpoints and metrics.jsonl as train.py. A finished run
leaves `finished.json` (its config's fingerprint) last; `finished` reads such a run back instead
of training it again (`same_fingerprint`: the comparison, shared with the scaling lab's records).
"""
from __future__ import annotations

import dataclasses
import json
import os
import shutil
import time

from trainer.config.cli import from_dict
from trainer.config.defaults import ConfigError, default_config
from trainer.tracking.record import ramp_from_rows, read_rows


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


def train(cfg, workdir: str, *, stop=None, stop_key: str | None = None, fresh: bool = True,
          keep_checkpoints: bool = False, reuse: bool = False) -> Trained:
  """Train `cfg` in `workdir` through `trainer.run.loop.Run` (validated first: a config mistake is a
  ConfigError before anything compiles). `fresh` clears the workdir first (the experiments own
  their run directories); otherwise the run resumes from its checkpoints as train.py would.
  `stop(run)` returns the run's `stop_when(step, row)` callback (it may read the live ramp,
  `run.ramp`); `stop_key` states the rule (its parameters) so that the finished record holds it
  and `finished` can read a stopped run back. `reuse`: a run that already finished in `workdir`
  with the same config and stop rule is read back (`finished`) instead of trained, so a long
  sweep killed part-way resumes by run (not for a stop rule without its `stop_key`, a run that
  resumes from its checkpoints, or one whose checkpoints the caller keeps). A run that diverges
  under `trainer.nonfinite_policy="stop"` is a result (status "nonfinite"); any other early end
  raises."""
  if reuse and fresh and not keep_checkpoints and (stop is None or stop_key is not None):
    done = finished(cfg, workdir, stop_key)
    if done is not None:
      print(f"[reuse] {workdir}: read from its finished.json", flush=True)
      return done
  import jax  # noqa: PLC0415  start-up
  from trainer.config.checks import validate  # noqa: PLC0415  start-up
  from trainer.run.loop import Run  # noqa: PLC0415  start-up
  said = fingerprint(cfg)  # the config as the caller states it, before the run fills it in
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
  if stop is None or stop_key is not None:  # a record of the run, with its stop rule stated
    tmp = os.path.join(workdir, "finished.json.tmp")
    with open(tmp, "w") as f:
      json.dump({"fingerprint": said, "stop": stop_key, "status": result.status,
                 "steps_run": result.step, "seconds": seconds, "seq_len": ramp.seq_len,
                 "stages": list(zip(ramp.batches, ramp.start_tokens)), "cuts": ramp.cuts}, f)
    os.replace(tmp, os.path.join(workdir, FINISHED))
  return Trained(result.status, result.step, seconds, rows, ramp, workdir)


FINISHED = "finished.json"


def fingerprint(cfg) -> str:
  """What a finished run's record is compared on: its whole config."""
  return json.dumps({"config": cfg.to_dict()}, sort_keys=True, default=str)


def finished(cfg, workdir: str, stop_key: str | None = None) -> Trained | None:
  """The run of `cfg` in `workdir` read from its record, if a run of the same config (up to
  `same_fingerprint`) trained there to its end under the same stop rule (`stop_key`, as `train`
  was given it; None: no rule); else None. A run killed before its end has no finished.json and
  is trained again. The ramp is the run's stages (a Seesaw ramp without its plan)."""
  path = os.path.join(workdir, FINISHED)
  if not os.path.exists(path):
    return None
  with open(path) as f:
    saved = json.load(f)
  if saved.get("stop") != stop_key or not same_fingerprint(saved["fingerprint"], fingerprint(cfg)):
    return None
  from optim.ramp import BatchRamp  # noqa: PLC0415  start-up
  ramp = BatchRamp([tuple(s) for s in saved["stages"]], saved["seq_len"], tuple(saved["cuts"]))
  return Trained(saved["status"], saved["steps_run"], saved["seconds"], read_rows(workdir), ramp,
                 workdir)


def same_fingerprint(saved: str, now: str) -> bool:
  """Whether a record's fingerprint is the job's: equal, up to config options that one of them
  lacks while the other holds that option's default (an option added to the stack since the
  record was written, at its default, which leaves training as it was)."""
  if saved == now:
    return True
  from trainer.multihost.agreement import flatten  # noqa: PLC0415  start-up

  try:
    a, b = flatten(json.loads(saved)), flatten(json.loads(now))
  except (json.JSONDecodeError, AttributeError):  # not a job's JSON object: unequal strings differ
    return False
  defaults = flatten({"config": default_config().to_dict()})
  missing = object()
  for key in set(a) | set(b):
    x, y = a.get(key, missing), b.get(key, missing)
    if x == y:
      continue
    present = y if x is missing else x if y is missing else missing
    if present is missing or key not in defaults or defaults[key] != present:
      return False
  return True


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
  from trainer.checkpoint.model_dirs import source_config  # noqa: PLC0415  start-up
  from trainer.checkpoint.saved import CheckpointError  # noqa: PLC0415  start-up
  if not os.path.isdir(workdir):
    raise ConfigError(f"{workdir} does not exist" + (" (it is a file)" if os.path.exists(workdir)
                      else "") + "; give the --workdir of a trained run")
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
  from optim.ramp import UNITS, BatchRamp  # noqa: PLC0415  start-up
  from optim.schedules import length  # noqa: PLC0415  start-up
  ramp = BatchRamp.constant(cfg.data.global_batch_size, cfg.data.seq_len)
  out = {f"{what}_{u}": 0 for what in ("warmup", "decay") for u in UNITS}
  out["warmup_tokens"] = int(round(length(cfg.optim, "warmup", "tokens", ramp)))
  out["decay_tokens"] = int(round(length(cfg.optim, "decay", "tokens", ramp,
                                         default_steps=cfg.steps)))
  out["schedule_unit"] = "tokens"
  return out

"""The scaling lab's runs: one (width, batch, rate multiplier, seed) each, trained in worker
processes, resumable (experiments/critical_batch_scaling.py decides which to run).

A run writes `result.json` (its fingerprint: config, batch, rate, evaluation settings) last; a
run whose record covers its stop rule is read, never retrained, so a killed lab picks up where it
stopped (a run cut off mid-way starts again). `--read_only` trains nothing and reports what is
pending.
"""
from __future__ import annotations

import argparse
import concurrent.futures
import dataclasses
import json
import math
import multiprocessing
import os

from experiments import common
from tools import batch_sweep
from trainer.config.cli import from_dict
from trainer.multihost import platforms
from trainer.run.inprocess import same_fingerprint


@dataclasses.dataclass(frozen=True)
class Task:
  width: int
  batch: int
  lr_multiplier: float
  seed: int
  b2: float = 0.0  # a fixed Adam b2 (experiments/scaling_b2.py); 0: the config's rule
  depth: int = 0  # num_layers on a depth grid (`--depths`); 0: the config's (a width-only lab)

  @property
  def name(self) -> str:
    b2 = f"_b2{self.b2:g}" if self.b2 else ""
    depth = f"_L{self.depth}" if self.depth else ""
    return f"d{self.width}{depth}/b{self.batch}_lr{self.lr_multiplier:g}{b2}_s{self.seed}"

  @property
  def size(self):
    """The key of its targets and counts: the width, or (width, depth) on a depth grid."""
    return (self.width, self.depth) if self.depth else self.width


def job(task: Task, cfg, args, stop: dict) -> dict:
  """What a worker needs to train `task` (picklable; `cfg` is the task's own config), its
  workdir and fingerprint: the run's config and the settings that shape its record (not the
  stop rule, which a record may cover)."""
  run_args = dict(micro_batch_size=args.micro_batch_size, eval_examples=args.eval_interval,
                  eval_sequences=args.eval_sequences, smooth_examples=args.smooth_lowest,
                  curve=args.curve)
  fingerprint = json.dumps(dict(config=cfg.to_dict(), batch=task.batch,
                                lr_multiplier=task.lr_multiplier, **run_args),
                           sort_keys=True, default=str)
  return dict(config=cfg.to_dict(), batch=task.batch, lr_multiplier=task.lr_multiplier,
              args={**run_args, **stop}, workdir=os.path.join(args.workdir, task.name),
              fingerprint=fingerprint, reference=stop["target_loss"] == -math.inf)


def reference_stop(args) -> dict:
  """A reference run's stop rule: `--reference_factor` x the largest budget, no target."""
  return dict(target_loss=-math.inf, min_examples=0, max_examples=args.reference_examples)


def grid_stop(t: Task, target: float, ref: int, args) -> dict:
  """A grid run's: past `target` (its width's lowest) with the largest budget seen. The run at
  the reference batch and rate shares the reference run's record, so it also trains that long
  (else a record cut at the target is retrained as a reference, then as a grid run, ...)."""
  shared = (t.batch, t.lr_multiplier) == (ref, 1.0)
  return dict(target_loss=target, max_examples=args.max_examples,
              min_examples=args.reference_examples if shared else args.min_examples)


def covered(j: dict, seq_len: int) -> bool:
  """Whether the run in j's workdir finished with j's fingerprint and its record covers j's stop
  rule: the target crossed with min_examples seen, or max_examples seen."""
  path = os.path.join(j["workdir"], "result.json")
  if not os.path.exists(path):
    return False
  with open(path) as f:
    saved = json.load(f)
  if not same_fingerprint(saved["fingerprint"], j["fingerprint"]):
    return False
  a, r = j["args"], saved["result"]
  seen = common.ramp_from_rows(common.read_rows(j["workdir"]), r["batch_size"],
                               seq_len).examples_before(r["steps_run"])
  if seen >= a["max_examples"]:
    return True
  hit = common.crossings(j["workdir"], r["batch_size"], seq_len, [a["target_loss"]],
                         a["smooth_examples"], curve_key(a.get("curve", "raw")))[0]
  return hit["steps"] is not None and seen >= a["min_examples"]


def rows_of(t: Task, r: dict, j: dict, targets, counts, args, seq) -> list[dict]:
  """A run's row per budget: the crossing of that budget's target on the curve smoothed over
  its own window (steps an upper bound, `censored`, where the curve starts below it) and the
  loss after D."""
  key = curve_key(args.curve)
  out = []
  for d, target in zip(args.budgets, targets[t.size]):
    hit = common.crossings(j["workdir"], t.batch, seq, [target], args.smooth[d], key)[0]
    loss = common.loss_at(j["workdir"], t.batch, seq, [d], args.smooth[d], key)[0]
    out.append(dict(width=t.width, **({"depth": t.depth} if t.depth else {}),
                    params=counts[t.size]["total"], seed=t.seed,
                    batch_size=t.batch, lr_multiplier=t.lr_multiplier,
                    learning_rate=r["learning_rate"], budget=d, budget_tokens=d * seq,
                    target=target, steps=hit["steps"], examples=hit["examples"],
                    tokens=hit["tokens"], noise_scale=hit["noise_scale"],
                    noise_scale_precond=hit["noise_scale_precond"], censored=hit["first"],
                    micro_batches=r["micro_batches"], loss_at_budget=loss, warmup=args.warmup,
                    steps_run=r["steps_run"], seconds=r["seconds"]))
  return out


def grid_rows(tasks: list[Task], config, targets, counts, ref: int, args, seq: int
              ) -> dict[Task, list[dict]]:
  """Each grid task (`config(task)` its config) trained to its width's lowest target, or read
  from its record; its rows per budget (`rows_of`)."""
  jobs = {t: job(t, config(t), args, grid_stop(t, min(targets[t.size]), ref, args))
          for t in tasks}
  results = run_all(tasks, jobs, args, seq)
  return {t: rows_of(t, results[t], jobs[t], targets, counts, args, seq) for t in tasks}


def curve_key(curve: str) -> str:
  """The metric a crossing reads: the raw parameters' eval loss, or their EMA's."""
  return "eval_loss_ema" if curve == "ema" else "eval_loss"


def train_job(j: dict) -> dict:
  """Train one run (in a worker process or this one) and write its result.json last, so a run
  killed before the end is retrained, never read."""
  platforms.choose()
  cfg = from_dict(j["config"], j["workdir"])
  r = batch_sweep.run_one(cfg, j["batch"], j["lr_multiplier"], argparse.Namespace(**j["args"]),
                          j["workdir"])
  result = dataclasses.asdict(r)
  tmp = os.path.join(j["workdir"], "result.json.tmp")
  with open(tmp, "w") as f:
    json.dump({"fingerprint": j["fingerprint"], "result": result}, f)
  os.replace(tmp, os.path.join(j["workdir"], "result.json"))
  return result


class Pending(Exception):
  """--read_only found runs without a complete record (the message says which)."""


def run_all(tasks: list[Task], jobs: dict[Task, dict], args, seq_len: int) -> dict[Task, dict]:
  """Every task's result: read where its record covers the stop rule, else trained (in
  `--jobs` processes); with `--read_only`, Pending if any is not covered."""
  results, todo = {}, []
  for t in tasks:
    if covered(jobs[t], seq_len):
      with open(os.path.join(jobs[t]["workdir"], "result.json")) as f:
        results[t] = json.load(f)["result"]
    else:
      todo.append(t)
  print(f"[scaling] {len(tasks) - len(todo)} of {len(tasks)} runs read from their records, "
        f"{len(todo)} to train", flush=True)
  if todo and args.read_only:
    pending = {w: sum(t.width == w for t in todo) for w in sorted({t.width for t in tasks})}
    raise Pending(f"{len(todo)} of {len(tasks)} runs have no complete record yet (pending per "
                  "width: " + ", ".join(f"d{w}: {n} of {sum(t.width == w for t in tasks)}"
                                        for w, n in pending.items())
                  + f"; first {todo[0].name}); run without --read_only to train them")

  def report(t, r):
    if jobs[t].get("final"):  # a run that ends at its budget (experiments/scaling_anneal.py)
      said = f"final eval loss {r['final_eval_loss']:.4f}"
    elif jobs[t]["reference"]:
      said = "reference run"
    elif r["steps"]:
      said = f"lowest target at step {r['steps']:.1f}"
    else:
      said = "lowest target not reached"
    print(f"[scaling] {t.name}: {r['steps_run']} steps, {said}; {r['seconds']:.0f}s", flush=True)

  if args.jobs == 1:
    for t in todo:
      results[t] = train_job(jobs[t])
      report(t, results[t])
    return results
  context = multiprocessing.get_context("spawn")  # a fresh jax per worker
  with concurrent.futures.ProcessPoolExecutor(args.jobs, mp_context=context) as pool:
    futures = {pool.submit(train_job, jobs[t]): t for t in todo}
    for done in concurrent.futures.as_completed(futures):
      t = futures[done]
      results[t] = done.result()
      report(t, results[t])
  return results

"""How the critical batch scales with model size N and data D: McCandlish's B_crit, Zhang et al.'s
20%-overhead batch, B_opt and eta_opt at every (N, D), with bootstrap intervals over seeds.

    python -m experiments.critical_batch_scaling [--widths 32,64,128] [--budgets 1024,2048,4096] \\
        [--batch_sizes 4,8,...,256] [--lr_grid 0.5,1,2] [--seeds 3] [--jobs 2] [--quick]
    python -m tools.scaling_fit docs/critical_batch_scaling.csv      # the power laws in D and N

Per width (d_model; mlp 3x, heads and depth the config's), a run per seed at the reference batch
sets the targets: their mean eval loss after each budget D. Every (width, batch, rate, seed)
then trains once, to the lowest target and past the largest budget; each budget's target and
loss are read from that record (`scaling_cells` turns them into estimates). Runs go to `--jobs`
processes; a run whose record is complete is read, not retrained, so a killed lab picks up where
it stopped (a run cut off mid-way starts again); `--read_only` trains nothing. Outputs: OUT.csv
(a row per (N, D)), OUT_boot.csv (bootstrap replicates), OUT_runs.csv (a row per run and
budget), OUT.png; runs in --workdir. docs/scaling_lab.md
"""
from __future__ import annotations

import argparse
import concurrent.futures
import dataclasses
import json
import math
import multiprocessing
import os
import sys

import numpy as np

from experiments import common, scaling_cells
from tools import batch_sweep, figures
from trainer.config import ConfigError
from trainer.config.cli import from_dict
from trainer.multihost import platforms

QUICK = dict(widths=[32, 64], budgets=[384, 768, 1152], batch_sizes=[8, 16, 32], lr_grid=[1.0],
             seeds=2, eval_examples=64, eval_sequences=32, smooth_examples=256, max_factor=4.0,
             bootstrap=200)


def build_parser():
  p = common.parser("critical_batch_scaling", __doc__, seeds=False)
  p.add_argument("--widths", type=common.ints, default="32,64,128", help="d_model of each N")
  p.add_argument("--budgets", type=common.ints, default="1024,2048,4096",
                 help="data budgets D in sequences (x seq_len tokens): each target is the "
                      "reference runs' mean eval loss after D")
  p.add_argument("--batch_sizes", type=common.ints, default="4,8,16,32,64,128,256",
                 help="batches in sequences (Step Law's B_opt at these D is 5-11 sequences)")
  p.add_argument("--lr_grid", type=common.floats, default="0.5,1,2",
                 help="multipliers of the rule's rate at each batch (x1 always; per seed and "
                      "batch the fastest to the target counts)")
  p.add_argument("--seeds", type=int, default=3, help="the config's seed, seed + 1, ...")
  p.add_argument("--jobs", type=int, default=1, help="runs trained at once, each a process")
  p.add_argument("--quick", action="store_true",
                 help=f"a grid of minutes (what the tests run): {QUICK}; flags given win")
  p.add_argument("--reference_factor", type=float, default=1.5,
                 help="the reference runs train this multiple of the largest budget")
  p.add_argument("--max_factor", type=float, default=4.0,
                 help="a run gives up after this multiple of the largest budget")
  p.add_argument("--bootstrap", type=int, default=300, help="bootstrap replicates")
  p.add_argument("--read_only", action="store_true",
                 help="train nothing: summarise if every run's record is complete, else say "
                      "which are pending (safe beside a lab that is running)")
  common.add_to_target_args(p, max_examples=0)
  return p


def parse(argv):
  p = build_parser()
  args, overrides = p.parse(argv)
  if args.quick:
    p.set_defaults(**QUICK)
    args, overrides = p.parse(argv)
  args.lr_grid = sorted(set(args.lr_grid) | {1.0})
  args.budgets, args.batch_sizes = sorted(set(args.budgets)), sorted(set(args.batch_sizes))
  if len(args.batch_sizes) < 2 or not args.budgets or not args.widths:
    p.error("give two or more --batch_sizes, and one or more --budgets and --widths")
  odd = [b for b in args.batch_sizes if b % args.micro_batch_size and b > args.micro_batch_size]
  if odd:
    p.error(f"--batch_sizes: {odd[0]} is not a multiple of --micro_batch_size="
            f"{args.micro_batch_size} (a batch at or below it is one micro-batch)")
  short = args.smooth_examples / 2 + args.eval_examples
  if args.budgets[0] <= short:
    p.error(f"--budgets: {args.budgets[0]} sequences is within the first smoothing window; "
            f"give budgets above {short:g} (--smooth_examples / 2 + --eval_examples)")
  if args.seeds < 1 or args.jobs < 1 or args.bootstrap < 0:
    p.error("--seeds and --jobs must be at least 1, --bootstrap at least 0")
  largest = args.budgets[-1]
  args.min_examples = largest + short  # every budget's loss can be read from every run
  args.max_examples = args.max_examples or int(args.max_factor * largest)
  args.reference_examples = int(max(args.reference_factor * largest, args.min_examples))
  if args.max_examples < args.reference_examples:
    p.error(f"--max_examples {args.max_examples} is below the {args.reference_examples:g} "
            "sequences the reference runs train (--reference_factor x the largest budget, at "
            "least that budget and a smoothing window)")
  return args, overrides


def width_config(cfg, width: int, seed: int):
  """The base config at d_model `width` (mlp_dim in the config's ratio) and `seed`."""
  c = cfg.copy_and_resolve_references()
  c.model.mlp_dim = round(cfg.model.mlp_dim / cfg.model.d_model * width)
  c.model.d_model, c.seed = width, seed
  return c


def parameters(cfg) -> dict[str, int]:
  from models.llama import ModelConfig  # noqa: PLC0415  start-up
  from models.sizes import param_counts  # noqa: PLC0415  start-up
  return param_counts(ModelConfig.from_config(cfg.model))


@dataclasses.dataclass(frozen=True)
class Task:
  width: int
  batch: int
  lr_multiplier: float
  seed: int

  @property
  def name(self) -> str:
    return f"d{self.width}/b{self.batch}_lr{self.lr_multiplier:g}_s{self.seed}"


def job(task: Task, cfg, args, stop: dict) -> dict:
  """What a worker needs to train `task` (picklable), its workdir and fingerprint: the run's
  config and the settings that shape its record (not the stop rule, which a record may cover)."""
  c = width_config(cfg, task.width, task.seed)
  run_args = dict(micro_batch_size=args.micro_batch_size, eval_examples=args.eval_examples,
                  eval_sequences=args.eval_sequences, smooth_examples=args.smooth_examples)
  fingerprint = json.dumps(dict(config=c.to_dict(), batch=task.batch,
                                lr_multiplier=task.lr_multiplier, **run_args),
                           sort_keys=True, default=str)
  return dict(config=c.to_dict(), batch=task.batch, lr_multiplier=task.lr_multiplier,
              args={**run_args, **stop}, workdir=os.path.join(args.workdir, task.name),
              fingerprint=fingerprint)


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
  if saved["fingerprint"] != j["fingerprint"]:
    return False
  a, r = j["args"], saved["result"]
  seen = common.ramp_from_rows(common.read_rows(j["workdir"]), r["batch_size"],
                               seq_len).examples_before(r["steps_run"])
  if seen >= a["max_examples"]:
    return True
  hit = common.crossings(j["workdir"], r["batch_size"], seq_len, [a["target_loss"]],
                         a["smooth_examples"])[0]
  return hit["steps"] is not None and seen >= a["min_examples"]


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


def run_all(tasks: list[Task], jobs: dict[Task, dict], args, seq_len: int) -> dict[Task, dict]:
  """Every task's result: read where its record covers the stop rule, else trained (in
  `--jobs` processes)."""
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
    raise ConfigError(f"--read_only: {len(todo)} of {len(tasks)} runs have no complete record "
                      "yet (pending per width: " + ", ".join(f"d{w}: {n} of "
                      f"{sum(t.width == w for t in tasks)}" for w, n in pending.items())
                      + f"; first {todo[0].name}); run without --read_only to train them")
  report = lambda t, r: print(
      f"[scaling] {t.name}: {r['steps_run']} steps, "
      + (f"lowest target at step {r['steps']:.1f}" if r["steps"] else "lowest target not reached")
      + f"; {r['seconds']:.0f}s", flush=True)
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


def experiment(args, cfg) -> list[dict]:
  if cfg.data.batch_ramp or cfg.optim.schedule != "constant":
    raise ConfigError("the lab reads every target from one run at a constant rate: set "
                      "data.batch_ramp='' and optim.schedule='constant' (got "
                      f"{cfg.data.batch_ramp!r}, {cfg.optim.schedule!r})")
  bad = [w for w in args.widths if w % cfg.model.num_heads]
  if bad:
    raise ConfigError(f"--widths: {bad[0]} is not a multiple of model.num_heads="
                      f"{cfg.model.num_heads}")
  seq = cfg.data.seq_len
  seeds = [cfg.seed + k for k in range(args.seeds)]
  ref = cfg.optim.reference_batch_size or cfg.data.global_batch_size
  counts = {w: parameters(width_config(cfg, w, seeds[0])) for w in args.widths}
  for w, n in counts.items():
    print(f"[scaling] width {w}: {n['total'] / 1e6:.3f}M parameters "
          f"({n['non_embedding'] / 1e6:.3f}M non-embedding)", flush=True)
  budgets = ", ".join(f"{d:,} sequences ({d * seq:,} tokens)" for d in args.budgets)
  print(f"[scaling] budgets D = {budgets}; batches {args.batch_sizes}; rates x{args.lr_grid}; "
        f"seeds {seeds}", flush=True)
  ref_tasks = [Task(w, ref, 1.0, s) for s in seeds for w in args.widths]
  ref_jobs = {t: job(t, cfg, args, reference_stop(args)) for t in ref_tasks}
  run_all(ref_tasks, ref_jobs, args, seq)
  targets = {}
  for w in args.widths:
    losses = [common.loss_at(ref_jobs[t]["workdir"], ref, seq, args.budgets, args.smooth_examples)
              for t in ref_tasks if t.width == w]
    if any(x is None for loss in losses for x in loss):
      raise ConfigError(f"width {w}: a reference run's eval curve does not reach every budget "
                        f"({args.budgets}); see the runs under {args.workdir}")
    targets[w] = [sum(x[i] for x in losses) / len(losses) for i in range(len(args.budgets))]
    print(f"[scaling] width {w}: targets (mean eval loss of the reference runs at batch {ref}) "
          + ", ".join(f"{d:,}: {l:.4f}" for d, l in zip(args.budgets, targets[w])), flush=True)
  # Smallest width first, all its seeds: a lab cut short has whole widths done, not seed 0 of all.
  tasks = [Task(w, b, m, s) for w in sorted(args.widths) for s in seeds
           for b in sorted(args.batch_sizes, reverse=True) for m in args.lr_grid]
  jobs = {t: job(t, cfg, args, grid_stop(t, min(targets[t.width]), ref, args)) for t in tasks}
  results = run_all(tasks, jobs, args, seq)
  runs = []
  for t in tasks:
    r, where = results[t], jobs[t]["workdir"]
    hits = common.crossings(where, t.batch, seq, targets[t.width], args.smooth_examples)
    losses = common.loss_at(where, t.batch, seq, args.budgets, args.smooth_examples)
    for d, hit, loss in zip(args.budgets, map(measured, hits), losses):
      runs.append(dict(width=t.width, params=counts[t.width]["total"], seed=t.seed,
                       batch_size=t.batch, lr_multiplier=t.lr_multiplier,
                       learning_rate=r["learning_rate"], budget=d, budget_tokens=d * seq,
                       target=hit["target"], steps=hit["steps"], examples=hit["examples"],
                       tokens=hit["tokens"], noise_scale=hit["noise_scale"],
                       below_at_start=hit["first"],
                       micro_batches=r["micro_batches"], loss_at_budget=loss,
                       steps_run=r["steps_run"], seconds=r["seconds"]))
  early = sorted({(r["width"], r["budget"], r["batch_size"]) for r in runs if r["below_at_start"]})
  if early:
    print(f"[scaling] {len(early)} (width, D, batch) with a run already below its target at the "
          "first smoothed point (no crossing measured; left out): "
          + ", ".join(f"d{w} D {d} b{b}" for w, d, b in early), flush=True)
  return summarize(args, runs, counts, targets, seeds, seq)


def measured(hit: dict) -> dict:
  """A crossing (`common.crossings`) as the lab counts it: none where the run was below the
  target at the first smoothed point already (it may have crossed earlier)."""
  if not hit["first"]:
    return hit
  return {**hit, "steps": None, "examples": None, "tokens": None, "noise_scale": None}


def summarize(args, runs: list[dict], counts, targets, seeds, seq) -> list[dict]:
  """Estimates per (N, D) with intervals: OUT.csv, OUT_boot.csv, OUT_runs.csv, table, OUT.png."""
  boot = scaling_cells.draws(args.bootstrap, len(args.batch_sizes), len(seeds))
  cells, replicates = [], []
  for w in args.widths:
    for i, d in enumerate(args.budgets):
      mine = [r for r in runs if r["width"] == w and r["budget"] == d]
      est, reps = scaling_cells.cell(mine, boot)
      key = dict(width=w, params=counts[w]["total"], non_embedding=counts[w]["non_embedding"],
                 budget=d, tokens=d * seq, target=targets[w][i])
      cells.append({**key, **est})
      replicates += [{"params": key["params"], "tokens": key["tokens"], "replicate": k,
                      **compact({q: rep[q] for q in FITTED})} for k, rep in enumerate(reps)]
  columns = [c for c in cells[0] if c not in ("steps_by_batch", "steps_spread", "loss_by_batch")]
  figures.write_csv(args.out + ".csv", [{k: c[k] for k in columns} for c in cells], columns)
  figures.write_csv(args.out + "_runs.csv", [compact(r) for r in runs])
  if replicates:
    figures.write_csv(args.out + "_boot.csv", replicates)
  print(common.table([{**c, **{f"{q}_ci": ci(c, q) for q in scaling_cells.QUANTITIES}}
                      for c in cells], COLUMNS, "scaling"))
  plotted = plot(args.out + ".png", cells, args)
  print(f"[scaling] wrote {args.out}.csv, {args.out}_runs.csv"
        + (f", {args.out}_boot.csv ({args.bootstrap} replicates)" if replicates else "")
        + (f", {args.out}.png" if plotted else figures.NO_PLOT))
  return cells


def compact(row: dict) -> dict:
  """The row with floats to 5 significant digits (the CSVs stay small enough to commit)."""
  return {k: float(f"{v:.5g}") if isinstance(v, float) and math.isfinite(v) else v
          for k, v in row.items()}


def ci(c: dict, q: str) -> str:
  """'lo-hi' of a quantity's interval ('-' without one)."""
  lo, hi = c.get(f"{q}_lo"), c.get(f"{q}_hi")
  return "-" if lo is None else f"{lo:.3g}-{hi:.3g}"


FITTED = ("b_crit", "b_zhang", "b_opt", "eta_opt", "b_simple")  # what tools.scaling_fit reads
COLUMNS = [("params", "N", ",d"), ("tokens", "D tokens", ",d"), ("target", "target", ".3f"),
           ("s_min", "S_min", ".1f"), ("e_min", "E_min", ",.0f"), ("b_crit", "B_crit", ".1f"),
           ("b_crit_ci", "95%", "s"), ("b_zhang", "B_zhang", ".1f"), ("b_zhang_ci", "95%", "s"),
           ("zhang_b0", "b0", ".0f"),
           ("b_opt", "B_opt", ".1f"), ("b_opt_resolved", "inside", ""),
           ("eta_opt", "eta_opt", ".2e"), ("eta_opt_resolved", "inside", ""),
           ("b_simple", "B_simple", ".1f"), ("b_simple_ci", "95%", "s")]


def plot(path: str, cells: list[dict], args) -> bool:
  """Per width: steps to each budget's target against batch (seeds' mean, range bars, the
  McCandlish fit), and the eval loss after each budget against batch."""
  plt = figures.pyplot()
  if plt is None:
    return False
  fig, axes = plt.subplots(2, len(args.widths), figsize=(max(9.2, 4.6 * len(args.widths)), 8),
                           squeeze=False)
  for col, w in enumerate(args.widths):
    top, bottom = axes[0][col], axes[1][col]
    for i, c in enumerate(x for x in cells if x["width"] == w):
      color = f"C{i}"
      spread = c["steps_spread"]
      b = sorted(spread)
      mean = [c["steps_by_batch"][x] if c["steps_by_batch"][x] is not None else np.nan for x in b]
      lo = [m - spread[x][0] for m, x in zip(mean, b)]
      hi = [spread[x][1] - m for m, x in zip(mean, b)]
      top.errorbar(b, mean, yerr=[lo, hi], fmt="o", c=color, ms=4, capsize=2,
                   label=f"D {c['tokens']:,} tokens (target {c['target']:.3f})")
      if c["s_min"] is not None:
        fit = batch_sweep.Fit(c["s_min"], c["e_min"])
        xs = np.geomspace(b[0] / 1.3, b[-1] * 1.3)
        top.plot(xs, fit.steps(xs), "-", c=color, lw=1)
      loss = c["loss_by_batch"]
      bottom.plot(sorted(loss), [loss[x] if loss[x] is not None else np.nan for x in sorted(loss)],
                  "o-", c=color, ms=4, label=f"after {c['tokens']:,} tokens")
    for ax in (top, bottom):
      ax.set_xscale("log")
      ax.set_xticks(args.batch_sizes, [str(b) for b in args.batch_sizes])
      ax.minorticks_off()
    top.set(yscale="log", xlabel="batch (sequences)", ylabel="steps to target",
            title=f"d_model {w} ({cells[[x['width'] for x in cells].index(w)]['params']:,} "
                  "parameters)")
    bottom.set(xlabel="batch (sequences)", ylabel="eval loss (best rate)",
               title="loss after D tokens (B_opt: the lowest)")
    top.legend(fontsize=7)
    bottom.legend(fontsize=7)
  figures.save(fig, path, "Steps to the target and loss after D across batch sizes "
               "(mean over seeds, bars: min-max; lines: S_min + E_min / B)")
  return True


def main(argv: list[str]) -> int:
  return common.main("scaling", parse, experiment, argv, seeds_inside=True)


if __name__ == "__main__":
  sys.exit(main(sys.argv[1:]))

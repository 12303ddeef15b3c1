"""B_opt and eta_opt as Step Law and Power Lines define them: the batch and rate of lowest loss
among runs whose schedule *ends* at the budget D (the lab's warmup, its constant rate, then a
cooldown to zero over the last `--decay_fraction` of D: the WSD branch the lab's constant run
would give at D, which has the same initialisation, data order and rate up to the branch point).

    python -m experiments.scaling_anneal [the lab's flags: --widths --budgets --batch_sizes
        --seeds --jobs --warmup_fraction ...] [--decay_fraction 0.2] [--lab_runs OUT_runs.csv]

Per (width, D, batch, seed) the rates start at `--lr_grid` around the multiplier that was
fastest in the constant lab (`--lab_runs`, the seeds' median; 1 without it) and grow beyond any
edge that has the lowest final loss until each is inside. B_opt: the batch of lowest seed-mean
best loss (parabola vertex in log B), with a paired seed bootstrap; refused where a rate stays at
its edge. Outputs: OUT.csv (a row per cell), OUT_runs.csv (a row per run). Method:
docs/scaling_lab.md#b_opt-from-cooldowns-that-end-at-d
"""
from __future__ import annotations

import argparse
import dataclasses
import math
import os
import statistics
import sys

import numpy as np

from experiments import common, critical_batch_scaling as lab, scaling_cells
from experiments.scaling_runs import Task, job, run_all
from tools import figures, stats
from tools.scaling_fit import interval
from tools.tradeoff import interior, next_multipliers
from trainer.config import ConfigError


@dataclasses.dataclass(frozen=True)
class Branch(Task):
  """One run that ends at `budget` sequences (its own workdir per budget)."""
  budget: int = 0

  @property
  def name(self) -> str:
    return f"D{self.budget}/{super().name}"


def build_parser():
  p = lab.build_parser()
  p.set_defaults(out=os.path.join("docs", "scaling_anneal"),
                 workdir=os.path.join("runs", "experiments", "scaling_anneal"), b2_grid=[])
  p.add_argument("--decay_fraction", type=float, default=0.2,
                 help="the cooldown's share of D (WSD's decay, to zero, optim.wsd_decay_shape)")
  p.add_argument("--final_eval_sequences", type=int, default=128,
                 help="validation sequences of the one evaluation, at D")
  p.add_argument("--lab_runs", default="",
                 help="the constant lab's OUT_runs.csv: each batch's grid starts around its "
                      "fastest multiplier there (the seeds' median)")
  return p


def parse(argv):
  args, overrides = lab.parse(argv, build=build_parser)
  if not 0 < args.decay_fraction <= 1:
    raise ConfigError(f"--decay_fraction {args.decay_fraction}: give the cooldown's share of D "
                      "in (0, 1], e.g. 0.2")
  if args.final_eval_sequences < 1:
    raise ConfigError(f"--final_eval_sequences {args.final_eval_sequences}: at least 1")
  return args, overrides


def branch_config(cfg, t: Branch, args):
  """The lab's config of `t` with the schedule ending at its budget: WSD to zero."""
  c = lab.task_config(cfg, t, args)
  c.optim.schedule, c.optim.wsd_decay_fraction, c.optim.min_lr_ratio = "wsd", args.decay_fraction, 0.0
  return c


def branch_job(cfg, t: Branch, args) -> dict:
  """The worker's job: `t.budget` sequences, one evaluation at the end (its own workdir)."""
  at_d = argparse.Namespace(**{**vars(args), "workdir": os.path.join(args.workdir, f"D{t.budget}"),
                               "eval_interval": t.budget, "smooth_lowest": 0.0,
                               "eval_sequences": args.final_eval_sequences})
  stop = dict(target_loss=-math.inf, min_examples=0, max_examples=t.budget)
  j = job(Task(t.width, t.batch, t.lr_multiplier, t.seed), branch_config(cfg, t, args), at_d, stop)
  return {**j, "reference": False, "final": True}


def start_multipliers(path: str, grid: list[float]) -> dict:
  """{(width, batch, budget): [multipliers]}: `grid` times the constant lab's fastest
  multiplier (median over seeds, to a power of 2) where `path` has one, else `grid`."""
  if not path:
    return {}
  fastest: dict = {}  # (width, batch, budget) -> {seed: (steps, multiplier)}
  for r in figures.read_csv(path):
    if r["steps"] is None:
      continue
    per_seed = fastest.setdefault((int(r["width"]), int(r["batch_size"]), int(r["budget"])), {})
    s = int(r["seed"])
    if s not in per_seed or r["steps"] < per_seed[s][0]:
      per_seed[s] = (r["steps"], r["lr_multiplier"])
  out = {}
  for key, per_seed in fastest.items():
    m = 2.0 ** round(math.log2(statistics.median(v[1] for v in per_seed.values())))
    out[key] = sorted({g * m for g in grid})
  return out


def experiment(args, cfg) -> list[dict]:
  seq = cfg.data.seq_len
  seeds = [cfg.seed + k for k in range(args.seeds)]
  counts = {w: lab.parameters(lab.width_config(cfg, w, seeds[0], args)) for w in args.widths}
  start = start_multipliers(args.lab_runs, args.lr_grid)
  mults = {(w, b, d): list(start.get((w, b, d), args.lr_grid))
           for w in args.widths for b in args.batch_sizes for d in args.budgets}
  print(f"[anneal] widths {args.widths}, budgets {args.budgets}, batches {args.batch_sizes}, "
        f"seeds {seeds}; warmup {args.warmup} sequences, cooldown over the last "
        f"{args.decay_fraction:g} of D to zero; rates grown to bracket the final loss", flush=True)
  for round_ in range(args.max_extensions + 1):
    tasks = [Branch(w, b, m, s, budget=d) for (w, b, d), ms in sorted(mults.items())
             for s in seeds for m in sorted(ms)]
    jobs = {t: branch_job(cfg, t, args) for t in tasks}
    results = run_all(tasks, jobs, args, seq)
    runs = [dict(width=t.width, params=counts[t.width]["total"], budget=t.budget,
                 batch_size=t.batch, lr_multiplier=t.lr_multiplier, seed=t.seed,
                 learning_rate=results[t]["learning_rate"],
                 final_loss=results[t]["final_eval_loss"], steps_run=results[t]["steps_run"],
                 seconds=results[t]["seconds"]) for t in tasks]
    grown = {}
    for key, ms in mults.items():
      scores = [{r["lr_multiplier"]: r["final_loss"] for r in runs
                 if (r["width"], r["batch_size"], r["budget"], r["seed"]) == (*key, s)}
                for s in seeds]
      new = [m for m in next_multipliers(*scores, factor=args.bracket_factor) if m not in ms]
      if new:
        grown[key] = new
    if not grown or round_ == args.max_extensions:
      break
    print(f"[anneal] round {round_ + 1}: the lowest final loss at its grid's edge at "
          f"{len(grown)} (width, batch, D)", flush=True)
    for k, new in grown.items():
      mults[k] += new
  return summarize(args, runs, seeds, seq)


def cell(rows: list[dict], boot: np.ndarray) -> dict:
  """One (width, D): B_opt and eta_opt with the bootstrap interval, the rates' bracketing,
  and the paired loss differences of B_opt's grid neighbours against it."""
  t = scaling_cells.table([{**r, "loss_at_budget": r["final_loss"], "steps": None}
                           for r in rows])
  inside = np.zeros(t.loss.shape[:2], bool)
  for i, s in enumerate(t.seeds):
    for j, b in enumerate(t.batches):
      inside[i, j] = bool(interior({r["lr_multiplier"]: r["final_loss"] for r in rows
                                    if (r["seed"], r["batch_size"]) == (s, b)}))
  out = dict(seeds=len(t.seeds), cases=inside.size, interior_cases=int(inside.sum()),
             refused="" if inside.all() else
             "rates at their grid's edge at " + ", ".join(
                 f"b{t.batches[j]} s{t.seeds[i]}" for i, j in zip(*np.nonzero(~inside))))
  point = _b_opt(t, np.arange(len(t.seeds)))
  out.update(point)
  lo, hi = interval([_b_opt(t, pick)["b_opt"] for pick in boot])
  out.update(b_opt_lo=lo, b_opt_hi=hi)
  best = scaling_cells.nanmin(t.loss, axis=2)  # [seed, batch]
  out["loss_by_batch"] = {b: float(np.nanmean(best[:, j])) for j, b in enumerate(t.batches)}
  j = t.batches.index(point["b_grid"])
  for k, side in ((j - 1, "below"), (j + 1, "above")):
    d = stats.paired(dict(zip(t.seeds, best[:, k])), dict(zip(t.seeds, best[:, j]))) \
        if 0 <= k < len(t.batches) else None
    out.update(d.as_dict(f"loss_{side}") if d else {f"loss_{side}{x}": None for x in SUFFIXES})
  return out


SUFFIXES = ("", "_lo", "_hi", "_se", "_p", "_n", "_significant")  # stats.Paired.as_dict's


def _b_opt(t, pick) -> dict:
  """B_opt (vertex in log B of the seed-mean best loss), whether inside the batches run, and
  eta_opt at that batch (vertex in log rate of the seed-mean loss over its rates)."""
  best = scaling_cells.nanmin(t.loss[pick], axis=2).mean(axis=0)
  i = int(np.nanargmin(best))
  by_rate = t.loss[pick][:, i, :].mean(axis=0)
  ok = ~np.isnan(by_rate)
  k = int(np.nanargmin(by_rate[ok]))
  rates = t.rates[i][ok]
  return dict(b_opt=scaling_cells.vertex(t.batches, best, i), b_grid=t.batches[i],
              b_opt_resolved=0 < i < len(t.batches) - 1,
              eta_opt=scaling_cells.vertex(rates, by_rate[ok], k),
              eta_opt_resolved=0 < k < len(rates) - 1, loss_min=float(best[i]))


COLUMNS = [("width", "width", "d"), ("params", "N", ",d"), ("tokens", "D tokens", ",d"),
           ("b_opt", "B_opt", ".2f"), ("b_opt_ci", "95% boot", "s"),
           ("b_opt_resolved", "inside", ""), ("eta_opt", "eta_opt", ".2e"),
           ("eta_opt_resolved", "inside", ""), ("loss_min", "loss", ".4f"),
           ("loss_below", "d loss below", "+.4f"), ("loss_above", "d loss above", "+.4f"),
           ("interior_cases", "rates inside", "d"), ("cases", "of", "d")]


def summarize(args, runs: list[dict], seeds, seq) -> list[dict]:
  boot = scaling_cells.draws(args.bootstrap, len(seeds))
  cells = []
  for w in args.widths:
    for d in args.budgets:
      mine = [r for r in runs if (r["width"], r["budget"]) == (w, d)]
      c = dict(width=w, params=mine[0]["params"], budget=d, tokens=d * seq, **cell(mine, boot))
      c["b_opt_ci"] = "-" if c["b_opt_lo"] is None else f"{c['b_opt_lo']:.3g}-{c['b_opt_hi']:.3g}"
      cells.append(c)
  inside = sum(c["interior_cases"] for c in cells)
  cases = sum(c["cases"] for c in cells)
  print(f"[anneal] {inside} of {cases} (width, D, batch, seed) cases have their lowest final "
        f"loss inside the rates run ({inside / max(cases, 1):.0%})", flush=True)
  for c in cells:
    if c["refused"]:
      print(f"[anneal] d{c['width']} D {c['budget']:,}: B_opt refused ({c['refused']})")
  print(common.table(cells, COLUMNS, "anneal"))
  flat = [{k: lab.text(v) for k, v in c.items()} for c in cells]
  figures.write_csv(args.out + ".csv", flat, list(flat[0]))
  figures.write_csv(args.out + "_runs.csv", [lab.compact(r) for r in runs])
  print(f"[anneal] wrote {args.out}.csv, {args.out}_runs.csv")
  return cells


def main(argv: list[str]) -> int:
  return common.main("anneal", parse, experiment, argv, seeds_inside=True)


if __name__ == "__main__":
  sys.exit(main(sys.argv[1:]))

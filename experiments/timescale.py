"""Power Lines' timescale (Bergsma et al. 2025, arXiv 2505.13738): is tau = B / (eta lambda D)
what stays optimal across batch sizes? AdamW's weight decay lambda swept at each batch.

    python -m experiments.timescale [--batch_sizes 8,32,128] [--wd_grid 0.1,0.3,1,3,10,30] \\
        [--examples 4096] [--seeds 3] [--out docs/timescale]

sweep_tiny's AdamW at the sqrt rule's rate, warmup 1/16 of `--examples` then linear to zero (as
Power Lines trains); a run per (batch, lambda, seed), scored by the final eval loss. Per batch the
lambda grid grows by `--wd_factor` past a winning edge of the seeds' mean (`tools.tradeoff.
bracket`; a diverged run brackets); lambda_opt is the mean curve's best (parabola in log lambda),
tau_opt = B / (eta lambda_opt D); a batch still at an edge is censored and left out of the fit of
lambda_opt ~ B^e (Power Lines, sqrt rule: e = 0.5), whose t interval is over the seeds' own
exponents. OUT.csv, OUT.png; results and method: docs/scaling_lab.md
"""
from __future__ import annotations

import math
import os
import sys

import numpy as np

from experiments import common, scaling_cells
from tools import figures, stats, tradeoff


def build_parser():
  p = common.parser("timescale", __doc__)
  p.add_argument("--batch_sizes", type=common.ints, default="8,32,128")
  p.add_argument("--wd_grid", type=common.floats, default="0.1,0.3,1,3,10,30",
                 help="AdamW weight decays lambda (decoupled: each step multiplies the "
                      "parameters by 1 - lr lambda), the same at every batch")
  p.add_argument("--wd_factor", type=float, default=math.sqrt(10),
                 help="each extension's step beyond a winning edge of the lambda grid "
                      "(default sqrt(10), the default grid's)")
  p.add_argument("--max_extensions", type=int, default=3,
                 help="rounds of extension per batch (0: the grid as given)")
  p.add_argument("--examples", type=int, default=4096, help="training sequences D per run")
  common.add_budget_args(p, evals=4, eval_sequences=256)
  return p


def parse(argv):
  p = build_parser()
  args, overrides = p.parse(argv)
  args.wd_grid = sorted(set(args.wd_grid))
  if len(args.wd_grid) < 3 or args.wd_grid[0] <= 0:
    p.error(f"--wd_grid {','.join(f'{x:g}' for x in args.wd_grid)}: needs at least 3 positive "
            "values (an optimum inside the grid has a neighbour on each side), e.g. 0.1,1,10")
  if args.wd_factor <= 1 or args.max_extensions < 0 or args.seeds < 1:
    p.error(f"--wd_factor {args.wd_factor:g}, --max_extensions {args.max_extensions}, --seeds "
            f"{args.seeds}: the factor must be above 1, the extensions at least 0, the seeds at "
            "least 1")
  return args, overrides


def run_config(base, args, batch: int, weight_decay: float):
  """`base` at `batch` for `--examples` sequences with weight decay `weight_decay`; its rate is
  stated at its reference batch (its own batch where it names none) and moved by the sqrt rule."""
  reference = base.optim.reference_batch_size or base.data.global_batch_size
  cfg = common.at_budget(base, batch, args.examples, micro=args.micro_batch_size,
                         evals=args.evals, eval_sequences=args.eval_sequences)
  cfg.optim.update(name="adamw", weight_decay=weight_decay, weight_decay_rule="constant",
                   lr_rule="sqrt", reference_batch_size=reference, schedule="linear",
                   schedule_unit="examples", min_lr_ratio=0.0,
                   warmup_steps=0, warmup_tokens=0, decay_steps=0, decay_tokens=0,
                   warmup_examples=args.examples // 16, decay_examples=args.examples)
  return cfg


def optimum(runs: list[dict], batch: int, examples: int, inside: bool | None = None) -> dict:
  """The optimum of one batch's runs (their `weight_decay`, `final_eval_loss`, `learning_rate`):
  lambda_opt, tau_opt = B / (eta lambda_opt D), and whether it is inside the grid (`inside`
  where the caller knows better: a diverged neighbour brackets too)."""
  runs = sorted((r for r in runs if math.isfinite(r["final_eval_loss"])),
                key=lambda r: r["weight_decay"])
  wd = [r["weight_decay"] for r in runs]
  loss = [r["final_eval_loss"] for r in runs]
  i = int(np.argmin(loss))
  best = scaling_cells.vertex(wd, loss, i)
  eta = runs[i]["learning_rate"]
  return {"kind": "optimum", "batch_size": batch, "learning_rate": eta, "wd_opt": best,
          "tau_opt": batch / (eta * best * examples),
          "inside": 0 < i < len(runs) - 1 if inside is None else bool(inside),
          "final_eval_loss": loss[i]}


def exponent(optima: list[dict]) -> dict:
  """lambda_opt ~ B^e over the batches whose optimum is inside the grid (NaN with fewer than 2):
  Power Lines under the sqrt rule says e = 0.5, the constant rule e = 0."""
  inside = [o for o in optima if o["inside"]]
  e = math.nan
  if len(inside) >= 2:
    e = float(np.polyfit(np.log([o["batch_size"] for o in inside]),
                         np.log([o["wd_opt"] for o in inside]), 1)[0])
  return {"kind": "fit", "wd_exponent": e, "batches_inside": len(inside)}


def mean_runs(runs: list[dict], batch: int) -> list[dict]:
  """One batch's runs averaged over the seeds per lambda (NaN where a seed diverged)."""
  out = []
  for wd in sorted({r["weight_decay"] for r in runs if r["batch_size"] == batch}):
    mine = [r for r in runs if (r["batch_size"], r["weight_decay"]) == (batch, wd)]
    out.append({**mine[0],
                "final_eval_loss": common.seed_mean([r["final_eval_loss"] for r in mine])})
  return out


def seed_spread(runs: list[dict], optima: list[dict], examples: int) -> tuple[dict, dict]:
  """Over the seeds, each seed's own optimum on the lambdas run at each batch whose mean optimum
  is inside: ({batch: t interval of tau_opt}, t interval of the exponent of lambda_opt in B)."""
  inside = [o["batch_size"] for o in optima if o["inside"]]
  taus, exps = {b: [] for b in inside}, []
  for seed in sorted({r["seed"] for r in runs}):
    mine = [optimum([r for r in runs if (r["seed"], r["batch_size"]) == (seed, b)], b, examples)
            for b in inside]
    for o in mine:
      taus[o["batch_size"]].append(o["tau_opt"])
    exps.append(exponent([{**o, "inside": True} for o in mine])["wd_exponent"])
  return {b: stats.t_interval(v) for b, v in taus.items()}, stats.t_interval(exps)


def experiment(args, cfg) -> list[dict]:
  from optim import derive  # noqa: PLC0415  start-up
  seeds = [cfg.seed + k for k in range(args.seeds)]
  runs, optima = [], []
  for batch in args.batch_sizes:
    def score(wd, batch=batch):
      """Mean final eval loss over the seeds at this lambda (None where a seed diverged)."""
      losses = []
      for seed in seeds:
        seeded = cfg.copy_and_resolve_references()
        seeded.seed = seed
        c = run_config(seeded, args, batch, wd)
        t = common.train(c, os.path.join(args.workdir, f"b{batch}_wd{wd:g}_s{seed}"))
        finite = [y for _, y in common.eval_curve(t.rows, t.ramp) if math.isfinite(y)]
        runs.append({"kind": "run", "seed": seed, "batch_size": batch, "weight_decay": wd,
                     "learning_rate": derive(c.optim, batch).learning_rate,
                     "steps": t.steps_run, "final_eval_loss": finite[-1] if finite else math.nan,
                     "seconds": t.seconds})
        print(f"[timescale] batch {batch:4d} lambda {wd:<8.3g} seed {seed}: lr "
              f"{runs[-1]['learning_rate']:.3g}, final eval {runs[-1]['final_eval_loss']:.4f}; "
              f"{t.seconds:.0f}s", flush=True)
        losses.append(runs[-1]["final_eval_loss"])
      return m if math.isfinite(m := common.seed_mean(losses)) else None

    scores = tradeoff.bracket(score, args.wd_grid, factor=args.wd_factor,
                              max_extensions=args.max_extensions)
    o = optimum(mean_runs(runs, batch), batch, args.examples, inside=tradeoff.interior(scores))
    optima.append({**o, "seed": "mean", "lambdas": "/".join(f"{w:.3g}" for w in sorted(scores))})
    if not o["inside"]:
      print(f"[timescale] batch {batch}: censored, the best lambda {o['wd_opt']:.3g} is at the "
            f"edge of {optima[-1]['lambdas']} after {args.max_extensions} extensions", flush=True)
  taus, exp = seed_spread(runs, optima, args.examples)
  for o in optima:
    iv = taus.get(o["batch_size"])
    o.update(tau_lo=iv.lo if iv else math.nan, tau_hi=iv.hi if iv else math.nan)
  fit = {**exponent(optima), "seed": "mean", "wd_exponent_seeds": exp.mean,
         "wd_exponent_lo": exp.lo, "wd_exponent_hi": exp.hi}
  rows = runs + optima + [fit]
  common.write(args, rows)
  print(common.table(optima, COLUMNS, "timescale"))
  print(f"[timescale] lambda_opt ~ B^{fit['wd_exponent']:.2f} over {fit['batches_inside']} "
        f"batch(es) with the optimum inside the grid; over the seeds {exp.text('.2f')} (Power "
        "Lines, sqrt rule: 0.5; constant weight decay: 0)")
  plotted = plot(args.out + ".png", [r for b in args.batch_sizes for r in mean_runs(runs, b)],
                 optima, args)
  print(f"[timescale] wrote {args.out}.csv" + (f", {args.out}.png" if plotted else figures.NO_PLOT))
  return rows


COLUMNS = [("batch_size", "batch", "d"), ("learning_rate", "lr", ".3g"),
           ("wd_opt", "lambda_opt", ".3g"), ("inside", "inside", ""), ("tau_opt", "tau_opt", ".3g"),
           ("tau_lo", "tau lo", ".3g"), ("tau_hi", "tau hi", ".3g"),
           ("final_eval_loss", "best eval loss", ".4f"), ("lambdas", "lambdas run", "")]


def plot(path: str, runs: list[dict], optima: list[dict], args) -> bool:
  """The seeds' mean final loss against lambda per batch (the optimum marked), and against tau =
  B / (eta lambda D): Power Lines' claim is that the second panel's minima line up."""
  plt = figures.pyplot()
  if plt is None:
    return False
  fig, axes = plt.subplots(1, 2, figsize=(11, 4.3))
  for i, b in enumerate(args.batch_sizes):
    mine = sorted((r for r in runs if r["batch_size"] == b), key=lambda r: r["weight_decay"])
    o = next(x for x in optima if x["batch_size"] == b)
    tau = [b / (r["learning_rate"] * r["weight_decay"] * args.examples) for r in mine]
    for ax, xs, best in ((axes[0], [r["weight_decay"] for r in mine], o["wd_opt"]),
                         (axes[1], tau, o["tau_opt"])):
      ax.plot(xs, [r["final_eval_loss"] for r in mine], "o-", c=f"C{i}",
              label=f"batch {b} (lr {o['learning_rate']:.2g})")
      ax.axvline(best, c=f"C{i}", ls=":" if o["inside"] else "--", lw=1)
  axes[0].set(xscale="log", xlabel="weight decay lambda", ylabel="final eval loss",
              title="dotted: lambda_opt (dashed: at the grid's edge)")
  axes[1].set(xscale="log", xlabel="tau = B / (lr lambda D)", ylabel="final eval loss",
              title="Power Lines: the minima at one tau")
  for ax in axes:
    ax.legend(fontsize=8)
  figures.save(fig, path, f"AdamW's timescale across batches, {args.examples:,} sequences")
  return True


def main(argv: list[str]) -> int:
  return common.main("timescale", parse, experiment, argv, seeds_inside=True)


if __name__ == "__main__":
  sys.exit(main(sys.argv[1:]))

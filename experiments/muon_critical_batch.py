"""Critical batch of Muon vs AdamW: steps and sequences to a target loss across batch sizes, the
McCandlish fit per optimizer, and a learning-rate check of the batch rule.

    python -m experiments.muon_critical_batch [--batch_sizes 8,16,32,64,128] \\
        [--targets 2.7] [--stated_lr adamw=0.0015,muon=0.012] \\
        [--lr_grid 0.5,1,2 --lr_grid_batches 16,64] [--seeds 1] [--out docs/muon_critical_batch]

Each optimizer, at its `--stated_lr` (stated at batch 16 on configs/sweep_tiny.py and moved by
the sqrt rule), runs the critical-batch sweep (`tools.batch_sweep.run_one`, to the lowest of
`--targets`; the others are read from the same records), fitted per target by
`tools.batch_sweep.summarise`; `--lr_grid` multiples at `--lr_grid_batches` check the rate.
Outputs: OUT.csv (one row per run and target: optimizer, batch, lr multiplier, steps / sequences
to the target, B_simple, the fitted B_crit), OUT.png (the lowest target: steps and sequences vs
batch with each optimizer's fit; the learning-rate check). 17 minutes on 2 busy CPU cores.
Claim and setup: docs/experiments.md#muon-vs-adamw-the-critical-batch; results: docs/muon.md
"""
from __future__ import annotations

import argparse
import dataclasses
import math
import os
import sys

import numpy as np

from experiments import common
from tools import batch_sweep, figures


def build_parser():
  p = common.parser("muon_critical_batch", __doc__)
  p.add_argument("--optimizers", default="adamw,muon")
  p.add_argument("--batch_sizes", type=common.ints, default="8,16,32,64,128")
  p.add_argument("--targets", type=common.floats, default="2.7",
                 help="eval losses; runs train to the lowest, the others are read on the way")
  p.add_argument("--lr_grid", type=common.floats, default="0.5,1,2",
                 help="multipliers of the rule-derived rate")
  p.add_argument("--lr_grid_batches", type=common.ints, default="16,64",
                 help="the batches that also run the --lr_grid multipliers (others: x1 only)")
  p.add_argument("--stated_lr", default="adamw=0.0015,muon=0.012",
                 help="NAME=LR,...: an optimizer's learning rate at the reference batch, "
                      "(default: each one's best at batch 16 of a 2x grid; others: the config's)")
  common.add_to_target_args(p, max_examples=49152)
  return p


def parse(argv):
  p = build_parser()
  args, overrides = p.parse(argv)
  from optim import OPTIMIZERS  # noqa: PLC0415  start-up
  args.optimizers = [o for o in args.optimizers.split(",") if o]
  bad = [o for o in args.optimizers if o not in OPTIMIZERS]
  if bad:
    p.error(f"--optimizers: unknown {bad[0]!r}; choose from {', '.join(OPTIMIZERS)}")
  try:
    args.stated_lr = {k: float(v) for k, v in (x.split("=") for x in args.stated_lr.split(",")
                                               if x)}
  except ValueError:
    p.error(f"--stated_lr {args.stated_lr!r}: give NAME=LR pairs, e.g. muon=0.012")
  unknown = set(args.stated_lr) - set(OPTIMIZERS)
  if unknown:
    p.error(f"--stated_lr: unknown optimizer {sorted(unknown)[0]!r}")
  args.lr_grid = sorted(set(args.lr_grid) | {1.0})
  common.parse_targets(p, args)
  odd = [b for b in args.batch_sizes if b % args.micro_batch_size]
  if odd:
    p.error(f"--batch_sizes: {odd[0]} is not a multiple of --micro_batch_size="
            f"{args.micro_batch_size}")
  return args, overrides


def sweep_args(args) -> argparse.Namespace:
  """What `tools.batch_sweep.run_one` reads of its own command line."""
  return argparse.Namespace(
      target_loss=args.target_loss, micro_batch_size=args.micro_batch_size,
      max_examples=args.max_examples, eval_examples=args.eval_examples,
      eval_sequences=args.eval_sequences, smooth_examples=args.smooth_examples,
      reuse=getattr(args, "reuse", False))


def experiment(args, cfg) -> list[dict]:
  trained = {}
  for name in args.optimizers:
    base = cfg.copy_and_resolve_references()
    base.optim.name = name
    base.optim.learning_rate = args.stated_lr.get(name, base.optim.learning_rate)
    runs = []
    for batch in args.batch_sizes:
      for mult in (args.lr_grid if batch in args.lr_grid_batches else [1.0]):
        workdir = os.path.join(args.workdir, f"{name}_b{batch}_lr{mult:g}")
        r = batch_sweep.run_one(base, batch, mult, sweep_args(args), workdir)
        runs.append(r)
        reached = (f"target at step {r.steps:.1f} ({r.examples:,.0f} sequences)" if r.steps
                   else f"target not reached in {r.steps_run} steps")
        print(f"[muon_bcrit] {name} batch {batch} lr x{mult:g} ({r.learning_rate:.3g}): "
              f"{reached}; {r.seconds:.0f}s", flush=True)
    trained[name] = runs
  hits = {id(r): common.crossings(r.workdir, r.batch_size, cfg.data.seq_len, args.targets,
                                  args.smooth_examples)  # each record read once
          for runs in trained.values() for r in runs}
  rows, lowest = [], None
  for i, target in enumerate(args.targets):
    results, fits, summaries = at_target(trained, {k: h[i] for k, h in hits.items()}, target)
    rows += [dict(optimizer=name, target=target, **dataclasses.asdict(r),
                  b_crit=_b_crit(fits[name])) for name in args.optimizers for r in results[name]]
    lowest = (results, fits, summaries)
  for row in rows:
    row.pop("workdir")
  common.write(args, rows)
  for target in args.targets:
    print(f"[muon_bcrit] to eval loss {target}:")
    print(common.table([r for r in rows if r["target"] == target], COLUMNS, "muon_bcrit"))
  plotted = plot(args.out + ".png", *lowest, args)
  print(f"[muon_bcrit] wrote {args.out}.csv" + (f", {args.out}.png" if plotted
                                                else figures.NO_PLOT))
  return rows


def at_target(trained: dict, hits: dict, target: float):
  """Each optimizer's runs with their crossing of `target` (`hits`: `common.crossings`' entry per
  run, by id), the fit over the best run per batch, and the sweep's summary."""
  results, fits, summaries = {}, {}, {}
  for name, runs in trained.items():
    here = []
    for r in runs:
      hit = hits[id(r)]
      here.append(dataclasses.replace(r, steps=hit["steps"], examples=hit["examples"],
                                      tokens=hit["tokens"], noise_scale=hit["noise_scale"],
                                      best=False))
    _, fit, summary = batch_sweep.summarise(here)
    results[name], fits[name], summaries[name] = here, fit, summary
    if fit is not None:
      print(f"[muon_bcrit] {name} to {target}: S_min {fit.s_min:.1f} steps, E_min "
            f"{fit.e_min:,.0f} sequences, B_crit {fit.b_crit:.1f}"
            + (f" ({fit.note})" if fit.note else ""), flush=True)
  return results, fits, summaries


def _b_crit(fit) -> float | None:
  return None if fit is None else fit.b_crit


COLUMNS = [("optimizer", "optimizer", "s"), ("target", "target", "g"), ("batch_size", "batch", "d"),
           ("lr_multiplier", "lr x", "g"), ("learning_rate", "lr", ".3g"),
           ("steps", "steps to target", ".1f"), ("examples", "sequences", ",.0f"),
           ("noise_scale", "B_simple", ".1f"), ("best", "best", ""),
           ("b_crit", "fitted B_crit", ".1f"), ("seconds", "seconds", ".0f")]


def plot(path: str, results: dict, fits: dict, summaries: dict, args) -> bool:
  plt = figures.pyplot()
  if plt is None:
    return False
  fig, (ax1, ax2, ax3) = plt.subplots(1, 3, figsize=(16, 4.5))
  for i, name in enumerate(args.optimizers):
    best = [r for r in results[name] if r.best]
    if not best:
      continue
    b = [r.batch_size for r in best]
    fit = fits[name]
    label = name if fit is None else f"{name}: B_crit {fit.b_crit:.0f}"
    ax1.plot(b, [r.steps for r in best], "o", c=f"C{i}", label=label)
    ax2.plot(b, [r.examples for r in best], "o-", c=f"C{i}", label=name)
    if fit is not None:
      bs = np.geomspace(min(b) / 1.5, max(b) * 1.5)
      ax1.plot(bs, fit.steps(bs), "-", c=f"C{i}", lw=1)
      ax2.plot(bs, fit.steps(bs) * bs, ":", c=f"C{i}", lw=1)
      if fit.s_min > 0:
        ax1.axvline(fit.b_crit, c=f"C{i}", ls="--", lw=1)
    for j, batch in enumerate(args.lr_grid_batches):
      grid = sorted((r.lr_multiplier, r.steps) for r in results[name] if r.batch_size == batch)
      if len(grid) > 1:
        ax3.plot([m for m, _ in grid], [s if s is not None else math.nan for _, s in grid],
                 "os-^"[j % 4] + "-", c=f"C{i}", label=f"{name}, batch {batch}")
  ax1.set(xscale="log", yscale="log", xlabel="batch (sequences)", ylabel="steps to target",
          title="steps to the target (lines: S_min + E_min/B)")
  ax2.set(xscale="log", yscale="log", xlabel="batch (sequences)",
          ylabel="sequences to target", title="data to the target")
  ax3.set(xscale="log", xlabel="learning rate / the rule-derived rate", ylabel="steps to target",
          title="rates around the rule's, at batch "
          + ", ".join(str(b) for b in args.lr_grid_batches))
  for ax in (ax1, ax2, ax3):
    ax.legend(fontsize=8)
  figures.save(fig, path, f"Muon vs AdamW: eval loss {args.target_loss} across batch sizes "
               "(sweep_tiny; each at its own best rate at batch 16)")
  return True


def main(argv: list[str]) -> int:
  return common.main("muon_critical_batch", parse, experiment, argv,
                     keys=("optimizer", "target", "batch_size", "lr_multiplier"),
                     metrics=("steps", "examples", "noise_scale", "b_crit"),
                     compare=("optimizer", "adamw"))


if __name__ == "__main__":
  sys.exit(main(sys.argv[1:]))

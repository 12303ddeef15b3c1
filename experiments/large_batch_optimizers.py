"""LAMB, LARS and Muon vs AdamW at a large batch: the same token budget, each optimizer with the
learning rate its batch-size rule derives; and each at the small reference batch.

    python -m experiments.large_batch_optimizers [--batch 256] [--reference_batch 16] \\
        [--examples 32768] [--out docs/large_batch_optimizers]
        # the defaults: 21 min on this project's 2-core CPU machine (cores busy), for 8
        # trainings of 32,768 sequences (docs/muon.md)

configs/sweep_tiny.py; each optimizer states its hyperparameters at `--reference_batch` and
moves them to `--batch` by its rules (optim/scaling.py); every run trains `--examples` sequences
(warmup, then cosine) and is scored by its final validation loss. Outputs: OUT.csv (one row per
optimizer and batch), OUT.png (eval loss vs sequences, one panel per batch). Deterministic on a
given machine.
Claims, setup and results: docs/experiments.md#lamb--lars--muon-vs-adamw-at-large-batch
"""
from __future__ import annotations

import math
import os
import sys

from experiments import common
from tools import figures

# (optimizer, the keys it states at the reference batch, its lr rule)
OPTIMIZERS = (
    ("adamw", dict(learning_rate=3e-3, b2=0.99, weight_decay=0.1), "sqrt"),
    ("lamb", dict(learning_rate=0.0, b2=0.0, weight_decay=-1.0), "sqrt"),
    ("lars", dict(learning_rate=0.0, weight_decay=-1.0, trust_coefficient=0.0), "linear"),
    ("muon", dict(learning_rate=3e-3, b2=0.99, weight_decay=0.1), "sqrt"),
)


def build_parser():
  p = common.parser("large_batch_optimizers", __doc__)
  p.add_argument("--batch", type=int, default=256, help="the large batch")
  p.add_argument("--reference_batch", type=int, default=16,
                 help="where the hyperparameters are stated (and the small-batch runs; 0: skip "
                      "them)")
  p.add_argument("--examples", type=int, default=32768, help="training sequences per run")
  p.add_argument("--optimizers", default="adamw,lamb,lars,muon")
  common.add_budget_args(p, evals=16, eval_sequences=128)
  return p


def parse(argv):
  p = build_parser()
  args, overrides = p.parse(argv)
  known = [name for name, _, _ in OPTIMIZERS]
  args.optimizers = [o for o in args.optimizers.split(",") if o]
  bad = [o for o in args.optimizers if o not in known]
  if bad:
    p.error(f"--optimizers: unknown {bad[0]!r}; choose from {', '.join(known)}")
  return args, overrides


def optimizer_config(base, args, name: str, batch: int):
  stated, rule = {n: (s, r) for n, s, r in OPTIMIZERS}[name]
  ref = args.reference_batch or args.batch
  cfg = common.at_budget(base, batch, args.examples, micro=args.micro_batch_size,
                         evals=args.evals, eval_sequences=args.eval_sequences)
  cfg.optim.update(name=name, **stated, reference_batch_size=ref, lr_rule=rule,
                   b2_rule="half_life" if name in ("adamw", "lamb", "muon") else "constant",
                   weight_decay_rule="constant", ema_decay=0.0, schedule="cosine",
                   schedule_unit="examples", warmup_steps=0, warmup_tokens=0, decay_steps=0,
                   decay_tokens=0, warmup_examples=args.examples // 8,
                   decay_examples=args.examples)
  return cfg


def experiment(args, cfg) -> list[dict]:
  from optim import derive  # noqa: PLC0415  start-up
  batches = [args.batch] + ([args.reference_batch] if args.reference_batch
                            and args.reference_batch != args.batch else [])
  rows, curves = [], {}
  for batch in batches:
    for name in args.optimizers:
      c = optimizer_config(cfg, args, name, batch)
      hp = derive(c.optim, batch)
      t = common.train(c, os.path.join(args.workdir, f"{name}_b{batch}"))
      curve = common.eval_curve(t.rows, t.ramp)
      curves[(name, batch)] = curve
      row = {"optimizer": name, "batch_size": batch, "lr_rule": c.optim.lr_rule,
             "learning_rate": hp.learning_rate, "b2": hp.b2 if name != "lars" else None,
             "weight_decay": hp.weight_decay, "trust_coefficient": hp.trust_coefficient,
             "steps": t.steps_run, "examples": t.ramp.examples_before(t.steps_run),
             "final_eval_loss": curve[-1][1] if curve else math.nan, "seconds": t.seconds}
      rows.append(row)
      print(f"[optimizers] {name} at batch {batch}: lr {hp.learning_rate:.4g} ({c.optim.lr_rule} "
            f"from {c.optim.reference_batch_size}), final eval {row['final_eval_loss']:.4f}; "
            f"{t.seconds:.0f}s", flush=True)
  common.write(args, rows)
  print(common.table(rows, COLUMNS, "optimizers"))
  plotted = plot(args.out + ".png", rows, curves, batches, args)
  print(f"[optimizers] wrote {args.out}.csv" + (f", {args.out}.png" if plotted
                                                else figures.NO_PLOT))
  return rows


COLUMNS = [("optimizer", "optimizer", "s"), ("batch_size", "batch", "d"),
           ("lr_rule", "rule", "s"), ("learning_rate", "lr", ".4g"), ("b2", "b2", ".4g"),
           ("steps", "steps", "d"), ("final_eval_loss", "final eval loss", ".4f"),
           ("seconds", "seconds", ".0f")]


def plot(path: str, rows: list[dict], curves: dict, batches: list[int], args) -> bool:
  plt = figures.pyplot()
  if plt is None:
    return False
  fig, axes = plt.subplots(1, len(batches), figsize=(5.5 * len(batches), 4.3), sharey=True,
                           squeeze=False)
  finite = [y for c in curves.values() for _, y in c if math.isfinite(y)]
  for ax, batch in zip(axes[0], batches):
    for i, name in enumerate(args.optimizers):
      curve = curves.get((name, batch))
      r = next(r for r in rows if r["optimizer"] == name and r["batch_size"] == batch)
      if curve:
        ax.plot(*zip(*curve), "o-", ms=3, c=f"C{i}",
                label=f"{name}, lr {r['learning_rate']:.3g}: {r['final_eval_loss']:.3f}")
    ax.set(xlabel="sequences seen", title=f"batch {batch} ({args.examples // batch} steps)",
           ylim=(min(finite) - 0.05, min(finite) + 1.5))
    ax.legend(fontsize=8)
  axes[0][0].set_ylabel("eval loss")
  figures.save(fig, path, f"LAMB / LARS / Muon vs AdamW at the same {args.examples:,} sequences, "
               "rule-derived learning rates (sweep_tiny model)")
  return True


def main(argv: list[str]) -> int:
  return common.main("optimizers", parse, experiment, argv, keys=("optimizer", "batch_size"),
                     metrics=("final_eval_loss",), compare=("optimizer", "adamw"))


if __name__ == "__main__":
  sys.exit(main(sys.argv[1:]))

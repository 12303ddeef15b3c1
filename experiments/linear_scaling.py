"""Linear scaling + warmup (Goyal et al. 2017): SGD with momentum, loss at a fixed token budget
across batch sizes, with the linear learning-rate rule and warmup, the rule without warmup, and
no rule.

    python -m experiments.linear_scaling [--batch_sizes 8,16,32,64,128,256] \\
        [--examples 16384] [--lr 0.15] [--out docs/linear_scaling]

configs/sweep_tiny.py with SGD, the rate `--lr` stated at the smallest batch and moved by
`optim.lr_rule` (linear, or none in the third arm); every batch trains `--examples` sequences
and is scored by its final validation loss (a run that blows up is marked diverged). Outputs:
OUT.csv (one row per arm and batch), OUT.png (final loss vs batch for the three arms; the
learning rate each used). 18 minutes on 2 busy CPU cores; deterministic on a given machine.
Claim, setup and results: docs/experiments.md#linear-scaling--warmup
"""
from __future__ import annotations

import math
import os
import sys

from experiments import common
from tools import figures

ARMS = (("linear + warmup", "linear", True), ("linear, no warmup", "linear", False),
        ("no rule (same lr)", "none", True))


def build_parser():
  p = common.parser("linear_scaling", __doc__)
  p.add_argument("--batch_sizes", type=common.ints, default="8,16,32,64,128,256")
  p.add_argument("--examples", type=int, default=16384, help="training sequences per run")
  p.add_argument("--lr", type=float, default=0.15, help="SGD rate at the smallest batch")
  p.add_argument("--warmup_fraction", type=float, default=1 / 16)
  common.add_budget_args(p, evals=8, eval_sequences=128)
  return p


def parse(argv):
  return build_parser().parse(argv)


def arm_config(base, args, batch: int, rule: str, warmup: bool):
  cfg = common.at_budget(base, batch, args.examples, micro=args.micro_batch_size,
                         evals=args.evals, eval_sequences=args.eval_sequences)
  o = cfg.optim
  o.update(name="sgd", learning_rate=args.lr, weight_decay=-1.0, momentum=0.9, nesterov=False,
           clip_norm=0.0, reference_batch_size=args.batch_sizes[0], lr_rule=rule,
           b2_rule="constant", weight_decay_rule="constant", ema_decay=0.0, schedule="cosine",
           schedule_unit="examples", warmup_steps=0, warmup_tokens=0, decay_steps=0,
           decay_tokens=0, decay_examples=args.examples,
           warmup_examples=round(args.examples * args.warmup_fraction) if warmup else 0)
  return cfg


def experiment(args, cfg) -> list[dict]:
  from optim import derive  # noqa: PLC0415  start-up
  rows, done = [], {}
  for batch in args.batch_sizes:
    for name, rule, warmup in ARMS:
      c = arm_config(cfg, args, batch, rule, warmup)
      key = (batch, derive(c.optim, batch).learning_rate, c.optim.warmup_examples)
      if key in done:  # the same run as another arm's (the reference batch)
        row = {**done[key], "arm": name}
      else:
        slug = f"b{batch}_{rule}_{'warmup' if warmup else 'nowarmup'}"
        t = common.train(c, os.path.join(args.workdir, slug))
        curve = common.eval_curve(t.rows, t.ramp)
        finite = [(x, y) for x, y in curve if math.isfinite(y)]
        diverged = is_diverged([y for _, y in curve], c.model.vocab_size)
        row = {"arm": name, "batch_size": batch, "lr_rule": rule,
               "learning_rate": derive(c.optim, batch).learning_rate,
               "warmup_examples": c.optim.warmup_examples, "steps": t.steps_run,
               "examples": t.ramp.examples_before(t.steps_run),
               "final_eval_loss": finite[-1][1] if finite else math.nan,
               "diverged": diverged, "seconds": t.seconds}
        # over seeds: the loss of the runs that trained, and the fraction that diverged
        row.update(trained_loss=math.nan if diverged else row["final_eval_loss"],
                   diverged_fraction=float(diverged))
        done[key] = row
      rows.append(row)
      print(f"[linear] {name:18s} batch {batch:4d}: lr {row['learning_rate']:.3g}, final eval "
            f"{row['final_eval_loss']:.4f}" + (" (diverged)" if row["diverged"] else "")
            + f"; {row['seconds']:.0f}s", flush=True)
  common.write(args, rows)
  print(common.table(rows, COLUMNS, "linear"))
  plotted = plot(args.out + ".png", rows, args)
  print(f"[linear] wrote {args.out}.csv" + (f", {args.out}.png" if plotted else figures.NO_PLOT))
  return rows


def is_diverged(evals: list[float], vocab_size: int) -> bool:
  """A run diverged if an evaluation was non-finite or far above the first one, or if it ends
  no better than a uniform prediction (loss ln V: an overflow the trainer's non-finite
  policy skipped leaves the model there)."""
  if not evals:
    return True
  return (not all(math.isfinite(y) for y in evals) or any(y > evals[0] + 1 for y in evals)
          or evals[-1] >= math.log(vocab_size) - 0.05)


COLUMNS = [("arm", "arm", "s"), ("batch_size", "batch", "d"), ("learning_rate", "lr", ".3g"),
           ("steps", "steps", "d"), ("final_eval_loss", "final eval loss", ".4f"),
           ("diverged", "diverged", "")]


def plot(path: str, rows: list[dict], args) -> bool:
  """Final loss vs batch per arm (diverged runs as x at the top edge); the learning rate each
  arm used vs batch, diverged runs marked."""
  plt = figures.pyplot()
  if plt is None:
    return False
  fig, (ax1, ax2) = plt.subplots(1, 2, figsize=(11, 4.3))
  ok = [r["final_eval_loss"] for r in rows if not r["diverged"]]
  top = max(ok) + 0.25
  for i, (name, _, _) in enumerate(ARMS):
    arm = [r for r in rows if r["arm"] == name]
    good = [r for r in arm if not r["diverged"]]
    bad = [r for r in arm if r["diverged"]]
    ax1.plot([r["batch_size"] for r in good], [r["final_eval_loss"] for r in good], "o-",
             c=f"C{i}", label=name)
    ax1.plot([r["batch_size"] for r in bad], [top - 0.04 * i] * len(bad), "x", c=f"C{i}", ms=9,
             mew=2)
    for marks, style in ((good, "o-"), (bad, "x")):
      ax2.plot([r["batch_size"] for r in marks], [r["learning_rate"] for r in marks], style,
               c=f"C{i}", ms=8 if style == "x" else 5, mew=2, label=name if style == "o-" else None)
  ax1.set(xscale="log", xlabel="batch size (sequences)", ylabel="final eval loss",
          ylim=(min(ok) - 0.05, top + 0.05),
          title=f"SGD-momentum after {args.examples:,} sequences (x: diverged)")
  ax2.set(xscale="log", yscale="log", xlabel="batch size (sequences)", ylabel="learning rate",
          title="the rate each arm used (x: diverged)")
  ax2.yaxis.set_major_formatter(plt.matplotlib.ticker.ScalarFormatter())
  ax2.yaxis.set_minor_formatter(plt.matplotlib.ticker.NullFormatter())
  for ax in (ax1, ax2):
    ax.set_xticks(args.batch_sizes, [str(b) for b in args.batch_sizes])
    ax.legend(fontsize=8)
  figures.save(fig, path, "Linear scaling rule + warmup (Goyal et al. 2017), sweep_tiny model")
  return True


def main(argv: list[str]) -> int:
  return common.main("linear", parse, experiment, argv, keys=("arm", "batch_size"),
                     metrics=("trained_loss", "diverged_fraction", "final_eval_loss"),
                     compare=("arm", "no rule (same lr)"))


if __name__ == "__main__":
  sys.exit(main(sys.argv[1:]))

"""FP8 dense layers against bf16: is the loss curve within the run-to-run noise of seeds?

    python -m experiments.fp8_loss [--seeds 0,1,2] [--config configs/lm_tiny.py] \\
        [--out docs/fp8_loss] [--config.steps=300 ...]

Runs the base config in bf16 once per seed without and with `model.fp8`, and judges fp8 "within
noise" when the mean paired difference fp8 - bf16 is at most the bf16 runs' seed-to-seed
standard deviation at every eval step after the first. On CPU fp8 is emulated: the curve means
something there, not the time. Outputs: OUT.csv (one row per run and eval step), OUT.png (the
eval curves and the paired differences against the noise band). 12 minutes on 2 busy CPU cores.
Claim and method: docs/experiments.md#fp8-against-bf16; results: docs/accelerators.md#fp8
"""
from __future__ import annotations

import os
import statistics
import sys

from experiments import common
from tools import figures

DEFAULT_CONFIG = os.path.join("configs", "lm_tiny.py")


def build_parser():
  p = common.parser("fp8_loss", __doc__, seeds=False)
  p.set_defaults(config=DEFAULT_CONFIG)
  p.add_argument("--seeds", type=common.ints, default="0,1,2",
                 help="seeds of the run pairs (at least 2)")
  p.add_argument("--eval_every", type=int, default=50)
  return p


def parse(argv):
  p = build_parser()
  args, overrides = p.parse(argv)
  if len(args.seeds) < 2 or len(set(args.seeds)) != len(args.seeds):
    p.error("--seeds needs two or more different seeds (the noise is their spread)")
  return args, overrides


def run_config(cfg, args, seed: int, fp8: bool):
  c = cfg.copy_and_resolve_references()
  c.seed = seed
  c.model.update(dtype="bfloat16", fp8=fp8)
  c.eval_every = args.eval_every
  c.checkpoint.every_steps = 0
  return c


def compare(curves: dict) -> list[dict]:
  """Per eval step: the mean paired difference fp8 - bf16 and the bf16 seed spread.
  `curves[(variant, seed)]` = {step: eval loss}."""
  seeds = sorted({s for _, s in curves})
  steps = sorted(set.intersection(*(set(c) for c in curves.values())))
  out = []
  for step in steps:
    diffs = [curves[("fp8", s)][step] - curves[("bf16", s)][step] for s in seeds]
    out.append({"step": step, "mean_diff": statistics.mean(diffs),
                "bf16_std": statistics.stdev(curves[("bf16", s)][step] for s in seeds),
                "fp8_std": statistics.stdev(curves[("fp8", s)][step] for s in seeds)})
  return out


def experiment(args, cfg) -> list[dict]:
  rows, curves = [], {}
  for seed in args.seeds:
    for variant in ("bf16", "fp8"):
      c = run_config(cfg, args, seed, variant == "fp8")
      t = common.train(c, os.path.join(args.workdir, f"{variant}_seed{seed}"))
      if t.status != "done":
        raise RuntimeError(f"{variant} seed {seed} ended {t.status}")
      curve = {r["step"]: r["eval_loss"] for r in t.rows if "eval_loss" in r}
      curves[(variant, seed)] = curve
      rows += [{"variant": variant, "seed": seed, "step": s, "eval_loss": v,
                "seconds": t.seconds} for s, v in sorted(curve.items())]
      print(f"[fp8_loss] {variant} seed {seed}: final eval {curve[max(curve)]:.4f}; "
            f"{t.seconds:.0f}s", flush=True)
  table = compare(curves)
  common.write(args, rows)
  print(common.table(table, COLUMNS, "fp8_loss"))
  judged = table[1:] or table
  within = all(abs(r["mean_diff"]) <= r["bf16_std"] for r in judged)
  last = table[-1]
  print(f"[fp8_loss] final step {last['step']}: fp8 - bf16 {last['mean_diff']:+.4f} (mean over "
        f"{len(args.seeds)} seeds, paired), bf16 seed std {last['bf16_std']:.4f}; "
        f"within noise at every eval step after the first: {'yes' if within else 'no'}")
  plotted = plot(args.out + ".png", curves, table)
  print(f"[fp8_loss] wrote {args.out}.csv" + (f", {args.out}.png" if plotted
                                              else figures.NO_PLOT))
  return rows


COLUMNS = [("step", "step", "d"), ("mean_diff", "fp8 - bf16 (mean)", "+.4f"),
           ("bf16_std", "bf16 seed std", ".4f"), ("fp8_std", "fp8 seed std", ".4f")]


def plot(path: str, curves: dict, table: list[dict]) -> bool:
  plt = figures.pyplot()
  if plt is None:
    return False
  fig, (ax1, ax2) = plt.subplots(1, 2, figsize=(11, 4.3))
  for (variant, seed), curve in sorted(curves.items()):
    steps = sorted(curve)
    ax1.plot(steps, [curve[s] for s in steps], ls="-" if variant == "bf16" else "--",
             c=f"C{seed % 10}", lw=1.2, label=f"{variant} seed {seed}")
  ax1.set(xlabel="step", ylabel="eval loss", title="eval loss")
  ax1.legend(fontsize=7)
  steps = [r["step"] for r in table]
  std = [r["bf16_std"] for r in table]
  ax2.fill_between(steps, [-s for s in std], std, color="0.85", label="+- bf16 seed std")
  ax2.plot(steps, [r["mean_diff"] for r in table], "o-", c="C3",
           label="fp8 - bf16, mean over seeds")
  ax2.axhline(0, c="0.5", lw=0.8)
  ax2.set(xlabel="step", ylabel="eval loss difference", title="fp8 - bf16 vs seed noise")
  ax2.legend(fontsize=7)
  figures.save(fig, path, "FP8 dense layers vs bf16")
  return True


if __name__ == "__main__":
  sys.exit(common.main("fp8_loss", parse, experiment, sys.argv[1:]))

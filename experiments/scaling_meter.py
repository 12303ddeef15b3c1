"""The gradient noise scale against the scaling lab's critical batch, cell by cell.

    python -m experiments.scaling_meter [the lab's flags] [--sequences 2048]
    python -m experiments.scaling_meter --from_meter A_meter.csv B_meter.csv --out OUT

After a lab (the same flags: its OUT.csv and OUT_runs.csv), per width the reference run of the
config's seed trains again (the lab's iterates) with a checkpoint at every budget, where
`tools.noise_check` measures the truth, tr(Sigma) / |G|^2 and the preconditioned
tr(P Sigma) / G^T P G, from the per-sequence gradients of `--sequences` windows, beside what the
meter logged there and the medians the grid's runs logged at their crossings per rate. Over the
cells the lab fitted (refused and transient ones out): Pearson's r of the logs against B_crit
with its Fisher-z interval, and estimate / B_crit's median and range -> OUT_meter.{csv,json}.
`--from_meter` trains nothing: it pools several such files (one per width: the lab runs a width
per command) into one summary. Why: docs/scaling_lab.md#the-meter-against-the-labs-critical-batch
"""
from __future__ import annotations

import argparse
import json
import math
import os
import sys

import numpy as np

from experiments import common, critical_batch_scaling as lab
from experiments.scaling_runs import Task, job, reference_stop
from tools import figures, stats
from tools.batch_sweep import run_config
from tools.noise_check import check_run
from trainer.config import ConfigError
from trainer.run.inprocess import train

ESTIMATES = ("truth", "truth_precond", "logged", "logged_precond", "crossing", "crossing_precond")


def build_parser():
  p = lab.build_parser()
  p.prog = "python -m experiments.scaling_meter"
  p.description = __doc__
  p.add_argument("--sequences", type=int, default=2048,
                 help="windows whose per-sequence gradients make each checkpoint's truth")
  p.add_argument("--truth_seed", type=int, default=12345,
                 help="the seed of the truth's data order (not the run's)")
  p.add_argument("--from_meter", nargs="+", default=[], metavar="METER_CSV",
                 help="train nothing: pool the cells of these OUT_meter.csv files, e.g. one per "
                      "width, and summarise them together")
  return p


def parse(argv):
  return lab.parse(argv, build_parser)


def reference_checkpoints(args, cfg, width: int, ref: int) -> str:
  """Train width's reference run (the config's seed, at the reference batch `ref`) with a
  checkpoint at every budget; its workdir (`--workdir`/meter/d<width>)."""
  if any(d % ref for d in args.budgets):
    raise ConfigError(f"--budgets {args.budgets}: each must be a multiple of the reference "
                      f"batch {ref} (a checkpoint at every budget)")
  task = Task(width, ref, 1.0, cfg.seed)
  task_cfg = lab.task_config(cfg, task, args)
  j = job(task, task_cfg, args, reference_stop(args))
  run_cfg = run_config(task_cfg, ref, 1.0, argparse.Namespace(**j["args"]))
  run_cfg.steps = args.budgets[-1] // ref
  run_cfg.checkpoint.every_steps = math.gcd(*[d // ref for d in args.budgets])
  run_cfg.checkpoint.keep = len(args.budgets) * 64
  workdir = os.path.join(args.workdir, "meter", f"d{width}")
  train(run_cfg, workdir, keep_checkpoints=True)
  return workdir


def pooled(args) -> list[dict]:
  """`--from_meter`: the cells of several meter CSVs, summarised together."""
  rows = [r for path in args.from_meter for r in figures.read_table(
      path, ("width", "budget", "b_crit", "refused", "transient", *ESTIMATES),
      "an OUT_meter.csv of experiments.scaling_meter")]
  for r in rows:
    r["refused"], r["transient"] = r["refused"] or None, bool(r["transient"])
  print(f"[meter] {len(rows)} cells of {' '.join(args.from_meter)}: widths "
        f"{sorted({int(r['width']) for r in rows})}; nothing trained or measured", flush=True)
  write(args, rows)
  return rows


def write(args, rows: list[dict]) -> None:
  summary = summarize(rows)
  figures.write_csv(args.out + "_meter.csv", [lab.compact(r) for r in rows])
  with open(args.out + "_meter.json", "w") as f:
    json.dump(summary, f, indent=1)
  print(f"[meter] wrote {args.out}_meter.csv, {args.out}_meter.json")


def experiment(args, cfg) -> list[dict]:
  if args.from_meter:
    return pooled(args)
  seq = cfg.data.seq_len
  ref = cfg.optim.reference_batch_size or cfg.data.global_batch_size
  cells = figures.read_table(args.out + ".csv", ("width", "budget", "b_crit"),
                             "the lab's OUT.csv: run experiments.critical_batch_scaling first")
  runs = figures.read_table(args.out + "_runs.csv", ("width", "budget", "lr_multiplier",
                                                     "noise_scale", "steps"),
                            "the lab's OUT_runs.csv")
  rows = []
  for w in args.widths:
    workdir = reference_checkpoints(args, cfg, w, ref)
    checks = check_run(workdir, [d // ref for d in args.budgets], sequences=args.sequences,
                       groups=16, seed=args.truth_seed)
    for d, c in zip(args.budgets, checks):
      cell = next((x for x in cells if (x["width"], x["budget"]) == (w, d)), None)
      if cell is None:
        raise ConfigError(f"{args.out}.csv has no cell d{w} D {d}: run the lab with the same "
                          "--widths and --budgets first")
      mine = [r for r in runs if (r["width"], r["budget"]) == (w, d) and r["steps"] is not None]
      row = dict(width=w, budget=d, tokens=d * seq, params=cell.get("params"),
                 b_crit=cell.get("b_crit"), b_crit_lo=cell.get("b_crit_lo"),
                 b_crit_hi=cell.get("b_crit_hi"), b_zhang=cell.get("b_zhang"),
                 refused=cell.get("refused"), transient=cell.get("transient"),
                 truth=c["truth"], truth_se=c["truth_se"],
                 truth_precond=c.get("truth_precond"), truth_precond_se=c.get("truth_precond_se"),
                 logged=c["logged"], logged_precond=c.get("logged_precond"),
                 crossing=median(r["noise_scale"] for r in mine),
                 crossing_precond=median(r.get("noise_scale_precond") for r in mine))
      for m in sorted({r["lr_multiplier"] for r in mine}):
        at = [r for r in mine if r["lr_multiplier"] == m]
        row[f"crossing_x{m:g}"] = median(r["noise_scale"] for r in at)
        row[f"crossing_precond_x{m:g}"] = median(r.get("noise_scale_precond") for r in at)
      rows.append(row)
      print(f"[meter] d{w} D {d:,}: B_crit {fmt(row['b_crit'])}; truth {row['truth']:.1f} "
            f"(s.e. {row['truth_se']:.1f}), preconditioned {fmt(row['truth_precond'])}; logged "
            f"{fmt(row['logged'])} / {fmt(row['logged_precond'])}; at the grid's crossings "
            f"{fmt(row['crossing'])} / {fmt(row['crossing_precond'])}", flush=True)
  write(args, rows)
  return rows


def summarize(rows: list[dict]) -> dict:
  """Per estimate, over the fitted cells: r of the logs against B_crit with its interval, and
  the ratio's median and range."""
  fitted = [r for r in rows if r["b_crit"] is not None and not r["refused"]
            and not r["transient"]]
  out = {"cells": len(fitted), "of": len(rows)}
  print(f"[meter] {len(fitted)} of {len(rows)} cells fitted by the lab (refused and transient "
        "ones left out)")
  for key in ESTIMATES:
    pairs = [(r[key], r["b_crit"]) for r in fitted if r.get(key)]
    if len(pairs) < 3:
      continue
    est, crit = np.log(np.array(pairs)).T
    c = stats.correlation(est, crit)
    ratio = np.exp(est - crit)
    out[key] = dict(r=c.r, r_lo=c.lo, r_hi=c.hi, p=c.p, n=c.n,
                    ratio_median=float(np.median(ratio)), ratio_min=float(ratio.min()),
                    ratio_max=float(ratio.max()))
    print(f"[meter] {key:16s} against B_crit (logs): {c.text()}; estimate / B_crit median "
          f"{np.median(ratio):.2f} (range {ratio.min():.2f}-{ratio.max():.2f})")
  return out


def median(values) -> float | None:
  v = [float(x) for x in values if x is not None and math.isfinite(float(x))]
  return float(np.median(v)) if v else None


def fmt(x) -> str:
  return "-" if x is None else f"{x:.1f}"


def main(argv: list[str]) -> int:
  return common.main("meter", parse, experiment, argv, seeds_inside=True)


if __name__ == "__main__":
  sys.exit(main(sys.argv[1:]))

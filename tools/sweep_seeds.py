"""A critical-batch sweep over seeds (`tools.batch_sweep --seeds N`): the spread of B_crit, S_min,
E_min, B_simple and the steps per batch (batch_sweep_seeds.json), and a row per seed
(batch_sweep_seeds.csv), so that two sweeps of the same seeds compare seed by seed through
`python -m tools.stats`. Several sweeps side by side, steps to the target against batch:

    python -m tools.sweep_seeds A/batch_sweep_seeds.csv B/batch_sweep_seeds.csv --out FIG.png
"""
from __future__ import annotations

import json
import math
import os
import shutil
import sys

from tools import figures, stats
from trainer.config import ConfigError
from trainer.config.cli import CliParser


def over_seeds(summaries: list[dict]) -> dict:
  """`stats.spread` over the seeds' sweeps of B_crit, S_min, E_min, the median B_simple, and the steps
  to the target at each batch."""
  out = {k: stats.spread([s.get(k) for s in summaries])
         for k in ("b_crit", "s_min", "e_min", "b_simple_median")}
  batches = sorted({b for s in summaries for b in s["steps"]})
  out["steps"] = {b: stats.spread([s["steps"].get(b) for s in summaries]) for b in batches}
  out["seeds"] = [s["seed"] for s in summaries]
  return out


def seed_rows(summaries: list[dict]) -> list[dict]:
  """A row per seed's sweep (batch_sweep_seeds.csv): its optimizer, B_crit (and log2 of it, the
  scale two arms are compared on), the fit's residual interval, S_min, E_min, B_simple, the
  batches whose rate is censored, and the steps to the target at each batch, so that two
  sweeps that share their seeds compare seed by seed (`python -m tools.stats`)."""
  rows = []
  for s in summaries:
    b = s.get("b_crit")
    row = {"seed": s["seed"], "optimizer": s.get("optimizer"),
           "target_metric": s.get("target_metric"), "target": s.get("target_loss"),
           "b_crit": b, "log2_b_crit": math.log2(b) if b and b > 0 else None,
           "b_crit_lo": s.get("b_crit_lo"), "b_crit_hi": s.get("b_crit_hi"),
           "s_min": s.get("s_min"), "e_min": s.get("e_min"),
           "b_simple_median": s.get("b_simple_median"),
           "censored": "/".join(map(str, s.get("censored", [])))}
    rows.append({**row, **{f"steps_{k}": v for k, v in s["steps"].items()}})
  return rows


def report(args, summaries: list[dict], first_seed: int) -> None:
  """Write batch_sweep_seeds.json and .csv into `args.out`, the first seed's figure as the
  sweep's (`args.plot`), and print the spread."""
  summary = over_seeds(summaries)
  with open(os.path.join(args.out, "batch_sweep_seeds.json"), "w") as f:
    json.dump(summary, f, indent=1)
  figures.write_csv(os.path.join(args.out, "batch_sweep_seeds.csv"), seed_rows(summaries))
  first = os.path.join(args.out, f"seed{first_seed}", "batch_sweep.png")
  if os.path.exists(first):
    shutil.copyfile(first, args.plot)
  text = lambda s: "-" if s is None else (f"{s['mean']:.4g} +- {s['std']:.2g} "
                                          f"({s['min']:.4g}-{s['max']:.4g}, n={s['n']})")
  print(f"[sweep] over seeds {summary['seeds']}: B_crit {text(summary['b_crit'])}; S_min "
        f"{text(summary['s_min'])}; E_min {text(summary['e_min'])}; B_simple at the target "
        f"{text(summary['b_simple_median'])}")
  for b, s in summary["steps"].items():
    print(f"[sweep]   batch {b}: steps to the target {text(s)}")
  print(f"[sweep] wrote {args.out}/batch_sweep_seeds.json, batch_sweep_seeds.csv (a row per "
        "seed: two sweeps compare seed by seed with python -m tools.stats)")


def curves(rows: list[dict]) -> dict[int, list[float]]:
  """{batch: the seeds' steps to the target} of one sweep's batch_sweep_seeds.csv rows."""
  batches = sorted(int(k[len("steps_"):]) for k in rows[0] if k.startswith("steps_"))
  return {b: [r[f"steps_{b}"] for r in rows if r.get(f"steps_{b}") is not None] for b in batches}


def build_parser():
  p = CliParser("-m tools.sweep_seeds", __doc__, config=False, overrides=False)
  p.add_argument("csv", nargs="+", help="sweeps' batch_sweep_seeds.csv (tools.batch_sweep --seeds)")
  p.add_argument("--out", required=True, help="the figure (.png)")
  return p


def main(argv: list[str]) -> int:
  """Each sweep's steps to its target per batch (every seed a point, their mean a line, labelled
  by optimizer and B_crit's seed mean) on log-log axes, and the means printed."""
  try:
    args, _ = build_parser().parse(argv)
    sweeps = [figures.read_table(path, ("seed", "optimizer", "b_crit", "target_metric",
                                        "target"), "a sweep's batch_sweep_seeds.csv")
              for path in args.csv]
    for path, rows in zip(args.csv, sweeps):
      if not any(k.startswith("steps_") for k in rows[0]):
        raise ConfigError(f"{path}: no steps_<batch> columns; give a sweep's batch_sweep_seeds.csv")
  except ConfigError as e:
    print(f"error: {e}", file=sys.stderr)
    return 2
  plt = figures.pyplot()
  fig, ax = (plt.subplots(figsize=(6, 4)) if plt else (None, None))
  for i, (path, rows) in enumerate(zip(args.csv, sweeps)):
    name = rows[0]["optimizer"] or os.path.basename(os.path.dirname(path)) or path
    steps = curves(rows)
    means = {b: m["mean"] for b, m in ((b, stats.spread(v)) for b, v in steps.items()) if m}
    b_crit = stats.spread([r["b_crit"] for r in rows])
    label = f"{name}: B_crit {b_crit['mean']:.3g} (n={b_crit['n']})" if b_crit else name
    print(f"[sweep] {label}; mean steps to {rows[0]['target_metric']} {rows[0]['target']:g}: "
          + ", ".join(f"{b}: {m:.1f}" for b, m in means.items()))
    if ax is not None:
      for b, v in steps.items():
        ax.plot([b] * len(v), v, "o", color=f"C{i}", ms=3, alpha=0.5)
      ax.plot(list(means), list(means.values()), "-", color=f"C{i}", label=label)
  if ax is None:
    print("[sweep] no figure (matplotlib is not installed)")
    return 0
  ax.set(xscale="log", yscale="log", xlabel="batch (sequences)",
         ylabel=f"steps to {sweeps[0][0]['target_metric']} {sweeps[0][0]['target']:g}")
  ax.legend(fontsize=8)
  figures.save(fig, args.out, "steps to the target against batch (points: seeds; lines: means)")
  print(f"[sweep] wrote {args.out}")
  return 0


if __name__ == "__main__":
  sys.exit(main(sys.argv[1:]))

"""A critical-batch sweep over seeds (`tools.batch_sweep --seeds N`): the spread of B_crit, S_min,
E_min, B_simple and the steps per batch (batch_sweep_seeds.json), and a row per seed
(batch_sweep_seeds.csv), so that two sweeps of the same seeds compare seed by seed through
`python -m tools.stats`."""
from __future__ import annotations

import json
import math
import os
import shutil

from tools import figures, stats


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

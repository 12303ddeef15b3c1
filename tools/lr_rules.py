"""The optimal learning rate per batch, measured, against the rules that predict it.

    python -m tools.lr_rules docs/critical_batch_scaling_lr.csv

Reads the scaling lab's OUT_lr.csv (a row per width, budget and batch: `lr_opt`, the rate with
the fewest mean steps to the target, and whether it is `interior` to the rates run) and fits,
per (width, budget), over the batches whose optimum is interior:

- a power law lr_opt ~ B^k (least squares in log-log, k with its Student-t interval): the sqrt
  rule says k = 0.5 (Adam-type, Granziol et al.; Malladi et al.), the linear rule k = 1;
- McCandlish et al.'s lr_opt = lr_max / (1 + B_noise / B) (their eq. 2.6, for SGD), whose
  B_noise is a noise scale measured from the rates alone.

Both with the RMS of their log residuals, so the forms can be compared on the same points.
Writes the fits to JSON (default `<CSV stem>.json`). No jax here.
"""
from __future__ import annotations

import json
import math
import os
import sys

import numpy as np
from scipy import optimize, stats

from tools import figures
from trainer.config import ConfigError
from trainer.config.cli import CliParser


def power_law(batches, lrs, level: float = 0.95) -> dict | None:
  """log lr = c + k log B: k, its t interval, the RMS log residual; None with < 3 points."""
  b, y = np.log(np.asarray(batches, float)), np.log(np.asarray(lrs, float))
  if len(b) < 3:
    return None
  fit = stats.linregress(b, y)
  half = float(stats.t.ppf((1 + level) / 2, len(b) - 2)) * fit.stderr
  resid = y - (fit.intercept + fit.slope * b)
  return dict(k=float(fit.slope), k_lo=float(fit.slope - half), k_hi=float(fit.slope + half),
              rms=float(np.sqrt(np.mean(resid ** 2))), points=len(b))


def mccandlish(batches, lrs) -> dict | None:
  """lr = lr_max / (1 + B_noise / B) by least squares on log lr: lr_max, B_noise, the RMS log
  residual; None with < 3 points or where it does not converge."""
  b, y = np.asarray(batches, float), np.log(np.asarray(lrs, float))
  if len(b) < 3:
    return None
  model = lambda x, log_max, log_noise: log_max - np.log1p(np.exp(log_noise) / x)
  try:
    (log_max, log_noise), _ = optimize.curve_fit(
        model, b, y, p0=(y.max() + 0.5, math.log(np.median(b))), maxfev=20000)
  except (RuntimeError, optimize.OptimizeWarning):
    return None
  resid = y - model(b, log_max, log_noise)
  return dict(lr_max=float(math.exp(log_max)), b_noise=float(math.exp(log_noise)),
              rms=float(np.sqrt(np.mean(resid ** 2))), points=len(b))


def fits(rows: list[dict]) -> list[dict]:
  """Per (width, budget) of the rows (per (width, depth, budget) on a lab's depth grid): both
  fits over the interior optima."""
  out = []
  size = lambda r: (r["width"], int(r.get("depth") or 0), r["budget"])  # noqa: E731
  for w, depth, d in sorted({size(r) for r in rows}):
    mine = [r for r in rows if size(r) == (w, depth, d) and r.get("interior") and r.get("lr_opt")]
    b, lr = [r["batch"] for r in mine], [r["lr_opt"] for r in mine]
    out.append(dict(width=w, **({"depth": depth} if depth else {}), budget=d, batches=b,
                    lr_opt=lr, power_law=power_law(b, lr), mccandlish=mccandlish(b, lr),
                    edge=[r["batch"] for r in rows if size(r) == (w, depth, d)
                          and not r.get("interior")]))
  return out


def report(rows: list[dict], path: str) -> list[dict]:
  """Print the fits (one line per width and budget) and write them to `path` (JSON)."""
  result = fits(rows)
  for f in result:
    p, m = f["power_law"], f["mccandlish"]
    depth = f" L{f['depth']}" if f.get("depth") else ""
    line = (f"[lr_rules] d{f['width']}{depth} D {f['budget']:,}: lr_opt at "
            f"{len(f['batches'])} batches")
    if p:
      line += (f"; lr_opt ~ B^{p['k']:.2f} [{p['k_lo']:.2f}, {p['k_hi']:.2f}] (sqrt rule 0.5; "
               f"RMS log residual {p['rms']:.3f})")
    if m:
      line += (f"; lr_max / (1 + B_noise / B): lr_max {m['lr_max']:.3g}, B_noise "
               f"{m['b_noise']:.3g} (RMS {m['rms']:.3f})")
    if f["edge"]:
      line += f"; optimum at the grid's edge at batch {', '.join(map(str, f['edge']))}"
    print(line, flush=True)
  with open(path, "w") as fh:
    json.dump(result, fh, indent=1)
  return result


def build_parser():
  p = CliParser("-m tools.lr_rules", __doc__, config=False, overrides=False)
  p.add_argument("csv", help="the scaling lab's OUT_lr.csv")
  p.add_argument("--out", default="", help="the JSON (default <CSV stem>.json)")
  return p


def main(argv: list[str]) -> int:
  try:
    args, _ = build_parser().parse(argv)
    rows = figures.read_table(args.csv, ("width", "budget", "batch", "lr_opt", "interior"),
                              "the scaling lab's OUT_lr.csv")
  except ConfigError as e:
    print(f"error: {e}", file=sys.stderr)
    return 2
  report(rows, args.out or os.path.splitext(args.csv)[0] + ".json")
  return 0


if __name__ == "__main__":
  sys.exit(main(sys.argv[1:]))

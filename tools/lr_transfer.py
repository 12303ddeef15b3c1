"""muP learning-rate transfer (Tensor Programs V, Fig. 1): training loss over a learning-rate x
width grid under SP and muP; where is the best learning rate at each width?

    python -m tools.lr_transfer [--widths 32,64,128,256] [--lrs 2^-12,...,2^-5] \\
        [--base_width 32] [--steps 100] [--out runs/lr_transfer]

Every run is the setting of tools/coord_check.py trained `--steps` steps at a constant rate and
scored by its mean training loss over the last `--tail` steps; a width's best rate is the grid
minimum refined by a parabola in log(lr) (reported only inside the grid). Under SP the best rate
should fall as the width grows; under muP it should stay put. Outputs in `--out`:
`lr_transfer.csv` (parametrization, width, lr, score, final loss, seconds per run),
`lr_transfer.png` (score vs lr per parametrization, one line per width; needs matplotlib, the
`tools` extra). Deterministic on a given machine.
Setup and results: docs/mup.md#coordinate-check-and-learning-rate-transfer
"""
from __future__ import annotations

import math
import os
import sys
import time

import numpy as np

from tools import figures
from tools.coord_check import Setup, batches, parse_sweep_args, start, sweep_parser, train


def parse_lr(text: str) -> float:
  """'3e-3' or '2^-8'."""
  if "^" in text:
    base, exp = text.split("^")
    return float(base) ** float(exp)
  return float(text)


def best_lr(lrs, scores) -> tuple[float, bool]:
  """(best learning rate, inside the grid?): the grid argmin, refined by a parabola in log(lr)
  through it and its neighbours when it is not at an end of the grid. NaN scores lose."""
  lrs = np.asarray(lrs, float)
  scores = np.where(np.isfinite(scores), scores, np.inf)
  i = int(np.argmin(scores))
  if i == 0 or i == len(lrs) - 1 or not np.all(np.isfinite(scores[i - 1:i + 2])):
    return float(lrs[i]), False
  x, y = np.log(lrs[i - 1:i + 2]), scores[i - 1:i + 2]
  a, b, _ = np.polyfit(x, y, 2)
  if a <= 0:
    return float(lrs[i]), True
  return float(np.exp(np.clip(-b / (2 * a), x[0], x[2]))), True


def sweep(setup: Setup, widths, lrs, steps: int, tail: int,
          parametrizations=("sp", "mup"), log=print) -> list[dict]:
  data = batches(setup, steps)  # the last batch (coord_check's probe batch) goes unused
  rows = []
  for par in parametrizations:
    for width in widths:
      t0 = time.perf_counter()
      results = train(setup, width, par, lrs, data, probe=False)
      seconds = round((time.perf_counter() - t0) / len(lrs), 2)
      for lr, result in zip(lrs, results):
        losses = np.asarray(result["loss"])
        score = float(np.mean(losses[-tail:]))
        rows.append({"parametrization": par, "width": width, "lr": lr,
                     "score": score if math.isfinite(score) else float("nan"),
                     "final_loss": float(losses[-1]), "seconds": seconds})
        log(f"[lr_transfer] {par:3s} width {width:4d} lr {lr:.3g}: loss {score:.4f}")
      log(f"[lr_transfer] {par:3s} width {width:4d}: {seconds * len(lrs):.0f}s")
  return rows


def optima(rows: list[dict]) -> dict[tuple[str, int], tuple[float, bool]]:
  out = {}
  for par in dict.fromkeys(r["parametrization"] for r in rows):
    for width in sorted({r["width"] for r in rows}):
      pts = sorted((r["lr"], r["score"]) for r in rows
                   if r["parametrization"] == par and r["width"] == width)
      out[(par, width)] = best_lr([p[0] for p in pts], [p[1] for p in pts])
  return out


def plot(path: str, rows: list[dict], title: str) -> bool:
  plt = figures.pyplot()
  if plt is None:
    return False
  pars = list(dict.fromkeys(r["parametrization"] for r in rows))
  widths = sorted({r["width"] for r in rows})
  best = optima(rows)
  finite = [r["score"] for r in rows if math.isfinite(r["score"])]
  lo = min(finite)
  hi = min(max(finite), lo + 2.0)
  fig, axes = plt.subplots(1, len(pars), figsize=(5.5 * len(pars), 4.2), sharey=True)
  axes = np.atleast_1d(axes)
  colors = plt.cm.viridis(np.linspace(0, 0.9, len(widths)))
  for ax, par in zip(axes, pars):
    for color, width in zip(colors, widths):
      pts = sorted((r["lr"], r["score"]) for r in rows
                   if r["parametrization"] == par and r["width"] == width)
      ax.plot([p[0] for p in pts], [p[1] for p in pts], "o-", color=color, ms=4,
              label=f"width {width}")
      lr, inside = best[(par, width)]
      ax.axvline(lr, color=color, ls="--" if inside else ":", lw=1)
    ax.set_xscale("log", base=2)
    ax.set_ylim(lo - 0.05, hi)
    ax.set_xlabel("learning rate (AdamW)")
    ax.set_title(f"{par.upper()} (dashed: best lr per width)")
    ax.grid(alpha=0.3)
    ax.legend(fontsize=8)
  axes[0].set_ylabel("training loss (mean of the last steps)")
  figures.save(fig, path, title)
  return True


def build_parser():
  p = sweep_parser("-m tools.lr_transfer", __doc__, steps=100,
                   out=os.path.join("runs", "lr_transfer"))
  p.add_argument("--lrs", default="2^-12,2^-11,2^-10,2^-9,2^-8,2^-7,2^-6,2^-5",
                 help="comma-separated learning rates (3e-3 or 2^-8)")
  p.add_argument("--tail", type=int, default=20, help="score = mean loss of the last steps")
  return p


def parse_args(argv):
  p = build_parser()
  args = parse_sweep_args(p, argv)
  try:
    args.lrs = sorted({parse_lr(x) for x in args.lrs.split(",") if x})
  except ValueError as e:
    p.error(f"--lrs takes comma-separated numbers ({e})")
  if len(args.lrs) < 3 or not 1 <= args.tail <= args.steps:
    p.error("--lrs needs at least three rates, and 1 <= --tail <= --steps")
  return args


def main(argv: list[str]) -> int:
  started = start(parse_args, argv)
  if started is None:
    return 2
  args, setup, t0 = started
  rows = sweep(setup, args.widths, args.lrs, args.steps, args.tail)
  figures.write_csv(os.path.join(args.out, "lr_transfer.csv"), rows)
  png = os.path.join(args.out, "lr_transfer.png")
  plotted = plot(png, rows, f"lr transfer: {args.steps} AdamW steps, base width "
                 f"{args.base_width}, {args.layers} layers, batch {setup.batch_size}x"
                 f"{setup.seq_len} tokens of the embedded corpus")
  best = optima(rows)
  print("[lr_transfer] width  best lr SP  best lr muP  (loss at it SP / muP)")
  for width in args.widths:
    cells = []
    for par in ("sp", "mup"):
      lr, inside = best[(par, width)]
      cells.append(f"{lr:.3g}{'' if inside else ' (edge)'}")
    low = [min(r["score"] for r in rows if r["parametrization"] == par and r["width"] == width)
           for par in ("sp", "mup")]
    print(f"[lr_transfer] {width:5d}  {cells[0]:>10s}  {cells[1]:>11s}  "
          f"({low[0]:.4f} / {low[1]:.4f})")
  print(f"[lr_transfer] {time.perf_counter() - t0:.0f}s; wrote {args.out}/lr_transfer.csv"
        + (f", {png}" if plotted else figures.NO_PLOT))
  return 0


if __name__ == "__main__":
  sys.exit(main(sys.argv[1:]))

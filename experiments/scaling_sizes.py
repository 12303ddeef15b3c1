"""The scaling lab's model sizes and its figure. A size is a width at the config's depth (keyed by
the width alone, so earlier labs' runs, records and CSVs read as before) or, with `--depths`, a
(width, depth) pair: N moved by depth at fixed width under `--depth_parametrization` (CompleteP
by default) with the config's num_layers as base depth. A runs CSV without a depth column is at
the config's depth. Method: docs/scaling_lab.md#a-grid-over-depth
"""
from __future__ import annotations

import numpy as np

from experiments.scaling_runs import Task
from tools import figures
from tools.tradeoff import Fit
from trainer.config.cli import ints

DEPTH_PARAMETRIZATIONS = ("completep", "depth_mup", "standard")


def add_flags(p) -> None:
  p.add_argument("--depths", type=ints, default="",
                 help="num_layers of a depth grid: every (width, depth) is a size N (default: "
                      "the config's depth, sizes keyed by width)")
  p.add_argument("--depth_parametrization", default="completep", choices=DEPTH_PARAMETRIZATIONS,
                 help="with --depths: model.depth_parametrization, base_depth the config's own "
                      "(its base_depth if it sets one), so every depth starts near its rate")


def sizes(args) -> list:
  """The lab's sizes: its widths, or every (width, depth) with `--depths`."""
  depths = getattr(args, "depths", None) or []
  return [(w, d) for w in args.widths for d in depths] if depths else list(args.widths)


def split(size) -> tuple[int, int]:
  """(width, depth) of a size; depth 0 is the config's."""
  return size if isinstance(size, tuple) else (size, 0)


def of_row(row: dict):
  """The size of a runs or cells row (no depth, or none given: the config's depth)."""
  return (int(row["width"]), int(row["depth"])) if row.get("depth") else int(row["width"])


def label(size) -> str:
  """'d32', or 'd32 L4' on a depth grid."""
  w, d = split(size)
  return f"d{w}" + (f" L{d}" if d else "")


def name(size) -> str:
  """'width 32', or 'width 32 depth 4' on a depth grid."""
  w, d = split(size)
  return f"width {w}" + (f" depth {d}" if d else "")


def axes(args) -> str:
  """What a (size, batch) pair is called in the lab's lines."""
  return "(width, depth, batch)" if getattr(args, "depths", None) else "(width, batch)"


def task(size, batch: int, lr_multiplier: float, seed: int) -> Task:
  w, d = split(size)
  return Task(w, batch, lr_multiplier, seed, depth=d)


def columns(size) -> dict:
  """The key columns of a size's rows: width, and depth on a depth grid."""
  w, d = split(size)
  return dict(width=w, **({"depth": d} if d else {}))


def deepen(c, cfg, depth: int, args=None) -> None:
  """Config `c` (from base `cfg`) at `depth` layers; with the lab's `args`, under its depth
  parametrization relative to the base config's depth."""
  c.model.num_layers = depth
  if args is not None:
    c.model.depth_parametrization = args.depth_parametrization
    c.model.base_depth = cfg.model.base_depth or cfg.model.num_layers


def plot(path: str, cells: list[dict], args) -> bool:
  """Per size: steps to each budget's target against batch (seeds' mean, range bars, the
  McCandlish fit where the cell is not refused), and the eval loss after each budget."""
  plt = figures.pyplot()
  if plt is None:
    return False
  keys = list(dict.fromkeys(of_row(c) for c in cells))
  fig, axes = plt.subplots(2, len(keys), figsize=(max(9.2, 4.6 * len(keys)), 8), squeeze=False)
  for col, k in enumerate(keys):
    top, bottom = axes[0][col], axes[1][col]
    mine = [x for x in cells if of_row(x) == k]
    for i, c in enumerate(x for x in mine if x.get("steps_spread")):
      color = f"C{i}"
      spread = c["steps_spread"]
      b = sorted(spread)
      mean = [c["steps_by_batch"][x] if c["steps_by_batch"][x] is not None else np.nan for x in b]
      lo = [m - spread[x][0] for m, x in zip(mean, b)]
      hi = [spread[x][1] - m for m, x in zip(mean, b)]
      top.errorbar(b, mean, yerr=[lo, hi], fmt="o", c=color, ms=4, capsize=2,
                   mfc=color if not c.get("refused") else "white",
                   label=f"D {c['tokens']:,} tokens (target {c['target']:.3f})"
                   + (" refused" if c.get("refused") else ""))
      if c.get("s_min") is not None:
        xs = np.geomspace(b[0] / 1.3, b[-1] * 1.3)
        top.plot(xs, Fit(c["s_min"], c["e_min"]).steps(xs), "-", c=color, lw=1)
      loss = c["loss_by_batch"]
      bottom.plot(sorted(loss), [loss[x] if loss[x] is not None else np.nan for x in sorted(loss)],
                  "o-", c=color, ms=4, label=f"after {c['tokens']:,} tokens")
    for ax in (top, bottom):
      ax.set_xscale("log")
      ax.set_xticks(args.batch_sizes, [str(b) for b in args.batch_sizes])
      ax.minorticks_off()
    w, d = split(k)
    top.set(yscale="log", xlabel="batch (sequences)", ylabel="steps to target",
            title=f"d_model {w}" + (f", {d} layers" if d else "")
            + f" ({mine[0]['params']:,} parameters)")
    bottom.set(xlabel="batch (sequences)", ylabel="eval loss (best rate)",
               title="loss after D tokens (constant rate; B_opt: the lowest)")
    top.legend(fontsize=7)
    bottom.legend(fontsize=7)
  figures.save(fig, path, "Steps to the target and loss after D across batch sizes "
               "(mean over seeds, bars: min-max; lines: S_min + E_min / B; hollow: refused)")
  return True

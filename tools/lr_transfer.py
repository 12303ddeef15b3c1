"""Learning-rate transfer (Tensor Programs V, Fig. 1): training loss over a rate x width grid
under SP and muP (AdamW, or `--optim muon`), or a rate x depth grid under the depth
parametrizations (`--axis depth`); where is the best learning rate at each size?

    python -m tools.lr_transfer [--widths 32,64,128,256] [--lrs 2^-12,...,2^-5] [--base_width 32]
        [--steps 100] [--optim adamw|muon [--fallback_lr 2^-5]] [--seeds 1] [--out runs/...]
    python -m tools.lr_transfer --axis depth [--depths 2,4,8,16] [--base_depth 2] [--width 64]

Every run is the setting of tools/coord_check.py trained `--steps` steps at a constant rate
(Muon's fallback held at `--fallback_lr`, or its matrices at `--muon_lr` with --lrs the
fallback's) and scored by its mean training loss over the last `--tail` steps (the mean over
`--seeds`); a size's best rate is the grid minimum refined by a parabola in log(lr), reported
only inside the grid. `--join a.csv,b.csv` summarizes earlier runs' CSVs (one per seed).
Outputs in `--out`: `lr_transfer[_depth|_muon].csv` (a row per run), `.png` (score vs lr, a
line per size). Results: docs/mup.md#coordinate-check-and-learning-rate-transfer
"""
from __future__ import annotations

import dataclasses
import math
import os
import sys
import time

import numpy as np

from tools import figures
from tools.coord_check import parse_sweep_args, start, sweep_parser
from tools.coord_depth import DEPTH_PARAMETRIZATIONS
from tools.sweeps import Setup, batches, model_config, train


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


def sweep(setup: Setup, sizes, lrs, steps: int, tail: int, parametrizations=("sp", "mup"),
          log=print, *, axis: str = "width", width: int = 64, optim: str = "adamw",
          seeds: int = 1, first_seed: int = 0, fallback_lr: float = 0.0,
          muon_lr: float = 0.0) -> list[dict]:
  """Rows {parametrization, width, depth, seed, lr, fallback_lr, muon_lr, score, final_loss,
  seconds}: `sizes` are widths (`parametrizations` "sp" / "mup", `setup.num_layers` layers) or
  depths (`axis` "depth": "standard" / "depth_mup" / "completep" at d_model `width`); Muon's
  `fallback_lr` > 0 holds its fallback there (0: the fallback at each swept rate), `muon_lr` > 0
  its matrices (`lrs` are then the fallback's)."""
  rows = []
  for seed in range(first_seed, first_seed + seeds):
    run_setup = dataclasses.replace(setup, seed=seed)
    data = batches(run_setup, steps)  # the last batch (coord_check's probe batch) goes unused
    for par in parametrizations:
      for size in sizes:
        if axis == "width":
          mcfg = model_config(run_setup, size, par)
        else:
          mcfg = model_config(run_setup, width, "sp", layers=size, depth_parametrization=par)
        t0 = time.perf_counter()
        results = train(run_setup, mcfg, lrs, data, optim=optim, fallback_lr=fallback_lr,
                        muon_lr=muon_lr)
        seconds = round((time.perf_counter() - t0) / len(lrs), 2)
        for lr, result in zip(lrs, results):
          losses = np.asarray(result["loss"])
          score = float(np.mean(losses[-tail:]))
          rows.append({"parametrization": par, "width": mcfg.d_model, "depth": mcfg.num_layers,
                       "seed": seed, "lr": lr, "fallback_lr": fallback_lr, "muon_lr": muon_lr,
                       "score": score if math.isfinite(score) else float("nan"),
                       "final_loss": float(losses[-1]), "seconds": seconds})
          log(f"[lr_transfer] {par:9s} {axis} {size:4d} seed {seed} lr {lr:.3g}: "
              f"loss {score:.4f}")
        log(f"[lr_transfer] {par:9s} {axis} {size:4d} seed {seed}: "
            f"{seconds * len(lrs):.0f}s")
  return rows


def _curve(rows, par, axis, size, seed=None):
  """[(lr, score)] of one parametrization and size: one seed's, or the mean over seeds."""
  by_lr = {}
  for r in rows:
    if r["parametrization"] == par and r[axis] == size and seed in (None, r["seed"]):
      by_lr.setdefault(r["lr"], []).append(r["score"])
  return sorted((lr, float(np.mean(v))) for lr, v in by_lr.items())


def optima(rows: list[dict], axis: str = "width", seed: int | None = None
           ) -> dict[tuple[str, int], tuple[float, bool]]:
  """{(parametrization, size): (best lr, inside the grid?)} of the seed-mean scores (or of one
  `seed`'s)."""
  out = {}
  for par in dict.fromkeys(r["parametrization"] for r in rows):
    for size in sorted({r[axis] for r in rows}):
      pts = _curve(rows, par, axis, size, seed)
      if pts:  # (joined CSVs may differ in their sizes)
        out[(par, size)] = best_lr([p[0] for p in pts], [p[1] for p in pts])
  return out


def plot(path: str, rows: list[dict], title: str, axis: str = "width",
         optim: str = "adamw") -> bool:
  plt = figures.pyplot()
  if plt is None:
    return False
  pars = list(dict.fromkeys(r["parametrization"] for r in rows))
  sizes = sorted({r[axis] for r in rows})
  best = optima(rows, axis)
  finite = [r["score"] for r in rows if math.isfinite(r["score"])]
  lo = min(finite)
  hi = min(max(finite), lo + 2.0)
  fig, axes = plt.subplots(1, len(pars), figsize=(5.5 * len(pars), 4.2), sharey=True)
  axes = np.atleast_1d(axes)
  colors = plt.cm.viridis(np.linspace(0, 0.9, len(sizes)))
  for ax, par in zip(axes, pars):
    for color, size in zip(colors, sizes):
      pts = _curve(rows, par, axis, size)
      ax.plot([p[0] for p in pts], [p[1] for p in pts], "o-", color=color, ms=4,
              label=f"{axis} {size}")
      lr, inside = best[(par, size)]
      ax.axvline(lr, color=color, ls="--" if inside else ":", lw=1)
    ax.set_xscale("log", base=2)
    ax.set_ylim(lo - 0.05, hi)
    ax.set_xlabel("the fallback's learning rate" if ", matrices" in par else
                  f"learning rate ({optim})")
    ax.set_title(f"{par} (dashed: best lr per {axis})")
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
  p.add_argument("--seeds", type=int, default=1, help="data and init seeds F..F+S-1 (F: "
                 "--first_seed), scores averaged")
  p.add_argument("--first_seed", type=int, default=0)
  p.add_argument("--fallback_lr", type=parse_lr, default=0.0,
                 help="--optim muon: the fallback's rate (3e-3 or 2^-5) held while Muon's is "
                 "swept (optim.muon.fallback_lr; 0: the fallback at each swept rate)")
  p.add_argument("--muon_lr", type=parse_lr, default=0.0,
                 help="--optim muon: Muon's matrices held at this rate, --lrs the fallback's")
  p.add_argument("--join", default="",
                 help="comma-separated CSVs of earlier runs (one per seed) to summarize and "
                 "plot together instead of training")
  p.add_argument("--parametrizations", default="",
                 help="comma-separated subset to run (default: sp,mup; over depth all three)")
  return p


def parse_args(argv):
  p = build_parser()
  args = parse_sweep_args(p, argv)
  try:
    args.lrs = sorted({parse_lr(x) for x in args.lrs.split(",") if x})
  except ValueError as e:
    p.error(f"--lrs takes comma-separated numbers ({e})")
  every = DEPTH_PARAMETRIZATIONS if args.axis == "depth" else ("sp", "mup")
  args.parametrizations = [x for x in args.parametrizations.split(",") if x] or list(every)
  if set(args.parametrizations) - set(every):
    p.error(f"--parametrizations {args.parametrizations}: choose among {', '.join(every)}")
  if len(args.lrs) < 3 or not 1 <= args.tail <= args.steps or args.seeds < 1 or \
      args.first_seed < 0:
    p.error("--lrs needs at least three rates, 1 <= --tail <= --steps, --seeds >= 1, "
            "--first_seed >= 0")
  args.join = [x for x in args.join.split(",") if x]
  for key in ("fallback_lr", "muon_lr"):
    if getattr(args, key) < 0 or (getattr(args, key) > 0 and args.optim != "muon"):
      p.error(f"--{key} {getattr(args, key)}: must be >= 0, and is Muon's (--optim muon)")
  if args.fallback_lr and args.muon_lr:
    p.error("--fallback_lr and --muon_lr: hold one of the two, sweep the other")
  return args


def main(argv: list[str]) -> int:
  started = start(parse_args, argv)
  if started is None:
    return 2
  args, setup, t0 = started
  axis = args.axis
  pars = args.parametrizations
  if axis == "depth":
    sizes = args.depths
    where = f"width {args.width}, base depth {args.base_depth}"
  else:
    sizes = args.widths
    where = f"base width {args.base_width}, {args.layers} layers"
  missing = [x for x in args.join if not os.path.isfile(x)]
  if missing:
    print(f"error: --join {','.join(missing)}: no such file", file=sys.stderr)
    return 2
  if args.join:  # the rows of earlier runs (one process per seed), not trained again
    rows = joined(args.join)
    pars = list(dict.fromkeys(r["parametrization"] for r in rows))
    sizes = sorted(set.intersection(*({r[axis] for r in rows if r["parametrization"] == p}
                                      for p in pars)))  # the sizes every one has
    rows = [r for r in rows if r[axis] in sizes]
  else:
    rows = sweep(setup, sizes, args.lrs, args.steps, args.tail, pars, axis=axis,
                 width=args.width, optim=args.optim, seeds=args.seeds,
                 first_seed=args.first_seed, fallback_lr=args.fallback_lr,
                 muon_lr=args.muon_lr)
  seeds = sorted({r["seed"] for r in rows})
  name = "lr_transfer" + ("_depth" if axis == "depth" else "") + \
      ("" if args.optim == "adamw" else f"_{args.optim}")
  figures.write_csv(os.path.join(args.out, f"{name}.csv"), rows)
  png = os.path.join(args.out, f"{name}.png")
  held = f" (fallback at {args.fallback_lr:.3g})" if args.fallback_lr else \
      f" (matrices at {args.muon_lr:.3g}; the fallback's lr swept)" if args.muon_lr else ""
  plotted = plot(png, rows, f"lr transfer: {args.steps} {args.optim}{held} steps, {where}, "
                 f"{len(seeds)} seed(s), batch {setup.batch_size}x{setup.seq_len} tokens of "
                 "the embedded corpus", axis, args.optim)
  summarize(rows, axis)
  print(f"[lr_transfer] {time.perf_counter() - t0:.0f}s; wrote {args.out}/{name}.csv"
        + (f", {png}" if plotted else figures.NO_PLOT))
  return 0


def joined(paths: list[str]) -> list[dict]:
  """The rows of these CSVs; where they hold Muon's fallback (or matrices) at different rates,
  each parametrization is named with the held rate ("mup, fallback 0.0312"; "at lr": shared)."""
  rows = [dict(r, width=int(r["width"]), depth=int(r["depth"]), seed=int(r["seed"]),
               fallback_lr=r.get("fallback_lr") or 0.0, muon_lr=r.get("muon_lr") or 0.0)
          for path in paths for r in figures.read_csv(path)]
  if len({(r["fallback_lr"], r["muon_lr"]) for r in rows}) > 1:
    for r in rows:
      fb, mu = r["fallback_lr"], r["muon_lr"]
      r["parametrization"] += f", fallback {fb:.3g}" if fb else f", matrices {mu:.3g}" if mu \
          else ", fallback at lr"
  return rows


def summarize(rows: list[dict], axis: str = "width", log=print) -> None:
  """Each size's best rate per parametrization (the seed-mean curve's; each seed's in brackets
  with several seeds), the seed-mean loss at the best grid point, and the spreads over sizes."""
  pars = list(dict.fromkeys(r["parametrization"] for r in rows))
  sizes = sorted({r[axis] for r in rows})
  seeds = sorted({r["seed"] for r in rows})
  best = optima(rows, axis)
  per_seed = [optima(rows, axis, seed) for seed in seeds] if len(seeds) > 1 else []
  log(f"[lr_transfer] {axis:5s}  " + "  ".join(f"{'best lr ' + p:>20s}" for p in pars)
      + "  (seed-mean loss at the best grid point; per-seed best lrs in brackets)")
  for size in sizes:
    cells, low = [], []
    for par in pars:
      lr, inside = best[(par, size)]
      cells.append(f"{lr:.3g}{'' if inside else ' (edge)'}")
      low.append(min(s for _, s in _curve(rows, par, axis, size)))
    seeds_txt = " ".join("[" + ",".join(f"{o[(p, size)][0]:.3g}" for o in per_seed
                                        if (p, size) in o) + "]" for p in pars) if per_seed else ""
    log(f"[lr_transfer] {size:5d}  " + "  ".join(f"{c:>20s}" for c in cells) + "  ("
        + " / ".join(f"{x:.4f}" for x in low) + f") {seeds_txt}")
  spread = lambda o, par: (lambda v: max(v) / min(v))([o[(par, size)][0] for size in sizes])
  for par in pars:
    each = [f"{spread(o, par):.2f}x" for o in per_seed if all((par, z) in o for z in sizes)]
    each = f" (per seed {', '.join(each)})" if each else ""
    log(f"[lr_transfer] {par}: best lr spread over {axis}s {spread(best, par):.2f}x{each}")


if __name__ == "__main__":
  sys.exit(main(sys.argv[1:]))

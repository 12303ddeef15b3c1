"""DiLoCo vs data parallelism at equal tokens across global batch sizes: where is each one's
optimal batch? (Charles et al. 2025 report that DiLoCo's is larger.)

    python -m experiments.diloco [--batch_sizes 8,16,32,64,128] [--replicas 1,2,4] \\
        [--inner_steps 1,8,32] [--examples 8192] [--out docs/diloco]
    python -m experiments.diloco --lr_grid 0.5,1,2 --outer_lr_grid 0.35,0.7,1.0 --seeds 3 \\
        [--reuse]  # each arm tuned at each batch: rates bracketed on the seeds' mean loss

Every run trains `--examples` sequences of configs/sweep_tiny.py at a fixed global batch B (data
parallelism; DiLoCo with each M in `--replicas`, H in `--inner_steps`) on `--devices` CPU host
devices; an arm's optimal batch is the minimum of its final loss against log2(B). OUT.csv a row
per arm and batch, OUT.png loss vs batch and each arm's gap to data parallelism (52 min on 2
busy cores). Tuned: OUT.csv every run, OUT_tuned.csv each (arm, batch)'s best cell,
OUT_paired.csv tuned arms against tuned data parallelism. Results: docs/diloco.md
"""
from __future__ import annotations

import math
import os
import sys

from experiments import common
from tools import figures, tradeoff
from trainer.config import ConfigError


def build_parser():
  p = common.parser("diloco", __doc__)
  p.add_argument("--batch_sizes", type=common.ints, default="8,16,32,64,128")
  p.add_argument("--replicas", type=common.ints, default="1,2,4", help="DiLoCo's M values")
  p.add_argument("--inner_steps", type=common.ints, default="1,8,32", help="DiLoCo's H values")
  p.add_argument("--examples", type=int, default=8192, help="training sequences per run")
  common.add_budget_args(p, evals=4, eval_sequences=128,
                         evals_help="evaluations per run (at least)")
  p.add_argument("--devices", type=int, default=4,
                 help="CPU host devices to run on (DiLoCo's M must divide them)")
  p.add_argument("--lr_grid", type=common.floats, default="1",
                 help="multipliers of the inner (data parallelism's) rate, every arm; a "
                      "winning edge grows the grid (--max_extensions)")
  p.add_argument("--outer_lr_grid", type=common.floats, default="",
                 help="DiLoCo's outer rates, every DiLoCo arm (default: the config's)")
  p.add_argument("--max_extensions", type=int, default=3,
                 help="rounds that grow an arm's inner rates beyond a winning edge")
  return p


def parse(argv):
  p = build_parser()
  args, overrides = p.parse(argv)
  if min(args.lr_grid, default=0) <= 0 or min(args.outer_lr_grid, default=1) <= 0:
    p.error("--lr_grid and --outer_lr_grid take positive values, e.g. 0.5,1,2 and 0.35,0.7,1")
  args.tuned = args.lr_grid != [1.0] or len(args.outer_lr_grid) > 1
  return args, overrides


def arms(args) -> list[tuple[str, int, int]]:
  """(name, M, H) of every arm; M = 0 is plain data parallelism."""
  return [("data parallel", 0, 1)] + [(f"DiLoCo M={m} H={h}", m, h)
                                      for m in args.replicas for h in args.inner_steps]


def arm_config(base, args, batch: int, replicas: int, inner_steps: int):
  cfg = common.at_budget(base, batch, args.examples, micro=args.micro_batch_size,
                         evals=args.evals, eval_sequences=args.eval_sequences)
  if cfg.steps % inner_steps:
    raise ValueError(f"{args.examples} examples at batch {batch} are {cfg.steps} steps, not a "
                     f"multiple of H={inner_steps}")
  if replicas:  # evaluations fall on outer steps
    cfg.eval_every = max(cfg.eval_every, inner_steps)
    while cfg.steps % cfg.eval_every or cfg.eval_every % inner_steps:
      cfg.eval_every += 1
  cfg.optim.update(schedule="cosine", schedule_unit="examples", warmup_steps=0, decay_steps=0,
                   warmup_examples=args.examples // 16, decay_examples=args.examples,
                   min_lr_ratio=0.1)
  cfg.optim.diloco.update(replicas=replicas, inner_steps=inner_steps)
  cfg.mesh.update(data=-1, fsdp=1, tensor=1, sequence=1, expert=1)
  return cfg


def tune(args, cfg) -> list[dict]:
  """Every arm tuned alike at every batch: (inner rate multiplier x outer rate x seed) runs, the
  inner rates bracketed on the seeds' mean final loss (`tools.tradeoff.bracket`), then both
  rates around the best cell (`best_cell`); each (arm, batch)'s best cell against data
  parallelism's, seed by seed (not called where either is censored in either rate)."""
  from optim import derive  # noqa: PLC0415  start-up
  from optim.scaling import stated  # noqa: PLC0415  start-up
  seeds = [cfg.seed + k for k in range(args.seeds)]
  runs, tuned = [], []
  for name, m, h in arms(args):
    outers = (args.outer_lr_grid or [cfg.optim.diloco.outer_lr]) if m else [None]
    for batch in args.batch_sizes:
      cells = {}

      def cell(mult, outer, name=name, m=m, h=h, batch=batch, cells=cells):
        """The seeds' mean final loss of (inner multiplier, outer rate), trained once."""
        if (mult, outer) in cells:
          return cells[mult, outer]
        losses = []
        for seed in seeds:
          c = arm_config(cfg, args, batch, m, h)
          c.seed = seed
          c.optim.learning_rate = stated(c.optim)["learning_rate"][0] * mult
          if outer is not None:
            c.optim.diloco.outer_lr = outer
          slug = f"b{batch}_m{m}_h{h}_lr{mult:g}" + (f"_o{outer:g}" if m else "") + f"_s{seed}"
          t = common.train(c, os.path.join(args.workdir, slug))
          runs.append({"arm": name, "replicas": m, "inner_steps": h if m else 0,
                       "batch_size": batch, "seed": seed, "lr_multiplier": mult,
                       "outer_lr": outer,
                       "learning_rate": derive(c.optim, batch).learning_rate,
                       "final_eval_loss": t.final_eval, "seconds": t.seconds})
          losses.append(t.final_eval if t.final_eval is not None else math.nan)
        cells[mult, outer] = common.seed_mean(losses)
        print(f"[diloco] {name:18s} batch {batch:4d} lr x{mult:g}"
              + (f" outer {outer:g}" if m else "") + f": mean final eval {cells[mult, outer]:.4f}",
              flush=True)
        return cells[mult, outer]

      def score(mult, outers=outers, cell=cell):
        done = [v for o in outers if math.isfinite(v := cell(mult, o))]
        return min(done) if done else None

      tradeoff.bracket(score, args.lr_grid, max_extensions=args.max_extensions)
      tuned.append(best_cell(name, m, h, batch, cells, cell, args, len(seeds),
                             grow_outer=len(outers) > 2))
  mark_optimal_batches(args, tuned)
  common.write(args, runs)
  figures.write_csv(args.out + "_tuned.csv", tuned)
  print(common.table(tuned, TUNED, "diloco"))
  diffs = common.paired_tuned(tuned, runs, "arm", "data parallel",
                              choice=("lr_multiplier", "outer_lr"))
  figures.write_csv(args.out + "_paired.csv", diffs)
  print(f"[diloco] tuned arms against tuned data parallelism, seed by seed (seeds {seeds}):")
  for d in diffs:
    print(f"[diloco]   {d['text']}")
  plotted = plot(args.out + ".png", tuned, args)
  print(f"[diloco] wrote {args.out}.csv, {args.out}_tuned.csv, {args.out}_paired.csv"
        + (f", {args.out}.png" if plotted else figures.NO_PLOT))
  return runs


def best_cell(name: str, m: int, h: int, batch: int, cells: dict, cell, args, seeds: int,
              grow_outer: bool) -> dict:
  """The (inner multiplier, outer rate) with the lowest mean loss, both rates bracketed: while
  the best cell's outer rate is at an edge of the outer rates run at its inner multiplier, or
  its multiplier at an edge of those run at its outer rate, the next rate beyond that edge is
  trained (`tools.tradeoff.next_multipliers`, factor 2; at most `--max_extensions` rounds). The
  outer rate grows only where `--outer_lr_grid` gives three or more (a grid to bracket); a rate
  still at an edge after the rounds is censored (`interior` False: no comparison calls it)."""
  def best():
    finite = {k: v for k, v in cells.items() if math.isfinite(v)}
    mult, outer = min(finite, key=finite.get) if finite else min(cells)
    return (mult, outer, {x: cells[x, outer] for x, o in cells if o == outer},
            {o: cells[mult, o] for x, o in cells if x == mult})
  for _ in range(args.max_extensions):
    mult, outer, inner, outers = best()
    new = [(x, outer) for x in tradeoff.next_multipliers(inner) if (x, outer) not in cells]
    if grow_outer:
      new += [(mult, o) for o in tradeoff.next_multipliers(outers) if (mult, o) not in cells]
    if not new:
      break
    for x, o in new:
      cell(x, o)
  mult, outer, inner, outers = best()
  outer_inside = tradeoff.interior(outers) if grow_outer else None
  return {"arm": name, "replicas": m, "inner_steps": h if m else 0, "batch_size": batch,
          "lr_multiplier": mult, "outer_lr": outer, "final_eval_loss": cells[mult, outer],
          "seeds": seeds, "interior": bool(tradeoff.interior(inner)) and outer_inside is not False,
          "lr_interior": bool(tradeoff.interior(inner)),
          "multipliers": "/".join(f"{x:g}" for x in sorted(inner)),
          "outer_interior": outer_inside,
          "outer_rates": "/".join(f"{o:g}" for o in sorted(outers)) if m else ""}


TUNED = [("arm", "arm", "s"), ("batch_size", "batch", "d"), ("lr_multiplier", "lr x", "g"),
         ("outer_lr", "outer lr", ""), ("final_eval_loss", "mean final eval", ".4f"),
         ("multipliers", "rates run (x)", "s"), ("lr_interior", "rate inside", ""),
         ("outer_rates", "outer rates run", "s"), ("outer_interior", "outer inside", ""),
         ("optimal_batch", "optimal batch", ".1f")]


def mark_optimal_batches(args, rows: list[dict]) -> None:
  """Each arm's optimal batch (`best_batch` of its rows' final losses) on every row of it."""
  for name, _, _ in arms(args):
    arm = [r for r in rows if r["arm"] == name]
    opt, inside = best_batch([(r["batch_size"], r["final_eval_loss"]) for r in arm])
    for r in arm:
      r.update(optimal_batch=opt, optimum_inside_grid=inside)


def best_batch(points: list[tuple[int, float]]) -> tuple[float, bool]:
  """(optimal batch, inside the grid?) of [(batch, loss)]: the vertex of the parabola in
  log2(batch) through the best point and its neighbours, or the best point at an edge."""
  points = sorted((b, y) for b, y in points if math.isfinite(y))
  i = min(range(len(points)), key=lambda j: points[j][1])
  if i == 0 or i == len(points) - 1:
    return float(points[i][0]), False
  (x0, y0), (x1, y1), (x2, y2) = [(math.log2(b), y) for b, y in points[i - 1:i + 2]]
  denom = (x0 - x1) * (x0 - x2) * (x1 - x2)
  a = (x2 * (y1 - y0) + x1 * (y0 - y2) + x0 * (y2 - y1)) / denom
  b = (x2 * x2 * (y0 - y1) + x1 * x1 * (y2 - y0) + x0 * x0 * (y1 - y2)) / denom
  vertex = -b / (2 * a) if a > 0 else x1
  return 2 ** min(max(vertex, x0), x2), True


def experiment(args, cfg) -> list[dict]:
  from optim import derive  # noqa: PLC0415  start-up
  rows = []
  for name, m, h in arms(args):
    for batch in args.batch_sizes:
      c = arm_config(cfg, args, batch, m, h)
      slug = f"b{batch}_m{m}_h{h}"
      t = common.train(c, os.path.join(args.workdir, slug))
      outer = [r for r in t.rows if "outer_grad_norm" in r]
      rows.append({"arm": name, "replicas": m, "inner_steps": h if m else 0,
                   "batch_size": batch, "rows_per_replica": batch // max(m, 1),
                   "learning_rate": derive(c.optim, batch).learning_rate, "steps": t.steps_run,
                   "outer_steps": t.steps_run // h if m else 0,
                   "final_eval_loss": t.final_eval, "last_outer_grad_norm":
                   outer[-1]["outer_grad_norm"] if outer else None, "seconds": t.seconds})
      print(f"[diloco] {name:18s} batch {batch:4d}: final eval {t.final_eval:.4f}; "
            f"{t.seconds:.0f}s", flush=True)
  mark_optimal_batches(args, rows)
  common.write(args, rows)
  summary = [r for r in rows if r["batch_size"] == args.batch_sizes[0]]
  print(common.table(summary, SUMMARY, "diloco"))
  plotted = plot(args.out + ".png", rows, args)
  print(f"[diloco] wrote {args.out}.csv" + (f", {args.out}.png" if plotted else figures.NO_PLOT))
  return rows


SUMMARY = [("arm", "arm", "s"), ("optimal_batch", "optimal batch", ".1f"),
           ("optimum_inside_grid", "inside grid", "")]


def plot(path: str, rows: list[dict], args) -> bool:
  """Final loss vs batch per arm (colour: M, line style: H; data parallelism black, each arm's
  optimal batch circled); each DiLoCo arm's loss minus data parallelism's at the same batch (a
  gap that shrinks with the batch is an optimum that moves to larger batches)."""
  plt = figures.pyplot()
  if plt is None:
    return False
  fig, (ax1, ax2) = plt.subplots(1, 2, figsize=(12, 4.6))
  styles = dict(zip(args.inner_steps, ("-", "--", ":", "-.")))
  colour = lambda m: "k" if not m else f"C{args.replicas.index(m)}"
  dp = {r["batch_size"]: r["final_eval_loss"] for r in rows if not r["replicas"]}
  for name, m, h in arms(args):
    arm = sorted((r for r in rows if r["arm"] == name), key=lambda r: r["batch_size"])
    batches, losses = [r["batch_size"] for r in arm], [r["final_eval_loss"] for r in arm]
    style = dict(c=colour(m), lw=2.5 if not m else 1.3, ms=4, label=name)
    ax1.plot(batches, losses, "o" + (styles[h] if m else "-"), **style)
    best = min(arm, key=lambda r: r["final_eval_loss"])
    ax1.plot([best["batch_size"]], [best["final_eval_loss"]], "o", ms=10, mfc="none",
             c=colour(m))
    if m:
      ax2.plot(batches, [y - dp[b] for b, y in zip(batches, losses)], "o" + styles[h], **style)
  edge = sum(not r["optimum_inside_grid"] for r in rows if r["batch_size"] ==
             args.batch_sizes[0])
  ax1.set(xscale="log", xlabel="global batch (sequences)", ylabel="final eval loss",
          title=f"{args.examples:,} sequences per run (equal tokens); circles: each arm's best"
          + (f"\n({edge} of {len(arms(args))} arms best at a grid edge)" if edge else ""))
  ax2.axhline(0, c="k", lw=1)
  ax2.set(xscale="log", xlabel="global batch (sequences)",
          ylabel="DiLoCo loss - data parallel loss", title="the gap to data parallelism")
  for ax in (ax1, ax2):
    ax.set_xticks(args.batch_sizes, [str(b) for b in args.batch_sizes])
  ax1.legend(fontsize=7, ncol=2)
  figures.save(fig, path, "DiLoCo vs data parallelism across global batch sizes, sweep_tiny model")
  return True


def main(argv: list[str]) -> int:
  def run(args, cfg):
    return (tune if args.tuned else experiment)(args, cfg)
  return common.main("diloco", parse, run, argv, keys=("arm", "batch_size"),
                     metrics=("final_eval_loss", "optimal_batch"),
                     compare=("arm", "data parallel"), seeds_inside=lambda args: args.tuned)


def host_devices(argv: list[str]) -> None:
  """`--devices` host devices for this process (the command's own, set before jax starts its
  backend; in-process callers such as the tests keep the devices they have). A mistake on the
  command line is left to `main`, which reports it in one line."""
  try:
    devices = build_parser().parse_known_args(argv)[0].devices
  except ConfigError:
    return
  os.environ["XLA_FLAGS"] = (os.environ.get("XLA_FLAGS", "") +
                             f" --xla_force_host_platform_device_count={devices}").strip()


if __name__ == "__main__":
  host_devices(sys.argv[1:])
  sys.exit(main(sys.argv[1:]))

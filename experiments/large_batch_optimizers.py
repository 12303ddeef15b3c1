"""LAMB, LARS and Muon vs AdamW at a large batch and the reference batch, the same token budget,
each optimizer tuned alike around the rate its batch-size rule derives (optim/scaling.py).

    python -m experiments.large_batch_optimizers [--batch 256] [--reference_batch 16] \\
        [--examples 32768] [--lr_grid 0.5,1,2] [--b2_grid rule,0.95,0.99] [--seeds 3] \\
        [--large_only] [--reuse]
    python -m experiments.large_batch_optimizers --lr_grid 1 --b2_grid rule  # the rules alone:
        # 8 trainings, 21 min on 2 busy cores (docs/muon.md), the untuned comparison of before

Per optimizer and batch: every rate multiplier x b2 (Adam-family; 'rule': the half-life rule's)
x seed, scored by the final eval loss's mean over seeds; an edge winner grows the rates
(`tools.tradeoff.bracket`). OUT.csv every run, OUT_tuned.csv each arm's best (`interior`),
OUT_paired.csv each tuned arm against AdamW's on paired seeds (not called where an optimum is
censored), OUT.png the tuned arms' curves.
Claims, setup and results: docs/experiments.md#lamb--lars--muon-vs-adamw-at-large-batch
"""
from __future__ import annotations

import math
import os
import sys

from experiments import common
from tools import figures, stats, tradeoff

# (optimizer, the keys it states at the reference batch, its lr rule)
OPTIMIZERS = (
    ("adamw", dict(learning_rate=3e-3, b2=0.99, weight_decay=0.1), "sqrt"),
    ("lamb", dict(learning_rate=0.0, b2=0.0, weight_decay=-1.0), "sqrt"),
    ("lars", dict(learning_rate=0.0, weight_decay=-1.0, trust_coefficient=0.0), "linear"),
    ("muon", dict(learning_rate=3e-3, b2=0.99, weight_decay=0.1), "sqrt"),
)
B2_OPTIMIZERS = ("adamw", "lamb", "muon")  # Adam's b2 (Muon's: its AdamW fallback's)


def build_parser():
  p = common.parser("large_batch_optimizers", __doc__)
  p.add_argument("--batch", type=int, default=256, help="the large batch")
  p.add_argument("--reference_batch", type=int, default=16,
                 help="where the hyperparameters are stated (and the small-batch runs; 0: skip "
                      "them)")
  p.add_argument("--large_only", action="store_true",
                 help="train at --batch only; --reference_batch still states the hyperparameters")
  p.add_argument("--examples", type=int, default=32768, help="training sequences per run")
  p.add_argument("--optimizers", default="adamw,lamb,lars,muon")
  p.add_argument("--lr_grid", type=common.floats, default="0.5,1,2",
                 help="multipliers of each optimizer's rule-derived rate (1 with --b2_grid rule: "
                      "the rules alone, untuned)")
  p.add_argument("--b2_grid", default="rule,0.95,0.99",
                 help="b2 values of adamw, lamb and muon's fallback ('rule': the half-life "
                      "rule's at the batch)")
  p.add_argument("--max_extensions", type=int, default=3,
                 help="rounds that grow an arm's rates beyond a winning edge")
  p.add_argument("--bracket_factor", type=float, default=2.0, help="each extension's step")
  common.add_budget_args(p, evals=16, eval_sequences=128)
  return p


def parse(argv):
  p = build_parser()
  args, overrides = p.parse(argv)
  known = [name for name, _, _ in OPTIMIZERS]
  args.optimizers = [o for o in args.optimizers.split(",") if o]
  bad = [o for o in args.optimizers if o not in known]
  if bad:
    p.error(f"--optimizers: unknown {bad[0]!r}; choose from {', '.join(known)}")
  try:
    args.b2_grid = [x if x == "rule" else float(x) for x in args.b2_grid.split(",") if x]
  except ValueError:
    p.error(f"--b2_grid {args.b2_grid!r}: give 'rule' or numbers in (0, 1), e.g. rule,0.95,0.99")
  if not args.b2_grid or any(x != "rule" and not 0 < x < 1 for x in args.b2_grid):
    p.error(f"--b2_grid {args.b2_grid}: give 'rule' or numbers in (0, 1), e.g. rule,0.95,0.99")
  if not args.lr_grid or min(args.lr_grid) <= 0:
    p.error(f"--lr_grid {args.lr_grid}: give positive multipliers, e.g. 0.5,1,2")
  if args.max_extensions < 0 or args.bracket_factor <= 1 or args.seeds < 1:
    p.error("--max_extensions must be at least 0, --bracket_factor above 1, --seeds at least 1")
  args.tuned = (args.lr_grid, args.b2_grid) != ([1.0], ["rule"])
  return args, overrides


def optimizer_config(base, args, name: str, batch: int, mult: float = 1.0, b2="rule"):
  """The run of optimizer `name` at `batch`: its stated values moved by its rules, the rate x
  `mult`, b2 the rule's or the fixed value `b2`."""
  from optim.scaling import stated  # noqa: PLC0415  start-up
  keys, rule = {n: (s, r) for n, s, r in OPTIMIZERS}[name]
  ref = args.reference_batch or args.batch
  cfg = common.at_budget(base, batch, args.examples, micro=args.micro_batch_size,
                         evals=args.evals, eval_sequences=args.eval_sequences)
  fixed = b2 != "rule" and name in B2_OPTIMIZERS
  cfg.optim.update(name=name, **keys, reference_batch_size=ref, lr_rule=rule,
                   b2_rule="half_life" if name in B2_OPTIMIZERS and not fixed else "constant",
                   weight_decay_rule="constant", ema_decay=0.0, schedule="cosine",
                   schedule_unit="examples", warmup_steps=0, warmup_tokens=0, decay_steps=0,
                   decay_tokens=0, warmup_examples=args.examples // 8,
                   decay_examples=args.examples)
  if mult != 1.0:
    cfg.optim.learning_rate = stated(cfg.optim)["learning_rate"][0] * mult
  if fixed:
    cfg.optim.b2 = float(b2)
  return cfg


def train_run(cfg, workdir: str):
  """Train `cfg`: its eval curve [(sequences, loss)], steps run and seconds (tests replace it)."""
  t = common.train(cfg, workdir)
  return common.eval_curve(t.rows, t.ramp), t.steps_run, t.seconds


def measure(cfg, args, name: str, batch: int, mult: float, b2, workdir: str):
  """One training: its CSV row and eval curve."""
  from optim import derive  # noqa: PLC0415  start-up
  c = optimizer_config(cfg, args, name, batch, mult, b2)
  hp = derive(c.optim, batch)
  curve, steps, seconds = train_run(c, workdir)
  final = curve[-1][1] if curve else math.nan
  row = {"optimizer": name, "batch_size": batch, "lr_rule": c.optim.lr_rule,
         "lr_multiplier": mult, "b2_choice": b2 if name in B2_OPTIMIZERS else None,
         "learning_rate": hp.learning_rate, "b2": hp.b2 if name != "lars" else None,
         "weight_decay": hp.weight_decay, "trust_coefficient": hp.trust_coefficient,
         "steps": steps, "examples": steps * batch, "final_eval_loss": final, "seconds": seconds}
  print(f"[optimizers] {name} at batch {batch}: lr {hp.learning_rate:.4g} (x{mult:g} of "
        f"{c.optim.lr_rule} from {c.optim.reference_batch_size}), b2 {row['b2'] or '-'} ({b2}), "
        f"final eval {final:.4f}; {seconds:.0f}s", flush=True)
  return row, curve


def batches(args) -> list[int]:
  return [args.batch] + ([args.reference_batch] if args.reference_batch and not args.large_only
                         and args.reference_batch != args.batch else [])


def experiment(args, cfg) -> list[dict]:
  """The rules alone (`--lr_grid 1 --b2_grid rule`): one run per optimizer and batch."""
  rows, curves = [], {}
  for batch in batches(args):
    for name in args.optimizers:
      row, curves[(name, batch)] = measure(cfg, args, name, batch, 1.0, "rule",
                                           os.path.join(args.workdir, f"{name}_b{batch}"))
      rows.append(row)
  common.write(args, rows)
  print(common.table(rows, COLUMNS, "optimizers"))
  report_plot(args, rows, curves, "rule-derived learning rates")
  return rows


def tune(args, cfg) -> list[dict]:
  """Every optimizer tuned alike at each batch: (rate multiplier x b2 x seed) runs, the rates
  bracketed on the mean final eval loss; the tuned arms compared with AdamW's seed by seed."""
  seeds = [cfg.seed + k for k in range(args.seeds)]
  runs, curves, tuned = [], {}, []
  for batch in batches(args):
    for name in args.optimizers:
      b2s = args.b2_grid if name in B2_OPTIMIZERS else ["rule"]
      cells = {}

      def score(mult, name=name, batch=batch, b2s=b2s, cells=cells):
        for b2 in b2s:
          losses = []
          for seed in seeds:
            seeded = cfg.copy_and_resolve_references()
            seeded.seed = seed
            where = os.path.join(args.workdir, f"{name}_b{batch}_lr{mult:g}_b2{b2}_s{seed}")
            row, curves[(name, batch, mult, b2, seed)] = measure(seeded, args, name, batch,
                                                                 mult, b2, where)
            runs.append({"seed": seed, **row})
            losses.append(row["final_eval_loss"])
          cells[mult, b2] = common.seed_mean(losses)
        done = [cells[mult, b2] for b2 in b2s if math.isfinite(cells[mult, b2])]
        return min(done) if done else None

      scores = tradeoff.bracket(score, args.lr_grid, factor=args.bracket_factor,
                                max_extensions=args.max_extensions)
      tuned.append(best_arm(name, batch, cells, scores, runs))
  write_tuned(args, runs, tuned, TUNED_COLUMNS, "optimizers")
  diffs = compare(tuned, runs) + penalty(tuned, runs, batches(args))
  figures.write_csv(args.out + "_paired.csv", diffs)
  print(f"[optimizers] tuned arms against tuned adamw, seed by seed (seeds {seeds}; 95% t):")
  for d in diffs:
    print(f"[optimizers]   {d['text']}")
  arms = [t for t in tuned if math.isfinite(t["final_eval_loss"])]
  report_plot(args, arms, {(t["optimizer"], t["batch_size"]): curves[
      t["optimizer"], t["batch_size"], t["lr_multiplier"], t["b2_choice"] or "rule", seeds[0]]
      for t in arms}, f"each tuned (seed {seeds[0]})")
  return runs


def write_tuned(args, runs: list[dict], tuned: list[dict], columns, prefix: str) -> None:
  """OUT.csv (every run), OUT_tuned.csv (each arm's best) and its table; a line per arm whose
  best rate is at the edge of the rates run (censored: no comparison calls it)."""
  common.write(args, runs)
  figures.write_csv(args.out + "_tuned.csv", tuned)
  print(common.table(tuned, columns, prefix))
  for t in tuned:
    if not t["interior"]:
      print(f"[{prefix}] {t['optimizer']} at batch {t['batch_size']}: censored, its best rate "
            f"x{t['lr_multiplier']:g} is at the edge of x{t['multipliers']} after "
            f"{args.max_extensions} extensions", flush=True)


def best_arm(name: str, batch: int, cells: dict, scores: dict, runs: list[dict],
             metric: str = "final_eval_loss") -> dict:
  """The (multiplier, b2) with the lowest mean `metric` (lower better), and whether its rate
  lies inside the rates run (`interior`; False where every run diverged); `b2_interior` the same
  of its b2 among 3 or more distinct values run at that rate (reported, not grown)."""
  finite = {k: v for k, v in cells.items() if math.isfinite(v)}
  mult, b2 = min(finite, key=finite.get) if finite else next(k for k in cells
                                                               if k[0] == min(scores))
  mine = [r for r in runs if (r["optimizer"], r["batch_size"], r["lr_multiplier"]) ==
          (name, batch, mult) and (r["b2_choice"] or "rule") == b2]
  seeds = [r[metric] for r in mine]
  spread = stats.spread(seeds) or {"std": math.nan}
  b2_values = {r["b2"]: cells[mult, r["b2_choice"]] for r in runs if r["b2"] is not None and
               (r["optimizer"], r["batch_size"], r["lr_multiplier"]) == (name, batch, mult)}
  return {"optimizer": name, "batch_size": batch, "lr_multiplier": mult,
          "b2_choice": b2 if name in B2_OPTIMIZERS else None,
          "learning_rate": mine[0]["learning_rate"], "b2": mine[0]["b2"],
          metric: finite.get((mult, b2), math.nan), f"{metric}_std": spread["std"], "seeds": len(seeds),
          "interior": bool(tradeoff.interior(scores)),
          "multipliers": "/".join(f"{m:g}" for m in sorted(scores)),
          "b2_interior": tradeoff.interior(b2_values) if len(b2_values) > 2 else None}


def compare(tuned: list[dict], runs: list[dict], baseline: str = "adamw",
            metric: str = "final_eval_loss") -> list[dict]:
  """Each tuned arm against the baseline's tuned arm at its batch, seed by seed
  (`common.paired_tuned`; not called where either optimum is censored)."""
  return common.paired_tuned(tuned, runs, "optimizer", baseline,
                             choice=("lr_multiplier", "b2_choice"), metric=metric)


def penalty(tuned: list[dict], runs: list[dict], batch_sizes: list[int], baseline: str = "adamw",
            metric: str = "final_eval_loss") -> list[dict]:
  """What the large batch costs each tuned arm (its best cell's loss at the first batch minus
  at the second, seed by seed) against what it costs the baseline, paired over the seeds: the
  question the large-batch optimizers were made for. [] with one batch; not called where any of
  the four optima is censored."""
  if len(batch_sizes) < 2:
    return []
  large, small = batch_sizes[:2]
  best = {(t["optimizer"], t["batch_size"]): t for t in tuned}
  loss = {(r["optimizer"], r["batch_size"], r["seed"]): r[metric] for r in common.best_cells(
      tuned, runs, "optimizer", choice=("lr_multiplier", "b2_choice"))}
  rows = [{"seed": seed, "optimizer": name, f"{metric}_penalty":
           loss[name, large, seed] - loss[name, small, seed]}
          for (name, batch, seed) in loss if batch == large and (name, small, seed) in loss]
  diffs = common.paired(rows, ("optimizer",), (f"{metric}_penalty",), "optimizer", baseline)
  for d in diffs:
    censored = [f"{n} at {b}" for n in (d["arm"], baseline) for b in (large, small)
                if not best[n, b]["interior"]]
    d.update(batch_size=f"{large} - {small}", called=not censored)
    if censored:
      d["text"] += f" (not called: the best rate of {', '.join(censored)} is at an edge)"
  return diffs


def report_plot(args, rows: list[dict], curves: dict, how: str) -> None:
  plotted = plot(args.out + ".png", rows, curves, batches(args), args, how)
  print(f"[optimizers] wrote {args.out}.csv" + (f", {args.out}.png" if plotted
                                                else figures.NO_PLOT))


COLUMNS = [("optimizer", "optimizer", "s"), ("batch_size", "batch", "d"),
           ("lr_rule", "rule", "s"), ("learning_rate", "lr", ".4g"), ("b2", "b2", ".4g"),
           ("steps", "steps", "d"), ("final_eval_loss", "final eval loss", ".4f"),
           ("seconds", "seconds", ".0f")]

TUNED_COLUMNS = [("optimizer", "optimizer", "s"), ("batch_size", "batch", "d"),
                 ("lr_multiplier", "lr x rule", "g"), ("learning_rate", "lr", ".4g"),
                 ("b2_choice", "b2 from", ""), ("b2", "b2", ".4g"),
                 ("final_eval_loss", "mean final eval", ".4f"),
                 ("final_eval_loss_std", "std", ".2g"), ("seeds", "seeds", "d"),
                 ("multipliers", "rates run (x)", "s"), ("interior", "rate inside", ""),
                 ("b2_interior", "b2 inside", "")]


def plot(path: str, rows: list[dict], curves: dict, batches: list[int], args,
         how: str) -> bool:
  plt = figures.pyplot()
  if plt is None:
    return False
  fig, axes = plt.subplots(1, len(batches), figsize=(max(7.5, 5.5 * len(batches)), 4.3),
                           sharey=True, squeeze=False)  # one panel: wide enough for the title
  finite = [y for c in curves.values() for _, y in c if math.isfinite(y)]
  if not finite:
    return False
  for ax, batch in zip(axes[0], batches):
    for i, name in enumerate(args.optimizers):
      curve = curves.get((name, batch))
      r = next((r for r in rows if r["optimizer"] == name and r["batch_size"] == batch), None)
      if curve and r:
        ax.plot(*zip(*curve), "o-", ms=3, c=f"C{i}",
                label=f"{name}, lr {r['learning_rate']:.3g}: {r['final_eval_loss']:.3f}")
    ax.set(xlabel="sequences seen", title=f"batch {batch} ({args.examples // batch} steps)",
           ylim=(min(finite) - 0.05, min(finite) + 1.5))
    ax.legend(fontsize=8)
  axes[0][0].set_ylabel("eval loss")
  figures.save(fig, path, f"LAMB / LARS / Muon vs AdamW at the same {args.examples:,} sequences, "
               f"{how} (sweep_tiny model)")
  return True


def main(argv: list[str]) -> int:
  def run(args, cfg):
    return (tune if args.tuned else experiment)(args, cfg)
  return common.main("optimizers", parse, run, argv, keys=("optimizer", "batch_size"),
                     metrics=("final_eval_loss",), compare=("optimizer", "adamw"),
                     seeds_inside=lambda args: args.tuned)


if __name__ == "__main__":
  sys.exit(main(sys.argv[1:]))

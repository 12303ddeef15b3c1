"""LARS and LAMB where they were made (issue 51): a ResNet on mnist1d (LARS vs Nesterov vs AdamW)
and a masked-LM encoder (LAMB vs AdamW), each at its bracketed rate per batch, 3 seeds.

    python -m experiments.original_domains --task vision [--batches 32,...,4096] \\
        [--train_examples 131072] [--epochs 4] [--lr_grid 0.5,1,2] [--seeds 3]
    python -m experiments.original_domains --task mlm [--batches 16,64,256,1024] [--tokens N]
    python -m experiments.original_domains --task vision --quick   # tiny sizes, minutes

Recipes: experiments/domain_recipes.py. Per (optimizer, batch): the rate multipliers (x b2 for
AdamW) x seeds, scored by the mean final test error (1 - accuracy), an edge winner grows the
rates (`tools.tradeoff.bracket`), still at an edge: censored, reported and not called.
OUT.csv every run, OUT_tuned.csv each arm's best, OUT_paired.csv each tuned arm against the
baseline's (vision: sgd, mlm: adamw) on paired seeds (tools.stats), OUT.png accuracy vs batch
(OUT: docs/original_domains_<task>[_quick]); the verdicts of the issue's four claims.
Results: docs/original_domains.md
"""
from __future__ import annotations

import math
import os
import sys

from experiments import common
from experiments import domain_recipes as recipes
from experiments import large_batch_optimizers as lbo
from tools import figures, stats, tradeoff
from trainer.config import ConfigError

FULL = dict(lr_grid=[0.5, 1.0, 2.0], b2_grid=[0.95, 0.99, 0.999], seeds=3, max_extensions=3)
QUICK_GRID = dict(lr_grid=[0.25, 1.0, 4.0], b2_grid=[0.95, 0.999], seeds=2, max_extensions=0)
QUICK = {  # --quick: tiny sizes for the tests and a first look (not the experiment)
    "vision": dict(batches=(32, 128), train_examples=2048, epochs=2, eval_sequences=512,
                   config={"model.resnet.channels": 8, "model.resnet.blocks": 1}),
    "mlm": dict(batches=(16, 64), tokens=512 * 32, eval_sequences=32,
                config={"model.d_model": 32, "model.num_layers": 1, "model.num_heads": 2,
                        "model.num_kv_heads": 1, "model.mlp_dim": 64, "data.seq_len": 32}),
}
CLAIMS = {  # task: (arm, baseline, who): the claims tested on arm - baseline per batch
    "vision": ("lars", "sgd", "You et al. 2017; Goyal et al. 2017", "Nado et al. 2021"),
    "mlm": ("lamb", "adamw", "You et al. 2019", "Nado et al. 2021"),
}


def build_parser():
  p = common.parser("original_domains", __doc__)
  p.add_argument("--task", choices=tuple(recipes.TASKS), required=True)
  p.add_argument("--quick", action="store_true", help="tiny sizes (tests, a first look)")
  p.add_argument("--batches", type=common.ints, default=None, help="default: the task's")
  p.add_argument("--optimizers", default="", help="default: the task's")
  p.add_argument("--train_examples", type=int, default=131_072,
                 help="vision: mnist1d training examples (4096 / 131072 = 3.1%%)")
  p.add_argument("--epochs", type=float, default=4, help="vision: the budget")
  p.add_argument("--warmup_epochs", type=float, default=0.5, help="vision")
  p.add_argument("--tokens", type=int, default=4_194_304, help="mlm: the budget")
  p.add_argument("--warmup_fraction", type=float, default=0.1, help="mlm: of the budget")
  p.add_argument("--lr_grid", type=common.floats, default=None,
                 help="multipliers of each recipe's rule-derived rate (0.5,1,2; quick 0.25,1,4)")
  p.add_argument("--b2_grid", type=common.floats, default=None,
                 help="AdamW's (0.95,0.99,0.999; quick 0.95,0.999)")
  p.add_argument("--max_extensions", type=int, default=None, help="3; quick 0")
  p.add_argument("--bracket_factor", type=float, default=2.0)
  common.add_budget_args(p, evals=4, eval_sequences=0)
  p.set_defaults(seeds=None, micro_batch_size=0)
  return p


def parse(argv):
  p = build_parser()
  args, overrides = p.parse(argv)
  task = recipes.TASKS[args.task]
  quick = QUICK[args.task] if args.quick else {}
  for key in ("train_examples", "epochs", "tokens"):
    if key in quick:
      setattr(args, key, quick[key])
  for key, value in (QUICK_GRID if args.quick else FULL).items():
    if getattr(args, key) is None:
      setattr(args, key, value)
  args.batches = sorted(args.batches or quick.get("batches", task.batches))
  args.optimizers = [o for o in args.optimizers.split(",") if o] or list(task.optimizers)
  bad = [o for o in args.optimizers if (args.task, o) not in recipes.RECIPES]
  if bad:
    p.error(f"--optimizers: no {args.task} recipe for {bad[0]!r}; choose from "
            f"{', '.join(task.optimizers)}")
  if task.baseline not in args.optimizers:
    p.error(f"--optimizers must include the baseline {task.baseline!r}")
  if args.config == common.DEFAULT_CONFIG:
    args.config = task.config
  if args.out == os.path.join("docs", "original_domains"):  # one output per task
    args.out += f"_{args.task}" + ("_quick" if args.quick else "")
  args.workdir = os.path.join(args.workdir, args.task)
  args.eval_sequences = args.eval_sequences or quick.get("eval_sequences", 0) or (
      4_000 if args.task == "vision" else 256)
  overrides = [(k, str(v)) for k, v in quick.get("config", {}).items()] + overrides
  if not args.lr_grid or min(args.lr_grid) <= 0 or not all(0 < b < 1 for b in args.b2_grid):
    p.error("--lr_grid needs positive multipliers (e.g. 0.5,1,2), --b2_grid values in (0, 1)")
  if args.seeds < 1 or args.max_extensions < 0 or args.bracket_factor <= 1:
    p.error("--seeds must be at least 1, --max_extensions at least 0, --bracket_factor above 1")
  return args, overrides


def budget(args, cfg) -> None:
  """`args.examples` and `args.warmup_examples` from the budget (vision: epochs of the training
  set; mlm: tokens / the config's seq_len); a batch that does not divide them is a ConfigError
  (one line, before anything compiles)."""
  if args.task == "vision":
    args.examples = round(args.epochs * args.train_examples)
    args.warmup_examples = round(args.warmup_epochs * args.train_examples)
  else:
    args.examples = args.tokens // cfg.data.seq_len
    args.warmup_examples = round(args.warmup_fraction * args.examples)
  uneven = [b for b in args.batches if b < 1 or args.examples % b
            or args.micro_batch_size and b % min(args.micro_batch_size, b)]
  if uneven:
    fits = [b for b in (16, 32, 64, 128, 256, 512, 1024, 2048, 4096) if not args.examples % b]
    raise ConfigError(f"--batches {uneven[0]}: the budget of {args.examples} examples (and the "
                      f"micro-batch {args.micro_batch_size}) must be multiples of every batch; "
                      f"batches that fit: {fits}")


def run_config(base, args, name: str, batch: int, mult: float, b2, seed: int):
  """The run of recipe `name` at `batch`: the budget, its rate x `mult`, b2 (AdamW) and seed."""
  from optim.scaling import stated  # noqa: PLC0415  start-up
  micro = min(args.micro_batch_size or batch, batch)
  cfg = common.at_budget(base, batch, args.examples, micro=micro, evals=args.evals,
                         eval_sequences=args.eval_sequences)
  cfg.seed = seed
  if args.task == "vision":
    cfg.data.mnist1d.train_examples = args.train_examples
  task = recipes.TASKS[args.task]
  recipes.apply(cfg, args.task, name, task.reference_batch, args.warmup_examples, b2)
  if mult != 1.0:
    cfg.optim.learning_rate = stated(cfg.optim)["learning_rate"][0] * mult
  return cfg


def train_run(cfg, workdir: str, metric: str):
  """Train `cfg`: (final `metric`, NaN where the final eval loss is not finite; steps; seconds).
  Tests replace it."""
  t = common.train(cfg, workdir)
  evals = [r for r in t.rows if metric in r]
  last = evals[-1] if evals else {}
  ok = math.isfinite(float(last.get("eval_loss", math.nan)))
  return (float(last[metric]) if ok else math.nan), t.steps_run, t.seconds


def tune(args, cfg) -> list[dict]:
  """Every recipe at every batch: rates (x b2) x seeds, bracketed on the mean error."""
  from optim import derive  # noqa: PLC0415  start-up
  task = recipes.TASKS[args.task]
  seeds = [cfg.seed + k for k in range(args.seeds)]
  budget(args, cfg)
  runs, tuned = [], []
  for batch in args.batches:
    for name in args.optimizers:
      b2s = args.b2_grid if name in recipes.B2_TUNED else ["rule"]
      cells = {}

      def score(mult, name=name, batch=batch, b2s=b2s, cells=cells):
        for b2 in b2s:
          errors = []
          for seed in seeds:
            c = run_config(cfg, args, name, batch, mult, b2, seed)
            hp = derive(c.optim, batch)
            where = os.path.join(args.workdir, f"{name}_b{batch}_lr{mult:g}_b2{b2}_s{seed}")
            acc, steps, seconds = train_run(c, where, task.metric)
            runs.append({"task": args.task, "seed": seed, "optimizer": name,
                         "batch_size": batch, "lr_rule": c.optim.lr_rule,
                         "lr_multiplier": mult,
                         "b2_choice": b2 if name in lbo.B2_OPTIMIZERS else None,
                         "learning_rate": hp.learning_rate,
                         "b2": hp.b2 if name != "lars" and name != "sgd" else None,
                         "weight_decay": hp.weight_decay, "steps": steps,
                         "examples": steps * batch, "metric": task.metric, "accuracy": acc,
                         "error": 1.0 - acc, "seconds": seconds})
            errors.append(1.0 - acc)
            print(f"[domains] {name} at batch {batch}: lr {hp.learning_rate:.4g} (x{mult:g}), "
                  f"b2 {b2}, seed {seed}: {task.metric} {acc:.4f}; {seconds:.0f}s", flush=True)
          cells[mult, b2] = common.seed_mean(errors)
        done = [cells[mult, b2] for b2 in b2s if math.isfinite(cells[mult, b2])]
        return min(done) if done else None

      scores = tradeoff.bracket(score, args.lr_grid, factor=args.bracket_factor,
                                max_extensions=args.max_extensions)
      arm = lbo.best_arm(name, batch, cells, scores, runs, metric="error")
      arm["accuracy"] = 1.0 - arm["error"]
      arm["accuracy_interval"] = stats.t_interval(
          r["accuracy"] for r in runs if (r["optimizer"], r["batch_size"], r["lr_multiplier"],
                                          r["b2_choice"]) == (name, batch, arm["lr_multiplier"],
                                                              arm["b2_choice"])).text(".4f")
      tuned.append(arm)
  report(args, runs, tuned)
  return runs


def report(args, runs: list[dict], tuned: list[dict]) -> None:
  task = recipes.TASKS[args.task]
  lbo.write_tuned(args, runs, tuned, TUNED_COLUMNS, "domains")
  diffs = lbo.compare(tuned, runs, task.baseline, metric="accuracy")
  figures.write_csv(args.out + "_paired.csv", diffs)
  print(f"[domains] tuned arms against tuned {task.baseline}, seed by seed (95% t):")
  for d in diffs:
    print(f"[domains]   {d['text']}")
  for line in verdicts(args.task, diffs, args.optimizers):
    print(f"[domains] {line}")
  plotted = plot(args.out + ".png", args, tuned)
  print(f"[domains] wrote {args.out}.csv, _tuned.csv, _paired.csv"
        + (f", {args.out}.png" if plotted else figures.NO_PLOT), flush=True)


def verdicts(task: str, diffs: list[dict], optimizers) -> list[str]:
  """The issue's two claims of `task` from the paired differences arm - baseline per batch:
  'holds to a larger batch' needs the arm significantly ahead at the largest batch called and
  behind at none; 'matches' fails where the arm is significantly ahead at any batch called."""
  arm, base, first, second = CLAIMS[task]
  if arm not in optimizers:
    return [f"claims: {arm} not run"]
  mine = sorted((d for d in diffs if d["arm"] == arm), key=lambda d: d["batch_size"])
  called = [d for d in mine if d.get("called", True)]
  censored = [d["batch_size"] for d in mine if not d.get("called", True)]
  note = f" (not called, censored rate: batches {censored})" if censored else ""
  if not called:
    return [f"claim ({first}): {arm} holds accuracy to a larger batch than {base}: not called"
            + note, f"claim ({second}): tuned {base} matches {arm}: not called" + note]
  ahead = [d["batch_size"] for d in called if d["diff_significant"] and d["diff"] > 0]
  behind = [d["batch_size"] for d in called if d["diff_significant"] and d["diff"] < 0]
  top = called[-1]
  at_top = (f"at batch {top['batch_size']} {arm} - {base} = {top['diff']:+.4f} "
            f"[{top['diff_lo']:+.4f}, {top['diff_hi']:+.4f}]")
  if top["batch_size"] in ahead and not behind:
    one = f"holds: {at_top}; {arm} ahead at batches {ahead}, behind at none"
  elif behind:
    one = f"fails: {base} ahead at batches {behind} ({at_top})"
  else:
    one = f"not shown: {at_top}, the interval holds 0" + (
        f"; {arm} ahead at batches {ahead}" if ahead else "")
  widest = max((d["diff_hi"] - d["diff_lo"]) / 2 for d in called)
  two = (f"fails: {arm} ahead at batches {ahead}" if ahead else
         f"holds within the intervals: {arm} ahead at no batch of {[d['batch_size'] for d in called]}"
         f" (widest half-width {widest:.4f}: smaller differences are not resolved)")
  return [f"claim ({first}): {arm} holds accuracy to a larger batch than {base}: {one}" + note,
          f"claim ({second}): tuned {base} matches {arm}: {two}" + note]


TUNED_COLUMNS = [("optimizer", "optimizer", "s"), ("batch_size", "batch", "d"),
                 ("lr_multiplier", "lr x rule", "g"), ("learning_rate", "lr", ".4g"),
                 ("b2", "b2", ".4g"), ("accuracy", "mean accuracy", ".4f"),
                 ("accuracy_interval", "95% t", "s"), ("seeds", "seeds", "d"),
                 ("multipliers", "rates run (x)", "s"), ("interior", "rate inside", ""),
                 ("b2_interior", "b2 inside", "")]


def plot(path: str, args, tuned: list[dict]) -> bool:
  plt = figures.pyplot()
  if plt is None or not tuned:
    return False
  fig, ax = plt.subplots(figsize=(6, 4.3))
  for i, name in enumerate(args.optimizers):
    arms = sorted((t for t in tuned if t["optimizer"] == name), key=lambda t: t["batch_size"])
    ax.plot([t["batch_size"] for t in arms], [t["accuracy"] for t in arms], "o-", c=f"C{i}",
            label=name)
    for t in arms:
      if not t["interior"]:  # censored: hollow marker
        ax.plot(t["batch_size"], t["accuracy"], "o", mfc="white", c=f"C{i}")
  ax.set(xscale="log", xlabel="batch size", ylabel=recipes.TASKS[args.task].metric)
  ax.set_xticks(args.batches, [str(b) for b in args.batches])
  ax.legend(fontsize=8)
  figures.save(fig, path, f"{args.task}: tuned accuracy vs batch, {args.examples:,} examples, "
               f"{args.seeds} seeds (hollow: censored rate)")
  return True


def main(argv: list[str]) -> int:
  return common.main("original_domains", parse, tune, argv, seeds_inside=True)


if __name__ == "__main__":
  sys.exit(main(sys.argv[1:]))

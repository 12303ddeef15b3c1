"""How the critical batch scales with model size N and data D: McCandlish's B_crit, Zhang et al.'s
20%-overhead batch, B_opt, eta_opt and the optimal rate per batch at every (N, D), with paired
bootstrap and residual-based intervals, under the protocol of docs/scaling_lab.md.

    python -m experiments.critical_batch_scaling [--widths 32,64,128] [--depths 2,4,8] \\
        [--budgets 2048,4096,8192,16384] [--batch_sizes 1,2,4,...,256] [--lr_grid 0.5,1,2] \\
        [--seeds 3] [--jobs 2] [--quick] [--read_only] [--from_runs RUNS.csv]
    python -m tools.scaling_fit OUT.csv      # the power laws in D and N

Reference runs set each width's targets; every (width, batch, rate, seed) trains once and every
budget is read from its record; rates grow beyond any winning edge round by round; one batch
window for every cell; `scaling_cells` turns each (N, D) into estimates and refuses a cell whose
rates stay censored. Outputs: OUT.csv, OUT_boot.csv, OUT_runs.csv, OUT_lr.csv, OUT.png; runs in
--workdir (experiments/scaling_runs.py).
"""
from __future__ import annotations

import json
import math
import os
import sys


from experiments import common, scaling_b2, scaling_cells, scaling_runs, scaling_sizes
from experiments.scaling_runs import Task, grid_rows, job, reference_stop, run_all
from experiments.scaling_sizes import axes, label, name, of_row, sizes, split, task
from tools import figures, lr_rules
from tools.tradeoff import next_multipliers
from trainer.config import ConfigError

QUICK = dict(widths=[32, 64], budgets=[512, 1024, 2048], batch_sizes=[4, 8, 16, 32],
             lr_grid=[0.5, 1.0, 2.0], seeds=2, eval_sequences=32, max_extensions=1,
             max_factor=4.0, bootstrap=200, b2_grid=[],
             out=os.path.join("runs", "scaling_lab_quick", "lab"), workdir=os.path.join("runs", "scaling_lab_quick", "runs"))


def build_parser():
  p = common.parser("critical_batch_scaling", __doc__, seeds=False)
  # not docs/critical_batch_scaling*: those CSVs are the grid measured before this protocol
  p.set_defaults(out=os.path.join("docs", "scaling_lab"),
                 workdir=os.path.join("runs", "experiments", "scaling_lab"))
  p.add_argument("--widths", type=common.ints, default="32,64,128", help="d_model of each N")
  p.add_argument("--budgets", type=common.ints, default="2048,4096,8192,16384",
                 help="data budgets D in sequences (x seq_len tokens): each target is the "
                      "reference runs' mean eval loss after D")
  p.add_argument("--batch_sizes", type=common.ints, default="1,2,4,8,16,32,64,128,256",
                 help="batches in sequences (the meter is off at 1)")
  p.add_argument("--lr_grid", type=common.floats, default="0.5,1,2",
                 help="multipliers of the rule's rate to start from at each batch (x1 always)")
  p.add_argument("--max_extensions", type=int, default=3,
                 help="rounds that grow a batch's rate grid beyond a winning edge")
  p.add_argument("--bracket_factor", type=float, default=2.0, help="each extension's step")
  p.add_argument("--b2_grid", type=common.floats, default="0.95,0.99",
                 help="fixed Adam b2 values run beside the rule's at the smallest and largest "
                      "batch once the rates are bracketed (experiments/scaling_b2.py); '' for none")
  p.add_argument("--parametrization", default="mup", choices=("mup", "sp"),
                 help="mup: model.parametrization=mup with base_width the config's own d_model "
                      "(where its rate is stated), so every width starts near its optimal rate; "
                      "sp: the config's rate at every width")
  scaling_sizes.add_flags(p)
  p.add_argument("--seeds", type=int, default=3, help="the config's seed, seed + 1, ...")
  p.add_argument("--jobs", type=int, default=1, help="runs trained at once, each a process")
  p.add_argument("--quick", action="store_true",
                 help=f"a grid of minutes (what the tests run): {QUICK}; flags given win")
  p.add_argument("--reference_factor", type=float, default=1.25,
                 help="the reference runs train this multiple of the largest budget")
  p.add_argument("--max_factor", type=float, default=4.0,
                 help="a run gives up after this multiple of the largest budget")
  p.add_argument("--micro_batch_size", type=int, default=8)
  p.add_argument("--max_examples", type=int, default=0, help="overrides --max_factor")
  p.add_argument("--eval_fraction", type=float, default=1 / 16,
                 help="evaluate every this fraction of the smallest budget (sequences)")
  p.add_argument("--smooth_fraction", type=float, default=0.25,
                 help="a budget's crossing and loss on the eval curve averaged over this "
                      "fraction of the budget")
  p.add_argument("--eval_sequences", type=int, default=64, help="validation sequences")
  p.add_argument("--warmup_fraction", type=float, default=1 / 16,
                 help="warmup, in sequences, as a fraction of the smallest budget (replaces "
                      "the config's; the same at every batch)")
  p.add_argument("--transient_warmups", type=float, default=8.0,
                 help="a budget within this many warmups of the start is reported as a "
                      "transient regime and left out of the power laws")
  p.add_argument("--curve", default="raw", choices=("raw", "ema"),
                 help="read targets and crossings on the raw eval curve or on the parameter "
                      "EMA's (Zhang et al.'s EWA; needs --ema_decay)")
  p.add_argument("--ema_decay", type=float, default=0.0,
                 help="optim.ema_decay at the reference batch (half-life rule across batches)")
  p.add_argument("--bootstrap", type=int, default=300, help="bootstrap replicates")
  p.add_argument("--from_runs", default="",
                 help="train nothing: estimate every cell from a runs CSV (OUT_runs.csv of this "
                      "or an earlier lab; its widths, budgets, batches and seeds) by this "
                      "protocol's rules, e.g. to re-read a grid measured before them")
  p.add_argument("--read_only", action="store_true",
                 help="train nothing: summarise if every run's record is complete, else report "
                      "which are pending (safe beside a lab that is running)")
  return p


def parse(argv, build=build_parser):
  """(args, overrides) of the lab's command line (`build`: its parser, or one that adds to it)
  with the derived settings: evaluation interval, smoothing windows, warmup, stop budgets."""
  p = build()
  args, overrides = p.parse(argv)
  if args.quick:
    p.set_defaults(**QUICK)
    args, overrides = p.parse(argv)
  args.lr_grid = sorted(set(args.lr_grid) | {1.0})
  args.budgets, args.batch_sizes = sorted(set(args.budgets)), sorted(set(args.batch_sizes))
  if len(args.batch_sizes) < 2 or not args.budgets or not args.widths:
    p.error("give two or more --batch_sizes, and one or more --budgets and --widths")
  args.depths = sorted(set(args.depths))
  if any(d < 1 for d in args.depths):
    p.error(f"--depths {args.depths}: each is a number of layers, at least 1")
  odd = [b for b in args.batch_sizes if b % args.micro_batch_size and b > args.micro_batch_size]
  if odd:
    p.error(f"--batch_sizes: {odd[0]} is not a multiple of --micro_batch_size="
            f"{args.micro_batch_size} (a batch at or below it is one micro-batch)")
  if not (0 < args.eval_fraction <= 1 and 0 <= args.smooth_fraction < 1
          and 0 <= args.warmup_fraction < 1):
    p.error("--eval_fraction in (0, 1], --smooth_fraction and --warmup_fraction in [0, 1)")
  if any(not 0 < x < 1 for x in args.b2_grid):
    p.error(f"--b2_grid {args.b2_grid}: Adam's b2 values lie in (0, 1), e.g. 0.95,0.99")
  if args.curve == "ema" and args.ema_decay <= 0:
    p.error("--curve ema reads the parameter EMA's eval loss: give --ema_decay, e.g. 0.99")
  if args.seeds < 1 or args.jobs < 1 or args.bootstrap < 0 or args.max_extensions < 0:
    p.error("--seeds and --jobs must be at least 1, --bootstrap and --max_extensions at least 0")
  for flag in ("out", "workdir"):
    parent = os.path.dirname(os.path.abspath(getattr(args, flag)))
    while parent and not os.path.exists(parent):
      parent = os.path.dirname(parent)
    if parent and not os.path.isdir(parent):
      p.error(f"--{flag} {getattr(args, flag)}: {parent} is a file, not a directory")
  largest = args.budgets[-1]
  args.eval_interval = max(1, round(args.eval_fraction * args.budgets[0]))
  args.smooth = {d: args.smooth_fraction * d for d in args.budgets}
  args.smooth_lowest = args.smooth[largest]  # the lowest target: where a run stops
  # a run evaluates every max(eval_interval, its batch) sequences: the largest batch's first
  # smoothed point must come before the smallest budget
  first = args.smooth[args.budgets[0]] / 2 + max(args.eval_interval, args.batch_sizes[-1])
  if args.budgets[0] <= first:
    p.error(f"--budgets: {args.budgets[0]} sequences is within the first smoothing window of a "
            f"run at batch {args.batch_sizes[-1]} ({first:g} sequences): give larger budgets")
  args.warmup = round(args.warmup_fraction * args.budgets[0])
  args.min_examples = largest + args.smooth_lowest / 2 + args.eval_interval
  args.max_examples = args.max_examples or int(args.max_factor * largest)
  args.reference_examples = int(max(args.reference_factor * largest, args.min_examples))
  if args.max_examples < args.reference_examples:
    p.error(f"--max_examples {args.max_examples} is below the {args.reference_examples:g} "
            "sequences the reference runs train (--reference_factor x the largest budget, at "
            "least that budget and half its smoothing window)")
  return args, overrides


def task_config(cfg, t: Task, args):
  """The config of task `t`: its size's (width, and depth where it has one), with `t.b2` fixed at
  every batch where it has one."""
  c = width_config(cfg, t.width, t.seed, args, depth=getattr(t, "depth", 0))
  if t.b2:
    c.optim.b2, c.optim.b2_rule = t.b2, "constant"
  return c


def width_config(cfg, width: int, seed: int, args=None, depth: int = 0):
  """The base config at d_model `width` (mlp_dim in the config's ratio), `depth` layers (0: the
  config's) and `seed`; with the lab's `args`, its parametrizations, warmup and parameter EMA."""
  c = cfg.copy_and_resolve_references()
  if depth:
    scaling_sizes.deepen(c, cfg, depth, args)
  c.model.mlp_dim = round(cfg.model.mlp_dim / cfg.model.d_model * width)
  c.model.d_model, c.seed = width, seed
  if args is not None:
    if args.parametrization == "mup":
      # the base is the width the config's rate was stated at (its base_width if it has one)
      c.model.parametrization = "mup"
      c.model.base_width = cfg.model.base_width or cfg.model.d_model
    c.optim.warmup_steps, c.optim.warmup_examples = 0, args.warmup
    if args.ema_decay:
      c.optim.ema_decay, c.optim.ema_rule = args.ema_decay, "half_life"
  return c


def parameters(cfg) -> dict[str, int]:
  from models.llama import ModelConfig  # noqa: PLC0415  start-up
  from models.sizes import param_counts  # noqa: PLC0415  start-up
  return param_counts(ModelConfig.from_config(cfg.model))


def experiment(args, cfg) -> list[dict]:
  if cfg.data.batch_ramp or cfg.optim.schedule != "constant":
    raise ConfigError("the lab reads every target from one run at a constant rate: set "
                      "data.batch_ramp='' and optim.schedule='constant' (got "
                      f"{cfg.data.batch_ramp!r}, {cfg.optim.schedule!r})")
  bad = [w for w in args.widths if w % cfg.model.num_heads]
  if bad:
    raise ConfigError(f"--widths: {bad[0]} is not a multiple of model.num_heads="
                      f"{cfg.model.num_heads}")
  seq = cfg.data.seq_len
  if args.from_runs:
    return reanalyse(args, cfg)
  seeds = [cfg.seed + k for k in range(args.seeds)]
  ref = cfg.optim.reference_batch_size or cfg.data.global_batch_size
  config = lambda t: task_config(cfg, t, args)
  keys = sizes(args)
  counts = {k: parameters(width_config(cfg, split(k)[0], seeds[0], args, depth=split(k)[1]))
            for k in keys}
  for k, n in counts.items():
    print(f"[scaling] {name(k)}: {n['total'] / 1e6:.3f}M parameters "
          f"({n['non_embedding'] / 1e6:.3f}M non-embedding)", flush=True)
  small = min(keys, key=lambda k: counts[k]["non_embedding"])
  smallest = counts[small]["non_embedding"]
  print("[scaling] budgets D = " + ", ".join(f"{d:,} sequences ({d * seq:,} tokens)"
                                              for d in args.budgets)
        + f"; the largest is {args.budgets[-1] * seq / smallest:.1f} tokens per non-embedding "
        f"parameter at {name(small)} (Chinchilla's ratio: 20); batches "
        f"{args.batch_sizes}; rates x{args.lr_grid} grown to bracket; seeds {seeds}; warmup "
        f"{args.warmup} sequences; evaluations every {args.eval_interval} sequences; "
        f"{args.parametrization}" + (f", {args.depth_parametrization} over depths {args.depths}"
                                     if args.depths else "")
        + f"; the {args.curve} eval curve", flush=True)
  ref_tasks = [task(k, ref, 1.0, s) for s in seeds for k in keys]
  ref_jobs = {t: job(t, config(t), args, reference_stop(args)) for t in ref_tasks}
  run_all(ref_tasks, ref_jobs, args, seq)
  key = scaling_runs.curve_key(args.curve)
  targets = {}
  for k in keys:
    losses = [[common.loss_at(ref_jobs[t]["workdir"], ref, seq, [d], args.smooth[d], key)[0]
               for d in args.budgets] for t in ref_tasks if t.size == k]
    if any(x is None for loss in losses for x in loss):
      raise ConfigError(f"{name(k)}: a reference run's eval curve does not reach every budget "
                        f"({args.budgets}); see the runs under {args.workdir}")
    targets[k] = [sum(x[i] for x in losses) / len(losses) for i in range(len(args.budgets))]
    print(f"[scaling] {name(k)}: targets (mean eval loss of the reference runs at batch {ref}) "
          + ", ".join(f"{d:,}: {l:.4f}" for d, l in zip(args.budgets, targets[k])), flush=True)
  mults = {(k, b): list(args.lr_grid) for k in keys for b in args.batch_sizes}
  for round_ in range(args.max_extensions + 1):
    # Smallest size first, all its seeds: a lab cut short has whole sizes done.
    tasks = [task(k, b, m, s) for k in sorted(keys) for s in seeds
             for b in sorted(args.batch_sizes, reverse=True) for m in sorted(mults[k, b])]
    runs = [row for rows in grid_rows(tasks, config, targets, counts, ref, args, seq).values()
            for row in rows]
    grown = {}
    for (k, b), ms in mults.items():
      scores = [{r["lr_multiplier"]: r["steps"] for r in runs if (of_row(r), r["batch_size"],
                 r["seed"], r["budget"]) == (k, b, s, d)} for s in seeds for d in args.budgets]
      new = [m for m in next_multipliers(*scores, factor=args.bracket_factor) if m not in ms]
      if new:
        grown[k, b] = new
    if not grown or round_ == args.max_extensions:
      break
    print(f"[scaling] round {round_ + 1}: a fastest rate at its grid's edge at "
          f"{len(grown)} {axes(args)}: " + ", ".join(
              f"{label(k)} b{b} +x{'/x'.join(f'{m:g}' for m in new)}"
              for (k, b), new in grown.items()), flush=True)
    for k, new in grown.items():
      mults[k] += new
  if grown:
    print(f"[scaling] after {args.max_extensions} extensions {len(grown)} {axes(args)} still "
          "have a fastest rate at the edge: their cells are refused", flush=True)
  if args.b2_grid and args.depths:
    print("[scaling] --b2_grid: not run on a depth grid (experiments/scaling_b2.py brackets b2 "
          "per width)", flush=True)
  elif args.b2_grid and cfg.optim.name in ("adamw", "adam", "lamb"):
    b2 = scaling_b2.run(args, runs, targets, counts, seeds, ref, seq, config,
                        lambda t: width_config(cfg, t.width, t.seed, args).optim)
    figures.write_csv(args.out + "_b2.csv", [compact(r) for r in b2])
  return summarize(args, runs, counts, targets, seeds, seq)


def reanalyse(args, cfg) -> list[dict]:
  """`--from_runs`: the cells of a runs CSV by this protocol's rules (an earlier lab's
  `below_at_start` read as `censored`; its rows carry no bound there, so such a crossing counts
  as not reached); its warmup is the CSV's `warmup` column, or the config's where it has none.
  A row without a depth (no such column, or an empty cell) is at the config's depth."""
  need = ("width", "seed", "batch_size", "lr_multiplier", "learning_rate", "budget", "target",
          "steps")
  runs = [{**r, "censored": bool(r.get("censored", r.get("below_at_start")))} for r in
          figures.read_table(args.from_runs, need, "--from_runs: a lab's OUT_runs.csv")]
  deep = any(r.get("depth") for r in runs)
  for r in runs:
    for k in ("width", "seed", "batch_size", "budget"):
      r[k] = int(r[k])
    if deep:
      r["depth"] = int(r.get("depth") or cfg.model.num_layers)
  keys = sorted({of_row(r) for r in runs})
  args.widths = sorted({split(k)[0] for k in keys})
  args.depths = sorted({split(k)[1] for k in keys}) if deep else []
  args.budgets = sorted({r["budget"] for r in runs})
  args.batch_sizes = sorted({r["batch_size"] for r in runs})
  warmups = sorted({int(r.get("warmup") or cfg.optim.warmup_examples) for r in runs})
  if len(warmups) > 1:  # a lab's warmup is a fraction of its own smallest budget
    raise ConfigError(f"--from_runs: its rows were trained with warmups of {warmups} sequences, "
                      "so its cells are not measured alike; join runs of one warmup (a lab of "
                      "other budgets matches with --warmup_fraction = warmup / smallest budget)")
  args.warmup = warmups[0]
  seeds = sorted({r["seed"] for r in runs})
  targets = {k: [next(r["target"] for r in runs if (of_row(r), r["budget"]) == (k, d))
                 for d in args.budgets] for k in keys}
  counts = {k: parameters(width_config(cfg, split(k)[0], seeds[0], depth=split(k)[1]))
            for k in keys}
  print(f"[scaling] {len(runs)} rows of {args.from_runs}: widths {args.widths}"
        + (f", depths {args.depths}" if deep else "") + f", budgets {args.budgets}, batches "
        f"{args.batch_sizes}, seeds {seeds}; nothing trained", flush=True)
  return summarize(args, runs, counts, targets, seeds, cfg.data.seq_len)


def summarize(args, runs: list[dict], counts, targets, seeds, seq) -> list[dict]:
  """Estimates per (N, D) with intervals: OUT.csv, OUT_boot.csv, OUT_runs.csv, OUT_lr.csv,
  the table, OUT.png. `counts` and `targets` are keyed by size (`scaling_sizes`)."""
  keys = list(counts)
  lowest = {k: min(targets[k]) for k in keys}
  reached = {(of_row(x), x["seed"], x["batch_size"]) for x in runs
             if x["steps"] is not None and x["target"] == lowest[of_row(x)]}
  failed = [b for b in args.batch_sizes
            if any((k, s, b) not in reached for k in keys for s in seeds)]
  if failed:
    print(f"[scaling] batches {failed}: some seed reached the lowest target at no rate within "
          f"{args.max_examples:,} sequences: left out of every cell (raise --max_factor to keep "
          "them)", flush=True)
  kept = [r for r in runs if r["batch_size"] not in failed]
  boot = scaling_cells.draws(args.bootstrap, len(seeds))
  cells, replicates, lr_rows = [], [], []
  for k in keys:
    for i, d in enumerate(args.budgets):
      mine = [r for r in kept if of_row(r) == k and r["budget"] == d]
      est, reps = scaling_cells.cell(mine, boot) if mine else ({}, [])
      key = dict(**scaling_sizes.columns(k), params=counts[k]["total"],
                 non_embedding=counts[k]["non_embedding"], budget=d, tokens=d * seq,
                 target=targets[k][i], transient=d < args.transient_warmups * args.warmup)
      cells.append({**key, **est})
      if not est.get("refused"):
        replicates += [{"params": key["params"], "tokens": key["tokens"], "replicate": k,
                        **compact({q: rep[q] for q in FITTED})} for k, rep in enumerate(reps)]
      lr_rows += [{**scaling_sizes.columns(k), "budget": d, **x} for x in scaling_cells.lr_opt(mine)]
  columns = [c for c in cells[0] if c not in ("steps_by_batch", "steps_spread", "loss_by_batch")]
  figures.write_csv(args.out + ".csv", [{k: text(c.get(k)) for k in columns} for c in cells],
                    columns)
  figures.write_csv(args.out + "_runs.csv", [compact(r) for r in runs])
  figures.write_csv(args.out + "_lr.csv", [compact(r) for r in lr_rows])
  if replicates:
    figures.write_csv(args.out + "_boot.csv", replicates)
  cases = sum(c.get("cases", 0) for c in cells)
  inside = sum(c.get("interior_cases", 0) for c in cells)
  print(f"[scaling] {inside} of {cases} (width, budget, batch, seed) cases with a crossing have "
        f"their fastest rate inside the rates run ({inside / max(cases, 1):.0%})", flush=True)
  for c in cells:
    if c.get("refused"):
      print(f"[scaling] cell {label(of_row(c))} D {c['budget']:,}: refused ({c['refused']})")
  print(common.table([{**c, **{f"{q}_ci": ci(c, q) for q in scaling_cells.QUANTITIES}}
                      for c in cells], COLUMNS, "scaling"))
  lr_rules.report(lr_rows, args.out + "_lr.json")
  plotted = scaling_sizes.plot(args.out + ".png", cells, args)
  print(f"[scaling] wrote {args.out}.csv, {args.out}_runs.csv, {args.out}_lr.csv"
        + (f", {args.out}_boot.csv ({args.bootstrap} replicates)" if replicates else "")
        + (f", {args.out}.png" if plotted else figures.NO_PLOT))
  return cells


def text(v):
  """A CSV cell: dicts and lists as compact JSON, floats to 5 significant digits."""
  if isinstance(v, (dict, list)):
    return json.dumps(v, separators=(",", ":"))
  return compact({"v": v})["v"]


def compact(row: dict) -> dict:
  """The row with floats to 5 significant digits (the CSVs stay small enough to commit)."""
  return {k: float(f"{v:.5g}") if isinstance(v, float) and math.isfinite(v) else v
          for k, v in row.items()}


def ci(c: dict, q: str) -> str:
  """'lo-hi' of a quantity's interval ('-' without one)."""
  lo, hi = c.get(f"{q}_lo"), c.get(f"{q}_hi")
  return "-" if lo is None else f"{lo:.3g}-{hi:.3g}"


FITTED = ("b_crit", "b_zhang", "b_opt", "eta_opt", "b_simple")  # what tools.scaling_fit reads
COLUMNS = [("params", "N", ",d"), ("tokens", "D tokens", ",d"), ("target", "target", ".3f"),
           ("s_min", "S_min", ".1f"), ("e_min", "E_min", ",.0f"), ("b_crit", "B_crit", ".1f"),
           ("b_crit_ci", "95% boot", "s"), ("b_crit_fit_lo", "fit lo", ".1f"),
           ("b_crit_fit_hi", "fit hi", ".1f"), ("b_zhang", "B_zhang", ".1f"),
           ("b_zhang_ci", "95%", "s"), ("b_opt", "B_opt", ".1f"), ("b_opt_resolved", "inside", ""),
           ("eta_opt", "eta_opt", ".2e"), ("eta_opt_resolved", "inside", ""),
           ("b_simple", "B_simple", ".1f"), ("interior_cases", "rates inside", "d"),
           ("cases", "of", "d"), ("transient", "transient", "")]


def main(argv: list[str]) -> int:
  try:
    return common.main("scaling", parse, experiment, argv, seeds_inside=True)
  except scaling_runs.Pending as e:
    print(f"[scaling] --read_only: {e}")
    return 0


if __name__ == "__main__":
  sys.exit(main(sys.argv[1:]))

"""What every experiment shares: its command line, a config at a token budget, and the results
table. Training a config in-process (trainer/run/inprocess.py) and reading a run's own record
(trainer/tracking/record.py: examples seen through its batch changes, the eval curve, where it
crossed a target) are re-exported here.

Every experiment trains through `trainer.run.loop.Run` exactly as train.py does (the same data
order, checkpoints and metrics.jsonl), one run after the other in this process, each in a fresh
workdir under `--workdir`. Its outputs are one CSV (`tools/figures.write_csv`) and one PNG
(`tools/figures.save`), by default `docs/<experiment>.csv` and `.png`.
"""
from __future__ import annotations

import copy
import math
import os
import shutil
import sys
import time
from collections.abc import Callable

from tools import batch_sweep, figures, stats
from trainer.config import ConfigError
from trainer.config.cli import floats, ints  # noqa: F401  (the experiments' argparse types)
from trainer.config.cli import CliParser, load
from trainer.multihost import platforms
from trainer.run import inprocess
from trainer.run.inprocess import Trained  # noqa: F401  (the experiments' toolkit)
from trainer.tracking.record import (Reached, eval_curve, interpolate, noise_curve,  # noqa: F401
                                     ramp_from_rows, read_rows, smooth, target_stop, to_target,
                                     train_curve)

DEFAULT_CONFIG = os.path.join("configs", "sweep_tiny.py")


# ------------------------------------------------------------------------------------------------
# Training in-process (the runs themselves: trainer/run/inprocess.py)


def at_budget(base, batch: int, examples: int, *, micro: int, evals: int,
              eval_sequences: int):
  """A copy of `base` that trains `examples` sequences at a fixed `batch` (micro-batches of
  `micro` rows, the same data order at every batch), evaluated `evals` times on the same
  `eval_sequences` validation sequences (the last evaluation at the end), without checkpoints
  or the noise meter."""
  if examples % batch or batch % micro and micro < batch:
    raise ValueError(f"budget {examples} and batch {batch} must be multiples of the micro-batch "
                     f"({micro}) and of each other")
  cfg = base.copy_and_resolve_references()
  cfg.data.global_batch_size = batch
  cfg.data.micro_batch_size = micro if micro < batch else 0
  cfg.data.batch_ramp = ""
  cfg.steps = examples // batch
  cfg.eval_every = max(1, cfg.steps // evals)
  while cfg.steps % cfg.eval_every:  # the last evaluation is at the last step
    cfg.eval_every -= 1
  cfg.eval_sequences = eval_sequences
  cfg.log_every = max(1, min(cfg.log_every, cfg.eval_every))
  cfg.optim.noise_scale_every = 0
  cfg.checkpoint.every_steps = 0
  cfg.trainer.progress_bar = False
  return cfg


def crossings(workdir: str, start_batch: int, seq_len: int, targets: list[float],
              smooth_examples: float, key: str = "eval_loss") -> list[dict]:
  """Per target, where a run's smoothed eval curve crossed it: steps, examples and tokens through
  the run's own record (its batch changes), the batch it had then and the B_simple the meter
  logged there, plain and preconditioned (all None where it never did); `first`: at the
  smoothed curve's first point, so the run may have crossed earlier (an upper bound, not a
  crossing). `key`: the curve read (`eval_loss_ema`: the parameter EMA's)."""
  rows = read_rows(workdir)
  ramp = ramp_from_rows(rows, start_batch, seq_len)
  curve, noise = eval_curve(rows, ramp, key), noise_curve(rows)
  noise_precond = noise_curve(rows, "noise_scale_precond")
  start = smooth(curve, smooth_examples / 2)[:1]
  out = []
  for target in targets:
    hit = to_target(curve, ramp, target, smooth_examples)
    out.append({"target": target, "steps": None, "examples": None, "tokens": None,
                "batch_at_target": None, "noise_scale": None,
                "noise_scale_precond": None, "first": False} if hit is None else
               {"target": target, "steps": hit.steps, "examples": hit.examples,
                "tokens": hit.tokens, "batch_at_target": ramp.batch_at(int(hit.steps)),
                "noise_scale": interpolate(noise, hit.steps),
                "noise_scale_precond": interpolate(noise_precond, hit.steps),
                "first": bool(start) and hit.examples == start[0][0]})
  return out


def loss_at(workdir: str, start_batch: int, seq_len: int, examples: list[float],
            smooth_examples: float, key: str = "eval_loss") -> list[float | None]:
  """The run's eval loss after each of `examples` sequences, on its curve smoothed as for a
  crossing (`smooth`), linear between evaluations; None outside the smoothed curve."""
  rows = read_rows(workdir)
  curve = smooth(eval_curve(rows, ramp_from_rows(rows, start_batch, seq_len), key),
                 smooth_examples / 2)
  return [interpolate(curve, x) if curve and curve[0][0] <= x <= curve[-1][0] else None
          for x in examples]


REUSE = False  # --reuse (every experiment's flag): `main` sets it for its command's run


def train(cfg, workdir: str, **kw) -> Trained:
  """`trainer.run.inprocess.train`, reading back a run that already finished in `workdir` with
  the same config and stop rule where the command was given `--reuse`, so a long experiment
  killed part-way resumes by run."""
  return inprocess.train(cfg, workdir, reuse=REUSE, **kw)


# ------------------------------------------------------------------------------------------------
# Command line, table, outputs


def parser(name: str, doc: str, *, seeds: bool = True):
  """CliParser of `python -m experiments.<name>`: `--config` (default configs/sweep_tiny.py),
  `--out` (path stem of the CSV and PNG, default docs/<name>), `--workdir` (the runs),
  `--seeds` (unless `seeds=False`) and `--config.KEY=VALUE` overrides of the base config."""
  p = CliParser(f"-m experiments.{name}", doc, config=False)
  p.add_argument("--config", default=DEFAULT_CONFIG, metavar="FILE.py",
                 help=f"base config (default {DEFAULT_CONFIG}); --config.KEY=VALUE overrides it")
  p.add_argument("--out", default=os.path.join("docs", name),
                 help="writes OUT.csv and OUT.png (default %(default)s)")
  p.add_argument("--workdir", default=os.path.join("runs", "experiments", name),
                 help="where the runs' workdirs go")
  p.add_argument("--reuse", action="store_true",
                 help="read a run that already finished in its workdir with the same config "
                      "(finished.json) instead of training it again: a killed experiment "
                      "resumes run by run")
  if not seeds:  # the experiment handles its seeds itself (fp8_loss: the noise is their spread)
    return p
  p.add_argument("--seeds", type=int, default=1,
                 help="repeat the experiment with the config's seed, seed + 1, ... (data order "
                      "and initialisation): OUT.csv holds every seed's rows, OUT_seeds.csv "
                      "each result's mean, std, min and max over the seeds")
  return p


def parse_targets(p, args) -> None:
  """`--targets` (eval losses) sorted from the highest, duplicates dropped; `args.target_loss`
  the lowest, where `tools.batch_sweep.run_one` stops (the others are read on the way)."""
  args.targets = sorted(set(args.targets), reverse=True)
  if not args.targets:
    p.error("--targets needs at least one loss, e.g. 2.7")
  args.target_loss = args.targets[-1]


def add_budget_args(p, *, evals: int, eval_sequences: int, evals_help: str = "evaluations per run"
                    ) -> None:
  """The flags of an experiment whose runs train a fixed budget (`at_budget`): micro-batch,
  how often and on how many validation sequences a run is evaluated."""
  p.add_argument("--micro_batch_size", type=int, default=8)
  p.add_argument("--evals", type=int, default=evals, help=evals_help)
  p.add_argument("--eval_sequences", type=int, default=eval_sequences, help="validation sequences")


def add_to_target_args(p, max_examples: int) -> None:
  """The flags of an experiment whose runs train to a target loss (`target_stop`, `to_target`):
  micro-batch, the give-up budget, evaluation interval and size, and the smoothing window."""
  p.add_argument("--micro_batch_size", type=int, default=8)
  p.add_argument("--max_examples", type=int, default=max_examples,
                 help="give up on a run after this many sequences")
  p.add_argument("--eval_examples", type=int, default=256,
                 help="sequences between evaluations")
  p.add_argument("--eval_sequences", type=int, default=64, help="validation sequences")
  p.add_argument("--smooth_examples", type=int, default=1024,
                 help="the eval curve is averaged over this many sequences before a crossing")


def main(name: str, parse: Callable, experiment: Callable, argv: list[str], *,
         keys: tuple[str, ...] = (), metrics: tuple[str, ...] = (),
         compare: tuple[str, str] | None = None,
         seeds_inside: bool | Callable = False) -> int:
  """Parse (`parse(argv) -> (args, overrides)`), load the base config, run
  `experiment(args, cfg) -> rows` (once per seed with `--seeds`: `keys` name a result, `metrics`
  its numbers, summarised over the seeds; `compare` = (key, baseline): every other value of that
  key against the baseline's, seed by seed, with t intervals (`paired`); `seeds_inside`: the
  experiment runs its seeds itself, or a function of the parsed args saying so) and report the
  wall time. A mistake in the command line or a config is one line on stderr and exit code 2,
  before anything compiles."""
  platforms.choose()
  try:
    args, overrides = parse(argv)
    cfg = load(args.config, overrides)
    if callable(seeds_inside):
      seeds_inside = seeds_inside(args)
    if not seeds_inside and getattr(args, "seeds", 1) < 1:
      raise ConfigError(f"--seeds {args.seeds}: must be at least 1")
  except ConfigError as e:
    print(f"error: {e}", file=sys.stderr)
    return 2
  global REUSE
  REUSE = bool(getattr(args, "reuse", False))  # for this command only: reset when it ends
  out_dir = os.path.dirname(args.out)
  if out_dir:
    os.makedirs(out_dir, exist_ok=True)
  t0 = time.perf_counter()
  try:
    if seeds_inside or getattr(args, "seeds", 1) == 1:
      experiment(args, cfg)
    else:
      over_seeds(name, args, cfg, experiment, keys, metrics, compare)
  except ConfigError as e:
    print(f"error: {e}", file=sys.stderr)
    return 2
  finally:
    REUSE = False
  print(f"[{name}] {time.perf_counter() - t0:.0f}s in all", flush=True)
  return 0


def over_seeds(name: str, args, cfg, experiment: Callable, keys, metrics,
               compare: tuple[str, str] | None = None) -> list[dict]:
  """The experiment at seeds cfg.seed, cfg.seed + 1, ...: each seed's runs, CSV and figure in
  `--workdir`/seed<s>; OUT.csv every seed's rows, OUT_seeds.csv `summarize`'s, OUT_paired.csv
  `paired`'s (with `compare`), OUT.png the first seed's figure."""
  rows = []
  for k in range(args.seeds):
    seeded = cfg.copy_and_resolve_references()
    seeded.seed = cfg.seed + k
    where = os.path.join(args.workdir, f"seed{seeded.seed}")
    os.makedirs(where, exist_ok=True)
    each = copy.copy(args)
    each.workdir, each.out = where, os.path.join(where, os.path.basename(args.out))
    print(f"[{name}] seed {seeded.seed} ({k + 1} of {args.seeds})", flush=True)
    rows += [{"seed": seeded.seed, **r} for r in experiment(each, seeded)]
    if k == 0 and os.path.exists(each.out + ".png"):
      shutil.copyfile(each.out + ".png", args.out + ".png")
  figures.write_csv(args.out + ".csv", rows)
  summary = summarize(rows, keys, metrics)
  figures.write_csv(args.out + "_seeds.csv", summary)
  columns = [(k, k, "") for k in keys] + [(f"{m}_text", m, "s") for m in metrics]
  print(f"[{name}] over {args.seeds} seeds (mean +- std, min-max; n: seeds with a value):")
  print(table(summary, columns, name))
  if compare:
    diffs = paired(rows, keys, metrics, *compare)
    figures.write_csv(args.out + "_paired.csv", diffs)
    print(f"[{name}] against {compare[0]}={compare[1]!r}, seed by seed (t intervals, 95%):")
    for d in diffs:
      print(f"[{name}]   {d['text']}")
  print(f"[{name}] wrote {args.out}.csv, {args.out}_seeds.csv"
        + (f", {args.out}_paired.csv" if compare else "")
        + (f", {args.out}.png (seed {cfg.seed})" if os.path.exists(args.out + ".png") else ""))
  return rows


def paired(rows: list[dict], keys, metrics, arm: str, baseline) -> list[dict]:
  """Per metric, per value of the other `keys` and per arm (the values of `arm` other than
  `baseline`): the difference arm - baseline over the seeds both have (`tools.stats.paired`), its
  t interval, p-value and verdict (no difference claimed where the interval holds 0)."""
  others = [k for k in keys if k != arm]
  out = []
  groups = sorted({tuple(r.get(k) for k in others) for r in rows}, key=str)
  for m in metrics:
    for g in groups:
      where = dict(zip(others, g))
      mine = [r for r in rows if all(r.get(k) == v for k, v in where.items())]
      base = {r["seed"]: r.get(m) for r in mine if r.get(arm) == baseline}
      if not base:
        continue
      for a in sorted({r.get(arm) for r in mine} - {baseline}, key=str):
        result = stats.paired({r["seed"]: r.get(m) for r in mine if r.get(arm) == a}, base)
        label = ", ".join(f"{k}={v}" for k, v in where.items())
        out.append({"metric": m, **where, "arm": a, "baseline": baseline,
                    **result.as_dict("diff"),
                    "text": f"{m}{f' ({label})' if label else ''}: "
                            + result.verdict(str(a), str(baseline), ".4g")})
  return out


def seed_mean(values: list[float]) -> float:
  """Mean over seeds; NaN where a seed diverged (a non-finite loss brackets like a diverged run)."""
  return sum(values) / len(values) if all(math.isfinite(v) for v in values) else math.nan


def best_cells(tuned: list[dict], runs: list[dict], arm: str, *, by=("batch_size",),
               choice=("lr_multiplier",)) -> list[dict]:
  """The runs (every seed) of each tuned arm's best cell: `tuned` holds one row per (`arm`,
  `by`) with the `choice` keys of its best cell."""
  key = lambda r: (r[arm], *(r[k] for k in by))
  best = {key(t): t for t in tuned}
  return [r for r in runs if (t := best.get(key(r))) and all(r[c] == t[c] for c in choice)]


def paired_tuned(tuned: list[dict], runs: list[dict], arm: str, baseline, *,
                 by=("batch_size",), choice=("lr_multiplier",),
                 metric: str = "final_eval_loss") -> list[dict]:
  """Each tuned arm against the baseline's tuned arm at the same `by` values, seed by seed
  (`paired`): `tuned` holds one row per (`arm`, `by`) with the `choice` keys of its best cell
  and whether its optimum is `interior`; `runs` every run, with its seed. No call where either
  arm's optimum is censored (the text says whose)."""
  best = {(t[arm], *(t[k] for k in by)): t for t in tuned}
  diffs = paired(best_cells(tuned, runs, arm, by=by, choice=choice), (arm, *by), (metric,), arm,
                 baseline)
  for d in diffs:
    where = tuple(d[k] for k in by)
    censored = [str(n) for n in (d["arm"], baseline) if not best[(n, *where)]["interior"]]
    d["called"] = not censored
    if censored:
      label = ", ".join(f"{k}={d[k]}" for k in by)
      d["text"] = (f"{metric} ({label}): {d['arm']} vs {baseline} not called: the best rate of "
                   f"{' and '.join(censored)} is at the edge of the rates run (difference "
                   f"{d['diff']:.4g} [{d['diff_lo']:.4g}, {d['diff_hi']:.4g}], not a tuned "
                   "comparison)")
  return diffs


def summarize(rows: list[dict], keys, metrics) -> list[dict]:
  """One row per distinct `keys` value: for each metric its number of seeds with a value, mean,
  sample std, min and max (None and NaN, e.g. a target not reached, are left out), and a text
  "mean +- std (min-max, n)"."""
  groups: dict[tuple, list[dict]] = {}
  for r in rows:
    groups.setdefault(tuple(r.get(k) for k in keys), []).append(r)
  out = []
  for key, group in groups.items():
    row = dict(zip(keys, key))
    for m in metrics:
      s = stats.spread(r.get(m) for r in group) or dict.fromkeys(
          ("mean", "std", "min", "max"), math.nan) | {"n": 0}
      row.update({f"{m}_{k}": s[k] for k in ("n", "mean", "std", "min", "max")})
      row[f"{m}_text"] = "-" if not s["n"] else (
          f"{s['mean']:.4g} +- {s['std']:.2g} ({s['min']:.4g}-{s['max']:.4g}, "
          f"{s['n']}/{len(group)})")
    out.append(row)
  return out


def table(rows: list[dict], columns: list[tuple[str, str, str]], prefix: str) -> str:
  """Fixed-width text table: columns are (key, header, format spec); None prints as '-'."""
  def cell(v, spec):
    return "-" if v is None or (isinstance(v, float) and math.isnan(v)) else format(v, spec)
  cells = [[h for _, h, _ in columns]] + [[cell(r.get(k), s) for k, _, s in columns]
                                          for r in rows]
  widths = [max(len(c[i]) for c in cells) for i in range(len(columns))]
  return "\n".join(f"[{prefix}] " + "  ".join(c.rjust(w) for c, w in zip(line, widths))
                   for line in cells)


def write(args, rows: list[dict], fields: list[str] | None = None) -> str:
  """The experiment's CSV at `<--out>.csv`; returns its path."""
  path = args.out + ".csv"
  figures.write_csv(path, rows, fields)
  return path

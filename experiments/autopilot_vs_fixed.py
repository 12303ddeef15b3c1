"""Batch autopilot vs fixed batches: tokens and optimizer steps to a target validation loss.

    python -m experiments.autopilot_vs_fixed [--batch_sizes 8,16,32,64,128,256] \\
        [--margins 2,1] [--targets 2.7,2.6,2.45] [--out docs/autopilot_vs_fixed]

Trains configs/sweep_tiny.py at each fixed batch (`tools.batch_sweep.run_one`) and with the
autopilot (`data.batch_ramp="auto"`, from the smallest batch up to the largest) at each margin,
every run until the lowest of `--targets` or `--max_examples`; the higher targets are read from
the same runs. Outputs: OUT.csv (one row per run and target), OUT.png (steps vs tokens to each
target; the autopilot's batch and B_simple over training). 3.2 minutes on 2 busy CPU cores;
deterministic on a given machine.
Claim, setup and results: docs/experiments.md#autopilot-vs-fixed-batches
"""
from __future__ import annotations

import argparse
import math
import os
import sys

from experiments import common
from tools import batch_sweep, figures


def build_parser():
  p = common.parser("autopilot_vs_fixed", __doc__)
  p.add_argument("--batch_sizes", type=common.ints, default="8,16,32,64,128,256",
                 help="fixed batches")
  p.add_argument("--margins", type=common.floats, default="2,1",
                 help="one autopilot run per margin")
  p.add_argument("--targets", type=common.floats, default="2.7,2.6,2.45",
                 help="validation losses; runs stop at the lowest, the others are read from "
                      "the same runs' records")
  common.add_to_target_args(p, max_examples=80_000)
  return p


def parse(argv):
  p = build_parser()
  args, overrides = p.parse(argv)
  common.parse_targets(p, args)
  if len(args.batch_sizes) < 2 or any(b % args.micro_batch_size for b in args.batch_sizes):
    p.error(f"--batch_sizes needs two or more multiples of --micro_batch_size="
            f"{args.micro_batch_size}")
  return args, overrides


def in_tokens(cfg, max_examples: int) -> None:
  """The config's warmup and horizon in tokens (the autopilot's unit; the same curve for a fixed
  batch): warmup_examples / warmup_steps become warmup_tokens."""
  o, seq = cfg.optim, cfg.data.seq_len
  if not o.warmup_tokens:
    examples = o.warmup_examples or o.warmup_steps * cfg.data.global_batch_size
    o.warmup_tokens = int(examples * seq)
  o.warmup_steps = o.warmup_examples = 0
  o.decay_steps = o.decay_examples = 0
  o.decay_tokens = o.decay_tokens or int(max_examples * seq)
  o.schedule_unit = "tokens"


def experiment(args, cfg) -> list[dict]:
  in_tokens(cfg, args.max_examples)
  cfg.data.batch_ramp = ""
  runs = []  # (name, kind, margin, tools.batch_sweep.Result)
  for batch in args.batch_sizes:
    r = batch_sweep.run_one(cfg, batch, 1.0, args, os.path.join(args.workdir, f"fixed_b{batch}"))
    runs.append((f"B={batch}", "fixed", None, r))
    report(runs[-1])
  auto_args = argparse.Namespace(**{**vars(args), "eval_examples": args.eval_examples // 2})
  for margin in args.margins:
    auto = cfg.copy_and_resolve_references()
    auto.data.batch_ramp = "auto"
    auto.data.batch_auto.update(max=args.batch_sizes[-1], margin=margin)
    r = batch_sweep.run_one(auto, args.batch_sizes[0], 1.0, auto_args,
                            os.path.join(args.workdir, f"auto_m{margin:g}"))
    runs.append((f"auto m={margin:g}", "auto", margin, r))
    report(runs[-1])
  rows = [row for run in runs for row in at_targets(*run, args.targets, args.smooth_examples,
                                                    cfg.data.seq_len)]
  common.write(args, rows)
  for target in args.targets:
    print(f"[autopilot] to eval loss {target}:")
    print(common.table([r for r in rows if r["target"] == target], COLUMNS, "autopilot"))
    for line in verdict([r for r in rows if r["target"] == target]):
      print(f"[autopilot]   {line}")
  plotted = plot(args.out + ".png", rows, runs, args.targets, cfg.data.seq_len)
  print(f"[autopilot] wrote {args.out}.csv" + (f", {args.out}.png" if plotted
                                                else figures.NO_PLOT))
  return rows


COLUMNS = [("run", "run", "s"), ("batch_at_target", "batch then", "d"),
           ("steps", "steps", ".1f"), ("tokens", "tokens", ",.0f"),
           ("examples", "sequences", ",.0f"), ("noise_scale", "B_simple", ".1f")]


def at_targets(name: str, kind: str, margin: float | None, r: batch_sweep.Result,
               targets: list[float], smooth_examples: float, seq_len: int) -> list[dict]:
  """One row per target: where the run's smoothed eval curve crossed it (`common.crossings`:
  examples, tokens and steps of the run's own record, the batch it had then, B_simple)."""
  return [{"run": name, "kind": kind, "margin": margin, "target": c["target"],
           "start_batch": r.batch_size, "learning_rate": r.learning_rate,
           **{k: c[k] for k in ("steps", "examples", "tokens", "batch_at_target", "noise_scale")},
           "final_batch": r.final_batch, "steps_run": r.steps_run,
           "final_eval_loss": r.final_eval_loss, "seconds": r.seconds}
          for c in common.crossings(r.workdir, r.batch_size, seq_len, targets, smooth_examples)]


def report(run) -> None:
  name, _, _, r = run
  where = (f"lowest target at step {r.steps:.1f}, {r.tokens:,.0f} tokens" if r.steps
           else f"lowest target not reached in {r.steps_run} steps")
  print(f"[autopilot] {name} (last batch {r.final_batch}): {where}; {r.seconds:.0f}s",
        flush=True)


def verdict(rows: list[dict]) -> list[str]:
  """Each autopilot run's tokens and steps as multiples of the best fixed batch's (which), at
  one target."""
  fixed = [r for r in rows if r["kind"] == "fixed" and r["steps"] is not None]
  if not fixed:
    return ["no fixed batch reached the target"]
  few_tokens = min(fixed, key=lambda r: r["tokens"])
  few_steps = min(fixed, key=lambda r: r["steps"])
  out = []
  for r in rows:
    if r["kind"] != "auto":
      continue
    if r["steps"] is None:
      out.append(f"{r['run']}: did not reach the target")
      continue
    out.append(f"{r['run']}: {r['tokens'] / few_tokens['tokens']:.2f}x the tokens of the most "
               f"frugal fixed batch ({few_tokens['run']}), {r['steps'] / few_steps['steps']:.2f}x "
               f"the steps of the fastest ({few_steps['run']})")
  return out


def plot(path: str, rows: list[dict], runs, targets: list[float], seq_len: int) -> bool:
  plt = figures.pyplot()
  if plt is None:
    return False
  fig, (ax1, ax2) = plt.subplots(1, 2, figsize=(12, 4.6))
  markers, labelled = "*Pd^v", set()
  for j, target in enumerate(targets):
    color = f"C{j}"
    fixed = [r for r in rows if r["target"] == target and r["kind"] == "fixed"
             and r["steps"] is not None]
    ax1.plot([r["tokens"] for r in fixed], [r["steps"] for r in fixed], "o-", c=color, ms=4,
             label=f"fixed batches, eval loss {target}")
    for r in fixed:
      ax1.annotate(str(r["start_batch"]), (r["tokens"], r["steps"]), fontsize=7, color=color,
                   textcoords="offset points", xytext=(3, 3))
    autos = [r for r in rows if r["target"] == target and r["kind"] == "auto"
             and r["steps"] is not None]
    for r in autos:
      i = sorted({x["margin"] for x in rows if x["kind"] == "auto"}).index(
          r["margin"])
      ax1.plot([r["tokens"]], [r["steps"]], markers[i % len(markers)], ms=11, c=color,
               mec="k", mew=0.6, label=None if i in labelled else
               f"autopilot, margin {r['margin']:g} (colour: target)")
      labelled.add(i)
  missing = sorted({r["start_batch"] for r in rows if r["kind"] == "fixed" and r["steps"] is None
                    and r["target"] == targets[-1]})
  ax1.set(xscale="log", yscale="log", xlabel="tokens to target", ylabel="steps to target",
          title="steps vs tokens to the target (labels: fixed batch)"
          + (f"\nnot reached at {targets[-1]}: B = {', '.join(map(str, missing))}" if missing
             else ""))
  ticker = plt.matplotlib.ticker
  reached = [r for r in rows if r["steps"] is not None]
  _log_ticks(ax1.xaxis, [r["tokens"] for r in reached], ticker,
             lambda v, _: f"{v / 1e6:g}M")
  _log_ticks(ax1.yaxis, [r["steps"] for r in reached], ticker, lambda v, _: f"{v:g}")
  ax1.legend(fontsize=7)
  for i, (name, kind, margin, r) in enumerate(x for x in runs if x[1] == "auto"):
    color = f"C{i + len(targets)}"
    run_rows = common.read_rows(r.workdir)
    ramp = common.ramp_from_rows(run_rows, r.batch_size, seq_len)
    steps = range(0, r.steps_run + 1)
    ax2.step([ramp.tokens_before(s) for s in steps], [ramp.batch_at(s) for s in steps],
             where="post", c=color, lw=2, label=f"batch, margin {margin:g}")
    noise = [(ramp.tokens_before(x["step"]), x["noise_scale"]) for x in run_rows
             if "noise_scale" in x]
    if noise:
      ax2.plot(*zip(*noise), c=color, lw=0.8, alpha=0.7, ls="--",
               label=f"smoothed B_simple, margin {margin:g}")
    for target in targets:
      hit = [x for x in rows if x["run"] == name and x["target"] == target and x["tokens"]]
      if hit:
        ax2.axvline(hit[0]["tokens"], c=color, lw=0.6, ls=":")
  ax2.set(yscale="log", xlabel="tokens seen", ylabel="sequences",
          title="the autopilot's batch and B_simple (dotted: targets reached)")
  _log_ticks(ax2.yaxis, [1, 2 * max(r["final_batch"] for r in rows)], ticker,
             lambda v, _: f"{v:g}", steps=(1, 2))
  ax2.legend(fontsize=7)
  figures.save(fig, path, "Batch autopilot vs fixed batches (sweep_tiny, embedded corpus)")
  return True


def _log_ticks(axis, values, ticker, fmt, steps=(1, 2, 5)) -> None:
  """Plain-number ticks at 1, 2, 5 x 10^k (or `steps`) over the range of `values`."""
  lo, hi = min(values), max(values)
  ticks = [m * 10 ** k for k in range(int(math.floor(math.log10(lo))) - 1,
                                      int(math.ceil(math.log10(hi))) + 1) for m in steps]
  if steps == (1, 2):  # powers of two instead
    ticks = [2 ** k for k in range(0, int(math.log2(hi)) + 1)]
  axis.set_major_locator(ticker.FixedLocator([t for t in ticks if lo / 1.5 <= t <= hi * 1.5]))
  axis.set_major_formatter(ticker.FuncFormatter(fmt))
  axis.set_minor_formatter(ticker.NullFormatter())


def main(argv: list[str]) -> int:
  return common.main("autopilot", parse, experiment, argv, keys=("run", "target"),
                     metrics=("steps", "tokens", "examples", "noise_scale", "batch_at_target"))


if __name__ == "__main__":
  sys.exit(main(sys.argv[1:]))

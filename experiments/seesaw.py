"""Seesaw against cosine and step decay at equal tokens, and the critical batch over training by
branching, next to the gradient noise scale and the critical-batch sweep.

    python -m experiments.seesaw [--examples 16384] [--batch 16] [--max_batches 32,128] \\
        [--at 50,100,200,400,800] [--factors 2,4,8] [--probe_tokens 65536] [--b_crit 0] \\
        [--out docs/seesaw]

Part 1 trains configs/sweep_tiny.py at `--batch` under cosine, its step decay, and Seesaw
(`data.batch_ramp="seesaw"`) up to each of `--max_batches`, the largest also with the linear
rule. Part 2 branches one run at `--factors` x its batch from its checkpoints at `--at`
(tools/batch_probe.py). Outputs: OUT.csv and OUT.png (part 1), OUT_probe.{csv,json,png} (part
2) and OUT_probe_ramp.txt (the implied ramp as config overrides, when the measurements imply
one). 13 minutes on 2 busy CPU cores; deterministic on a given machine.
Setup and results: docs/experiments.md#seesaw-and-the-critical-batch-by-branching
"""
from __future__ import annotations

import argparse
import csv
import math
import os
import shutil
import sys

from experiments import common
from tools import batch_probe, figures


def build_parser():
  p = common.parser("seesaw", __doc__)
  p.add_argument("--examples", type=int, default=16384, help="part 1's budget in sequences")
  p.add_argument("--batch", type=int, default=16, help="part 1's starting batch B0")
  p.add_argument("--max_batches", type=common.ints, default="32,128",
                 help="one Seesaw run per largest batch")
  p.add_argument("--micro_batch_size", type=int, default=8)
  p.add_argument("--eval_examples", type=int, default=512,
                 help="sequences between evaluations (part 1)")
  p.add_argument("--eval_sequences", type=int, default=256, help="validation sequences")
  p.add_argument("--at", type=common.ints, default="50,100,200,400,800",
                 help="part 2's branch points (steps of the sweep_tiny run)")
  p.add_argument("--factors", type=common.ints, default="2,4,8")
  p.add_argument("--probe_tokens", type=int, default=65536, help="tokens each branch trains")
  p.add_argument("--b_crit", type=float, default=0.0,
                 help="the critical-batch sweep's B_crit to draw (0: none)")
  p.add_argument("--skip", choices=("seesaw", "probe"), default=None,
                 help="run one part only")
  return p


def parse(argv):
  p = build_parser()
  args, overrides = p.parse(argv)
  b0 = args.batch
  bad = [m for m in args.max_batches if m <= b0 or b0 * 2 ** round(math.log2(m / b0)) != m]
  if bad:
    p.error(f"--max_batches: {bad[0]} is not {b0} x 2^k with k >= 1")
  if args.examples % b0 or b0 % args.micro_batch_size:
    p.error("--examples must be a multiple of --batch, and --batch of --micro_batch_size")
  return args, overrides


def runs(args) -> list[tuple[str, dict]]:
  """(name, config values) of part 1's runs."""
  top = max(args.max_batches)
  out = [("cosine", {}),
         ("step decay", {"data.batch_ramp": "seesaw", "data.max_batch": args.batch})]
  out += [(f"seesaw {m}", {"data.batch_ramp": "seesaw", "data.max_batch": m})
          for m in args.max_batches]
  out.append((f"seesaw {top}, linear rule", {"data.batch_ramp": "seesaw", "data.max_batch": top,
                                             "optim.lr_rule": "linear"}))
  return out


def part1_config(cfg, args, values: dict):
  c = common.at_budget(cfg, args.batch, args.examples, micro=args.micro_batch_size,
                       evals=max(1, args.examples // args.eval_examples),
                       eval_sequences=args.eval_sequences)
  c.optim.update(schedule="cosine", min_lr_ratio=0.1, decay_steps=0, decay_examples=0,
                 decay_tokens=0)
  c.log_every = 1  # every step's rate and batch (the figure's right panel)
  for key, value in values.items():
    node, *path = key.split(".")
    c[node][path[0]] = value
  return c


def seesaw_part(args, cfg) -> list[dict]:
  rows, curves = [], {}
  for name, values in runs(args):
    c = part1_config(cfg, args, values)
    t = common.train(c, os.path.join(args.workdir, name.replace(" ", "_").replace(",", "")))
    seq = c.data.seq_len
    evals = [(x * seq, y) for x, y in common.eval_curve(t.rows, t.ramp)]
    steps = [(r["step"], r["eval_loss"]) for r in t.rows if "eval_loss" in r]
    lrs = [(t.ramp.tokens_before(r["step"] - 1), r["learning_rate"], t.ramp.batch_at(r["step"] - 1))
           for r in t.rows if "learning_rate" in r]
    curves[name] = (evals, steps, lrs)
    rows.append({"run": name, "max_batch": values.get("data.max_batch", args.batch),
                 "lr_rule": values.get("optim.lr_rule", c.optim.lr_rule),
                 "steps": t.steps_run, "tokens": t.ramp.tokens_before(t.steps_run),
                 "final_batch": t.ramp.batch_at(t.steps_run - 1),
                 "final_eval_loss": t.final_eval, "seconds": t.seconds})
    print(f"[seesaw] {name}: {t.steps_run} steps, {rows[-1]['tokens']:,} tokens, final eval "
          f"{t.final_eval:.4f}; {t.seconds:.0f}s", flush=True)
  base = rows[0]
  for r in rows:
    r["steps_saved"] = 1 - r["steps"] / base["steps"]
    r["loss_minus_cosine"] = r["final_eval_loss"] - base["final_eval_loss"]
  common.write(args, rows)
  print(common.table(rows, COLUMNS, "seesaw"))
  plotted = plot(args.out + ".png", rows, curves, args)
  print(f"[seesaw] wrote {args.out}.csv" + (f", {args.out}.png" if plotted else figures.NO_PLOT))
  return rows


COLUMNS = [("run", "run", "s"), ("steps", "steps", "d"), ("steps_saved", "steps saved", ".0%"),
           ("tokens", "tokens", ",d"), ("final_batch", "last batch", "d"),
           ("final_eval_loss", "final eval loss", ".4f"),
           ("loss_minus_cosine", "- cosine's", "+.4f"), ("seconds", "seconds", ".0f")]


def plot(path: str, rows: list[dict], curves: dict, args) -> bool:
  plt = figures.pyplot()
  if plt is None:
    return False
  fig, (ax1, ax2, ax3) = plt.subplots(1, 3, figsize=(15, 4.4))
  low = min(y for evals, _, _ in curves.values() for _, y in evals)
  for i, r in enumerate(rows):
    evals, steps, lrs = curves[r["run"]]
    style = dict(c=f"C{i}", lw=1.2, label=r["run"])
    ax1.plot(*zip(*evals), **style)
    ax2.plot(*zip(*steps), **style)
    ax3.plot([t for t, _, _ in lrs], [lr for _, lr, _ in lrs], **style)
  for ax in (ax1, ax2):
    ax.set(ylabel="eval loss", ylim=(low - 0.03, low + 0.6))
  ax1.set(xlabel="tokens", title="eval loss against tokens")
  ax2.set(xlabel="optimizer steps (serial)", title="eval loss against steps")
  ax3.set(xlabel="tokens", ylabel="learning rate", yscale="log",
          title="rate (each Seesaw doubling: a cut by 1/sqrt 2)")
  ax1.legend(fontsize=7)
  figures.save(fig, path, f"Seesaw vs cosine and step decay at {args.examples:,} sequences "
               f"(sweep_tiny, batch {args.batch} at the start)")
  return True


def probe_part(args, cfg) -> list[dict]:
  """The sweep_tiny run with checkpoints at the branch points, then the probe; its branches."""
  run = cfg.copy_and_resolve_references()
  every = math.gcd(*args.at)
  run.steps = max(args.at)
  run.eval_every = 0
  run.checkpoint.update(every_steps=every, keep=run.steps // every + 1)
  run.trainer.progress_bar = False
  run_dir = os.path.join(args.workdir, os.path.splitext(os.path.basename(args.config))[0])
  t = common.train(run, run_dir, keep_checkpoints=True)
  print(f"[seesaw] the run to branch from: {t.steps_run} steps at batch "
        f"{run.data.global_batch_size}; {t.seconds:.0f}s", flush=True)
  out = args.out + "_probe"
  argv = ["--workdir", run_dir, "--at", ",".join(map(str, args.at)),
          "--factors", ",".join(map(str, args.factors)), "--tokens", str(args.probe_tokens),
          "--eval_sequences", str(args.eval_sequences), "--b_crit", str(args.b_crit),
          "--out", out + "_files", "--ramp"]
  if batch_probe.main(argv) != 0:
    raise RuntimeError("the probe failed (its error is above)")
  for name, target in (("batch_probe.csv", out + ".csv"), ("batch_probe.json", out + ".json"),
                       ("batch_probe.png", out + ".png"), ("ramp_overrides.txt",
                                                           out + "_ramp.txt")):
    if os.path.exists(os.path.join(out + "_files", name)):
      shutil.copyfile(os.path.join(out + "_files", name), target)
  shutil.rmtree(out + "_files", ignore_errors=True)
  print(f"[seesaw] wrote {out}.csv, {out}.json, {out}.png", flush=True)
  with open(out + ".csv") as f:
    return list(csv.DictReader(f))


def experiment(args: argparse.Namespace, cfg) -> list[dict]:
  """Part 1's rows and part 2's branches (`part` says which)."""
  rows = []
  if args.skip != "seesaw":
    rows += [{"part": "seesaw", **r} for r in seesaw_part(args, cfg)]
  if args.skip != "probe":
    rows += [{"part": "probe", **r} for r in probe_part(args, cfg)]
  return rows


def main(argv: list[str]) -> int:
  return common.main("seesaw", parse, experiment, argv,
                     keys=("part", "run", "at_step", "factor"),
                     metrics=("steps", "final_eval_loss", "loss_minus_cosine", "smoothed_loss",
                              "critical_batch", "b_simple"), compare=("run", "cosine"))


if __name__ == "__main__":
  sys.exit(main(sys.argv[1:]))

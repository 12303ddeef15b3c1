"""WSD vs cosine vs the Power scheduler at equal tokens, and WSD's decay branched from several
points of one stable phase (one run, several endings).

    python -m experiments.schedules [--examples 32768] [--branches 0.25,0.5,0.75,1] \\
        [--decay_fraction 0.2] [--out docs/schedules]

configs/sweep_tiny.py at batch 16 trains `--examples` sequences under cosine and Power, and one
stable WSD run checkpointed at each branch point, from which each WSD ending restores a copy and
decays over the last `--decay_fraction`; the branch's rate is checked against the stable run's
logged rate at every logged step. Outputs: OUT.csv (one row per run), OUT.png (eval loss vs
tokens of every run; final loss vs tokens of the WSD branches beside cosine and power at T).
14 minutes on 2 busy CPU cores; deterministic on a given machine. Claims, setup and results:
docs/experiments.md#wsd-vs-cosine-vs-power-and-wsd-branches-from-one-stable-phase
"""
from __future__ import annotations

import math
import os
import sys

import numpy as np

from experiments import common
from tools import figures
from trainer.run.inprocess import copy_checkpoint


def build_parser():
  p = common.parser("schedules", __doc__)
  p.add_argument("--examples", type=int, default=32768, help="the budget T in sequences")
  p.add_argument("--branches", type=common.floats, default="0.25,0.5,0.75,1",
                 help="WSD runs end at these fractions of T (each decays over the last "
                      "decay_fraction x T)")
  p.add_argument("--decay_fraction", type=float, default=0.2)
  common.add_budget_args(p, evals=32, eval_sequences=256, evals_help="evaluations over T")
  return p


def parse(argv):
  p = build_parser()
  args, overrides = p.parse(argv)
  args.branches = sorted(args.branches)
  if not 0 < args.decay_fraction < min(args.branches) or max(args.branches) > 1:
    p.error(f"--branches must be in ({args.decay_fraction}, 1], above --decay_fraction")
  return args, overrides


def branch_points(examples: int, batch: int, ends: list[float], decay_fraction: float):
  """[(stop step of the stable phase, decay steps, end step)] of WSD runs ending at each
  fraction of the budget, all decaying over the same decay_fraction x budget."""
  total = examples // batch
  decay = round(total * decay_fraction)
  out = []
  for end in ends:
    stop = round(total * end) - decay
    if stop <= 0:
      raise ValueError(f"a WSD run ending at {end} x T has no stable phase")
    out.append((stop, decay, stop + decay))
  return out


def branch_schedule(optim_cfg, stop_tokens: int, decay_tokens: int) -> None:
  """Make `optim_cfg` the WSD schedule whose decay starts at `stop_tokens` and lasts
  `decay_tokens` (the horizon and decay fraction of a branch)."""
  horizon = stop_tokens + decay_tokens
  optim_cfg.update(schedule="wsd", decay_tokens=horizon, wsd_decay_fraction=decay_tokens / horizon)


def base_config(cfg, args, steps: int):
  """`cfg` trained for `steps` steps at its batch, schedules in tokens with T's horizon, evaluated
  every T / evals (the same steps in every run)."""
  c = common.at_budget(cfg, cfg.data.global_batch_size, steps * cfg.data.global_batch_size,
                       micro=args.micro_batch_size, evals=args.evals,
                       eval_sequences=args.eval_sequences)
  tokens = args.examples * c.data.seq_len
  c.eval_every = max(1, (args.examples // c.data.global_batch_size) // args.evals)
  c.optim.update(schedule_unit="tokens", warmup_steps=0, warmup_examples=0, decay_steps=0,
                 decay_examples=0, warmup_tokens=int(cfg.optim.warmup_examples * c.data.seq_len
                                                     or cfg.optim.warmup_tokens),
                 decay_tokens=tokens, lr_rule="none", reference_batch_size=0,
                 wsd_decay_shape="sqrt", min_lr_ratio=0.1)
  return c


def power_a(peak: float, batch: int, warmup_tokens: float, b: float) -> float:
  """The Power law's `a` that meets `peak` at the end of the warmup: peak = batch a n_w^b."""
  return peak / (batch * warmup_tokens ** b)


def schedule_values(cfg, steps: int) -> list[float]:
  """The learning rate the config's schedule gives at steps 0 .. steps-1 (float32)."""
  from optim.ramp import BatchRamp  # noqa: PLC0415  start-up
  from optim.schedules import build_schedule  # noqa: PLC0415  start-up
  ramp = BatchRamp.from_config(cfg.data)
  sched = build_schedule(cfg.optim, cfg.steps, ramp, batch_size=cfg.data.global_batch_size)
  return [float(np.float32(sched(n))) for n in range(steps)]


def experiment(args, cfg) -> list[dict]:
  batch, seq = cfg.data.global_batch_size, cfg.data.seq_len
  total = args.examples // batch
  rows, curves = [], {}

  def record(name, t, kind, end_step, stop=None):
    curve = [(x * seq, y) for x, y in common.eval_curve(t.rows, t.ramp)]
    curves[name] = curve
    rows.append({"run": name, "schedule": kind, "stable_steps": stop,
                 "stable_tokens": None if stop is None else t.ramp.tokens_before(stop),
                 "end_step": end_step,
                 "tokens": t.ramp.tokens_before(end_step), "final_eval_loss": curve[-1][1],
                 "seconds": t.seconds})
    print(f"[schedules] {name}: final eval {curve[-1][1]:.4f} at {rows[-1]['tokens']:,} tokens; "
          f"{t.seconds:.0f}s", flush=True)

  for kind in ("cosine", "power"):
    c = base_config(cfg, args, total)
    c.optim.schedule = kind
    if kind == "power":
      c.optim.update(power_a=power_a(float(c.optim.learning_rate), batch,
                                     c.optim.warmup_tokens, c.optim.power_b),
                     wsd_decay_fraction=args.decay_fraction)
    record(kind, common.train(c, os.path.join(args.workdir, kind)), kind, total)

  points = branch_points(args.examples, batch, args.branches, args.decay_fraction)
  stable = base_config(cfg, args, points[-1][0])
  stable.optim.update(schedule="constant")
  stable.checkpoint.update(every_steps=0, keep=len(points) + 1)
  stable_dir = os.path.join(args.workdir, "wsd_stable")
  t_stable = train_stable(stable, stable_dir, [s for s, _, _ in points])
  stable_lr = {r["step"]: r["learning_rate"] for r in t_stable.rows if "learning_rate" in r}
  for stop, decay, end in points:
    c = base_config(cfg, args, end)
    branch_schedule(c.optim, stop * batch * seq, decay * batch * seq)
    want = schedule_values(c, stop)
    got = [stable_lr[s] for s in range(1, stop + 1) if s in stable_lr]
    mismatch = [s for s in range(1, stop + 1) if s in stable_lr and stable_lr[s] != want[s - 1]]
    if mismatch or not got:
      raise RuntimeError(f"branch at step {stop}: its schedule differs from the stable run's "
                         f"learning rate at steps {mismatch[:5]}")
    workdir = os.path.join(args.workdir, f"wsd_branch_{stop}")
    copy_checkpoint(stable_dir, stop, workdir)
    t = common.train(c, workdir, fresh=False)
    t.rows = [r for r in t_stable.rows if r.get("step", 0) <= stop and "event" not in r] + \
        [r for r in t.rows if r.get("step", 0) > stop]
    record(f"wsd to {end * batch * seq / 1e6:.2f}M tokens", t, "wsd", end, stop)
  cosine = next(r["final_eval_loss"] for r in rows if r["run"] == "cosine")
  for r in rows:  # against the same seed's cosine: what a spread over seeds compares
    r["loss_minus_cosine"] = r["final_eval_loss"] - cosine
  common.write(args, rows)
  print(common.table(rows, COLUMNS, "schedules"))
  plotted = plot(args.out + ".png", rows, curves, t_stable, seq)
  print(f"[schedules] wrote {args.out}.csv" + (f", {args.out}.png" if plotted
                                               else figures.NO_PLOT))
  return rows


def train_stable(cfg, workdir: str, stops: list[int]):
  """The stable phase, run up to each stop in turn (a checkpoint at every stop: each leg resumes
  the previous one, as a restarted run does, and ends with a save)."""
  t = None
  for i, stop in enumerate(stops):
    leg = cfg.copy_and_resolve_references()
    leg.steps = stop
    t = common.train(leg, workdir, fresh=i == 0, keep_checkpoints=True)
  return t


COLUMNS = [("run", "run", "s"), ("stable_steps", "stable steps", "d"),
           ("end_step", "steps", "d"), ("tokens", "tokens", ",d"),
           ("final_eval_loss", "final eval loss", ".4f"), ("seconds", "seconds", ".0f")]


def plot(path: str, rows: list[dict], curves: dict, t_stable, seq: int) -> bool:
  plt = figures.pyplot()
  if plt is None:
    return False
  fig, (ax1, ax2) = plt.subplots(1, 2, figsize=(11, 4.3))
  stable = [(x * seq, y) for x, y in common.eval_curve(t_stable.rows, t_stable.ramp)]
  ax1.plot(*zip(*stable), c="0.6", lw=1, label="WSD stable phase (constant lr)")
  for i, r in enumerate(rows):
    curve = curves[r["run"]]
    if r["schedule"] == "wsd":  # the decay only: the stable part is the grey curve
      curve = [(x, y) for x, y in curve if x >= r["stable_tokens"]]
    ax1.plot(*zip(*curve), lw=1.2, c=f"C{i}", label=r["run"])
  finite = [y for c in curves.values() for _, y in c if math.isfinite(y)]
  ax1.set(xlabel="tokens", ylabel="eval loss", ylim=(min(finite) - 0.05, min(finite) + 0.8),
          title="eval loss")
  ax1.legend(fontsize=7)
  wsd = [r for r in rows if r["schedule"] == "wsd"]
  ax2.plot([r["tokens"] for r in wsd], [r["final_eval_loss"] for r in wsd], "o-", c="C2",
           label="WSD branches of one stable run")
  for j, kind in enumerate(("cosine", "power")):
    for r in rows:
      if r["schedule"] == kind:
        ax2.plot([r["tokens"]], [r["final_eval_loss"]], "s^"[j], ms=9, c=f"C{j}",
                 label=f"{kind} (full budget)")
  ax2.set(xlabel="tokens", ylabel="final eval loss", title="final loss vs tokens")
  ax2.legend(fontsize=8)
  figures.save(fig, path, "Schedules at equal tokens, and WSD branched from one stable phase "
               "(sweep_tiny, batch 16)")
  return True


def main(argv: list[str]) -> int:
  return common.main("schedules", parse, experiment, argv, keys=("run",),
                     metrics=("final_eval_loss", "loss_minus_cosine"), compare=("run", "cosine"))


if __name__ == "__main__":
  sys.exit(main(sys.argv[1:]))

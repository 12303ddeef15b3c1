"""Critical-batch sweep: steps and examples to a target loss (or error: `--target_metric`) at
several batch sizes, the fit of McCandlish et al. 2018, and the measured gradient noise scale.

    python -m tools.batch_sweep --config configs/sweep_tiny.py --batch_sizes 8,16,32,64,128 \\
        --target_loss 2.6 [--lr_grid 0.5,1,2] [--max_extensions 4] [--out runs/batch_sweep] \\
        [--curve ema] [--reuse] [--config.KEY=VALUE ...]

One training per batch and rate multiplier, stopped at the target. Per batch the rate grid grows
beyond any winning edge (`tools.tradeoff.bracket`; a run that never reaches the target brackets)
until the fastest rate is inside; only then S(B) = S_min + E_min / B is fitted, with residuals,
local slopes, B_crit on narrower windows and the residual interval. Outputs in `--out`:
batch_sweep.csv (a row per run), batch_sweep.json, batch_sweep.png (matplotlib, the `tools`
extra) and each run's workdir. Method: docs/batch_size.md#critical-batch-sweep
"""
from __future__ import annotations

import dataclasses
import json
import math
import os
import sys
import time

import numpy as np

from tools import figures, sweep_seeds
from tools.tradeoff import Fit, bracket, fit_tradeoff, interior, local_slopes, window_sensitivity
from trainer.config import ConfigError
from trainer.config.cli import CliParser, floats, ints, load
from trainer.multihost import platforms
from trainer.run.inprocess import train
from trainer.tracking.record import (eval_curve, interpolate, noise_curve, read_rows, smooth,
                                     target_stop, to_target)

# ------------------------------------------------------------------------------------------------
# Running


@dataclasses.dataclass
class Result:
  batch_size: int
  lr_multiplier: float
  learning_rate: float
  steps: float | None  # interpolated steps to the target (None: not reached)
  examples: float | None
  tokens: float | None
  noise_scale: float | None  # B_simple (sequences) when the target was reached
  micro_batches: int  # per step: the estimator's small batches
  final_eval_loss: float | None
  steps_run: int
  seconds: float
  workdir: str
  best: bool = False
  final_batch: int = 0  # the batch of the last stage (the start batch unless it grew)
  lr_interior: bool | None = None  # the best run of its batch: its rate inside the grid run


def run_config(base_cfg, batch_size: int, lr_multiplier: float, args):
  """The config `run_one` trains: `base_cfg` at `batch_size` (micro-batches of
  `args.micro_batch_size`), the stated rate x `lr_multiplier`, `args.max_examples` sequences,
  evaluated every `args.eval_examples` on `args.eval_sequences`, the meter on every step, no
  checkpoints."""
  from optim.scaling import stated  # noqa: PLC0415  start-up

  cfg = base_cfg.copy_and_resolve_references()
  micro = args.micro_batch_size
  cfg.data.global_batch_size = batch_size
  cfg.data.micro_batch_size = micro if micro < batch_size or cfg.data.batch_ramp else 0
  # The stated rate, or the optimizer's own default when the config leaves it unset.
  cfg.optim.learning_rate = stated(base_cfg.optim)["learning_rate"][0] * lr_multiplier
  cfg.steps = max(1, math.ceil(args.max_examples / batch_size))
  cfg.eval_every = max(1, round(args.eval_examples / batch_size))
  cfg.eval_sequences = args.eval_sequences
  # the meter measures every step (its window: the config's); a step of one sequence has no
  # two small batches to measure with
  cfg.optim.noise_scale_every = 1 if batch_size >= 2 else 0
  cfg.checkpoint.every_steps = 0
  cfg.trainer.progress_bar = False
  return cfg


def run_one(base_cfg, batch_size: int, lr_multiplier: float, args, workdir: str) -> Result:
  """One training starting at `batch_size` (under `data.batch_ramp="auto"` the autopilot may
  grow it), stopped at the target (once `args.min_examples` are seen, if it has that) or after
  `args.max_examples`; returns what it measured. `args.curve` "ema" (if it has that): the target
  is read on the parameter EMA's eval curve (the config must set optim.ema_decay).
  Examples, tokens and steps come from the run's record (its batch changes), not step x batch.
  With `args.reuse` a run that finished in `workdir` with the same config and stop rule is read
  back instead of trained (a killed sweep resumes by run)."""
  from optim import derive  # noqa: PLC0415  start-up

  cfg = run_config(base_cfg, batch_size, lr_multiplier, args)
  micro, target = args.micro_batch_size, args.target_loss
  key = getattr(args, "target_metric", "eval_loss")
  key += "_ema" if getattr(args, "curve", "raw") == "ema" else ""
  smoothing, least = args.smooth_examples, getattr(args, "min_examples", 0)
  stop = lambda run: target_stop(target, smoothing, run.ramp.examples_before, args.max_examples,
                                 least, key)
  stop_key = json.dumps({"target_stop": [target, smoothing, args.max_examples, least, key]})
  trained = train(cfg, workdir, stop=stop, stop_key=stop_key, reuse=getattr(args, "reuse", False))
  rows, ramp = trained.rows, trained.ramp
  reached = to_target(eval_curve(rows, ramp, key), ramp, target, args.smooth_examples)
  first = smooth(eval_curve(rows, ramp, key), args.smooth_examples / 2)
  if reached is not None and first and reached.examples == first[0][0]:
    print(f"[sweep] warning: batch {batch_size} was below the target at its first smoothed "
          f"point ({reached.examples:,.0f} examples): the target is too easy to resolve",
          flush=True)
  steps = None if reached is None else reached.steps
  hp = derive(cfg.optim, batch_size, batch_size)
  noise = interpolate(noise_curve(rows), steps) if steps is not None else None
  return Result(batch_size, lr_multiplier, hp.learning_rate, steps,
                None if reached is None else reached.examples,
                None if reached is None else reached.tokens,
                noise, max(1, batch_size // micro), trained.final_eval, trained.steps_run,
                trained.seconds, workdir, final_batch=ramp.batches[-1])


TARGET_METRICS = ("eval_loss", "eval_error", "eval_masked_error")  # record.ERROR_OF
MIN_MICRO_BATCHES = 4  # runs whose noise scale the summary trusts (if there are any)


def summarise(results: list[Result], require_interior: bool = False
              ) -> tuple[list[Result], Fit | None, dict]:
  """Best run per batch (fewest steps; `lr_interior` set on it), the fit over those that reached
  the target, and a summary dict. `require_interior`: no fit where a batch's best rate is at
  the edge of the rates it ran (the summary's `censored` names those batches)."""
  best: dict[int, Result] = {}
  for r in results:
    if r.steps is None:
      continue
    if r.batch_size not in best or r.steps < best[r.batch_size].steps:
      best[r.batch_size] = r
  for r in results:
    r.best = best.get(r.batch_size) is r
  for b, r in best.items():
    r.lr_interior = interior({x.lr_multiplier: x.steps for x in results if x.batch_size == b})
  chosen = [best[b] for b in sorted(best)]
  fit = None
  censored = [r.batch_size for r in chosen if not r.lr_interior]
  summary: dict = {"reached": [r.batch_size for r in chosen],
                   "not_reached": sorted({r.batch_size for r in results} - set(best)),
                   "censored": censored}
  if len(chosen) >= 2 and not (require_interior and censored):
    b, steps = [r.batch_size for r in chosen], [r.steps for r in chosen]
    fit = fit_tradeoff(b, steps)
    summary.update(s_min=fit.s_min, e_min=fit.e_min, b_crit=fit.b_crit, fit_note=fit.note,
                   b_crit_lo=fit.b_crit_lo, b_crit_hi=fit.b_crit_hi,
                   residuals=dict(zip(b, fit.residuals)), local_slopes=local_slopes(b, steps),
                   window_b_crit=window_sensitivity(b, steps))
  # The small-batch squared norm is averaged over a step's micro-batches: with few of them
  # (a single batch split in two halves) the estimate is far noisier, so prefer runs with many.
  measured = [r for r in chosen if r.noise_scale is not None]
  many = [r for r in measured if r.micro_batches >= MIN_MICRO_BATCHES]
  noise = [r.noise_scale for r in (many or measured)]
  if noise:
    summary["b_simple_from"] = [r.batch_size for r in (many or measured)]
    summary.update(b_simple_median=float(np.median(noise)),
                   b_simple_range=[float(min(noise)), float(max(noise))])
  return chosen, fit, summary


def write_csv(path: str, results: list[Result]) -> None:
  figures.write_csv(path, [dataclasses.asdict(r) for r in results],
                    [f.name for f in dataclasses.fields(Result)])


def plot(path: str, results: list[Result], chosen: list[Result], fit: Fit | None,
         summary: dict, target: float, title: str) -> bool:
  """Two panels: steps to target vs batch with the fit; B_simple over training. False if
  matplotlib is missing."""
  plt = figures.pyplot()
  if plt is None:
    return False
  if not chosen:
    return False
  fig, (ax1, ax2) = plt.subplots(1, 2, figsize=(11, 4.2))
  other = [r for r in results if r.steps is not None and not r.best]
  if other:
    ax1.scatter([r.batch_size for r in other], [r.steps for r in other], c="0.7", s=18,
                label="other learning rates")
  ax1.scatter([r.batch_size for r in chosen], [r.steps for r in chosen], c="C0", zorder=3,
              label=f"measured ({summary.get('target_metric', 'eval_loss')} {target})")
  if fit is not None:
    bs = np.geomspace(min(r.batch_size for r in chosen) / 2, max(r.batch_size for r in chosen) * 2)
    ax1.plot(bs, fit.steps(bs), "C1-", label=(f"S_min(1 + B_crit/B): S_min={fit.s_min:.0f}, "
                                              f"B_crit={fit.b_crit:.0f}"))
    if fit.s_min > 0:
      ax1.axhline(fit.s_min, color="C1", ls=":", lw=1)
      ax1.axvline(fit.b_crit, color="C1", ls="--", lw=1)
  if "b_simple_median" in summary:
    ax1.axvline(summary["b_simple_median"], color="C2", ls="--", lw=1,
                label=f"B_simple at target (median {summary['b_simple_median']:.0f})")
  ax1.set(xscale="log", yscale="log", xlabel="batch size (sequences)",
          ylabel="steps to target", title="steps to the target")
  ax1.legend(fontsize=8)
  drawn = False
  for i, r in enumerate(chosen):
    curve = [(s, v) for s, v in noise_curve(read_rows(r.workdir))
             if v is not None and math.isfinite(v) and v > 0]  # rows without a value left out
    if curve:
      drawn = True
      xs = [s * r.batch_size for s, _ in curve]
      ax2.plot(xs, [v for _, v in curve], color=f"C{i % 10}", lw=1, label=f"B={r.batch_size}")
      if r.examples is not None and r.noise_scale is not None:
        ax2.plot([r.examples], [r.noise_scale], "o", color=f"C{i % 10}", ms=4)
  if fit is not None and fit.s_min > 0:
    ax2.axhline(fit.b_crit, color="C1", ls="--", lw=1, label="fitted B_crit")
  ax2.set(xlabel="examples seen (sequences)", ylabel="B_simple (sequences)",
          title="gradient noise scale during training (dots: at target)"
          if drawn else "no noise scale logged (optim.noise_scale_every, log_every)")
  if drawn:
    ax2.set(xscale="log", yscale="log")
    ax2.legend(fontsize=7, ncol=2)
  figures.save(fig, path, title)
  return True


# ------------------------------------------------------------------------------------------------
# CLI


def build_parser():
  p = CliParser("-m tools.batch_sweep", __doc__)
  p.add_argument("--batch_sizes", type=ints, required=True,
                 help="comma-separated, e.g. 8,16,32,64")
  p.add_argument("--target_loss", type=float, required=True,
                 help="the value of --target_metric to fall to (a validation loss, or an error)")
  p.add_argument("--target_metric", default="eval_loss", choices=TARGET_METRICS,
                 help="the eval curve read: eval_loss, or 1 - accuracy (eval_error: the "
                      "classifier's; eval_masked_error: the masked LM's)")
  p.add_argument("--curve", default="raw", choices=("raw", "ema"),
                 help="read the target on the raw eval curve or on the parameter EMA's (Zhang et "
                      "al.'s EWA: --config.optim.ema_decay, e.g. 0.99)")
  p.add_argument("--lr_grid", type=floats, default="0.5,1,2",
                 help="multipliers of the reference learning rate to start from; a batch whose "
                      "fastest rate is at an edge runs the next multiplier beyond it")
  p.add_argument("--bracket_factor", type=float, default=2.0,
                 help="the step of the rate grid's extension beyond a winning edge")
  p.add_argument("--max_extensions", type=int, default=4,
                 help="rounds of extension per batch (0: the grid as given); a batch whose "
                      "fastest rate is still at an edge after them leaves the sweep unfitted")
  p.add_argument("--out", default="", help="output dir (default runs/batch_sweep/<config>)")
  p.add_argument("--micro_batch_size", type=int, default=0,
                 help="rows per micro-batch for every run (default: the smallest batch)")
  p.add_argument("--max_examples", type=int, default=200_000,
                 help="give up on a run after this many sequences")
  p.add_argument("--eval_examples", type=int, default=256,
                 help="evaluate every this many training sequences (resolution of E)")
  p.add_argument("--eval_sequences", type=int, default=64,
                 help="validation sequences per evaluation (a fixed set)")
  p.add_argument("--smooth_examples", type=int, default=1024,
                 help="width in examples of the centered average of the eval curve (0: none)")
  p.add_argument("--plot", default="", help="PNG path (default <out>/batch_sweep.png)")
  p.add_argument("--reuse", action="store_true",
                 help="read back a run that already finished in its workdir with the same config "
                      "and stop rule instead of training it again (a killed sweep resumes)")
  p.add_argument("--seeds", type=int, default=1,
                 help="sweep at the config's seed, seed + 1, ... (each in <out>/seed<s>) and "
                      "report the spread of B_crit, B_simple and the steps")
  return p


def parse_args(argv):
  """(options, config overrides, config name); a mistake is a one-line ConfigError."""
  p = build_parser()
  args, overrides = p.parse(argv)
  args.batch_sizes = sorted(set(args.batch_sizes))
  args.micro_batch_size = args.micro_batch_size or args.batch_sizes[0]
  name = os.path.splitext(os.path.basename(args.config))[0]
  args.out = args.out or os.path.join("runs", "batch_sweep", name)
  args.plot = args.plot or os.path.join(args.out, "batch_sweep.png")
  return args, overrides, name


def sweep(cfg, args, out: str, name: str) -> dict:
  """One sweep of `cfg` into `out` (runs, CSV, JSON, figure); its summary (`summarise`'s, with the
  settings). A config a batch cannot take raises ConfigError naming the batch."""
  os.makedirs(out, exist_ok=True)
  results = []
  t0 = time.perf_counter()
  for batch in args.batch_sizes:
    def run(mult, batch=batch):
      workdir = os.path.join(out, "runs", f"b{batch}_lr{mult:g}")
      try:
        r = run_one(cfg, batch, mult, args, workdir)
      except ConfigError as e:
        raise ConfigError(f"batch {batch}: {e}") from None
      results.append(r)
      reached = (f"target at step {r.steps:.1f} ({r.examples:,.0f} examples)" if r.steps
                 else f"target not reached in {r.steps_run} steps")
      print(f"[sweep] batch {batch} lr x{mult:g} (lr {r.learning_rate:.3g}): {reached}; "
            f"B_simple {r.noise_scale if r.noise_scale is None else round(r.noise_scale, 1)}; "
            f"{r.seconds:.0f}s", flush=True)
      return r.steps
    bracket(run, args.lr_grid, factor=args.bracket_factor, max_extensions=args.max_extensions)
  chosen, fit, summary = summarise(results, require_interior=True)
  summary.update(config=args.config, overrides=getattr(args, "overrides", {}),
                 optimizer=str(cfg.optim.name), seed=int(cfg.seed), target_loss=args.target_loss,
                 target_metric=getattr(args, "target_metric", "eval_loss"),
                 curve=getattr(args, "curve", "raw"),
                 batch_sizes=args.batch_sizes, lr_grid=args.lr_grid,
                 rates_run={b: sorted(r.lr_multiplier for r in results if r.batch_size == b)
                            for b in args.batch_sizes},
                 micro_batch_size=args.micro_batch_size, seconds=time.perf_counter() - t0)
  write_csv(os.path.join(out, "batch_sweep.csv"), results)
  with open(os.path.join(out, "batch_sweep.json"), "w") as f:
    json.dump(summary, f, indent=1)
  plot_path = args.plot if out == args.out else os.path.join(out, "batch_sweep.png")
  plotted = plot(plot_path, results, chosen, fit, summary, args.target_loss,
                 f"{name} (seed {cfg.seed}): {summary['target_metric']} {args.target_loss}")
  print("[sweep] batch  steps   examples  B_simple  lr (x rule)  inside the rates run  residual")
  res = dict(zip(fit.batches, fit.residuals)) if fit is not None else {}
  for r in chosen:
    print(f"[sweep] {r.batch_size:5d} {r.steps:7.1f} {r.examples:10,.0f} "
          f"{'-' if r.noise_scale is None else f'{r.noise_scale:8.1f}':>9s}  "
          f"{r.learning_rate:.3g} (x{r.lr_multiplier:g})  {'yes' if r.lr_interior else 'NO':>8s}"
          + (f"  {res[float(r.batch_size)]:+.1%}" if float(r.batch_size) in res else ""))
  if fit is not None:
    ci = "" if fit.b_crit_lo is None else f" [{fit.b_crit_lo:.1f}, {fit.b_crit_hi:.1f}] (95%, " \
        "the fit's residuals)"
    print(f"[sweep] fit S = S_min + E_min/B: S_min={fit.s_min:.1f} steps, E_min={fit.e_min:,.0f} "
          f"examples, B_crit = E_min/S_min = {fit.b_crit:.1f}{ci} sequences"
          + (f" ({fit.note})" if fit.note else ""))
    print("[sweep] local slopes -dlog S/dlog B between batches: "
          + ", ".join(f"{x:.2f}" for x in summary["local_slopes"]) + "; B_crit by batch window: "
          + ", ".join(f"{k}: {v:.1f}" for k, v in summary["window_b_crit"].items()))
  elif summary["censored"] and len(chosen) >= 2:
    print(f"[sweep] no fit: the fastest rate of batch {', '.join(map(str, summary['censored']))} "
          f"is at the edge of the rates run (after {args.max_extensions} extensions of "
          "--lr_grid): steps to the target there are set by the grid, not the batch; raise "
          "--max_extensions")
  else:
    print("[sweep] fewer than two batch sizes reached the target: no fit")
  if "b_simple_median" in summary:
    lo, hi = summary["b_simple_range"]
    print(f"[sweep] measured B_simple at the target: median {summary['b_simple_median']:.1f} "
          f"sequences (range {lo:.1f}-{hi:.1f})")
  print(f"[sweep] wrote {out}/batch_sweep.csv, batch_sweep.json"
        + (f", {plot_path}" if plotted else figures.NO_PLOT))
  summary["steps"] = {r.batch_size: r.steps for r in chosen}
  return summary


def main(argv: list[str]) -> int:
  platforms.choose()  # as train.py: no TPU probing (and its start-up noise) without TPUs
  try:
    args, overrides, name = parse_args(argv)
    cfg = load(args.config, overrides)
    args.overrides = dict(overrides)
    if args.seeds < 1:
      raise ConfigError(f"--seeds {args.seeds}: must be at least 1")
    if args.curve == "ema" and not cfg.optim.ema_decay > 0:
      raise ConfigError("--curve ema reads the parameter EMA's evaluations: set "
                        "--config.optim.ema_decay, e.g. 0.99")
    if args.curve == "ema" and args.target_metric == "eval_masked_error":
      raise ConfigError("--curve ema: the masked LM logs no EMA accuracy; use --target_metric "
                        "eval_loss with it")
    if args.max_extensions < 0 or args.bracket_factor <= 1:
      raise ConfigError(f"--max_extensions {args.max_extensions} / --bracket_factor "
                        f"{args.bracket_factor}: give at least 0 extensions and a factor above 1")
  except ConfigError as e:
    print(f"error: {e}", file=sys.stderr)
    return 2
  if cfg.data.batch_ramp:
    print("error: the sweep sets the batch itself; remove data.batch_ramp", file=sys.stderr)
    return 2
  bad = [b for b in args.batch_sizes if b % args.micro_batch_size]
  if bad:
    print(f"error: batch {bad[0]} is not a multiple of --micro_batch_size="
          f"{args.micro_batch_size}", file=sys.stderr)
    return 2
  summaries = []
  try:
    for k in range(args.seeds):
      seeded = cfg.copy_and_resolve_references()
      seeded.seed = cfg.seed + k
      out = args.out if args.seeds == 1 else os.path.join(args.out, f"seed{seeded.seed}")
      summaries.append(sweep(seeded, args, out, name))
  except ConfigError as e:
    print(f"error: {e}", file=sys.stderr)
    return 2
  if args.seeds > 1:
    sweep_seeds.report(args, summaries, int(cfg.seed))
  return 0


if __name__ == "__main__":
  sys.exit(main(sys.argv[1:]))

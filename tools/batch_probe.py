"""The critical batch over training, measured by branching: short continuations of one run at k
times its batch, compared at equal tokens (Merrill et al. 2025, arXiv 2505.23971).

    python -m tools.batch_probe --workdir RUN --at 100,200,400 --factors 2,4,8 \\
        --tokens 65536 [--tolerance 0.01] [--evals 4] [--eval_sequences 256] [--ramp] \\
        [--out DIR] [--b_crit B] [--config.KEY=VALUE ...]

From RUN's checkpoint at each step of `--at`, one branch per factor k (and k = 1, the run
continued) trains `--tokens` tokens at k times the run's batch B, its hyperparameters moved by
the run's rules; the critical batch there is k B for the largest k whose smoothed loss is within
`--tolerance` of every smaller factor's. RUN is not touched. `--ramp` writes the batch ramp the
measurements imply as config overrides. Outputs in `--out` (default runs/batch_probe/<run>):
batch_probe.csv (one row per branch), batch_probe.json (the summary), batch_probe.png.
Protocol, censoring, the ramp: docs/batch_size.md#critical-batch-by-branching
"""
from __future__ import annotations

import dataclasses
import json
import math
import os
import shutil
import sys
import time

from tools import figures
from trainer.config import ConfigError
from trainer.config.cli import CliParser, apply_override, ints
from trainer.multihost import platforms
from trainer.run.inprocess import load_run, schedule_in_tokens
from trainer.run.inprocess import copy_checkpoint, read_rows, train
from trainer.tracking.record import interpolate, noise_curve

ALPHA = 0.5  # the smoothing of the evaluations (Merrill et al.'s EMA weight)


# ------------------------------------------------------------------------------------------------
# Analysis (no jax)


def smoothed(losses: list[float], alpha: float = ALPHA) -> float:
  """The last value of the exponential moving average x <- alpha y + (1 - alpha) x, started at
  the first loss."""
  value = losses[0]
  for y in losses[1:]:
    value = alpha * y + (1 - alpha) * value
  return value


def critical_factor(losses: dict[int, float], tolerance: float) -> int:
  """The largest factor k* whose loss is within `tolerance` of every smaller factor's (the
  paper's rule; factor 1 always qualifies)."""
  ks = sorted(losses)
  ok = [k for i, k in enumerate(ks) if all(losses[k] <= losses[j] + tolerance for j in ks[:i])]
  return max(ok)


def implied_stages(points: list[tuple[int, float]], start: int) -> list[tuple[int, int]]:
  """[(batch, start tokens)] of the batch warmup that follows measured critical batches
  [(tokens at the branch point, critical batch)]: the batch doubles at a point while the
  critical batch there is at least twice it."""
  stages = [(start, 0)]
  for tokens, critical in sorted(points):
    batch = stages[-1][0]
    while critical >= 2 * batch:
      batch *= 2
    if batch != stages[-1][0]:
      stages.append((batch, int(tokens)))
  return stages


# ------------------------------------------------------------------------------------------------
# Branches


def check_run(cfg) -> str:
  """The rate rule of the run's optimizer; a ConfigError for a run the probe cannot branch."""
  from optim.seesaw import SEESAW_RULES, seesaw_rule  # noqa: PLC0415  start-up
  if cfg.data.batch_ramp:
    raise ConfigError(f"the run trains with data.batch_ramp={cfg.data.batch_ramp!r}; the probe "
                      "branches from a run at a fixed batch")
  if cfg.optim.diloco.replicas:
    raise ConfigError("the run trains with DiLoCo (optim.diloco.replicas); the probe branches "
                      "from a data-parallel run")
  if cfg.optim.schedule == "power":
    raise ConfigError("the run's optim.schedule='power' sets the rate from the batch itself; the "
                      "probe moves the rate by the optimizer's rule")
  rule = seesaw_rule(cfg.optim)
  if rule not in ("sqrt", "linear"):
    raise ConfigError(f"optim.name={cfg.optim.name!r} has no rate rule for a larger batch "
                      f"(known: {', '.join(f'{k} {v}' for k, v in SEESAW_RULES.items())}); "
                      "pass --config.optim.lr_rule=sqrt or linear")
  return rule


def rate_settings(run, rule: str) -> dict:
  """{optim key: value} under which `rule` moves the run's own rate at its batch B to k B:
  the run's reference batch and rules; a run without a rate rule (`lr_rule="none"`) used its
  stated rate at B, which is restated at its reference batch so that B still gets it."""
  from optim.scaling import lr_factor, stated  # noqa: PLC0415  start-up
  batch = run.data.global_batch_size
  ref = run.optim.reference_batch_size or batch
  out = {"lr_rule": rule, "reference_batch_size": ref}
  if run.optim.lr_rule == "none" and ref != batch:
    out["learning_rate"] = stated(run.optim)["learning_rate"][0] / lr_factor(rule, batch / ref)
  return out


def branch_config(run, step: int, factor: int, tokens: int, evals: int, eval_sequences: int,
                  rule: str):
  """The config of the branch at `factor` x the run's batch from its checkpoint `step`."""
  cfg = run.copy_and_resolve_references()
  d, o = cfg.data, cfg.optim
  batch, seq = run.data.global_batch_size, run.data.seq_len
  micro = run.data.micro_batch_size or batch
  o.update(**schedule_in_tokens(run), **rate_settings(run, rule))
  d.global_batch_size = factor * batch
  d.micro_batch_size = micro if factor * batch > micro else 0
  d.batch_ramp = f"{batch}:0,{factor * batch}:{step * batch * seq}" if factor > 1 else ""
  n = tokens // (factor * batch * seq)
  cfg.steps = step + n
  cfg.eval_every = math.gcd(step, n // evals)  # every evaluation point is a multiple of it
  cfg.eval_sequences = eval_sequences
  cfg.log_every = 1  # every step's row (one compiled step: no norms)
  cfg.trainer.norm_metrics = "off"
  if o.noise_scale_every:  # the meter stays (its state is in the checkpoint), measuring nothing
    o.noise_scale_every = cfg.steps + 1
  cfg.checkpoint.update(every_steps=0, every_seconds=0.0, keep=1, init_from="")
  cfg.trainer.progress_bar = False
  return cfg


@dataclasses.dataclass
class Branch:
  at_step: int
  at_tokens: int
  factor: int
  batch: int
  learning_rate: float  # at the branch's first step
  steps: int
  eval_losses: list[float]  # at the same token counts in every branch of the point
  smoothed_loss: float
  seconds: float
  loss_minus_base: float = math.nan
  critical_batch: int = 0  # the point's
  censored: str = ""  # ">=" (the largest factor passed), "<=" (k = 2 failed) or ""
  b_simple: float | None = None  # the run's own, at the point


def run_branch(run_dir: str, run, step: int, factor: int, args, rule: str) -> Branch:
  cfg = branch_config(run, step, factor, args.tokens, args.evals, args.eval_sequences, rule)
  workdir = os.path.join(args.out, "branches", f"at{step}_x{factor}")
  copy_checkpoint(run_dir, step, workdir)
  t = train(cfg, workdir, fresh=False)
  if not args.keep_branches:
    shutil.rmtree(workdir, ignore_errors=True)
  n = cfg.steps - step
  points = [step + j * n // args.evals for j in range(1, args.evals + 1)]
  evals = {r["step"]: r["eval_loss"] for r in t.rows if "eval_loss" in r}
  missing = [p for p in points if p not in evals]
  if missing:
    raise RuntimeError(f"branch at step {step} x{factor}: no evaluation at steps {missing}")
  losses = [evals[p] for p in points]
  first = next(r for r in t.rows if r.get("step") == step + 1 and "learning_rate" in r)
  batch, seq = run.data.global_batch_size, run.data.seq_len
  return Branch(step, step * batch * seq, factor, factor * batch, first["learning_rate"], n,
                losses, smoothed(losses), t.seconds)


def noise_at(run_dir: str, step: int) -> float | None:
  """The run's own smoothed B_simple at `step` (interpolated between its measurements)."""
  try:
    return interpolate(noise_curve(read_rows(run_dir)), step)
  except OSError:
    return None


def probe(args):
  """(every branch of every point, the summary: critical batch per point and the implied ramp,
  the run's config with the command line's overrides)."""
  run = load_run(args.workdir, args.at[0])
  for key, value in args.overrides:
    apply_override(run, key, value)
  rule = check_run(run)
  batch, seq = run.data.global_batch_size, run.data.seq_len
  unit = math.lcm(*args.factors) * batch * seq * args.evals
  tokens = -(-args.tokens // unit) * unit
  if tokens != args.tokens:
    print(f"[probe] --tokens {args.tokens:,} -> {tokens:,}: a whole number of steps at every "
          f"factor for each of {args.evals} evaluations", flush=True)
  args.tokens = tokens
  branches, points = [], []
  for step in args.at:
    at = [run_branch(args.workdir, run, step, k, args, rule) for k in [1] + args.factors]
    base = at[0].smoothed_loss
    losses = {b.factor: b.smoothed_loss for b in at}
    k = critical_factor(losses, args.tolerance)
    censored = ">=" if k == max(args.factors) else "<=" if k == 1 else ""
    noise = noise_at(args.workdir, step)
    for b in at:
      b.loss_minus_base, b.critical_batch, b.censored, b.b_simple = \
          b.smoothed_loss - base, k * batch, censored, noise
    branches += at
    points.append((at[0].at_tokens, k * batch))
    print(f"[probe] step {step} ({at[0].at_tokens:,} tokens): smoothed eval loss "
          + ", ".join(f"x{b.factor} {b.smoothed_loss:.4f}" for b in at)
          + f" -> critical batch {censored}{k * batch} (B_simple "
          + (f"{noise:.1f})" if noise is not None else "not measured)"), flush=True)
  summary = {"workdir": args.workdir, "batch": batch, "seq_len": seq, "rule": rule,
             "factors": args.factors, "tokens": args.tokens, "evals": args.evals,
             "tolerance": args.tolerance, "eval_sequences": args.eval_sequences,
             "points": [{"step": s, "tokens": t, "critical_batch": c,
                         "censored": next(b.censored for b in branches if b.at_step == s),
                         "b_simple": next(b.b_simple for b in branches if b.at_step == s)}
                        for s, (t, c) in zip(args.at, points)],
             "implied_stages": implied_stages(points, batch)}
  return branches, summary, run


def ramp_overrides(run, stages: list[tuple[int, int]], rule: str) -> tuple[list[str], list[str]]:
  """(overrides of a plain run with the ramp, of an autopilot run up to its largest batch): the
  schedule in tokens, the rule from the run's batch, and for the plain run the steps that read
  the run's tokens under the ramp."""
  from optim.ramp import BatchRamp  # noqa: PLC0415  start-up
  batch, seq = run.data.global_batch_size, run.data.seq_len
  micro = run.data.micro_batch_size or batch
  optim = {**schedule_in_tokens(run), **rate_settings(run, rule)}
  shared = [f"--config.optim.{k}={v}" for k, v in optim.items()] + [
      f"--config.data.micro_batch_size={micro}"]
  ramp = BatchRamp(stages, seq)
  plain = [f"--config.data.batch_ramp={','.join(f'{b}:{t}' for b, t in stages)}",
           f"--config.data.global_batch_size={stages[-1][0]}",
           f"--config.steps={ramp.first_step_at(run.steps * batch)}"] + shared
  auto = ["--config.data.batch_ramp=auto", f"--config.data.global_batch_size={batch}",
          f"--config.data.batch_auto.max={stages[-1][0]}"] + shared
  return plain, auto


# ------------------------------------------------------------------------------------------------
# Outputs


def write_csv(path: str, branches: list[Branch]) -> None:
  rows = [{**dataclasses.asdict(b), "eval_losses": " ".join(f"{x:.5f}" for x in b.eval_losses)}
          for b in branches]
  figures.write_csv(path, rows, [f.name for f in dataclasses.fields(Branch)])


def plot(path: str, branches: list[Branch], summary: dict, run_dir: str, b_crit: float,
         title: str) -> bool:
  """Left: the critical batch at each point (triangles: censored) over tokens, the run's
  B_simple over training, the sweep's B_crit. Right: each point's smoothed loss minus the
  k = 1 branch's against the batch, with the tolerance."""
  plt = figures.pyplot()
  if plt is None or not branches:
    return False
  batch, seq = summary["batch"], summary["seq_len"]
  fig, (ax1, ax2) = plt.subplots(1, 2, figsize=(11.5, 4.4))
  marker = {">=": "^", "<=": "v", "": "o"}
  for p in summary["points"]:
    ax1.plot([p["tokens"]], [p["critical_batch"]], marker[p["censored"]], c="C0", ms=8)
  ax1.plot([p["tokens"] for p in summary["points"]],
           [p["critical_batch"] for p in summary["points"]], "-", c="C0",
           label=f"critical batch, branching (tolerance {summary['tolerance']:g}; triangles: "
                 "beyond the factors tried)")
  try:
    curve = noise_curve(read_rows(run_dir))
  except OSError:
    curve = []
  if curve:
    ax1.plot([s * batch * seq for s, _ in curve], [v for _, v in curve], c="C2", lw=1,
             label="the run's B_simple (gradient noise scale)")
  if b_crit:
    ax1.axhline(b_crit, c="C1", ls="--", lw=1, label=f"critical-batch sweep's B_crit ({b_crit:g})")
  ax1.axhline(batch, c="0.5", ls=":", lw=1, label=f"the run's batch ({batch})")
  ax1.set(xscale="log", yscale="log", xlabel="tokens at the branch point",
          ylabel="batch (sequences)", title="critical batch over training")
  ax1.legend(fontsize=7)
  tol = summary["tolerance"]
  for i, p in enumerate(summary["points"]):
    at = sorted((b for b in branches if b.at_step == p["step"]), key=lambda b: b.factor)
    ax2.plot([b.batch for b in at], [b.loss_minus_base for b in at], "o-", c=f"C{i % 10}",
             ms=4, label=f"step {p['step']}")
  ax2.axhspan(-tol, tol, color="0.85", zorder=0, label=f"+-{tol:g}")
  ax2.set(xscale="log", xlabel="branch batch (sequences)",
          ylabel="smoothed eval loss - the run's (k = 1)",
          title=f"after {summary['tokens']:,} tokens")
  ax2.legend(fontsize=7, ncol=2)
  figures.save(fig, path, title)
  return True


# ------------------------------------------------------------------------------------------------
# CLI


def build_parser():
  p = CliParser("-m tools.batch_probe", __doc__, config=False)
  p.add_argument("--workdir", required=True, help="the run to branch from (left untouched)")
  p.add_argument("--at", type=ints, required=True,
                 help="comma-separated steps with checkpoints")
  p.add_argument("--factors", type=ints, default="2,4,8", help="batch multiples to branch at")
  p.add_argument("--tokens", type=int, required=True, help="tokens each branch trains")
  p.add_argument("--tolerance", type=float, default=0.01,
                 help="loss difference still 'the same' (nats; the paper's 0.01)")
  p.add_argument("--evals", type=int, default=4, help="evaluations per branch (smoothed)")
  p.add_argument("--eval_sequences", type=int, default=256,
                 help="validation sequences per evaluation (a fixed set)")
  p.add_argument("--b_crit", type=float, default=0.0,
                 help="a critical-batch sweep's B_crit to draw beside (0: none)")
  p.add_argument("--ramp", action="store_true",
                 help="write the implied batch ramp as config overrides")
  p.add_argument("--out", default="", help="output dir (default runs/batch_probe/<run>)")
  p.add_argument("--keep_branches", action="store_true", help="keep the branches' workdirs")
  return p


def parse_args(argv):
  """(options with the overrides in `.overrides`); a mistake is a one-line ConfigError."""
  p = build_parser()
  args, overrides = p.parse(argv)
  args.at, args.factors = sorted(set(args.at)), sorted(set(args.factors))
  if not args.at or min(args.at) < 1:
    p.error("--at needs steps >= 1 (checkpoints of the run)")
  if not args.factors or min(args.factors) < 2:
    p.error("--factors needs integers >= 2 (the run itself is factor 1)")
  if args.tokens < 1 or args.evals < 1 or args.eval_sequences < 1:
    p.error("--tokens, --evals and --eval_sequences must be positive")
  if args.tolerance < 0:
    p.error("--tolerance must be >= 0")
  args.overrides = overrides
  name = os.path.basename(os.path.normpath(args.workdir))
  args.out = args.out or os.path.join("runs", "batch_probe", name)
  return args


def main(argv: list[str]) -> int:
  platforms.choose()  # as train.py: no TPU probing (and its start-up noise) without TPUs
  t0 = time.perf_counter()
  try:
    args = parse_args(argv)
    try:
      os.makedirs(args.out, exist_ok=True)
    except OSError as e:
      raise ConfigError(f"--out {args.out}: cannot create it ({e.strerror or e}); give a "
                        "directory path") from None
    branches, summary, run = probe(args)
  except ConfigError as e:
    print(f"error: {e}", file=sys.stderr)
    return 2
  summary["seconds"] = time.perf_counter() - t0
  written = [os.path.join(args.out, "batch_probe.csv"), os.path.join(args.out,
                                                                     "batch_probe.json")]
  write_csv(written[0], branches)
  if args.ramp:
    stages = summary["implied_stages"]
    if len(stages) == 1:
      print("[probe] the critical batch never reached twice the run's batch: no ramp implied")
    else:
      plain, auto = ramp_overrides(run, stages, summary["rule"])
      summary.update(ramp_overrides=plain, autopilot_overrides=auto)
      for name, lines in (("ramp_overrides.txt", plain), ("autopilot_overrides.txt", auto)):
        written.append(os.path.join(args.out, name))
        with open(written[-1], "w") as f:
          f.write("\n".join(lines) + "\n")
      print("[probe] implied batch ramp: " + " -> ".join(
          f"{b} from {t:,} tokens" for b, t in stages), flush=True)
  with open(written[1], "w") as f:
    json.dump(summary, f, indent=1)
  png = os.path.join(args.out, "batch_probe.png")
  name = os.path.basename(os.path.normpath(args.workdir))
  title = (f"{name}: critical batch by branching (x" + ",".join(map(str, args.factors))
           + f", {args.tokens:,} tokens)")
  plotted = plot(png, branches, summary, args.workdir, args.b_crit, title)
  print(f"[probe] wrote {', '.join(written)}" + (f", {png}" if plotted else figures.NO_PLOT)
        + f"; {summary['seconds']:.0f}s")
  return 0


if __name__ == "__main__":
  sys.exit(main(sys.argv[1:]))

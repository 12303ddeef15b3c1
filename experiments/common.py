"""What every experiment shares: its command line, training one config in-process, reading a
run's own record (examples seen from its batch changes, the eval curve), and the results table.

Every experiment trains through `trainer.loop.Run` exactly as train.py does (the same data
order, checkpoints and metrics.jsonl), one run after the other in this process, each in a fresh
workdir under `--workdir`. Its outputs are one CSV (`tools/figures.write_csv`) and one PNG
(`tools/figures.save`), by default `docs/<experiment>.csv` and `.png`.

Examples seen are read from the run's record, never computed as step x batch: a run's batch can
change (a ramp, or the batch autopilot's decisions, logged as `batch_change` events), so the
examples before step n are those of the ramp rebuilt from those events (`ramp_from_rows`).
"""
from __future__ import annotations

import dataclasses
import json
import math
import os
import shutil
import sys
import time
from collections.abc import Callable

from tools import figures
from tools.batch_sweep import crossing, smooth

DEFAULT_CONFIG = os.path.join("configs", "sweep_tiny.py")


# ------------------------------------------------------------------------------------------------
# A run's own record (no jax)


def read_rows(workdir: str) -> list[dict]:
  """Every row of a run's metrics.jsonl (training, evaluation and event rows)."""
  with open(os.path.join(workdir, "metrics.jsonl")) as f:
    return [json.loads(line) for line in f if line.strip()]


def ramp_from_rows(rows: list[dict], start_batch: int, seq_len: int):
  """The batch of every step as the run recorded it: `start_batch`, changed by each
  `batch_change` event (`from_step` is 1-based) in the order they were written. A run without
  events had a constant batch."""
  from optim.ramp import BatchRamp  # noqa: PLC0415  (jax.numpy only inside traced helpers)
  ramp = BatchRamp.constant(int(start_batch), int(seq_len))
  seen = set()
  for r in rows:
    if r.get("event") != "batch_change":
      continue
    key = (int(r["from_step"]), int(r["batch"]))
    if key in seen:  # a resumed run may write an event again: same decision, same stage
      continue
    seen.add(key)
    if int(r["old_batch"]) != ramp.batches[-1]:
      raise ValueError(f"batch_change at step {r['step']} is from {r['old_batch']}, but the "
                       f"record's batch was {ramp.batches[-1]}")
    ramp.add_stage(int(r["batch"]), int(r["from_step"]) - 1)
  return ramp


def eval_curve(rows: list[dict], ramp, key: str = "eval_loss") -> list[tuple[float, float]]:
  """[(examples seen at the evaluation, value)] of the run's evaluation rows."""
  return [(float(ramp.examples_before(r["step"])), float(r[key])) for r in rows
          if key in r and "event" not in r]


def train_curve(rows: list[dict], ramp, key: str = "loss") -> list[tuple[float, float]]:
  """[(examples seen after the step, value)] of the logged training rows."""
  return [(float(ramp.examples_before(r["step"])), float(r[key])) for r in rows
          if key in r and "event" not in r and "eval_loss" not in r]


@dataclasses.dataclass(frozen=True)
class Reached:
  """Where a run's smoothed eval curve crossed the target: examples, tokens and (fractional,
  through the run's ramp) optimizer steps."""
  examples: float
  tokens: float
  steps: float


def to_target(curve: list[tuple[float, float]], ramp, target: float,
              smooth_examples: float) -> Reached | None:
  """Examples, tokens and steps at which the eval curve, averaged over a centered window of
  `smooth_examples` examples (`tools.batch_sweep.smooth`), first falls to `target`
  (interpolated between evaluations); None if it never does."""
  examples = crossing(smooth(curve, smooth_examples / 2), target)
  if examples is None:
    return None
  return Reached(examples, examples * ramp.seq_len, ramp.step_at_examples(examples))


def target_stop(target: float, smooth_examples: float, examples_at: Callable[[int], float],
                max_examples: float = math.inf) -> Callable[[int, dict], str | None]:
  """A `Run(stop_when=...)` callback: stop once the smoothed eval curve (examples from
  `examples_at(step)`, the run's ramp) is at or below `target`, or `max_examples` are seen."""
  evals: list[tuple[float, float]] = []

  def stop_when(step: int, row: dict) -> str | None:
    seen = examples_at(step)
    if "eval_loss" in row:
      evals.append((seen, row["eval_loss"]))
      low = [x for x, y in smooth(evals, smooth_examples / 2) if y <= target]
      if low:
        return f"smoothed eval loss <= {target} at {low[0]:,.0f} examples"
    if seen >= max_examples:
      return f"{max_examples:,.0f} examples seen without reaching eval loss {target}"
    return None

  return stop_when


# ------------------------------------------------------------------------------------------------
# Training in-process


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


@dataclasses.dataclass
class Trained:
  status: str
  steps_run: int
  seconds: float
  rows: list[dict]
  ramp: object  # optim.ramp.BatchRamp rebuilt from the record
  workdir: str

  @property
  def final_eval(self) -> float | None:
    evals = [r["eval_loss"] for r in self.rows if "eval_loss" in r]
    return evals[-1] if evals else None


def train(cfg, workdir: str, *, stop=None, fresh: bool = True,
          keep_checkpoints: bool = False) -> Trained:
  """Train `cfg` in `workdir` through `trainer.loop.Run` (validated first: a config mistake is a
  ConfigError before anything compiles). `fresh` clears the workdir first (the experiments own
  their run directories); otherwise the run resumes from its checkpoints as train.py would.
  `stop(run)` returns the run's `stop_when(step, row)` callback (it may read the live ramp,
  `run.ramp`). A run that diverges under `trainer.nonfinite_policy="stop"` is a result (status
  "nonfinite"); any other early end raises."""
  import jax  # noqa: PLC0415
  from trainer.config_checks import validate  # noqa: PLC0415
  from trainer.loop import Run  # noqa: PLC0415
  validate(cfg, jax.devices())
  if fresh and os.path.exists(workdir):
    shutil.rmtree(workdir)
  run = Run(cfg, workdir)
  if stop is not None:
    run.stop_when = stop(run)
  t0 = time.perf_counter()
  result = run.train()
  seconds = time.perf_counter() - t0
  if result.status not in ("done", "nonfinite"):
    raise RuntimeError(f"run in {workdir} ended {result.status}: {result.message}")
  if not keep_checkpoints:
    shutil.rmtree(os.path.join(workdir, "checkpoints"), ignore_errors=True)
  rows = read_rows(workdir)
  return Trained(result.status, result.step, seconds, rows,
                 ramp_from_rows(rows, cfg.data.global_batch_size, cfg.data.seq_len), workdir)


# ------------------------------------------------------------------------------------------------
# Command line, table, outputs


def parser(name: str, doc: str):
  """CliParser of `python -m experiments.<name>`: `--config` (default configs/sweep_tiny.py),
  `--out` (path stem of the CSV and PNG, default docs/<name>), `--workdir` (the runs), and
  `--config.KEY=VALUE` overrides of the base config."""
  from trainer.cli import CliParser  # noqa: PLC0415
  p = CliParser(f"-m experiments.{name}", doc, config=False)
  p.add_argument("--config", default=DEFAULT_CONFIG, metavar="FILE.py",
                 help=f"base config (default {DEFAULT_CONFIG}); --config.KEY=VALUE overrides it")
  p.add_argument("--out", default=os.path.join("docs", name),
                 help="writes OUT.csv and OUT.png (default docs/%(default)s)")
  p.add_argument("--workdir", default=os.path.join("runs", "experiments", name),
                 help="where the runs' workdirs go")
  return p


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


def ints(text: str) -> list[int]:
  """An argparse type: "8,16,32" -> [8, 16, 32] (a mistake is argparse's one-line error)."""
  return _numbers(text, int, "integers")


def floats(text: str) -> list[float]:
  """An argparse type: "0.5,1,2" -> [0.5, 1.0, 2.0]."""
  return _numbers(text, float, "numbers")


def _numbers(text: str, kind, what: str) -> list:
  import argparse  # noqa: PLC0415
  try:
    return [kind(x) for x in text.split(",") if x]
  except ValueError:
    raise argparse.ArgumentTypeError(f"{text!r}: give comma-separated {what}") from None


def main(name: str, parse: Callable, experiment: Callable, argv: list[str]) -> int:
  """Parse (`parse(argv) -> (args, overrides)`), load the base config, run
  `experiment(args, cfg) -> rows` and report the wall time. A mistake in the command line or a
  config is one line on stderr and exit code 2, before anything compiles."""
  from trainer import platforms  # noqa: PLC0415
  platforms.choose()
  from trainer.cli import load  # noqa: PLC0415
  from trainer.config import ConfigError  # noqa: PLC0415
  try:
    args, overrides = parse(argv)
    cfg = load(args.config, overrides)
  except ConfigError as e:
    print(f"error: {e}", file=sys.stderr)
    return 2
  out_dir = os.path.dirname(args.out)
  if out_dir:
    os.makedirs(out_dir, exist_ok=True)
  t0 = time.perf_counter()
  try:
    experiment(args, cfg)
  except ConfigError as e:
    print(f"error: {e}", file=sys.stderr)
    return 2
  print(f"[{name}] {time.perf_counter() - t0:.0f}s in all", flush=True)
  return 0


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

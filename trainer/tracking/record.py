"""A run's own record, read back: the rows of its metrics.jsonl, the examples seen through its
batch changes (`ramp_from_rows`), its eval curve, where a smoothed curve crossed a target
(`to_target`), and a `Run(stop_when=...)` callback that stops there (`target_stop`).

Examples seen are read from the record, never computed as step x batch: a run's batch can change
(a ramp, or the batch autopilot's `batch_change` events). A curve falls to its target: an
accuracy is read as its error (`eval_error` = 1 - eval_accuracy, `ERROR_OF`). Used by the
research tools and the experiments alike.
"""
from __future__ import annotations

import dataclasses
import json
import math
import os
from collections.abc import Callable

import numpy as np


def read_rows(workdir: str) -> list[dict]:
  """Every row of a run's metrics.jsonl (training, evaluation and event rows)."""
  with open(os.path.join(workdir, "metrics.jsonl")) as f:
    return [json.loads(line) for line in f if line.strip()]


def ramp_from_rows(rows: list[dict], start_batch: int, seq_len: int):
  """The batch of every step as the run recorded it: `start_batch`, changed by each
  `batch_change` event (`from_step` is 1-based) in the order they were written. A run without
  events had a constant batch."""
  from optim.ramp import BatchRamp  # noqa: PLC0415  start-up
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


# the error metrics a curve can be read on (1 - the logged accuracy): a target falls like a loss's
ERROR_OF = {"eval_error": "eval_accuracy", "eval_error_ema": "eval_accuracy_ema",
            "eval_masked_error": "eval_masked_accuracy"}


def value(row: dict, key: str) -> float | None:
  """`row[key]`, or for an `ERROR_OF` key 1 - its accuracy; None where the row has neither."""
  if key in row:
    return float(row[key])
  accuracy = ERROR_OF.get(key)
  return 1.0 - float(row[accuracy]) if accuracy in row else None


def eval_curve(rows: list[dict], ramp, key: str = "eval_loss") -> list[tuple[float, float]]:
  """[(examples seen at the evaluation, value)] of the run's evaluation rows (`key`: a logged
  eval metric, or an `ERROR_OF` error)."""
  return [(float(ramp.examples_before(r["step"])), v) for r in rows
          if "event" not in r and (v := value(r, key)) is not None]


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
  `smooth_examples` examples (`smooth`), first falls to `target`
  (interpolated between evaluations); None if it never does."""
  examples = crossing(smooth(curve, smooth_examples / 2), target)
  if examples is None:
    return None
  return Reached(examples, examples * ramp.seq_len, ramp.step_at_examples(examples))


DIVERGED = 1.0  # nats above the first evaluation: a run that far up has diverged (target_stop)


def target_stop(target: float, smooth_examples: float, examples_at: Callable[[int], float],
                max_examples: float = math.inf, min_examples: float = 0,
                key: str = "eval_loss") -> Callable[[int, dict], str | None]:
  """A `Run(stop_when=...)` callback: stop once the smoothed eval curve (`key`; examples from
  `examples_at(step)`, the run's ramp) is at or below `target` and `min_examples` are seen (at
  an evaluation), or once `max_examples` are seen (a target of -inf: a run of that length), or
  once it has diverged: an evaluation non-finite or DIVERGED nats above the run's first (it
  would not reach the target; a sweep counts it as not reached)."""
  evals: list[tuple[float, float]] = []

  def stop_when(step: int, row: dict) -> str | None:
    seen = examples_at(step)
    if (now := value(row, key)) is not None:
      if not math.isfinite(now) or (evals and now > evals[0][1] + DIVERGED):
        return f"diverged: {key} {now:.4g} at {seen:,.0f} examples"
      evals.append((seen, now))
      low = [x for x, y in smooth(evals, smooth_examples / 2) if y <= target]
      if low and seen >= min_examples:
        return f"smoothed {key} <= {target} at {low[0]:,.0f} examples" + (
            f" ({seen:,.0f} seen, at least {min_examples:,.0f} asked)" if min_examples else "")
    if seen >= max_examples:
      if target == -math.inf:
        return f"{max_examples:,.0f} examples seen (the length asked)"
      return f"{max_examples:,.0f} examples seen without reaching {key} {target}"
    return None

  return stop_when


def crossing(points: list[tuple[float, float]], target: float) -> float | None:
  """First x at which y falls to `target`, interpolating linearly between points [(x, y)].
  None if it never does; the first point's x if it already starts at or below the target."""
  for i, (x, y) in enumerate(points):
    if y <= target:
      if i == 0:
        return float(x)
      x0, y0 = points[i - 1]
      return float(x0 + (y0 - target) / (y0 - y) * (x - x0))
  return None


def smooth(points: list[tuple[float, float]], half_window: float) -> list[tuple[float, float]]:
  """Centered moving average: each point whose window [x - h, x + h] lies inside the data gets
  the mean of the y's in it (points without a full window are left out). Linear trends pass
  unchanged; with x in examples the window is the same for every batch size."""
  if half_window <= 0:
    return list(points)
  xs = np.array([x for x, _ in points], float)
  ys = np.array([y for _, y in points], float)
  out = []
  for x in xs:
    if x - half_window < xs[0] - 1e-9 or x + half_window > xs[-1] + 1e-9:
      continue
    inside = np.abs(xs - x) <= half_window + 1e-9
    out.append((float(x), float(ys[inside].mean())))
  return out


def interpolate(points: list[tuple[float, float]], x: float) -> float | None:
  """y at x, linear between the given points (clamped to the ends); None without points."""
  finite = [(a, b) for a, b in points if b is not None and math.isfinite(b)]
  if not finite:
    return None
  xs, ys = zip(*sorted(finite))
  return float(np.interp(x, xs, ys))


def noise_curve(rows: list[dict], key: str = "noise_scale") -> list[tuple[int, float]]:
  """[(step, logged noise scale)] of the rows that measured it (`key`: `noise_scale_precond`
  for the preconditioned one)."""
  return [(r["step"], r[key]) for r in rows if key in r]


"""Learning-rate schedules, in steps, examples or tokens.

`build_schedule(cfg, total_steps, ramp)`: a linear warmup from 0, then one of

  constant  cosine  linear  wsd  poly (1 - t/T)^poly_power: the last four decay to min_lr_ratio
  power     min(peak, batch x a x tokens^b), then a final decay (with `lr_rule = none`)
  rsqrt     peak * sqrt(W / t) after a warmup of length W; no horizon

`optim.schedule_unit` is what the schedule is a function of: optimizer steps, or the examples or
tokens of the applied updates (the same curve without a batch ramp; with one, optim/ramp.py,
a schedule in tokens keeps its shape in tokens). Lengths (`warmup_*`, `decay_*`) may be in any
unit and are converted through the ramp; the horizon is fixed at a run's first start.
`halvings` finds where a decaying schedule has fallen to 1/2, 1/4, ... of its peak, and
`step_decay` cuts the rate there (for Seesaw's ramp, whose `BatchRamp.cuts` switch it on).
Why and details: docs/batch_size.md#schedules
"""
from __future__ import annotations

import math

import jax
import jax.numpy as jnp
import numpy as np
import optax

from optim.ramp import UNITS, BatchRamp
from optim.scaling import stated

SCHEDULES = ("constant", "cosine", "linear", "wsd", "poly", "power", "rsqrt")
WSD_SHAPES = ("linear", "cosine", "sqrt")
DECAYING = ("cosine", "linear", "wsd", "poly")  # fall monotonically from the peak to their end: `halvings`
MAX_HALVINGS = 30  # a rate that reaches 0 counts as this many halvings (peak / 2^30)


def _decay_shape(shape: str, peak: float, end: float, steps) -> optax.Schedule:
  steps = max(steps, 1) if isinstance(steps, int) else max(float(steps), 1.0)
  if shape == "linear":
    return optax.linear_schedule(peak, end, steps)
  if shape == "cosine":
    return optax.cosine_decay_schedule(peak, steps, alpha=end / peak if peak else 0.0)
  if shape == "sqrt":  # 1 - sqrt(t): the shape MiniCPM / Hägele et al. 2024 found best for WSD
    return lambda count: end + (peak - end) * (
        1.0 - jnp.sqrt(jnp.clip(count / steps, 0.0, 1.0)))
  raise ValueError(f"unknown decay shape {shape!r}; choose from {WSD_SHAPES}")


def length(cfg, what: str, unit: str, ramp: BatchRamp | None, default_steps: int = 0):
  """`warmup` or `decay` length in `unit`, from whichever of its three keys is set.

  Steps stay integers (the schedule is then exactly today's optax composition); examples and
  tokens are floats (tokens overflow int32)."""
  given = [(u, cfg.get(f"{what}_{u}", 0)) for u in UNITS if cfg.get(f"{what}_{u}", 0) > 0]
  if len(given) > 1:
    names = " and ".join(f"optim.{what}_{u}={v}" for u, v in given)
    raise ValueError(f"{names} both set the {what}; set one, the others to 0")
  source, value = given[0] if given else ("steps", default_steps)
  if source != unit:
    if ramp is None:
      raise ValueError(f"optim.{what}_{source} needs the batch and sequence length to convert "
                       f"to {unit}")
    value = ramp.convert(float(value), source, unit)
  return int(round(value)) if unit == "steps" else float(value)


def build_schedule(cfg, total_steps: int, ramp: BatchRamp | None = None, *,
                   peak: float | None = None, batch_size: int | None = None) -> optax.Schedule:
  """Schedule (a function of the optimizer's step count) from the `optim` config block.

  `total_steps` is the horizon when no `decay_*` key is set; `ramp` converts between units
  (needed for units other than steps and for the power schedule); `peak` replaces the stated
  learning rate (the batch-size rules' value); `batch_size` is the power law's beta. The count
  the trainer passes is its step counter, skipped steps included (trainer/step/train_step.py).
  """
  if peak is None:  # the stated rate, or the optimizer's default when the config leaves it unset
    peak = stated(cfg)["learning_rate"][0]
  peak = float(peak)
  unit = cfg.get("schedule_unit", "steps")
  if unit != "steps" and ramp is None:
    raise ValueError(f"optim.schedule_unit={unit!r} needs the data config (batch, seq_len)")
  warmup = length(cfg, "warmup", unit, ramp)
  horizon = length(cfg, "decay", unit, ramp, default_steps=int(total_steps))
  end = peak * float(cfg.min_lr_ratio)
  one = 1 if unit == "steps" else 1.0
  after = max(horizon - warmup, one)
  kind = cfg.schedule
  warmup_end = peak
  if kind == "constant":
    main = optax.constant_schedule(peak)
  elif kind in ("cosine", "linear"):
    main = _decay_shape(kind, peak, end, after)
  elif kind == "poly":  # optax.polynomial_schedule's curve, for float lengths too
    power = float(cfg.get("poly_power", 2.0))
    main = lambda count: end + (peak - end) * (1.0 - jnp.clip(count / after, 0.0, 1.0)) ** power
  elif kind == "wsd":
    decay = max(_round(horizon * float(cfg.wsd_decay_fraction), unit), one)
    stable = max(after - decay, 0)
    main = optax.join_schedules(
        [optax.constant_schedule(peak), _decay_shape(cfg.wsd_decay_shape, peak, end, decay)],
        [stable])
  elif kind == "power":
    main, warmup_end = _power(cfg, peak, batch_size, ramp, unit, warmup, horizon)
  elif kind == "rsqrt":
    if warmup <= 0:
      raise ValueError("optim.schedule='rsqrt' needs a warmup: its length is the timescale")
    main = lambda count: peak * jnp.sqrt(warmup / jnp.maximum(count + warmup, warmup))
  else:
    raise ValueError(f"unknown schedule {kind!r}; choose from {SCHEDULES}")
  schedule = main if warmup <= 0 else optax.join_schedules(
      [optax.linear_schedule(0.0, warmup_end, warmup), main], [warmup])
  if unit != "steps":
    clock, in_unit = ramp.clock(unit), schedule
    schedule = lambda count: in_unit(clock(count))
  if ramp is not None and ramp.cuts:
    steps = warmup if unit == "steps" else ramp.convert(float(warmup), unit, "steps")
    return step_decay(schedule, steps, peak, ramp.cuts)
  return schedule


def step_decay(schedule: optax.Schedule, warmup_steps: float, peak: float,
               cuts) -> optax.Schedule:
  """`schedule` during its warmup (steps before `warmup_steps`), then peak / 2^k, k the number
  of `cuts` (step indices, sorted; one may repeat) at or before the step."""
  cuts = tuple(int(c) for c in cuts)  # Python ints: no array constant captured by the jit

  def fn(count):
    k = sum(jnp.where(count >= c, 1, 0) for c in cuts)
    return jnp.where(count < warmup_steps, schedule(count), peak * jnp.power(0.5, k))

  return fn


def halvings(cfg, total_steps: int, ramp: BatchRamp) -> tuple[int, ...]:
  """Where the schedule of the `optim` block `cfg` (one of DECAYING), past its warmup, has
  fallen to 1/2, 1/4, ... of its peak: the k-th entry is the first step index whose rate is at
  most peak / 2^k, evaluated at every step index before the horizon (`total_steps` when no
  `decay_*` key is set) at the batch of `ramp` (a constant ramp: units convert exactly). Two
  halvings within one step repeat its index; a rate that reaches 0 counts as MAX_HALVINGS."""
  if cfg.schedule not in DECAYING:
    raise ValueError(f"optim.schedule={cfg.schedule!r} does not decay from a peak; halvings "
                     f"are defined for {', '.join(DECAYING)}")
  unit = cfg.get("schedule_unit", "steps")
  warmup = length(cfg, "warmup", unit, ramp)
  warmup = warmup if unit == "steps" else ramp.convert(float(warmup), unit, "steps")
  horizon = ramp.convert(float(length(cfg, "decay", "examples", ramp,
                                      default_steps=int(total_steps))), "examples", "steps")
  sched = build_schedule(cfg, total_steps, ramp, peak=1.0)
  steps = np.arange(math.ceil(horizon - 1e-9))
  rate = np.asarray(jax.vmap(sched)(jnp.asarray(steps, jnp.int32)), np.float64)
  with np.errstate(divide="ignore"):  # a rate of 0: infinitely many halvings, capped
    k = np.floor(-np.log2(np.maximum(rate, 0.0)) + 1e-6)  # float32: peak/2 may be an ulp above
  k = np.where(steps >= warmup, np.minimum(k, MAX_HALVINGS), 0)
  k = np.maximum.accumulate(np.maximum(k, 0)) if len(k) else k
  return tuple(int(np.argmax(k >= j)) for j in range(1, int(k.max(initial=0)) + 1))


def _round(value, unit):
  return int(round(value)) if unit == "steps" else float(value)


def _power(cfg, peak, batch_size, ramp, unit, warmup, horizon):
  """(schedule after the warmup, its value at the warmup's end) of the Power scheduler."""
  if batch_size is None or ramp is None:
    raise ValueError("optim.schedule='power' needs the batch size and sequence length")
  a, b = float(cfg.power_a), float(cfg.power_b)
  law_py = lambda n: min(peak, batch_size * a * max(n, 1.0) ** b)
  tokens_py = lambda x: ramp.convert(float(x), unit, "tokens")
  if unit == "tokens":
    tokens = lambda x: x
  elif unit == "examples":
    tokens = lambda x: x * float(ramp.seq_len)
  else:
    tokens = lambda x: ramp.examples_before_traced(x) * float(ramp.seq_len)
  one = 1 if unit == "steps" else 1.0
  decay = max(_round(horizon * float(cfg.wsd_decay_fraction), unit), one)
  decay_start = max(horizon - decay, warmup)
  at_decay = law_py(tokens_py(decay_start))
  tail = _decay_shape(cfg.wsd_decay_shape, at_decay, at_decay * float(cfg.min_lr_ratio), decay)

  def after_warmup(count):  # count: position after the warmup, in `unit`
    x = count + warmup
    n = jnp.maximum(jnp.asarray(tokens(x), jnp.float32), 1.0)
    law = jnp.minimum(peak, batch_size * a * jnp.power(n, b))
    return jnp.where(x < decay_start, law, tail(x - decay_start))

  return after_warmup, law_py(tokens_py(warmup)) if warmup > 0 else peak


def describe(cfg, total_steps: int, ramp: BatchRamp | None) -> str:
  """One line: the schedule, its unit and its lengths (what a run prints at start)."""
  unit = cfg.get("schedule_unit", "steps")
  warmup = length(cfg, "warmup", unit, ramp)
  horizon = length(cfg, "decay", unit, ramp, default_steps=int(total_steps))
  text = f"schedule {cfg.schedule} in {unit}: warmup {warmup:,.0f}, horizon {horizon:,.0f}"
  if ramp is not None and unit != "steps":
    text += (f" (= {ramp.convert(float(warmup), unit, 'steps'):,.1f} and "
             f"{ramp.convert(float(horizon), unit, 'steps'):,.1f} steps)")
  return text


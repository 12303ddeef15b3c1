"""Learning-rate schedules, all functions of the optimizer step count.

`build_schedule(cfg, total_steps)` composes optax pieces: a linear warmup from 0, then one of

  constant   peak for ever
  cosine     cosine decay to `min_lr_ratio * peak` at `decay_steps` (Loshchilov & Hutter 2017)
  linear     linear decay to `min_lr_ratio * peak` at `decay_steps`
  wsd        warmup-stable-decay (MiniCPM, Hu et al. 2024): constant until the last
             `wsd_decay_fraction` of `decay_steps`, then a decay of shape `wsd_decay_shape`
             (linear, cosine or 1-sqrt) to `min_lr_ratio * peak`.

`decay_steps` is the schedule's horizon. It is a setting of its own (not `steps`) so that a run
can be stopped and continued with a different `steps` and still follow the same curve.
"""
from __future__ import annotations

import jax.numpy as jnp
import optax

SCHEDULES = ("constant", "cosine", "linear", "wsd")
WSD_SHAPES = ("linear", "cosine", "sqrt")


def _decay_shape(shape: str, peak: float, end: float, steps: int) -> optax.Schedule:
  steps = max(int(steps), 1)
  if shape == "linear":
    return optax.linear_schedule(peak, end, steps)
  if shape == "cosine":
    return optax.cosine_decay_schedule(peak, steps, alpha=end / peak if peak else 0.0)
  if shape == "sqrt":  # 1 - sqrt(t): the shape MiniCPM / Hägele et al. 2024 found best for WSD
    return lambda count: end + (peak - end) * (
        1.0 - jnp.sqrt(jnp.clip(count / steps, 0.0, 1.0)))
  raise ValueError(f"unknown decay shape {shape!r}; choose from {WSD_SHAPES}")


def build_schedule(cfg, total_steps: int) -> optax.Schedule:
  """Schedule from the `optim` config block. `total_steps` fills `decay_steps` <= 0."""
  peak = float(cfg.learning_rate)
  warmup = int(cfg.warmup_steps)
  horizon = int(cfg.decay_steps) if int(cfg.decay_steps) > 0 else int(total_steps)
  end = peak * float(cfg.min_lr_ratio)
  after = max(horizon - warmup, 1)
  kind = cfg.schedule
  if kind == "constant":
    main = optax.constant_schedule(peak)
  elif kind in ("cosine", "linear"):
    main = _decay_shape(kind, peak, end, after)
  elif kind == "wsd":
    decay = max(int(round(horizon * float(cfg.wsd_decay_fraction))), 1)
    stable = max(after - decay, 0)
    main = optax.join_schedules(
        [optax.constant_schedule(peak), _decay_shape(cfg.wsd_decay_shape, peak, end, decay)],
        [stable])
  else:
    raise ValueError(f"unknown schedule {kind!r}; choose from {SCHEDULES}")
  if warmup <= 0:
    return main
  return optax.join_schedules([optax.linear_schedule(0.0, peak, warmup), main], [warmup])

"""The gradient noise scale, measured online (McCandlish et al. 2018, Appendix A).

B_simple = tr(Sigma) / |G|^2 predicts the critical batch. As E |G_b|^2 = |G|^2 + tr(Sigma) / b
for a batch of b, squared gradient norms at two sizes b < B give unbiased estimates (`estimate`):

  |G|^2     ~ (B |G_B|^2 - b |G_b|^2) / (B - b)
  tr(Sigma) ~ (|G_b|^2 - |G_B|^2) / (1/b - 1/B)

B is the measuring step's batch, b its `optim.noise_scale_pieces` small batches (their
harmonic-mean size), in target tokens. Both estimates are summed over the measurements of the
last `optim.noise_scale_window` of the training so far (a fraction of the examples read) before
the ratio is taken. The meter is an optax
transformation that changes nothing, first in the chain: it takes the norms as `update(...,
noise_sample=)` and keeps its averages in the optimizer state. Why and details:
docs/batch_size.md#gradient-noise-scale
"""
from __future__ import annotations

import math
from collections.abc import Callable
from typing import Any, NamedTuple

import jax
import jax.numpy as jnp
import optax


def estimate(sq_norm_small, sq_norm_big, b_small, b_big):
  """Unbiased (|G|^2, tr(Sigma)) from squared gradient norms at batch sizes b_small < b_big.

  Works on Python floats, numpy or jax arrays. `sq_norm_small` is |G_b|^2 (or its mean over
  several disjoint small batches), `sq_norm_big` is |G_B|^2.
  """
  g_sq = (b_big * sq_norm_big - b_small * sq_norm_small) / (b_big - b_small)
  trace_sigma = (sq_norm_small - sq_norm_big) / (1.0 / b_small - 1.0 / b_big)
  return g_sq, trace_sigma


class Sample(NamedTuple):
  """One step's measurement: squared norms and the batch sizes (in target tokens) they had."""
  sq_norm_small: jax.Array
  sq_norm_big: jax.Array
  b_small: jax.Array
  b_big: jax.Array


BUCKETS = 8  # buckets per window: the window's edge is known to 1 / BUCKETS of its length
SLOTS = BUCKETS + 2  # ring slots: the window's buckets, the one in progress, one spare


class NoiseScaleState(NamedTuple):
  g_sq: jax.Array  # [SLOTS] sums of the |G|^2 estimates in each slot's bucket
  trace_sigma: jax.Array  # [SLOTS] sums of the tr(Sigma) estimates
  count: jax.Array  # [SLOTS] measurements in each bucket
  bucket: jax.Array  # [SLOTS] int32: the bucket each slot holds (-1: none)
  first: jax.Array  # int32: the window's first bucket at the last measurement
  clock: jax.Array  # the training done through the last measurement (the meter's clock)


def meter(window: float, clock: Callable[[Any], Any] = lambda step: step + 1
          ) -> optax.GradientTransformationExtraArgs:
  """The identity transformation that sums the estimates of the measurements in the last
  `window` (a fraction in (0, 1]) of the training so far: those after (1 - window) T, T the
  clock of the newest. `clock(step)`: the training done through step `step` (0-based), in any
  unit that grows with the data read (examples under a batch ramp). The sums are kept in
  buckets of geometric length (BUCKETS per window, each (1 - window) ** (-1 / BUCKETS) times
  the last), so the ring of SLOTS slots covers the window at any length of training."""
  log_ratio = -math.log(1.0 - window) / BUCKETS if window < 1 else math.inf

  def bucket_of(t):  # the bucket of clock t (all of training is bucket 0 when window = 1)
    if math.isinf(log_ratio):
      return jnp.zeros((), jnp.int32)
    return jnp.floor(jnp.log(jnp.maximum(t, 1e-12)) / log_ratio).astype(jnp.int32)

  def init(params):
    del params
    zeros = jnp.zeros((SLOTS,), jnp.float32)
    return NoiseScaleState(zeros, zeros, zeros, jnp.full((SLOTS,), -1, jnp.int32),
                           jnp.zeros((), jnp.int32), jnp.zeros((), jnp.float32))

  def update(updates, state, params=None, *, noise_sample: Sample | None = None, step=None,
             **extra):
    del params, extra
    if noise_sample is None:
      return updates, state
    g_sq, trace_sigma = estimate(*(jnp.asarray(x, jnp.float32) for x in noise_sample))
    now = jnp.asarray(clock(step), jnp.float32)
    b = bucket_of(now)
    here = jnp.arange(SLOTS) == b % SLOTS
    fresh = here & (state.bucket != b)  # the slot held an older bucket: start it again
    add = lambda sums, value: jnp.where(fresh, 0.0, sums) + jnp.where(here, value, 0.0)
    return updates, NoiseScaleState(
        add(state.g_sq, g_sq), add(state.trace_sigma, trace_sigma), add(state.count, 1.0),
        jnp.where(here, b, state.bucket), bucket_of((1.0 - window) * now), now)

  return optax.GradientTransformationExtraArgs(init, update)


def splits(num_micro: int, pieces: int, rows_per_device: int, *, together: bool = False) -> int:
  """Into how many equal parts a measuring step splits each of its `num_micro` micro-batches
  (1: not at all): enough for `pieces` small batches in all where the rows each device holds
  divide so (a part must keep every device's share of the rows equal), else as many as they do.
  `together`: the micro-batches run as one (a pipeline), so each small batch is one part of
  every micro-batch. A step that cannot make 2 small batches gets 1 (the config checks refuse
  it)."""
  want = max(1, -(-pieces // (1 if together else num_micro)))
  return max(r for r in range(1, want + 1) if rows_per_device % r == 0)


def split_rows(x: jax.Array, parts: int) -> jax.Array:
  """[M, B, ...] -> [M, parts, B / parts, ...]: part j of a micro-batch holds its rows j, j +
  parts, ... (a device's block of rows stays on it when B / devices divides by `parts`)."""
  m, rows = x.shape[:2]
  return x.reshape(m, rows // parts, parts, *x.shape[2:]).swapaxes(1, 2)


def find_state(opt_state: Any) -> NoiseScaleState | None:
  """The meter's state inside an optimizer state, or None if the optimizer has no meter."""
  found = [x for x in jax.tree.leaves(opt_state, is_leaf=_is_state) if _is_state(x)]
  return found[0] if found else None


def _is_state(x) -> bool:
  return isinstance(x, NoiseScaleState)


def readout(state: NoiseScaleState) -> dict[str, jax.Array]:
  """The window's mean estimates and B_simple = tr(Sigma) / |G|^2, the ratio of their sums (NaN
  until the window's |G|^2 sum is positive), and its count of measurements."""
  inside = (state.bucket >= state.first) & (state.bucket >= 0)
  count = jnp.sum(jnp.where(inside, state.count, 0.0))
  g_sq = jnp.sum(jnp.where(inside, state.g_sq, 0.0)) / jnp.maximum(count, 1.0)
  trace_sigma = jnp.sum(jnp.where(inside, state.trace_sigma, 0.0)) / jnp.maximum(count, 1.0)
  b_simple = jnp.where(g_sq > 0, trace_sigma / jnp.where(g_sq > 0, g_sq, 1.0), jnp.nan)
  return {"g_sq": g_sq, "trace_sigma": trace_sigma, "b_simple": b_simple, "count": count}

"""The gradient noise scale, measured online (McCandlish et al. 2018, Appendix A).

B_simple = tr(Sigma) / |G|^2 predicts the critical batch. As E |G_b|^2 = |G|^2 + tr(Sigma) / b,
squared gradient norms at two sizes b < B (a step's `optim.noise_scale_pieces` small batches,
their harmonic-mean size, and the whole batch, in target tokens) give unbiased estimates of both
(`estimate`). The meter keeps them over the last `optim.noise_scale_window` of the training so
far (of the examples read) and reads tr(Sigma) as their mean (it changes slowly and its
estimates are heavy-tailed), |G|^2 as their mean weighted by exp(-age / (r x the training so
far)) (it falls as B_simple rises: an even mean reads the window's early steps), r the shortest
memory (`noise_scale_recency` doubled up to DOUBLINGS times, then the even mean) whose mean the
per-step estimates' spread pins down to MEMORY_RSE (one step's estimate is noisy when B_simple
>> B: a longer memory, not a hidden value); no value while the even mean's relative standard
error exceeds a bound. For the Adam family also tr(P Sigma) / G^T P G, the same with sqrt(P) g,
P = 1 / (sqrt(v_hat) + eps) (`preconditioner`). An optax transformation that changes nothing,
first in the chain (`update(..., noise_sample=)`). docs/batch_size.md, docs/noisy_quadratic.md
"""
from __future__ import annotations

import math
from collections.abc import Callable
from typing import Any, NamedTuple

import jax
import jax.numpy as jnp
import numpy as np
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
  """One step's measurement: squared norms and the batch sizes (in target tokens) they had; with
  a preconditioner P (`preconditioner`), also the squared norms of sqrt(P) g (None: not
  measured)."""
  sq_norm_small: jax.Array
  sq_norm_big: jax.Array
  b_small: jax.Array
  b_big: jax.Array
  sq_norm_small_precond: jax.Array | None = None
  sq_norm_big_precond: jax.Array | None = None


BUCKETS = 8  # buckets per window: the window's edge is known to 1 / BUCKETS of its length
SLOTS = BUCKETS + 2  # ring slots: the window's buckets, the one in progress, one spare
PRECONDITIONED = ("adamw", "lamb")  # optim.name values whose second moments make P
# |G|^2's memory (`readout`): the recency doubled up to DOUBLINGS times, then the whole window
# evenly; the shortest whose weighted mean has a predicted relative standard error <= MEMORY_RSE
# (docs/noisy_quadratic.md#the-memory: the NQM at batches 8-1024 and sweep_tiny chose it)
DOUBLINGS = 4
MEMORY_RSE = 0.4


class NoiseScaleState(NamedTuple):
  g_sq: jax.Array  # [SLOTS] sums of the |G|^2 estimates in each slot's bucket
  g_sq_sq: jax.Array  # [SLOTS] sums of their squares (the precision of the window's |G|^2)
  trace_sigma: jax.Array  # [SLOTS] sums of the tr(Sigma) estimates
  count: jax.Array  # [SLOTS] measurements in each bucket
  g_sq_precond: jax.Array  # [SLOTS] sums of the G^T P G estimates
  g_sq_sq_precond: jax.Array  # [SLOTS] sums of their squares
  trace_precond: jax.Array  # [SLOTS] sums of the tr(P Sigma) estimates
  count_precond: jax.Array  # [SLOTS] preconditioned measurements in each bucket
  bucket: jax.Array  # [SLOTS] int32: the bucket each slot holds (-1: none)
  first: jax.Array  # int32: the window's first bucket at the last measurement
  clock: jax.Array  # the training done through the last measurement (the meter's clock)
  step: jax.Array  # int32: the last measuring step + 1 (0: none yet)
  settings: jax.Array  # [4] (window, recency, minimum of measurements, largest relative standard
  # error of |G|^2; 0: no bound) the sums were made with
  second_moments: jax.Array  # [3] (b2, eps, clip norm) of the Adam moments P is made of; [1]: no P
  # (one placeholder, not [0]: orbax does not save zero-size arrays)


def meter(window: float, clock: Callable[[Any], Any] = lambda step: step + 1, *,
          recency: float = 0.0, min_measurements: int = 1, max_rse: float = 0.0,
          second_moments: tuple[float, float, float] | None = None
          ) -> optax.GradientTransformationExtraArgs:
  """The identity transformation that sums the estimates of the measurements in the last
  `window` (a fraction in (0, 1]) of the training so far: those after (1 - window) T, T the
  clock of the newest. `clock(step)`: the training done through step `step` (0-based), in any
  unit that grows with the data read (examples under a batch ramp). The sums are kept in buckets
  of geometric length (BUCKETS per window, each (1 - window) ** (-1 / BUCKETS) times the last),
  so the ring of SLOTS slots covers the window at any length of training. `readout` takes
  tr(Sigma) as the window's mean and |G|^2 as its mean weighted by exp(-age / (r T)), age = T -
  a bucket's middle, r the shortest of `recency` x 2^k (k <= DOUBLINGS) whose mean is precise
  enough, else the even mean (`recency` 0: always even; a fraction of the training so far, so
  the memory is in training, not in measurements), and gives no value (NaN) until the window
  holds `min_measurements` or while the relative standard error of its even |G|^2 mean (`rse`)
  exceeds `max_rse` (0: no bound).
  `second_moments` (b2, eps, the global-norm clipping before them, 0: none): how the
  optimizer's Adam-family second moments are made, which `preconditioner` turns into P; the
  preconditioned estimates are kept beside the plain ones.
  A state made with other settings, or whose last measurement the clock now places elsewhere
  (a changed batch ramp on resume), is emptied at the next measurement."""
  log_ratio = -math.log(1.0 - window) / BUCKETS if window < 1 else math.inf
  # numpy, not jax arrays: constants a jitted step embeds (a closed-over jax array becomes an
  # argument of the compiled step, which the ahead-of-time compiled variants do not all share)
  settings = np.asarray([window, recency, min_measurements, max_rse], np.float32)
  moments = np.asarray(second_moments or (0.0,), np.float32)

  def bucket_of(t):  # the bucket of clock t (all of training is bucket 0 when window = 1)
    if math.isinf(log_ratio):
      return jnp.zeros((), jnp.int32)
    return jnp.floor(jnp.log(jnp.maximum(t, 1e-12)) / log_ratio).astype(jnp.int32)

  def init(params):
    del params
    zeros = jnp.zeros((SLOTS,), jnp.float32)
    zero = jnp.zeros((), jnp.int32)
    return NoiseScaleState(zeros, zeros, zeros, zeros, zeros, zeros, zeros, zeros,
                           jnp.full((SLOTS,), -1, jnp.int32), zero, jnp.zeros((), jnp.float32),
                           zero, jnp.asarray(settings), jnp.asarray(moments))

  def update(updates, state, params=None, *, noise_sample: Sample | None = None, step=None,
             **extra):
    del params, extra
    if noise_sample is None:
      return updates, state
    f32 = lambda x: jnp.asarray(x, jnp.float32)
    s = noise_sample
    g_sq, trace_sigma = estimate(f32(s.sq_norm_small), f32(s.sq_norm_big), f32(s.b_small),
                                 f32(s.b_big))
    valid = jnp.isfinite(g_sq) & jnp.isfinite(trace_sigma)  # (a step with < 2 pieces: NaN)
    if s.sq_norm_small_precond is None:
      g_p = t_p = jnp.zeros((), jnp.float32)
      valid_p = jnp.zeros((), bool)
    else:
      g_p, t_p = estimate(f32(s.sq_norm_small_precond), f32(s.sq_norm_big_precond),
                          f32(s.b_small), f32(s.b_big))
      valid_p = valid & jnp.isfinite(g_p) & jnp.isfinite(t_p)
    now = f32(clock(step))
    # Settings changed, or the clock moved the last measurement: the sums are not this window's.
    stale = jnp.any(state.settings != settings) | (
        (state.step > 0) & (jnp.abs(f32(clock(state.step - 1)) - state.clock)
                             > 0.5 + 1e-6 * state.clock))
    b = bucket_of(now)
    here = (jnp.arange(SLOTS) == b % SLOTS) & valid
    old = jnp.where(stale, -1, state.bucket)
    fresh = here & (old != b)  # the slot held an older bucket: start it again
    keep = ~(stale | fresh)
    add = lambda sums, value, ok: jnp.where(keep, sums, 0.0) + jnp.where(here & ok, value, 0.0)
    return updates, NoiseScaleState(
        add(state.g_sq, g_sq, True), add(state.g_sq_sq, g_sq * g_sq, True),
        add(state.trace_sigma, trace_sigma, True),
        add(state.count, 1.0, True), add(state.g_sq_precond, g_p, valid_p),
        add(state.g_sq_sq_precond, g_p * g_p, valid_p),
        add(state.trace_precond, t_p, valid_p), add(state.count_precond, 1.0, valid_p),
        jnp.where(here, b, old), bucket_of((1.0 - window) * now), now,
        jnp.asarray(step, jnp.int32) + 1, jnp.asarray(settings), jnp.asarray(moments))

  return optax.GradientTransformationExtraArgs(init, update)


def splits(num_micro: int, pieces: int, rows_per_device: int, *, together: bool = False,
           group: int = 1) -> int:
  """Into how many equal parts a measuring step splits each of its `num_micro` micro-batches
  (1: not at all): enough for `pieces` small batches in all where the rows each device holds
  divide so (a part must keep every device's share of the rows equal), else as many as they do.
  `together`: the micro-batches run as one (a pipeline), so each small batch is one part of
  every micro-batch. `group`: rows a part keeps whole (a ghost batch-norm group,
  models/resnet.py; none split where a group spans devices). A step that cannot make 2 small
  batches gets 1 (the config checks refuse it)."""
  units = rows_per_device // group if rows_per_device % group == 0 else 1
  want = max(1, -(-pieces // (1 if together else num_micro)))
  return max(r for r in range(1, want + 1) if units % r == 0)


def split_rows(x: jax.Array, parts: int, group: int = 1) -> jax.Array:
  """[M, B, ...] -> [M, parts, B / parts, ...]: part j of a micro-batch holds its groups of
  `group` rows j, j + parts, ... (group 1: its rows; a device's block of rows stays on it when
  B / devices divides by `parts` x `group`)."""
  m, rows = x.shape[:2]
  grouped = x.reshape(m, rows // (parts * group), parts, group, *x.shape[2:]).swapaxes(1, 2)
  return grouped.reshape(m, parts, rows // parts, *x.shape[2:])


def find_state(opt_state: Any) -> NoiseScaleState | None:
  """The meter's state inside an optimizer state, or None if the optimizer has no meter."""
  found = [x for x in jax.tree.leaves(opt_state, is_leaf=_is_state) if _is_state(x)]
  return found[0] if found else None


def _is_state(x) -> bool:
  return isinstance(x, NoiseScaleState)


def readout(state: NoiseScaleState, *, memory_rse: float = MEMORY_RSE, memory=None,
            memory_precond=None) -> dict[str, jax.Array]:
  """The window's mean tr(Sigma) estimate, its recency-weighted mean |G|^2 estimate (`meter`),
  and B_simple = their ratio; `memory` the recency its weights had (0: even), the shortest of
  `recency` x 2^k (k <= DOUBLINGS), then even, whose mean's predicted relative standard error
  (`memory_error`) is <= `memory_rse` (the last where none is; `memory=`, `memory_precond=`
  given: that one, as a replay of another meter's choice); `count` the window's measurements;
  `g_sq_rse` the relative standard error of the window's even |G|^2 mean (`rse`); `why` 0
  where B_simple has a value, else NaN and 1 (fewer than the minimum of measurements), 2 (the
  |G|^2 mean is not positive) or 3 (that relative standard error is above the bound); the same
  with P (`*_precond`)."""
  window, recency, least = state.settings[0], state.settings[1], state.settings[2]
  max_rse = state.settings[3]
  inside = (state.bucket >= state.first) & (state.bucket >= 0)
  # Each bucket's middle in the clock: bucket b spans [r^b, r^(b + 1)), the newest up to now.
  log_ratio = -jnp.log1p(-jnp.minimum(window, 1.0 - 1e-7)) / BUCKETS
  lo = jnp.exp(state.bucket * log_ratio)
  middle = (lo + jnp.minimum(lo * jnp.exp(log_ratio), state.clock)) / 2
  age = jnp.maximum(state.clock - middle, 0.0) / jnp.maximum(state.clock, 1e-12)
  # the memories to choose from, shortest first: [DOUBLINGS + 2] recencies (0: even), weights
  ladder = jnp.where(recency > 0, jnp.append(recency * 2.0 ** jnp.arange(DOUBLINGS + 1.0), 0.0),
                     0.0)
  weights = jnp.where(ladder[:, None] > 0, jnp.exp(
      -age[None] / jnp.where(ladder > 0, ladder, 1.0)[:, None]), 1.0)
  if_in = lambda x: jnp.where(inside, x, 0.0)

  def ratio(g_sums, g_squares, trace_sums, counts, forced):
    count = jnp.sum(if_in(counts))
    trace = jnp.sum(if_in(trace_sums)) / jnp.maximum(count, 1.0)
    error = memory_error(if_in(g_sums), if_in(g_squares), if_in(counts), weights)
    pick = jnp.argmax(jnp.append(error[:-1] <= memory_rse, True))  # the first precise enough
    if forced is not None:
      pick = jnp.argmin(jnp.abs(ladder - forced))
    w = if_in(weights[pick])
    g_sq = jnp.sum(w * g_sums) / jnp.maximum(jnp.sum(w * counts), 1e-30)
    even_error = rse(if_in(g_sums), if_in(g_squares), if_in(counts))
    why = jnp.where(count < jnp.maximum(least, 1.0), 1, jnp.where(
        g_sq <= 0, 2, jnp.where((max_rse > 0) & ~(even_error <= max_rse), 3, 0)))
    ok = why == 0
    return (g_sq, trace, jnp.where(ok, trace / jnp.where(ok, g_sq, 1.0), jnp.nan), count,
            even_error, why.astype(jnp.int32), ladder[pick], error[pick])

  names = ("g_sq", "trace_sigma", "b_simple", "count", "g_sq_rse", "why", "memory",
           "memory_error")
  out = dict(zip(names, ratio(state.g_sq, state.g_sq_sq, state.trace_sigma, state.count,
                              memory)))
  out.update(zip((f"{k}_precond" for k in names),
                 ratio(state.g_sq_precond, state.g_sq_sq_precond, state.trace_precond,
                       state.count_precond, memory_precond)))
  out["trace_precond"] = out.pop("trace_sigma_precond")
  return out


def memory_error(sums, squares, counts, weights):
  """[memories] the predicted relative standard error of the |G|^2 mean under each row of
  `weights` [memories, buckets] (per bucket, as `readout` weighs them), from the window's
  per-bucket `sums`, `squares` and `counts` of per-step estimates: sqrt(s^2 sum_b w_b^2 n_b) /
  sum_b w_b n_b over the window's even mean, s^2 the variance within buckets (their noise, not
  the drift of |G|^2 across the window; the whole window's where no bucket holds two). Neither
  s^2 nor the even mean leans on the recent estimates the value is read from (a bound on the
  weighted mean's own error selects: docs/noisy_quadratic.md#the-gate). inf for a mean that is
  not positive."""
  n, total = jnp.sum(counts), jnp.sum(sums)
  mean = total / jnp.maximum(n, 1.0)
  within = jnp.sum(jnp.where(counts > 0, squares - sums * sums / jnp.maximum(counts, 1.0), 0.0))
  dof = jnp.sum(jnp.maximum(counts - 1.0, 0.0))
  overall = (jnp.sum(squares) - n * mean * mean) / jnp.maximum(n - 1.0, 1.0)
  var = jnp.maximum(jnp.where(dof > 0, within / jnp.maximum(dof, 1.0), overall), 0.0)
  sw, sw2 = weights @ counts, (weights * weights) @ counts
  ok = mean > 0
  return jnp.where(ok, jnp.sqrt(var * sw2) / jnp.maximum(sw, 1e-30) / jnp.where(ok, mean, 1.0),
                   jnp.inf)


def rse(sums, squares, counts):
  """The relative standard error of the window's even mean of its n per-step estimates x_k,
  from their `sums`, `squares` and `counts` (per bucket): sqrt(s^2 / n) / mean, s^2 their
  sample variance (a drift inside the window counts as spread). inf for n < 2 or a mean that is
  not positive. Of the even mean, not the recency-weighted one: a bound on the weighted mean's
  own error would pass the steps whose recent estimates ran high and read B_simple low (on the
  NQM at batch 8 a median 0.68 of the truth, against 0.85 without a bound);
  docs/noisy_quadratic.md#the-gate."""
  n, total, total_sq = jnp.sum(counts), jnp.sum(sums), jnp.sum(squares)
  mean = total / jnp.maximum(n, 1.0)
  var = jnp.maximum(total_sq - n * mean * mean, 0.0) / jnp.maximum(n - 1.0, 1.0)
  ok = (n >= 2) & (mean > 0)
  return jnp.where(ok, jnp.sqrt(var / jnp.maximum(n, 1.0)) / jnp.where(ok, mean, 1.0), jnp.inf)


def has_preconditioner(state: NoiseScaleState) -> bool:
  """Whether the meter keeps preconditioned estimates (static: from the state's shapes)."""
  return state.second_moments.shape[0] == 3


def preconditioner(opt_state: Any, grads: Any = None, *, grad_sq: Any = None) -> Any | None:
  """P = 1 / (sqrt(v_hat) + eps) per parameter as this step's Adam update divides by it: v_hat
  = (b2 nu + (1 - b2) g^2) / (1 - b2^(count + 1)) from optax's ScaleByAdamState in `opt_state`
  (before the update) and the step's gradient `grads` (clipped as the optimizer clips it), or
  `grad_sq` given in place of g^2; with the (b2, eps, clip) the meter was given. None where
  the meter keeps no preconditioned estimates."""
  state = find_state(opt_state)
  if state is None or not has_preconditioner(state):
    return None
  adam = [x for x in jax.tree.leaves(opt_state, is_leaf=_is_adam) if _is_adam(x)]
  if len(adam) != 1:
    raise ValueError(f"the preconditioned noise scale needs one Adam state, found {len(adam)}")
  b2, eps, clip = (state.second_moments[i] for i in range(3))
  if grad_sq is None:
    norm = optax.tree.norm(grads)
    scale = jnp.where((clip > 0) & (norm > clip), clip / jnp.maximum(norm, 1e-30), 1.0)
    grad_sq = jax.tree.map(lambda g: jnp.square(scale * g.astype(jnp.float32)), grads)
  correction = 1.0 - b2 ** (adam[0].count.astype(jnp.float32) + 1.0)
  return jax.tree.map(
      lambda v, g2: 1.0 / (jnp.sqrt((b2 * v.astype(jnp.float32) + (1 - b2) * g2) / correction)
                           + eps), adam[0].nu, grad_sq)


def _is_adam(x) -> bool:
  return isinstance(x, optax.ScaleByAdamState)


def weighted_sq_norm(tree: Any, weights: Any, *, squared: bool = False) -> jax.Array:
  """sum_i w_i x_i^2 over the leaves of `tree` (float32): |sqrt(P) g|^2 for P = `weights`;
  `squared`: the tree holds x^2 already."""
  square = (lambda x: x) if squared else jnp.square
  return sum(jnp.sum(w * square(x.astype(jnp.float32)))
             for x, w in zip(jax.tree.leaves(tree), jax.tree.leaves(weights)))


def piece_sums(grads: Any, tokens: jax.Array, squares: bool = False) -> tuple:
  """One small batch's terms of a measuring step's sums: (|g|^2 / t^2, 1 / t, 1) for its
  gradient sum `grads` over `tokens` target tokens t, with `squares` also g^2 / t^2 per
  parameter (a tree: the preconditioned norms take P after the step's gradient is known); all
  zero for a piece without target tokens (no small batch: its |g|^2 = 0 would read tr(Sigma)
  as -|G|^2)."""
  some = tokens > 0
  t = jnp.maximum(tokens, 1.0)
  out = (optax.tree.norm(grads, squared=True) / (t * t), 1.0 / t, jnp.ones((), jnp.float32))
  out = tuple(jnp.where(some, x, 0.0) for x in out)
  if squares:
    out += (jax.tree.map(lambda g: jnp.where(some, jnp.square(g.astype(jnp.float32) / t), 0.0),
                         grads),)
  return out

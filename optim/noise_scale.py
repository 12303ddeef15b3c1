"""The gradient noise scale, measured online (McCandlish et al. 2018, "An Empirical Model of
Large-Batch Training", Appendix A).

The simple noise scale B_simple = tr(Sigma) / |G|^2 (Sigma the per-example gradient covariance,
G the true gradient) predicts the critical batch: below it a bigger batch buys proportionally
fewer steps, above it hardly any. A gradient over a batch of b examples has
E |G_b|^2 = |G|^2 + tr(Sigma) / b, so squared norms at two batch sizes b < B give unbiased
estimates of both terms (`estimate`):

  |G|^2     ~ (B |G_B|^2 - b |G_b|^2) / (B - b)
  tr(Sigma) ~ (|G_b|^2 - |G_B|^2) / (1/b - 1/B)

Single-step estimates are noisy (the |G|^2 one is often negative), so each is smoothed by an
exponential moving average and the ratio is taken afterwards, as the paper does. The ratio of
averages is biased upward when the |G|^2 average is itself noisy, so the average must span
enough examples: `optim.noise_scale_ema` is the coefficient per measurement at the reference
batch, and at batch B it is rho ** (B / B_ref), the same number of examples at every batch.

When it is measured: only on the steps that log it (every `optim.noise_scale_every`-th). The
trainer compiles a measuring variant of the train step beside the plain one
(`Program.compile(measure_noise=True)`); every other step is exactly the step of a run without
the meter, and the meter's state passes through it unchanged. So the EMA below advances once
per measurement, and `noise_scale_ema` is its coefficient per measurement.

Where the two batch sizes come from (trainer/step/train_step.py): the big one is the whole global batch;
the small one is each accumulation micro-batch, whose gradient the scan computes anyway, so
the measurement costs one squared norm per micro-batch. The small-batch value is the mean of
|G_b|^2 over the micro-batches, with b their harmonic-mean size (so unequal token counts stay
unbiased). Without accumulation the measuring step splits its batch into two interleaved halves
for the same purpose (half the matmul batch on that step only). Batch sizes are counted in target tokens (the loss is a token mean), so the
estimate is B_noise in tokens; the trainer also reports it in sequences.

The meter is an optax transformation that changes nothing: it sits first in the optimizer
chain, receives the step's squared norms as an extra argument of `update` (`noise_sample`), and
keeps the moving averages in the optimizer state, so they are checkpointed, restored and left
alone by a skipped step like every other optimizer statistic.
"""
from __future__ import annotations

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


class NoiseScaleState(NamedTuple):
  g_sq: jax.Array  # EMA of the |G|^2 estimates (zero-initialised: divide by `weight`)
  trace_sigma: jax.Array  # EMA of the tr(Sigma) estimates
  weight: jax.Array  # EMA of 1: the debiasing denominator


def meter(decay: float) -> optax.GradientTransformationExtraArgs:
  """The identity transformation that keeps EMAs (coefficient `decay`) of the estimates."""

  def init(params):
    del params
    zero = jnp.zeros((), jnp.float32)
    return NoiseScaleState(zero, zero, zero)

  def update(updates, state, params=None, *, noise_sample: Sample | None = None, **extra):
    del params, extra
    if noise_sample is None:
      return updates, state
    g_sq, trace_sigma = estimate(*(jnp.asarray(x, jnp.float32) for x in noise_sample))
    ema = lambda old, new: decay * old + (1.0 - decay) * new
    return updates, NoiseScaleState(ema(state.g_sq, g_sq), ema(state.trace_sigma, trace_sigma),
                                    ema(state.weight, 1.0))

  return optax.GradientTransformationExtraArgs(init, update)


def find_state(opt_state: Any) -> NoiseScaleState | None:
  """The meter's state inside an optimizer state, or None if the optimizer has no meter."""
  found = [x for x in jax.tree.leaves(opt_state, is_leaf=_is_state) if _is_state(x)]
  return found[0] if found else None


def _is_state(x) -> bool:
  return isinstance(x, NoiseScaleState)


def readout(state: NoiseScaleState) -> dict[str, jax.Array]:
  """Debiased EMAs and B_simple = tr(Sigma) / |G|^2 (NaN until |G|^2's average is positive)."""
  weight = jnp.maximum(state.weight, 1e-12)
  g_sq, trace_sigma = state.g_sq / weight, state.trace_sigma / weight
  b_simple = jnp.where(g_sq > 0, trace_sigma / jnp.where(g_sq > 0, g_sq, 1.0), jnp.nan)
  return {"g_sq": g_sq, "trace_sigma": trace_sigma, "b_simple": b_simple}

"""The gradient noise scale, measured online (McCandlish et al. 2018, Appendix A).

B_simple = tr(Sigma) / |G|^2 predicts the critical batch. As E |G_b|^2 = |G|^2 + tr(Sigma) / b
for a batch of b, squared gradient norms at two sizes b < B give unbiased estimates (`estimate`):

  |G|^2     ~ (B |G_B|^2 - b |G_b|^2) / (B - b)
  tr(Sigma) ~ (|G_b|^2 - |G_B|^2) / (1/b - 1/B)

Each is smoothed by an EMA before the ratio is taken (`optim.noise_scale_ema` per measurement
at the reference batch, rho ** (B / B_ref) at batch B). B is the global batch, b an
accumulation micro-batch (their harmonic-mean size), both in target tokens; only the steps
that log it measure (`optim.noise_scale_every`). The meter is an optax transformation that
changes nothing, first in the chain: it takes the norms as `update(..., noise_sample=)` and
keeps its averages in the optimizer state. Why and details:
docs/batch_size.md#gradient-noise-scale
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

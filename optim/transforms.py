"""Gradient transformations optax does not have in the form we need.

Layer-wise trust ratio. LARS (You et al. 2017) and LAMB (You et al. 2019) scale each *layer's*
update by ||w|| / ||u||. Our layers are stacked along a leading `layers` axis (the model scans
over them), so a plain `optax.scale_by_trust_ratio` would take one norm over all layers at once.
This version takes the norms per layer slice: for a stacked leaf it reduces over every axis but
the first.
"""
from __future__ import annotations

import jax
import jax.numpy as jnp
import optax


def scale_by_layerwise_trust_ratio(mask, stacked, *, trust_coefficient: float = 1.0,
                                   eps: float = 0.0) -> optax.GradientTransformation:
  """Like `optax.scale_by_trust_ratio`, with norms per layer slice where `stacked` is True.

  `mask` and `stacked` are trees of bools with the structure of the params: the ratio applies
  where `mask` is True (elsewhere the update passes unchanged), per layer slice where `stacked`
  is True (leading layer axis). A zero parameter or update norm gives ratio 1 (as in optax), so
  zero-initialised tensors still move.
  """

  def update_fn(updates, state, params):
    if params is None:
      raise ValueError("the layer-wise trust ratio needs params: call update(g, s, params)")

    def scale(u, p, apply, is_stacked):
      if not apply:
        return u
      axes = tuple(range(1, p.ndim)) if is_stacked and p.ndim > 1 else None
      p_norm = jnp.sqrt(jnp.sum(jnp.square(p.astype(jnp.float32)), axis=axes, keepdims=True))
      u_norm = jnp.sqrt(jnp.sum(jnp.square(u.astype(jnp.float32)), axis=axes, keepdims=True))
      ratio = trust_coefficient * p_norm / (u_norm + eps)
      ratio = jnp.where((p_norm == 0.0) | (u_norm == 0.0), 1.0, ratio)
      return (u * ratio).astype(u.dtype)

    return jax.tree.map(scale, updates, params, mask, stacked), state

  return optax.GradientTransformation(optax.init_empty_state, update_fn)


def scale_by_learning_rate_at(schedule) -> optax.GradientTransformationExtraArgs:
  """`optax.scale_by_learning_rate(schedule)` whose clock can be given: `update(..., step=n)`
  scales by -schedule(n). The trainer passes `TrainState.step` (skipped steps included), so the
  rate is a pure function of the step ("One clock", docs/configs.md); without `step` it is
  optax's count of updates. The state is optax's `ScaleByScheduleState`."""

  def init(params):
    del params
    return optax.ScaleByScheduleState(count=jnp.zeros([], jnp.int32))

  def update(updates, state, params=None, *, step=None, **extra):
    del params, extra
    count = state.count if step is None else step
    lr = schedule(count)
    updates = jax.tree.map(lambda u: (-jnp.asarray(lr, u.dtype) * u), updates)
    return updates, optax.ScaleByScheduleState(count=optax.safe_increment(state.count))

  return optax.GradientTransformationExtraArgs(init, update)

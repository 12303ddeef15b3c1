"""An exponential moving average of the model's parameters (Polyak & Juditsky 1992), evaluated
alongside the raw model.

`ema_params(decay)` is an optax transformation that leaves the updates alone and keeps
ema <- decay * ema + (1 - decay) * (params + updates), i.e. the average of the parameters after
each step, starting from the initial parameters. It goes last in the optimizer chain, so the
average lives in the optimizer state: it is sharded like the parameters, checkpointed with them,
and untouched by a skipped step. It is kept in float32 whatever the parameters' dtype (a bf16
average would lose every update smaller than 1/256 of the weight).

The decay is a per-step coefficient, so what it averages over depends on the batch; How to
Scale Your EMA (Busbridge et al. 2023) moves it to another batch as rho ** (B / B_ref), which is
`optim.ema_rule = half_life` (optim/scaling.py).
"""
from __future__ import annotations

from typing import Any, NamedTuple

import jax
import jax.numpy as jnp
import optax


class EmaParamsState(NamedTuple):
  ema: Any  # float32 tree with the parameters' structure


def ema_params(decay: float) -> optax.GradientTransformation:

  def init(params):
    return EmaParamsState(jax.tree.map(lambda p: jnp.asarray(p, jnp.float32), params))

  def update(updates, state, params=None):
    if params is None:
      raise ValueError("the parameter EMA needs params: call update(g, s, params)")
    new = lambda e, p, u: decay * e + (1.0 - decay) * (p + u).astype(jnp.float32)
    return updates, EmaParamsState(jax.tree.map(new, state.ema, params, updates))

  return optax.GradientTransformation(init, update)


def find_ema(opt_state: Any, like: Any = None) -> Any | None:
  """The averaged parameters inside an optimizer state (cast to `like`'s dtypes), or None."""
  is_state = lambda x: isinstance(x, EmaParamsState)
  found = [x for x in jax.tree.leaves(opt_state, is_leaf=is_state) if is_state(x)]
  if not found:
    return None
  ema = found[0].ema
  if like is not None:
    ema = jax.tree.map(lambda e, p: e.astype(p.dtype), ema, like)
  return ema

"""DiLoCo: its settings and its outer optimizer (the maths of the outer step).

M replicas start from the same parameters theta (the anchor) and take H inner steps each on
their own data, exchanging nothing; then the outer step

    Delta = theta - (1/M) sum_r theta_r            (the mean pseudo-gradient)
    theta <- OuterOpt(theta, Delta)                (Nesterov SGD: lr 0.7, momentum 0.9)

and every replica restarts from the new anchor, keeping its inner optimizer state. This module
has no model or mesh: the settings (`DiLoCoConfig`), the outer optimizer (`outer_optimizer`,
optax) and `outer_update`, the outer step on parameter trees; the trainer holds the replicas
(trainer/step/diloco.py). Why and details: docs/diloco.md#how-it-works
"""
from __future__ import annotations

import dataclasses
from typing import Any

import jax
import jax.numpy as jnp
import optax


@dataclasses.dataclass(frozen=True)
class DiLoCoConfig:
  """`optim.diloco.*`: `replicas` M (0 = off: plain data parallelism), `inner_steps` H, and the
  outer Nesterov SGD's `outer_lr` and `outer_momentum` (0 = plain SGD)."""
  replicas: int
  inner_steps: int = 32
  outer_lr: float = 0.7
  outer_momentum: float = 0.9

  @classmethod
  def from_config(cls, optim_cfg) -> "DiLoCoConfig | None":
    """The settings of a DiLoCo run, or None when `optim.diloco.replicas` is 0."""
    d = optim_cfg.diloco
    if not d.replicas:
      return None
    return cls(replicas=int(d.replicas), inner_steps=int(d.inner_steps),
               outer_lr=float(d.outer_lr), outer_momentum=float(d.outer_momentum))

  def is_outer_step(self, step: int) -> bool:
    """Whether the outer step follows inner step `step` (1-based): every H-th, a pure function of
    the step count (the same on every process and after a resume)."""
    return step % self.inner_steps == 0

  def describe(self) -> str:
    outer = (f"Nesterov SGD lr {self.outer_lr:g} momentum {self.outer_momentum:g}"
             if self.outer_momentum else f"SGD lr {self.outer_lr:g} (no momentum)")
    return (f"DiLoCo: {self.replicas} replica(s), an outer step every {self.inner_steps} inner "
            f"step(s); outer optimizer {outer}")


def outer_optimizer(cfg: DiLoCoConfig) -> optax.GradientTransformation:
  """Nesterov SGD on the outer gradient (optax.sgd; its state is one momentum tree)."""
  return optax.sgd(cfg.outer_lr, momentum=cfg.outer_momentum or None,
                   nesterov=cfg.outer_momentum > 0)


def outer_gradient(anchor: Any, replica_params: Any) -> Any:
  """Delta = anchor - mean over the leading replica axis of `replica_params` [M, ...], summed in
  float32 and returned in the anchor's dtype (the outer optimizer's state keeps that dtype)."""
  return jax.tree.map(
      lambda a, p: (a.astype(jnp.float32) - jnp.mean(p.astype(jnp.float32), axis=0)
                    ).astype(a.dtype), anchor, replica_params)


def outer_update(tx: optax.GradientTransformation, anchor: Any, replica_params: Any,
                 outer_state: Any) -> tuple[Any, Any, dict[str, jax.Array]]:
  """The outer step: (new anchor, new outer optimizer state, metrics) from the anchor and the
  replicas' parameters [M, ...]. Metrics: `outer_grad_norm` (|Delta|) and `outer_update_norm`
  (how far the anchor moved)."""
  delta = outer_gradient(anchor, replica_params)
  updates, outer_state = tx.update(delta, outer_state, anchor)
  new_anchor = optax.apply_updates(anchor, updates)
  metrics = {"outer_grad_norm": optax.tree.norm(delta),
             "outer_update_norm": optax.tree.norm(updates)}
  return new_anchor, outer_state, metrics

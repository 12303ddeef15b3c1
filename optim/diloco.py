"""DiLoCo: its settings and its outer optimizer (the maths of the outer step).

Douillard et al. 2023, "DiLoCo: Distributed Low-Communication Training of Language Models":
M replicas start from the same parameters theta (the *anchor*) and each takes H steps of an
ordinary (inner) optimizer on its own data, exchanging nothing. Then the outer step averages
their parameter changes into the outer gradient

    Delta = theta - (1/M) sum_r theta_r            (the mean pseudo-gradient)

and applies an outer optimizer to the anchor, theta <- OuterOpt(theta, Delta): Nesterov SGD with
learning rate 0.7 and momentum 0.9 in the paper (and here by default); every replica restarts from
the new anchor, keeping its own inner optimizer state. Only the outer step communicates: one
all-reduce of the parameters every H steps, instead of the gradient's at every step.
Charles et al. 2025, "Communication-Efficient Language Model Training Scales Reliably and
Robustly: Scaling Laws for DiLoCo", find that this scales predictably with model size, that
M = 1 (Lookahead-like: theta <- theta - lr x Nesterov(theta - theta_H)) can beat plain data
parallelism, and that DiLoCo's optimal global batch is larger than data parallelism's.

Two checks of the maths (tests/test_diloco.py): with H = 1, an SGD inner optimizer and an outer
SGD of rate 1 without momentum, the anchor after each step is the replicas' mean, which for a
linear inner optimizer is data parallelism's update on the global batch; with M = 1 the outer
step is the Lookahead-style update computed by hand.

The trainer holds the replicas and runs the steps (trainer/step/diloco.py); this module has no
model or mesh: the settings (`DiLoCoConfig`), the outer optimizer (`outer_optimizer`, optax), and
`outer_update`, the outer step on parameter trees.
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

"""DiLoCo in the trainer: the replicas' state, their inner step, the outer step, evaluation (the
maths and settings are optim/diloco.py; this module lays them onto the mesh).

  DiLoCoState      parameters, inner optimizer state and guard counters with a leading [M]
                   dimension over the `replica` axis (`sharding.mesh.over_replicas`); the shared
                   step counter; the outer state (anchor, momentum) laid out like the parameters
  make_inner_step  the plain train step vmapped over `replica`: replica r steps on block r of
                   the global batch's rows, with no collective over `replica`
  reduce_metrics   the replicas' [M] metrics into the run's row: counts summed, the loss weighted
                   by target tokens, the rest averaged
  make_outer_step  every H-th step: the parameters' mean over `replica`, the outer optimizer,
                   every replica set to the new anchor
  make_eval_step   the plain evaluation mapped over the replicas, scoring the anchor

Why and details: docs/diloco.md#how-it-works.
"""
from __future__ import annotations

from typing import Any

import flax
import jax
import jax.numpy as jnp
import optax
from jax.sharding import NamedSharding
from jax.sharding import PartitionSpec as P

from optim.diloco import outer_update
from sharding.mesh import over_replicas, replicated
from sharding.rules import REPLICA_AXIS
from trainer.step.state import (ModelSpec, TrainState, fresh_state, init_sharded, optimizer_shardings,
                           state_shardings as plain_state_shardings, with_shardings)
from trainer.step.train_step import loss_sums, make_train_step

# Metrics summed over the replicas (counts); per-token means weighted by the replicas' target
# tokens; the others are averaged (`reduce_metrics`).
SUMMED = ("target_tokens", "skipped", "nonfinite", "spike")
TOKEN_WEIGHTED = ("loss",)


@flax.struct.dataclass
class DiLoCoState:
  step: jax.Array  # int32 scalar: inner steps taken (the run's clock, as TrainState.step)
  params: Any  # [M, ...] each replica's parameters
  opt_state: Any  # [M, ...] each replica's inner optimizer state
  guard: Any  # [M] each replica's guard counters (trainer/step/train_step.py)
  anchor: Any  # the outer parameters: where every replica started at the last outer step
  outer_opt_state: Any  # the outer optimizer's state (Nesterov momentum)

  def inner(self) -> TrainState:
    return TrainState(step=self.step, params=self.params, opt_state=self.opt_state,
                      guard=self.guard)


# vmap axes of the replicas' TrainState: everything but the shared step counter is per replica.
_INNER_AXES = TrainState(step=None, params=0, opt_state=0, guard=0)


def state_shardings(spec: ModelSpec, tx: optax.GradientTransformation,
                    outer_tx: optax.GradientTransformation) -> DiLoCoState:
  """NamedShardings of the DiLoCoState (module docstring)."""
  inner = plain_state_shardings(spec, tx)
  per_replica = lambda tree: jax.tree.map(over_replicas, tree)
  return DiLoCoState(step=inner.step, params=per_replica(inner.params),
                     opt_state=per_replica(inner.opt_state), guard=per_replica(inner.guard),
                     anchor=spec.param_shardings,
                     outer_opt_state=optimizer_shardings(spec, outer_tx))


def _state_from_params(params, tx, outer_tx, replicas: int) -> DiLoCoState:
  """Every replica at `params` with a fresh inner optimizer state; anchor `params`."""
  inner = fresh_state(tx, params)
  stack = lambda tree: jax.tree.map(lambda x: jnp.broadcast_to(x, (replicas, *x.shape)), tree)
  return DiLoCoState(step=inner.step, params=stack(params), opt_state=stack(inner.opt_state),
                     guard=stack(inner.guard), anchor=params,
                     outer_opt_state=outer_tx.init(params))


def abstract_state(spec: ModelSpec, tx, outer_tx, replicas: int) -> DiLoCoState:
  """ShapeDtypeStructs (with target shardings) of the DiLoCoState, for restoring checkpoints."""
  shapes = jax.eval_shape(lambda p: _state_from_params(p, tx, outer_tx, replicas),
                          spec.abstract_params)
  return with_shardings(shapes, state_shardings(spec, tx, outer_tx))


def init_state(spec: ModelSpec, tx, outer_tx, replicas: int, params=None) -> DiLoCoState:
  """A fresh state: the model initialised from the run's seed (the same parameters a plain run
  starts from) or `params`, copied to every replica and the anchor."""
  return init_sharded(spec, lambda p: _state_from_params(p, tx, outer_tx, replicas),
                      state_shardings(spec, tx, outer_tx), params)


def split_rows(x: jax.Array, replicas: int, axis: int) -> jax.Array:
  """[..., B, ...] -> [M, ..., B/M, ...]: replica r takes the r-th block of rows along `axis`
  (the blocks `batch_sharding` puts on its devices, so the split moves no data)."""
  shape = x.shape[:axis] + (replicas, x.shape[axis] // replicas) + x.shape[axis + 1:]
  return jnp.moveaxis(x.reshape(shape), axis, 0)


def make_inner_step(spec: ModelSpec, tx, schedule, guard_cfg, replicas: int, *,
                    norm_metrics: bool = True):
  """step(DiLoCoState, batch[micro-batches, B, S]) -> (DiLoCoState, metrics [M]): every replica's
  plain train step on its B/M rows (module docstring); the outer state passes through."""
  plain = make_train_step(spec, tx, schedule, guard_cfg, norm_metrics=norm_metrics,
                          replicas=replicas)
  mapped = jax.vmap(plain, in_axes=(_INNER_AXES, 0), out_axes=(_INNER_AXES, 0),
                    spmd_axis_name=REPLICA_AXIS)

  def step(state: DiLoCoState, batch):
    inner, metrics = mapped(state.inner(), jax.tree.map(
        lambda x: split_rows(x, replicas, axis=1), batch))
    return state.replace(step=inner.step, params=inner.params, opt_state=inner.opt_state,
                         guard=inner.guard), metrics

  return step


def make_outer_step(outer_tx, replicas: int):
  """outer(DiLoCoState) -> (DiLoCoState, metrics): the anchor moved by the outer optimizer on
  the mean pseudo-gradient, every replica reset to it (inner optimizer states kept)."""

  def outer(state: DiLoCoState):
    anchor, outer_opt_state, metrics = outer_update(outer_tx, state.anchor, state.params,
                                                    state.outer_opt_state)
    params = jax.tree.map(lambda a: jnp.broadcast_to(a, (replicas, *a.shape)), anchor)
    return state.replace(params=params, anchor=anchor, outer_opt_state=outer_opt_state), metrics

  return outer


def metrics_sharding(mesh) -> NamedSharding:
  """The inner step's per-replica metrics [M] stay on their replicas."""
  return NamedSharding(mesh, P(REPLICA_AXIS))


def reduce_metrics(mesh):
  """A jitted `metrics -> metrics` over the replicas' [M] metrics (module docstring): counts
  summed, the loss weighted by target tokens, the rest averaged; scalars (the outer step's)
  pass through. Replicated, so every process can read it: the one collective over `replica`
  for metrics, a few scalars per step."""

  def reduce(metrics: dict) -> dict:
    tokens = metrics["target_tokens"].astype(jnp.float32)
    weights = tokens / jnp.maximum(jnp.sum(tokens), 1.0)

    def one(k, v):
      if not v.ndim:
        return v
      if k in SUMMED:
        return jnp.sum(v, axis=0)
      if k in TOKEN_WEIGHTED:
        return jnp.sum(v * weights, axis=0)
      return jnp.mean(v, axis=0)

    return {k: one(k, v) for k, v in metrics.items()}

  return jax.jit(reduce, out_shardings=replicated(mesh))


def make_eval_step(spec: ModelSpec, replicas: int):
  """eval(anchor, batch[B, S]) -> (loss sum, target tokens): each replica scores its B/M rows
  with the anchor; the sums are added over the replicas."""

  def plain(params, batch):
    return loss_sums(spec, params, batch)

  mapped = jax.vmap(plain, in_axes=(None, 0), spmd_axis_name=REPLICA_AXIS)

  def step(params, batch):
    loss_sum, tokens = mapped(params, jax.tree.map(lambda x: split_rows(x, replicas, 0), batch))
    return jnp.sum(loss_sum), jnp.sum(tokens)

  return step

"""Pipeline stages in the train step (`mesh.stage` > 1): the gradient sums through the pipeline,
and the layer order a circular pipeline stores. The schedule is sharding/pipeline.py, the model's
side models/pipeline.py, the start-up report trainer/tracking/report.py.

  grad_sums  trainer/step/train_step.py's `grad_sums` for a pipelined model: the pipeline's
             micro-batches are the step's M accumulation micro-batches, one value_and_grad runs
             through all of them (1f1b, zero_bubble: their loop's own backward), and the rest of
             the step is unchanged; the step that measures the noise scale runs it once per
             part of every micro-batch's rows (`optim.noise_scale_pieces` parts)
  Layout     the stored layer order and the plain stack checkpoints hold: the same for GPipe;
             stage-major with repeats (circular, interleaved), converted at every save and
             restore (`to_saved` / `from_saved`), so its checkpoints restore on any mesh

Why and details: docs/pipeline.md#what-it-does.
"""
from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np

from models import pipeline as model_pipeline
from optim import noise_scale
from sharding.pipeline import Pipeline, reorder


def grad_sums(spec, params, batch, *, measure_noise: bool = False, noise_parts: int = 2,
              squares: bool = False):
  """trainer/step/train_step.py's `grad_sums` for a pipelined model (module docstring): (loss
  sum, target tokens, gradient sum in float32 sharded like the parameters, noise-meter sums
  (`noise_scale.piece_sums` summed over the pieces) or None, MoE sums or None). Measuring the
  noise, the pipeline runs once per part of `noise_parts` (`noise_scale.split_rows`): part j of
  every micro-batch is one small batch."""
  pipe, moe = spec.pipeline, spec.cfg.moe
  step_tokens = jnp.maximum(jnp.sum(batch["loss_mask"].astype(jnp.float32)), 1.0)
  parts = [batch]
  if measure_noise:
    split = jax.tree.map(lambda x: noise_scale.split_rows(x, noise_parts), batch)
    parts = [jax.tree.map(lambda x, j=j: x[:, j], split) for j in range(noise_parts)]
  fraction = None
  if len(parts) > 1 and moe.enabled and moe.balance_scope == "global":
    fraction = model_pipeline.global_fraction(spec.model(params), pipe, batch)
  f32 = lambda tree: jax.tree.map(lambda g: g.astype(jnp.float32), tree)
  shard = lambda tree: jax.lax.with_sharding_constraint(tree, spec.param_shardings)
  out = None
  for piece in parts:
    kw = dict(step_tokens=step_tokens, parts=len(parts), fraction=fraction)
    if pipe.explicit:  # the schedule's loop computes the gradient (sharding/pipeline_vjp.py)
      (_, (loss_sum, tokens, moe_sums)), grads = model_pipeline.value_and_grad(
          spec.model(params), pipe, piece, **kw)
    else:
      objective = lambda p, b=piece: model_pipeline.objective(spec.model(p), pipe, b, **kw)
      (_, (loss_sum, tokens, moe_sums)), grads = jax.value_and_grad(objective, has_aux=True)(
          params)
    noise = noise_scale.piece_sums(grads, tokens, squares)
    if squares:
      noise = (*noise[:3], shard(noise[3]))
    now = (loss_sum, tokens, shard(f32(grads)), noise, moe_sums)
    out = now if out is None else jax.tree.map(jnp.add, out, now)
  loss_sum, tokens, grads, noise, moe_sums = out
  grads = shard(grads)
  return loss_sum, tokens, grads, noise if measure_noise else None, moe_sums


def loss_sums(spec, params, batch):
  """trainer/step/train_step.py's `loss_sums` (evaluation, one batch [B, S]), through the
  pipeline."""
  return model_pipeline.loss_sums(spec.model(params), spec.pipeline, batch)


# ----------------------------------------------------------------------------------------------
# The stored layer order


class Layout:
  """How the train state stores the layer stack, relative to the plain stack of checkpoints:
  identical unless the pipeline is circular (module docstring)."""

  def __init__(self, pipe: Pipeline | None, model_cfg, shardings):
    groups = model_cfg.num_layers // (model_cfg.moe.every if model_cfg.moe.enabled else 1)
    self.order = (pipe.stored_order(groups) if pipe is not None and pipe.repeats > 1 else None)
    self.shardings = shardings
    self._jitted = {}

  @property
  def reordered(self) -> bool:
    return self.order is not None

  def stored(self, tree, shardings):
    """Traceable: plain-order `tree` (laid out as `shardings`) in the stored order."""
    return tree if self.order is None else reorder(tree, shardings, self.order)

  def to_saved(self, state):
    """The train state with the plain layer stack (what a checkpoint holds)."""
    return self.conversion("to_saved")(state) if self.reordered else state

  def from_saved(self, state):
    """A state with the plain layer stack (restored) in the stored order."""
    return self.conversion("from_saved")(state) if self.reordered else state

  def conversion(self, name: str):
    """The jitted conversion "to_saved" or "from_saved" of a reordered layout (also compiled
    ahead of time by tools.memory_check: a save holds its output beside the state)."""
    if name not in self._jitted:
      order = np.argsort(self.order) if name == "to_saved" else self.order
      self._jitted[name] = jax.jit(lambda s: reorder(s, self.shardings, order),
                                   in_shardings=(self.shardings,), out_shardings=self.shardings)
    return self._jitted[name]

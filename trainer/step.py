"""The jitted train and eval steps.

The global batch arrives as [M, B, S] arrays: M micro-batches of B sequences. The step scans
over the micro-batches, summing the token-weighted loss and its gradient, then divides by the
number of target tokens of the whole batch, so the update is the same whatever M is (exact
gradient accumulation). M = 1 is the ordinary step.
"""
from __future__ import annotations

from typing import Any, Callable

import jax
import jax.numpy as jnp
import optax

from trainer.state import ModelSpec, TrainState


def loss_sums(spec: ModelSpec, params, batch) -> tuple[jax.Array, jax.Array]:
  """(sum of token cross-entropies over the batch, number of target tokens), in fp32."""
  model = spec.model(params)
  logits_BSV = model(batch["inputs"], batch["positions"], batch["segment_ids"])
  losses_BS = optax.softmax_cross_entropy_with_integer_labels(logits_BSV, batch["targets"])
  mask_BS = batch["loss_mask"].astype(jnp.float32)
  return jnp.sum(losses_BS * mask_BS), jnp.sum(mask_BS)


def make_train_step(spec: ModelSpec, tx: optax.GradientTransformation,
                    schedule: Callable[[Any], Any]):
  """step(state, batch[M, B, S]) -> (state, metrics)."""

  def grads_of(params, micro_batch):
    (loss_sum, tokens), grads = jax.value_and_grad(
        lambda p: loss_sums(spec, p, micro_batch), has_aux=True)(params)
    return loss_sum, tokens, grads

  def step(state: TrainState, batch) -> tuple[TrainState, dict[str, jax.Array]]:
    num_micro = jax.tree.leaves(batch)[0].shape[0]
    if num_micro == 1:
      loss_sum, tokens, grad_sum = grads_of(state.params, jax.tree.map(lambda x: x[0], batch))
    else:
      def accumulate(carry, micro_batch):
        loss_sum, tokens, grads = grads_of(state.params, micro_batch)
        return jax.tree.map(jnp.add, carry, (loss_sum, tokens, grads)), None

      zeros = (jnp.zeros((), jnp.float32), jnp.zeros((), jnp.float32),
               jax.tree.map(jnp.zeros_like, state.params))
      (loss_sum, tokens, grad_sum), _ = jax.lax.scan(accumulate, zeros, batch)
    denom = jnp.maximum(tokens, 1.0)
    grads = jax.tree.map(lambda g: g / denom, grad_sum)
    updates, opt_state = tx.update(grads, state.opt_state, state.params)
    params = optax.apply_updates(state.params, updates)
    metrics = {
        "loss": loss_sum / denom,
        "grad_norm": optax.tree.norm(grads),
        "update_norm": optax.tree.norm(updates),
        "param_norm": optax.tree.norm(params),
        "learning_rate": jnp.asarray(schedule(state.step), jnp.float32),
        "target_tokens": tokens,
    }
    return TrainState(step=state.step + 1, params=params, opt_state=opt_state), metrics

  return step


def make_eval_step(spec: ModelSpec):
  """eval(params, batch[B, S]) -> (loss sum, target tokens)."""
  return lambda params, batch: loss_sums(spec, params, batch)

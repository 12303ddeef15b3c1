"""The jitted train and eval steps.

The global batch arrives as [M, B, S] arrays: M micro-batches of B sequences. The step scans
over the micro-batches, summing the token-weighted loss and its gradient, then divides by the
number of target tokens of the whole batch, so the update is the same whatever M is (exact
gradient accumulation). M = 1 is the ordinary step.

Guards. An update whose loss or gradient norm is not finite is never applied: parameters and
optimizer state stay as they were, `skipped` counts it, and the loop decides (policy `skip` or
`stop`) whether to go on. Optionally a loss spike is treated the same way: a loss more than
`spike_zscore` standard deviations above an exponential moving average of recent losses (time
constant `spike_window` steps; armed after one window of good steps).
"""
from __future__ import annotations

import dataclasses
from typing import Any, Callable

import jax
import jax.numpy as jnp
import optax

from trainer.state import ModelSpec, TrainState


@dataclasses.dataclass(frozen=True)
class GuardConfig:
  spike_zscore: float = 0.0  # 0 = no spike detection
  spike_window: int = 200
  debug_nan_at_step: int = 0  # testing aid: poison the loss of this step (1-based); 0 = never

  @classmethod
  def from_config(cls, trainer_cfg) -> "GuardConfig":
    on = trainer_cfg.spike_policy != "off"
    return cls(spike_zscore=float(trainer_cfg.spike_zscore) if on else 0.0,
               spike_window=int(trainer_cfg.spike_window),
               debug_nan_at_step=int(trainer_cfg.debug_nan_at_step))


def loss_sums(spec: ModelSpec, params, batch) -> tuple[jax.Array, jax.Array]:
  """(sum of token cross-entropies over the batch, number of target tokens), in fp32."""
  model = spec.model(params)
  logits_BSV = model(batch["inputs"], batch["positions"], batch["segment_ids"])
  losses_BS = optax.softmax_cross_entropy_with_integer_labels(logits_BSV, batch["targets"])
  mask_BS = batch["loss_mask"].astype(jnp.float32)
  return jnp.sum(losses_BS * mask_BS), jnp.sum(mask_BS)


def _judge(guard, loss, grad_norm, cfg: GuardConfig):
  """(bad, finite, spike, new guard stats) for this step's loss."""
  finite = jnp.isfinite(loss) & jnp.isfinite(grad_norm)
  spike = jnp.zeros((), bool)
  if cfg.spike_zscore > 0:
    std = jnp.sqrt(guard["loss_var"] + 1e-12)
    armed = guard["good_steps"] >= cfg.spike_window
    spike = armed & finite & (loss - guard["loss_mean"] > cfg.spike_zscore * std)
  bad = ~finite | spike
  # EMA of mean and variance of good losses (West 1979's incremental form).
  alpha = 1.0 / cfg.spike_window
  first = guard["good_steps"] == 0
  delta = loss - guard["loss_mean"]
  mean = jnp.where(first, loss, guard["loss_mean"] + alpha * delta)
  var = jnp.where(first, 0.0, (1 - alpha) * (guard["loss_var"] + alpha * delta * delta))
  keep = lambda new, old: jnp.where(bad, old, new)
  new_guard = {"skipped": guard["skipped"] + bad.astype(jnp.int32),
               "good_steps": guard["good_steps"] + (~bad).astype(jnp.int32),
               "loss_mean": keep(mean, guard["loss_mean"]),
               "loss_var": keep(var, guard["loss_var"])}
  return bad, finite, spike, new_guard


def make_train_step(spec: ModelSpec, tx: optax.GradientTransformation,
                    schedule: Callable[[Any], Any], guard_cfg: GuardConfig = GuardConfig()):
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
    if guard_cfg.debug_nan_at_step:
      poison = state.step + 1 == guard_cfg.debug_nan_at_step
      loss_sum = jnp.where(poison, jnp.nan, loss_sum)
      grad_sum = jax.tree.map(lambda g: jnp.where(poison, jnp.nan, g), grad_sum)
    denom = jnp.maximum(tokens, 1.0)
    loss = loss_sum / denom
    grads = jax.tree.map(lambda g: g / denom, grad_sum)
    grad_norm = optax.tree.norm(grads)
    bad, finite, spike, guard = _judge(state.guard, loss, grad_norm, guard_cfg)

    updates, opt_state = tx.update(grads, state.opt_state, state.params)
    params = optax.apply_updates(state.params, updates)
    # A bad step changes nothing but the step counter (its batch is consumed) and the guard.
    keep_old = lambda new, old: jax.tree.map(lambda n, o: jnp.where(bad, o, n), new, old)
    params = keep_old(params, state.params)
    opt_state = keep_old(opt_state, state.opt_state)
    metrics = {
        "loss": loss,
        "grad_norm": grad_norm,
        "update_norm": jnp.where(bad, 0.0, optax.tree.norm(updates)),
        "param_norm": optax.tree.norm(params),
        # the rate this update used: the optimizer's own count skips bad steps
        "learning_rate": jnp.asarray(schedule(state.step - state.guard["skipped"]), jnp.float32),
        "target_tokens": tokens,
        "skipped": bad.astype(jnp.int32),
        "nonfinite": (~finite).astype(jnp.int32),
        "spike": spike.astype(jnp.int32),
    }
    new_state = TrainState(step=state.step + 1, params=params, opt_state=opt_state, guard=guard)
    return new_state, metrics

  return step


def make_eval_step(spec: ModelSpec):
  """eval(params, batch[B, S]) -> (loss sum, target tokens)."""
  return lambda params, batch: loss_sums(spec, params, batch)

"""The jitted train and eval steps (`make_train_step`, `make_eval_step`).

  batch [M, B, S]  M micro-batches of B sequences (M = 1: the ordinary step)
    -> sums over the micro-batches (a scan; the pipeline with stages, trainer/step/pipelined.py)
       of token losses and float32 gradients, sharded like the parameters
    -> / the target tokens of the whole batch: the update does not depend on M
    -> guards: a step whose loss or gradient norm is not finite (or a spike) is not applied
    -> the optimizer, told the batch B and the step (the step counter is the only clock)

The variant with `measure_noise` also feeds the gradient noise-scale meter; MoE auxiliary losses
are weighted so that they do not depend on M either. Why and details:
docs/configs.md#the-train-step; the meter docs/batch_size.md#gradient-noise-scale; MoE
docs/moe.md#auxiliary-losses.
"""
from __future__ import annotations

import dataclasses
from typing import Any, Callable

import jax
import jax.numpy as jnp
import optax
from flax import nnx

from models import moe as moe_lib
from models.llama import moe_layer_ids
from optim import noise_scale
from sharding.mesh import data_parallel_size
from trainer.step import pipelined
from trainer.step.state import ModelSpec, TrainState


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
  if spec.pipeline is not None:
    return pipelined.loss_sums(spec, params, batch)
  return spec.model(params).loss_sums(batch["inputs"], batch["positions"], batch["segment_ids"],
                                      batch["targets"], batch["loss_mask"])


def _global_fraction(spec: ModelSpec, params, batch):
  """f [MoE layers, N]: each expert's share of the assignments of all micro-batches of `batch`
  [M, B, S], from a forward-only pass (no gradient flows through it)."""
  k = spec.cfg.moe.top_k

  def counts_of(total, micro_batch):
    _, stats = spec.model(params).hidden(micro_batch["inputs"], micro_batch["positions"],
                                         micro_batch["segment_ids"], with_stats=True)
    return total + stats["counts"], stats["tokens"]

  num_layers = len(moe_layer_ids(spec.cfg))
  zero = jnp.zeros((num_layers, spec.cfg.moe.num_experts), jnp.float32)
  counts, tokens = jax.lax.scan(counts_of, zero, batch)
  return jax.lax.stop_gradient(counts / (k * jnp.sum(tokens, axis=0)[:, None]))


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


def grad_sums(spec: ModelSpec, params, batch, *, measure_noise: bool = False,
              noise_parts: int = 2, squares: bool = False, model_state=None):
  """Sums over the micro-batches of `batch` [M, B, S] (the noise meter's small batches: the
  micro-batches, with a pipeline `noise_parts` parts of their rows): (loss sum, target tokens, gradient sum
  in float32 sharded like the parameters, noise-meter sums (`noise_scale.piece_sums` summed
  over the pieces: |g_i|^2 / t_i^2, 1 / t_i, the pieces with target tokens, and with `squares`
  g_i^2 / t_i^2 per parameter, sharded like them) or None, MoE sums ({"stats": router statistics,
  "aux": auxiliary losses} of the whole step) or None). M = 1 is one plain backward pass, M > 1
  a scan (why float32 and sharded: docs/configs.md#the-train-step; MoE:
  docs/moe.md#auxiliary-losses). With `model_state` (a model with batch statistics,
  models/resnet.py) the MoE slot holds instead the sum over the micro-batches of the state each
  leaves, every one starting from `model_state`.
  """

  if spec.pipeline is not None:  # the pipeline is the accumulation loop (trainer/step/pipelined.py)
    return pipelined.grad_sums(spec, params, batch, measure_noise=measure_noise,
                               noise_parts=noise_parts, squares=squares)
  num_micro = jax.tree.leaves(batch)[0].shape[0]
  moe = spec.cfg.moe
  # The step's target tokens: the MoE auxiliary terms are scaled by it (docs/moe.md).
  step_tokens = jnp.maximum(jnp.sum(batch["loss_mask"].astype(jnp.float32)), 1.0)
  fraction = None
  if moe.enabled and moe.balance_scope == "global" and num_micro > 1:
    fraction = _global_fraction(spec, params, batch)

  def objective(p, micro_batch):
    if model_state is not None:  # training mode; the state the micro-batch leaves comes out
      model = spec.model(p, model_state)
      loss_sum, tokens, _ = model.sums(micro_batch, train=True)
      return loss_sum, (loss_sum, tokens, nnx.to_pure_dict(nnx.state(model, nnx.BatchStat)))
    loss_sum, tokens, stats = spec.model(p).loss_and_stats(
        micro_batch["inputs"], micro_batch["positions"], micro_batch["segment_ids"],
        micro_batch["targets"], micro_batch["loss_mask"])
    if not moe.enabled:
      return loss_sum, (loss_sum, tokens, None)
    aux = moe_lib.aux_losses(stats, moe, num_micro=num_micro, fraction=fraction)
    total = loss_sum + step_tokens * moe_lib.aux_objective(aux, moe)
    return total, (loss_sum, tokens, {"stats": stats, "aux": aux})

  def grads_of(micro_batch):
    (_, (loss_sum, tokens, moe_sums)), grads = jax.value_and_grad(objective, has_aux=True)(
        params, micro_batch)
    return loss_sum, tokens, grads, moe_sums

  f32 = lambda tree: jax.tree.map(lambda g: g.astype(jnp.float32), tree)
  shard = lambda tree: jax.lax.with_sharding_constraint(tree, spec.param_shardings)
  if num_micro == 1 and not measure_noise:
    loss_sum, tokens, grads, moe_sums = grads_of(jax.tree.map(lambda x: x[0], batch))
    return loss_sum, tokens, f32(grads), None, moe_sums

  def accumulate(carry, micro_batch):
    loss_sum, tokens, grads, moe_sums = grads_of(micro_batch)
    out = (loss_sum, tokens, f32(grads), moe_sums)
    if measure_noise:  # |mean gradient of this micro-batch|^2, 1 / its tokens, ...
      out += noise_scale.piece_sums(grads, tokens, squares)
    carry = jax.tree.map(jnp.add, carry, out)
    if squares:
      carry = (*carry[:-1], shard(carry[-1]))
    return (*carry[:2], shard(carry[2]), *carry[3:]), None

  zero = jnp.zeros((), jnp.float32)
  like_params = lambda: shard(jax.tree.map(lambda p: jnp.zeros(p.shape, jnp.float32), params))
  zeros = (zero, zero, like_params(),
           moe_lib.zero_sums(moe, len(moe_layer_ids(spec.cfg))) if moe.enabled else
           jax.tree.map(jnp.zeros_like, model_state))
  if measure_noise:
    zeros += (zero,) * 3 + ((like_params(),) if squares else ())
  carry, _ = jax.lax.scan(accumulate, zeros, batch)
  return (carry[0], carry[1], carry[2], tuple(carry[4:]) if measure_noise else None, carry[3])


def make_train_step(spec: ModelSpec, tx: optax.GradientTransformation,
                    schedule: Callable[[Any], Any], guard_cfg: GuardConfig = GuardConfig(), *,
                    measure_noise: bool = False, noise_pieces: int = 2, norm_metrics: bool = True,
                    replicas: int = 1, row_group: int = 1):
  """step(state, batch[M, B, S]) -> (state, metrics). With `measure_noise` the step measures
  the gradient noise scale on `noise_pieces` small batches (`noise_scale.splits`; the optimizer
  must carry the meter); without, it is the plain step and the meter's state passes through.
  `norm_metrics=False` leaves param_norm and update_norm out of the metrics (and their passes
  over the state out of the program; the loop runs that variant on the steps that do not log,
  `trainer.norm_metrics`). `replicas`: the step is one of that many DiLoCo replicas' inner steps
  (trainer/step/diloco.py), each on B of the replicas x B rows of the global batch; the
  optimizer and schedule are told the global batch. `row_group`: rows that stay together in the
  meter's parts (a ghost batch-norm group, models/resnet.py; 1: any row)."""
  dp = data_parallel_size(spec.mesh.shape)
  meter = noise_scale.find_state(jax.eval_shape(tx.init, spec.abstract_params))
  has_meter = meter is not None
  has_precond = has_meter and noise_scale.has_preconditioner(meter)
  if measure_noise and not has_meter:
    raise ValueError("measure_noise needs the noise-scale meter in the optimizer "
                     "(optim.noise_scale_every > 0)")

  def step(state: TrainState, batch) -> tuple[TrainState, dict[str, jax.Array]]:
    num_micro, rows = jax.tree.leaves(batch)[0].shape[:2]
    batch_size = num_micro * rows * replicas
    parts = 1
    if measure_noise:  # enough small batches for the meter
      parts = noise_scale.splits(num_micro, noise_pieces, rows // dp, group=row_group,
                                 together=spec.pipeline is not None)
    if parts > 1 and spec.pipeline is None:  # [M parts, B / parts, S]: each part one micro-batch
      batch = jax.tree.map(lambda x: noise_scale.split_rows(x, parts, row_group).reshape(
          num_micro * parts, rows // parts, *x.shape[2:]), batch)
    precondition = None
    model_state = getattr(state, "model_state", None)  # batch statistics (StatefulTrainState)
    loss_sum, tokens, grad_sum, noise_sums, moe_sums = grad_sums(
        spec, state.params, batch, measure_noise=measure_noise, noise_parts=parts,
        squares=measure_noise and has_precond, model_state=model_state)
    if model_state is not None:  # the mean of the micro-batches' states (models/resnet.py)
      parts_run = jax.tree.leaves(batch)[0].shape[0]
      model_state, moe_sums = jax.tree.map(lambda x: x / parts_run, moe_sums), None
    if guard_cfg.debug_nan_at_step:
      poison = state.step + 1 == guard_cfg.debug_nan_at_step
      loss_sum = jnp.where(poison, jnp.nan, loss_sum)
      grad_sum = jax.tree.map(lambda g: jnp.where(poison, jnp.nan, g), grad_sum)
    denom = jnp.maximum(tokens, 1.0)
    loss = loss_sum / denom
    # the optimizer sees gradients in the parameters' dtype (its state keeps that dtype)
    grads = jax.tree.map(lambda g, p: (g / denom).astype(p.dtype), grad_sum, state.params)
    grad_norm = optax.tree.norm(grads)
    bad, finite, spike, guard = _judge(state.guard, loss, grad_norm, guard_cfg)

    extra = {}
    if isinstance(tx, optax.GradientTransformationExtraArgs):
      # One clock: the schedule is read at the step counter, skipped steps included.
      extra.update(batch_size=batch_size, step=state.step)
      if measure_noise:  # fewer than 2 pieces with target tokens: NaN, which the meter skips
        sq_small_sum, inv_tokens_sum, pieces = noise_sums[:3]
        two = jnp.where(pieces >= 2, pieces, jnp.nan)
        precond = {}
        if has_precond:  # the same with sqrt(P) g, P as this update's (optim/noise_scale.py)
          precondition = noise_scale.preconditioner(state.opt_state, grads)
          precond = dict(sq_norm_small_precond=noise_scale.weighted_sq_norm(
                             noise_sums[3], precondition, squared=True) / two,
                         sq_norm_big_precond=noise_scale.weighted_sq_norm(grads, precondition))
        extra["noise_sample"] = noise_scale.Sample(
            sq_norm_small=sq_small_sum / two, sq_norm_big=grad_norm * grad_norm,
            b_small=two / inv_tokens_sum, b_big=denom, **precond)
    updates, opt_state = tx.update(grads, state.opt_state, state.params, **extra)
    params = optax.apply_updates(state.params, updates)
    # A bad step changes nothing but the step counter (its batch and its schedule slot are
    # consumed) and the guard.
    keep_old = lambda new, old: jax.tree.map(lambda n, o: jnp.where(bad, o, n), new, old)
    params = keep_old(params, state.params)
    opt_state = keep_old(opt_state, state.opt_state)
    lr_at = schedule.at(batch_size) if hasattr(schedule, "at") else schedule
    metrics = {
        "loss": loss,
        "grad_norm": grad_norm,
        "learning_rate": jnp.asarray(lr_at(state.step), jnp.float32),  # what this update used
        "target_tokens": tokens,
        "skipped": bad.astype(jnp.int32),
        "nonfinite": (~finite).astype(jnp.int32),
        "spike": spike.astype(jnp.int32),
    }
    if norm_metrics:
      metrics.update(update_norm=jnp.where(bad, 0.0, optax.tree.norm(updates)),
                     param_norm=optax.tree.norm(params))
    if moe_sums is not None:  # router statistics and auxiliary losses (models/moe.py)
      metrics.update(moe_lib.metrics(moe_sums["stats"], moe_sums["aux"], spec.cfg.moe,
                                     layer_ids=moe_layer_ids(spec.cfg)))
    if has_meter:  # the meter's value (its averages pass through the steps that do not measure)
      noise = noise_scale.readout(noise_scale.find_state(opt_state))
      per_sequence = batch_size / denom
      metrics.update(noise_scale=noise["b_simple"] * per_sequence,
                     noise_scale_tokens=noise["b_simple"], noise_g_sq=noise["g_sq"],
                     noise_trace=noise["trace_sigma"], noise_measurements=noise["count"],
                     noise_g_sq_rse=noise["g_sq_rse"], noise_scale_why=noise["why"],
                     noise_memory=noise["memory"])
      if has_precond:
        metrics.update(noise_scale_precond=noise["b_simple_precond"] * per_sequence,
                       noise_scale_precond_why=noise["why_precond"],
                       noise_g_sq_precond=noise["g_sq_precond"],
                       noise_trace_precond=noise["trace_precond"])
    if measure_noise:  # this step's own estimates
      sample = extra["noise_sample"]
      g_sq, trace = noise_scale.estimate(*sample[:4])
      metrics.update(noise_g_sq_step=g_sq, noise_trace_step=trace,
                     noise_pieces=pieces.astype(jnp.int32))
      if precondition is not None:
        metrics.update(zip(("noise_g_sq_precond_step", "noise_trace_precond_step"),
                           noise_scale.estimate(*sample[4:], *sample[2:4])))
    new_state = state.replace(step=state.step + 1, params=params, opt_state=opt_state,
                              guard=guard)
    if model_state is not None:
      new_state = new_state.replace(model_state=keep_old(model_state, state.model_state))
    return new_state, metrics

  return step


def make_eval_step(spec: ModelSpec):
  """eval(params, batch[B, S]) -> (loss sum, target tokens)."""
  return lambda params, batch: loss_sums(spec, params, batch)

"""The jitted train and eval steps.

The global batch arrives as [M, B, S] arrays: M micro-batches of B sequences. The step scans
over the micro-batches, summing the token-weighted loss and its gradient, then divides by the
number of target tokens of the whole batch, so the update is the same whatever M is (exact
gradient accumulation). M = 1 is the ordinary step.

Gradient noise scale (McCandlish et al. 2018, `optim/noise_scale.py`). The step comes in two
compiled variants (`make_train_step(..., measure_noise=)`, `Program.compile`). The plain one is
the ordinary step: with the meter in the optimizer (`optim.noise_scale_every` > 0) its state
just passes through. The measuring one, which the loop runs only on the steps that log the
noise scale (every `noise_scale_every`-th), also measures the squared norm of each
micro-batch's mean gradient inside the scan (free: the scan computes those gradients anyway)
and hands the meter their mean, their harmonic-mean token count, and the squared norm and token
count of the whole batch. A measuring step without accumulation (M = 1) runs as two
micro-batches of interleaved half rows (rows 0, 2, 4, ... and 1, 3, 5, ...: each device keeps
its own rows), the same update up to float rounding at half the matmul batch; so the meter
costs that once every N steps, and nothing on the other steps. The metrics of a measuring step
carry the smoothed estimates: `noise_scale` (B_simple in sequences), `noise_scale_tokens`,
`noise_g_sq` (|G|^2) and `noise_trace` (tr Sigma per token).

Accumulation. The gradient sum over micro-batches is float32 whatever `model.param_dtype`, and
constrained to the parameters' shardings (under FSDP it stays sharded); the optimizer receives
the mean gradient cast back to the parameters' dtype.

Pipeline stages (`mesh.stage` > 1, trainer/step/pipelined.py). The M micro-batches run through the
pipeline instead of the scan: one value_and_grad over all of them (the pipeline's tick loop is
the accumulation loop), with the same sums as the scan's; everything after `grad_sums` is this
module's. The measuring step runs the pipeline on the two halves of every micro-batch's rows.

Mixture of experts (`model.moe.*`, models/moe.py). The objective differentiated is
(sum of token losses) / (target tokens of the whole step) + load_balance_loss x balance +
router_z_loss x z: each micro-batch adds its loss sum plus the step's token count times its
share of the weighted auxiliary losses (`moe.aux_losses`), so the division by the step's tokens
leaves the auxiliary terms exactly weighted. `loss` stays the cross-entropy; the auxiliary
losses and router statistics are logged as `moe/...` (`moe.metrics`). The global-batch balance
loss (`balance_scope="global"`) needs each expert's share f of the *whole* step's assignments
before any micro-batch's backward pass: with one micro-batch it is that micro-batch's own
(statistics inside one jitted SPMD step already span every data-parallel device); with M > 1
a forward-only pre-pass over the M micro-batches counts the assignments first (costing one
more forward pass), and each micro-batch's balance term is N sum_i f_i (its sum of router
probabilities of expert i) / (the step's tokens), whose sum over micro-batches is exactly
N sum_i f_i P_i of the global batch: the loss and the gradient do not depend on M.

Batch size. The step tells the optimizer the batch it has (`update(..., batch_size=B)`, B known
from the batch's static shape), so a batch-size ramp's stages each use their own derived
hyperparameters (`optim/factory.py`); the logged `learning_rate` is that batch's.

Guards. An update whose loss or gradient norm is not finite is never applied: parameters and
optimizer state stay as they were, `skipped` counts it, and the loop decides (policy `skip` or
`stop`) whether to go on. Optionally a loss spike is treated the same way: a loss more than
`spike_zscore` standard deviations above an exponential moving average of recent losses (time
constant `spike_window` steps; armed after one window of good steps).

One clock. The step counter (`TrainState.step`) is the only clock: a skipped step consumes its
batch, its batch-ramp slot and its learning-rate schedule slot; only its update is not applied.
The learning rate of the update made at step n (0-based) is the schedule at n, whatever was
skipped before (the trainer passes `step=state.step` to the optimizer, which reads its schedule
there; `optim/transforms.py`), so the learning rate, the ramp's stage and the tokens seen are
pure functions of the step and a resumed run cannot drift. Counts that belong to the optimizer's
own statistics stay its own: Adam's bias correction (and Adafactor's decay) count the updates
actually applied, since they correct moving averages that skipped steps did not feed.
"""
from __future__ import annotations

import dataclasses
from typing import Any, Callable

import jax
import jax.numpy as jnp
import optax

from models import moe as moe_lib
from models.llama import moe_layer_ids
from optim import noise_scale
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


def grad_sums(spec: ModelSpec, params, batch, *, measure_noise: bool = False):
  """Sums over the micro-batches of `batch` [M, B, S]: (loss sum, target tokens, gradient sum
  in float32 sharded like the parameters, noise-meter sums (|g_i|^2 / t_i^2 and 1 / t_i summed
  over the pieces i, and their number) or None, MoE sums or None). The MoE
  sums are {"stats": router statistics, "aux": auxiliary losses} of the whole step; the gradient
  includes the weighted auxiliary losses times the step's target tokens (module docstring).

  M = 1 is one plain backward pass. M > 1 scans over the micro-batches; the running gradient
  sum is float32 whatever the parameters' dtype (a bf16 sum would round away each addend's low
  bits, and more of them the more micro-batches) and is constrained to the parameters'
  shardings, so under FSDP the accumulator stays sharded like the parameters. With
  `measure_noise` the scan also sums each micro-batch's |mean gradient|^2 and 1 / its tokens.
  """

  if spec.pipeline is not None:  # the pipeline is the accumulation loop (trainer/step/pipelined.py)
    return pipelined.grad_sums(spec, params, batch, measure_noise=measure_noise)
  num_micro = jax.tree.leaves(batch)[0].shape[0]
  moe = spec.cfg.moe
  # The step's target tokens: the MoE auxiliary terms are scaled by it (see the docstring).
  step_tokens = jnp.maximum(jnp.sum(batch["loss_mask"].astype(jnp.float32)), 1.0)
  fraction = None
  if moe.enabled and moe.balance_scope == "global" and num_micro > 1:
    fraction = _global_fraction(spec, params, batch)

  def objective(p, micro_batch):
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
    if measure_noise:  # |mean gradient of this micro-batch|^2 and 1 / its tokens
      t = jnp.maximum(tokens, 1.0)
      out += (optax.tree.norm(grads, squared=True) / (t * t), 1.0 / t)
    carry = jax.tree.map(jnp.add, carry, out)
    return (*carry[:2], shard(carry[2]), *carry[3:]), None

  zero = jnp.zeros((), jnp.float32)
  zeros = (zero, zero, shard(jax.tree.map(lambda p: jnp.zeros(p.shape, jnp.float32), params)),
           moe_lib.zero_sums(moe, len(moe_layer_ids(spec.cfg))) if moe.enabled else None)
  if measure_noise:
    zeros += (zero, zero)
  carry, _ = jax.lax.scan(accumulate, zeros, batch)
  return (carry[0], carry[1], carry[2], (*carry[4:], num_micro) if measure_noise else None,
          carry[3])


def make_train_step(spec: ModelSpec, tx: optax.GradientTransformation,
                    schedule: Callable[[Any], Any], guard_cfg: GuardConfig = GuardConfig(), *,
                    measure_noise: bool = False, norm_metrics: bool = True, replicas: int = 1):
  """step(state, batch[M, B, S]) -> (state, metrics). With `measure_noise` the step measures
  the gradient noise scale (the optimizer must carry the meter); without, it is the plain step
  and the meter's state passes through unchanged. `norm_metrics=False` leaves param_norm and
  update_norm out of the metrics (and their passes over the state out of the program; the loop
  runs that variant on the steps that do not log, `trainer.norm_metrics`). `replicas`: the step
  is one of that many DiLoCo replicas' inner steps (trainer/step/diloco.py), each on B of the
  replicas x B rows of the global batch; the optimizer and schedule are told the global batch."""
  if measure_noise and noise_scale.find_state(jax.eval_shape(
      tx.init, spec.abstract_params)) is None:
    raise ValueError("measure_noise needs the noise-scale meter in the optimizer "
                     "(optim.noise_scale_every > 0)")

  def step(state: TrainState, batch) -> tuple[TrainState, dict[str, jax.Array]]:
    num_micro, rows = jax.tree.leaves(batch)[0].shape[:2]
    batch_size = num_micro * rows * replicas
    if measure_noise and num_micro == 1:
      batch, num_micro = jax.tree.map(_split_rows_in_two, batch), 2
    loss_sum, tokens, grad_sum, noise_sums, moe_sums = grad_sums(
        spec, state.params, batch, measure_noise=measure_noise)
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
      if measure_noise:
        sq_small_sum, inv_tokens_sum, pieces = noise_sums
        extra["noise_sample"] = noise_scale.Sample(
            sq_norm_small=sq_small_sum / pieces, sq_norm_big=grad_norm * grad_norm,
            b_small=pieces / inv_tokens_sum, b_big=denom)
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
    if measure_noise:
      noise = noise_scale.readout(noise_scale.find_state(opt_state))
      metrics.update(noise_scale=noise["b_simple"] * batch_size / denom,
                     noise_scale_tokens=noise["b_simple"], noise_g_sq=noise["g_sq"],
                     noise_trace=noise["trace_sigma"])
    new_state = TrainState(step=state.step + 1, params=params, opt_state=opt_state, guard=guard)
    return new_state, metrics

  return step


def _split_rows_in_two(x):
  """[1, B, ...] -> [2, B/2, ...]: rows 0, 2, 4, ... and 1, 3, 5, ... (a device's block of rows
  stays on it when B / devices is even)."""
  rows = x.shape[1]
  return x[0].reshape(rows // 2, 2, *x.shape[2:]).swapaxes(0, 1)


def make_eval_step(spec: ModelSpec):
  """eval(params, batch[B, S]) -> (loss sum, target tokens)."""
  return lambda params, batch: loss_sums(spec, params, batch)

"""The Llama model through a pipeline over `mesh.stage` (sharding/pipeline.py has the schedule):
the loss of a step's [M, B, S] batch as one differentiable function of the parameters, with the
MoE router statistics and auxiliary losses of the whole step.

  embed (every stage, its M / S micro-batches)
    -> tick loop: the stored layer stack [G, ...] viewed as [S, R, G / (S R), ...], `run_layers`
    -> final norm, head and loss (every stage, its M / S micro-batches, one at a time)

The embedding, head and final norm are replicated over `stage` and their gradients all-reduced
over it once per step. The explicit schedules (1f1b, zero_bubble) compute the gradient in their
own loop (`value_and_grad`, sharding/pipeline_vjp.py), embedding and head inside it.
Why and details: docs/pipeline.md#inside-the-tick-loop
"""
from __future__ import annotations

import math

import jax
import jax.numpy as jnp
from flax import nnx

from models import moe as moe_lib
from models import weight_grad
from models.cross_entropy import chunked_cross_entropy
from models.llama import Transformer, layer_inputs, run_layers
from models.params import DTYPES
from sharding import pipeline_vjp
from sharding.mesh import data_parallel_size
from sharding.pipeline import Pipeline, run
from sharding.rules import STAGE_AXIS, constrain
from sharding.schedule import dot_flops

ACT = ("act_batch", "act_seq", "act_embed")


def _stage(model: Transformer, pipe: Pipeline, batch):
  """(the stage function of sharding/pipeline.py's loops, the layer stack as [S, R, G / (S R),
  ...] weights): stage(w, x, micro) runs one stage's layers on micro-batch `micro`."""
  cfg = model.cfg
  graphdef, state = nnx.split(model.blocks)
  weights = jax.tree.map(pipe.stage_view, nnx.to_pure_dict(state))
  positions, segments_ids = batch["positions"], batch["segment_ids"]

  def stage(w, x_BSE, micro, tape=None):  # with a tape: also what the layers' tapes return
    blocks = nnx.merge(graphdef, w)
    # read after the stage input arrives: on CPU the RoPE tables' choice is an all-reduce over
    # the batch's devices, which must not run before the tick's earlier collectives
    after = (0 * x_BSE[..., 0]).astype(jnp.int32)  # [B, S] zeros laid out as the batch
    rope, segments = layer_inputs(cfg, positions[micro] + after, segments_ids[micro] + after)
    y_BSE, stats, *taped = run_layers(cfg, x_BSE, blocks, rope, segments, tape)
    if stats:  # this micro-batch's balance term per layer (balance_scope="micro_batch")
      stats = {**stats, "balance_mb": _micro_balance(stats, cfg.moe)}
    return (y_BSE, stats, *taped)

  return stage, weights


def _split(stage, weights, x_like):
  """(backward, weight) of the zero-bubble schedule (sharding/pipeline_vjp.py `StageFns`) for
  `stage`: the backward split at the layers' matmuls (models/weight_grad.py)."""
  made = []

  def shapes(_):
    made.append(weight_grad.Tape("shapes"))
    return made[-1]

  w0 = jax.tree.map(lambda a: a[0, 0], weights)
  _, _, (_, outputs) = jax.eval_shape(lambda w, x: stage(w, x, 0, (shapes, {})), w0, x_like)
  index = list(made[-1].index)

  def backward(w, x, dy, ct, micro):
    taps = [jnp.zeros(o.shape, o.dtype) for o in outputs]

    def f(w, x, taps):
      y, stats, inputs = stage(w, x, micro, (lambda d: weight_grad.Tape("B", taps=d), taps))
      return (y, stats), inputs

    _, pull, inputs = jax.vjp(f, w, x, taps, has_aux=True)
    dw, dx, dtaps = pull((dy, ct))
    return dx, dw, (inputs, dtaps)

  def weight(w, stash, micro):
    make = lambda d: weight_grad.Tape("W", inputs=d[0], cotangents=d[1], index=index)
    zero = jnp.zeros(x_like.shape, x_like.dtype)  # no input reaches the objective
    return jax.grad(lambda w: jnp.sum(stage(w, zero, micro, (make, stash))[2]))(w)

  return backward, weight


def forward(model: Transformer, pipe: Pipeline, batch) -> tuple:
  """(loss sum, target tokens, router statistics [G, ...] in model order ({} if dense), the
  per-micro-batch balance terms [G] (None if dense)) of `batch` (leaves [M, B, S], M a multiple
  of the stages) through the pipeline."""
  stage, weights = _stage(model, pipe, batch)
  x_MBSE = jax.vmap(model.embed, spmd_axis_name=STAGE_AXIS)(batch["inputs"])
  y_MBSE, sums = run(pipe, stage, weights, x_MBSE, act_names=ACT)
  stats = jax.tree.map(_model_order, sums)
  balance_mb = stats.pop("balance_mb", None)
  loss_sum = _loss(model, pipe, y_MBSE, batch["targets"], batch["loss_mask"])
  tokens = jnp.sum(batch["loss_mask"].astype(jnp.float32))
  return loss_sum, tokens, stats, balance_mb


def objective(model: Transformer, pipe: Pipeline, batch, *, step_tokens, parts: int = 1,
              fraction=None):
  """(what the step differentiates, (loss sum, target tokens, {"stats", "aux"} or None)), as
  trainer/step/train_step.py's accumulation objective: the loss sum plus the step's target
  tokens times the weighted auxiliary losses. `batch` is the step's batch or one of `parts`
  equal pieces of its rows (the noise-scale meter's small batches), `fraction` then the whole
  step's f [G, N] for the global balance loss (else taken from this pass)."""
  loss_sum, tokens, stats, balance_mb = forward(model, pipe, batch)
  moe = model.cfg.moe
  if not moe.enabled:
    return loss_sum, (loss_sum, tokens, None)
  micro = jax.tree.leaves(batch)[0].shape[0]
  aux = aux_losses(stats, balance_mb, moe, micro=micro * parts, parts=parts, fraction=fraction)
  total = loss_sum + step_tokens * moe_lib.aux_objective(aux, moe)
  return total, (loss_sum, tokens, {"stats": stats, "aux": aux})


def value_and_grad(model: Transformer, pipe: Pipeline, batch, *, step_tokens, parts: int = 1,
                   fraction=None):
  """`jax.value_and_grad(objective, has_aux=True)` at the model's parameters for the explicit
  schedules (1f1b, zero_bubble: sharding/pipeline_vjp.py), whose loop computes the gradient
  itself: ((objective, (loss sum, tokens, MoE sums or None)), gradient as the parameters).
  MoE with the global balance loss takes f from a forward pass first (as the accumulation scan
  does), since a micro-batch's backward runs before the step's last forward."""
  cfg, moe = model.cfg, model.cfg.moe
  if moe.enabled and moe.balance_scope == "global" and fraction is None:
    fraction = global_fraction(model, pipe, batch)
  graphdef, state = nnx.split(model)
  params = nnx.to_pure_dict(state)
  rest = {k: v for k, v in params.items() if k != "blocks"}
  merged = lambda rest: nnx.merge(graphdef, {**rest, "blocks": params["blocks"]})
  stage, weights = _stage(model, pipe, batch)
  targets, mask = batch["targets"], batch["loss_mask"]

  head = lambda rest, y_BnE, labels: _piece_loss(merged(rest), y_BnE, *labels)
  labels = lambda micro: (targets[micro], mask[micro])
  dtype = DTYPES[cfg.dtype]
  embed = lambda rest, micro: _embed(rest, batch["inputs"][micro], dtype)
  embed_grad = lambda g, micro, dx_BSE: _embed_grad(g, batch["inputs"][micro], dx_BSE)
  micro, rows, seq = batch["inputs"].shape
  table = pipe.table(micro)
  x_like = jax.eval_shape(embed, rest, jax.ShapeDtypeStruct((), jnp.int32))
  _, aux_shape = jax.eval_shape(stage, jax.tree.map(lambda a: a[0, 0], weights), x_like,
                                jax.ShapeDtypeStruct((), jnp.int32))
  sums_shape = jax.tree.map(lambda a: jax.ShapeDtypeStruct((pipe.stages, pipe.repeats, *a.shape),
                                                           a.dtype), aux_shape)

  def aux_objective(sums):  # linear in what carries a gradient: its gradient is the same anywhere
    if not moe.enabled:
      return jnp.zeros((), jnp.float32), None
    stats = jax.tree.map(_model_order, sums)
    balance_mb = stats.pop("balance_mb", None)
    aux = aux_losses(stats, balance_mb, moe, micro=micro * parts, parts=parts, fraction=fraction)
    return step_tokens * moe_lib.aux_objective(aux, moe), {"stats": stats, "aux": aux}

  point = {k: jnp.full(a.shape, micro * rows * seq if k == "tokens" else 0, a.dtype)
           for k, a in sums_shape.items()}  # the tokens each layer routes in the step
  aux_ct = jax.grad(lambda s: aux_objective(s)[0])(point) if moe.enabled else {}
  split = _split(stage, weights, x_like) if table.split else (None, None)
  fns = pipeline_vjp.StageFns(embed, embed_grad, lambda w, x, m: stage(w, x, m), labels, head,
                              *split)
  loss_sum, sums, d_blocks, grads = pipeline_vjp.run(table, fns, weights, rest, aux_ct,
                                                     act_names=ACT, remat=pipe.remat_stage)
  grads["blocks"] = jax.tree.map(lambda g: g.reshape(-1, *g.shape[3:]), d_blocks)
  aux_value, moe_sums = aux_objective(sums)
  tokens = jnp.sum(mask.astype(jnp.float32))
  return (loss_sum + aux_value, (loss_sum, tokens, moe_sums)), grads


def slot_flops(graphdef, params, pipe: Pipeline, rows: int, seq: int) -> dict:
  """{"F", "B", "W"}: the FLOPs of one stage's forward, backward (zero_bubble: its input-gradient
  part) and weight-gradient part on a micro-batch of `rows` x `seq` tokens, counted in their
  jaxprs (`sharding.schedule.dot_flops`; `params` may be abstract): the costs the schedule
  table's bubble weighs its slots with. W is 0 unless the schedule splits the backward. (The
  head is no slot: sharding/pipeline_vjp.py splits it over all stages, none idle. The
  embedding's gather in F and its gradient's scatter in B, which every stage runs in those
  slots and stage 0's first repeat uses, hold no matrix product: they weigh nothing here.)"""
  def setup(params):
    model = nnx.merge(graphdef, params)
    ids = jnp.zeros((1, rows, seq), jnp.int32)
    stage, weights = _stage(model, pipe, {"positions": ids, "segment_ids": ids + 1})
    w = jax.tree.map(lambda a: a[0, 0], weights)
    x = jnp.zeros((rows, seq, model.cfg.d_model), DTYPES[model.cfg.dtype])
    ct = jax.tree.map(lambda a: jnp.ones(a.shape, a.dtype), jax.eval_shape(stage, w, x, 0)[1])
    return stage, weights, w, x, ct

  def traced(params, op):
    stage, weights, w, x, ct = setup(params)
    if op == "F":
      return stage(w, x, 0)
    if pipe.schedule != "zero_bubble":  # the forward recomputed, then pulled back
      return jax.vjp(lambda w, x: stage(w, x, 0), w, x)[1]((x, ct))
    backward, weight = _split(stage, weights, jax.ShapeDtypeStruct(x.shape, x.dtype))
    if op == "B":
      return backward(w, x, x, ct, 0)[:2]
    stash = jax.eval_shape(backward, w, x, x, ct, 0)[2]
    return weight(w, jax.tree.map(lambda a: jnp.zeros(a.shape, a.dtype), stash), 0)

  def residuals_of(params):
    stage, _, w, x, _ = setup(params)
    return pipeline_vjp.Residuals(stage).f(w, x, 0)[2]

  def pullback(params, residuals):  # B without remat: F's residuals are the jaxpr's inputs
    stage, _, w, x, ct = setup(params)
    keep = pipeline_vjp.Residuals(stage)
    keep.f(w, x, 0)  # traced for the pullback's structure only (dead code in the count)
    return keep.b(w, residuals, x, ct, 0)[:2]

  ops = ("F", "B", "W") if pipe.schedule == "zero_bubble" else ("F", "B")
  keeps = pipe.schedule != "zero_bubble" and not pipe.remat_stage
  out = {op: dot_flops(jax.make_jaxpr(lambda p, op=op: traced(p, op))(params))
         for op in ops if not (keeps and op == "B")}
  if keeps:
    residuals = jax.eval_shape(residuals_of, params)
    out["B"] = dot_flops(jax.make_jaxpr(pullback)(params, residuals))
  return {"W": 0.0, **out}


def _embed(weights, tokens_BS, dtype):
  """`Transformer.embed` (a row gather, cast to `dtype`) of one micro-batch, each device reading
  its own shard of the table (the micro-batch's ids gathered within the stage, its width split
  as the table's, then the rows split over the batch's devices): a micro-batch's tokens x E
  between them, where gathering the table is V x E per tick (the plain step's micro-batches are
  large enough that the table's gather is the cheaper one)."""
  table_VE = constrain(weights["embed_VE"], ("vocab", "embed"))
  tokens_BS = constrain(tokens_BS, (None, None))
  x_BSE = jnp.take(table_VE, tokens_BS, axis=0).astype(dtype)
  return constrain(constrain(x_BSE, (None, None, "embed")), ACT)


def _embed_grad(g, tokens_BS, dx_BSE):
  """`g` (the float32 gradient of the weights outside the layer stack) plus the embedding's
  gradient at `tokens_BS` with cotangent `dx_BSE`: the transpose of `Transformer.embed` (a row
  gather, cast to the compute dtype) written out as a scatter-add into `g`'s table in place,
  each device into its own shard of it (the micro-batch's rows gathered, its width split as the
  table's). Autodiff's transpose scattered into a [V, E] array of zeros on every device and
  summed it over the batch's devices, per stage, in every tick with a backward slot."""
  table_VE = constrain(g["embed_VE"], ("vocab", "embed"))
  # XLA:CPU's chain (sharding/pipeline_vjp.py `tie`): the ids gathered after dx arrives, dx
  # after them (by their sum: a slice of a gathered array XLA takes from before the gather)
  batch = ("act_batch", "act_seq")
  tie = lambda x, token, names: constrain(pipeline_vjp.tie(x, token), names)
  tokens_BS = constrain(tie(tokens_BS, dx_BSE, batch), (None, None))
  dx_BSE = tie(dx_BSE, jnp.sum(tokens_BS, keepdims=True), (*batch, "act_embed"))
  dx_NE = constrain(dx_BSE, (None, None, "embed")).reshape(tokens_BS.size, -1)
  dx_NE = dx_NE.astype(table_VE.dtype)
  table_VE = table_VE.at[tokens_BS.reshape(-1)].add(dx_NE)
  return {**g, "embed_VE": constrain(table_VE, ("vocab", "embed"))}


def _piece_loss(model: Transformer, y_BnE, targets_Bn, mask_Bn):
  """The loss sum of `n` positions of a micro-batch (the explicit schedules' head, a piece per
  stage: sharding/pipeline_vjp.py): the model's `loss_from_hidden`, its logits chunk cut to
  divide `n` where it does not (the same sum, fewer positions' logits at a time)."""
  chunk, n = model.cfg.logits_chunk, y_BnE.shape[1]
  x_BnE = model.final_norm(y_BnE)
  if chunk and n % chunk:
    return chunked_cross_entropy(x_BnE, model.head(), targets_Bn, mask_Bn.astype(jnp.float32),
                                 chunk=math.gcd(chunk, n), dtype=DTYPES[model.cfg.dtype])
  return model.loss_from_hidden(x_BnE, targets_Bn, mask_Bn)


def aux_losses(stats, balance_mb, moe, *, micro: int, parts: int = 1, fraction=None):
  """The auxiliary losses {"balance", "z"} of the step from statistics summed over this pass's
  micro-batches (one of `parts` equal pieces of the step; `micro`: the step's micro-batches in
  all pieces): `moe.aux_losses` summed over micro-batches, in closed form."""
  N, K = moe.num_experts, moe.top_k
  all_tokens = stats["tokens"] * parts  # [G]: the step's router tokens per layer
  z = jnp.mean(stats["z_sum"] / all_tokens)
  if moe.balance_scope == "micro_batch":
    balance = jnp.mean(balance_mb) / micro
  else:
    f = fraction if fraction is not None else stats["counts"] / (K * all_tokens[:, None])
    per_layer = N * jnp.sum(jax.lax.stop_gradient(f) * stats["prob_sum"], axis=-1)
    balance = jnp.mean(per_layer / all_tokens)
  return {"balance": balance, "z": z}


def global_fraction(model: Transformer, pipe: Pipeline, batch):
  """f [G, N]: each expert's share of the assignments of the whole `batch` (a forward pass, no
  gradient): what the pieces of a step cut in parts share."""
  _, _, stats, _ = forward(model, pipe, batch)
  f = stats["counts"] / (model.cfg.moe.top_k * stats["tokens"][:, None])
  return jax.lax.stop_gradient(f)


def loss_sums(model: Transformer, pipe: Pipeline, batch):
  """(loss sum, target tokens) of one batch [B, S] (evaluation): its rows cut into S
  micro-batches (padded with empty rows to a multiple of S x the data-parallel size)."""
  rows = batch["inputs"].shape[0]
  mesh = jax.sharding.get_abstract_mesh()
  dp = 1 if mesh.empty else data_parallel_size(mesh.shape)
  unit = pipe.stages * dp
  padded = -(-rows // unit) * unit
  micro = {k: jnp.pad(v, [(0, padded - rows)] + [(0, 0)] * (v.ndim - 1))
              .reshape(pipe.stages, padded // pipe.stages, *v.shape[1:])
           for k, v in batch.items()}  # padded rows: empty, loss_mask False
  micro = {k: constrain(v, (None, "act_batch", "act_seq")) for k, v in micro.items()}
  loss_sum, tokens, _, _ = forward(model, pipe, micro)
  return loss_sum, tokens


def _micro_balance(stats, moe):
  """N sum_i f_i P_i of one micro-batch per layer [G], f and P its own (no gradient through f)."""
  tokens = stats["tokens"]
  f = jax.lax.stop_gradient(stats["counts"] / (moe.top_k * tokens[:, None]))
  return moe.num_experts * jnp.sum(f * stats["prob_sum"] / tokens[:, None], axis=-1)


def _model_order(sums):
  """[S, R, G / (S R), ...] sums of stage s in repeat r (layer group r S + s) -> [G, ...]."""
  return jnp.swapaxes(sums, 0, 1).reshape(-1, *sums.shape[3:])


def _loss(model: Transformer, pipe: Pipeline, y_MBSE, targets_MBS, mask_MBS):
  """The loss sum of the pipeline's outputs: each stage its M / S micro-batches, one at a time.
  The weights outside the layer stack (final norm, head) enter as one copy per stage, so each
  stage sums its own gradient over its micro-batches and the copies' sum, the all-reduce over
  `stage`, happens once, not once per micro-batch."""
  S = pipe.stages
  per_stage = lambda a: a.reshape(S, a.shape[0] // S, *a.shape[1:])
  graphdef, state = nnx.split(model)
  rest = nnx.to_pure_dict(state)
  blocks = rest.pop("blocks")  # not read by the head: left out of the copies
  P = jax.sharding.PartitionSpec  # inside a stage: sharded as the weight is
  copies = jax.tree.map(lambda a: jax.lax.with_sharding_constraint(
      jnp.broadcast_to(a, (S, *a.shape)), P(STAGE_AXIS, *(P.UNCONSTRAINED,) * a.ndim)), rest)

  def stage_sum(weights, y_KBSE, targets_KBS, mask_KBS):
    head = nnx.merge(graphdef, {**weights, "blocks": blocks})

    def one(x_BSE, targets_BS, mask_BS):
      return head.loss_from_hidden(head.final_norm(x_BSE), targets_BS, mask_BS)

    if not model.cfg.logits_chunk:  # keep no micro-batch's full logits for the backward pass
      one = jax.checkpoint(one, policy=jax.checkpoint_policies.nothing_saveable)

    def add(total, xs):
      return total + one(*xs), None

    return jax.lax.scan(add, jnp.zeros((), jnp.float32), (y_KBSE, targets_KBS, mask_KBS))[0]

  sums = jax.vmap(stage_sum, spmd_axis_name=STAGE_AXIS)(
      copies, per_stage(y_MBSE), per_stage(targets_MBS), per_stage(mask_MBS))
  return jnp.sum(sums)

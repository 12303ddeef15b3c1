"""The explicit pipeline schedules (1f1b, interleaved 1f1b, zero_bubble): every stage's forward
and backward in one SPMD tick loop driven by the schedule table (sharding/schedule.py), with
per-stage VJPs. Each run of ticks with the same slots is one `jax.lax.scan`; per tick, every stage
(vmapped over `stage`):
  F  runs its layers on its input (stage 0's first repeat: the micro-batch's embedding; else
     what the previous stage sent), keeps the input in its stash slot and sends the output on
  H  (ticks where the last stage ran its last repeat's F) the head and loss of that output, its
     sequence cut in S pieces, one per stage: the head's work once, shared by all stages; the
     cotangent, joined again, starts the last stage's B of the same tick
  B  recomputes its stage from the stashed input (`pipeline.remat_stage=False`: takes F's VJP
     residuals from the stash instead) and pulls the output cotangent back (from the head, or
     the next stage) through it: the weight gradient is summed, the input's sent back
  W  (zero_bubble) the weight-gradient part B left in its W stash
Why and details: docs/pipeline.md#the-explicit-schedules
"""
from __future__ import annotations

import dataclasses
from collections.abc import Callable

import jax
import jax.numpy as jnp
import numpy as np

from sharding.mesh import mesh_platform
from sharding.rules import STAGE_AXIS, constrain
from sharding.schedule import Table

P = jax.sharding.PartitionSpec


@dataclasses.dataclass(frozen=True)
class StageFns:
  """One stage's work. embed(hw, micro) -> the first stage's input for micro-batch `micro`;
  embed_grad(g, micro, dx) -> `g` (one stage's float32 gradient of `hw`) plus the embedding's
  gradient at micro-batch `micro` and input cotangent `dx` (the VJP of `embed`, scattered into
  `g` where its table lives: no [V, E] array of its own per tick);
  forward(w, x, micro) -> (y, aux) as sharding.pipeline.run's `stage_fn`; labels(micro) -> what
  the loss reads of micro-batch `micro` (a pytree of [rows, sequence] arrays, zero where padded
  meaning "no target"); head(hw, y, labels) -> the loss sum of hidden states `y` [rows, n, ...]
  (a piece of the last stage's output: `n` of its positions) against those positions' labels
  (`hw`: the weights outside the layer stack, one copy per stage). With the backward split
  (zero_bubble):
  backward(w, x, dy, aux_ct, micro) -> (dx, the weight gradient it computes, a stash for W) and
  weight(w, stash, micro) -> the rest of the weight gradient; without, B is the VJP of
  `forward`."""
  embed: Callable
  embed_grad: Callable
  forward: Callable
  labels: Callable
  head: Callable
  backward: Callable | None = None
  weight: Callable | None = None


class Residuals:
  """F's VJP kept for B without recomputing the stage (`pipeline.remat_stage=False`, 1f1b).
  Only the pullback's leaves that depend on the stage input are stashed; the others (the stage
  weights, their casts to the compute dtype, what is built from the micro-batch's positions)
  B computes again from the weights and the micro-batch index, where XLA drops the rest of
  that forward as dead code: no stash slot holds a copy of the weights. The pullback's
  structure and which leaves are stashed are set when F is traced (every trace gives the same)."""

  def __init__(self, forward: Callable):
    self.forward, self.treedef, self.stashed, self.x = forward, None, None, None

  def _leaves(self, w, x, micro):
    (y, aux), pull = jax.vjp(lambda w, x: self.forward(w, x, micro), w, x)
    leaves, self.treedef = jax.tree.flatten(pull)
    return y, aux, leaves

  def f(self, w, x, micro):
    """(y, aux, the residuals to stash) of the stage at weights `w` on input `x`."""
    y, aux, leaves = self._leaves(w, x, micro)
    if self.stashed is None:  # on the first trace (each F traced again gives the same)
      self.x = jax.ShapeDtypeStruct(x.shape, x.dtype)
      self.stashed = _reads_input(lambda w, x: self._leaves(w, x, micro)[2], w, x)
    return y, aux, [leaf for leaf, keep in zip(leaves, self.stashed) if keep]

  def b(self, w, residuals, dy, ct, micro):
    """(dx, dw, None): the cotangents (dy, ct) of (y, aux) pulled back through the VJP of F on
    micro-batch `micro`, rebuilt from the stashed residuals."""
    again = self._leaves(w, jnp.zeros(self.x.shape, self.x.dtype), micro)[2]
    kept = iter(residuals)
    pull = jax.tree.unflatten(self.treedef, [next(kept) if keep else leaf
                                             for leaf, keep in zip(again, self.stashed)])
    dw, dx = pull((dy, ct))
    return dx, dw, None


def _reads_input(fn: Callable, w, x) -> list[bool]:
  """For each array `fn(w, x)` returns, whether it depends on `x` (its jaxpr, dead code left
  out per output; where that cannot tell, it does)."""
  from jax._src.interpreters import partial_eval  # noqa: PLC0415  version
  jaxpr = jax.make_jaxpr(fn)(w, x).jaxpr
  n = len(jaxpr.outvars)
  return [partial_eval.dce_jaxpr(jaxpr, [j == i for j in range(n)])[1][-1] for i in range(n)]


def _stage_constrain(tree):
  if jax.sharding.get_abstract_mesh().empty:
    return tree
  spec = lambda a: P(STAGE_AXIS, *(P.UNCONSTRAINED,) * (a.ndim - 1))
  return jax.tree.map(lambda a: jax.lax.with_sharding_constraint(a, spec(a)), tree)


def tie(x, token):
  """`x`, for its consumers only after `token` (what the tick computed last: an activation
  [S, *act] or a tree of per-stage sums [S, ...]): a data dependency, nothing more. `x` is
  [S, *act], labels [S, rows, n] or a W stash leaf [S, layers, rows x sequence, ...]. On CPU `x`
  plus zero times `token`: XLA:CPU starts a program's thunks as soon as the buffers they read
  are written (it drops optimization barriers first), so only data orders them; elsewhere an
  optimization barrier after an activation, which the compiler's schedule keeps and which
  computes nothing (an addition on the W stash made XLA copy it), and nothing after sums (only
  XLA:CPU's concurrent runtime needs that order: a scheduled program runs its collectives in
  one order on every device)."""
  if token is None:
    return x
  if mesh_platform(jax.sharding.get_abstract_mesh()) != "cpu":  # sums: only XLA:CPU's order
    return jax.lax.optimization_barrier((x, token))[0] if isinstance(token, jax.Array) else x
  if isinstance(token, jax.Array) and token.shape[:x.ndim] == x.shape:
    token = token[(..., *(0,) * (token.ndim - x.ndim))]  # labels after their hidden states
  elif isinstance(token, jax.Array) and token.ndim >= 3:  # an activation: broadcast locally
    token = token.reshape(token.shape[0], 1, -1, token.shape[-1])[..., :1]  # [S, 1, B T, 1]
    token = token.reshape(*token.shape, *(1,) * (x.ndim - token.ndim))
  else:  # sums (all-reduced: the same on every device of a stage): one entry per stage
    token = sum(a.reshape(a.shape[0], -1)[:, 0].astype(jnp.float32)
                for a in jax.tree.leaves(token))
    token = token.reshape(-1, *(1,) * (x.ndim - 1))
  return x + (0 * token).astype(x.dtype)


def pieces(a, parts: int):
  """[rows, T, ...] -> [parts, rows, ceil(T / parts), ...]: the sequence cut in `parts` pieces,
  the last padded with zeros (`joined` undoes it)."""
  n = -(-a.shape[1] // parts)
  a = jnp.pad(a, [(0, 0), (0, n * parts - a.shape[1])] + [(0, 0)] * (a.ndim - 2))
  return jnp.moveaxis(a.reshape(a.shape[0], parts, n, *a.shape[2:]), 1, 0)


def joined(p, length: int):
  """`pieces` undone: [parts, rows, n, ...] -> [rows, length, ...]."""
  a = jnp.moveaxis(p, 0, 1)
  return a.reshape(a.shape[0], -1, *a.shape[3:])[:, :length]


def _columns(table: Table, start: int, stop: int) -> dict:
  """The table's entries for ticks [start, stop) as the scan's per-tick inputs [n, S]."""
  S, R = table.stages, table.repeats
  cut = lambda a: np.asarray(a[start:stop], np.int32)
  f, b, w = (table.cells[op] for op in ("F", "B", "W"))
  first, last = np.arange(S) == 0, np.arange(S) == S - 1
  stash = table.slots("F", "B")
  out = {"f_micro": cut(np.maximum(f[..., 0], 0)), "f_repeat": cut(np.maximum(f[..., 1], 0)),
         "f_ok": cut(f[..., 0] >= 0), "f_slot": cut(np.maximum(stash[..., 0], 0)),
         "embed": cut((f[..., 0] >= 0) & (f[..., 1] == 0) & first),
         "head": cut((f[..., 0] >= 0) & (f[..., 1] == R - 1) & last),
         "h_micro": cut(np.maximum(f[:, -1, 0], 0)),  # one per tick: no stage's column
         "b_micro": cut(np.maximum(b[..., 0], 0)), "b_repeat": cut(np.maximum(b[..., 1], 0)),
         "b_ok": cut(b[..., 0] >= 0), "b_slot": cut(np.maximum(stash[..., 1], 0)),
         "b_embed": cut((b[..., 0] >= 0) & (b[..., 1] == 0) & first),
         "b_head": cut((b[..., 0] >= 0) & (b[..., 1] == R - 1) & last)}
  # the last stage's backward of its last repeat follows the head of the same tick's forward
  assert np.array_equal(out["b_head"], out["head"] & (cut(b[..., 0]) == cut(f[..., 0])))
  if table.split:
    wslot = table.slots("B", "W")
    out.update(w_micro=cut(np.maximum(w[..., 0], 0)), w_repeat=cut(np.maximum(w[..., 1], 0)),
               w_ok=cut(w[..., 0] >= 0), bw_slot=cut(np.maximum(wslot[..., 0], 0)),
               w_slot=cut(np.maximum(wslot[..., 1], 0)))
  return out


def run(table: Table, fns: StageFns, weights, head_weights, aux_ct, *, act_names,
        remat: bool = True):
  """The step's forward and backward through the pipeline (module docstring).

  weights: leaves [S, R, ...] (`Pipeline.stage_view`); head_weights: the weights `fns.embed`
  and `fns.head` read (one copy per stage is made here); aux_ct: the cotangent of the objective
  with respect to the aux sums (leaves [S, R, ...], the same for every micro-batch: the
  objective is linear in them). remat: B recomputes the stage from its stashed input (else
  the stash holds F's VJP residuals; not with a split backward).
  Returns (loss sum, aux sums [S, R, ...], the weights' gradient [S, R, ...] and the head
  weights' gradient, both in float32).
  """
  S, R = table.stages, table.repeats
  act = ("act_stage", *act_names)
  vmap = lambda f: jax.vmap(f, spmd_axis_name=STAGE_AXIS)
  per_stage = lambda mask, x: mask.reshape(S, *(1,) * (x.ndim - 1))
  zeros32 = lambda tree: _stage_constrain(jax.tree.map(
      lambda a: jnp.zeros(a.shape, jnp.float32), tree))

  copies = _stage_constrain(jax.tree.map(lambda a: jnp.broadcast_to(a, (S, *a.shape)),
                                         head_weights))
  pick = lambda w, r: jax.tree.map(lambda a: jax.lax.dynamic_index_in_dim(a, r, 0, False), w)
  w0 = jax.tree.map(lambda a: a[0, 0], weights)
  micro0 = jax.ShapeDtypeStruct((), jnp.int32)
  one = jax.eval_shape(fns.embed, head_weights, micro0)
  _, aux_shape = jax.eval_shape(fns.forward, w0, one, micro0)
  zero = constrain(jnp.zeros((S, *one.shape), one.dtype), act)
  held = int(table.held("F", "B").max())
  keep = None if remat else Residuals(fns.forward)
  if keep is None:
    stash = constrain(jnp.zeros((S, held, *one.shape), one.dtype), ("act_stage", None, *act_names))
  else:
    assert not table.split, "a split backward recomputes its stage"
    stash = _stage_constrain([jnp.zeros((S, held, *a.shape), a.dtype) for a in
                              jax.eval_shape(keep.f, w0, one, micro0)[2]])
  carry = {"shift": zero, "dshift": zero, "stash": stash,
           "loss": jnp.zeros((S,), jnp.float32),
           "aux": jax.tree.map(lambda a: jnp.zeros((S, R, *a.shape), a.dtype), aux_shape),
           "grads": zeros32(weights), "head": zeros32(copies)}
  if table.split:
    ct0 = jax.tree.map(lambda a: a[0, 0], aux_ct)
    wstash = jax.eval_shape(fns.backward, w0, one, one, ct0, micro0)[2]
    depth = int(table.held("B", "W").max())
    carry["wstash"] = _stage_constrain(jax.tree.map(
        lambda a: jnp.zeros((S, depth, *a.shape), a.dtype), wstash))

  def add_at(acc, r, ok, value):  # acc[s, r] += value[s] where ok[s]
    return jax.tree.map(lambda a, v: vmap(lambda a, r, ok, v: a.at[r].add(
        jnp.where(ok, v.astype(a.dtype), jnp.zeros_like(v, a.dtype))))(a, r, ok, v), acc, value)

  def put(buffer, slot, ok, value):  # buffer[s, slot[s]] = value[s] where ok[s]
    return jax.tree.map(lambda b, v: vmap(lambda b, i, ok, v: b.at[i].set(
        jnp.where(ok, v, b[i])))(b, slot, ok, v), buffer, value)

  get = lambda buffer, slot: jax.tree.map(lambda b: vmap(lambda b, i: b[i])(b, slot), buffer)
  add = lambda acc, g: jax.tree.map(lambda a, g: a + g.astype(a.dtype), acc, g)

  def head_vjp(hw, y, labels):  # one stage's piece of the head
    loss, pull = jax.vjp(lambda hw, y: fns.head(hw, y, labels), hw, y)
    dhw, dy = pull(jnp.ones_like(loss))
    return loss, dhw, dy

  def backward(w, x, dy, ct, micro):
    if fns.backward is not None:
      return fns.backward(w, x, dy, ct, micro)
    _, pull = jax.vjp(lambda w, x: fns.forward(w, x, micro), w, x)
    dw, dx = pull((dy, ct))
    return dx, dw, None

  def tick(slots, c, x):
    # One chain per tick: F (after the embedding) and the head, B (and the embedding's VJP),
    # the hand-overs, W, each fed (`tie`) by the one before, so every device runs the tick's
    # collectives in the same order (XLA:CPU runs independent computations concurrently, and
    # two devices waiting on each other's collectives hang).
    c, token = dict(c), None
    if "F" in slots:
      embedded = vmap(fns.embed)(copies, x["f_micro"])
      xin = constrain(jnp.where(per_stage(x["embed"], embedded), embedded, c["shift"]), act)
      if keep is None:
        y, aux = vmap(lambda w, x, r, m: fns.forward(pick(w, r), x, m))(
            weights, xin, x["f_repeat"], x["f_micro"])
      else:
        y, aux, xin = vmap(lambda w, x, r, m: keep.f(pick(w, r), x, m))(
            weights, xin, x["f_repeat"], x["f_micro"])
      y = constrain(y, act)
      c["stash"] = put(c["stash"], x["f_slot"], x["f_ok"], xin)
      c["aux"] = add_at(c["aux"], x["f_repeat"], x["f_ok"], aux)
      token = y
    if "H" in slots:  # the last stage's output, scored by all stages, a piece each
      assert "B" in slots, "the last stage's B follows its head in the same tick"
      length = y.shape[2]
      ys = constrain(pieces(y[S - 1], S), act)
      labels = jax.tree.map(lambda a: tie(constrain(pieces(a, S), (
          "act_stage", *act_names[:2])), ys), fns.labels(x["h_micro"]))
      loss, dhw, dys = vmap(head_vjp)(copies, ys, labels)
      c["loss"] = c["loss"] + loss
      c["head"] = add(c["head"], dhw)
      # after the sums' all-reduces over the batch's devices, like everything that follows
      dy_head = joined(constrain(tie(dys, (c["loss"], c["head"])), act), length)
    if "B" in slots:
      dy = c["dshift"] if "H" not in slots else jnp.where(
          per_stage(x["b_head"], c["dshift"]), dy_head[None], c["dshift"])
      ct = jax.tree.map(lambda a: vmap(lambda a, r: a[r])(a, x["b_repeat"]), aux_ct)
      token = dy = tie(constrain(dy, act), token)
      if keep is None:
        dx, dw, wst = vmap(lambda w, xs, dy, ct, r, m: backward(pick(w, r), xs, dy, ct, m))(
            weights, tie(get(c["stash"], x["b_slot"]), token), dy, ct, x["b_repeat"],
            x["b_micro"])
      else:  # the residuals are not tied: the pullback's collectives act on products with dy
        dx, dw, wst = vmap(lambda w, res, dy, ct, r, m: keep.b(pick(w, r), res, dy, ct, m))(
            weights, get(c["stash"], x["b_slot"]), dy, ct, x["b_repeat"], x["b_micro"])
      token = dx = constrain(dx, act)
      c["grads"] = add_at(c["grads"], x["b_repeat"], x["b_ok"], dw)
      if wst is not None:
        c["wstash"] = put(c["wstash"], x["bw_slot"], x["b_ok"], wst)
      dx_embed = constrain(tie(jnp.where(per_stage(x["b_embed"], dx), dx, jnp.zeros_like(dx)),
                               c["grads"]), act)  # stage 0's first repeat, after the B's sums
      c["head"] = vmap(fns.embed_grad)(c["head"], x["b_micro"], dx_embed)
      token = dx = tie(dx, c["head"])  # the hand-overs after the sums' all-reduces
    if "F" in slots:  # the hand-overs: the ring forward, then back
      c["shift"] = token = constrain(jnp.roll(tie(y, token), 1, axis=0), act)
    if "B" in slots:
      c["dshift"] = token = constrain(jnp.roll(tie(dx, token), -1, axis=0), act)
    if "W" in slots:
      stash = jax.tree.map(lambda a: tie(a, token), get(c["wstash"], x["w_slot"]))
      dw = vmap(lambda w, st, r, m: fns.weight(pick(w, r), st, m))(
          weights, stash, x["w_repeat"], x["w_micro"])
      c["grads"] = add_at(c["grads"], x["w_repeat"], x["w_ok"], dw)
    return c, None

  for start, stop, slots in table.phases():
    carry, _ = jax.lax.scan(lambda c, x, slots=slots: tick(slots, c, x), carry,
                            _columns(table, start, stop))
  head = jax.tree.map(lambda a: jnp.sum(a, axis=0), carry["head"])
  return jnp.sum(carry["loss"]), carry["aux"], carry["grads"], head

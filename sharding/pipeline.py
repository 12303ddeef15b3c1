"""Pipeline parallelism over the `stage` mesh axis: GPipe and circular schedules as one SPMD loop
inside the jitted step (differentiated by autodiff), the layer order a circular or interleaved
pipeline stores, and the bubble and the bytes between stages counted from a compiled program
(`count`). The explicit schedules (1f1b, zero_bubble) run their own forward and backward loop
from the schedule table: sharding/schedule.py, sharding/pipeline_vjp.py.

S stages, M micro-batches (a multiple of S), R repeats (GPipe: R = 1). Stage s runs layer groups
s, S + s, ... of L / (S R) layers; at tick t it works on micro-batch (t - s) mod M:

  tick      0    1    2    3    4        S = 2, M = 4, R = 1: M R + S - 1 = 5 ticks,
  stage 0   m0   m1   m2   m3   .        a bubble of (S - 1) / (M R + S - 1) = 1/5
  stage 1   .    m0   m1   m2   m3

Per-stage state has a leading [S] dimension sharded over `stage`; the stage function is vmapped
over it; hand-overs are `jnp.roll`s (collective-permutes). docs/pipeline.md#inside-the-tick-loop
"""
from __future__ import annotations

import dataclasses
import math
from collections.abc import Callable

import jax
import jax.numpy as jnp
import numpy as np

from sharding.collectives import collectives, crossing, format_bytes as size, total_bytes
from sharding.rules import STAGE_AXIS, constrain
from sharding.schedule import EXPLICIT, Table, build

SCHEDULES = ("gpipe", "circular", *EXPLICIT)


@dataclasses.dataclass(frozen=True)
class Pipeline:
  """S stages, R repeats (1 for GPipe), the schedule's name, and whether each tick's stage is
  rematerialised from its input (`pipeline.remat_stage`)."""
  stages: int
  repeats: int = 1
  schedule: str = "gpipe"
  remat_stage: bool = True

  @classmethod
  def from_config(cls, cfg, mesh_sizes) -> "Pipeline | None":
    """From a run config and its mesh sizes over all devices ({axis: size}); None for one stage
    (no pipeline: the plain layer scan)."""
    stages = int(mesh_sizes.get(STAGE_AXIS, 1))
    if stages == 1:
      return None
    p = cfg.pipeline
    repeats = int(p.repeats) if p.schedule != "gpipe" else 1
    schedule = p.schedule if p.schedule in EXPLICIT or repeats > 1 else "gpipe"  # circular R=1
    return cls(stages, repeats, schedule, bool(p.remat_stage))

  @property
  def explicit(self) -> bool:
    """The loop runs its own backward (sharding/pipeline_vjp.py), not autodiff of `run`."""
    return self.schedule in EXPLICIT

  def table(self, micro: int) -> Table:
    """The schedule table of a step of `micro` micro-batches (sharding/schedule.py)."""
    return build(self.schedule, self.stages, self.repeats, micro)

  def ticks(self, micro: int) -> int:
    """Ticks of GPipe's and circular's forward loop at `micro` micro-batches: M R + S - 1."""
    return micro * self.repeats + self.stages - 1

  def bubble(self, micro: int, weights: dict | None = None) -> float:
    """The bubble at `micro` micro-batches: the cost model of a batch size (the compiled
    program's own count is `count`). GPipe, circular: the idle fraction of each stage's ticks,
    (S - 1) / (M R + S - 1); explicit schedules: the table's idle slot work, F, B, W weighted by
    `weights` (their FLOPs; 1f1b's bubble is GPipe's whatever they are)."""
    if not self.explicit:
      return (self.stages - 1) / self.ticks(micro)
    if weights is None and self.schedule == "zero_bubble":
      raise ValueError("the zero-bubble schedule's bubble depends on the costs of F, B and W")
    return self.table(micro).bubble(weights or {"F": 1.0, "B": 2.0, "W": 0.0})

  def describe(self) -> str:
    name = {"gpipe": "GPipe", "circular": "circular", "zero_bubble": "zero bubble (ZB-H1)",
            "1f1b": "interleaved 1F1B" if self.repeats > 1 else "1F1B"}[self.schedule]
    return (f"{self.stages} stages, {name}" if self.repeats == 1 else
            f"{self.stages} stages x {self.repeats} repeats, {name}")

  def stored_order(self, groups: int) -> np.ndarray:
    """order[i] = the plain index of the layer group stored at position i: stage-major (stage s
    holds groups s, S + s, ... in that order). The identity for GPipe."""
    S, R = self.stages, self.repeats
    return np.arange(groups).reshape(R, S, groups // (S * R)).transpose(1, 0, 2).reshape(-1)

  def stage_view(self, stack):
    """A stored layer stack [G, ...] as [S, R, G / (S R), ...] (a local reshape: stage s's
    block of the stored stack is its R groups)."""
    S, R = self.stages, self.repeats
    view = stack.reshape(S, R, stack.shape[0] // (S * R), *stack.shape[1:])
    if jax.sharding.get_abstract_mesh().empty:
      return view
    P = jax.sharding.PartitionSpec  # the other dimensions stay as the stack's (fsdp, tensor, ...)
    return jax.lax.with_sharding_constraint(
        view, P(STAGE_AXIS, *(P.UNCONSTRAINED,) * (view.ndim - 1)))


def reorder(tree, shardings, order: np.ndarray):
  """`tree` with every leaf whose first dimension is split over `stage` (the layer stacks of
  the parameters and of the optimizer state that mirrors them) permuted along it by `order`
  (new[i] = old[order[i]]); other leaves unchanged. Traceable: jit it with `shardings`."""
  def one(leaf, sharding):
    spec = tuple(sharding.spec)
    first = spec[0] if spec else None
    axes = (first,) if isinstance(first, str) else tuple(first or ())
    return jnp.take(leaf, jnp.asarray(order), axis=0) if STAGE_AXIS in axes else leaf
  return jax.tree.map(one, tree, shardings)


def run(pipe: Pipeline, stage_fn: Callable, weights, inputs, *, act_names):
  """The pipelined forward of M micro-batches (the module docstring's schedule).

  stage_fn(w, x, micro) -> (y, aux): one stage's work on one micro-batch, `w` the weights of
      that stage and repeat (leaves [...]), `x` [*act] its input activation, `micro` the
      micro-batch's index (int32 scalar, to read per-micro-batch data such as positions); `y` like
      `x`; `aux` a pytree of arrays (e.g. router statistics) summed over the busy ticks.
  weights: a pytree whose leaves are [S, R, ...] (`Pipeline.stage_view` of the stored stack).
  inputs: [M, *act], the micro-batch dimension split over `stage` (M / S per stage).
  act_names: the logical names of one micro-batch's activation dimensions (`*act`).
  With `pipe.remat_stage` each tick's stage computation is one `jax.checkpoint` that saves
  nothing but its inputs: the backward pass recomputes the stage from the tick's input.

  Returns (outputs [M, *act] sharded like `inputs`, aux sums with leaves [S, R, ...]: entry
  [s, r] is the sum over stage s's busy ticks of repeat r, i.e. layer group r S + s).
  """
  S, R = pipe.stages, pipe.repeats
  M = inputs.shape[0]
  if M % S:
    raise ValueError(f"{M} micro-batches do not split over {S} pipeline stages")
  K = M // S
  act = ("act_stage", *act_names)
  io = constrain(inputs.reshape(S, K, *inputs.shape[1:]), ("act_stage", None, *act_names))
  shift = constrain(jnp.zeros((S, *inputs.shape[1:]), inputs.dtype), act)
  loop = (constrain(jnp.zeros((S, M, *inputs.shape[1:]), inputs.dtype),
                    ("act_stage", None, *act_names)) if R > 1 else None)
  stage_ids = jnp.arange(S)
  per_stage = lambda mask, x: mask.reshape(S, *(1,) * (x.ndim - 1))

  def compute(weights, x, repeat, micro):
    def one(w, x, r, m):  # one stage: its repeat's weights, then its layers
      w = jax.tree.map(lambda a: jax.lax.dynamic_index_in_dim(a, r, 0, keepdims=False), w)
      return stage_fn(w, x, m)
    return jax.vmap(one, spmd_axis_name=STAGE_AXIS)(weights, x, repeat, micro)

  if pipe.remat_stage:
    compute = jax.checkpoint(compute, policy=jax.checkpoint_policies.nothing_saveable,
                             prevent_cse=False)
  w0 = jax.tree.map(lambda a: a[0, 0], weights)
  _, aux_shape = jax.eval_shape(stage_fn, w0, jax.ShapeDtypeStruct(inputs.shape[1:], inputs.dtype),
                                jax.ShapeDtypeStruct((), jnp.int32))
  aux0 = jax.tree.map(lambda a: jnp.zeros((S, R, *a.shape), a.dtype), aux_shape)

  def tick(carry, t):
    shift, io, loop, aux = carry
    k = t - stage_ids  # stage s's position in its sequence of M R busy ticks
    busy = (k >= 0) & (k < M * R)
    repeat = jnp.clip(k // M, 0, R - 1)
    micro = k % M
    slot = io[:, t % K]
    first = slot if loop is None else jnp.where(t < M, slot, loop[:, t % M])
    x = constrain(jnp.where(per_stage(stage_ids == 0, shift), first, shift), act)
    y, out = compute(weights, x, repeat, micro)
    y = constrain(y, act)
    shift = constrain(jnp.roll(y, 1, axis=0), act)
    if loop is not None:  # the last stage's output, now on stage 0, queued for its next repeat
      loop = loop.at[:, (t - (S - 1)) % M].set(shift)
    slot = jnp.where(per_stage(stage_ids == S - 1, y), y, jnp.roll(slot, -1, axis=0))
    io = io.at[:, t % K].set(constrain(slot, act))
    add = lambda acc, o: jax.vmap(
        lambda a, r, b, v: a.at[r].add(jnp.where(b, v, jnp.zeros_like(v))),
        spmd_axis_name=STAGE_AXIS)(acc, repeat, busy, o)
    aux = jax.tree.map(add, aux, out)
    return (shift, io, loop, aux), None

  (_, io, _, aux), _ = jax.lax.scan(tick, (shift, io, loop, aux0),
                                    jnp.arange(pipe.ticks(M), dtype=jnp.int32))
  outputs = jnp.roll(io, -(S - 1), axis=1).reshape(inputs.shape)
  return constrain(outputs, ("act_stage", *act_names)), aux


# ----------------------------------------------------------------------------------------------
# Counted from a compiled program


@dataclasses.dataclass(frozen=True)
class Count:
  """What a compiled pipelined step does, per device, read from its HLO; for the explicit
  schedules with the table its loop runs and the costs of F, B, W it weighs the bubble by."""
  stages: int
  micro: int
  repeats: int
  ticks: int | None  # ticks per step: the run count of the stage hand-over collective-permutes
  activation_bytes: float | None  # collective-permutes between stages, per step
  other_bytes: float | None  # other collectives joining stages: the stage-replicated weights'
  # gradients; 1f1b, zero_bubble: also the head's pieces (sharding/pipeline_vjp.py)
  permutes: int  # collective-permute instructions between stages
  runs: tuple = ()  # the distinct run counts of those collective-permutes
  table: Table | None = None  # explicit schedules: the table the loop runs
  weights: dict | None = None  # {"F", "B", "W"}: their FLOPs (models/pipeline.py `slot_flops`)
  residuals: bool = False  # the stash holds F's VJP residuals (pipeline.remat_stage=False)

  @property
  def busy(self) -> int:
    """Ticks each stage works: every micro-batch passes every stage R times."""
    return self.micro * self.repeats

  @property
  def idle(self) -> int | None:
    return None if self.ticks is None else self.ticks - self.busy

  @property
  def bubble(self) -> float | None:
    if self.table is not None:
      return self.table.bubble(self.weights)
    return None if self.ticks is None else self.idle / self.ticks

  @property
  def loops_match(self) -> bool:
    """Explicit schedules: every hand-over runs as often as a run of the table's ticks is long,
    and every run longer than one tick (a loop; one tick XLA inlines) has its hand-overs."""
    lengths = {stop - start for start, stop, _ in self.table.phases()}
    return set(self.runs) <= lengths and {n for n in lengths if n > 1} <= set(self.runs)

  @property
  def stage_bytes(self) -> float | None:
    if self.activation_bytes is None or self.other_bytes is None:
      return None
    return self.activation_bytes + self.other_bytes

  def line(self) -> str:
    """The start-up / tools.aot line."""
    between = (f"between stages per step and device: {size(self.stage_bytes)} (activations "
               f"{size(self.activation_bytes)} in {self.permutes} collective-permute(s)")
    if self.table is not None:
      t, w = self.table, self.weights
      lengths = "+".join(str(stop - start) for start, stop, _ in t.phases())
      held = t.held("F", "B")
      ratio = ":".join(f"{w[op] / w['F']:.2f}" for op in ("F", "B", "W") if w.get(op))
      return (f"pipeline: M={self.micro} micro-batches, bubble {self.bubble:.1%} of the slot "
              f"work (the schedule table, {t.ticks} ticks in runs of {lengths}, F:B"
              + (":W" if t.split else "") + f" weighted {ratio} by their FLOPs; the compiled "
              f"step's tick loops {'run' if self.loops_match else 'do NOT run'} those runs); "
              f"stash per stage at most {held.max()} "
              + ("micro-batches' VJP residuals" if self.residuals else "stage input(s)")
              + (f" and {t.held('B', 'W').max()} weight-gradient stash(es)" if t.split else "")
              + f"; {between} run {'/'.join(map(str, self.runs))} times, stage-replicated "
              f"weights' gradients and the head's pieces {size(self.other_bytes)})")
    bubble = ("unknown (no hand-over between stages found in the compiled program)"
              if self.ticks is None else
              f"{self.bubble:.1%} ({self.idle} idle of {self.ticks} ticks per stage, counted "
              f"from the compiled step; (S-1)/(MR+S-1) = {self.stages - 1}/"
              f"{self.micro * self.repeats + self.stages - 1})")
    return (f"pipeline: M={self.micro} micro-batches, bubble {bubble}; {between} run "
            f"{self.ticks or '?'} times each, stage-replicated weights' gradients "
            f"{size(self.other_bytes)})")

  def row(self) -> dict:
    out = {"pipeline/micro_batches": self.micro, "pipeline/ticks": self.ticks,
           "pipeline/idle_ticks": self.idle, "pipeline/bubble": self.bubble,
           "pipeline/activation_bytes": self.activation_bytes,
           "pipeline/other_bytes": self.other_bytes}
    if self.table is not None:
      out.update({"pipeline/ticks": self.table.ticks, "pipeline/idle_ticks": None,
                  "pipeline/stash": int(self.table.held("F", "B").max()),
                  **{f"pipeline/flops_{op}": v for op, v in self.weights.items()}})
    return out


def stage_labels(mesh) -> list[int]:
  """The stage of each position in the mesh's device order (the programs' device assignment)."""
  names = list(mesh.axis_names)
  shape = mesh.devices.shape
  if STAGE_AXIS not in names:
    return [0] * math.prod(shape)
  axis = names.index(STAGE_AXIS)
  ids = np.arange(shape[axis]).reshape([-1 if i == axis else 1 for i in range(len(shape))])
  return np.broadcast_to(ids, shape).ravel().tolist()


def count(pipe: Pipeline, micro: int, hlo_text: str, mesh, weights: dict | None = None) -> Count:
  """The `Count` of a compiled pipelined step of `micro` micro-batches (`compiled.as_text()`);
  `weights`: the FLOPs of F, B, W (needed for the explicit schedules)."""
  ops = crossing(collectives(hlo_text), stage_labels(mesh))
  permutes = [op for op in ops if op.kind == "collective-permute"]
  runs = [op.count for op in permutes]
  ticks = None if not runs or any(r is None for r in runs) else max(runs)
  others = [op for op in ops if op.kind != "collective-permute"]
  explicit = pipe.explicit
  return Count(pipe.stages, micro, pipe.repeats, None if explicit else ticks,
               total_bytes(permutes), total_bytes(others), len(permutes),
               tuple(sorted({r for r in runs if r is not None})),
               pipe.table(micro) if explicit else None, weights if explicit else None,
               explicit and not pipe.remat_stage)

"""The schedule table of a pipeline step: for every tick and stage, the op that stage runs (F a
stage forward, B its backward, or only its input-gradient part when W, the weight-gradient part,
is split off) on which micro-batch, or nothing. The explicit schedules' loop runs it
(sharding/pipeline_vjp.py); the start-up line and tools.aot print it; the bubble and the stash
each stage holds are counted on it.

  tick     0  1  2  3  4  5     1f1b, S = 2, M = 4: an activation moves one stage per tick, a
  stage 0  F0 F1 F2 F3 .  .     cotangent one stage back; the last stage runs a micro-batch's
           .  .  B0 B1 B2 B3    forward and backward in one tick. A stage holds at most
  stage 1  .  F0 F1 F2 F3 .     2 (S - s) - 1 inputs (stage s) whatever M is.
           .  B0 B1 B2 B3 .

Ticks run in lockstep (one SPMD program): a tick's program holds a slot (F, B, W) when any stage
uses it, and every stage pays for it, so the bubble is idle slot work over all slot work.
Why and details: docs/pipeline.md#the-schedule-table
"""
from __future__ import annotations

import dataclasses

import jax
import numpy as np

EXPLICIT = ("1f1b", "zero_bubble")  # the schedules whose loop this table drives
SLOTS = ("F", "B", "W")


@dataclasses.dataclass(frozen=True)
class Table:
  """`cells[op]` [T, S, 2] int: (micro-batch, repeat) of the `op` a stage runs at a tick, (-1, -1)
  when it has none. B is the whole backward unless `split` (zero bubble: B then W)."""
  schedule: str
  stages: int
  repeats: int
  micro: int
  cells: dict
  split: bool

  @property
  def ticks(self) -> int:
    return self.cells["F"].shape[0]

  def busy(self, op: str) -> np.ndarray:
    """[T, S] bool: the stage runs `op` at the tick."""
    return self.cells[op][..., 0] >= 0

  def present(self) -> dict:
    """{op: [T] bool}: the op's slot is in the tick's program (some stage runs it)."""
    return {op: self.busy(op).any(axis=1) for op in SLOTS}

  def head(self) -> np.ndarray:
    """[T] bool: the tick's program holds the head (the last stage's forward of its last repeat
    ends there: its output is scored, its cotangent started), its work shared by all stages."""
    f = self.cells["F"][:, -1]
    return (f[:, 0] >= 0) & (f[:, 1] == self.repeats - 1)

  def phases(self) -> list[tuple[int, int, tuple[str, ...]]]:
    """(first tick, end tick, slots): the runs of ticks whose programs hold the same slots, "H"
    for the head."""
    present, head = self.present(), self.head()
    keys = [tuple(op for op in SLOTS if present[op][t]) + (("H",) if head[t] else ())
            for t in range(self.ticks)]
    out = []
    for t, key in enumerate(keys):
      if out and out[-1][2] == key:
        out[-1] = (out[-1][0], t + 1, key)
      else:
        out.append((t, t + 1, key))
    return out

  def bubble(self, weights: dict) -> float:
    """Idle slot work over all slot work: every present slot counts on every stage, weighted by
    its op's cost (`weights` {"F", "B", "W"}: e.g. the FLOPs of one stage's F, B, W). The head
    has no idle share: its ticks split it over all stages. The embedding's gather and scatter
    ride in F and B (no FLOPs: by FLOPs they add nothing)."""
    present = self.present()
    total = sum(weights[op] * present[op].sum() * self.stages for op in SLOTS if op in weights)
    busy = sum(weights[op] * self.busy(op).sum() for op in SLOTS if op in weights)
    return 1.0 - busy / total

  def held(self, start: str, end: str) -> np.ndarray:
    """[S]: the most items a stage holds between its `start` op and its `end` op (an input
    stashed from F until B; a weight-gradient stash from B until W), within a tick `start`
    before `end`."""
    s_busy, e_busy = self.busy(start), self.busy(end)
    opened = np.cumsum(s_busy, axis=0)
    closed = np.cumsum(e_busy, axis=0) - e_busy  # an item closed this tick is still held
    return (opened - closed).max(axis=0)

  def slots(self, start: str, end: str) -> np.ndarray:
    """[T, S] int: the buffer slot the item of `start` (a tick's F or B) is stored in and the
    `end` op reads it from, lowest free first (-1 where neither runs); the buffer depth is
    `held(start, end).max()`."""
    T, S = self.ticks, self.stages
    out = np.full((T, S, 2), -1)  # [..., 0] the slot written by `start`, [..., 1] read by `end`
    for s in range(S):
      where, free = {}, list(range(int(self.held(start, end).max())))
      for t in range(T):
        item = tuple(self.cells[start][t, s])
        if item[0] >= 0:
          where[item] = free.pop(0)
          out[t, s, 0] = where[item]
        item = tuple(self.cells[end][t, s])
        if item[0] >= 0:
          out[t, s, 1] = where.pop(item)
          free = sorted(free + [out[t, s, 1]])
    return out

  def rows(self) -> list[str]:
    """Each stage's ticks run-length coded: `F×3` three ticks of F, `FB×4` four of F and B,
    `·×2` two idle ticks."""
    out = []
    for s in range(self.stages):
      ops = ["".join(op for op in SLOTS if self.busy(op)[t, s]) or "·" for t in range(self.ticks)]
      runs, prev, n = [], ops[0], 0
      for op in ops + [None]:
        if op == prev:
          n += 1
          continue
        runs.append(f"{prev}×{n}")
        prev, n = op, 1
      out.append(f"stage {s}: " + " ".join(runs))
    return out

  def grid(self) -> str:
    """The table as in the module docstring: a column per tick, a row per stage and op (its
    micro-batch, `.repeat` when R > 1)."""
    def label(op, t, s):
      m, r = self.cells[op][t, s]
      return "." if m < 0 else f"{op}{m}" + (f".{r}" if self.repeats > 1 else "")

    width = max(len(label(op, t, s)) for op in SLOTS for t in range(self.ticks)
                for s in range(self.stages)) + 1
    lines = ["tick     " + "".join(f"{t:<{width}}" for t in range(self.ticks)).rstrip()]
    for s in range(self.stages):
      for op in SLOTS if self.split else SLOTS[:2]:
        head = f"stage {s}  " if op == "F" else " " * 9
        lines.append(head + "".join(f"{label(op, t, s):<{width}}"
                                    for t in range(self.ticks)).rstrip())
    return "\n".join(lines)

def build(schedule: str, stages: int, repeats: int, micro: int) -> Table:
  """The table of `schedule` for S stages, R repeats (a micro-batch passes the stages R times)
  and M micro-batches, M a multiple of S.

  gpipe / circular: forward item k = (k mod M, k div M) at tick k + s, then the tick loop's
  transpose (autodiff): every backward after the last forward, in reverse order.
  1f1b / zero_bubble: items in groups of S micro-batches, each group through all R repeats
  before the next (Megatron's interleaved order; M = S is the circular order), forward item k
  at tick k + s; backward item j (groups in order, repeats last to first) at tick
  j + R S - 1 + (S - 1 - s), so the last stage runs the backward of its last repeat's forward
  in the same tick; zero_bubble runs W of item j on every stage at tick j + R S + S - 2 (the
  weight-gradient slot is in only the last M R ticks' programs, the ticks where every stage
  has one to run).
  """
  S, R, M = stages, repeats, micro
  if M % S:
    raise ValueError(f"{M} micro-batches do not split over {S} pipeline stages")
  if schedule in EXPLICIT:
    forward = [(g * S + i, r) for g in range(M // S) for r in range(R) for i in range(S)]
    backward = [(g * S + i, R - 1 - r) for g in range(M // S) for r in range(R) for i in range(S)]
    f_tick = lambda k, s: k + s
    b_tick = lambda j, s: j + R * S - 1 + (S - 1 - s)
    w_tick = (lambda j, s: j + R * S + S - 2) if schedule == "zero_bubble" else None
  else:
    forward = [(k % M, k // M) for k in range(M * R)]
    backward = forward[::-1]
    loop = M * R + S - 1
    f_tick = lambda k, s: k + s
    b_tick = lambda j, s: loop + j + (S - 1 - s)
    w_tick = None
  n = M * R
  ticks = 1 + max(max(f_tick(n - 1, s), b_tick(n - 1, s)) for s in range(S))
  if w_tick is not None:
    ticks = max(ticks, 1 + w_tick(n - 1, 0))
  cells = {op: np.full((ticks, S, 2), -1) for op in SLOTS}
  for s in range(S):
    for k, item in enumerate(forward):
      cells["F"][f_tick(k, s), s] = item
    for j, item in enumerate(backward):
      cells["B"][b_tick(j, s), s] = item
      if w_tick is not None:
        cells["W"][w_tick(j, s), s] = item
  return Table(schedule, S, R, M, cells, w_tick is not None)


def dot_flops(closed_jaxpr) -> float:
  """2 x the multiply-adds of the matrix products (dot_general) of a jaxpr that reach its
  outputs (dead code left out, as XLA does), nested jaxprs included: a scan's body times its
  length, a cond's costliest branch, a while loop's body once. What weighs F, B and W in
  `Table.bubble` (elementwise work and custom kernels are not counted)."""
  from jax._src.interpreters import partial_eval  # noqa: PLC0415  version
  jaxpr = closed_jaxpr.jaxpr
  jaxpr, _ = partial_eval.dce_jaxpr(jaxpr, [True] * len(jaxpr.outvars))
  return _flops(jaxpr)


def _flops(jaxpr) -> float:
  total = 0.0
  for eqn in jaxpr.eqns:
    if eqn.primitive.name == "dot_general":
      (contract, _), (batch, _) = eqn.params["dimension_numbers"]
      a, b = (v.aval.shape for v in eqn.invars)
      shared = np.prod([a[i] for i in contract]) * np.prod([a[i] for i in batch])
      total += 2.0 * np.prod(a) * np.prod(b) / shared
    inner = [_flops(j) for j in jax.extend.core.jaxprs_in_params(eqn.params)]
    if inner:
      total += (max(inner) if eqn.primitive.name == "cond" else
                eqn.params.get("length", 1) * sum(inner))
  return float(total)

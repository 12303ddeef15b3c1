"""The schedule tables of sharding/schedule.py against a tick-by-tick simulation of the pipeline:
stages that pass activations and cotangents one stage per tick and run each op as soon as what it
needs has arrived, in each schedule's order. The table the loop runs must be the simulation's,
and its bubble, stash and phases what the simulation counts. Also the compiled explicit loops:
their tick loops run the table's phases, and every device runs their collectives one at a time
in one order (sharding/pipeline_vjp.py)."""
import itertools
import math
import os
import re

import jax
import numpy as np
import pytest

from models.config import ModelConfig
from models.sizes import flops_per_token
from sharding.collectives import collectives, crossing
from sharding.pipeline import count, stage_labels
from sharding.schedule import SLOTS, build, dot_flops
from test_pipeline import _batches, _cfg
from tools.hlo import Module
from trainer.step.pipelined import grad_sums as pipelined_grad_sums
from trainer.step.program import Program, run_mesh
from trainer.step.train_step import grad_sums

CASES = [(schedule, S, R, M) for schedule in ("gpipe", "circular", "1f1b", "zero_bubble")
         for S in (2, 3, 4) for R in ((1,) if schedule == "gpipe" else (1, 2, 3))
         for M in (S, 2 * S, 4 * S) if schedule != "circular" or R > 1]


def orders(schedule, S, R, M):
  """(forward order, backward order) of (micro-batch, repeat) items."""
  if schedule in ("gpipe", "circular"):  # repeat by repeat, then autodiff's reverse
    forward = [(m, r) for r in range(R) for m in range(M)]
    return forward, forward[::-1]
  groups = [range(g * S, (g + 1) * S) for g in range(M // S)]  # Megatron's groups of S
  return ([(m, r) for g in groups for r in range(R) for m in g],
          [(m, r) for g in groups for r in reversed(range(R)) for m in g])


def simulate(schedule, S, R, M):
  """{op: {(stage, item): tick}} of a lockstep pipeline: per tick each stage runs its next F, then
  its next B, then its next W, each only when ready (an output sent at tick t arrives at t + 1,
  the last stage's head turns a forward into a cotangent within the tick). GPipe and circular
  start no backward before every forward is done (the backward is the forward loop's
  transpose); zero bubble runs W only in ticks where every stage has one ready."""
  forward, backward = orders(schedule, S, R, M)
  done = {"F": {}, "B": {}, "W": {}}
  nxt = {op: [0] * S for op in SLOTS}
  t = 0

  def f_ready(s, m, r):
    if s == 0:
      return r == 0 or done["F"].get((S - 1, (m, r - 1)), t) < t
    return done["F"].get((s - 1, (m, r)), t) < t

  def b_ready(s, m, r):
    if (s, (m, r)) not in done["F"]:
      return False
    if schedule in ("gpipe", "circular") and (len(done["F"]) < S * M * R
                                              or max(done["F"].values()) >= t):
      return False  # the transposed loop starts after the forward loop
    if s == S - 1:
      return r == R - 1 or done["B"].get((0, (m, r + 1)), t) < t
    return done["B"].get((s + 1, (m, r)), t) < t

  while len(done["B"]) < S * M * R:
    assert t < 10 * (M * R + S) * 3, "the simulation stalls"
    for op, order, ready in (("F", forward, f_ready), ("B", backward, b_ready)):
      started = []
      for s in range(S):
        if nxt[op][s] < len(order) and ready(s, *order[nxt[op][s]]):
          started.append(s)
      for s in started:  # all stages of a tick decide on what arrived before it
        done[op][s, order[nxt[op][s]]] = t
        nxt[op][s] += 1
    t += 1
  if schedule == "zero_bubble":
    n = M * R
    for tick in range(t - n, t):  # W in the last M R ticks, each stage in backward order
      for s in range(S):
        item = backward[nxt["W"][s]]
        assert done["B"][s, item] <= tick, "a weight gradient before its input gradient"
        done["W"][s, item] = tick
        nxt["W"][s] += 1
  return done, t


@pytest.mark.parametrize("schedule,S,R,M", CASES)
def test_table_is_the_simulated_pipeline(schedule, S, R, M):
  table = build(schedule, S, R, M)
  done, ticks = simulate(schedule, S, R, M)
  assert table.ticks == ticks
  for op in SLOTS:
    got = {(s, (int(m), int(r))): t for t in range(table.ticks) for s in range(S)
           for m, r in [table.cells[op][t, s]] if m >= 0}
    assert got == done[op], op
  # the bubble: the simulation's slot time per tick against each stage's work, for a few costs
  for weights in ({"F": 1, "B": 2, "W": 1}, {"F": 1, "B": 1.3, "W": 0.7}):
    w = {**weights, "W": weights["W"] if schedule == "zero_bubble" else 0}
    if schedule != "zero_bubble":
      w["B"] = weights["B"] + weights["W"]  # one backward: both parts
    time = sum(w[op] * len(set(done[op].values())) for op in SLOTS)  # a tick's slots
    work = M * R * sum(w.values())
    assert table.bubble(w) == pytest.approx(1 - work / time)
  # what a stage holds between its forward and its backward: the simulation's count
  held = [max(sum(done["F"][s, it] <= t <= done["B"][s, it] for it in orders(
      schedule, S, R, M)[0]) for t in range(ticks)) for s in range(S)]
  np.testing.assert_array_equal(table.held("F", "B"), held)


@pytest.mark.parametrize("S,R", [(2, 1), (4, 1), (4, 2)])
def test_1f1b_holds_what_the_round_trip_needs_whatever_m(S, R):
  """1F1B's stash does not grow with M (GPipe's holds every micro-batch): on stage s the
  ticks a micro-batch takes to the last stage and back, 2 (S - s) - 1, plus the other repeats
  of its group, (R - 1) S (Megatron's interleaved warm-up), or all M R items when fewer."""
  for M in (S, 4 * S, 8 * S):
    ones = build("1f1b", S, R, M)
    assert list(ones.held("F", "B")) == [min(M * R, (R - 1) * S + 2 * (S - s) - 1)
                                         for s in range(S)]
    assert build("gpipe" if R == 1 else "circular", S, R, M).held("F", "B").max() == M * R
  zero = build("zero_bubble", S, R, 8 * S)
  assert list(zero.held("F", "B")) == list(ones.held("F", "B"))
  assert list(zero.held("B", "W")) == [s + 1 for s in range(S)]  # W waits s ticks on stage s


def test_zero_bubble_has_less_bubble_than_1f1b():
  """Same M, same costs: the weight-gradient slot is only in ticks where every stage has one."""
  cost = {"F": 1.0, "B": 2.0, "W": 1.0}
  for S, R, M in [(4, 1, 8), (4, 1, 32), (4, 2, 16), (2, 1, 4)]:
    ones = build("1f1b", S, R, M).bubble({"F": 1.0, "B": 3.0})
    zero = build("zero_bubble", S, R, M).bubble(cost)
    assert zero < ones, (S, R, M, zero, ones)
    assert build("1f1b", S, R, M).bubble({"F": 1.0, "B": 3.0}) == pytest.approx(
        build("gpipe" if R == 1 else "circular", S, R, M).bubble({"F": 1.0, "B": 3.0}))


def test_the_table_prints():
  table = build("1f1b", 2, 1, 4)
  assert table.grid().splitlines() == [
      "tick     0  1  2  3  4  5",
      "stage 0  F0 F1 F2 F3 .  .",
      "         .  .  B0 B1 B2 B3",
      "stage 1  .  F0 F1 F2 F3 .",
      "         .  B0 B1 B2 B3 ."]
  assert table.rows() == ["stage 0: F×2 FB×2 B×2", "stage 1: ·×1 FB×4 ·×1"]
  assert table.phases() == [(0, 1, ("F",)), (1, 5, ("F", "B", "H")), (5, 6, ("B",))]


# ------------------------------------------------------------------------------------------------
# The compiled explicit loops (sharding/pipeline_vjp.py) and the costs the bubble weighs


@pytest.mark.parametrize("schedule", ["zero_bubble", pytest.param("1f1b", marks=pytest.mark.slow)])
def test_compiled_loops_run_the_table(schedule, devices):
  """The compiled step's hand-overs run as often as the table's runs of ticks are long (one
  scan per run; one tick XLA inlines), each moves one micro-batch's activations per device, and
  the only other bytes between stages are the stage-replicated weights' gradients and, once per
  micro-batch, the head's pieces: the last stage's output to the stages and their cotangents
  back (an activation each way). In the tick loops the only collectives of a [V, E] array are
  the head's gradient sums, one per micro-batch: the embedding's gradient is scattered into each
  device's own shard of its table (autodiff's transpose summed a [V, E] array over the batch's
  devices on every stage in every backward tick)."""
  cfg = _cfg(**{"mesh.stage": 2, "mesh.data": 4, "pipeline.schedule": schedule})
  program = Program(cfg, run_mesh(cfg))
  micro = 4
  text = program.compile(micro, logs=True).as_text()
  found = count(program.pipeline, micro, text, program.mesh, program.slot_flops())
  lengths = [stop - start for start, stop, _ in found.table.phases()]
  assert found.loops_match, (found.runs, lengths)
  assert set(found.runs) == set(lengths)
  m = cfg.model
  rows = cfg.data.micro_batch_size // cfg.mesh.data
  activation = rows * cfg.data.seq_len * m.d_model * 4
  permutes = [op for op in crossing(collectives(text), stage_labels(program.mesh))
              if op.kind == "collective-permute"]
  assert {op.bytes for op in permutes} == {activation}
  weights = (2 * m.vocab_size * m.d_model + m.d_model) * 4  # embedding, head, final norm (fp32)
  pieces = 2 * activation * micro
  assert weights + pieces <= found.other_bytes <= weights + pieces + 256
  assert found.bubble == pytest.approx(found.table.bubble(program.slot_flops()))
  assert "the compiled step's tick loops run those runs" in found.line()
  V, E = m.vocab_size, m.d_model  # in the tick loops, [V, E] sums are the head's, one a head
  table = re.compile(rf"f32\[(1,)?({V},{E}|{E},{V})\]")
  heads = sum(stop - start for start, stop, slots in found.table.phases()
              if "H" in slots and stop - start > 1)  # (a one-tick run is inlined)
  assert sum(op.count for op in collectives(text)
             if op.count != 1 and table.search(op.line)) == heads


def test_slot_costs_are_the_stage_flops(devices):
  """F is the stage's layers' matmul and attention FLOPs (the model's own count, attention
  unmasked: the product XLA computes); 1F1B's B recomputes F and runs the whole backward (2 F);
  zero bubble splits that B into its input-gradient part and W without losing or adding any."""
  flops = {}
  for schedule in ("1f1b", "zero_bubble"):
    cfg = _cfg(**{"mesh.stage": 2, "mesh.data": 4, "pipeline.schedule": schedule})
    flops[schedule] = Program(cfg, run_mesh(cfg)).slot_flops()
  model = ModelConfig.from_config(cfg.model)
  per_token = flops_per_token(model, cfg.data.seq_len, causal=False)
  head = 6.0 * model.d_model * model.vocab_size
  tokens = cfg.data.micro_batch_size * cfg.data.seq_len
  stage = (per_token["total"] - head) / 3 / 2 * tokens  # forward, one of 2 stages
  ones, zero = flops["1f1b"], flops["zero_bubble"]
  assert ones["F"] == pytest.approx(stage) and zero["F"] == ones["F"]
  assert ones["B"] == pytest.approx(3 * ones["F"]) and ones["W"] == 0  # remat + backward
  assert zero["B"] + zero["W"] == pytest.approx(ones["B"])
  assert 0 < zero["W"] < ones["F"]  # the weight-gradient matmuls: 2/3 of them on F's share


@pytest.mark.parametrize("schedule", ["zero_bubble", "1f1b"])
def test_the_head_runs_once_per_micro_batch(schedule, devices):
  """The matmul FLOPs of the explicit schedules' traced gradient step are their table's slots
  (every present slot on every stage, at its counted cost) plus one head per micro-batch (its
  forward and backward, 6 E V per token, the sequence cut in S pieces), nothing more: before,
  every stage ran the whole head in every tick with a forward slot."""
  cfg = _cfg(**{"mesh.stage": 2, "mesh.data": 4, "pipeline.schedule": schedule})
  program = Program(cfg, run_mesh(cfg))
  S, M, rows, T = 2, 4, cfg.data.micro_batch_size, cfg.data.seq_len
  params = jax.eval_shape(lambda: program.init_state().params)
  batch = {k: jax.ShapeDtypeStruct((M, rows, T), bool if k == "loss_mask" else np.int32)
           for k in ("inputs", "targets", "positions", "segment_ids", "loss_mask")}
  with jax.set_mesh(program.mesh):
    traced = jax.make_jaxpr(lambda p, b: pipelined_grad_sums(program.spec, p, b))(params, batch)
  cost, present = program.slot_flops(), program.pipeline.table(M).present()
  slots = sum(cost[op] * present[op].sum() * S for op in SLOTS)
  head = 6.0 * cfg.model.d_model * cfg.model.vocab_size * rows * math.ceil(T / S) * S * M
  assert dot_flops(traced) == pytest.approx(slots + head)


# ------------------------------------------------------------------------------------------------
# The order of the collectives


def unordered(hlo_text: str) -> list[tuple[str, str]]:
  """Pairs of collectives of a compiled program, or loops and calls that hold some, in one
  computation where neither reads what the other wrote (through any chain of instructions):
  what XLA:CPU may run at once on a device, each blocking a thread of the pool all devices
  share until the other devices join it."""
  module = Module(hlo_text)
  kinds = ("all-reduce", "all-gather", "reduce-scatter", "all-to-all", "collective-permute")
  holds = {}

  def has(name):  # the computation runs a collective, at any depth
    if name not in holds:
      holds[name] = False
      holds[name] = any(i.opcode.removesuffix("-start") in kinds or any(map(has, i.called))
                        for i in module.computations.get(name, []))
    return holds[name]

  out = []
  for insts in module.computations.values():
    before, names = {}, {i.name for i in insts}
    for i in insts:  # in the text's order, a topological one
      control = re.search(r"control-predecessors=\{([^}]*)\}", i.line)
      deps = set(i.operands) | set(re.findall(r"%([\w.\-]+)", control.group(1) if control else ""))
      before[i.name] = set().union(*({d} | before[d] for d in deps & names))
    nodes = [i.name for i in insts if i.opcode.removesuffix("-start") in kinds
             or (i.opcode in ("while", "call", "conditional") and any(map(has, i.called)))]
    out += [(a, b) for a, b in itertools.combinations(nodes, 2)
            if a not in before[b] and b not in before[a]]
  return out


def test_zero_bubble_one_layer_per_stage_runs_its_collectives_in_order(data_dir, devices):
  """4 stages of one layer, data 2, M = 4: the shape whose program hung XLA:CPU (issue 49; its
  one-tick phase, inlined between two tick loops, had the RoPE tables' all-reduce, which read
  nothing of the loop before it, and each tick's head gradients' all-reduce ran beside the
  hand-overs). No two collectives of a computation may run at once, and the step's gradient
  sum equals the plain accumulation scan's."""
  cfg = _cfg(**{"mesh.stage": 4, "mesh.data": 2, "model.num_layers": 4,
                "pipeline.schedule": "zero_bubble"})
  batch = _batches(data_dir, cfg, steps=1)[0]
  out = {}
  for name, c, devs, fn in (("piped", cfg, None, pipelined_grad_sums),
                            ("plain", _cfg(**{"model.num_layers": 4}), devices[:1], grad_sums)):
    program = Program(c, run_mesh(c, devs))
    params = program.init_state().params
    with jax.set_mesh(program.mesh):
      b = {k: jax.device_put(v, program.batch_sharding) for k, v in batch.items()}
      compiled = jax.jit(lambda p, b, fn=fn, s=program.spec: fn(s, p, b)).lower(params, b).compile()
      if name == "piped":
        assert unordered(compiled.as_text()) == []
      loss, _, grads, _, _ = compiled(params, b)
    out[name] = jax.device_get((loss, grads))
  np.testing.assert_allclose(out["piped"][0], out["plain"][0], rtol=1e-6)
  worst = jax.tree.map(lambda a, b: np.max(np.abs(a - b)) / np.max(np.abs(b)), out["piped"][1],
                       out["plain"][1])  # 1 layer per stage: the stored order is the plain one
  assert max(jax.tree.leaves(worst)) < 5e-6, worst


@pytest.mark.parametrize("platform", ["cpu", "tpu"])
def test_the_chain_computes_nothing_off_cpu(platform, devices):
  """`tie` on a W stash leaf after an activation: on a TPU mesh one optimization barrier (an
  addition there made XLA copy the stash: 5.867 against 3.083 GiB of zero bubble's temporaries
  on the docs' bench, issue 49), after sums nothing; on CPU the addition of zero times the
  token that orders XLA:CPU's thunks."""
  from sharding.pipeline_vjp import tie  # noqa: PLC0415
  from tools import aot  # noqa: PLC0415
  from trainer.config.cli import load  # noqa: PLC0415
  if platform == "tpu" and not aot.libtpu_available():
    pytest.skip("libtpu is not installed")
  cfg = load(os.path.join(os.path.dirname(__file__), "..", "configs", "lm_tiny.py"),
             [("mesh.stage", "2"), ("data.micro_batch_size", "8")])
  mesh = (run_mesh(cfg) if platform == "cpu" else
          aot.target_mesh(cfg, aot.tpu_target("v5e:2x2"))[1])
  leaf = jax.ShapeDtypeStruct((2, 2, 4 * 8, 16), np.float32)  # a slot's: [S, layers, B T, ...]
  token = jax.ShapeDtypeStruct((2, 4, 8, 16), np.float32)  # an activation [S, B, T, E]
  sums = {"loss": jax.ShapeDtypeStruct((2,), np.float32)}
  with jax.set_mesh(mesh):
    after = {e.primitive.name for e in jax.make_jaxpr(tie)(leaf, token).eqns}
    summed = {e.primitive.name for e in jax.make_jaxpr(tie)(leaf, sums).eqns}
  if platform == "tpu":
    assert after == {"optimization_barrier"} and summed == set()
  else:
    assert "add" in after and "mul" in after and "add" in summed


# ------------------------------------------------------------------------------------------------
# The explicit schedules' embedding


def test_the_embedding_reads_and_writes_each_devices_own_shard(devices):
  """The explicit schedules' embedding (models/pipeline.py `_embed`, `_embed_grad`) on fsdp 4 x
  tensor 2: the table's rows and their scatter-add, and no collective of the compiled lookup or
  gradient moves a quarter of the table (the micro-batch's ids and rows move; gathering the
  table over fsdp, and autodiff's transpose, a [V, E] sum over the batch's devices, moved it
  all, in every tick)."""
  from models import pipeline as model_pipeline  # noqa: PLC0415
  from sharding.rules import logical_to_spec  # noqa: PLC0415
  cfg = _cfg(**{"mesh.fsdp": 4, "mesh.tensor": 2})
  mesh = run_mesh(cfg)
  V, E, rows, T = cfg.model.vocab_size, cfg.model.d_model, 4, cfg.data.seq_len
  rng = np.random.default_rng(0)
  table = rng.standard_normal((V, E)).astype(np.float32)
  ids = rng.integers(0, V, (rows, T)).astype(np.int32)
  dx = rng.standard_normal((rows, T, E)).astype(np.float32)
  want = np.zeros((V, E), np.float32)
  np.add.at(want, ids.ravel(), dx.reshape(-1, E))
  put = lambda a, names: jax.device_put(a, jax.sharding.NamedSharding(mesh, logical_to_spec(names)))
  with jax.set_mesh(mesh):
    args = (put(table, ("vocab", "embed")), put(ids, ("act_batch", "act_seq")),
            put(dx, ("act_batch", "act_seq", "act_embed")))
    lookup = jax.jit(lambda t, i, _: model_pipeline._embed({"embed_VE": t}, i, np.float32))
    grad = jax.jit(lambda t, i, dx: model_pipeline._embed_grad({"embed_VE": 0 * t}, i, dx))
    texts = [f.lower(*args).compile().as_text() for f in (lookup, grad)]
    got = (lookup(*args), grad(*args)["embed_VE"])
  np.testing.assert_array_equal(got[0], table[ids])
  np.testing.assert_allclose(got[1], want, rtol=1e-5, atol=1e-5)
  moved = [op.line for text in texts for op in collectives(text) if op.bytes >= V * E * 4 / 4]
  assert moved == []

"""DiLoCo (optim/diloco.py, trainer/step/diloco.py): the maths pinned by three equivalences, no
communication across replicas in the inner step (read from the compiled program), exact resume
and restore onto another mesh, and the config errors."""
import csv
import os

import jax
import numpy as np
import orbax.checkpoint as ocp
import pytest

import train
from conftest import (assert_adam_params_close, losses, metric_rows, tiny_config,
                      tiny_config_file)
from data import pipeline
from sharding.collectives import collectives, crossing, unattributed
from sharding.mesh import MeshError, fold_replicas, make_mesh, resolve_mesh
from trainer.checkpoint.model_dirs import load_params
from trainer.checkpoint.persistent import Checkpointer
from trainer.checkpoint.saved import CheckpointError
from trainer.config import ConfigError
from trainer.config.checks import validate
from trainer.run.loop import Run
from trainer.run.readback import FLAG_KEYS, MetricsWindow
from trainer.step.diloco import reduce_metrics
from trainer.step.program import Program, run_mesh
from trainer.tracking import communication

TINY = "configs/lm_tiny.py"


def _cfg(**overrides):
  """The tiny test model with SGD (no clipping: a global-norm clip is not linear) on DiLoCo."""
  base = {"optim.name": "sgd", "optim.learning_rate": 0.5, "optim.clip_norm": 0.0,
          "optim.warmup_steps": 0, "optim.schedule": "constant", "optim.diloco.replicas": 2,
          "optim.diloco.inner_steps": 1}
  return tiny_config(**{**base, **overrides})


def _batches(data_dir, cfg, steps, *, full_mask=False):
  """`steps` global batches [1, B, S] of the training stream. `full_mask`: every position is a
  target, so that each replica's block of rows has the same number of target tokens."""
  it = iter(pipeline.dataset(pipeline.StreamSpec(
      data_dir, "train", cfg.data.seq_len, cfg.data.global_batch_size)))
  out = []
  for _ in range(steps):
    batch = {k: v[None] for k, v in next(it).items()}
    if full_mask:
      batch["loss_mask"] = np.ones_like(batch["loss_mask"])
    out.append(batch)
  return out


def _train(cfg, batches, devices=None):
  """(per-step mean losses, final state on the host, program): the compiled steps of `cfg`'s
  Program, DiLoCo's outer step after every H-th."""
  program = Program(cfg, run_mesh(cfg, devices))
  state = program.init_state()
  step = program.jitted_step(logs=True)
  outer = program.jitted_outer() if program.diloco else None
  out = []
  with jax.set_mesh(program.mesh):
    for n, batch in enumerate(batches, 1):
      state, metrics = step(state, {k: jax.device_put(v, program.batch_sharding)
                                    for k, v in batch.items()})
      if outer is not None and program.diloco.is_outer_step(n):
        state, _ = outer(state)
      out.append(float(np.mean(jax.device_get(metrics["loss"]))))
  return np.array(out), jax.device_get(state), program


def _assert_trees_close(a, b, **tol):
  jax.tree.map(lambda x, y: np.testing.assert_allclose(x, y, **tol), a, b)


# ------------------------------------------------------------------------------------------------
# The maths


@pytest.mark.parametrize("momentum", [0.0, 0.9], ids=["sgd", "sgd-momentum"])
def test_h1_outer_sgd_rate_1_is_data_parallelism(data_dir, devices, momentum):
  """SGD inner (with or without momentum: both are linear), H = 1, outer SGD of rate 1 without
  momentum: the anchor after every step is data parallelism's parameters on the global batch,
  step for step (each replica's rows carry the same number of target tokens: the outer step
  averages replicas uniformly, as the paper, and each replica normalises by its own tokens)."""
  # lr x (1 - momentum): the same long-run step size with momentum (0.5 with momentum 0.9
  # diverges within three steps on some batches).
  cfg = _cfg(**{"optim.momentum": momentum, "optim.learning_rate": 0.5 * (1 - momentum),
                "optim.diloco.outer_lr": 1.0,
                "optim.diloco.outer_momentum": 0.0, "mesh.fsdp": 2})
  batches = _batches(data_dir, cfg, 3, full_mask=True)
  got, state, _ = _train(cfg, batches)
  plain = cfg.copy_and_resolve_references()
  plain.optim.diloco.replicas = 0
  want, dp_state, _ = _train(plain, batches)
  np.testing.assert_allclose(got, want, rtol=1e-6)
  _assert_trees_close(state.anchor, dp_state.params, rtol=2e-5, atol=1e-7)
  for r in range(2):  # every replica restarts from the anchor
    _assert_trees_close(jax.tree.map(lambda p: p[r], state.params), state.anchor, rtol=0, atol=0)
  assert want[-1] < want[0]


def test_the_logged_loss_weights_the_replicas_by_their_target_tokens(data_dir, devices):
  """The row a DiLoCo run logs (`reduce_metrics`, dispatched as the step is added to the metrics
  window) is the global batch's: at step 1, every replica at the same parameters, its loss is
  data parallelism's loss per target token although the replicas' rows hold different numbers
  of target tokens; counts are summed; on a step that does not log, the flags alone reduce."""
  cfg = _cfg()
  batch = _batches(data_dir, cfg, 1)[0]
  rows, seq = batch["loss_mask"].shape[1:]
  batch["loss_mask"][:, :rows // 2, seq // 4:] = 0  # replica 0's rows: a quarter of the targets
  rows_out = {}
  for replicas in (2, 0):
    c = cfg.copy_and_resolve_references()
    c.optim.diloco.replicas = replicas
    program = Program(c, run_mesh(c, devices))
    window = MetricsWindow(reduce_metrics(program.mesh) if replicas else None)
    with jax.set_mesh(program.mesh):
      sharded = {k: jax.device_put(v, program.batch_sharding) for k, v in batch.items()}
      _, metrics = program.jitted_step(logs=True)(program.init_state(), sharded)
      if replicas:
        tokens = jax.device_get(metrics["target_tokens"])
        assert tokens[0] < tokens[1] / 2, tokens  # the replicas' counts differ
      window.add(1, metrics, log=True)
      window.add(2, metrics, log=False)
      rows_out[replicas] = {s: m for s, m, _ in window.read()}
  diloco, plain = rows_out[2], rows_out[0]
  assert diloco[1]["target_tokens"] == plain[1]["target_tokens"]
  np.testing.assert_allclose(diloco[1]["loss"], plain[1]["loss"], rtol=1e-6)
  assert set(diloco[2]) == set(FLAG_KEYS) and diloco[2]["loss"] == diloco[1]["loss"]


def test_one_replica_is_the_lookahead_step_computed_by_hand(data_dir, devices):
  """M = 1, H = 3, AdamW inner, outer Nesterov SGD (lr 0.7, momentum 0.9): two outer steps equal
  plain steps from the same start with the outer update done by hand in numpy (Delta = anchor -
  theta; m = 0.9 m + Delta; anchor -= 0.7 (Delta + 0.9 m); theta = anchor, Adam's state kept)."""
  h = 3
  cfg = tiny_config(**{"optim.diloco.replicas": 1, "optim.diloco.inner_steps": h,
                       "optim.clip_norm": 0.0, "mesh.fsdp": 2})
  batches = _batches(data_dir, cfg, 2 * h)
  _, got, _ = _train(cfg, batches)

  plain = cfg.copy_and_resolve_references()
  plain.optim.diloco.replicas = 0
  program = Program(plain, run_mesh(plain))
  state = program.init_state()
  step = program.jitted_step(logs=True)
  anchor = jax.device_get(state.params)
  momentum = jax.tree.map(np.zeros_like, anchor)
  with jax.set_mesh(program.mesh):
    for n, batch in enumerate(batches, 1):
      state, _ = step(state, {k: jax.device_put(v, program.batch_sharding)
                              for k, v in batch.items()})
      if n % h == 0:
        theta = jax.device_get(state.params)
        delta = jax.tree.map(lambda a, t: a - t, anchor, theta)
        momentum = jax.tree.map(lambda m, d: 0.9 * m + d, momentum, delta)
        anchor = jax.tree.map(lambda a, d, m: a - 0.7 * (d + 0.9 * m), anchor, delta, momentum)
        state = state.replace(params=jax.device_put(anchor, program.shardings.params))
  # Float rounding of the two programs, amplified by Adam's division where a gradient is ~0.
  assert_adam_params_close(got.anchor, anchor, lr=cfg.optim.learning_rate)
  assert_adam_params_close(got.outer_opt_state[0].trace, momentum, lr=cfg.optim.learning_rate)
  # The outer step is no identity: the anchor is not where the inner steps ended.
  assert not all(np.allclose(a, t, atol=1e-4) for a, t in zip(jax.tree.leaves(got.anchor),
                                                               jax.tree.leaves(theta)))


def test_replicas_on_8_devices_equal_the_same_run_on_2(data_dir, devices):
  """M = 2 on 8 devices (each replica data=2 x fsdp=2) equals M = 2 on 2 devices (one each),
  through outer steps (H = 2, AdamW inner, the default outer optimizer)."""
  cfg = tiny_config(**{"optim.diloco.replicas": 2, "optim.diloco.inner_steps": 2,
                       "mesh.fsdp": 2})
  batches = _batches(data_dir, cfg, 4)
  got, state8, program = _train(cfg, batches)
  assert dict(program.mesh.shape) == {"replica": 2, "stage": 1, "data": 2, "fsdp": 2,
                                      "tensor": 1, "sequence": 1, "expert": 1}
  small = cfg.copy_and_resolve_references()
  small.mesh.fsdp = 1
  want, state2, _ = _train(small, batches, devices=jax.devices()[:2])
  np.testing.assert_allclose(got, want, rtol=2e-6)
  _assert_trees_close(state8.anchor, state2.anchor, rtol=1e-4, atol=1e-6)
  _assert_trees_close(state8.opt_state, state2.opt_state, rtol=1e-4, atol=1e-6)


# ------------------------------------------------------------------------------------------------
# Communication, from the compiled programs


def test_only_the_outer_step_communicates_across_replicas(devices):
  """The inner step of M = 2 replicas x (data 2, fsdp 2) has collectives (inside a replica) but
  none whose device groups join two replicas; the outer step's cross them and move about the
  parameters' bytes per device; plain data parallelism on the same devices crosses them every
  step (counted from the compiled programs)."""
  cfg = tiny_config(**{"optim.diloco.replicas": 2, "optim.diloco.inner_steps": 4,
                       "mesh.fsdp": 2})
  program = Program(cfg, run_mesh(cfg))
  inner, outer = program.compile(), program.compile_outer()
  labels = communication.replica_labels(program.mesh)
  assert labels == [0, 0, 0, 0, 1, 1, 1, 1]
  inner_ops = collectives(inner.as_text())
  assert inner_ops and not crossing(inner_ops, labels)
  report = communication.measure(program, inner, outer)
  param_bytes = sum(x.size * x.dtype.itemsize
                    for x in jax.tree.leaves(program.spec.abstract_params))
  assert report.inner_bytes == 0 and report.inner_ops == 0
  assert param_bytes / 2 <= report.outer_bytes <= param_bytes / 2 * 1.1  # fsdp=2 halves it
  assert report.data_parallel_bytes > report.outer_bytes / 4
  assert report.per_step == report.outer_bytes / 4
  assert "inner step 0 B" in report.lines()[0]


@pytest.mark.parametrize("text,groups", [
    ("replica_groups={{0,1},{2,3}}, use_global", ((0, 1), (2, 3))),
    ("replica_groups=[2,2]<=[4], dim", ((0, 1), (2, 3))),
    ("replica_groups=[2,2]<=[2,2]T(1,0), dim", ((0, 2), (1, 3))),
    ("replica_groups=mesh['a'=2,'b'=4] {'b'}, use", ((0, 1, 2, 3), (4, 5, 6, 7))),
    ("replica_groups=mesh['a'=2,'b'=4] {'a'}, use", ((0, 4), (1, 5), (2, 6), (3, 7))),
    ("replica_groups=mesh['a'=2,'b'=2,'c'=2], device_ids=([2,2,2]T(0,2,1)) {'b'}, x",
     ((0, 1), (2, 3), (4, 5), (6, 7))),
    ("replica_groups=mesh['a'=8] {'a':(2)2}, use", ((0, 2), (1, 3), (4, 6), (5, 7))),
    ("source_target_pairs={{0,1},{1,0}}, ch", ((0, 1), (1, 0))),
])
def test_replica_group_spellings(text, groups):
  from sharding.collectives import parse_groups  # noqa: PLC0415
  assert tuple(sorted(parse_groups(text))) == tuple(sorted(groups))


def test_collective_runs_count_loop_trips():
  """A collective in a while body runs its trip count times (XLA's known_trip_count, or read
  from the loop's condition and initial counter); bytes per kind; an instruction spanning lines
  (a Mosaic kernel's config) does not end its computation."""
  hlo = """HloModule m

%body (p: (s32[], f32[4])) -> (s32[], f32[4]) {
  %ar = f32[4]{0} all-reduce(%x), replica_groups={{0,1}}, to_apply=%add
  %rs = f32[2]{0} reduce-scatter(%y), replica_groups={{0,1}}, dimensions={0}
}

%cond2 (p: (s32[], f32[4])) -> pred[] {
  %bound = s32[]{:T(128)} constant(3)
  %i = s32[]{:T(128)} get-tuple-element(%p), index=0
  ROOT %lt = pred[]{:T(512)} compare(%i, %bound), direction=LT
}

%body2 (p: (s32[], f32[4])) -> (s32[], f32[4]) {
  %ar2 = f32[2]{0} all-reduce(%x), replica_groups={{0,1}}, to_apply=%add
}

ENTRY %main (a: f32[4]) -> f32[4] {
  %w = (s32[], f32[4]) while(%t), condition=%cond, body=%body, backend_config={"known_trip_count":{"n":"5"}}
  %one = s32[] constant(1)
  %start = s32[]{:T(128)} copy(%one)
  %init = (s32[], f32[4]) tuple(%start, /*index=1*/%a)
  %w2 = (s32[], f32[4]) while(%init), condition=%cond2, body=%body2
  %ag = bf16[8,2]{1,0} all-gather(%z), replica_groups=[1,2]<=[2], dimensions={0}
  %kernel = f32[2]{0} custom-call(%q), custom_call_target="tpu_custom_call", backend_config={"k":
"{\"block\": 128}"
}}, metadata={op_name="a Mosaic kernel's config spans lines"}
  %send = (f32[16,8,128]{2,1,0:T(8,128)}, u32[], token[]) send(%b, %t), channel_id=2, is_host_transfer=true, frontend_attributes={_xla_host_transfer_handler_name="xla_megascale_runtime",_xla_megascale_target="{1,2}x{0:3}",_xla_megascale_transfer_type="ALL_REDUCE"}
}
"""
  ops = {(op.kind, op.bytes): op for op in collectives(hlo)}
  # a TPU loop states no trip count: counter from 1 (a copied constant) while < 3 runs twice
  assert ops["all-reduce", 8].count == 2
  ops = {kind: op for (kind, size), op in ops.items() if (kind, size) != ("all-reduce", 8)}
  assert (ops["all-reduce"].bytes, ops["all-reduce"].count) == (16, 5)
  assert (ops["reduce-scatter"].bytes, ops["reduce-scatter"].count) == (16, 5)
  assert (ops["all-gather"].bytes, ops["all-gather"].count) == (32, 1)
  # a multi-slice TPU program's reduction between slices (a Megascale host transfer)
  assert (ops["dcn-all-reduce"].bytes, ops["dcn-all-reduce"].groups) == (16 * 8 * 128 * 4, ())
  assert crossing(list(ops.values()), [0, 1]) == list(ops.values())
  assert crossing(list(ops.values()), [0, 0]) == []


def test_a_transfer_between_slices_is_placed_only_where_no_replica_spans_two_slices():
  """A Megascale transfer names no slices: it crosses replicas for sure when each replica lies
  inside one slice (one or several replicas per slice); when a replica spans slices it may stay
  inside one, so it is unplaced and the bytes that include it are unknown, said in a line."""
  hlo = ("HloModule m\n\nENTRY %main (a: f32[4]) -> f32[4] {\n"
         '  %send = (f32[4,8]{1,0}, u32[], token[]) send(%b, %t), channel_id=2, '
         'is_host_transfer=true, frontend_attributes={_xla_host_transfer_handler_name='
         '"xla_megascale_runtime",_xla_megascale_transfer_type="ALL_REDUCE"}\n'
         "  %ar = f32[2]{0} all-reduce(%x), replica_groups={{0,1},{2,3}}, to_apply=%add\n}\n")
  ops = collectives(hlo)
  dcn = [op for op in ops if op.kind == "dcn-all-reduce"]
  replicas = [0, 0, 1, 1]
  for slices in ([0, 0, 1, 1], [0, 0, 0, 0], None):  # a replica per slice; two in one slice
    assert crossing(ops, replicas, slices) == dcn and unattributed(ops, replicas, slices) == []
  in_slice = [op for op in ops if op not in dcn]
  # replicas interleaved over two slices: the in-slice all-reduce crosses, the transfer unplaced
  assert crossing(ops, [0, 1, 0, 1], [0, 0, 1, 1]) == in_slice
  assert unattributed(ops, [0, 1, 0, 1], [0, 0, 1, 1]) == dcn
  spanning = [0, 1, 2, 3]  # each replica two slices
  assert crossing(ops, replicas, spanning) == [] and unattributed(ops, replicas, spanning) == dcn
  assert crossing(ops, [0, 0, 0, 0], spanning) == unattributed(ops, [0] * 4, spanning) == []

  class Compiled:
    def as_text(self):
      return hlo

  assert communication.crossing_bytes(Compiled(), replicas, [0, 0, 1, 1]) == (128.0, 1, 0)
  assert communication.crossing_bytes(Compiled(), replicas, spanning) == (None, 0, 1)
  report = communication.Communication(2, 4, None, 0, None, None, 1.0, unplaced=2)
  assert "inner step an unknown number of bytes" in report.lines()[0]
  assert "2 transfer(s) between slices could not be placed" in report.lines()[-1]


# ------------------------------------------------------------------------------------------------
# The mesh


def test_replica_axis_is_outermost_and_splits_the_batch_first(devices):
  mesh = make_mesh({"data": -1, "tensor": 2}, replicas=2)
  assert mesh.axis_names[0] == "replica" and dict(mesh.shape)["data"] == 2
  ids = np.vectorize(lambda d: d.id)(mesh.devices)
  assert set(ids[0].flat) == {0, 1, 2, 3}  # replica 0: a contiguous block of devices
  program = Program(tiny_config(**{"optim.diloco.replicas": 2, "mesh.tensor": 2}), mesh)
  assert program.batch_sharding.spec[1] == ("replica", "data", "fsdp", "expert")
  folded = fold_replicas(mesh)
  assert dict(folded.shape)["data"] == 4 and "replica" not in folded.axis_names
  np.testing.assert_array_equal(np.vectorize(lambda d: d.id)(folded.devices).flat, ids.flat)


@pytest.mark.parametrize("replicas,n,slices,ici,dcn", [
    (2, 16, 2, {"replica": 1, "data": 8}, {"replica": 2, "data": 1}),  # a replica per slice
    (4, 16, 2, {"replica": 2, "data": 4}, {"replica": 2, "data": 1}),
    (2, 16, 4, {"replica": 1, "data": 4}, {"replica": 2, "data": 2}),  # 2 slices per replica
])
def test_replicas_take_whole_slices(replicas, n, slices, ici, dcn):
  got_ici, got_dcn = resolve_mesh({"data": -1, "dcn_data": -1}, n, slices, replicas)
  assert {k: got_ici[k] for k in ici} == ici and {k: got_dcn[k] for k in dcn} == dcn


@pytest.mark.parametrize("replicas,slices", [(3, 2), (6, 4), (4, 6)])
def test_replicas_that_neither_fill_nor_divide_slices_are_refused(replicas, slices):
  """6 replicas on 4 slices would put parts of slices in a replica and replicas across slices."""
  with pytest.raises(MeshError, match=rf"optim.diloco.replicas={replicas} on {slices} slices: "
                     "a replica must be whole slices or lie inside one"):
    resolve_mesh({"data": -1, "dcn_data": -1}, 48, slices, replicas)


# ------------------------------------------------------------------------------------------------
# Runs: resume bit for bit (also at an outer step), another mesh, parameters for other tools


def _run_cfg(**overrides):
  return tiny_config(**{"optim.diloco.replicas": 2, "optim.diloco.inner_steps": 2,
                        "mesh.fsdp": 2, "eval_every": 4, "checkpoint.every_steps": 3,
                        **overrides})


def _killed_at(workdir, step: int) -> None:
  """A 6-step run (resumed from `workdir` if it has a checkpoint) stopped after `step`, as if
  killed there: it saves every step, so its newest checkpoint is `step`."""
  stop = lambda n, row: "killed" if n >= step else None
  Run(_run_cfg(steps=6, **{"checkpoint.every_steps": 1}), str(workdir), stop_when=stop).train()
  assert Checkpointer(str(workdir / "checkpoints"), keep=3).latest_step() == step


@pytest.mark.slow  # the default run keeps DiLoCo's restore onto another mesh (below)
def test_resume_is_bit_for_bit_between_and_at_outer_steps(tmp_path):
  """A straight 6-step run (outer steps after 2, 4 and 6) against one killed after step 3
  (between outer steps), resumed and killed after step 4 (right after one), and resumed to the
  end: the same losses bit for bit; a DiLoCo checkpoint's anchor is what other tools read."""
  straight = tmp_path / "straight"
  assert Run(_run_cfg(steps=6), str(straight)).train().status == "done"
  rows = metric_rows(straight)
  assert "outer_grad_norm" in rows[2] and "outer_grad_norm" not in rows[3]
  want = losses(straight)

  resumed = tmp_path / "resumed"
  _killed_at(resumed, 3)
  _killed_at(resumed, 4)
  Run(_run_cfg(steps=6), str(resumed)).train()
  got = losses(resumed)
  assert [got[s] for s in range(1, 7)] == [want[s] for s in range(1, 7)]  # bit for bit
  # Other tools (init_from, tools.evaluate, export) read a DiLoCo checkpoint's anchor.
  program = Program(_run_cfg(), run_mesh(_run_cfg()))
  params, _ = load_params(str(straight), program.spec.abstract_params)
  with ocp.StandardCheckpointer() as reader:
    state = reader.restore(straight / "checkpoints" / "6" / "state", program.abstract_state())
  _assert_trees_close(jax.device_get(params), jax.device_get(state.anchor), rtol=0, atol=0)


@pytest.mark.parametrize("mesh,ndev", [({"data": 4}, 8), ({"tensor": 2}, 4), ({"data": 1}, 2)],
                         ids=["data4", "tensor2-4dev", "2dev"])
def test_checkpoint_restores_onto_another_mesh_with_the_same_m(tmp_path, data_dir, mesh, ndev):
  """A DiLoCo state saved on replica=2 x (data=2, fsdp=2) restores exactly onto other meshes
  with the same M: the replicas' parameters and inner states, the anchor and outer momentum."""
  saved_cfg = _run_cfg()
  program = Program(saved_cfg, run_mesh(saved_cfg))
  state = program.init_state()
  step, outer = program.jitted_step(), program.jitted_outer()
  # two inner steps (the first at warmup's lr 0), outer, inner: the whole state non-trivial
  with jax.set_mesh(program.mesh):
    for n, batch in enumerate(_batches(data_dir, saved_cfg, 3)):
      state, _ = step(state, {k: jax.device_put(v, program.batch_sharding)
                              for k, v in batch.items()})
      if n == 1:
        state, _ = outer(state)
  want = jax.device_get(state)
  embed = lambda tree: tree["embed_VE"]
  assert not np.allclose(embed(want.params)[0], embed(want.params)[1])  # the replicas differ
  assert np.abs(embed(want.outer_opt_state[0].trace)).max() > 0
  spec = pipeline.StreamSpec(data_dir, "train", 32, 8)
  ckpt = Checkpointer(str(tmp_path), keep=1)
  ckpt.save(1, state, iter(pipeline.dataset(spec)), spec, saved_cfg.to_dict())
  ckpt.wait()
  cfg = _run_cfg(**{"mesh.fsdp": 1, **{f"mesh.{k}": v for k, v in mesh.items()}})
  other = Program(cfg, run_mesh(cfg, jax.devices()[:ndev]))
  restored = Checkpointer(str(tmp_path), keep=1).restore_latest(
      other.abstract_state(), spec, cfg.to_dict())
  got, step = restored.state, restored.step
  assert step == 1 and len(embed(got.anchor).sharding.device_set) == ndev
  jax.tree.map(np.testing.assert_array_equal, jax.device_get(got), want)


def test_another_m_is_refused_in_user_terms_and_init_from_takes_the_anchor(tmp_path):
  """Resuming with another M is refused naming the key; a new run with another M may start
  from the old run's outer model (`checkpoint.init_from` reads its anchor)."""
  workdir = tmp_path / "w"
  Run(_run_cfg(steps=2, **{"eval_every": 2, "checkpoint.every_steps": 2}), str(workdir)).train()
  four = {"optim.diloco.replicas": 4, "mesh.fsdp": 1, "eval_every": 2}
  with pytest.raises(CheckpointError, match="optim.diloco.replicas=2, the config has 4"):
    Run(_run_cfg(steps=2, **four), str(workdir)).train()
  warm = Run(_run_cfg(steps=2, **four, **{"checkpoint.init_from": str(workdir)}),
             str(tmp_path / "warm"))
  assert warm.train().status == "done"
  cold = metric_rows(workdir)
  assert metric_rows(tmp_path / "warm")[1]["loss"] < cold[1]["loss"]  # starts where w ended


def test_batch_rules_and_ramp_apply_to_the_inner_steps_at_the_global_batch(tmp_path):
  """A batch ramp 8 -> 16 under DiLoCo (M = 2): every stage's inner optimizer takes the
  hyperparameters its rules derive at the stage's global batch (here lr x sqrt(2)), and each
  step's rows are the global batch's."""
  cfg = _run_cfg(steps=4, **{"data.global_batch_size": 16, "data.micro_batch_size": 8,
                             "data.batch_ramp": "8:0,16:512", "optim.lr_rule": "sqrt",
                             "optim.reference_batch_size": 8, "optim.schedule": "constant",
                             "optim.warmup_steps": 0, "checkpoint.every_steps": 0})
  validate(cfg, 8)
  Run(cfg, str(tmp_path)).train()
  rows = metric_rows(tmp_path)
  assert [rows[s]["batch_size"] for s in (1, 2, 3, 4)] == [8, 8, 16, 16]
  # the replicas' target tokens add up to the global batch's (each row has up to 32)
  assert all(0.8 < rows[s]["target_tokens"] / (32 * rows[s]["batch_size"]) <= 1 for s in rows)
  lr = cfg.optim.learning_rate  # stated at the reference batch 8
  assert rows[2]["learning_rate"] == pytest.approx(lr)
  assert rows[3]["learning_rate"] == pytest.approx(lr * 2 ** 0.5)


# ------------------------------------------------------------------------------------------------
# Config errors: one line naming the key, before anything compiles


@pytest.mark.parametrize("overrides,needle", [
    ({"optim.diloco.replicas": 3}, "optim.diloco.replicas=3 does not divide the 8 devices"),
    ({"optim.diloco.replicas": -1}, "optim.diloco.replicas=-1: must be >= 0"),
    ({"optim.diloco.inner_steps": 0}, "optim.diloco.inner_steps=0: must be >= 1"),
    ({"optim.diloco.outer_lr": 0.0}, "optim.diloco.outer_lr=0.0: must be positive"),
    ({"optim.diloco.outer_momentum": 1.0}, "optim.diloco.outer_momentum=1.0: must be in [0, 1)"),
    ({"steps": 5}, "steps=5 is not a multiple of optim.diloco.inner_steps=2"),
    ({"eval_every": 3}, "eval_every=3 is not a multiple of optim.diloco.inner_steps=2"),
    ({"data.global_batch_size": 12}, "data.global_batch_size=12 is not divisible by the "
     "data-parallel size 8 (mesh.data x mesh.fsdp x mesh.expert x optim.diloco.replicas)"),
    ({"optim.noise_scale_every": 2}, "optim.noise_scale_every=2 with optim.diloco.replicas=2"),
    ({"optim.ema_decay": 0.9}, "optim.ema_decay=0.9 with optim.diloco.replicas=2"),
    ({"mesh.fsdp": 1, "mesh.sequence": 2, "model.attention": "auto"},
     "model.attention='auto' runs ring attention over "
     "mesh.sequence=2, which does not run inside DiLoCo's replicas yet"),
])
def test_config_errors(overrides, needle, devices):
  cfg = _run_cfg(**{"steps": 4, "eval_every": 0, **overrides})
  with pytest.raises(ConfigError) as e:
    validate(cfg, devices)
  assert needle in str(e.value) and "\n" not in str(e.value), str(e.value)


def test_bad_replicas_on_the_command_line_is_one_line_exit_2(tmp_path, capsys):
  code = train.main(["--config", TINY, "--workdir", str(tmp_path / "w"),
                     "--config.optim.diloco.replicas=3"])
  err = capsys.readouterr().err
  assert code == 2 and "optim.diloco.replicas=3" in err and len(err.strip().splitlines()) == 1


# ------------------------------------------------------------------------------------------------
# The experiment (experiments/diloco.py)


def test_experiment_optimal_batch_and_arm_configs():
  from experiments import diloco as experiment  # noqa: PLC0415
  # the parabola in log2(batch) through the best point and its neighbours; an edge stays
  assert experiment.best_batch([(8, 3.0), (16, 2.0), (32, 3.0)]) == (16.0, True)
  batch, inside = experiment.best_batch([(8, 3.0), (16, 2.0), (32, 2.5), (64, 4.0)])
  assert inside and 16 < batch < 32
  assert experiment.best_batch([(8, 2.0), (16, 2.5), (32, 3.0)]) == (8.0, False)
  args, _ = experiment.parse(["--examples", "512", "--evals", "8"])
  assert [(m, h) for _, m, h in experiment.arms(args)][:3] == [(0, 1), (1, 1), (1, 8)]
  cfg = experiment.arm_config(tiny_config(), args, 16, 2, 8)  # 32 steps: evaluations every 8
  assert (cfg.steps, cfg.eval_every, cfg.optim.diloco.replicas) == (32, 8, 2)
  validate(cfg, 8)
  with pytest.raises(ValueError, match="not a multiple of H=32"):
    experiment.arm_config(tiny_config(), args, 64, 2, 32)


def test_experiment_tunes_every_arm_at_every_batch(tmp_path, monkeypatch):
  """`--lr_grid` / `--outer_lr_grid` (a stand-in trainer with a known surface: final loss
  2 + log2(inner multiplier / best)^2 + (outer - 0.8)^2 + 0.01 x seed, best 2 for data
  parallelism, 0.5 for DiLoCo): the inner rates grow beyond a winning edge, every (arm, batch)
  takes its best cell on the seeds' mean, and the tuned arms are compared seed by seed."""
  import math  # noqa: PLC0415
  from experiments import common  # noqa: PLC0415
  from experiments import diloco as experiment  # noqa: PLC0415
  from optim.scaling import stated  # noqa: PLC0415
  from trainer.run.inprocess import Trained  # noqa: PLC0415

  def train(cfg, workdir, **_):
    m, mult = cfg.optim.diloco.replicas, stated(cfg.optim)["learning_rate"][0] / 1e-2
    loss = (2 + math.log2(mult / (0.5 if m else 2.0)) ** 2 + 0.01 * cfg.seed
            + ((cfg.optim.diloco.outer_lr - 0.8) ** 2 + 0.003 * cfg.seed ** 2 if m else 0.0))
    return Trained("done", cfg.steps, 0.0, [{"step": cfg.steps, "eval_loss": loss}], None, workdir)

  monkeypatch.setattr(common, "train", train)
  config = tiny_config_file(tmp_path, learning_rate=1e-2)
  out = tmp_path / "out" / "diloco"
  assert experiment.main([
      "--config", str(config), "--batch_sizes", "8", "--replicas", "2", "--inner_steps", "2",
      "--examples", "64", "--out", str(out), "--workdir", str(tmp_path / "runs"), "--seeds", "2",
      "--lr_grid", "1", "--outer_lr_grid", "0.4,0.8,1.2"]) == 0
  tuned = {r["arm"]: r for r in csv.DictReader(open(f"{out}_tuned.csv"))}
  dp, dl = tuned["data parallel"], tuned["DiLoCo M=2 H=2"]
  assert (float(dp["lr_multiplier"]), dp["multipliers"], dp["interior"]) == (2.0, "0.5/1/2/4",
                                                                           "True")
  assert (float(dl["lr_multiplier"]), float(dl["outer_lr"])) == (0.5, 0.8)
  assert dl["multipliers"] == "0.25/0.5/1/2" and dl["outer_interior"] == "True"
  runs = list(csv.DictReader(open(f"{out}.csv")))
  assert len(runs) == 4 * 2 + 4 * 3 * 2  # (rates x seeds) and (rates x outer rates x seeds)
  (d,) = list(csv.DictReader(open(f"{out}_paired.csv")))
  assert float(d["diff"]) == pytest.approx(0.0015) and d["called"] == "True"  # 0.003 x seed^2
  assert experiment.main(["--config", str(config), "--outer_lr_grid", "0,1"]) == 2


def test_tuned_experiment_brackets_the_outer_rate(tmp_path, monkeypatch):
  """An outer optimum below the outer grid (a stand-in surface: final loss 2 + log2(inner / 0.5)^2
  + 10 (outer - 0.2)^2 + 0.01 x seed): the outer rates grow below 0.35 at the best inner rate,
  the inner rates are bracketed again at the new outer rate, and the best cell is inside both;
  with one round the outer rate is still at its edge, censored, and the comparison not called."""
  import math  # noqa: PLC0415
  from experiments import common  # noqa: PLC0415
  from experiments import diloco as experiment  # noqa: PLC0415
  from optim.scaling import stated  # noqa: PLC0415
  from trainer.run.inprocess import Trained  # noqa: PLC0415

  def train(cfg, workdir, **_):
    m, mult = cfg.optim.diloco.replicas, stated(cfg.optim)["learning_rate"][0] / 1e-2
    loss = (2 + math.log2(mult / 0.5) ** 2 + 0.01 * cfg.seed
            + (10 * (cfg.optim.diloco.outer_lr - 0.2) ** 2 if m else 0.0))
    return Trained("done", cfg.steps, 0.0, [{"step": cfg.steps, "eval_loss": loss}], None, workdir)

  monkeypatch.setattr(common, "train", train)
  config = tiny_config_file(tmp_path, learning_rate=1e-2)
  def run(extensions):
    out = tmp_path / f"out{extensions}" / "diloco"
    assert experiment.main([
        "--config", str(config), "--batch_sizes", "8", "--replicas", "2", "--inner_steps", "2",
        "--examples", "64", "--out", str(out), "--workdir", str(tmp_path / "runs"), "--seeds",
        "2", "--lr_grid", "0.5,1,2", "--outer_lr_grid", "0.35,0.7,1.0",
        "--max_extensions", str(extensions)]) == 0
    tuned = {r["arm"]: r for r in csv.DictReader(open(f"{out}_tuned.csv"))}
    (d,) = list(csv.DictReader(open(f"{out}_paired.csv")))
    return tuned["DiLoCo M=2 H=2"], d
  dl, d = run(3)
  assert (float(dl["lr_multiplier"]), float(dl["outer_lr"])) == (0.5, 0.175)
  assert dl["outer_rates"] == "0.0875/0.175/0.35/0.7/1" and dl["outer_interior"] == "True"
  assert dl["multipliers"] == "0.25/0.5/1" and dl["interior"] == "True" and d["called"] == "True"
  dl, d = run(1)
  assert float(dl["outer_lr"]) == 0.175 and dl["outer_rates"] == "0.175/0.35/0.7/1"
  assert dl["outer_interior"] == "False" and dl["interior"] == "False" and d["called"] == "False"


@pytest.mark.slow
def test_experiment_end_to_end(tmp_path):
  from experiments import diloco as experiment  # noqa: PLC0415
  config = tiny_config_file(tmp_path)
  out = tmp_path / "out" / "diloco"
  assert experiment.main([
      "--config", str(config), "--batch_sizes", "8,16", "--replicas", "2",
      "--inner_steps", "2", "--examples", "64", "--eval_sequences", "8", "--out", str(out),
      "--workdir", str(tmp_path / "runs")]) == 0
  rows = list(csv.DictReader(open(f"{out}.csv")))
  assert [(r["arm"], int(r["batch_size"]), int(r["steps"])) for r in rows] == [
      ("data parallel", 8, 8), ("data parallel", 16, 4), ("DiLoCo M=2 H=2", 8, 8),
      ("DiLoCo M=2 H=2", 16, 4)]
  assert all(np.isfinite(float(r["final_eval_loss"])) for r in rows)
  assert os.path.getsize(f"{out}.png") > 10_000


@pytest.mark.slow  # six tiny trainings
def test_tuned_experiment_end_to_end(tmp_path):
  """The tuned mode training for real (two inner rates, two outer rates, one seed): every run in
  OUT.csv, one best cell per arm in OUT_tuned.csv (censored: a two-point grid without
  extensions), the comparison written."""
  from experiments import diloco as experiment  # noqa: PLC0415
  out = tmp_path / "out" / "diloco"
  assert experiment.main([
      "--config", str(tiny_config_file(tmp_path)), "--batch_sizes", "8", "--replicas", "2",
      "--inner_steps", "2", "--examples", "32", "--eval_sequences", "8", "--out", str(out),
      "--workdir", str(tmp_path / "runs"), "--lr_grid", "1,2", "--max_extensions", "0",
      "--outer_lr_grid", "0.7,1.0"]) == 0
  runs = list(csv.DictReader(open(f"{out}.csv")))
  assert len(runs) == 2 + 4 and all(np.isfinite(float(r["final_eval_loss"])) for r in runs)
  assert {r["arm"] for r in csv.DictReader(open(f"{out}_tuned.csv"))} == {
      "data parallel", "DiLoCo M=2 H=2"}
  assert os.path.exists(f"{out}_paired.csv")

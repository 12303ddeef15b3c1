"""Mixture of experts (models/moe.py, models/moe_dispatch.py): the layer against the dense MLP,
dropless against capacity, expert-parallel meshes against one device, the global-batch balance
loss against micro-batching, config errors, and train.py end to end with resume."""
import os
import subprocess
import sys

import jax
import jax.numpy as jnp
import numpy as np
import pytest
import test_train_step
from flax import nnx

import train
from conftest import losses, metric_rows, override, tiny_config
from models.llama import MLP, ModelConfig
from models.moe import MoE, MoEConfig
from models.moe_dispatch import capacity_keep
from models.sizes import param_counts
from sharding import make_mesh
from trainer.run.loop import Run
from trainer.step.state import ModelSpec, init_state
from trainer.step.train_step import grad_sums

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
MOE = {"model.moe.num_experts": 8, "model.moe.top_k": 2, "model.moe.mlp_dim": 32}


def _layer(**moe):
  cfg = ModelConfig(d_model=16, num_layers=1, num_heads=2, num_kv_heads=2, mlp_dim=24,
                    vocab_size=64, moe=MoEConfig(**moe))
  return cfg, MoE(cfg, rngs=nnx.Rngs(params=1))


def _x(B=2, S=16, E=16):
  return jax.random.normal(jax.random.key(3), (B, S, E), jnp.float32)


@pytest.mark.parametrize("capacity_factor", [0.0, 1.0])
def test_one_expert_top1_equals_the_dense_mlp(capacity_factor):
  cfg, moe = _layer(num_experts=1, top_k=1, capacity_factor=capacity_factor)
  mlp = MLP(cfg, rngs=nnx.Rngs(params=2))
  moe.w_gate_NEF[...] = mlp.w_gate_EF[...][None]
  moe.w_up_NEF[...] = mlp.w_up_EF[...][None]
  moe.w_down_NFE[...] = mlp.w_down_FE[...][None]
  x = _x()
  y, stats = moe(x)
  np.testing.assert_allclose(y, mlp(x), rtol=1e-5, atol=1e-6)
  assert float(stats["dropped"]) == 0 and float(stats["counts"][0]) == 32


def test_dropless_equals_capacity_when_ample_and_drops_are_counted():
  x = _x()
  _, dropless = _layer(num_experts=4, top_k=2)
  _, ample = _layer(num_experts=4, top_k=2, capacity_factor=4.0)  # capacity = S k: no drops
  y0, s0 = dropless(x)
  y1, s1 = ample(x)
  np.testing.assert_allclose(y1, y0, rtol=1e-5, atol=1e-6)
  assert float(s1["dropped"]) == 0
  # A tight capacity drops exactly the assignments beyond it, per expert and sequence.
  cfg, tight = _layer(num_experts=4, top_k=2, capacity_factor=0.5)
  y2, s2 = tight(x)
  experts = tight.route(x)[0]
  capacity = cfg.moe.capacity(x.shape[1])
  full = jax.lax.top_k(jax.nn.softmax(jnp.einsum("bse,en->bsn", x, tight.w_router_EN[...])), 2)[1]
  per_row = jax.nn.one_hot(full, 4).sum(axis=(1, 2))  # [B, N]
  expected = float(jnp.maximum(per_row - capacity, 0).sum())
  assert expected > 0 and float(s2["dropped"]) == expected
  assert int((experts == 4).sum()) == expected  # dropped assignments are routed nowhere
  assert not np.allclose(y2, y0)


def test_megablox_equals_ragged_dot():
  """The Pallas kernel (interpret mode here) against ragged_dot: outputs and gradients, with
  rows outside every group (dropped assignments) zero and passing no gradient."""
  from models.moe_dispatch import grouped_swiglu  # noqa: PLC0415
  cfg, moe = _layer(num_experts=4, top_k=2)
  x = jax.random.normal(jax.random.key(5), (40, 16))
  expert = jnp.sort(jax.random.randint(jax.random.key(6), (40,), 0, 5))  # 4 = no expert
  weights = (moe.w_gate_NEF[...], moe.w_up_NEF[...], moe.w_down_NFE[...])

  def run(impl):
    f = lambda x, w: jnp.sum(grouped_swiglu(x, expert, 4, *w, 0, impl) ** 2)
    return grouped_swiglu(x, expert, 4, *weights, 0, impl), jax.grad(f, (0, 1))(x, weights)

  (y0, g0), (y1, g1) = run("ragged_dot"), run("megablox")
  assert int((expert == 4).sum()) > 0 and not np.any(y1[expert == 4])
  np.testing.assert_allclose(y1, y0, rtol=1e-5, atol=1e-6)
  jax.tree.map(lambda a, b: np.testing.assert_allclose(a, b, rtol=1e-4, atol=1e-6), g1, g0)


def test_capacity_priority_is_first_choices_first():
  """Against a plain loop: per sequence, first choices in order, then second choices."""
  B, S, K, N, capacity = 3, 16, 2, 4, 5
  experts = np.asarray(jax.random.randint(jax.random.key(0), (B, S, K), 0, N))
  expected = np.zeros((B, S, K), bool)
  for b in range(B):
    used = [0] * N
    for k in range(K):
      for s in range(S):
        e = experts[b, s, k]
        expected[b, s, k] = used[e] < capacity
        used[e] += 1
  np.testing.assert_array_equal(capacity_keep(jnp.asarray(experts), N, capacity), expected)


def test_param_counts_total_and_active():
  cfg = ModelConfig.from_config(tiny_config(**MOE, **{"model.moe.every": 2,
                                                      "model.moe.shared_expert": 8,
                                                      "model.num_layers": 4}).model)
  spec = ModelSpec(cfg, make_mesh({"data": 1}, jax.devices()[:1]), 0)
  counts = param_counts(cfg)
  assert counts["total"] == sum(p.size for p in jax.tree.leaves(spec.abstract_params))
  expert = 3 * cfg.d_model * 32
  assert counts["total"] - counts["active"] == 2 * (8 - 2) * expert  # 2 MoE layers, 6 idle each


# --------------------------------------------------------------------------------------------
# Training steps: meshes and micro-batching.


@pytest.fixture(scope="module")
def reference(data_dir):
  cfg = tiny_config(**MOE, **{"model.moe.capacity_factor": 1.0})
  batches = test_train_step._batches(data_dir, cfg, 1)
  losses_, params = test_train_step._run(cfg, {"data": 1}, batches, devices=jax.devices()[:1])
  return cfg, batches, losses_, params


@pytest.mark.parametrize("mesh_cfg", [
    {"expert": 4, "fsdp": 2},
    {"expert": 2, "tensor": 2, "data": 2},
    pytest.param({"expert": 8}, marks=pytest.mark.slow),
    pytest.param({"expert": 2, "data": 4}, marks=pytest.mark.slow),
], ids=lambda m: ",".join(f"{k}={v}" for k, v in m.items()))
def test_expert_parallel_mesh_equals_one_device(reference, mesh_cfg, devices):
  """Capacity 1.0 drops assignments, and per-sequence capacity drops the same ones anywhere."""
  cfg, batches, ref_losses, ref_params = reference
  got, params = test_train_step._run(cfg, mesh_cfg, batches)
  np.testing.assert_allclose(got, ref_losses, rtol=2e-6)
  jax.tree.map(lambda a, b: np.testing.assert_allclose(a, b, rtol=1e-4, atol=1e-6),
               params, ref_params)
  assert ref_losses[-1] < ref_losses[0]


@pytest.mark.slow
def test_megablox_step_on_an_expert_mesh_equals_ragged_dot(data_dir, devices):
  """model.moe.impl='megablox' through the whole train step, experts split over 2 devices."""
  out = {}
  for impl in ("ragged_dot", "megablox"):
    cfg = tiny_config(**MOE, **{"model.moe.impl": impl, "steps": 2})
    batches = test_train_step._batches(data_dir, cfg, 1)[:2]
    out[impl] = test_train_step._run(cfg, {"expert": 2, "data": 4}, batches)
  np.testing.assert_allclose(out["megablox"][0], out["ragged_dot"][0], rtol=1e-6)
  jax.tree.map(lambda a, b: np.testing.assert_allclose(a, b, rtol=1e-4, atol=1e-6),
               out["megablox"][1], out["ragged_dot"][1])


def test_expert_parallel_program_exchanges_tokens_not_weights(devices):
  """The compiled step on expert=4 x fsdp=2: tokens move by all-to-all; expert weights are
  gathered only over fsdp (each device keeps its 2 of 8 experts); no batch-wide gather."""
  from optim import build_optimizer  # noqa: PLC0415
  from sharding import batch_sharding, replicated  # noqa: PLC0415
  from trainer.step.state import abstract_state, state_shardings  # noqa: PLC0415
  from trainer.step.train_step import make_train_step  # noqa: PLC0415
  cfg = tiny_config(**{**MOE, "model.moe.mlp_dim": 64})
  mesh = make_mesh({"expert": 4, "fsdp": 2})
  spec = ModelSpec(ModelConfig.from_config(cfg.model), mesh, 0)
  tx, schedule = build_optimizer(cfg.optim, spec.logical_names, cfg.steps)
  shardings, bsh = state_shardings(spec, tx), batch_sharding(mesh, microbatched=True)
  batch = {k: jax.ShapeDtypeStruct((1, 8, 32), jnp.int32, sharding=bsh)
           for k in ("inputs", "targets", "positions", "segment_ids", "loss_mask")}
  with jax.set_mesh(mesh):
    hlo = jax.jit(make_train_step(spec, tx, schedule), in_shardings=(shardings, bsh),
                  out_shardings=(shardings, replicated(mesh))).lower(
                      abstract_state(spec, tx), batch).compile().as_text()
  lines = hlo.splitlines()
  assert sum(" all-to-all(" in line for line in lines) >= 4  # rows, ids; back; and backward
  gathers = [line for line in lines if " all-gather(" in line]
  assert gathers and not [g for g in gathers if "top_k" in g or "sort" in g]
  shapes = [g.split(" = ")[1].split(" all-gather(")[0] for g in gathers]
  expert_weights = [sh for sh in shapes if "32,64]" in sh or "64,32]" in sh]  # [.., E, F] / [F, E]
  assert expert_weights and all(sh.startswith("f32[1,2,") for sh in expert_weights), shapes


def _sums(data_dir, scope, num_micro):
  cfg = tiny_config(**MOE, **{"model.moe.balance_scope": scope})
  batch = test_train_step._batches(data_dir, cfg, 1)[0]
  batch = {k: v.reshape(num_micro, -1, *v.shape[2:]) for k, v in batch.items()}
  spec = ModelSpec(ModelConfig.from_config(cfg.model), make_mesh({"data": 1},
                                                                 jax.devices()[:1]), 0)
  from optim import build_optimizer  # noqa: PLC0415
  tx, _ = build_optimizer(cfg.optim, spec.logical_names, cfg.steps)
  params = init_state(spec, tx).params
  _, _, grads, _, moe = jax.jit(lambda p, b: grad_sums(spec, p, b))(params, batch)
  return moe["aux"], grads


def test_global_balance_loss_is_independent_of_micro_batching(data_dir):
  aux1, g1 = _sums(data_dir, "global", 1)
  aux4, g4 = _sums(data_dir, "global", 4)
  np.testing.assert_allclose(aux4["balance"], aux1["balance"], rtol=1e-6)
  np.testing.assert_allclose(aux4["z"], aux1["z"], rtol=1e-6)
  jax.tree.map(lambda a, b: np.testing.assert_allclose(a, b, rtol=2e-4, atol=1e-5), g4, g1)
  # The per-micro-batch variant is a different loss (its f and P are micro-batch statistics).
  aux_mb, _ = _sums(data_dir, "micro_batch", 4)
  assert abs(float(aux_mb["balance"]) - float(aux1["balance"])) > 1e-4


@pytest.mark.parametrize("override, needle", [
    ("model.moe.top_k=9", "model.moe.top_k=9: must be between 1 and model.moe.num_experts=4"),
    ("model.moe.every=3", "model.moe.every=3 must be >= 1 and divide model.num_layers=2"),
    ("model.moe.balance_scope=batch", "model.moe.balance_scope='batch': choose one of"),
    ("mesh.expert=8", "model.moe.num_experts=4 does not split over mesh.expert=8"),
])
def test_config_errors_are_one_line_exit_2(override, needle, tmp_path, capsys):
  args = ["--config", os.path.join(ROOT, "configs", "moe_tiny.py"), "--workdir",
          str(tmp_path / "w"), "--config.model.moe.num_experts=4", f"--config.{override}"]
  assert train.main(args) == 2
  err = capsys.readouterr().err.strip().splitlines()
  assert len(err) == 1 and needle in err[0], err


E2E = {"steps": 4, "log_every": 1, "eval_every": 0, "checkpoint.every_steps": 2,
       "model.d_model": 32, "data.seq_len": 32, "model.moe.capacity_factor": 1.0,
       "model.moe.every": 2, "model.moe.shared_expert": 16}


@pytest.mark.slow  # the default run keeps MoE in pipeline stages and tests/test_train_e2e.py
def test_train_py_moe_tiny_and_resume(tmp_path):
  """train.py runs configs/moe_tiny.py and logs the router metrics; a run resumed from its
  step-2 checkpoint continues the uninterrupted one bit for bit."""
  workdir = tmp_path / "run"
  args = [sys.executable, "train.py", "--config", "configs/moe_tiny.py", "--workdir",
          str(workdir), *[f"--config.{k}={v}" for k, v in E2E.items()]]
  proc = subprocess.run(args, cwd=ROOT, capture_output=True, text=True, timeout=300)
  assert proc.returncode == 0, proc.stdout[-2000:] + proc.stderr[-2000:]
  rows = metric_rows(workdir)
  assert sorted(rows) == [1, 2, 3, 4]
  for key in ("moe/aux_loss", "moe/balance_loss", "moe/z_loss", "moe/dropped", "moe/entropy",
              "moe/load_max", "moe/L1/load_max", "moe/L1/load_min", "moe/L1/dropped",
              "moe/L1/entropy", "moe/L1/load/E7"):
    assert key in rows[4], key
  assert "moe/L0/load_max" not in rows[4]  # every=2: layer 1 is the MoE layer
  assert sum(rows[4][f"moe/L1/load/E{i}"] for i in range(8)) == pytest.approx(1.0)
  assert rows[4]["moe/balance_loss"] >= 1.0 - 1e-6  # N sum_i f_i P_i >= 1 only near balance
  assert 0 < rows[4]["moe/dropped"] < 0.5  # capacity 1.0 drops some assignments
  assert "moe/L1/" not in proc.stdout  # per-layer metrics stay off the console

  from configs.moe_tiny import get_config  # noqa: PLC0415
  cfg = lambda steps: override(get_config(), **{**E2E, "steps": steps})
  resumed = tmp_path / "resumed"
  Run(cfg(2), str(resumed)).train()
  Run(cfg(4), str(resumed)).train()
  assert [losses(resumed)[s] for s in range(1, 5)] == [losses(workdir)[s] for s in range(1, 5)]


@pytest.mark.slow
def test_resume_onto_an_expert_mesh(tmp_path):
  """A run checkpointed on data=8 continues on expert=4 x data=2 along the same curve."""
  from configs.moe_tiny import get_config  # noqa: PLC0415
  cfg = lambda steps, **kw: override(get_config(), **{**E2E, "steps": steps, **kw})
  straight, moved = tmp_path / "straight", tmp_path / "moved"
  Run(cfg(4), str(straight)).train()
  Run(cfg(2), str(moved)).train()
  Run(cfg(4, **{"mesh.data": 2, "mesh.expert": 4}), str(moved)).train()
  a, b = losses(straight), losses(moved)
  np.testing.assert_allclose([b[s] for s in (3, 4)], [a[s] for s in (3, 4)], rtol=1e-5)

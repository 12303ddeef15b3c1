"""The sharded train step equals the single-device step; accumulation equals one big batch and
sums in float32, sharded like the parameters."""
import functools

import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest

from conftest import assert_adam_params_close, tiny_config
from data import pipeline
from models.llama import ModelConfig
from optim import build_optimizer
from sharding import batch_sharding, make_mesh, replicated
from trainer.step.state import ModelSpec, init_state, state_shardings
from trainer.step.train_step import make_train_step

STEPS = 3


def _batches(data_dir, cfg, num_micro):
  rows = cfg.data.global_batch_size // num_micro
  it = iter(pipeline.dataset(pipeline.StreamSpec(data_dir, "train", cfg.data.seq_len, rows)))
  out = []
  for _ in range(STEPS):
    mbs = [next(it) for _ in range(num_micro)]
    out.append({k: np.stack([mb[k] for mb in mbs]) for k in pipeline.BATCH_KEYS})
  return out


def _run(cfg, mesh_cfg, batches, devices=None):
  mesh = make_mesh(mesh_cfg, devices)
  spec = ModelSpec(ModelConfig.from_config(cfg.model), mesh, cfg.seed)
  tx, schedule = build_optimizer(cfg.optim, spec.logical_names, cfg.steps)
  shardings = state_shardings(spec, tx)
  bsh = batch_sharding(mesh, microbatched=True)
  step = jax.jit(make_train_step(spec, tx, schedule), in_shardings=(shardings, bsh),
                 out_shardings=(shardings, replicated(mesh)))
  state = init_state(spec, tx)
  losses = []
  with jax.set_mesh(mesh):
    for b in batches:
      state, metrics = step(state, {k: jax.device_put(v, bsh) for k, v in b.items()})
      losses.append(float(metrics["loss"]))
  return np.array(losses), jax.device_get(state.params)


@pytest.fixture(scope="module")
def reference(data_dir):
  cfg = tiny_config()
  batches = _batches(data_dir, cfg, 1)
  losses, params = _run(cfg, {"data": 1}, batches, devices=jax.devices()[:1])
  return cfg, batches, losses, params


@pytest.mark.parametrize("mesh_cfg", [
    {"data": 8},
    {"data": 2, "fsdp": 2, "tensor": 2},
    {"fsdp": 4, "tensor": 2},
], ids=lambda m: ",".join(f"{k}={v}" for k, v in m.items()))
def test_sharded_step_equals_single_device(reference, mesh_cfg, devices):
  cfg, batches, ref_losses, ref_params = reference
  losses, params = _run(cfg, mesh_cfg, batches)
  # Measured: at most 3.8e-7 relative (jax 0.10.2, CPU); `pytest -s` prints it (docs/sharding.md).
  worst = np.max(np.abs(losses - ref_losses) / np.abs(ref_losses))
  print(f"\n{mesh_cfg}: worst relative loss difference to one device {worst:.2g}")
  np.testing.assert_allclose(losses, ref_losses, rtol=5e-7)
  worst_tensor = assert_adam_params_close(params, ref_params, lr=cfg.optim.learning_rate)
  print(f"{mesh_cfg}: worst relative parameter difference (per tensor) {worst_tensor:.2g}")
  assert ref_losses[-1] < ref_losses[0]  # it trains


def test_unrolled_layer_scan_equals_the_scan(reference):
  """model.scan_unroll (the layers unrolled in the compiled step) changes nothing but speed."""
  _, batches, ref_losses, ref_params = reference
  cfg = tiny_config(**{"model.scan_unroll": 2})
  losses, params = _run(cfg, {"data": 1}, batches, devices=jax.devices()[:1])
  np.testing.assert_allclose(losses, ref_losses, rtol=1e-6)
  jax.tree.map(lambda a, b: np.testing.assert_allclose(a, b, rtol=1e-5, atol=1e-7),
               params, ref_params)


def test_accumulation_equals_one_big_batch(reference, data_dir, devices):
  """4 micro-batches of 2 rows == 1 batch of 8 rows (same rows, token-weighted)."""
  cfg, _, _, _ = reference
  big = _batches(data_dir, cfg, 1)
  # Regroup the same 8 rows into 4 micro-batches of 2.
  split = [{k: v.reshape(4, 2, *v.shape[2:]) for k, v in b.items()} for b in big]
  ref_losses, ref_params = _run(cfg, {"data": 2}, big, devices=jax.devices()[:2])
  losses, params = _run(cfg, {"data": 2}, split, devices=jax.devices()[:2])
  np.testing.assert_allclose(losses, ref_losses, rtol=2e-6)
  jax.tree.map(lambda a, b: np.testing.assert_allclose(a, b, rtol=1e-4, atol=1e-6),
               params, ref_params)


# ------------------------------------------------------------------------------------------------
# Accumulation: float32 sum whatever the parameters' dtype, sharded like the parameters.


def test_accumulation_sums_bf16_gradients_in_float32(data_dir):
  """param_dtype=bfloat16, 4 micro-batches: the accumulated gradient is the float32 sum of the
  four micro-batch gradients (each bf16, as the model gives them). A bf16 running sum rounds
  after every addition, which puts it ~1e-3 (relative) away: the tolerance sits 30x below that."""
  from trainer.step.train_step import grad_sums, loss_sums  # noqa: PLC0415
  cfg = tiny_config(**{"model.param_dtype": "bfloat16"})
  mesh = make_mesh({"data": 1}, jax.devices()[:1])
  spec = ModelSpec(ModelConfig.from_config(cfg.model), mesh, cfg.seed)
  params = init_state(spec, optax.sgd(0.1)).params
  batch = {k: v.reshape(4, 2, *v.shape[2:]) for k, v in _batches(data_dir, cfg, 1)[0].items()}
  with jax.set_mesh(mesh):
    acc = jax.jit(lambda p, b: grad_sums(spec, p, b))(params, batch)[2]
    grad = jax.jit(jax.grad(lambda p, b: loss_sums(spec, p, b)[0]))
    micro = [grad(params, {k: v[i] for k, v in batch.items()}) for i in range(4)]
  assert all(g.dtype == jnp.float32 for g in jax.tree.leaves(acc))
  exact = jax.tree.map(lambda *g: sum(np.asarray(x, np.float64) for x in g), *micro)
  bf16_sum = jax.tree.map(lambda *g: np.asarray(functools.reduce(
      lambda a, b: (a + b).astype(jnp.bfloat16), g), np.float64), *micro)
  rel = lambda a: float(np.sqrt(sum(np.sum((np.asarray(x, np.float64) - e) ** 2) for x, e in zip(
      jax.tree.leaves(a), jax.tree.leaves(exact))) / sum(np.sum(e ** 2)
                                                         for e in jax.tree.leaves(exact))))
  assert rel(bf16_sum) > 3e-4, "the test must be able to tell a bf16 sum apart"
  assert rel(acc) < 1e-5


def test_accumulator_is_pinned_to_the_parameters_shardings(devices):
  """Under FSDP the running gradient sum of the scan is constrained to each parameter's
  sharding (lowered program), and the compiled loop carries per-device shards, not whole
  gradients (f32[2, 64/8, 256] for the [layers, embed, mlp] w_up, never f32[2, 64, 256])."""
  import re  # noqa: PLC0415
  from trainer.step.program import Program  # noqa: PLC0415
  cfg = tiny_config(**{"mesh.data": 1, "mesh.fsdp": 8, "model.d_model": 64, "model.mlp_dim": 256,
                       "data.global_batch_size": 32, "data.micro_batch_size": 8,
                       "model.param_dtype": "bfloat16"})
  program = Program(cfg, make_mesh(cfg.mesh))
  lowered = program.lower(4)
  pinned = [line for line in lowered.as_text().splitlines() if "sdy.sharding_constraint" in line
            and 'tensor<2x64x256xf32>' in line and '[{"stage"}, {"fsdp"}, {"tensor"}]' in line]
  assert len(pinned) >= 2, "zeros and each step's sum carry w_up's sharding"
  loops = [line for line in lowered.compile().as_text().splitlines()
           if re.search(r" while\(", line) and "(s32[], f32[], f32[]," in line]
  assert loops and all("f32[2,8,256]" in line and "f32[2,64,256]" not in line
                       for line in loops)


def test_cpu_step_updates_the_donated_state_in_place(devices):
  """The guard keeps a skipped step's old state (`jnp.where(bad, old, new)`); compiled with
  trainer.step.program's CPU options the step still writes the donated parameters and optimizer
  moments in place: no copy of any of them (without the options XLA copies them all)."""
  import re  # noqa: PLC0415

  from trainer.step.program import Program  # noqa: PLC0415
  cfg = tiny_config()
  text = Program(cfg, make_mesh({"data": 1}, jax.devices()[:1])).compile().as_text()
  state_params = re.findall(r"%(state_(?:params|opt_state)\S*) = \S+ parameter\(", text)
  assert len(state_params) > 10, "no state parameters found in the compiled step"
  copied = [name for name in state_params if re.search(rf"copy\(%{re.escape(name)}\)", text)]
  assert not copied, f"{len(copied)} of {len(state_params)} state buffers copied: {copied[:3]}"

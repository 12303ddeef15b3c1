"""Every optimizer the config offers trains at its own defaults, on one device and sharded.

An lm_tiny-sized model (d_model 128, so Adafactor really factors its second moments, whose
shardings are not the parameters') runs 40 steps of the compiled train step (`Program`, the
path train.py takes) with nothing but `optim.name` set: the loss must fall clearly and the
weight-decayed matrices' norm must not collapse (a weight decay applied without the learning
rate, as optax's adafactor does, shrinks every matrix by `weight_decay` per step). The default suite runs every
optimizer on one device and Adafactor on the 8-device mesh data=2, fsdp=2, tensor=2; the slow
suite every optimizer on both.
"""
import jax
import numpy as np
import pytest

from conftest import tiny_config
from data import pipeline
from optim import OPTIMIZERS, masks
from sharding import make_mesh
from trainer.step.program import Program
from trainer.step.state import init_state

STEPS = 40
MESHES = {"1dev": ({"data": 1}, 1), "dp2-fsdp2-tp2": ({"data": 2, "fsdp": 2, "tensor": 2}, 8)}


def _config(name, mesh_cfg):
  cfg = tiny_config(**{
      "steps": STEPS, "optim.name": name, "optim.warmup_steps": 20, "optim.decay_steps": 300,
      "model.d_model": 128, "model.mlp_dim": 128, "data.global_batch_size": 8,
      "data.seq_len": 32})
  cfg.optim.learning_rate = 0.0  # the optimizer's own default (tiny_config states one)
  cfg.mesh.update(mesh_cfg)
  return cfg


@pytest.fixture(scope="module")
def batches(data_dir):
  cfg = _config("adamw", {})
  it = iter(pipeline.dataset(pipeline.StreamSpec(data_dir, "train", cfg.data.seq_len,
                                                 cfg.data.global_batch_size)))
  return [{k: v[None] for k, v in next(it).items()} for _ in range(STEPS)]


def _train(name, mesh_key, batches):
  mesh_cfg, n = MESHES[mesh_key]
  cfg = _config(name, mesh_cfg)
  program = Program(cfg, make_mesh(cfg.mesh, jax.devices()[:n]))
  step = program.compile()
  state = init_state(program.spec, program.tx)
  decayed = masks(program.spec.logical_names)["decay"]
  matrix_norm = lambda params: float(np.sqrt(sum(
      np.sum(np.square(np.asarray(p, np.float64))) for p, d in zip(
          jax.tree.leaves(jax.device_get(params)), jax.tree.leaves(decayed)) if d)))
  losses, norms = [], [matrix_norm(state.params)]
  with jax.set_mesh(program.mesh):
    for b in batches:
      state, metrics = step(state, {k: jax.device_put(v, program.batch_sharding)
                                    for k, v in b.items()})
      m = jax.device_get(metrics)
      losses.append(float(m["loss"]))
  return np.array(losses), np.array(norms + [matrix_norm(state.params)])


def _check(name, losses, norms):
  summary = f"{name}: loss {losses[0]:.3f} -> {losses[-5:].mean():.3f}, " \
            f"norm of the decayed matrices {norms[0]:.2f} -> {norms[-1]:.2f}"
  assert np.all(np.isfinite(losses)), summary
  assert losses[-5:].mean() < losses[0] - 1.0, summary  # ln(512) = 6.24 at the start
  assert norms[-1] > 0.9 * norms[0], summary
  print(summary)


# Default suite: every optimizer on one device but Adafactor, which runs sharded instead (its
# state is not parameter-shaped); the slow suite runs the rest of the grid (~20 s each on 2
# cores).
GRID = [pytest.param(name, "1dev", id=f"{name}-1dev",
                     marks=pytest.mark.slow if name == "adafactor" else ())
        for name in OPTIMIZERS] + [
    pytest.param(name, "dp2-fsdp2-tp2", id=f"{name}-dp2-fsdp2-tp2",
                 marks=() if name == "adafactor" else pytest.mark.slow) for name in OPTIMIZERS]


@pytest.mark.parametrize("name,mesh_key", GRID)
def test_optimizer_trains_at_its_defaults(name, mesh_key, batches, devices):
  _check(f"{name} on {mesh_key}", *_train(name, mesh_key, batches))

"""Checkpoints: save/restore is exact, restores onto other meshes, resumed runs match."""
import json
import logging
import sys

import jax
import numpy as np
import pytest

from conftest import losses, tiny_config
from data import pipeline
from models.llama import ModelConfig
from optim import build_optimizer
from sharding import make_mesh
from trainer.checkpoint import persistent as checkpoint
from trainer.checkpoint.persistent import Checkpointer
from trainer.run.loop import Run
from trainer.step.state import ModelSpec, abstract_state, init_state


def _spec_tx(cfg, mesh_cfg, devices=None):
  spec = ModelSpec(ModelConfig.from_config(cfg.model), make_mesh(mesh_cfg, devices), cfg.seed)
  tx, _ = build_optimizer(cfg.optim, spec.logical_names, cfg.steps)
  return spec, tx


@pytest.fixture(scope="module")
def saved(tmp_path_factory, data_dir):
  """A checkpoint of a freshly initialised state on data=8, with an advanced data iterator."""
  cfg = tiny_config()
  spec, tx = _spec_tx(cfg, {"data": 8})
  state = init_state(spec, tx)
  data_spec = pipeline.StreamSpec(data_dir, "train", 32, 8)
  it = iter(pipeline.dataset(data_spec))
  for _ in range(5):
    next(it)
  directory = tmp_path_factory.mktemp("ckpt")
  ckpt = Checkpointer(str(directory), keep=2)
  ckpt.save(5, state, it, data_spec, cfg.to_dict())
  ckpt.wait()
  next_batch = next(it)
  return cfg, directory, jax.device_get(state), next_batch


@pytest.mark.parametrize("mesh_cfg,ndev", [
    ({"data": 8}, 8), ({"fsdp": 4, "tensor": 2}, 8), ({"data": 2, "tensor": 2}, 4),
    ({"data": 1}, 1)], ids=["same-mesh", "fsdp4-tensor2", "4-devices", "1-device"])
def test_restore_is_exact_on_any_mesh(saved, data_dir, mesh_cfg, ndev):
  cfg, directory, want, next_batch = saved
  spec, tx = _spec_tx(cfg, mesh_cfg, jax.devices()[:ndev])
  abstract = abstract_state(spec, tx)
  ckpt = Checkpointer(str(directory), keep=2)
  assert ckpt.latest_step() == 5
  restored = ckpt.restore_latest(
      abstract, pipeline.StreamSpec(data_dir, "train", 32, 8), cfg.to_dict())
  state, it, step = restored.state, restored.iterator, restored.step
  assert step == 5 and restored.tier == "persistent"
  jax.tree.map(np.testing.assert_array_equal, jax.device_get(state), want)
  w = state.params["blocks"]["attn"]["wq_EHD"]
  assert w.sharding == abstract.params["blocks"]["attn"]["wq_EHD"].sharding
  assert len(w.sharding.device_set) == ndev
  got = next(it)  # the data iterator resumes at exactly the next batch
  for key in pipeline.BATCH_KEYS:
    np.testing.assert_array_equal(got[key], next_batch[key])


@pytest.mark.parametrize("async_save", [True, False], ids=["async", "sync"])
def test_data_state_is_the_one_at_the_save_call(tmp_path, data_dir, async_save):
  """The data state is taken when `save` is called: an iterator that moves on while an async
  save is still being written does not change what the checkpoint holds (both save modes)."""
  cfg = tiny_config()
  spec, tx = _spec_tx(cfg, {"data": 1}, jax.devices()[:1])
  state = init_state(spec, tx)
  data_spec = pipeline.StreamSpec(data_dir, "train", 32, 2)
  it = iter(pipeline.dataset(data_spec))
  next(it)
  ckpt = Checkpointer(str(tmp_path), keep=1, async_save=async_save)
  ckpt.save(1, state, it, data_spec, cfg.to_dict())
  want = next(it)  # the loop goes on before the background write is done
  for _ in range(3):
    next(it)
  ckpt.wait()
  restored = Checkpointer(str(tmp_path), keep=1).restore_latest(
      abstract_state(spec, tx), data_spec, cfg.to_dict())
  got = next(restored.iterator)
  assert restored.step == 1
  for key in pipeline.BATCH_KEYS:
    np.testing.assert_array_equal(got[key], want[key])


def test_a_save_shortens_the_gil_switch_interval_only_while_it_blocks(tmp_path, monkeypatch):
  ckpt = Checkpointer(str(tmp_path), keep=1)
  seen = []
  monkeypatch.setattr(ckpt.manager, "save", lambda *a, **k: seen.append(sys.getswitchinterval()))
  before = sys.getswitchinterval()
  ckpt.save(1, {}, None, None, {})
  assert seen == [pytest.approx(checkpoint.SAVE_SWITCH_INTERVAL)]
  assert sys.getswitchinterval() == before


def test_checkpoint_files_need_no_pickle(saved):
  """Iterator state and config are plain JSON; no file carries a pickle stream."""
  _, directory, _, _ = saved
  step_dir = directory / "5"
  json.load(open(step_dir / "data" / "process_0-of-1.json"))
  assert json.load(open(step_dir / "config" / "metadata"))["steps"] == 6
  for path in step_dir.rglob("*"):
    if path.is_file():
      head = path.read_bytes()[:2]
      assert not (len(head) == 2 and head[0] == 0x80 and 2 <= head[1] <= 5), path


def test_resumed_run_equals_uninterrupted_run(tmp_path):
  straight = tmp_path / "straight"
  Run(tiny_config(**{"steps": 6, "checkpoint.every_steps": 3}), str(straight)).train()
  resumed = tmp_path / "resumed"
  Run(tiny_config(**{"steps": 3, "checkpoint.every_steps": 3}), str(resumed)).train()
  Run(tiny_config(**{"steps": 6, "checkpoint.every_steps": 3}), str(resumed)).train()
  a, b = losses(straight), losses(resumed)
  assert sorted(b) == list(range(1, 7))
  assert [a[s] for s in range(1, 7)] == [b[s] for s in range(1, 7)]  # bit for bit
  # A different mesh after the restart continues the same curve (up to fp32 reduction order).
  moved = tmp_path / "moved"
  Run(tiny_config(**{"steps": 3, "checkpoint.every_steps": 3}), str(moved)).train()
  Run(tiny_config(**{"steps": 6, "checkpoint.every_steps": 3, "mesh.data": 2,
                     "mesh.fsdp": 2, "mesh.tensor": 2}), str(moved)).train()
  c = losses(moved)
  np.testing.assert_allclose([c[s] for s in range(4, 7)], [a[s] for s in range(4, 7)],
                             rtol=1e-5)


def test_every_model_field_is_classified_functional_or_not():
  """Each key of the run config's `model` block (and each ModelConfig field) is in exactly one
  of models/config.py's FUNCTIONAL / NOT_FUNCTIONAL: a new model key cannot escape the resume
  and warm-start checks by being forgotten."""
  from models.config import FUNCTIONAL, NOT_FUNCTIONAL, field_names
  from trainer.config import default_config

  def leaves(node, prefix=""):
    return [k for key, v in node.items()
            for k in (leaves(v, f"{prefix}{key}.") if hasattr(v, "items") else
                      [prefix + key])]

  fields = field_names()
  assert sorted(leaves(default_config().model)) == sorted(fields)
  unclassified = set(fields) - set(FUNCTIONAL) - set(NOT_FUNCTIONAL)
  assert not unclassified, f"classify in models/config.py: {sorted(unclassified)}"
  assert not set(FUNCTIONAL) & set(NOT_FUNCTIONAL)
  assert sorted([*FUNCTIONAL, *NOT_FUNCTIONAL]) == sorted(fields)  # and no stale names


def test_functional_differences_compare_what_the_weights_compute():
  """Equal functions compare equal (defaults resolved, switched-off fields ignored); each
  functional change is named; implementation choices are free."""
  import dataclasses
  from models.config import functional_differences, overrides_to_match
  from models.moe import MoEConfig
  from models.rope import RopeScaling
  sp = ModelConfig(d_model=64, num_heads=4)
  same = [dataclasses.replace(sp, head_dim=16),  # = d_model / num_heads
          dataclasses.replace(sp, parametrization="mup"),  # base_width 0: m = 1, SP exactly
          dataclasses.replace(sp, parametrization="mup", base_width=64),
          dataclasses.replace(sp, rope_scaling=RopeScaling(factor=4.0)),  # type none
          dataclasses.replace(sp, moe=MoEConfig(top_k=1)),  # dense: no router
          dataclasses.replace(sp, dtype="bfloat16", remat="full", scan_unroll=2,
                              attention="flash", logits_chunk=8, init_std=0.1)]
  for other in same:
    assert functional_differences(sp, other) == [], other
  mup = dataclasses.replace(sp, parametrization="mup", base_width=32)
  diff = functional_differences(mup, sp)
  assert diff == [("parametrization", "mup", "sp"), ("base_width", 32, None)]
  assert overrides_to_match(diff) == ("--config.model.parametrization=mup "
                                      "--config.model.base_width=32")
  assert overrides_to_match(functional_differences(sp, mup)) == \
      "--config.model.parametrization=sp"
  moe = dataclasses.replace(sp, moe=MoEConfig(num_experts=4, top_k=2))
  assert functional_differences(moe, dataclasses.replace(moe, moe=MoEConfig(
      num_experts=4, top_k=2, mlp_dim=sp.mlp_dim, capacity_factor=1.25, impl="megablox",
      router_z_loss=0.0))) == []
  assert functional_differences(moe, dataclasses.replace(moe, moe=MoEConfig(
      num_experts=4, top_k=1))) == [("moe.top_k", 2, 1)]
  # muP off its base width: head_dim 0 scales the queries, the same head_dim stated does not
  assert mup.query_multiplier != dataclasses.replace(mup, head_dim=16).query_multiplier
  assert functional_differences(mup, dataclasses.replace(mup, head_dim=16)) == [
      ("head_dim", 0, 16)]


def test_asyncio_errors_of_orbax_tasks_are_silenced_and_others_pass(caplog):
  """A full disk at a save: Orbax's write tasks hold the error it raised once, and asyncio
  logs each with its traceback when collected ("Task exception was never retrieved", 34 lines
  on stderr after the one line). Those are dropped; asyncio's errors of other tasks pass."""
  import asyncio  # noqa: PLC0415
  import gc  # noqa: PLC0415
  from trainer.checkpoint.saver import silence_orbax_failures  # noqa: PLC0415
  silence_orbax_failures()
  code = "async def write():\n  raise ValueError('RESOURCE_EXHAUSTED: Error writing')\n"

  def never_retrieved(filename):
    scope = {}
    exec(compile(code, filename, "exec"), scope)
    loop = asyncio.new_event_loop()
    task = loop.create_task(scope["write"]())
    loop.run_until_complete(asyncio.sleep(0))
    loop.close()
    del task
    gc.collect()

  with caplog.at_level(logging.ERROR, logger="asyncio"):
    never_retrieved("/site-packages/orbax/checkpoint/_src/serialization/serialization.py")
    assert not [r for r in caplog.records if r.name == "asyncio"], caplog.text
    never_retrieved("/elsewhere/mine.py")
    passed = [r.getMessage() for r in caplog.records if r.name == "asyncio"]
    assert len(passed) == 1 and passed[0].startswith("Task exception was never retrieved\n"
                                                     "future: <Task finished") and \
        "/elsewhere/mine.py" in passed[0], caplog.text

"""Logical->mesh rules: a golden PartitionSpec table, FSDP memory, mesh errors."""
import jax
import numpy as np
import pytest
from jax.sharding import PartitionSpec as P

from models.llama import ModelConfig
from sharding import MeshError, make_mesh, resolve_mesh, resolve_mesh_shape
from trainer.step.state import ModelSpec

CFG = ModelConfig(vocab_size=512, d_model=32, num_layers=2, num_heads=4, num_kv_heads=2,
                  mlp_dim=64)

# Every parameter of the model, its logical names, and its spec on a data x fsdp x tensor mesh
# (the layer stack's `layers` on `stage`, of size 1 here: pipeline stages split it).
GOLDEN = {
    "embed_VE": (("vocab", "embed"), P("tensor", "fsdp")),
    "lm_head_EV": (("embed", "vocab"), P("fsdp", "tensor")),
    "final_norm/scale": (("norm",), P(None)),
    "blocks/attn_norm/scale": (("layers", "norm"), P("stage", None)),
    "blocks/mlp_norm/scale": (("layers", "norm"), P("stage", None)),
    "blocks/attn/wq_EHD": (("layers", "embed", "heads", "head_dim"),
                           P("stage", "fsdp", "tensor", None)),
    "blocks/attn/wk_EKD": (("layers", "embed", "kv_heads", "head_dim"),
                           P("stage", "fsdp", "tensor", None)),
    "blocks/attn/wv_EKD": (("layers", "embed", "kv_heads", "head_dim"),
                           P("stage", "fsdp", "tensor", None)),
    "blocks/attn/wo_HDE": (("layers", "heads", "head_dim", "embed"),
                           P("stage", "tensor", None, "fsdp")),
    "blocks/mlp/w_gate_EF": (("layers", "embed", "mlp"), P("stage", "fsdp", "tensor")),
    "blocks/mlp/w_up_EF": (("layers", "embed", "mlp"), P("stage", "fsdp", "tensor")),
    "blocks/mlp/w_down_FE": (("layers", "mlp", "embed"), P("stage", "tensor", "fsdp")),
}


def _flat(tree):
  return {"/".join(str(k.key) for k in path): leaf
          for path, leaf in jax.tree_util.tree_flatten_with_path(
              tree, is_leaf=lambda x: isinstance(x, tuple))[0]}


def test_golden_partition_specs(devices):
  spec = ModelSpec(CFG, make_mesh({"data": 2, "fsdp": 2, "tensor": 2}), seed=0)
  names = _flat(spec.logical_names)
  shardings = _flat(spec.param_shardings)
  assert set(names) == set(GOLDEN), "model parameters changed: update the golden table"
  for path, (want_names, want_spec) in GOLDEN.items():
    assert names[path] == want_names, path
    assert shardings[path].spec == want_spec, path


def test_fsdp_divides_parameter_bytes(devices):
  """Per-device parameter bytes shrink ~N-fold with fsdp=N (norm scales stay replicated)."""
  from trainer.step.state import init_state  # noqa: PLC0415
  from optim import build_optimizer  # noqa: PLC0415
  from trainer.config import default_config  # noqa: PLC0415

  def per_device_bytes(mesh_cfg):
    spec = ModelSpec(CFG, make_mesh(mesh_cfg), seed=0)
    tx, _ = build_optimizer(default_config().optim, spec.logical_names, 10)
    state = init_state(spec, tx)
    dev0 = jax.devices()[0]
    total = 0
    for leaf in jax.tree.leaves(state):
      for shard in leaf.addressable_shards:
        if shard.device == dev0:
          total += shard.data.nbytes
    return total

  full = per_device_bytes({"data": 8})
  fsdp8 = per_device_bytes({"fsdp": 8})
  assert full / fsdp8 > 7.0, (full, fsdp8)  # params + Adam moments, sharded 8 ways


def test_init_is_sharded_not_replicated(devices):
  from trainer.step.state import init_state  # noqa: PLC0415
  from optim import build_optimizer  # noqa: PLC0415
  from trainer.config import default_config  # noqa: PLC0415
  spec = ModelSpec(CFG, make_mesh({"fsdp": 4, "tensor": 2}), seed=0)
  tx, _ = build_optimizer(default_config().optim, spec.logical_names, 10)
  state = init_state(spec, tx)
  w = state.params["blocks"]["mlp"]["w_gate_EF"]
  assert w.sharding.spec == P("stage", "fsdp", "tensor")  # stage: of size 1
  assert w.addressable_shards[0].data.shape == (2, 32 // 4, 64 // 2)
  mu = state.opt_state[1][0].mu["blocks"]["mlp"]["w_gate_EF"]  # clip, (adam, ...)
  assert mu.sharding.spec == P("stage", "fsdp", "tensor")


@pytest.mark.parametrize("mesh_cfg,n,want", [
    ({"data": -1}, 8, {"data": 8}),
    ({"data": 2, "fsdp": -1, "tensor": 2}, 8, {"data": 2, "fsdp": 2, "tensor": 2}),
    ({"data": 1, "fsdp": 1}, 1, {"data": 1}),
])
def test_resolve_mesh_shape(mesh_cfg, n, want):
  sizes = resolve_mesh_shape(mesh_cfg, n)
  for k, v in want.items():
    assert sizes[k] == v
  assert np.prod(list(sizes.values())) == n


@pytest.mark.parametrize("mesh_cfg,n,needle", [
    ({"data": 3}, 8, "has 3 devices but 8 are available"),
    ({"data": -1, "fsdp": -1}, 8, "only one axis may be -1"),
    ({"data": -1, "tensor": 3}, 8, "cannot fill 8 devices"),
    ({"data": 0}, 8, "must be positive"),
])
def test_mesh_errors(mesh_cfg, n, needle):
  with pytest.raises(MeshError, match=needle):
    resolve_mesh_shape(mesh_cfg, n)


@pytest.mark.parametrize("mesh_cfg,n,slices,ici,dcn", [
    ({"data": -1, "dcn_data": 2}, 8, 2, {"data": 4}, {"data": 2}),
    ({"data": 2, "fsdp": -1, "dcn_data": -1}, 16, 4, {"data": 2, "fsdp": 2}, {"data": 4}),
    ({"fsdp": -1, "dcn_data": 2, "dcn_fsdp": 2}, 16, 4, {"fsdp": 4}, {"data": 2, "fsdp": 2}),
])
def test_resolve_multi_slice(mesh_cfg, n, slices, ici, dcn):
  """mesh.<axis> multiply to one slice's devices, mesh.dcn_<axis> to the slices; the axis sizes
  over all devices are their products."""
  got_ici, got_dcn = resolve_mesh(mesh_cfg, n, slices)
  assert {k: v for k, v in got_ici.items() if v > 1} == ici
  assert {k: v for k, v in got_dcn.items() if v > 1} == dcn
  total = resolve_mesh_shape(mesh_cfg, n, slices)
  assert total == {k: got_ici[k] * got_dcn[k] for k in total}


@pytest.mark.parametrize("mesh_cfg,n,slices,needle", [
    ({"data": -1}, 8, 2, r"mesh \(all 1\) has 1 slice\(s\) but the devices form 2"),
    ({"data": -1, "dcn_data": 2}, 8, 1, r"mesh \(dcn_data=2\) has 2 slice\(s\) but the devices "
     "form 1"),
    ({"data": 8, "dcn_data": 2}, 8, 2, "has 8 devices but each of the 2 slices has 4"),
    ({"dcn_data": -1, "dcn_fsdp": -1}, 8, 2, "only one axis may be -1"),
    ({"dcn_data": 0}, 8, 2, "mesh.dcn_data=0: axis sizes must be positive"),
])
def test_multi_slice_mesh_errors(mesh_cfg, n, slices, needle):
  with pytest.raises(MeshError, match=needle):
    resolve_mesh_shape(mesh_cfg, n, slices)


def test_dcn_sizes_must_match_the_slices_on_one_slice(devices):
  """CPU devices are one slice: a DCN size above 1 is an error, not a silently ignored key."""
  with pytest.raises(MeshError, match="dcn_data=2"):
    make_mesh({"data": -1, "dcn_data": 2})

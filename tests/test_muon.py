"""Muon (optim/muon.py): Newton-Schulz orthogonalises, the logical names say which matrix each
weight is, a scanned stack is updated layer by layer, sharded = one device, every optim.muon key
reaches the update, it trains and resumes exactly."""
import functools
import re

import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest

from conftest import losses, tiny_config
from models.llama import ModelConfig
from optim import build_optimizer
from optim.muon import (dimension_numbers, fan_in_out, labels, ns_path, ns_spec,
                        scale_by_muon)
from sharding import make_mesh
from trainer.config import ConfigError
from trainer.config.checks import validate
from trainer.run.loop import Run
from trainer.step.state import ModelSpec, init_state, state_shardings

IS_NAMES = lambda x: isinstance(x, tuple) and all(isinstance(n, (str, type(None))) for n in x)


def test_same_as_optax_scale_by_muon_on_one_device():
  """Our transformation is optax's `scale_by_muon` + `scale_by_shape` with a layout added."""
  from optax.contrib import scale_by_muon as optax_muon  # noqa: PLC0415
  from optax.contrib._muon import scale_by_shape  # noqa: PLC0415
  names = {"w": ("layers", "embed", "heads", "head_dim")}
  dims = {"w": dimension_numbers(names["w"])}
  ref = optax.chain(optax_muon(beta=0.9, weight_dimension_numbers=dims),
                    scale_by_shape(dims, consistent_rms=0.2))
  ours = scale_by_muon(names, beta=0.9, rms=0.2)
  zeros = {"w": jnp.zeros((2, 16, 4, 8))}
  s_ref, s_ours = ref.init(zeros), ours.init(zeros)
  for seed in range(3):
    g = {"w": jax.random.normal(jax.random.key(seed), (2, 16, 4, 8))}
    (u_ref, s_ref), (u_ours, s_ours) = ref.update(g, s_ref), ours.update(g, s_ours)
    np.testing.assert_array_equal(u_ours["w"], u_ref["w"])
  jax.tree.map(np.testing.assert_array_equal, s_ours, s_ref)


def test_the_states_newton_schulz_coefficients_are_the_ones_used():
  """The coefficients live in the state (optax's MuonState.ns_coeffs) and are read from it: a
  state carrying a cubic's orthogonalises as optax's transformation built with the cubic does."""
  from optax.contrib import scale_by_muon as optax_muon  # noqa: PLC0415
  names = {"w": ("embed", "mlp")}  # 32 x 16: Jordan's scaling (rms 0) is 1
  cubic = (1.5, -0.5, 0.0)
  ref = optax_muon(ns_coeffs=cubic, weight_dimension_numbers={"w": dimension_numbers(names["w"])})
  ours = scale_by_muon(names, rms=0.0)
  g = {"w": jax.random.normal(jax.random.key(0), (32, 16))}
  state = ours.init(g)
  default = ours.update(g, state)[0]["w"]
  state = (state[0]._replace(ns_coeffs=jnp.asarray(cubic)), *state[1:])
  (u, state), (u_ref, _) = ours.update(g, state), ref.update(g, ref.init(g))
  np.testing.assert_array_equal(u["w"], u_ref["w"])
  assert not np.allclose(u["w"], default, rtol=1e-2)
  np.testing.assert_array_equal(state[0].ns_coeffs, cubic)  # carried on


def test_newton_schulz_layout():
  """Whole matrices per device, the stack over the parameter's largest mesh axes that divide it."""
  mesh = jax.sharding.AbstractMesh((2, 4, 2), ("data", "fsdp", "tensor"))
  spec = lambda names, shape: tuple(ns_spec(names, dimension_numbers(names), shape, mesh))
  wq = ("layers", "embed", "heads", "head_dim")
  assert spec(wq, (8, 64, 4, 16)) == (("fsdp", "tensor"), None, None, None)
  assert spec(wq, (4, 64, 4, 16)) == ("fsdp", None, None, None)  # replicated over tensor
  assert spec(wq, (2, 64, 4, 16)) == ("tensor", None, None, None)
  assert spec(("layers", "mlp", "embed"), (3, 64, 32)) == (None, None, None)
  moe = ("layers", "experts", "embed", "expert_mlp")  # experts (expert axis absent: size 1)
  assert spec(moe, (2, 4, 64, 32)) == ("tensor", "fsdp", None, None)
  # one mesh axis moved per step (two at once the partitioner gathers whole), gathers last
  path = lambda names, shape: [tuple(p) for p in ns_path(names, dimension_numbers(names), shape,
                                                          mesh)]
  assert path(wq, (8, 64, 4, 16)) == [("fsdp", None, "tensor", None),
                                      (("fsdp", "tensor"), None, None, None)]
  assert path(wq, (4, 64, 4, 16)) == [("fsdp", None, "tensor", None), ("fsdp", None, None, None)]


def test_newton_schulz_layout_keeps_a_stack_dimensions_own_axes():
  """Expert parallelism: `experts` is already sharded over `expert`; only the matrix
  dimensions' axes (fsdp on embed, tensor on expert_mlp) move, and a stack dimension counts the
  axes it has when they are checked for dividing it."""
  moe = ("layers", "experts", "embed", "expert_mlp")
  dims = dimension_numbers(moe)
  path = lambda shape, mesh: [tuple(p) for p in ns_path(moe, dims, shape, mesh)]
  mesh = jax.sharding.AbstractMesh((4, 2), ("fsdp", "expert"))
  # 4 experts on expert=2: fsdp (4) does not divide the 2 per device left, so it is gathered
  # (not 8-way on 4 experts), and expert stays on the experts (not moved to the layers)
  assert path((1, 4, 64, 32), mesh) == [(None, "expert", None, None)]
  assert path((2, 4, 64, 32), mesh) == [(None, "expert", None, None)]
  assert path((1, 8, 64, 32), mesh) == [(None, ("expert", "fsdp"), None, None)]  # 2 x 4 = 8
  assert path((8, 4, 64, 32), mesh) == [("fsdp", "expert", None, None)]
  mesh = jax.sharding.AbstractMesh((4, 2, 2), ("fsdp", "tensor", "expert"))
  assert path((2, 4, 64, 32), mesh) == [("tensor", "expert", "fsdp", None),
                                        ("tensor", "expert", None, None)]
  # nothing on the matrix dimensions: nothing moves
  assert path((2, 4, 64, 32), jax.sharding.AbstractMesh((2,), ("expert",))) == []


def _muon_config(**overrides):
  return tiny_config(**{"optim.name": "muon", "optim.learning_rate": 0.0, **overrides})


def _direction(names, grads, steps=1, **args):
  """Muon's direction (no learning rate) after `steps` updates with these gradients."""
  tx = scale_by_muon(names, **args)
  state = tx.init(grads)
  for _ in range(steps):
    u, state = tx.update(grads, state)
  return u


def test_newton_schulz_output_is_nearly_orthogonal():
  g = jax.random.normal(jax.random.key(0), (96, 48))
  u = _direction({"w": ("mlp", "embed")}, {"w": g}, rms=0.0)["w"]  # fan_in 96 >= fan_out: x1
  s = np.linalg.svd(np.asarray(u), compute_uv=False)
  assert s.min() > 0.6 and s.max() < 1.25, s  # Jordan's quintic: singular values ~[0.7, 1.2]
  uu, _, vt = np.linalg.svd(np.asarray(g), full_matrices=False)
  polar = uu @ vt  # the exact orthogonalisation U V^T
  assert np.linalg.norm(u - polar) / np.linalg.norm(polar) < 0.25
  inner = uu.T @ np.asarray(u) @ vt.T  # G's singular vectors kept: U^T O V is diagonal
  off = inner - np.diag(np.diag(inner))
  assert np.linalg.norm(off) < 1e-3 * np.linalg.norm(inner)


def test_update_rms_matches_the_configured_value():
  g = jax.random.normal(jax.random.key(1), (3, 64, 32))  # [layers, embed, mlp]
  names = {"w": ("layers", "embed", "mlp")}
  u = _direction(names, {"w": g}, rms=0.2)["w"]
  rms = np.sqrt(np.mean(np.square(np.asarray(u)), axis=(1, 2)))
  # per layer ~0.2, AdamW's typical update RMS (0.17 here: the quintic's singular values are
  # ~0.85 in RMS, not 1, for a Gaussian gradient)
  np.testing.assert_allclose(rms, 0.2, rtol=0.2)
  jordan = _direction(names, {"w": g}, rms=0.0)["w"]  # sqrt(max(1, fan_out/fan_in)) = 1 here
  np.testing.assert_allclose(np.asarray(u), np.asarray(jordan) * 0.2 * np.sqrt(64), rtol=1e-5)


def test_dimension_numbers_from_logical_names():
  d = lambda *names: dimension_numbers(names)
  assert d("layers", "embed", "heads", "head_dim") == ((1,), (2, 3))  # wq: heads into the output
  assert d("layers", "heads", "head_dim", "embed") == ((1, 2), (3,))  # wo
  assert d("layers", "mlp", "embed") == ((1,), (2,))  # w_down reads mlp, writes embed
  assert d("layers", "experts", "embed", "expert_mlp") == ((2,), (3,))  # one matrix per expert
  assert d("embed", None) == ((0,), (1,))  # the MoE router
  for fallback in [("vocab", "embed"), ("embed", "vocab"), ("layers", "norm"), ("norm",)]:
    assert d(*fallback) is None, fallback
  with pytest.raises(ValueError, match="input from the output"):
    d("mlp", "heads", "head_dim")
  assert fan_in_out((2, 4, 8, 32), d("layers", "heads", "head_dim", "embed")) == (32, 32)


def test_each_projection_is_its_own_matrix_with_heads_in_the_output():
  """wq [L, E, H, D]: layer l's update is the orthogonalisation of the E x (H*D) matrix, not of
  each head, times Jordan's sqrt(max(1, fan_out/fan_in)) = sqrt(2); w_down [L, F, E] with
  F = 2E: the scaling is 1 (swapped input and output would give sqrt(2) for both)."""
  from optax.contrib._muon import orthogonalize_via_newton_schulz  # noqa: PLC0415
  L, E, H, D = 2, 16, 4, 8
  k1, k2 = jax.random.split(jax.random.key(2))
  grads = {"wq": jax.random.normal(k1, (L, E, H, D)), "down": jax.random.normal(k2, (L, 2 * E, E))}
  names = {"wq": ("layers", "embed", "heads", "head_dim"), "down": ("layers", "mlp", "embed")}
  u = _direction(names, grads, rms=0.0)
  coeffs = jnp.asarray((3.4445, -4.7750, 2.0315))
  for name, shape, scale in (("wq", (E, H * D), np.sqrt(2)), ("down", (2 * E, E), 1.0)):
    for layer in range(L):
      want = scale * orthogonalize_via_newton_schulz(grads[name][layer].reshape(shape), coeffs)
      np.testing.assert_allclose(np.asarray(u[name][layer]).reshape(shape), np.asarray(want),
                                 rtol=1e-4, atol=1e-6)


def _tiny_params(cfg, mesh):
  spec = ModelSpec(ModelConfig.from_config(cfg.model), mesh, cfg.seed)
  tx, _ = build_optimizer(cfg.optim, spec.logical_names, cfg.steps, cfg.data)
  return spec, tx, init_state(spec, tx)


def _grads(params, seed=0):
  leaves, tree = jax.tree.flatten(params)
  keys = jax.random.split(jax.random.key(seed), len(leaves))
  return tree.unflatten([jax.random.normal(k, p.shape, p.dtype) * 0.01
                         for k, p in zip(keys, leaves)])


def _unstack(tree, num_layers):
  """The tiny model's tree with its [layers, ...] stack split into one subtree per layer."""
  out = {k: v for k, v in tree.items() if k != "blocks"}
  for layer in range(num_layers):
    out[f"layer{layer}"] = jax.tree.map(
        lambda x: tuple(n for n in x if n != "layers") if IS_NAMES(x) else x[layer],
        tree["blocks"], is_leaf=IS_NAMES)
  return out


def test_a_scanned_stack_is_updated_as_its_layers_would_be_unrolled():
  cfg = _muon_config(**{"model.num_layers": 3})
  spec, tx, state = _tiny_params(cfg, make_mesh({"data": 1}, jax.devices()[:1]))
  n = cfg.model.num_layers
  names_u = _unstack(spec.logical_names, n)
  tx_u, _ = build_optimizer(cfg.optim, names_u, cfg.steps, cfg.data)
  params_u = _unstack(state.params, n)
  opt, opt_u = state.opt_state, tx_u.init(params_u)
  update = jax.jit(lambda g, o, p, s: tx.update(g, o, p, step=s))
  update_u = jax.jit(lambda g, o, p, s: tx_u.update(g, o, p, step=s))
  for step in range(2):
    g = _grads(state.params, step)
    u, opt = update(g, opt, state.params, jnp.int32(step))
    u_u, opt_u = update_u(_unstack(g, n), opt_u, params_u, jnp.int32(step))
    # equal up to fp32 rounding (a batched matmul against one per layer); updates are ~1e-4
    jax.tree.map(lambda a, b: np.testing.assert_allclose(a, b, rtol=1e-4, atol=1e-8),
                 _unstack(u, n), u_u)
  assert labels(names_u)["layer0"]["attn"]["wq_EHD"] == "muon"


MOE = {"model.moe.num_experts": 8, "model.moe.top_k": 2, "model.moe.mlp_dim": 32,
       "model.moe.every": 1}


@pytest.mark.parametrize("mesh_cfg,model", [
    ({"fsdp": 4, "tensor": 2}, {}), ({"data": 2, "fsdp": 2, "tensor": 2}, {}),
    pytest.param({"fsdp": 4, "expert": 2}, MOE, marks=pytest.mark.slow)])  # 8 experts on expert x fsdp
def test_sharded_update_equals_one_device(mesh_cfg, model):
  cfg = _muon_config(**{"model.d_model": 64, "model.mlp_dim": 128, **model})
  spec1, tx1, state1 = _tiny_params(cfg, make_mesh({"data": 1}, jax.devices()[:1]))
  spec8, tx8, state8 = _tiny_params(cfg, make_mesh(mesh_cfg))
  sh = state_shardings(spec8, tx8)
  mu = sh.opt_state[1][0].inner_states["muon"].inner_state[0].mu["blocks"]  # Muon's momentum
  params = sh.params["blocks"]
  if model:  # the MoE layers' block
    mu, params = mu["moe"], params["moe"]
  mlp, up = ("moe", "w_up_NEF") if model else ("mlp", "w_up_EF")
  assert mu["attn"]["wq_EHD"].spec == params["attn"]["wq_EHD"].spec
  assert mu[mlp][up].spec == params[mlp][up].spec
  assert len(mu[mlp][up].device_set) == 8
  outs = []
  for spec, tx, state, shard in ((spec1, tx1, state1, None), (spec8, tx8, state8, sh)):
    def update(params, opt, g, tx=tx):
      opt_out = opt
      for step in range(2):
        u, opt_out = tx.update(g, opt_out, params, step=jnp.int32(step))
      return u, opt_out
    g = _grads(state.params)
    kw = {} if shard is None else dict(in_shardings=(shard.params, shard.opt_state, shard.params),
                                       out_shardings=(shard.params, shard.opt_state))
    with jax.set_mesh(spec.mesh):
      jitted = jax.jit(update, **kw)
      outs.append(jax.device_get(jitted(state.params, state.opt_state, g)))
      hlo = jitted.lower(state.params, state.opt_state, g).compile().as_text()
  # Newton-Schulz on whole matrices (optim/muon.py ns_spec): no partial X X^T is all-reduced
  # (only clipping's scalar norms are); left to the partitioner, every iteration reduced one
  reduced = [line.split(" = ")[1].split(" all-reduce(")[0] for line in hlo.splitlines()
             if " all-reduce(" in line and " = " in line]
  assert not [r for r in reduced if re.search(r"\[\d+,\d+", r)], reduced
  # equal up to fp32 rounding (sharded contractions sum in another order); updates are ~1e-4
  jax.tree.map(lambda a, b: np.testing.assert_allclose(a, b, rtol=1e-4, atol=1e-8), *outs)


@functools.cache
def _second_update(key=None, value=None):
  """The tiny model's second Muon update (two different gradients: the first update of a
  bias-corrected momentum is the gradient's whatever beta and Nesterov are) under key=value."""
  cfg = _muon_config(**({} if key is None else {key: value}))
  spec, tx, state = _tiny_params(cfg, make_mesh({"data": 1}, jax.devices()[:1]))
  update = jax.jit(lambda g, o, p, s: tx.update(g, o, p, step=s))
  _, opt = update(_grads(state.params, 0), state.opt_state, state.params, jnp.int32(0))
  return update(_grads(state.params, 1), opt, state.params, jnp.int32(1))[0]


@pytest.mark.parametrize("key,value,changes", [
    ("optim.muon.beta", 0.5, "muon"), ("optim.muon.ns_steps", 2, "muon"),
    ("optim.muon.nesterov", False, "muon"), ("optim.muon.rms", 0.0, "muon"),
    ("optim.muon.fallback", "lion", "fallback"), ("optim.muon.fallback", "adafactor", "fallback"),
    ("optim.muon.fallback_lr", 0.002, "fallback")])
def test_every_muon_key_reaches_the_update(key, value, changes):
  base, varied = _second_update(), _second_update(key, value)
  wq = lambda u: np.asarray(u["blocks"]["attn"]["wq_EHD"])
  embed = lambda u: np.asarray(u["embed_VE"])
  moved, kept = (wq, embed) if changes == "muon" else (embed, wq)
  assert not np.allclose(moved(base), moved(varied), rtol=1e-3), key
  np.testing.assert_array_equal(kept(base), kept(varied))


def _fallback_lr_updates(fallback_lr, n=5, batch=None, **optim):
  """One update at step `n` (batch `batch`; reference batch 4) of a Muon whose fallback is at
  `fallback_lr`: Muon's rate 0.02 on a cosine schedule with warmup, decay 0.1 on the embedding
  too (so the fallback's decay is seen), and the fallback's AdamW updates at rate 1 for
  reference."""
  from optim.schedules import build_schedule  # noqa: PLC0415
  o = tiny_config().optim
  o.update(name="muon", learning_rate=0.02, schedule="cosine", warmup_steps=2, decay_steps=10,
           weight_decay=0.1, decay_embeddings=True, clip_norm=0.0, reference_batch_size=4,
           **optim)
  o.muon.fallback_lr = fallback_lr
  data = tiny_config().data
  names = {"embed_VE": ("vocab", "embed"), "norm": ("embed",), "w": ("layers", "embed", "mlp")}
  key = lambda i: jax.random.key(i)
  params = {"embed_VE": jax.random.normal(key(0), (16, 8)), "norm": jnp.ones((8,)),
            "w": jax.random.normal(key(1), (2, 8, 12))}
  grads = jax.tree.map(lambda p: jax.random.normal(key(p.size), p.shape), params)
  tx, _ = build_optimizer(o, names, 10, data)
  update = jax.jit(lambda g, s, p: tx.update(g, s, p, step=jnp.int32(n), batch_size=batch)[0])
  got = update(grads, tx.init(params), params)
  rate = lambda peak: float(build_schedule(o, 10, peak=peak)(n))
  fb = {k: params[k] for k in ("embed_VE", "norm")}
  adamw = lambda lr: optax.adamw(lr, b1=o.b1, b2=0.95, eps=o.eps, weight_decay=0.1,
                                 mask={"embed_VE": True, "norm": False})
  ref = lambda lr: adamw(lr).update({k: grads[k] for k in fb}, adamw(lr).init(fb), fb)[0]
  return got, ref, rate


def test_fallback_lr_is_the_fallbacks_rate_on_the_schedule_and_batch_rule():
  """optim.muon.fallback_lr: the embedding's and norm's update is AdamW's (its decay included) at
  fallback_lr on the schedule's shape, moved by the lr rule like learning_rate; Muon's matrices
  are untouched; 0 is the shared rate bit for bit (today's chain)."""
  shared, ref, rate = _fallback_lr_updates(0.0)
  held, _, _ = _fallback_lr_updates(0.005)
  same, _, _ = _fallback_lr_updates(0.02)  # = learning_rate: the shared rate exactly
  jax.tree.map(np.testing.assert_array_equal, same, shared)
  np.testing.assert_array_equal(held["w"], shared["w"])
  for k, want in ref(rate(0.005)).items():
    np.testing.assert_allclose(held[k], want, rtol=1e-5, atol=1e-9)
  for k, want in ref(rate(0.02)).items():  # the shared rate: AdamW at learning_rate
    np.testing.assert_allclose(shared[k], want, rtol=1e-5, atol=1e-9)
  # batch 16 at reference 4 under lr_rule sqrt: both rates x 2
  big, _, _ = _fallback_lr_updates(0.005, batch=16, lr_rule="sqrt")
  np.testing.assert_allclose(big["embed_VE"], ref(rate(0.01))["embed_VE"], rtol=1e-5, atol=1e-9)
  big_shared, _, _ = _fallback_lr_updates(0.0, batch=16, lr_rule="sqrt")
  np.testing.assert_array_equal(big["w"], big_shared["w"])


@pytest.mark.parametrize("fallback", ["adafactor", pytest.param("lion", marks=pytest.mark.slow)])
def test_trains_end_to_end_with_each_fallback_and_jordan_scaling(tmp_path, fallback):
  """The tiny config trains (loss falls) with every non-default optim.muon value (the fallback
  at its own rate too), through train.py's path (`Run`); the default (adamw, rms 0.2) trains
  in test_optimizers_train.py.
  Adafactor (whose state is not parameter-shaped) in the default suite, Lion in the slow one."""
  cfg = _muon_config(**{"steps": 8, "optim.muon.fallback": fallback, "optim.muon.rms": 0.0,
                        "optim.muon.beta": 0.9, "optim.muon.ns_steps": 4,
                        "optim.muon.nesterov": False, "optim.learning_rate": 0.02,
                        "optim.muon.fallback_lr": 0.01})
  Run(cfg, str(tmp_path)).train()
  got = losses(tmp_path)
  assert all(np.isfinite(v) for v in got.values())
  assert got[8] < got[1] - 0.5, got


@pytest.mark.slow  # the default run keeps tests/test_checkpoint.py's resume
def test_resumed_muon_run_equals_uninterrupted_run(tmp_path):
  cfg = lambda steps, **kw: _muon_config(**{"steps": steps, "checkpoint.every_steps": 3, **kw})
  Run(cfg(6), str(tmp_path / "straight")).train()
  Run(cfg(3), str(tmp_path / "resumed")).train()
  Run(cfg(6), str(tmp_path / "resumed")).train()
  a, b = losses(tmp_path / "straight"), losses(tmp_path / "resumed")
  assert [a[s] for s in range(1, 7)] == [b[s] for s in range(1, 7)]  # bit for bit
  Run(cfg(3), str(tmp_path / "moved")).train()  # restored onto a sharded mesh
  Run(cfg(6, **{"mesh.fsdp": 4, "mesh.tensor": 2}), str(tmp_path / "moved")).train()
  c = losses(tmp_path / "moved")
  np.testing.assert_allclose([c[s] for s in range(4, 7)], [a[s] for s in range(4, 7)],
                             rtol=1e-5)


@pytest.mark.parametrize("overrides,message", [
    ({"optim.muon.fallback": "lamb"}, "optim.muon.fallback='lamb': choose one of adamw"),
    ({"optim.muon.beta": 1.0}, "optim.muon.beta=1.0: must be in [0, 1)"),
    ({"optim.muon.ns_steps": 0}, "optim.muon.ns_steps=0: must be at least 1"),
    ({"optim.muon.rms": -0.2}, "optim.muon.rms=-0.2: must be >= 0"),
    ({"optim.muon.fallback_lr": -0.01}, "optim.muon.fallback_lr=-0.01: must be >= 0"),
    # muP has Muon's rule (optim/muon.py:mup_shape_scale); CompleteP's are Adam's
    ({"model.depth_parametrization": "completep", "model.base_depth": 1},
     "model.depth_parametrization='completep' sets CompleteP's rules for adamw")])
def test_config_mistakes_are_one_line(overrides, message):
  with pytest.raises(ConfigError, match=message.replace("[", r"\[").replace("(", r"\(")
                     .replace(")", r"\)")):
    validate(_muon_config(**overrides), 1)

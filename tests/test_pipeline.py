"""Pipeline parallelism over `mesh.stage` (sharding/pipeline.py, models/pipeline.py,
trainer/step/pipelined.py): GPipe and circular schedules equal the plain step (losses, gradients,
parameters over several steps; with fsdp x tensor inside the stages; with MoE layers), the
bubble and bytes between stages counted from the compiled program, checkpoints that hold the
plain layer stack, evaluation and the noise-scale meter through the pipeline, the batch ramp's
micro-batch counts, and the one-line config errors. Resume across meshes and after SIGKILL:
tests/test_pipeline_resume.py."""
import jax
import jax.numpy as jnp
import numpy as np
import pytest

from conftest import tiny_config
from data import pipeline as data_pipeline
from optim.autopilot import AutoConfig, Autopilot, Change
from optim.ramp import BatchRamp
from sharding.pipeline import Pipeline, count
from sharding.pipeline_vjp import Residuals
from trainer.config import ConfigError
from trainer.config.checks import validate
from trainer.step.pipelined import grad_sums as pipelined_grad_sums
from trainer.step.program import Program, run_mesh
from trainer.step.train_step import grad_sums

STEPS = 3
# 8 layers (so S x R up to 8), 4 micro-batches of 4 rows; SGD, so that parameter changes are
# the gradients themselves.
BASE = {"model.num_layers": 8, "data.global_batch_size": 16, "data.micro_batch_size": 4,
        "optim.name": "sgd", "optim.learning_rate": 0.5, "optim.schedule": "constant",
        "optim.warmup_steps": 0}
GPIPE2 = {"mesh.stage": 2, "mesh.data": 4}
CIRCULAR2 = {"mesh.stage": 2, "mesh.data": 4, "pipeline.schedule": "circular",
             "pipeline.repeats": 2}
ONE_F_ONE_B_R2 = {**CIRCULAR2, "pipeline.schedule": "1f1b"}  # interleaved 1F1B
ZERO_BUBBLE2 = {**GPIPE2, "pipeline.schedule": "zero_bubble"}


def _cfg(**overrides):
  return tiny_config(**{**BASE, **overrides})


def _batches(data_dir, cfg, steps=STEPS):
  """`steps` global batches [M, B, S] of the training stream."""
  micro = cfg.data.micro_batch_size
  it = iter(data_pipeline.dataset(data_pipeline.StreamSpec(
      data_dir, "train", cfg.data.seq_len, micro)))
  out = []
  for _ in range(steps):
    mbs = [next(it) for _ in range(cfg.data.global_batch_size // micro)]
    out.append({k: np.stack([mb[k] for mb in mbs]) for k in data_pipeline.BATCH_KEYS})
  return out


def _train(cfg, batches, devices=None):
  """(metric rows per step, final parameters in the plain layer order, program)."""
  program = Program(cfg, run_mesh(cfg, devices))
  state = program.init_state()
  step = program.jitted_step(logs=True)
  rows = []
  with jax.set_mesh(program.mesh):
    for batch in batches:
      state, metrics = step(state, {k: jax.device_put(v, program.batch_sharding)
                                    for k, v in batch.items()})
      rows.append(jax.device_get(metrics))
  return rows, jax.device_get(program.layout.to_saved(state).params), program


def _column(rows, key):
  return np.array([float(r[key]) for r in rows])


def _assert_trees_close(a, b, **tol):
  jax.tree.map(lambda x, y: np.testing.assert_allclose(x, y, **tol), a, b)


@pytest.fixture(scope="module")
def reference(data_dir):
  """The plain step on one device: what every pipeline must equal."""
  cfg = _cfg()
  batches = _batches(data_dir, cfg)
  rows, params, _ = _train(cfg, batches, devices=jax.devices()[:1])
  return batches, rows, params


@pytest.mark.parametrize("mesh", [
    GPIPE2,
    pytest.param(CIRCULAR2, marks=pytest.mark.slow),  # its gradients: the test below
    {"mesh.stage": 2, "mesh.fsdp": 2, "mesh.tensor": 2, "pipeline.schedule": "circular",
     "pipeline.repeats": 4, "pipeline.remat_stage": False, "model.remat": "full"},
    pytest.param({"mesh.stage": 4, "mesh.data": 2}, marks=pytest.mark.slow),
    pytest.param({"mesh.stage": 4, "mesh.data": 2, "pipeline.schedule": "circular",
                  "pipeline.repeats": 2}, marks=pytest.mark.slow),
    ONE_F_ONE_B_R2,
    pytest.param({"mesh.stage": 2, "mesh.fsdp": 2, "mesh.tensor": 2,
                  "pipeline.schedule": "zero_bubble", "model.remat": "full"},
                 marks=pytest.mark.slow),  # the default run keeps zero_bubble's gradients below
    # and fsdp x tensor x remat with stages in circular-s2r4
    pytest.param({**GPIPE2, "pipeline.schedule": "1f1b"}, marks=pytest.mark.slow),
    pytest.param({"mesh.stage": 4, "mesh.data": 2, "pipeline.schedule": "1f1b"},
                 marks=pytest.mark.slow),
    pytest.param({"mesh.stage": 4, "mesh.data": 2, "pipeline.schedule": "zero_bubble"},
                 marks=pytest.mark.slow),
    pytest.param({"mesh.stage": 4, "mesh.fsdp": 2, "pipeline.schedule": "zero_bubble",
                  "pipeline.repeats": 2}, marks=pytest.mark.slow),
], ids=["gpipe-s2", "circular-s2r2", "circular-s2r4-fsdp2-tensor2-layer-remat", "gpipe-s4",
        "circular-s4r2", "1f1b-s2r2", "zero_bubble-s2-fsdp2-tensor2-layer-remat", "1f1b-s2",
        "1f1b-s4", "zero_bubble-s4", "zero_bubble-s4r2-fsdp2"])
def test_stages_equal_the_plain_step(reference, mesh, devices):
  """Losses, gradient norms and the parameters after several SGD steps (each step's update is
  its gradient) equal the plain step on one device, to fp32 rounding."""
  batches, ref_rows, ref_params = reference
  rows, params, program = _train(_cfg(**mesh), batches)
  assert program.pipeline is not None and program.pipeline.stages == mesh["mesh.stage"]
  np.testing.assert_allclose(_column(rows, "loss"), _column(ref_rows, "loss"), rtol=1e-6)
  np.testing.assert_allclose(_column(rows, "grad_norm"), _column(ref_rows, "grad_norm"),
                             rtol=1e-5)
  _assert_trees_close(params, ref_params, rtol=1e-4, atol=1e-6)
  assert _column(ref_rows, "loss")[-1] < _column(ref_rows, "loss")[0]  # it trains


@pytest.mark.parametrize("mesh", [
    pytest.param(CIRCULAR2, marks=pytest.mark.slow),  # circular stays in the default run above
    {**CIRCULAR2, "pipeline.schedule": "zero_bubble"},
    pytest.param(ONE_F_ONE_B_R2, marks=pytest.mark.slow),
    pytest.param({"mesh.stage": 2, "mesh.fsdp": 2, "mesh.tensor": 2, "pipeline.schedule": "1f1b",
                  "pipeline.repeats": 2, "pipeline.remat_stage": False},
                 marks=pytest.mark.slow),  # 1f1b stays in the default run in test_moe_layers_in_stages
], ids=["circular", "zero_bubble-r2", "1f1b-r2", "1f1b-r2-fsdp2-tensor2-residuals"])
def test_gradients_equal_the_accumulation_scan(reference, devices, mesh):
  """The gradient sum of one step, leaf by leaf: the pipeline's with two repeats (brought to
  the plain layer order) against the plain accumulation scan's; the explicit schedules compute
  it in their own loop (sharding/pipeline_vjp.py)."""
  batches, _, _ = reference
  cfg = _cfg(**mesh)
  piped = Program(cfg, run_mesh(cfg))
  plain = Program(_cfg(), run_mesh(_cfg(), jax.devices()[:1]))
  out = {}
  for name, program, fn in (("piped", piped, pipelined_grad_sums), ("plain", plain, grad_sums)):
    state = program.init_state()
    with jax.set_mesh(program.mesh):
      batch = {k: jax.device_put(v, program.batch_sharding) for k, v in batches[0].items()}
      loss, tokens, grads, _, _ = jax.jit(lambda p, b: fn(program.spec, p, b))(state.params, batch)
      if name == "piped":  # the stored (stage-major) order -> the plain one
        grads = program.layout.to_saved(state.replace(params=grads)).params
    out[name] = jax.device_get((loss, tokens, grads))
  np.testing.assert_allclose(out["piped"][0], out["plain"][0], rtol=1e-6)
  assert out["piped"][1] == out["plain"][1]
  # Measured: at most 4.6e-7 of each leaf's largest entry (fp32 sums in another order).
  worst = jax.tree.map(lambda a, b: np.max(np.abs(a - b)) / np.max(np.abs(b)),
                       out["piped"][2], out["plain"][2])
  assert max(jax.tree.leaves(worst)) < 5e-6, worst


def test_kept_residuals_hold_nothing_the_weights_or_the_micro_batch_index_give():
  """`pipeline.remat_stage=false`: a stage that casts its weights to bfloat16 and adds a
  position term built from the micro-batch index stashes only what depends on its input (no
  cast weight, no position table), and B's pullback equals jax.grad's."""
  table = np.linspace(-1, 1, 3 * 2 * 8).reshape(3, 2, 8)  # [micro-batches, rows, features]

  def stage(w, x, micro):
    h = jnp.tanh(x @ w["a"].astype(jnp.bfloat16) + jnp.asarray(table)[micro].astype(jnp.bfloat16))
    return h @ w["b"].astype(jnp.bfloat16), {"s": jnp.sum(h.astype(jnp.float32) ** 2)}

  w = {"a": jnp.linspace(-0.5, 0.5, 32).reshape(4, 8), "b": jnp.linspace(0.3, -0.2, 32).reshape(8, 4)}
  x = jnp.linspace(-1, 1, 8).reshape(2, 4).astype(jnp.bfloat16)
  keep = Residuals(stage)
  y, _, residuals = keep.f(w, x, 1)
  assert all(r.shape[0] == 2 for r in residuals), [r.shape for r in residuals]  # [rows, ...] only
  cotangents = (jnp.linspace(0, 1, 8).reshape(2, 4).astype(jnp.bfloat16),
                {"s": jnp.ones((), jnp.float32)})
  dx, dw, _ = keep.b(w, residuals, *cotangents, 1)
  want_w, want_x = jax.vjp(lambda w, x: stage(w, x, 1), w, x)[1](cotangents)
  _assert_trees_close(jax.tree.map(lambda a: a.astype(jnp.float32), (dw, dx)),
                      jax.tree.map(lambda a: a.astype(jnp.float32), (want_w, want_x)), rtol=1e-6)


# ------------------------------------------------------------------------------------------------
# Mixture of experts


MOE = {"model.moe.num_experts": 4, "model.moe.top_k": 2, "model.num_layers": 2}


@pytest.mark.parametrize("scope,mesh", [
    pytest.param("global", {"mesh.stage": 2, "mesh.fsdp": 2, "mesh.expert": 2},
                 marks=pytest.mark.slow),  # the default run keeps global-1f1b
    pytest.param("micro_batch", {"mesh.stage": 2, "mesh.fsdp": 2, "mesh.expert": 2,
                                 "pipeline.schedule": "circular", "pipeline.repeats": 2,
                                 "model.num_layers": 4}, marks=pytest.mark.slow),
    ("global", {"mesh.stage": 2, "mesh.fsdp": 2, "mesh.expert": 2,
                "pipeline.schedule": "1f1b"}),
    pytest.param("micro_batch", {"mesh.stage": 2, "mesh.fsdp": 2, "mesh.expert": 2,
                                 "pipeline.schedule": "zero_bubble", "pipeline.repeats": 2,
                                 "model.num_layers": 4}, marks=pytest.mark.slow),
    pytest.param("global", {"mesh.stage": 2, "mesh.fsdp": 2, "mesh.expert": 2,
                            "pipeline.schedule": "1f1b", "pipeline.remat_stage": False},
                 marks=pytest.mark.slow),
], ids=["global-gpipe", "micro_batch-circular", "global-1f1b", "micro_batch-zero_bubble-r2",
        "global-1f1b-residuals"])
def test_moe_layers_in_stages(data_dir, devices, scope, mesh):
  """MoE layers (experts split over `expert` inside each stage, tokens exchanged by all-to-all):
  loss, router statistics, auxiliary losses and parameters equal the plain step's."""
  model = {**MOE, "model.moe.balance_scope": scope,
           "model.num_layers": mesh.get("model.num_layers", MOE["model.num_layers"])}
  plain = _cfg(**model)
  batches = _batches(data_dir, plain, 2)
  ref_rows, ref_params, _ = _train(plain, batches, devices=jax.devices()[:1])
  rows, params, _ = _train(_cfg(**{**model, **mesh}), batches)
  moe_keys = [k for k in ref_rows[0] if k.startswith("moe/")]
  assert "moe/L1/entropy" in moe_keys and "moe/balance_loss" in moe_keys
  for key in ["loss", "grad_norm", *moe_keys]:
    np.testing.assert_allclose(_column(rows, key), _column(ref_rows, key), rtol=2e-5, atol=1e-7,
                               err_msg=key)
  _assert_trees_close(params, ref_params, rtol=1e-4, atol=1e-6)


# ------------------------------------------------------------------------------------------------
# Counted from the compiled program


@pytest.mark.parametrize("mesh,micro", [
    # GPipe at M = 2 and 4: also counted by the batch-ramp test below
    pytest.param(GPIPE2, 2, marks=pytest.mark.slow),
    pytest.param(GPIPE2, 4, marks=pytest.mark.slow),
    (CIRCULAR2, 4),
    pytest.param({"mesh.stage": 4, "mesh.data": 2, "pipeline.schedule": "circular",
                  "pipeline.repeats": 2}, 4, marks=pytest.mark.slow),
], ids=["gpipe-s2-m2", "gpipe-s2-m4", "circular-s2r2-m4", "circular-s4r2-m4"])
def test_counted_bubble_is_the_formula(mesh, micro, devices):
  """The compiled step's tick loop runs M R + S - 1 times (the hand-over collective-permutes'
  run count), so the counted bubble is (S - 1) / (M R + S - 1); every hand-over moves one
  micro-batch's activations per device between neighbouring stages, and the only other bytes
  between stages are the all-reduce of the stage-replicated weights' gradients (embedding, head,
  final norm)."""
  cfg = _cfg(**mesh)
  program = Program(cfg, run_mesh(cfg))
  pipe = program.pipeline
  found = count(pipe, micro, program.compile(micro, logs=True).as_text(), program.mesh)
  S, R = pipe.stages, pipe.repeats
  assert found.ticks == micro * R + S - 1
  assert found.idle == S - 1 and found.busy == micro * R
  assert found.bubble == pytest.approx((S - 1) / (micro * R + S - 1))
  assert found.bubble == pytest.approx(pipe.bubble(micro))
  m = cfg.model
  rows = cfg.data.micro_batch_size // (cfg.mesh.data * cfg.mesh.fsdp)
  activation = rows * cfg.data.seq_len * m.d_model * 4  # one micro-batch per device, fp32
  assert found.activation_bytes == found.permutes * found.ticks * activation
  weights = (2 * m.vocab_size * m.d_model + m.d_model) * 4  # embedding, head, final norm (fp32)
  assert weights <= found.other_bytes <= weights + 256  # + the metrics' scalars reduced with them


def test_one_stage_is_no_pipeline(devices):
  """mesh.stage=1 (the default): no pipeline, no hand-over in the compiled step."""
  cfg = _cfg(**{"mesh.data": 4, "mesh.tensor": 2})
  program = Program(cfg, run_mesh(cfg))
  assert program.pipeline is None and not program.layout.reordered
  assert "collective-permute" not in (program.compile().as_text() or "")


# ------------------------------------------------------------------------------------------------
# The stored layer order and checkpoints


def test_circular_layout_saves_the_plain_stack(devices):
  """A circular pipeline stores its layers stage-major; what it saves is the plain stack: bit
  for bit the parameters the same seed gives on one device, and back again."""
  cfg = _cfg(**CIRCULAR2)
  program = Program(cfg, run_mesh(cfg))
  assert program.layout.reordered
  np.testing.assert_array_equal(Pipeline(2, 2, "circular").stored_order(8),
                                [0, 1, 4, 5, 2, 3, 6, 7])
  state = program.init_state()
  plain_cfg = _cfg()
  plain = Program(plain_cfg, run_mesh(plain_cfg, jax.devices()[:1])).init_state()
  saved = program.layout.to_saved(state)
  jax.tree.map(np.testing.assert_array_equal, jax.device_get(saved.params),
               jax.device_get(plain.params))
  stacked = jax.device_get(state.params["blocks"]["mlp"]["w_up_EF"])
  assert not np.array_equal(stacked, jax.device_get(plain.params["blocks"]["mlp"]["w_up_EF"]))
  back = program.layout.from_saved(saved)
  jax.tree.map(np.testing.assert_array_equal, jax.device_get(back), jax.device_get(state))


# ------------------------------------------------------------------------------------------------
# Evaluation, the noise-scale meter, batch sizes


def test_evaluation_through_the_pipeline(reference, devices):
  """The eval step of a pipelined run (the batch's rows cut into S micro-batches, padded with
  empty rows when they do not divide) scores what the plain eval step does."""
  batches, _, _ = reference
  out = {}
  for name, cfg, devs in (("plain", _cfg(), jax.devices()[:1]),
                          ("piped", _cfg(**{**CIRCULAR2, "mesh.data": 2, "mesh.fsdp": 2}),
                           None)):
    program = Program(cfg, run_mesh(cfg, devs))
    params = program.init_state().params
    with jax.set_mesh(program.mesh):
      for rows in (4, 6):  # padded to 8 = 2 stages x 4 data-parallel
        batch = {k: v.reshape(-1, v.shape[-1])[:rows] for k, v in batches[0].items()}
        out[name, rows] = jax.device_get(jax.jit(program.eval_step())(params, batch))
  for rows in (4, 6):
    np.testing.assert_allclose(out["piped", rows], out["plain", rows], rtol=1e-6)


@pytest.mark.parametrize("schedule,pieces,micro", [
    ("gpipe", 4, 8), pytest.param("zero_bubble", 2, 4, marks=pytest.mark.slow)])
def test_noise_scale_meter_through_the_pipeline(reference, devices, schedule, pieces, micro):
  """The measuring step runs the pipeline on `optim.noise_scale_pieces` parts of every
  micro-batch's rows (part j: rows j, j + P, ...): the small batches the plain step measures on
  when the same 16 rows are one micro-batch, so the noise-scale estimates, like the update, are
  the plain step's."""
  batches, _, _ = reference
  over = {"optim.noise_scale_every": 1, "optim.noise_scale_pieces": pieces,
          "optim.noise_scale_min_measurements": 1, "optim.noise_scale_max_rse": 0}
  rows = {}
  for name, cfg, devs in (
      ("plain", _cfg(**over, **{"data.micro_batch_size": 16}), jax.devices()[:1]),
      ("piped", _cfg(**{**GPIPE2, **over, "mesh.data": 2, "mesh.tensor": 2,
                        "data.micro_batch_size": micro, "pipeline.schedule": schedule}), None)):
    program = Program(cfg, run_mesh(cfg, devs))
    state = program.init_state()
    step = program.jitted_step(measure_noise=True, logs=True)
    with jax.set_mesh(program.mesh):
      width = 16 if name == "plain" else micro
      for batch in batches[:2]:  # the same 16 rows as [1, 16, S] (plain) or [16 / micro, micro, S]
        batch = {k: v.reshape(-1, width, *v.shape[2:]) for k, v in batch.items()}
        state, metrics = step(state, {k: jax.device_put(v, program.batch_sharding)
                                      for k, v in batch.items()})
    rows[name] = jax.device_get(metrics)
  for key in ("loss", "grad_norm", "noise_scale", "noise_trace", "noise_g_sq"):
    np.testing.assert_allclose(rows["piped"][key], rows["plain"][key], rtol=1e-4, err_msg=key)
  assert rows["piped"]["noise_pieces"] == rows["plain"]["noise_pieces"] == pieces
  assert np.isfinite(rows["piped"]["noise_scale"])


def test_the_autopilot_says_what_each_batch_costs_in_bubble():
  pipe = Pipeline(4, 2, "circular")
  cost = lambda batch: pipe.bubble(batch // 8)
  auto = Autopilot(AutoConfig(start=32, max=128), BatchRamp.constant(32, 128), cost=cost)
  line = auto.describe(Change(step=12, batch=64, old=32, measured_at=10, reason="B_simple=99"))
  # M = 4 -> 8 micro-batches of 8 rows: (S - 1) / (M R + S - 1) = 3/11 -> 3/19
  assert line.endswith("pipeline bubble 27.3% -> 15.8% of each step"), line


def test_batch_ramp_changes_the_micro_batches_and_the_counted_bubble(data_dir, tmp_path,
                                                                     devices):
  """A ramp from 8 to 16 sequences (M = 2 -> 4 micro-batches of 4 on 2 stages): the plan line
  gives the cost model at both batches, and the run counts the bubble of each compiled step."""
  import json  # noqa: PLC0415
  from trainer.run.loop import Run  # noqa: PLC0415
  cfg = _cfg(**GPIPE2, **{"data.batch_ramp": "8:0,16:64", "steps": 4, "log_every": 1})
  result = Run(cfg, str(tmp_path)).train()
  assert result.status == "done"
  events = [json.loads(line) for line in open(tmp_path / "metrics.jsonl")]
  counted = {e["pipeline/micro_batches"]: e for e in events if e.get("event") == "pipeline"}
  assert sorted(counted) == [2, 4]
  for micro, e in counted.items():
    assert e["pipeline/ticks"] == micro + 1 and e["pipeline/bubble"] == pytest.approx(
        1 / (micro + 1))
    assert e["pipeline/memory_bytes"] > 0


# ------------------------------------------------------------------------------------------------
# Config errors


@pytest.mark.parametrize("overrides,needle", [
    ({"mesh.stage": 2, "mesh.data": 4, "model.num_layers": 3},
     "model.num_layers=3 does not split over mesh.stage=2 x pipeline.repeats=1"),
    ({**CIRCULAR2, "model.num_layers": 6},
     "model.num_layers=6 does not split over mesh.stage=2 x pipeline.repeats=2"),
    ({"mesh.stage": 2, "mesh.data": 4, "model.moe.num_experts": 4, "model.moe.every": 2,
      "model.num_layers": 6}, "(in 3 groups of model.moe.every=2)"),
    ({"mesh.stage": 4, "mesh.data": 2, "data.micro_batch_size": 8},
     "is 2 micro-batch(es), fewer than the mesh.stage=4 pipeline stages (M < S"),
    ({"mesh.stage": 2, "mesh.data": 4, "data.micro_batch_size": 0},
     "is 1 micro-batch(es), fewer than the mesh.stage=2"),
    ({"mesh.stage": 4, "mesh.data": 2, "data.global_batch_size": 24, "data.micro_batch_size": 4},
     "is 6 micro-batches, not a multiple of mesh.stage=4"),
    ({**GPIPE2, "data.batch_ramp": "12:0,16:100"},
     "the batch of 12 sequences (data.batch_ramp) in micro-batches"),
    ({"mesh.stage": 2, "mesh.data": 2, "mesh.sequence": 2, "model.attention": "ring"},
     "does not run inside pipeline stages"),
    ({"mesh.stage": 2, "mesh.data": 2, "optim.diloco.replicas": 2},
     "pipeline stages do not run inside DiLoCo's replicas"),
    ({**GPIPE2, "pipeline.repeats": 2}, "pipeline.repeats=2 with pipeline.schedule='gpipe'"),
    ({**GPIPE2, "pipeline.schedule": "2f2b"}, "pipeline.schedule='2f2b': choose one of gpipe"),
    ({**GPIPE2, "pipeline.schedule": "zero_bubble", "pipeline.remat_stage": False},
     "pipeline.remat_stage=False with pipeline.schedule='zero_bubble': its split backward"),
    ({"mesh.stage": 4, "mesh.data": 2, "data.micro_batch_size": 8,
      "pipeline.schedule": "zero_bubble"}, "fewer than the mesh.stage=4 pipeline stages (M < S"),
    ({**GPIPE2, "pipeline.schedule": "1f1b", "pipeline.repeats": 3},
     "model.num_layers=8 does not split over mesh.stage=2 x pipeline.repeats=3"),
    ({**GPIPE2, "optim.noise_scale_every": 2}, "runs the pipeline on optim.noise_scale_pieces=2"),
    ({**GPIPE2, "optim.noise_scale_every": 2, "data.batch_ramp": "8:0,16:64"},
     "(at least two) parts of every micro-batch's"),
])
def test_config_errors_are_one_line(overrides, needle, data_dir):
  with pytest.raises(ConfigError) as e:
    validate(_cfg(**overrides), 8)
  assert needle in str(e.value) and "\n" not in str(e.value), str(e.value)

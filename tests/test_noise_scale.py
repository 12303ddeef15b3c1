"""Gradient noise scale (McCandlish et al. 2018): the two-batch estimator, its windowed average on
a problem whose answer is known, the window's memory in training (not in measurements), the train
step's wiring of the small and big batches, and the plain (non-measuring) step of a run with the
meter being exactly the step of a run without it. The meter as a run logs it, against per-sequence
gradients at the run's parameters: tests/test_noise_meter.py."""
import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest

from conftest import tiny_config
from data import pipeline
from models.llama import ModelConfig
from optim import build_optimizer, noise_scale
from sharding import batch_sharding, make_mesh, replicated
from trainer.step.program import Program
from trainer.step.state import ModelSpec, init_state, state_shardings
from trainer.step.train_step import grad_sums, loss_sums, make_train_step


def test_estimator_is_exact_in_expectation():
  """E|G_b|^2 = |G|^2 + tr(Sigma) / b: plugging in the expectations returns both exactly, also
  for several small batches of unequal sizes with b their harmonic mean."""
  g_sq, trace = 2.5, 40.0
  sq = lambda b: g_sq + trace / b
  np.testing.assert_allclose(noise_scale.estimate(sq(8), sq(64), 8, 64), (g_sq, trace))
  sizes = np.array([5.0, 8.0, 11.0])
  harmonic = len(sizes) / np.sum(1 / sizes)
  est = noise_scale.estimate(np.mean(sq(sizes)), sq(sizes.sum()), harmonic, sizes.sum())
  np.testing.assert_allclose(est, (g_sq, trace))


def test_meter_recovers_the_noise_scale_of_linear_regression():
  """Least squares 0.5 (x.w - y)^2 with x ~ N(0, I_d), y = x.w* + N(0, s^2), at w = w* + delta:
  per-example gradients x (x.delta - eps) have mean G = delta and covariance
  Sigma = (|delta|^2 + s^2) I + delta delta^T (Gaussian fourth moments), so
  B_simple = (d (|delta|^2 + s^2) + |delta|^2) / |delta|^2 = 21 for d = 16, |delta| = 1,
  s = 0.5. Batches of 64 split into 8 micro-batches of 8, as the train step does."""
  d, s, num_micro, micro = 16, 0.5, 8, 8
  rng = np.random.default_rng(0)
  delta = rng.standard_normal(d)
  delta /= np.linalg.norm(delta)
  want = (d * (1 + s * s) + 1) / 1.0

  tx = noise_scale.meter(0.5)
  state = tx.init(None)
  update = jax.jit(lambda st, sample, i: tx.update({}, st, noise_sample=sample, step=i)[1])
  for i in range(1500):
    x = rng.standard_normal((num_micro, micro, d))
    eps = s * rng.standard_normal((num_micro, micro))
    g = x * (x @ delta - eps)[..., None]  # per-example gradients [M, b, d]
    small = g.mean(axis=1)  # each micro-batch's mean gradient
    big = small.mean(axis=0)
    sample = noise_scale.Sample(np.mean(np.sum(small ** 2, -1)), np.sum(big ** 2),
                                float(micro), float(num_micro * micro))
    state = update(state, sample, i)
  out = noise_scale.readout(state)
  assert float(out["b_simple"]) == pytest.approx(want, rel=0.10)
  assert float(out["g_sq"]) == pytest.approx(1.0, rel=0.10)
  assert float(out["trace_sigma"]) == pytest.approx(want, rel=0.10)


def test_the_window_is_the_last_fraction_of_the_training_so_far():
  """At step n the meter sums the measurements after (1 - window) n (to within one bucket, 1/8
  of the window, at its old edge), whatever came before and however many there were: an
  impulse in tr(Sigma) at step 100 counts at step 130 and not at step 140 or later."""
  window = 0.25
  tx = noise_scale.meter(window)
  state = tx.init(None)
  update = jax.jit(lambda st, sample, i: tx.update({}, st, noise_sample=sample, step=i)[1])
  seen = {}
  for step in range(1000):  # 0-based: the step that ends at step + 1
    trace = 4.0 if step == 99 else 0.0  # squared norms whose estimates are (1, trace) exactly
    sample = noise_scale.Sample(*(np.float32(v) for v in (1 + trace, 1 + trace / 2, 1.0, 2.0)))
    state = update(state, sample, step)
    out = noise_scale.readout(state)
    seen[step + 1] = (float(out["trace_sigma"]) * float(out["count"]), float(out["count"]))
  assert seen[130][0] == pytest.approx(4.0) and seen[140][0] == 0.0 and seen[400][0] == 0.0
  for n in (40, 400, 1000):  # the window's measurements: n / 4, and at most one bucket more
    assert window * n <= seen[n][1] <= window * n * (1 + 1 / 8) + 1, (n, seen[n])
  assert float(state.clock) == 1000.0 and float(noise_scale.readout(state)["g_sq"]) == \
      pytest.approx(1.0, rel=1e-5)
  whole = noise_scale.meter(1.0)  # window 1: every measurement so far
  state = whole.init(None)
  for step in range(50):
    _, state = whole.update({}, state, noise_sample=noise_scale.Sample(
        *(np.float32(v) for v in (5.0, 3.0, 1.0, 2.0))), step=step)
  assert float(noise_scale.readout(state)["count"]) == 50


def test_the_meter_forgets_in_training_not_in_measurements():
  """The same stream of estimates, measured every step or every 10th: after a change of the
  truth (B_simple 4 -> 16 at step 200 of 400) both read the new value by the end, with the
  memory the window sets in steps (an EMA of 0.98 per measurement, as earlier versions had,
  read 11 here at every 10th step: a run-long average)."""
  rng = np.random.default_rng(1)
  readings = {}
  for every in (1, 10):
    tx = noise_scale.meter(0.25)
    state = tx.init(None)
    for step in range(every - 1, 400, every):
      g_sq, trace = 1.0, (4.0 if step < 200 else 16.0) * (1 + 0.1 * rng.standard_normal())
      b, big = 8.0, 64.0  # squared norms whose estimates are (g_sq, trace) exactly
      sample = noise_scale.Sample(*(np.float32(v) for v in (
          g_sq + trace / b, g_sq + trace / big, b, big)))
      _, state = tx.update({}, state, noise_sample=sample, step=step)
    readings[every] = float(noise_scale.readout(state)["b_simple"])
  assert readings[1] == pytest.approx(16, rel=0.1) and readings[10] == pytest.approx(16, rel=0.15)


def test_splits_make_enough_small_batches_where_the_rows_allow():
  assert noise_scale.splits(1, 2, 8) == 2 and noise_scale.splits(2, 2, 8) == 1
  assert noise_scale.splits(1, 8, 8) == 8 and noise_scale.splits(2, 8, 8) == 4
  assert noise_scale.splits(1, 8, 6) == 6 and noise_scale.splits(1, 8, 3) == 3
  assert noise_scale.splits(16, 4, 8) == 1 and noise_scale.splits(1, 2, 1) == 1


def test_meter_is_an_identity_without_a_sample():
  tx = noise_scale.meter(0.9)
  state = tx.init({"w": jnp.ones(3)})
  updates, new = tx.update({"w": jnp.ones(3)}, state)
  assert new == state and np.all(updates["w"] == 1)
  assert noise_scale.find_state(optax.chain(tx, optax.sgd(0.1)).init({"w": jnp.ones(3)})) \
      is not None
  assert noise_scale.find_state(optax.sgd(0.1).init({"w": jnp.ones(3)})) is None


@pytest.fixture(scope="module")
def step_setup(data_dir):
  cfg = tiny_config(**{"mesh.data": 2})
  it = iter(pipeline.dataset(pipeline.StreamSpec(data_dir, "train", cfg.data.seq_len, 8)))
  batch = {k: v[None] for k, v in next(it).items()}  # [1, 8, S]: no accumulation
  mesh = make_mesh({"data": 2}, jax.devices()[:2])
  spec = ModelSpec(ModelConfig.from_config(cfg.model), mesh, cfg.seed)
  return cfg, batch, mesh, spec


def _one_step(cfg, batch, mesh, spec):
  tx, schedule = build_optimizer(cfg.optim, spec.logical_names, cfg.steps, cfg.data)
  shardings = state_shardings(spec, tx)
  bsh = batch_sharding(mesh, microbatched=True)
  measure = cfg.optim.noise_scale_every > 0
  step = jax.jit(make_train_step(spec, tx, schedule, measure_noise=measure),
                 in_shardings=(shardings, bsh),
                 out_shardings=(shardings, replicated(mesh)))
  state = init_state(spec, tx)
  with jax.set_mesh(mesh):
    _, metrics = step(state, {k: jax.device_put(v, bsh) for k, v in batch.items()})
  return state, jax.device_get(metrics)


def test_step_without_accumulation_measures_two_halves(step_setup):
  """M = 1: the step splits the batch into rows 0, 2, 4, 6 and 1, 3, 5, 7; the meter's first
  estimate equals the estimator applied to those halves' gradients, and the loss is the one
  of the ordinary step."""
  cfg, batch, mesh, spec = step_setup
  noise_cfg = tiny_config(**{"mesh.data": 2, "optim.noise_scale_every": 1})
  state, metrics = _one_step(noise_cfg, batch, mesh, spec)
  _, plain = _one_step(cfg, batch, mesh, spec)
  assert metrics["loss"] == pytest.approx(plain["loss"], rel=1e-6)
  assert "noise_scale" not in plain

  sums, tokens = [], []
  grad_fn = jax.jit(jax.value_and_grad(lambda p, b: loss_sums(spec, p, b), has_aux=True))
  with jax.set_mesh(mesh):
    for half in (0, 1):
      (_, n), g = grad_fn(state.params, {k: v[0, half::2] for k, v in batch.items()})
      sums.append(jax.device_get(g))
      tokens.append(float(n))
  sq = lambda tree: float(optax.tree.norm(tree, squared=True))
  small = np.mean([sq(g) / t ** 2 for g, t in zip(sums, tokens)])
  total = sum(tokens)
  big = sq(jax.tree.map(lambda a, b: (a + b) / total, *sums))
  harmonic = 2 / (1 / tokens[0] + 1 / tokens[1])
  g_sq, trace = noise_scale.estimate(small, big, harmonic, total)
  assert metrics["noise_g_sq"] == pytest.approx(g_sq, rel=1e-3)
  assert metrics["noise_g_sq_step"] == pytest.approx(g_sq, rel=1e-3)
  assert metrics["noise_trace"] == pytest.approx(trace, rel=1e-3)
  assert metrics["noise_scale_tokens"] == pytest.approx(trace / g_sq, rel=1e-3)
  assert metrics["noise_scale"] == pytest.approx(trace / g_sq * 8 / total, rel=1e-3)


def test_plain_step_of_a_metered_run_is_the_meter_off_step(step_setup):
  """With optim.noise_scale_every > 0 the steps that do not measure run
  `Program.compile(measure_noise=False)`: bit for bit the step of a run without the meter (no
  half-batch split), leaving the meter's state as it was (their rows carry its value); the
  measuring step updates it."""
  _, batch, mesh, _ = step_setup
  def steps(cfg, measure_noise):
    program = Program(cfg, mesh)
    step = program.compile(measure_noise=measure_noise)
    state = init_state(program.spec, program.tx)
    meter0 = jax.device_get(noise_scale.find_state(state.opt_state))
    out = []
    with jax.set_mesh(mesh):
      for _ in range(2):
        state, metrics = step(state, {k: jax.device_put(v, program.batch_sharding)
                                      for k, v in batch.items()})
        out.append(jax.device_get(metrics))
    return out, jax.device_get(state), meter0

  metered = tiny_config(**{"mesh.data": 2, "optim.noise_scale_every": 10})
  off, off_state, _ = steps(tiny_config(**{"mesh.data": 2}), False)
  plain, plain_state, meter0 = steps(metered, False)
  for a, b in zip(off, plain):
    assert a["loss"] == b["loss"] and a["grad_norm"] == b["grad_norm"]
    assert "noise_g_sq_step" not in b and np.isnan(b["noise_scale"])  # no measurement yet
  jax.tree.map(np.testing.assert_array_equal, plain_state.params, off_state.params)
  jax.tree.map(np.testing.assert_array_equal, noise_scale.find_state(plain_state.opt_state),
               meter0)  # untouched
  measured, measured_state, _ = steps(metered, True)
  # two measurements at 8 and 16 examples: the window (the last quarter) holds the second
  assert float(noise_scale.readout(noise_scale.find_state(measured_state.opt_state))["count"]) \
      == 1
  assert np.isfinite(measured[-1]["noise_g_sq"])
  assert measured[0]["loss"] == pytest.approx(off[0]["loss"], rel=1e-6)


@pytest.mark.slow  # the estimator at fixed parameters; the default run keeps tests/test_noise_meter.py's check in training
def test_the_meter_agrees_with_per_example_gradients_of_independent_sequences(data_dir):
  """The meter's B_simple, from the training stream's steps (batch 64 in micro-batches of 4, the
  step's own gradient sums, its estimator averaged over steps), equals tr(Sigma) / |G|^2 from
  per-sequence gradients of independent windows, within the standard errors (jackknife) of the
  two: a step's micro-batches must be independent draws for the small-batch norms to measure
  the noise. On the per-row streams (a step's 16 micro-batches were the next chunks of the
  same 4 documents) the meter read 4.0 against a truth of 20 here."""
  cfg = tiny_config(**{"mesh.data": 1, "data.global_batch_size": 16})
  mesh = make_mesh(cfg.mesh, jax.devices()[:1])
  program = Program(cfg, mesh)
  spec, seq_len = program.spec, cfg.data.seq_len
  stream = lambda rows, seed: iter(pipeline.dataset(pipeline.StreamSpec(
      data_dir, "train", seq_len, rows, seed=seed)))
  step, state, it = program.compile(), program.init_state(), stream(16, 7)
  with jax.set_mesh(mesh):
    for _ in range(40):  # a little training: gradients that tell documents apart
      state, _ = step(state, {k: v[None] for k, v in next(it).items()})
  params = state.params

  def jackknife(values, ratio):
    """The ratio estimate over all groups and its jackknife standard error."""
    n = len(values)
    leave_out = np.array([ratio(np.delete(values, k, axis=0)) for k in range(n)])
    return ratio(values), np.sqrt((n - 1) / n * np.sum((leave_out - leave_out.mean()) ** 2))

  # The truth: per-sequence gradients of 2048 independent windows (another seed's stream).
  flat = lambda tree: jnp.concatenate([x.ravel() for x in jax.tree.leaves(tree)])
  mean_loss = lambda p, row: (lambda s, n: s / n)(*loss_sums(spec, p, jax.tree.map(
      lambda x: x[None], row)))
  per_sequence = jax.jit(lambda p, rows: jax.vmap(
      lambda r: flat(jax.grad(mean_loss)(p, r)))(rows))
  it = stream(128, 123)
  with jax.set_mesh(mesh):
    chunks = [np.asarray(per_sequence(params, next(it)), np.float64) for _ in range(16)]
  sums = np.array([np.concatenate([c.sum(0), [np.sum(c * c), len(c)]]) for c in chunks])

  def truth(groups):  # unbiased tr(Sigma) and |G|^2 from sums over sequences
    total = groups.sum(0)
    n, mean = total[-1], total[:-2] / total[-1]
    trace = (total[-2] - n * mean @ mean) / (n - 1)
    return trace / (mean @ mean - trace / n)

  want, want_se = jackknife(sums, truth)

  # The meter: the measuring step's sums on 48 steps of the training stream.
  measure = jax.jit(lambda p, b: grad_sums(spec, p, b, measure_noise=True))
  it, rows = stream(4, 5), []
  with jax.set_mesh(mesh):
    for _ in range(48):
      micro = [next(it) for _ in range(16)]
      batch = {k: np.stack([m[k] for m in micro]) for k in pipeline.BATCH_KEYS}
      _, tokens, grad_sum, (small_sum, inv_tokens, _), _ = measure(params, batch)
      tokens = float(tokens)
      g_sq, trace = noise_scale.estimate(
          float(small_sum) / 16, float(optax.tree.norm(grad_sum, squared=True)) / tokens ** 2,
          16 / float(inv_tokens), tokens)
      rows.append((g_sq, trace, tokens))
  rows = np.array(rows)
  per_seq_tokens = rows[:, 2].sum() / (len(rows) * 64)  # B_simple in tokens -> in sequences
  got, got_se = jackknife(rows, lambda r: r[:, 1].mean() / r[:, 0].mean() / per_seq_tokens)
  assert abs(got - want) < 3 * np.hypot(got_se, want_se), (got, got_se, want, want_se)


@pytest.mark.parametrize("override,needle", [
    ({"optim.noise_scale_window": 0.0}, "optim.noise_scale_window=0.0: must be in (0, 1]"),
    ({"optim.noise_scale_window": 1.5}, "optim.noise_scale_window=1.5: must be in (0, 1]"),
    ({"optim.noise_scale_pieces": 1}, "optim.noise_scale_pieces=1: must be >= 2"),
])
def test_meter_settings_are_checked(override, needle):
  from trainer.config import ConfigError  # noqa: PLC0415
  from trainer.config.checks import validate  # noqa: PLC0415
  with pytest.raises(ConfigError, match=needle.replace("(", r"\(").replace(")", r"\)")):
    validate(tiny_config(**{"optim.noise_scale_every": 1, **override}), 1)


def test_the_old_ema_key_names_its_replacement(tmp_path):
  from trainer.config import ConfigError  # noqa: PLC0415
  from trainer.config.cli import load  # noqa: PLC0415
  path = tmp_path / "c.py"
  path.write_text("from trainer.config import default_config\n"
                  "def get_config():\n  return default_config()\n")
  with pytest.raises(ConfigError, match="it is now optim.noise_scale_window"):
    load(str(path), [("optim.noise_scale_ema", "0.98")])


def test_a_run_measures_on_the_pieces_asked_and_says_its_window(tmp_path, capsys):
  """`noise_scale_pieces=4` on one 32-row micro-batch over 8 devices: the measuring steps split
  it in 4 (their rows say so); the start-up line gives the window in steps; a row that does not
  measure carries the meter's value."""
  from conftest import metric_rows  # noqa: PLC0415
  from trainer.run.loop import Run  # noqa: PLC0415
  cfg = tiny_config(**{"data.global_batch_size": 32, "steps": 8, "log_every": 1,
                       "optim.noise_scale_every": 2, "optim.noise_scale_pieces": 4})
  Run(cfg, str(tmp_path)).train()
  rows = metric_rows(tmp_path)
  assert [s for s in rows if "noise_pieces" in rows[s]] == [2, 4, 6, 8]
  assert {rows[s]["noise_pieces"] for s in (2, 4, 6, 8)} == {4}
  assert rows[5]["noise_scale"] == rows[4]["noise_scale"]  # no measurement at step 5
  assert "noise_pieces" not in rows[5] and rows[4]["noise_measurements"] >= 1
  out = capsys.readouterr().out
  assert ("gradient noise scale: measured every 2 steps on small batches (4 at batch 32), "
          "averaged over the last 25% of the tokens trained so far (at step 8 its steps 7-8)"
          ) in out, out


def test_the_start_up_line_never_says_an_empty_window():
  """A 3-step run with a window of 20%: the window is the last step's measurement, "steps 3-3"
  (it said "steps 4-3")."""
  from optim.ramp import BatchRamp  # noqa: PLC0415
  from trainer.tracking.report import log_noise_meter  # noqa: PLC0415
  cfg = tiny_config(**{"steps": 3, "optim.noise_scale_every": 1,
                       "optim.noise_scale_window": 0.2})
  lines = []
  writer = type("Writer", (), {"log": lambda self, line: lines.append(line)})()
  log_noise_meter(writer, cfg, BatchRamp.from_config(cfg.data), 8, 1, [8])
  assert len(lines) == 1 and "(at step 3 its steps 3-3" in lines[0], lines

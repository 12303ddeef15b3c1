"""Gradient noise scale (McCandlish et al. 2018): the two-batch estimator, its windowed average on
a problem whose answer is known, the window's memory in training (not in measurements), the
recency weight of |G|^2, the minimum of measurements and the precision gate (which leaves
training as it is), the preconditioned estimator against
per-example gradients and Adam's P, the ring emptied by changed settings, pieces without target
tokens, the train step's wiring of the small and big batches, and the plain (non-measuring) step
of a run with the meter being exactly the step of a run without it. The meter as a run logs it,
against per-sequence gradients at the run's parameters: tests/test_noise_meter.py."""
import functools
import json

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

  def step_fn(state, step):  # 0-based: the step that ends at step + 1
    trace = jnp.where(step == 99, 4.0, 0.0)  # squared norms whose estimates are (1, trace)
    sample = noise_scale.Sample(*(jnp.float32(v) for v in (1 + trace, 1 + trace / 2, 1.0, 2.0)))
    state = tx.update({}, state, noise_sample=sample, step=step)[1]
    out = noise_scale.readout(state)
    return state, (out["trace_sigma"] * out["count"], out["count"])

  run = jax.jit(lambda st: jax.lax.scan(step_fn, st, jnp.arange(1000)))
  state, (traces, counts) = run(tx.init(None))
  seen = {n: (float(traces[n - 1]), float(counts[n - 1])) for n in range(1, 1001)}
  assert seen[130][0] == pytest.approx(4.0) and seen[140][0] == 0.0 and seen[400][0] == 0.0
  for n in (40, 400, 1000):  # the window's measurements: n / 4, and at most one bucket more
    assert window * n <= seen[n][1] <= window * n * (1 + 1 / 8) + 1, (n, seen[n])
  assert float(state.clock) == 1000.0 and float(noise_scale.readout(state)["g_sq"]) == \
      pytest.approx(1.0, rel=1e-5)
  whole = noise_scale.meter(1.0)  # window 1: every measurement so far
  sample = noise_scale.Sample(*(np.float32(v) for v in (5.0, 3.0, 1.0, 2.0)))
  state = jax.jit(lambda st: jax.lax.fori_loop(0, 50, lambda i, s: whole.update(
      {}, s, noise_sample=sample, step=i)[1], st))(whole.init(None))
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


def _exact(g_sq, trace, precond=None):
  """A Sample whose estimates are (g_sq, trace) exactly (b = 1, B = 2); with `precond` (g, t)
  also the preconditioned ones."""
  f = np.float32
  extra = {} if precond is None else dict(sq_norm_small_precond=f(precond[0] + precond[1]),
                                          sq_norm_big_precond=f(precond[0] + precond[1] / 2))
  return noise_scale.Sample(f(g_sq + trace), f(g_sq + trace / 2), f(1.0), f(2.0), **extra)


def test_the_meter_reads_the_present_when_b_simple_rises():
  """|G|^2 falling as 1 / t^2, tr(Sigma) constant: B_simple = (t / 400)^2 rises through the
  window. The ratio of the window's sums (recency 0, the earlier meter) weights the window's
  early steps (at t = 400: 0.75 against 1); weighting |G|^2 by exp(-age / 0.1 t) reads 0.84.
  Neither reads anything before the window holds `min_measurements`."""
  got = {}
  for recency in (0.0, 0.1):
    tx = noise_scale.meter(0.25, recency=recency, min_measurements=8)
    state = tx.init(None)
    update = jax.jit(lambda st, sample, i, tx=tx: tx.update({}, st, noise_sample=sample,
                                                           step=i)[1])
    read = jax.jit(lambda st: noise_scale.readout(st)["b_simple"])
    seen = []
    for step in range(400):
      state = update(state, _exact(1.6e5 / (step + 1) ** 2, 1.0), step)
      if step < 40:
        seen.append(float(read(state)))
    assert np.all(np.isnan(seen[:7])) and np.all(np.isfinite(seen[31:]))
    assert float(noise_scale.readout(state)["count"]) >= 100
    got[recency] = float(read(state))
  assert got[0.0] == pytest.approx(0.75, abs=0.02)
  assert got[0.1] == pytest.approx(0.84, abs=0.02)


def test_too_few_measurements_give_no_value():
  """min_measurements = 8, measuring every 10th step with window 0.25: the window holds 8
  measurements first at step ~320; before, the value is NaN (what the autopilot ignores)."""
  tx = noise_scale.meter(0.25, min_measurements=8)
  state = tx.init(None)
  values = {}
  for step in range(9, 400, 10):
    _, state = tx.update({}, state, noise_sample=_exact(1.0, 5.0), step=step)
    out = noise_scale.readout(state)
    values[step + 1] = (float(out["count"]), float(out["b_simple"]))
  assert all(np.isnan(b) for c, b in values.values() if c < 8)
  assert all(b == pytest.approx(5.0) for c, b in values.values() if c >= 8)
  assert values[400][0] >= 8 and values[100][0] < 8


def test_the_precision_gate_gives_no_value_while_the_window_is_imprecise():
  """|G|^2 estimates 1 +- 4 (alternating: s = 4), tr(Sigma) 5, window 1: the even mean's relative
  standard error is ~4 / sqrt(n), above 0.5 until n ~ 64; before, no value and `why` 3 (then 0,
  the value 5); without the bound (max_rse 0) a value from the minimum of 8 on. A constant
  estimate (s = 0) passes any bound."""
  def values(max_rse, spread=4.0):
    tx = noise_scale.meter(1.0, min_measurements=8, max_rse=max_rse)
    update = jax.jit(lambda st, sample, i: tx.update({}, st, noise_sample=sample, step=i)[1])
    read = jax.jit(noise_scale.readout)
    state, out = tx.init(None), []
    for step in range(100):
      state = update(state, _exact(1.0 + spread * (-1) ** step, 5.0), step)
      r = read(state)
      out.append((float(r["b_simple"]), int(r["why"]), float(r["g_sq_rse"])))
    return out
  gated = values(0.5)
  n_pass = [i + 1 for i, (b, why, _) in enumerate(gated) if why == 0]
  # (an odd n has the mean 1 + 4 / n: the bound is crossed at n = 57-64)
  assert 55 <= n_pass[0] <= 64 and set(range(65, 101)) <= set(n_pass)
  assert all(np.isnan(b) and why in (1, 3) for b, why, _ in gated[:n_pass[0] - 1])
  assert all(why == 3 for _, why, _ in gated[8:n_pass[0] - 1])
  assert gated[-1][0] == pytest.approx(5.0, rel=1e-4)
  assert gated[-1][2] == pytest.approx(4 * np.sqrt(100 / 99) / 10, rel=1e-3)
  assert [i + 1 for i, (_, why, _) in enumerate(values(0.0)) if why == 0][0] == 8
  assert [i + 1 for i, (_, why, _) in enumerate(values(0.01, 0.0)) if why == 0][0] == 8


def test_the_preconditioned_estimator_equals_the_truth_from_per_example_gradients():
  """At fixed parameters, least squares 0.5 (x.w - y)^2 with x ~ N(0, I_d): per-example
  gradients x (x.delta - eps), G = delta, Sigma = (|delta|^2 + s^2) I + delta delta^T. With a
  fixed diagonal P the truth is tr(P Sigma) / G^T P G = ((|delta|^2 + s^2) tr P + delta^T P
  delta) / delta^T P delta. The meter, fed the squared norms of sqrt(P) times the micro-batch
  and batch gradients, reads it (and the plain B_simple beside it) over 1500 draws."""
  d, s, num_micro, micro = 16, 0.5, 4, 64
  rng = np.random.default_rng(3)
  p = np.exp(np.linspace(-2, 2, d))  # far from a multiple of I; G mostly where P is small
  delta = rng.standard_normal(d) * np.exp(-np.linspace(0, 3, d))
  delta /= np.linalg.norm(delta)
  want = ((1 + s * s) * p.sum() + delta @ (p * delta)) / (delta @ (p * delta))
  want_plain = (d * (1 + s * s) + 1) / 1.0
  tx = noise_scale.meter(1.0, second_moments=(0.99, 1e-8, 0.0))
  state = tx.init(None)
  update = jax.jit(lambda st, sample, i: tx.update({}, st, noise_sample=sample, step=i)[1])
  for i in range(1500):
    x = rng.standard_normal((num_micro, micro, d))
    g = x * (x @ delta - s * rng.standard_normal((num_micro, micro)))[..., None]
    small, big = g.mean(axis=1), g.mean(axis=(0, 1))
    sample = noise_scale.Sample(
        np.mean(np.sum(small ** 2, -1)), np.sum(big ** 2), float(micro),
        float(num_micro * micro), np.mean(np.sum(p * small ** 2, -1)), np.sum(p * big ** 2))
    state = update(state, sample, i)
  out = noise_scale.readout(state)
  assert want > 2 * want_plain  # P changes the answer here
  assert float(out["b_simple_precond"]) == pytest.approx(want, rel=0.1)
  assert float(out["b_simple"]) == pytest.approx(want_plain, rel=0.1)
  assert float(out["count_precond"]) == 1500


def test_the_preconditioned_estimator_is_exact_in_expectation():
  """E |sqrt(P) G_b|^2 = G^T P G + tr(P Sigma) / b, so the two-batch estimator on the expected
  preconditioned norms returns G^T P G and tr(P Sigma) exactly, as for P = I."""
  g_p, trace_p = 0.7, 90.0
  sq = lambda b: g_p + trace_p / b
  tx = noise_scale.meter(1.0, second_moments=(0.99, 1e-8, 0.0))
  _, state = tx.update({}, tx.init(None), noise_sample=noise_scale.Sample(
      *(np.float32(v) for v in (3.0, 2.0, 8.0, 64.0, sq(8.0), sq(64.0)))), step=0)
  out = noise_scale.readout(state)
  assert float(out["g_sq_precond"]) == pytest.approx(g_p, rel=1e-5)
  assert float(out["trace_precond"]) == pytest.approx(trace_p, rel=1e-5)


def test_the_preconditioner_is_adams_as_its_update_uses_it():
  """P = 1 / (sqrt(v_hat) + eps) with v_hat = (b2 nu + (1 - b2) g^2) / (1 - b2^(count + 1)):
  the denominator of this step's Adam update, from the state before it and the step's gradient
  clipped as the optimizer clips it; inside the factory's chain for adamw and lamb, none for an
  optimizer without second moments."""
  params = {"w": jnp.asarray([1.0, -2.0, 3.0])}
  names = {"w": ("embed",)}
  grads = {"w": jnp.asarray([0.1, 0.2, -0.3])}
  big = {"w": jnp.asarray([3.0, 0.0, -4.0])}  # norm 5: clipped to 1 before Adam sees it
  for name, precond in (("adamw", True), ("lamb", True), ("sgd", False)):
    cfg = tiny_config(**{"optim.name": name, "optim.noise_scale_every": 1,
                         "optim.clip_norm": 1.0})
    tx, _ = build_optimizer(cfg.optim, names, 10, cfg.data)
    state = tx.init(params)
    for i in range(2):
      _, state = tx.update(grads, state, params, step=i)
    p = noise_scale.preconditioner(state, big)
    assert (p is not None) == precond, name
    if not precond:
      continue
    b2 = float(noise_scale.find_state(state).second_moments[0])
    nu = b2 * (1 - b2) * (1 + b2) * np.square(grads["w"]) + (1 - b2) * np.square(big["w"] / 5)
    want = 1 / (np.sqrt(nu / (1 - b2 ** 3)) + float(cfg.optim.eps))
    np.testing.assert_allclose(p["w"], want, rtol=1e-4)
    # the update this step makes divides by exactly that (first moment / (sqrt(v_hat) + eps))
    adam = [x for x in jax.tree.leaves(state, is_leaf=lambda x: isinstance(
        x, optax.ScaleByAdamState)) if isinstance(x, optax.ScaleByAdamState)][0]
    _, after = tx.update(big, state, params, step=2)
    nu_after = [x for x in jax.tree.leaves(after, is_leaf=lambda x: isinstance(
        x, optax.ScaleByAdamState)) if isinstance(x, optax.ScaleByAdamState)][0].nu["w"]
    np.testing.assert_allclose(nu_after, b2 * adam.nu["w"] + (1 - b2) * np.square(
        big["w"] / 5), rtol=1e-4)


def test_a_changed_window_or_clock_empties_the_ring():
  """A state written with another window (a resume with optim.noise_scale_window changed), or
  whose last measurement the clock now places elsewhere (data.batch_ramp changed), holds sums
  of another window: the next measurement starts it again; the same settings keep it."""
  old = noise_scale.meter(0.25)
  state = old.init(None)
  for step in range(100):
    _, state = old.update({}, state, noise_sample=_exact(1.0, 4.0), step=step)
  assert float(noise_scale.readout(state)["count"]) >= 25
  same = noise_scale.meter(0.25).update({}, state, noise_sample=_exact(1.0, 4.0), step=100)[1]
  assert float(noise_scale.readout(same)["count"]) >= 26
  for changed in (noise_scale.meter(0.5), noise_scale.meter(0.25, recency=0.2),
                  noise_scale.meter(0.25, clock=lambda step: 2 * (step + 1))):
    _, new = changed.update({}, state, noise_sample=_exact(1.0, 4.0), step=100)
    assert float(noise_scale.readout(new)["count"]) == 1


def test_a_piece_without_target_tokens_is_no_small_batch(step_setup):
  """Micro-batches of which one has no target tokens: its |g|^2 = 0 would read tr(Sigma) as
  about -|G|^2. The step's sums hold the other pieces only (their number, their 1 / t), and a
  step left with one piece measures nothing."""
  _, batch, mesh, spec = step_setup
  zero = noise_scale.piece_sums({"w": jnp.ones(3)}, jnp.zeros(()), True)
  assert all(float(x) == 0 for x in zero[:3]) and np.all(zero[3]["w"] == 0)
  micro = {k: v.reshape(4, 2, *v.shape[2:]) for k, v in batch.items()}  # [4, 2, S]
  mask = np.array(micro["loss_mask"])
  mask[2] = 0
  empty = dict(micro, loss_mask=mask)
  sums = jax.jit(lambda p, b: grad_sums(spec, p, b, measure_noise=True)[3])
  params = init_state(spec, build_optimizer(
      tiny_config().optim, spec.logical_names, 10, tiny_config().data)[0]).params
  with jax.set_mesh(mesh):
    full = [float(x) for x in sums(params, micro)]
    part = [float(x) for x in sums(params, empty)]
    three = [float(x) for x in sums(params, {k: v[np.array([0, 1, 3])]
                                              for k, v in micro.items()})]
  assert full[2] == 4 and part[2] == 3
  np.testing.assert_allclose(part, three, rtol=1e-5)
  tx = noise_scale.meter(1.0)
  lone = noise_scale.Sample(np.float32(2.0), np.float32(2.0), np.float32(np.nan),
                            np.float32(100.0))  # one piece: b_small = 1 / 0 -> NaN
  _, state = tx.update({}, tx.init(None), noise_sample=lone, step=0)
  assert float(noise_scale.readout(state)["count"]) == 0


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
  noise_cfg = tiny_config(**{"mesh.data": 2, "optim.noise_scale_every": 1,
                             "optim.noise_scale_min_measurements": 1,
                             "optim.noise_scale_max_rse": 0})
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
  # preconditioned (adamw): P of this step's update, from the state before it and G_B
  big_grads = jax.tree.map(lambda a, b: (a + b) / total, *sums)
  p = noise_scale.preconditioner(state.opt_state, big_grads)
  weighted = lambda tree: float(noise_scale.weighted_sq_norm(tree, p))
  small_p = np.mean([weighted(g) / t ** 2 for g, t in zip(sums, tokens)])
  g_p, trace_p = noise_scale.estimate(small_p, weighted(big_grads), harmonic, total)
  assert abs(trace_p / g_p / (trace / g_sq) - 1) > 0.05  # P is not a multiple of I here
  assert metrics["noise_g_sq_precond_step"] == pytest.approx(g_p, rel=1e-3)
  assert metrics["noise_trace_precond_step"] == pytest.approx(trace_p, rel=1e-3)
  assert np.isnan(metrics["noise_scale_precond"]) == (g_p <= 0)  # one measurement: as noisy


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


@functools.cache
def _memory_runs(steps=400, seeds=16):
  """The default meter (window 0.35, recency 0.05) over `steps` measurements of a stationary
  |G|^2 = 1 whose per-step estimates carry a relative standard deviation of 0, 3 or 8
  (tr(Sigma) = 5 exactly; B_simple = 5), `seeds` runs each, in one compiled program: (final
  states, readouts with the meter's own memory, readouts with `memory=0.05`, the recency
  alone), leaves [spreads, seeds, ...]."""
  tx = noise_scale.meter(0.35, recency=0.05, min_measurements=8)

  def one(spread, key):
    def step(state, x):
      _, state = tx.update({}, state, noise_sample=noise_scale.Sample(
          x[0] + 5.0, x[0] + 2.5, jnp.float32(1), jnp.float32(2)), step=x[1])
      return state, (noise_scale.readout(state), noise_scale.readout(state, memory=0.05))
    state, (own, fixed) = jax.lax.scan(step, tx.init(None), (
        1.0 + spread * jax.random.normal(key, (steps,)), jnp.arange(steps)))
    return state, own, fixed
  keys = jax.vmap(jax.random.key)(jnp.arange(seeds))
  return jax.jit(jax.vmap(lambda s: jax.vmap(lambda k: one(s, k))(keys)))(
      jnp.asarray([0.0, 3.0, 8.0]))


def test_the_memory_lengthens_where_one_steps_estimate_is_noisy():
  """|G|^2's memory is the shortest of recency x 2^k, then the window's even mean, whose mean is
  pinned down to MEMORY_RSE: exact estimates keep the recency (0.05); estimates with a relative
  standard deviation of 3 take a longer one (at step 400 the recency's mean, ~40 measurements,
  would have a relative standard error of ~0.5), of 8 the whole window evenly (144
  measurements: still ~0.67); `memory_error` is that predicted error, for the window's even
  mean the spread within its buckets over sqrt(n) and over the mean; `memory=` forces one."""
  states, own, _ = _memory_runs()
  np.testing.assert_allclose(own["memory"][0, 0, 20:], 0.05)
  assert 0.05 < float(own["memory"][1, 0, -1]) <= 0.4
  assert float(own["memory_error"][1, 0, -1]) <= noise_scale.MEMORY_RSE
  assert float(own["memory"][2, 0, -1]) == 0.0 and float(own["count"][2, 0, -1]) == 144
  state = jax.tree.map(lambda x: x[2, 0], states)
  even = noise_scale.readout(state, memory=0.0)  # a forced memory: the even mean's weights
  inside = (state.bucket >= state.first) & (state.bucket >= 0)
  mean = float(jnp.sum(jnp.where(inside, state.g_sq, 0)) / 144)
  assert float(even["g_sq"]) == pytest.approx(mean, rel=1e-5)
  assert float(own["memory_error"][2, 0, -1]) == pytest.approx(8 / 12 / mean, rel=0.2)


def test_a_longer_memory_reads_noisy_estimates_closer_to_the_truth():
  """Over 16 runs of estimates with a relative standard deviation of 3 (B_simple = 5), the
  chosen memory's readings at steps 200-400 stay within [0.6, 1.8] x 5 (10th-90th percentile:
  0.70-1.70); the recency's alone (`memory=0.05`, the meter before the choice) strays beyond
  2.5x (0.62-2.81)."""
  _, own, fixed = _memory_runs()
  for readout, (lo, hi) in ((own, (0.6, 1.8)), (fixed, (0.0, np.inf))):
    got = np.nanpercentile(np.asarray(readout["b_simple"][1, :, 200:]) / 5, [10, 90])
    assert lo < got[0] and got[1] < hi, got
  assert got[1] > 2.5, got


def test_the_precision_gate_leaves_training_as_it_is(step_setup):
  """The bound only hides the meter's value: three measuring steps with every value gated
  (max_rse 1e-9) and with no bound give the same losses, gradient norms, parameters and meter
  sums bit for bit; the gated rows say why (`noise_scale_why` 3, or 2 / 1 where the value would
  be missing anyway)."""
  _, batch, mesh, _ = step_setup
  def run(max_rse):
    cfg = tiny_config(**{"mesh.data": 2, "optim.noise_scale_every": 1,
                         "optim.noise_scale_min_measurements": 1,
                         "optim.noise_scale_max_rse": max_rse})
    program = Program(cfg, mesh)
    step, state, out = program.compile(measure_noise=True), None, []
    state = init_state(program.spec, program.tx)
    with jax.set_mesh(mesh):
      for _ in range(3):
        state, metrics = step(state, {k: jax.device_put(v, program.batch_sharding)
                                      for k, v in batch.items()})
        out.append(jax.device_get(metrics))
    return out, jax.device_get(state)
  gated, gated_state = run(1e-9)
  free, free_state = run(0.0)
  for a, b in zip(gated, free):
    assert a["loss"] == b["loss"] and a["grad_norm"] == b["grad_norm"]
    assert a["noise_g_sq"] == b["noise_g_sq"] and a["noise_g_sq_rse"] == b["noise_g_sq_rse"]
    assert np.isnan(a["noise_scale"]) and a["noise_scale_why"] in (1, 2, 3)
  assert gated[-1]["noise_scale_why"] == 3 and free[-1]["noise_scale_why"] in (0, 2)
  jax.tree.map(np.testing.assert_array_equal, gated_state.params, free_state.params)
  g_meter, f_meter = (noise_scale.find_state(s.opt_state) for s in (gated_state, free_state))
  jax.tree.map(np.testing.assert_array_equal, g_meter._replace(settings=0),
               f_meter._replace(settings=0))


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
    ({"optim.noise_scale_max_rse": -0.1}, "optim.noise_scale_max_rse=-0.1: must be >= 0"),
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
                       "optim.noise_scale_every": 2, "optim.noise_scale_pieces": 4,
                       "optim.noise_scale_min_measurements": 1})
  Run(cfg, str(tmp_path)).train()
  rows = metric_rows(tmp_path)
  assert [s for s in rows if "noise_pieces" in rows[s]] == [2, 4, 6, 8]
  assert {rows[s]["noise_pieces"] for s in (2, 4, 6, 8)} == {4}
  # no measurement at step 5 (NaN while the window's one or two estimates are too few for
  # the precision bound: a row says why)
  np.testing.assert_equal(rows[5]["noise_scale"], rows[4]["noise_scale"])
  assert rows[5]["noise_scale_why"] == rows[4]["noise_scale_why"]
  assert "noise_pieces" not in rows[5] and rows[4]["noise_measurements"] >= 1
  # the memory each value was read with: the recency x 1..16, or 0 (the window's even mean)
  assert all(min(abs(r["noise_memory"] - m) for m in (0, .05, .1, .2, .4, .8)) < 1e-6
             for r in rows.values()), [r["noise_memory"] for r in rows.values()]
  out = capsys.readouterr().out
  assert ("gradient noise scale: measured every 2 steps on small batches (4 at batch 32), "
          "averaged over the last 35% of the tokens trained so far, |G|^2 weighted by "
          "exp(-age / m of them), m the shortest of 0.05 x 1, 2, 4, 8, 16 (then even) whose "
          "mean's predicted relative error is <= 0.4 (logged as noise_memory) "
          "(at step 8 its steps 7-8); a value once the window holds 1 "
          "measurements and its |G|^2 has a relative standard error <= 1; also "
          "preconditioned by Adam's second moments (noise_scale_precond)"
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


@pytest.mark.parametrize("name", ["sgd", "lars"])
def test_a_metered_run_without_adam_moments_checkpoints_and_resumes(tmp_path, name):
  """The meter's state of an optimizer without Adam moments (no P) is saved and restored: its
  "no P" marker was a zero-size array, which orbax refuses, so the run's last checkpoint failed
  and the run ended in a storage error. The resumed run continues the meter's count."""
  from conftest import metric_rows  # noqa: PLC0415
  from trainer.run.loop import Run  # noqa: PLC0415
  over = {"optim.name": name, "steps": 3, "log_every": 1, "data.global_batch_size": 32,
          "optim.noise_scale_every": 1, "optim.noise_scale_window": 1.0,
          "optim.noise_scale_min_measurements": 1}
  first = Run(tiny_config(**over), str(tmp_path)).train()
  assert (first.status, first.message) == ("done", ""), first
  Run(tiny_config(**{**over, "steps": 5}), str(tmp_path)).train()
  rows = metric_rows(tmp_path)
  logged = [json.loads(line)["step"] for line in open(tmp_path / "metrics.jsonl")]
  assert logged.count(1) == 1, logged  # resumed at step 4, not started again
  assert [rows[s]["noise_measurements"] for s in (3, 4, 5)] == [3, 4, 5], rows

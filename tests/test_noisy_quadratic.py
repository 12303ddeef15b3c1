"""The noisy quadratic model (experiments/nqm.py): its closed forms against stochastic runs of
the stack's own optimizer and meter, the exact S(B), and the experiment end to end (slow)."""
import json
import math

import jax
import numpy as np
import pytest

from experiments import nqm, nqm_meter
from trainer.config.defaults import default_config


@pytest.fixture(scope="module")
def problem():
  return nqm.Problem.power_law(dim=50, power=1.0)


def test_closed_form_expected_loss_matches_256_runs(problem):
  """SGD, heavy-ball momentum and a fixed preconditioner (plain SGD on the problem in the
  coordinates theta / sqrt(p), `Problem.preconditioned`): the mean loss of 256 runs through
  optim.factory is the closed form's within 3 standard errors at every checked step."""
  base, p, batch, steps = default_config(), problem.h ** -0.5, 8, 60
  arms = [("sgd", 0.5, 0.0, None), ("momentum", 0.1, 0.9, None), ("preconditioned", 0.3, 0.0, p)]
  jobs = [(nqm.run_config(base, "sgd", rate, batch, momentum=mu), steps, 256, 3)
          for _, rate, mu, _ in arms]
  runs = [r["loss"] for r, _ in nqm.run_many(problem, jobs[:2])]  # one program for both
  runs.append(nqm.run_many(problem.preconditioned(p), jobs[2:])[0][0]["loss"])
  for (name, rate, mu, pre), loss in zip(arms, runs):
    expected = nqm.curves(problem, [rate], [batch], steps, mu, precond=pre)["loss"][1:, 0]
    mean, se = loss.mean(1), loss.std(1, ddof=1) / math.sqrt(loss.shape[1])
    for t in (0, 4, 19, 59):  # after steps 1, 5, 20, 60
      assert abs(mean[t] - expected[t]) < 3 * se[t], (name, t + 1, mean[t], expected[t], se[t])
    assert expected[-1] < 0.5 * expected[0], name  # the checked stretch is not a plateau


def test_step_moments_is_the_covariance_of_the_linear_step():
  """The recursion against the 2x2 form M' = A M A^T + s s^T c / B, A = [[1 - a h, -a mu],
  [h, mu]], s = (-a, 1) (the state (theta, v) of v' = mu v + g, theta' = theta - a v')."""
  rng = np.random.default_rng(0)
  h, c, a, mu, b = 0.7, 0.3, 0.4, 0.9, 16.0
  x = rng.normal(size=(2, 2))
  m = x @ x.T
  got = nqm.step_moments(h, c, (m[0, 0], m[0, 1], m[1, 1]), a, b, mu)
  big_a, s = np.array([[1 - a * h, -a * mu], [h, mu]]), np.array([[-a], [1.0]])
  want = big_a @ m @ big_a.T + s @ s.T * c / b
  np.testing.assert_allclose(got, (want[0, 0], want[0, 1], want[1, 1]), rtol=1e-12)


def test_optimal_rate_is_interior_and_steps_fall_with_batch(problem):
  """S(B) = min over rates of the expected steps: the best rate lies strictly inside the
  stable range at every batch, S(B) never rises with B, and S(B) >= S_min, B S(B) >= E_min
  (the closed-form limits)."""
  target, batches = 0.1, [4, 16, 64, 256]
  s = nqm.tradeoff(problem, batches, target)
  top = nqm.stable_rate(problem)
  for b, rate, steps in s:
    assert 1e-3 * top < rate < 0.99 * top, (b, rate)
    assert math.isfinite(steps)
    around = nqm.curves(problem, [rate / 1.1, rate, min(rate * 1.1, top * 0.999)], [b] * 3,
                        int(steps * 2) + 10)["loss"]
    below, at, above = nqm.steps_to(around, target)
    assert below > at and above > at, (b, rate, below, at, above)  # a minimum, both sides
  steps = [x for _, _, x in s]
  assert all(later <= earlier * (1 + 1e-6) for earlier, later in zip(steps, steps[1:])), steps
  assert steps[0] > 2 * steps[-1]  # the range covers the bend
  s_min, e_min = nqm.limits(problem, target)
  assert all(x >= s_min * (1 - 1e-3) and b * x >= e_min * (1 - 1e-3) for b, _, x in s)


def test_meter_at_fixed_parameters_reads_the_truth(problem):
  """At a rate of ~0 (theta fixed; 0 itself is the optimizer's default rate) the meter's window
  holds 400 measurements of one state: its B_simple is tr(C) / |G|^2 there; for adamw with
  b2 = 0.999 (P nearly fixed) noise_scale_precond is tr(P C) / G^T P G with the optimizer's P
  (at b2 = 0.95 it reads ~13% high: P moves with the step's own gradient)."""
  theta = nqm.Problem(problem.h, problem.c, np.full(problem.dim, 0.25))
  truth = problem.c.sum() / np.sum((problem.h * 0.25) ** 2)  # ~45, near the batch
  adam = nqm.run_config(default_config(), "adamw", 1e-12, 64)
  adam.optim.b2 = 0.999
  rows = [r for r, _ in nqm.run_many(theta, [
      (nqm.run_config(default_config(), "sgd", 1e-12, 64), 1600, 8, 0), (adam, 1600, 8, 1)])]
  for r in rows:  # the median over 8 runs of the last reading
    np.testing.assert_allclose(np.median(r["noise_scale"][-1]), truth, rtol=0.1)
  if "noise_scale_precond" not in rows[1]:
    pytest.skip("optim/noise_scale.py has no preconditioned estimate")
  np.testing.assert_allclose(np.median(rows[1]["noise_scale_precond"][-1]),
                             np.median(rows[1]["b_precond_true"][-400:]), rtol=0.05)


def test_noise_free_meter_is_the_meter_fed_exact_values(problem):
  """`nqm_meter.noise_free`, rebuilt after the run from its |G(theta)|^2 at each step's iterate,
  is what the run's own meter reads on the same trajectory when each step's squared norms are
  their expectations (`make_step(exact_meter=True)`: its estimates exact); replaying the samples
  the meter was fed gives the logged reading; estimator x trajectory = logged / analytic."""
  cfg, batch, steps = nqm.run_config(default_config(), "sgd", 0.5, 16), 16, 120
  tx, _ = nqm.build(cfg, steps)
  plain, exact = (nqm.make_step(problem, tx, batch, exact_meter=e) for e in (False, True))
  keys = jax.random.split(jax.random.key(5), 2 * steps).reshape(2, steps)
  scan = lambda step: jax.vmap(lambda k: jax.lax.scan(step, nqm.init_state(problem, tx), k)[1],
                               out_axes=1)(keys)
  rows, fed = (jax.tree.map(lambda x: np.asarray(x, np.float64), r)
               for r in jax.jit(lambda: (scan(plain), scan(exact)))())
  np.testing.assert_allclose(fed["loss"], rows["loss"], rtol=1e-5)  # the same trajectory
  expected = nqm.curves(problem, [0.5], [batch], steps)["b_simple"][:, 0]
  split = nqm_meter.parts(problem, cfg, rows, expected, steps)
  free = split["noise_free"]
  assert np.isfinite(free[-60:]).all() and not np.isfinite(free[:7]).any()  # 8 measurements
  np.testing.assert_allclose(free, fed["noise_scale"], rtol=1e-4)
  replayed = nqm_meter.replay(problem, cfg, rows["meter_sq_small"], rows["meter_sq_big"])
  np.testing.assert_allclose(replayed["b_simple"], rows["noise_scale"], rtol=1e-6)
  ok = np.isfinite(split["total"])
  np.testing.assert_allclose((split["estimator"] * split["trajectory"])[ok], split["total"][ok],
                             rtol=1e-9)
  assert np.nanmax(np.abs(split["lag"] - 1)) < 0.5 and np.nanstd(np.log(split["estimator"])) > 0.05


@pytest.mark.slow
def test_experiment_quick_writes_its_numbers(tmp_path):
  from experiments import noisy_quadratic
  out = tmp_path / "nqm"
  assert noisy_quadratic.main(["--quick", "--out", str(out), "--json",
                               str(tmp_path / "n.json")]) == 0
  numbers = json.loads((tmp_path / "n.json").read_text())
  for key in ("b_crit_analytic", "b_crit_fitted", "b_crit_fitted_lo", "b_crit_fitted_hi",
              "meter_ratio_median", "meter_ratio_p10", "meter_ratio_p90",
              "autopilot_ratio_median", "probe_ratio_median"):
    assert isinstance(numbers[key], float) and math.isfinite(numbers[key]), key
  assert numbers["b_crit_fitted_lo"] <= numbers["b_crit_fitted"] <= numbers["b_crit_fitted_hi"]
  assert 0.5 < numbers["b_crit_fitted"] / numbers["b_crit_analytic"] < 2
  assert (tmp_path / "nqm.csv").exists()
  for key in ("meter_estimator_ratio", "meter_trajectory_ratio", "meter_lag_ratio"):
    assert math.isfinite(numbers[key]["median"]), key
    assert set(numbers[key + "_per_batch"]) == {"8", "64", "512"}, key


def test_experiment_refuses_a_bad_flag(capsys):
  from experiments import noisy_quadratic
  assert noisy_quadratic.main(["--seeds", "1"]) == 2
  assert "--seeds" in capsys.readouterr().err

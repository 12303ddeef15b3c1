"""The meter's reading on the NQM taken apart: the estimator's own error and the run's swings.

The meter (optim/noise_scale.py) reads tr(C) / |G|^2 as a weighted ratio of window sums of
per-step estimates. A noise-free meter, the same transformation with the same window, weights,
minimum and clock, fed at every step the exact tr(C) and |G(theta)|^2 at the iterate the step's
gradient was taken at (`exact_sample`), reads what the meter would read on that run's own
trajectory if its estimates carried no sampling noise (`replay`). So, per reading,

  logged / analytic = logged / noise-free (the estimator's error) x noise-free / analytic (the
  run's swings as the window smooths them, and its lag)

`replay` runs the meter `nqm.build` builds (optim.factory) over a run's recorded samples: fed
the run's samples it reproduces the logged values, fed `exact_sample` it is the noise-free meter
(JSON `meter_estimator_ratio`: logged / noise-free; `meter_trajectory_ratio`: noise-free /
analytic; `meter_lag_ratio`: noise-free on the expected trajectory / analytic).
"""
from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np

from experiments import nqm
from optim import noise_scale


def exact_sample(g_sq, trace, b_small, b_big):
  """(sq_norm_small, sq_norm_big): the squared norms whose estimates (`noise_scale.estimate`)
  are exactly |G|^2 = `g_sq` and tr(C) = `trace`: their expectations |G|^2 + tr(C) / b at the
  two sizes."""
  g_sq = np.asarray(g_sq, np.float64)
  return g_sq + trace / b_small, g_sq + trace / b_big


def replay(problem: nqm.Problem, cfg, sq_small, sq_big) -> dict[str, np.ndarray]:
  """The meter of `cfg` (built by `nqm.build` as `nqm.run_many` builds it: its window, recency,
  minimum and clock at cfg's batch) fed the samples `sq_small`, `sq_big` [steps, seeds] step by
  step (the small batches' size as `nqm.make_step` has it); its readout after every step, each
  [steps, seeds] (b_simple, g_sq, trace_sigma, count)."""
  batch = int(cfg.data.global_batch_size)
  steps = int(np.shape(sq_small)[0])
  tx, _ = nqm.build(cfg, steps)
  small = jnp.float32(batch / nqm.pieces_of(batch))
  params = {"theta": jnp.zeros((problem.dim,), jnp.float32)}
  keys = ("b_simple", "g_sq", "trace_sigma", "count")

  def one_run(s_small, s_big):
    def step(carry, x):
      opt_state, count = carry
      sample = noise_scale.Sample(sq_norm_small=x[0], sq_norm_big=x[1], b_small=small,
                                  b_big=jnp.float32(batch))
      _, opt_state = tx.update(params, opt_state, params, batch_size=batch, step=count,
                               noise_sample=sample)
      out = noise_scale.readout(noise_scale.find_state(opt_state))
      return (opt_state, count + 1), tuple(out[k] for k in keys)
    _, out = jax.lax.scan(step, (tx.init(params), jnp.zeros((), jnp.int32)), (s_small, s_big))
    return out

  out = jax.jit(jax.vmap(one_run, in_axes=1, out_axes=1))(
      jnp.asarray(sq_small, jnp.float32), jnp.asarray(sq_big, jnp.float32))
  return {k: np.asarray(v, np.float64) for k, v in zip(keys, out)}


def noise_free(problem: nqm.Problem, cfg, rows: dict) -> np.ndarray:
  """The noise-free meter's B_simple [steps, seeds] along the runs of `rows` (`nqm.run`'s rows:
  g_sq_true at each step's iterate before its update): `replay` of `exact_sample`."""
  batch = int(cfg.data.global_batch_size)
  small = batch / nqm.pieces_of(batch)
  return replay(problem, cfg, *exact_sample(rows["g_sq_true"], float(problem.c.sum()), small,
                                            batch))["b_simple"]


def parts(problem: nqm.Problem, cfg, rows: dict, expected, n: int) -> dict[str, np.ndarray]:
  """Over the first `n` steps of the runs `rows` (cfg's), with the analytic B_simple at the
  expected state `expected` [n + 1] (from step 0): the ratios per reading, [n, seeds] each, NaN
  where a meter has no value: `estimator` (logged / noise-free), `trajectory` (noise-free /
  analytic), `total` (logged / analytic: their product); `lag` [n, 1] (the noise-free meter on
  the expected trajectory / analytic: what the window alone does to a trend);
  `g_sq_not_positive` (the noise-free meter has a value and the logged one none: the window's
  |G|^2 estimate was not positive, or too imprecise for `optim.noise_scale_max_rse`)."""
  batch = int(cfg.data.global_batch_size)
  small, trace = batch / nqm.pieces_of(batch), float(problem.c.sum())
  expected = np.asarray(expected, np.float64).reshape(-1, 1)
  logged = rows["noise_scale"][:n]
  # the runs' |G|^2 and the expected state's side by side: one replay
  g_sq = np.concatenate([rows["g_sq_true"][:n], trace / expected[:n]], axis=1)
  both = replay(problem, cfg, *exact_sample(g_sq, trace, small, batch))["b_simple"]
  free, on_mean, analytic = both[:, :-1], both[:, -1:], expected[1:n + 1]
  return {"estimator": logged / free, "trajectory": free / analytic, "total": logged / analytic,
          "lag": on_mean / analytic, "noise_free": free,
          "g_sq_not_positive": np.isfinite(free) & ~np.isfinite(logged)}

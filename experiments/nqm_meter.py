"""The meter's reading on the NQM taken apart: the estimator's own error and the run's swings.

A noise-free meter, the meter (optim/noise_scale.py) with the same window, weights, minimum and
clock, fed at every step the exact tr(C) and |G(theta)|^2 at the iterate the step's gradient was
taken at (`exact_sample`), reads what the meter would on that run's own trajectory without
sampling noise (`replay`). So, per reading, logged / analytic = logged / noise-free (the
estimator's error) x noise-free / analytic (the run's swings as the window smooths them, and its
lag). `replay` runs the meter `nqm.build` builds (optim.factory) over a run's recorded samples
(JSON `meter_estimator_ratio`, `meter_trajectory_ratio`, `meter_lag_ratio`; `meter_sampling_
ratio`: logged / the run's |G|^2 read with the memory the meter chose). `python -m
experiments.nqm_meter [--lm RUN:BATCH ...]`: the meter designs of docs/noisy_quadratic.md#the-
memory replayed on the NQM's runs, or on LM runs against their per-sequence truth.
"""
from __future__ import annotations

import argparse
import csv
import json
import os

import jax
import jax.numpy as jnp
import numpy as np

from configs import sweep_tiny
from experiments import nqm
from optim import noise_scale
from tools.noise_check import check_run, checkpoints
from trainer.tracking.record import read_rows

PARTS = ("estimator", "trajectory", "lag", "sampling")  # `parts`' ratios the experiment reports


def exact_sample(g_sq, trace, b_small, b_big):
  """(sq_norm_small, sq_norm_big): the squared norms whose estimates (`noise_scale.estimate`)
  are exactly |G|^2 = `g_sq` and tr(C) = `trace`: their expectations |G|^2 + tr(C) / b at the
  two sizes."""
  g_sq = np.asarray(g_sq, np.float64)
  return g_sq + trace / b_small, g_sq + trace / b_big


def replay(problem: nqm.Problem, cfg, sq_small, sq_big, memory=None,
           memory_rse: float = noise_scale.MEMORY_RSE) -> dict[str, np.ndarray]:
  """The meter of `cfg` (built by `nqm.build` as `nqm.run_many` builds it: its window, recency,
  minimum and clock at cfg's batch) fed the samples `sq_small`, `sq_big` [steps, seeds] step by
  step (the small batches' size as `nqm.make_step` has it); its readout after every step, each
  [steps, seeds] (b_simple, g_sq, trace_sigma, count, memory: the recency |G|^2 was read with);
  `memory` [steps, seeds]: read with those recencies instead of the meter's own choice, which
  `memory_rse` sets (`noise_scale.readout`)."""
  batch = int(cfg.data.global_batch_size)
  steps = int(np.shape(sq_small)[0])
  tx, _ = nqm.build(cfg, steps)
  small = jnp.float32(batch / nqm.pieces_of(batch))
  params = {"theta": jnp.zeros((problem.dim,), jnp.float32)}
  keys = ("b_simple", "g_sq", "trace_sigma", "count", "memory")
  forced = memory is not None

  def one_run(s_small, s_big, mem):
    def step(carry, x):
      opt_state, count = carry
      sample = noise_scale.Sample(sq_norm_small=x[0], sq_norm_big=x[1], b_small=small,
                                  b_big=jnp.float32(batch))
      _, opt_state = tx.update(params, opt_state, params, batch_size=batch, step=count,
                               noise_sample=sample)
      out = noise_scale.readout(noise_scale.find_state(opt_state), memory_rse=memory_rse,
                                memory=x[2] if forced else None)
      return (opt_state, count + 1), tuple(out[k] for k in keys)
    _, out = jax.lax.scan(step, (tx.init(params), jnp.zeros((), jnp.int32)),
                          (s_small, s_big, mem))
    return out

  as32 = lambda x: jnp.asarray(x, jnp.float32)
  out = jax.jit(jax.vmap(one_run, in_axes=1, out_axes=1))(
      as32(sq_small), as32(sq_big), as32(memory if forced else np.zeros(np.shape(sq_small))))
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
  analytic), `total` (logged / analytic: their product); `sampling` (logged / the run's own
  |G(theta)|^2 read with the memory the logged meter chose: its sampling error alone, where
  `estimator` also holds the smoothing of a longer memory than the noise-free meter's); `lag`
  [n, 1] (the noise-free meter on the expected trajectory / analytic: what the window alone
  does to a trend); `g_sq_not_positive` (the noise-free meter has a value and the logged one
  none: the window's |G|^2 estimate was not positive, or too imprecise for
  `optim.noise_scale_max_rse`)."""
  batch = int(cfg.data.global_batch_size)
  small, trace = batch / nqm.pieces_of(batch), float(problem.c.sum())
  expected = np.asarray(expected, np.float64).reshape(-1, 1)
  logged = rows["noise_scale"][:n]
  # the runs' |G|^2 and the expected state's side by side: one replay
  g_sq = np.concatenate([rows["g_sq_true"][:n], trace / expected[:n]], axis=1)
  both = replay(problem, cfg, *exact_sample(g_sq, trace, small, batch))["b_simple"]
  free, on_mean, analytic = both[:, :-1], both[:, -1:], expected[1:n + 1]
  same = np.full_like(logged, np.nan)
  if "noise_memory" in rows:  # a meter that chooses its memory (optim/noise_scale.py)
    same = replay(problem, cfg, *exact_sample(rows["g_sq_true"][:n], trace, small, batch),
                  memory=rows["noise_memory"][:n])["b_simple"]
  return {"estimator": logged / free, "trajectory": free / analytic, "total": logged / analytic,
          "sampling": logged / same, "lag": on_mean / analytic, "noise_free": free,
          "g_sq_not_positive": np.isfinite(free) & ~np.isfinite(logged)}


# ------------------------------------------------------------------------------------------------
# Meter designs compared (docs/noisy_quadratic.md#the-memory): python -m experiments.nqm_meter

INF = float("inf")
DESIGNS = (  # (name, window, recency, memory_rse (inf: the recency always), max_rse (0: none))
    ("before: recency 0.05, gate 0.5", 0.25, 0.05, INF, 0.5), ("recency 0.05", 0.25, 0.05, INF, 0),
    ("even", 0.25, 0.0, INF, 0), ("window 0.35, recency 0.05, gate 1", 0.35, 0.05, INF, 1.0),
    ("window 0.5, even", 0.5, 0.0, INF, 0), ("memory 0.4, gate 1", 0.25, 0.05, 0.4, 1.0),
    ("window 0.35, memory 0.3, gate 1", 0.35, 0.05, 0.3, 1.0),
    ("window 0.35, memory 0.4, gate 1 (the default)", 0.35, 0.05, 0.4, 1.0),
    ("window 0.35, memory 0.4", 0.35, 0.05, 0.4, 0), ("window 0.5, memory 0.2", 0.5, 0.05, 0.2, 0))


def _set(cfg, design):
  cfg = cfg.copy_and_resolve_references()
  cfg.optim.update(noise_scale_window=design[1], noise_scale_recency=design[2],
                   noise_scale_max_rse=design[4])
  return cfg


def nqm_designs(csv_path: str = "docs/noisy_quadratic.csv", seeds: int = 8) -> None:
  """Each design replayed on the squared norms of the sweep's best run per batch (`seeds`
  seeds, to the target): p10/median/p90 of logged / the run's own |G|^2 read with the same
  memory (`sampling`) and of logged / analytic (`total`), and the steps with a value."""
  problem, q = nqm.Problem.power_law(1000), lambda x: "/".join(
      f"{v:.2f}" for v in np.nanpercentile(x, [10, 50, 90]))
  for r in csv.DictReader(open(csv_path)):
    if r["best"] != "True":
      continue
    b, rate, n = int(r["batch"]), float(r["rate"]), int(np.ceil(float(r["steps"])))
    cfg = nqm.run_config(sweep_tiny.get_config(), "sgd", rate, b)
    rows, _ = nqm.run(problem, cfg, n, seeds, b)
    analytic = nqm.curves(problem, [rate], [b], n)["b_simple"][:, 0]
    for d in DESIGNS:
      m = replay(problem, _set(cfg, d), rows["meter_sq_small"], rows["meter_sq_big"],
                 memory_rse=d[3])
      s = parts(problem, _set(cfg, d), dict(rows, noise_scale=m["b_simple"],
                                            noise_memory=m["memory"]), analytic, n)
      print(f"batch {b} | {d[0]} | sampling {q(s['sampling'])} | total {q(s['total'])} | "
            f"with a value {np.isfinite(m['b_simple']).mean():.0%}", flush=True)


def lm_designs(runs: list[str]) -> None:
  """Each design replayed on the per-step estimates (`noise_g_sq_step`, `noise_trace_step` and
  their `_precond`) an LM run logged at every step, over the truth at its checkpoints from
  step 50 (`tools.noise_check.check_run`, 1,024 sequences, kept in RUN.json), for runs given as
  RUN:BATCH."""
  for run in runs:
    wd, batch = run.rsplit(":", 1)
    rows = [r for r in read_rows(wd) if "noise_g_sq_step" in r]
    path = wd.rstrip("/") + ".json"
    if not os.path.exists(path):
      with open(path, "w") as f:
        json.dump(check_run(wd, [s for s in checkpoints(wd) if s >= 50], sequences=1024,
                            groups=16, seed=12345), f, default=float)
    truths = json.load(open(path))
    for d in DESIGNS:
      tx = noise_scale.meter(d[1], lambda step: (step + 1.0) * int(batch), recency=d[2],
                             min_measurements=8, max_rse=d[4])
      got = {}
      for kind in ("", "_precond"):
        state = tx.init(None)
        for r in rows:  # a Sample whose estimates are the logged ones (b = 1, B = 2)
          g, t = r[f"noise_g_sq{kind}_step"], r[f"noise_trace{kind}_step"]
          sample = noise_scale.Sample(*(np.float32(x) for x in (g + t, g + t / 2, 1, 2)))
          _, state = tx.update({}, state, noise_sample=sample, step=r["step"] - 1)
          if any(x["step"] == r["step"] for x in truths):
            value = float(noise_scale.readout(state, memory_rse=d[3])["b_simple"])
            got[r["step"], kind] = value * int(batch) / r["target_tokens"]
      ratios = {(x["step"], k): got[x["step"], k] / x["truth" + k] for x in truths
                for k in ("", "_precond")}
      v = np.array(list(ratios.values()))
      print(f"{wd} | {d[0]} | " + " ".join(f"{s}{k and 'p'}: {x:.2f}" for (s, k), x in
                                          ratios.items())
            + f" | within 1.6x {np.sum((v > 1 / 1.6) & (v < 1.6))} of {len(v)}", flush=True)


def build_parser():
  p = argparse.ArgumentParser("python -m experiments.nqm_meter", description=__doc__)
  p.add_argument("--lm", nargs="+", metavar="RUN:BATCH", help="the LM runs to replay (else the "
                 "NQM's, from docs/noisy_quadratic.csv)")
  return p


if __name__ == "__main__":
  args = build_parser().parse_args()
  if args.lm:
    lm_designs(args.lm)
  else:
    nqm_designs()

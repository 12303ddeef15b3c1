"""The scaling lab's estimates at one (model size N, data budget D) from its runs, with bootstrap
intervals over seeds (experiments/critical_batch_scaling.py runs them; no jax here).

From rows of (batch, learning-rate multiplier, seed) with the steps to the target of D, the eval
loss after D sequences and B_simple at the crossing: per seed and batch the rate with the fewest
steps counts (`tools.batch_sweep.summarise`, as the sweep does); on the steps averaged over seeds
McCandlish's S_min, E_min and B_crit (`fit_tradeoff`) and Zhang et al.'s 20%-overhead batch
(`zhang_batch` from `zhang_b0`, the smallest batch every seed crossed); B_opt, the batch with the
lowest mean loss after D (a parabola in log B through its neighbours), and eta_opt, the rate with
the lowest mean loss at that batch (a parabola in log eta), "resolved" only when the minimum (for
eta_opt both) lies inside the grid; B_simple, the median of the meter's values at the crossings.
Intervals: percentiles over `draws`, seeds drawn with replacement per batch, the same draws for
every (N, D). Method: docs/scaling_lab.md
"""
from __future__ import annotations

import dataclasses
import math
import warnings

import numpy as np

from tools.batch_sweep import MIN_MICRO_BATCHES, Result, fit_tradeoff, summarise, zhang_batch
from tools.scaling_fit import interval

QUANTITIES = ("s_min", "e_min", "b_crit", "b_zhang", "b_opt", "eta_opt", "b_simple")


def draws(replicates: int, batches: int, seeds: int, seed: int = 0) -> np.ndarray:
  """[replicate, batch, slot] indices of seeds drawn with replacement (the bootstrap's draws)."""
  return np.random.default_rng(seed).integers(0, seeds, size=(replicates, batches, seeds))


@dataclasses.dataclass
class Table:
  """One (N, D)'s runs as arrays over (seed, batch[, rate]); NaN where a value is missing."""
  seeds: list[int]
  batches: list[int]
  steps: np.ndarray  # [seed, batch]: the fastest rate's steps to the target
  noise: np.ndarray  # [seed, batch]: its B_simple at the crossing (NaN: too few micro-batches)
  loss: np.ndarray  # [seed, batch, rate]: eval loss after D sequences
  rates: np.ndarray  # [batch, rate]: the learning rates


def table(rows: list[dict]) -> Table:
  """The arrays of one (N, D)'s rows (keys: seed, batch_size, lr_multiplier, learning_rate,
  steps, examples, noise_scale, micro_batches, loss_at_budget, below_at_start)."""
  seeds = sorted({r["seed"] for r in rows})
  batches = sorted({r["batch_size"] for r in rows})
  mults = sorted({r["lr_multiplier"] for r in rows})
  steps = np.full((len(seeds), len(batches)), np.nan)
  noise = np.full_like(steps, np.nan)
  loss = np.full((len(seeds), len(batches), len(mults)), np.nan)
  rates = np.full((len(batches), len(mults)), np.nan)
  for i, s in enumerate(seeds):
    mine = [r for r in rows if r["seed"] == s]
    results = [Result(r["batch_size"], r["lr_multiplier"], r["learning_rate"], r["steps"],
                      r.get("examples"), r.get("tokens"), r.get("noise_scale"),
                      r.get("micro_batches", 1), None, 0, 0.0, "") for r in mine]
    chosen, _, _ = summarise(results)  # the fastest rate per batch
    # a rate already below the target where its curve starts may have been the fastest: unknown
    early = {r["batch_size"] for r in mine if r.get("below_at_start")}
    for r in (r for r in chosen if r.batch_size not in early):
      j = batches.index(r.batch_size)
      steps[i, j] = r.steps
      if r.noise_scale is not None and r.micro_batches >= MIN_MICRO_BATCHES:
        noise[i, j] = r.noise_scale
    for r in mine:
      j, k = batches.index(r["batch_size"]), mults.index(r["lr_multiplier"])
      rates[j, k] = r["learning_rate"]
      if r.get("loss_at_budget") is not None:
        loss[i, j, k] = r["loss_at_budget"]
  return Table(seeds, batches, steps, noise, loss, rates)


def vertex(xs, ys, i: int) -> float:
  """x of the minimum of the parabola through points i-1, i, i+1 (x in log), kept between
  x[i-1] and x[i+1]; x[i] itself at an end of the grid or where the three are not convex."""
  if i == 0 or i == len(xs) - 1:
    return float(xs[i])
  x = np.log(np.asarray(xs[i - 1:i + 2], float))
  a, b, _ = np.polyfit(x, np.asarray(ys[i - 1:i + 2], float), 2)
  if a <= 0:
    return float(xs[i])
  return float(np.exp(np.clip(-b / (2 * a), x[0], x[2])))


def estimate(t: Table, pick: np.ndarray) -> dict:
  """The quantities with each batch's seeds taken as `pick[batch]` (indices into t.seeds)."""
  out = dict.fromkeys(QUANTITIES + ("b_opt_resolved", "eta_opt_resolved", "zhang_b0"))
  cols = np.arange(len(t.batches))
  steps = t.steps[pick.T, cols]  # [slot, batch]
  full = ~np.isnan(steps).any(axis=0)  # batches every picked seed reached
  b = np.asarray(t.batches, float)[full]
  mean = steps[:, full].mean(axis=0)
  if len(b) >= 2:
    fit = fit_tradeoff(b, mean)
    out.update(s_min=fit.s_min, e_min=fit.e_min, b_crit=fit.b_crit,
               b_zhang=zhang_batch(b, mean), zhang_b0=float(b[0]))
  loss = np.stack([t.loss[pick[j], j] for j in cols], axis=1)  # [slot, batch, rate]
  by_batch = _nanmin(loss, axis=2).mean(axis=0)  # the best rate's, averaged over seeds
  ok = ~np.isnan(by_batch)
  if ok.any():
    bs, ls = np.asarray(t.batches, float)[ok], by_batch[ok]
    i = int(np.argmin(ls))
    out.update(b_opt=vertex(bs, ls, i), b_opt_resolved=0 < i < len(bs) - 1)
    j = int(np.flatnonzero(ok)[i])
    by_rate = loss[:, j, :].mean(axis=0)
    good = ~np.isnan(by_rate)
    if good.any():
      rates, lr_loss = t.rates[j][good], by_rate[good]
      k = int(np.argmin(lr_loss))
      # the joint minimum: a rate inside its grid at a batch inside its grid
      out.update(eta_opt=vertex(rates, lr_loss, k),
                 eta_opt_resolved=0 < k < len(rates) - 1 and bool(out["b_opt_resolved"]))
  noise = np.stack([t.noise[pick[j], j] for j in cols], axis=1)
  if not np.isnan(noise).all():
    out["b_simple"] = float(np.nanmedian(noise))
  return out


def _nanmin(a: np.ndarray, axis: int) -> np.ndarray:
  """np.nanmin, NaN (without a warning) where a slice is all NaN."""
  with warnings.catch_warnings():
    warnings.simplefilter("ignore", RuntimeWarning)
    return np.nanmin(a, axis=axis)


def cell(rows: list[dict], boot: np.ndarray, level: float = 0.95) -> tuple[dict, list[dict]]:
  """(the point estimates with their intervals and each batch's mean steps, the bootstrap
  replicates) of one (N, D). `boot`: `draws(R, len(batches), len(seeds))`."""
  t = table(rows)
  n = len(t.seeds)
  point = estimate(t, np.tile(np.arange(n), (len(t.batches), 1)))
  replicates = [estimate(t, boot[r]) for r in range(len(boot))] if n > 1 else []
  out = dict(point)
  for q in QUANTITIES:
    lo, hi = interval([r[q] for r in replicates], level)
    out[f"{q}_lo"], out[f"{q}_hi"] = lo, hi
  out["seeds"] = n
  out["steps_by_batch"] = {b: (None if np.isnan(t.steps[:, j]).any() else
                               float(t.steps[:, j].mean()))
                           for j, b in enumerate(t.batches)}
  out["steps_spread"] = {b: (float(np.nanmin(t.steps[:, j])), float(np.nanmax(t.steps[:, j])))
                         for j, b in enumerate(t.batches) if not np.isnan(t.steps[:, j]).all()}
  best = _nanmin(t.loss, axis=2).mean(axis=0)
  out["loss_by_batch"] = {b: None if np.isnan(best[j]) else float(best[j])
                          for j, b in enumerate(t.batches)}
  return out, [{q: r[q] for q in QUANTITIES} for r in replicates]

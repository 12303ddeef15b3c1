"""The scaling lab's estimates at one (model size N, data budget D) from its runs (no jax here).

Per seed and batch the fastest rate counts, and whether it lies inside the rates run there; a
crossing below the target at the first evaluation is an upper bound (`censored`). The cell keeps
the lab's whole batch window with b0 its smallest batch, and is *refused* (`refused` says why)
where some seed's fastest rate is at its grid's edge or some seed never reached the target.
Otherwise: McCandlish's fit on the seeds' mean steps (censored points as bounds) with residuals,
local slopes, B_crit by window and the residual interval; Zhang's batch from b0; B_opt and eta_opt
(resolved only inside the grid); B_simple at the crossings; `lr_opt` per batch. Intervals: a
*paired* bootstrap (`draws`: a drawn seed brings its runs at every batch), the same draws for
every cell. Method: docs/scaling_lab.md
"""
from __future__ import annotations

import dataclasses
import warnings

import numpy as np

from tools.batch_sweep import MIN_MICRO_BATCHES
from tools.scaling_fit import interval
from tools.tradeoff import fit_tradeoff, local_slopes, window_sensitivity, zhang_batch

QUANTITIES = ("s_min", "e_min", "b_crit", "b_zhang", "b_opt", "eta_opt", "b_simple")
FIT_QUANTITIES = ("s_min", "e_min", "b_crit", "b_zhang")  # what a refused cell does not have


def draws(replicates: int, seeds: int, seed: int = 0) -> np.ndarray:
  """[replicate, slot] indices of seeds drawn with replacement (a paired bootstrap: a drawn
  seed brings its runs at every batch)."""
  return np.random.default_rng(seed).integers(0, seeds, size=(replicates, seeds))


@dataclasses.dataclass
class Table:
  """One (N, D)'s runs as arrays over (seed, batch[, rate]); NaN where a value is missing."""
  seeds: list[int]
  batches: list[int]
  steps: np.ndarray  # [seed, batch]: the fastest rate's steps to the target (NaN: none reached)
  censored: np.ndarray  # [seed, batch]: those steps are an upper bound
  interior: np.ndarray  # [seed, batch]: the fastest rate has a slower one run on each side
  noise: np.ndarray  # [seed, batch]: its B_simple at the crossing (NaN: too few micro-batches)
  loss: np.ndarray  # [seed, batch, rate]: eval loss after D sequences
  rates: np.ndarray  # [batch, rate]: the learning rates (NaN: not run at that batch)
  mults: list[float]  # the rate multipliers (the rate axis)


def table(rows: list[dict]) -> Table:
  """The arrays of one (N, D)'s rows (keys: seed, batch_size, lr_multiplier, learning_rate,
  steps, noise_scale, micro_batches, loss_at_budget, censored)."""
  seeds = sorted({r["seed"] for r in rows})
  batches = sorted({r["batch_size"] for r in rows})
  mults = sorted({r["lr_multiplier"] for r in rows})
  shape = (len(seeds), len(batches))
  steps, noise = np.full(shape, np.nan), np.full(shape, np.nan)
  censored, inside = np.zeros(shape, bool), np.zeros(shape, bool)
  loss = np.full(shape + (len(mults),), np.nan)
  rates = np.full((len(batches), len(mults)), np.nan)
  for r in rows:
    i, j, k = seeds.index(r["seed"]), batches.index(r["batch_size"]), mults.index(r["lr_multiplier"])
    rates[j, k] = r["learning_rate"]
    if r.get("loss_at_budget") is not None:
      loss[i, j, k] = r["loss_at_budget"]
  for i, s in enumerate(seeds):
    for j, b in enumerate(batches):
      mine = [r for r in rows if r["seed"] == s and r["batch_size"] == b]
      reached = [r for r in mine if r["steps"] is not None]
      if not reached:
        continue
      fastest = min(r["steps"] for r in reached)
      winners = [r for r in reached if r["steps"] <= fastest * (1 + 1e-9)]
      run = [r["lr_multiplier"] for r in mine]
      steps[i, j] = fastest
      censored[i, j] = any(r.get("censored") for r in winners)
      # a tie (two rates censored at the same first evaluation) is inside only if all are
      inside[i, j] = all(min(run) < r["lr_multiplier"] < max(run) for r in winners)
      w = winners[0]
      if w.get("noise_scale") is not None and w.get("micro_batches", 1) >= MIN_MICRO_BATCHES:
        noise[i, j] = w["noise_scale"]
  return Table(seeds, batches, steps, censored, inside, noise, loss, rates, mults)


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


def refusal(t: Table, pick: np.ndarray) -> str:
  """Why the picked seeds' steps cannot be fitted ('' when they can): a seed that never reached
  the target at some batch, or a fastest rate at the edge of its batch's grid."""
  for j, b in enumerate(t.batches):
    for i in pick:
      if np.isnan(t.steps[i, j]):
        return f"batch {b}: seed {t.seeds[i]} never reached the target"
      if not t.interior[i, j]:
        return f"batch {b}: seed {t.seeds[i]}'s fastest rate is at the edge of the rates run"
  return ""


def estimate(t: Table, pick: np.ndarray, diagnostics: bool = False) -> dict:
  """The quantities from the seeds `pick` (indices into t.seeds, the same at every batch);
  `diagnostics`: also the fit's residuals, local slopes, window sensitivity and interval."""
  out = dict.fromkeys(QUANTITIES + ("b_opt_resolved", "eta_opt_resolved", "zhang_b0"))
  out["refused"] = refusal(t, pick)
  b = np.asarray(t.batches, float)
  if not out["refused"] and len(b) >= 2:
    mean = t.steps[pick].mean(axis=0)
    cens = t.censored[pick].any(axis=0)
    fit = fit_tradeoff(b, mean, cens)
    used = np.where(cens, np.minimum(mean, fit.steps(b)), mean)  # a bound at most its fit
    out.update(s_min=fit.s_min, e_min=fit.e_min, b_crit=fit.b_crit,
               b_zhang=zhang_batch(b, used), zhang_b0=float(b[0]))
    if diagnostics:
      out.update(b_crit_fit_lo=fit.b_crit_lo, b_crit_fit_hi=fit.b_crit_hi,
                 residuals=dict(zip(t.batches, np.round(fit.residuals, 4).tolist())),
                 local_slopes=dict(zip(t.batches[1:], np.round(local_slopes(b, used), 3).tolist())),
                 window_b_crit={k: round(v, 2) for k, v in window_sensitivity(b, mean, cens).items()},
                 censored_batches=[x for x, c in zip(t.batches, cens) if c])
  loss = t.loss[pick]  # [slot, batch, rate]
  by_batch = nanmin(loss, axis=2).mean(axis=0)  # the best rate's, averaged over seeds
  ok = ~np.isnan(by_batch)
  if ok.any():
    bs, ls = b[ok], by_batch[ok]
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
  noise = t.noise[pick]
  if not np.isnan(noise).all():
    out["b_simple"] = float(np.nanmedian(noise))
  return out


def nanmin(a: np.ndarray, axis: int) -> np.ndarray:
  """np.nanmin, NaN (without a warning) where a slice is all NaN."""
  with warnings.catch_warnings():
    warnings.simplefilter("ignore", RuntimeWarning)
    return np.nanmin(a, axis=axis)


def lr_opt(rows: list[dict]) -> list[dict]:
  """Per batch of one (N, D): the learning rate with the fewest steps to the target, averaged
  over the seeds (rates some seed did not reach with count as never), refined by a parabola in
  log rate through its neighbours; `interior` when it is inside the rates run."""
  t = table(rows)
  steps = np.full((len(t.seeds), len(t.batches), len(t.mults)), np.inf)
  for r in rows:
    if r["steps"] is not None:
      steps[t.seeds.index(r["seed"]), t.batches.index(r["batch_size"]),
            t.mults.index(r["lr_multiplier"])] = r["steps"]
  out = []
  for j, b in enumerate(t.batches):
    run = ~np.isnan(t.rates[j])
    mean = steps[:, j, run].mean(axis=0)
    if not np.isfinite(mean).any():
      out.append(dict(batch=b, lr_opt=None, interior=False, steps=None))
      continue
    k = int(np.argmin(mean))
    rates = t.rates[j][run]
    near = mean[max(0, k - 1):k + 2]
    best = vertex(rates, mean, k) if np.isfinite(near).all() else float(rates[k])
    out.append(dict(batch=b, lr_opt=best, interior=0 < k < len(rates) - 1,
                    steps=float(mean[k])))
  return out


def cell(rows: list[dict], boot: np.ndarray, level: float = 0.95) -> tuple[dict, list[dict]]:
  """(the point estimates with their intervals, diagnostics and each batch's mean steps, the
  bootstrap replicates) of one (N, D). `boot`: `draws(R, len(seeds))`."""
  t = table(rows)
  n = len(t.seeds)
  point = estimate(t, np.arange(n), diagnostics=True)
  replicates = [estimate(t, boot[r]) for r in range(len(boot))] if n > 1 else []
  out = dict(point)
  for q in QUANTITIES:
    # a refused cell has no B_crit: a replicate that happens to skip the censored seed does
    # not give it an interval
    fitted = not (point["refused"] and q in FIT_QUANTITIES)
    lo, hi = interval([r[q] for r in replicates], level) if fitted else (None, None)
    out[f"{q}_lo"], out[f"{q}_hi"] = lo, hi
  out["seeds"] = n
  reached = ~np.isnan(t.steps)
  out["cases"] = int(reached.sum())
  out["interior_cases"] = int((reached & t.interior).sum())
  out["steps_by_batch"] = {b: (None if np.isnan(t.steps[:, j]).any() else
                               float(t.steps[:, j].mean()))
                           for j, b in enumerate(t.batches)}
  out["steps_spread"] = {b: (float(np.nanmin(t.steps[:, j])), float(np.nanmax(t.steps[:, j])))
                         for j, b in enumerate(t.batches) if not np.isnan(t.steps[:, j]).all()}
  best = nanmin(t.loss, axis=2).mean(axis=0)
  out["loss_by_batch"] = {b: None if np.isnan(best[j]) else float(best[j])
                          for j, b in enumerate(t.batches)}
  return out, [{q: r[q] for q in QUANTITIES} for r in replicates]

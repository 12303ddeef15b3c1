"""What a set of steps-to-target measurements says, and how the rates that made them are
searched (no jax: importable and testable on its own; tools.batch_sweep, the scaling lab and the
noisy quadratic use it).

- `fit_tradeoff`: McCandlish et al. 2018's S(B) = S_min + E_min / B, left-censored points kept
  as intervals, with the fit's residuals and residual-based interval of B_crit = E_min / S_min;
  `local_slopes` and `window_sensitivity` show where the curve is not that shape.
- `zhang_batch`: Zhang et al. 2024's batch 20% over linear scaling from the smallest batch.
- `next_multipliers`, `interior`, `bracket`: the learning-rate grid grown beyond any winning
  edge until every fastest rate is inside it (Shallue et al. 2018).
"""
from __future__ import annotations

import dataclasses
import math

import numpy as np
from scipy import stats




@dataclasses.dataclass
class Fit:
  """S(B) = S_min + E_min / B fitted to measured steps, with what shows its misfit: each
  point's relative residual (measured / fitted - 1, in the order of `batches`), the
  residual-based 95% interval of B_crit (the fit's covariance with Student's t on n - 2 degrees
  of freedom; None without degrees of freedom or where an end was fixed at 0) and which points
  were left-censored (an upper bound on the steps, `fit_tradeoff`)."""
  s_min: float  # steps needed at an infinite batch
  e_min: float  # examples needed at a batch of 1
  note: str = ""
  batches: tuple = ()
  residuals: tuple = ()
  censored: tuple = ()
  b_crit_lo: float | None = None
  b_crit_hi: float | None = None

  @property
  def b_crit(self) -> float:
    return self.e_min / self.s_min if self.s_min > 0 else math.inf

  def steps(self, batch):
    return self.s_min + self.e_min / np.asarray(batch, float)


def _lstsq(b, s):
  """(S_min, E_min, covariance or None) of the relative least squares on (b, s)."""
  w = 1.0 / s
  a = np.stack([w, w / b], axis=1)
  coef, *_ = np.linalg.lstsq(a, np.ones_like(s), rcond=None)
  dof = len(b) - 2
  cov = None
  if dof > 0:
    resid = a @ coef - 1.0
    cov = float(resid @ resid / dof) * np.linalg.pinv(a.T @ a)
  return float(coef[0]), float(coef[1]), cov


def fit_tradeoff(batch_sizes, steps, censored=None, level: float = 0.95) -> Fit:
  """Least-squares fit of S(B) = S_min + E_min / B on relative residuals (each point's error
  weighted by 1 / S, so small and large batches count alike). A negative S_min means perfect
  scaling over the whole range (B_crit above the largest batch); a negative E_min means no
  gain from batch at all: each is then fixed at 0 and the other refitted.

  `censored[i]`: point i is an upper bound (the run was below the target at its first
  smoothed evaluation: it crossed at or before those steps). Such a point is kept, as an
  interval: it is fitted at min(bound, the fit's prediction), iterated to a fixed point (a
  censored least squares), so it pulls the curve only where the curve would pass above it."""
  b = np.asarray(batch_sizes, float)
  bound = np.asarray(steps, float)
  cens = np.zeros(len(b), bool) if censored is None else np.asarray(censored, bool)
  if len(b) < 2:
    raise ValueError("the fit needs at least two batch sizes that reached the target")
  s = bound.copy()
  for _ in range(100):
    s_min, e_min, cov = _lstsq(b, s)
    if not cens.any():
      break
    new = np.where(cens, np.minimum(bound, np.maximum(s_min + e_min / b, 1e-9)), bound)
    if np.allclose(new, s, rtol=1e-9):
      break
    s = new
  extra = dict(batches=tuple(b.tolist()), censored=tuple(cens.tolist()))
  if s_min <= 0:
    w = 1.0 / s
    e_min = float(np.sum(w * w * s / b) / np.sum((w / b) ** 2))
    return Fit(0.0, e_min, "S_min <= 0: steps halve with every doubling of the batch over the "
               "whole range (B_crit is above the largest batch)",
               residuals=tuple((bound / (e_min / b) - 1).tolist()), **extra)
  if e_min <= 0:
    s_min = float(np.sum(1.0 / s) / np.sum(1.0 / s ** 2))
    return Fit(s_min, 0.0, "E_min <= 0: a bigger batch saves no steps (B_crit is below the "
               "smallest batch)", residuals=tuple((bound / s_min - 1).tolist()), **extra)
  lo = hi = None
  if cov is not None:
    # log B_crit = log E_min - log S_min, its variance by the delta method
    grad = np.array([-1.0 / s_min, 1.0 / e_min])
    var = float(grad @ cov @ grad)
    t = float(stats.t.ppf((1 + level) / 2, len(b) - 2))
    half = t * math.sqrt(max(var, 0.0))
    lo, hi = e_min / s_min * math.exp(-half), e_min / s_min * math.exp(half)
  fitted = s_min + e_min / b
  return Fit(s_min, e_min, residuals=tuple((bound / fitted - 1).tolist()), b_crit_lo=lo,
             b_crit_hi=hi, **extra)


def local_slopes(batch_sizes, steps) -> list[float]:
  """-d log S / d log B between neighbouring batches (sorted by batch): 1 where doubling the
  batch halves the steps (perfect scaling), 0 where it saves none. McCandlish's curve goes from
  ~1 well below B_crit through 0.5 at B_crit to 0; a rate rule's shape (slope ~0.5 throughout
  under the sqrt rule) is not that curve."""
  order = np.argsort(np.asarray(batch_sizes, float))
  b = np.log(np.asarray(batch_sizes, float)[order])
  s = np.log(np.asarray(steps, float)[order])
  return [float(-(s[i + 1] - s[i]) / (b[i + 1] - b[i])) for i in range(len(b) - 1)]


def window_sensitivity(batch_sizes, steps, censored=None) -> dict[str, float]:
  """B_crit fitted on the whole batch window and on the windows without its smallest, its
  largest, or both end batches ({"4-256": B_crit, ...}; windows of fewer than 3 batches are
  left out): a B_crit that moves with the window is set by the window, not by the curve."""
  order = np.argsort(np.asarray(batch_sizes, float))
  b = np.asarray(batch_sizes, float)[order]
  s = np.asarray(steps, float)[order]
  c = np.zeros(len(b), bool) if censored is None else np.asarray(censored, bool)[order]
  out = {}
  for i, j in ((0, len(b)), (1, len(b)), (0, len(b) - 1), (1, len(b) - 1)):
    if j - i >= 3:
      out[f"{b[i]:g}-{b[j - 1]:g}"] = fit_tradeoff(b[i:j], s[i:j], c[i:j]).b_crit
  return out


def zhang_batch(batch_sizes, steps, overhead: float = 0.2) -> float | None:
  """Zhang et al. 2024's critical batch: where the steps to the target exceed linear scaling from
  the smallest batch b0 (S(b0) b0 / B) by `overhead`, i.e. where E(B) / E(b0) first reaches
  1 + overhead (E = B S), linear in B between batches (exact on McCandlish's curve, whose E is
  linear in B: there it is (1 + overhead) b0 + overhead B_crit). None: not within the range."""
  order = np.argsort(np.asarray(batch_sizes, float))
  b = np.asarray(batch_sizes, float)[order]
  ratio = b * np.asarray(steps, float)[order] / (b[0] * np.asarray(steps, float)[order][0])
  for i in range(1, len(b)):
    if ratio[i] >= 1 + overhead:
      return float(b[i - 1] + (1 + overhead - ratio[i - 1]) / (ratio[i] - ratio[i - 1])
                   * (b[i] - b[i - 1]))
  return None


def next_multipliers(*scores: dict, factor: float = 2.0) -> list[float]:
  """The learning-rate multipliers to run next so that every fastest rate lies inside its grid
  (Shallue et al. 2018's precondition for a steps-to-result claim). Each of `scores` maps the
  multipliers run so far to a score, lower better (steps to the target), None or NaN where the
  run did not reach it (or diverged): such a run is worse than any that did, so it brackets. For
  each dict whose best multiplier is the grid's smallest, best / factor; its largest, best x
  factor; where no run reached the target, both beyond the grid's ends (too high a rate
  diverges, too low a one is too slow: either can be why); the union, sorted ([] when every
  best is inside)."""
  out = set()
  for sc in scores:
    best = winners(sc)
    if not best:
      out.update((min(sc) / factor, max(sc) * factor))
      continue
    if min(sc) in best:
      out.add(min(sc) / factor)
    if max(sc) in best:
      out.add(max(sc) * factor)
  return sorted(out)


def winners(scores: dict) -> list[float]:
  """The multipliers with the lowest score (several where they tie), [] where none reached."""
  reached = {m: v for m, v in scores.items() if v is not None and math.isfinite(v)}
  if not reached:
    return []
  low = min(reached.values())
  return sorted(m for m, v in reached.items() if v <= low * (1 + 1e-9))


def interior(scores: dict) -> bool | None:
  """Whether the best (lowest) score's multiplier, every one of them where several tie, has a
  run on each side in `scores` (None where no run reached: there is no best)."""
  best = winners(scores)
  if not best:
    return None
  return all(min(scores) < m < max(scores) for m in best)


def bracket(run, grid, *, factor: float = 2.0, max_extensions: int = 4) -> dict:
  """{multiplier: score} of `run(multiplier)` (lower better; None: not reached) over `grid`,
  extended by `next_multipliers` (one step of `factor` beyond each winning edge per round, at
  most `max_extensions` rounds) until the best multiplier is inside."""
  scores = {m: run(m) for m in sorted(set(grid))}
  for _ in range(max_extensions):
    new = [m for m in next_multipliers(scores, factor=factor) if m not in scores]
    if not new:
      break
    for m in new:
      scores[m] = run(m)
  return scores

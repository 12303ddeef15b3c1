"""Paired statistics over seeds: what every experiment's summary says about two arms.

Two arms of an experiment that share a seed share its initialisation and data order, so they
are compared seed by seed: the differences d_s = a_s - b_s, their mean, Student's t interval
mean +- t(1 - alpha/2, n - 1) s / sqrt(n) and the two-sided p-value of "no difference"
(`paired`). A difference whose interval holds 0 is reported as no difference, never as a
"flip" or an "edge" (`Paired.verdict`). With 3 seeds t(0.975, 2) = 4.30, and the same sign on
3 of 3 seeds is p = 0.25 (sign test): effects below ~0.02 nats need 5 or more seeds.

    python -m tools.stats CSV [CSV ...] --metric final_eval_loss --arm rule --a linear --b sqrt \
        [--by seed] [--match KEY=VALUE,...]

reads an experiment's per-seed CSVs (a row per seed and arm) and prints the paired difference
A - B of `--metric` between the arms `--a` and `--b` of column `--arm`, matched on `--by`,
among the rows with the `--match` values. No jax here.
"""
from __future__ import annotations

import dataclasses
import math
import sys

import numpy as np
from scipy import stats as sps

from tools import figures
from trainer.config import ConfigError
from trainer.config.cli import CliParser


@dataclasses.dataclass(frozen=True)
class Interval:
  """Mean of `n` values with its Student-t interval at `level` and standard error."""
  mean: float
  lo: float
  hi: float
  se: float
  n: int
  level: float

  def text(self, fmt: str = ".3g") -> str:
    if self.n < 2:
      return f"{self.mean:{fmt}} (n = {self.n}: no interval)"
    return f"{self.mean:{fmt}} [{self.lo:{fmt}}, {self.hi:{fmt}}]"


def t_interval(values, level: float = 0.95) -> Interval:
  """The mean of `values` (NaN and None left out) with its t interval; lo = hi = NaN for fewer
  than two values."""
  v = np.asarray([float(x) for x in values if x is not None and math.isfinite(float(x))])
  n = len(v)
  if n == 0:
    return Interval(math.nan, math.nan, math.nan, math.nan, 0, level)
  mean = float(v.mean())
  if n < 2:
    return Interval(mean, math.nan, math.nan, math.nan, n, level)
  se = float(v.std(ddof=1) / math.sqrt(n))
  half = float(sps.t.ppf((1 + level) / 2, n - 1)) * se
  return Interval(mean, mean - half, mean + half, se, n, level)


@dataclasses.dataclass(frozen=True)
class Paired:
  """a - b over the seeds both arms have: the t interval of the mean difference, the two-sided
  p-value (paired t test; 1.0 where every difference is 0) and how many seeds had a > b."""
  diff: Interval
  p: float
  positive: int
  seeds: list

  @property
  def significant(self) -> bool:
    """The interval excludes 0 (at its level)."""
    return self.diff.n >= 2 and (self.diff.lo > 0 or self.diff.hi < 0)

  def verdict(self, a: str = "a", b: str = "b", fmt: str = ".3g") -> str:
    """One line: the difference with its interval, p, and what it allows one to say."""
    d = self.diff
    head = f"{a} - {b} = {d.text(fmt)} over {d.n} paired seeds (p = {self.p:.2g}; {a} higher " \
           f"on {self.positive} of {d.n})"
    if d.n < 2:
      return head + ": too few seeds for an interval"
    if not self.significant:
      return head + ": no difference at this level (the interval holds 0)"
    return head + f": {a} {'higher' if d.mean > 0 else 'lower'} than {b}"

  def as_dict(self, prefix: str = "diff") -> dict:
    d = self.diff
    return {f"{prefix}": d.mean, f"{prefix}_lo": d.lo, f"{prefix}_hi": d.hi, f"{prefix}_se": d.se,
            f"{prefix}_p": self.p, f"{prefix}_n": d.n, f"{prefix}_significant": self.significant}


def paired(a: dict, b: dict, level: float = 0.95) -> Paired:
  """Paired difference a - b of {seed: value} dicts over the seeds both have with finite values
  (a seed missing or NaN in either arm is left out of both)."""
  seeds = sorted(s for s in set(a) & set(b) if _finite(a[s]) and _finite(b[s]))
  d = np.asarray([float(a[s]) - float(b[s]) for s in seeds])
  diff = t_interval(d, level)
  if len(d) < 2:
    p = math.nan
  elif np.all(d == d[0]):
    p = 1.0 if d[0] == 0 else 0.0
  else:
    p = float(2 * sps.t.sf(abs(diff.mean / diff.se), len(d) - 1))
  return Paired(diff, p, int(np.sum(d > 0)), seeds)


@dataclasses.dataclass(frozen=True)
class Correlation:
  """Pearson's r of `n` pairs with its Fisher-z interval at `level` (NaN for fewer than 4 pairs)
  and the two-sided p-value of r = 0 (t test with n - 2 degrees of freedom)."""
  r: float
  lo: float
  hi: float
  p: float
  n: int
  level: float

  def text(self, fmt: str = ".2f") -> str:
    if self.n < 4:
      return f"r = {self.r:{fmt}} (n = {self.n}: no interval)"
    return f"r = {self.r:{fmt}} [{self.lo:{fmt}}, {self.hi:{fmt}}] (n = {self.n}, p = {self.p:.2g})"


def correlation(x, y, level: float = 0.95) -> Correlation:
  """Pearson's r of the pairs (x_i, y_i) where both are finite, with the interval
  tanh(atanh(r) -+ z(1 - alpha/2) / sqrt(n - 3)) (Fisher's transform; scipy's pearsonr)."""
  pairs = [(float(a), float(b)) for a, b in zip(x, y) if _finite(a) and _finite(b)]
  n = len(pairs)
  if n < 3:
    return Correlation(math.nan, math.nan, math.nan, math.nan, n, level)
  res = sps.pearsonr(*np.asarray(pairs).T)
  lo, hi = res.confidence_interval(level) if n >= 4 else (math.nan, math.nan)
  return Correlation(float(res.statistic), float(lo), float(hi), float(res.pvalue), n, level)


def spread(values) -> dict | None:
  """Mean, sample std (NaN for one value), min, max and count of `values`, None and NaN (a
  target not reached) left out; None when nothing is left."""
  values = [float(v) for v in values if v is not None and not math.isnan(float(v))]
  if not values:
    return None
  mean = float(np.mean(values))
  std = float(np.std(values, ddof=1)) if len(values) > 1 else math.nan
  return {"mean": mean, "std": std, "min": min(values), "max": max(values), "n": len(values)}


def _finite(x) -> bool:
  return x is not None and math.isfinite(float(x))


def by_seed(rows: list[dict], metric: str, where: dict, seed_key: str = "seed") -> dict:
  """{seed: metric} of the rows matching every (key, value) of `where` (values compared as
  text, so a CSV's '16' matches 16.0); a seed given twice is an error."""
  out = {}
  for r in rows:
    if all(_same(r.get(k), v) for k, v in where.items()):
      s = r[seed_key]
      if s in out:
        raise ConfigError(f"two rows for {seed_key}={s} at {where}: name the columns that tell "
                          "them apart with --match")
      out[s] = r.get(metric)
  return out


def _same(x, y) -> bool:
  try:
    return float(x) == float(y)
  except (TypeError, ValueError):
    return str(x) == str(y)


def build_parser():
  p = CliParser("-m tools.stats", __doc__, config=False, overrides=False)
  p.add_argument("csv", nargs="+", help="an experiment's CSV with a row per seed and arm (or "
                 "several, e.g. one run of seeds 0-2 and one of seeds 3-4: their rows together)")
  p.add_argument("--metric", required=True, help="the column compared")
  p.add_argument("--arm", required=True, help="the column that names the arm")
  p.add_argument("--a", required=True, help="arm A (a value of --arm)")
  p.add_argument("--b", required=True, help="arm B: prints A - B")
  p.add_argument("--by", default="seed", help="the column that pairs rows (default seed)")
  p.add_argument("--match", default="", help="KEY=VALUE,...: only rows with these values")
  p.add_argument("--level", type=float, default=0.95)
  return p


def main(argv: list[str]) -> int:
  try:
    args, _ = build_parser().parse(argv)
    rows = [r for path in args.csv for r in figures.read_table(
        path, (args.metric, args.arm, args.by), "an experiment's CSV with a row per seed and arm")]
    arms = [args.a, args.b]
    match = dict(kv.split("=", 1) for kv in args.match.split(",") if kv)
    a, b = (by_seed(rows, args.metric, {args.arm: arm, **match}, args.by) for arm in arms)
    if not a or not b:
      raise ConfigError(f"no rows with {args.arm}={arms[0 if not a else 1]!r}"
                        + (f" and {args.match}" if args.match else ""))
  except ConfigError as e:
    print(f"error: {e}", file=sys.stderr)
    return 2
  result = paired(a, b, args.level)
  seeds = [int(s) if isinstance(s, float) and s.is_integer() else s for s in result.seeds]
  print(f"[stats] {args.metric}: {result.verdict(*arms, fmt='.4g')} ({args.level:.0%} t "
        f"interval; seeds {seeds})")
  return 0


if __name__ == "__main__":
  sys.exit(main(sys.argv[1:]))

"""Power laws of the scaling lab's estimates in data D and model size N, with intervals, next to
the papers' exponents, and a log-log figure.

    python -m tools.scaling_fit OUT.csv [--boot FILE] [--out STEM] \\
        [--quantities b_crit,b_zhang,b_opt,eta_opt,b_simple] [--level 0.95] [--n params]

Fits log y = c + a log D + b log N (N non-embedding unless --n) over the cells that are finite,
not refused, not transient and, for B_opt and eta_opt, inside the grid (Zhang's batch at the most
common b0). Two intervals side by side: the residual-based one (the fit's covariance, Student's
t: it carries the lack of fit) and the bootstrap over the lab's replicates (`<stem>_boot.csv`:
the seeds' spread alone). With them each cell's residual, the local exponents between budgets
and an F test against a free level per budget: a structured misfit is reported as such. Writes
STEM.png and STEM.json (default `<CSV stem>_fit`). docs/scaling_lab.md
"""
from __future__ import annotations

import json
import math
import os
import sys

import numpy as np
from scipy import stats

from tools import figures
from trainer.config import ConfigError
from trainer.config.cli import CliParser

QUANTITIES = ("b_crit", "b_zhang", "b_opt", "eta_opt", "b_simple")
LABELS = {"b_crit": "B_crit (McCandlish fit)", "b_zhang": "B_crit (Zhang: +20% steps)",
          "b_opt": "B_opt (lowest loss at D)", "eta_opt": "eta_opt (at B_opt)",
          "b_simple": "B_simple at the crossing"}
LAB_CSV = "the lab's OUT.csv (python -m experiments.critical_batch_scaling)"
RESOLVED = {"b_opt": "b_opt_resolved", "eta_opt": "eta_opt_resolved"}
# (paper, exponent of D, exponent of N, how it is stated): None where the paper gives none.
PAPERS = {
    "b_crit": [("Zhang et al. 2024", 0.47, 0.0, "B* ~ 93.2 N^0.47 with D ~ N (Chinchilla), and "
                "flat in N at fixed D: a ~ 0.47 if D carries it all (derived)"),
               ("Power Lines 2025", None, 0.0, "a power law in D alone")],
    "b_zhang": [("Zhang et al. 2024", 0.47, 0.0, "their definition; as for b_crit")],
    "b_opt": [("Step Law 2025", 0.571, 0.0, "B = 0.58 D^0.571 (tokens)"),
              ("Power Lines 2025", None, 0.0, "a power law in D alone")],
    "eta_opt": [("Step Law 2025", 0.307, -0.713, "eta = 1.79 N^-0.713 D^0.307")],
    "b_simple": [("McCandlish et al. 2018", None, None, "B_simple tracks B_crit: compare with "
                  "b_crit's exponents")],
}


def interval(values, level: float = 0.95) -> tuple[float | None, float | None]:
  """Percentile interval of bootstrap values (order statistics, so +inf, a B_crit above the
  range, counts as the largest); None values (no estimate in that replicate) are left out."""
  v = np.sort(np.asarray([x for x in values if x is not None], float))
  if len(v) < 2:
    return None, None
  lo = v[max(0, math.floor((1 - level) / 2 * len(v)))]
  hi = v[min(len(v) - 1, math.ceil((1 + level) / 2 * len(v)) - 1)]
  return float(lo), float(hi)


def fit(tokens, params, y) -> dict:
  """Least squares of log y = c + a log D + b log N; an exponent whose variable does not vary is
  None. Returns c, a, b, their covariance (None without residual degrees of freedom), the
  degrees of freedom and the cells' count."""
  d, n, y = (np.log(np.asarray(v, float)) for v in (tokens, params, y))
  names = ["c"] + [k for k, v in (("a", d), ("b", n)) if np.ptp(v) > 0]
  x = np.stack([np.ones_like(y)] + [d if k == "a" else n for k in names[1:]], axis=1)
  if len(names) == 1 or len(y) < len(names):
    raise ValueError(f"{len(y)} cells at one D and one N, or fewer than the coefficients")
  coef, *_ = np.linalg.lstsq(x, y, rcond=None)
  dof = len(y) - len(names)
  cov = None
  if dof > 0:
    resid = y - x @ coef
    cov = float(resid @ resid / dof) * np.linalg.inv(x.T @ x)
  out = {"c": None, "a": None, "b": None, "dof": dof, "cells": len(y)}
  out.update({k: float(v) for k, v in zip(names, coef)})
  out["cov"] = None if cov is None else {k: {m: float(cov[i, j]) for j, m in enumerate(names)}
                                        for i, k in enumerate(names)}
  return out


def usable(row: dict, q: str) -> bool:
  """Whether a cell's value of `q` enters the fit (finite, positive, inside the grid, a cell the
  lab did not refuse and not in the transient regime)."""
  v = row.get(q)
  if v is None or not math.isfinite(v) or v <= 0 or row.get("transient"):
    return False
  if row.get("refused") and q in ("s_min", "e_min", "b_crit", "b_zhang"):
    return False
  flag = RESOLVED.get(q)
  return flag is None or bool(row.get(flag))


def fit_quantity(cells: list[dict], q: str, replicates: list[dict] | None = None,
                 level: float = 0.95, n_key: str = "params") -> dict | None:
  """The fit of `q` over the usable cells (N from column `n_key`), with intervals for a and b
  (`method` says which); None with fewer cells than coefficients."""
  use = [c for c in cells if usable(c, q)]
  if q == "b_zhang" and any(c.get("zhang_b0") is not None for c in use):
    # Zhang's batch is 20% over linear scaling *from b0*: only cells with one b0 compare
    b0s = [c.get("zhang_b0") for c in use]
    use = [c for c in use if c.get("zhang_b0") == max(set(b0s), key=b0s.count)]
  ns = [c[n_key] for c in use]
  try:
    out = fit([c["tokens"] for c in use], ns, [c[q] for c in use])
  except ValueError:
    return None
  keys = [(c["params"], c["tokens"]) for c in use]
  by_rep: dict[int, dict] = {}
  for r in replicates or []:
    by_rep.setdefault(int(r["replicate"]), {})[(r["params"], r["tokens"])] = r.get(q)
  draws = {"a": [], "b": []}
  for values in by_rep.values():
    ys = [values.get(k) for k in keys]
    if all(v is not None and math.isfinite(v) and v > 0 for v in ys):
      f = fit([k[1] for k in keys], ns, ys)
      for e in draws:
        draws[e].append(f[e])
  t = stats.t.ppf((1 + level) / 2, out["dof"]) if out["dof"] > 0 else math.nan
  for e in ("a", "b"):
    ok = out[e] is not None and out["cov"] is not None
    half = t * math.sqrt(out["cov"][e][e]) if ok else None
    out[f"{e}_fit_ci"] = (out[e] - half, out[e] + half) if ok else (None, None)
  if by_rep:
    out["method"] = f"bootstrap over {len(draws['a'])} of {len(by_rep)} replicates"
    for e in ("a", "b"):
      out[f"{e}_ci"] = interval(draws[e], level) if out[e] is not None else (None, None)
  else:
    out["method"] = f"fit covariance, t with {out['dof']} degrees of freedom"
    for e in ("a", "b"):
      out[f"{e}_ci"] = out[f"{e}_fit_ci"]
  predicted = lambda c: out["c"] + (out["a"] or 0) * math.log(c["tokens"]) + \
      (out["b"] or 0) * math.log(c[n_key])
  out["residuals"] = [{"params": c["params"], "tokens": c["tokens"],
                       "residual": math.log(c[q]) - predicted(c)} for c in use]
  out["local_a"] = local_exponents(use, q)
  out["lack_of_fit_p"] = lack_of_fit(use, q, n_key)
  out["structured"] = out["lack_of_fit_p"] is not None and out["lack_of_fit_p"] < 1 - level
  out["quantity"], out["used"], out["n"] = q, keys, n_key
  return out


def local_exponents(cells: list[dict], q: str) -> list[dict]:
  """d log y / d log D between neighbouring budgets at each N: the exponent each interval of D
  gives on its own."""
  out = []
  for n in sorted({c["params"] for c in cells}):
    mine = sorted((c for c in cells if c["params"] == n), key=lambda c: c["tokens"])
    for lo, hi in zip(mine, mine[1:]):
      out.append({"params": n, "tokens": [lo["tokens"], hi["tokens"]],
                  "a": math.log(hi[q] / lo[q]) / math.log(hi["tokens"] / lo["tokens"])})
  return out


def lack_of_fit(cells: list[dict], q: str, n_key: str) -> float | None:
  """p-value of the F test of the power law in D against a free level per budget (same N
  term): small when the cells bend away from one exponent over the range of D. None with fewer
  than 3 budgets or no residual degrees of freedom left."""
  d = np.log([c["tokens"] for c in cells])
  n = np.log([c[n_key] for c in cells])
  y = np.log([c[q] for c in cells])
  levels = sorted(set(d.tolist()))
  with_n = [n] if np.ptp(n) > 0 else []
  law = np.stack([np.ones_like(y), d, *with_n], axis=1)
  free = np.stack([d == v for v in levels] + with_n, axis=1).astype(float)
  dof = len(y) - free.shape[1]
  if len(levels) < 3 or dof <= 0:
    return None
  rss = lambda x: float(np.sum((y - x @ np.linalg.lstsq(x, y, rcond=None)[0]) ** 2))
  rss_law, rss_free = rss(law), rss(free)
  extra = free.shape[1] - law.shape[1]
  if rss_free <= 0:
    return 0.0 if rss_law > 0 else 1.0
  f = (rss_law - rss_free) / extra / (rss_free / dof)
  return float(stats.f.sf(f, extra, dof))


def text(f: dict) -> str:
  """'a = 0.41 [0.22, 0.60] (fit [0.1, 0.7]), b = ...' of a fit: the method's interval, then the
  residual-based one where the method is the bootstrap."""
  def one(e, var):
    if f[e] is None:
      return f"{e} ({var}) not fitted"
    lo, hi = f[f"{e}_ci"]
    ci = "" if lo is None else f" [{lo:.2f}, {hi:.2f}]"
    flo, fhi = f.get(f"{e}_fit_ci", (None, None))
    if flo is not None and f["method"].startswith("bootstrap"):
      ci += f" (residuals: [{flo:.2f}, {fhi:.2f}])"
    return f"{e} ({var}) = {f[e]:.2f}{ci}"
  return f"{one('a', 'D')}, {one('b', 'N')}"


def plot(path: str, cells: list[dict], fits: dict, level: float, n_key: str = "params") -> bool:
  """One log-log panel per quantity: the cells against D, a colour per N, bars the lab's
  intervals, lines the fitted law at each N (hollow: not in the fit)."""
  plt = figures.pyplot()
  if plt is None:
    return False
  qs = list(fits)
  cols = min(3, len(qs))
  rows = math.ceil(len(qs) / cols)
  fig, axes = plt.subplots(rows, cols, figsize=(5 * cols, 4.3 * rows), squeeze=False)
  for ax in axes.flat[len(qs):]:
    ax.set_visible(False)
  sizes = sorted({c["params"] for c in cells})
  for ax, q in zip(axes.flat, qs):
    f = fits[q]
    for i, n in enumerate(sizes):
      mine = sorted((c for c in cells if c["params"] == n and c.get(q) is not None
                     and math.isfinite(c[q]) and c[q] > 0), key=lambda c: c["tokens"])
      for c in mine:
        lo, hi = c.get(f"{q}_lo"), c.get(f"{q}_hi")
        err = None if lo is None or not math.isfinite(hi) else [[c[q] - lo], [hi - c[q]]]
        inside = f is not None and (c["params"], c["tokens"]) in f["used"]
        ax.errorbar([c["tokens"]], [c[q]], yerr=err, fmt="o", c=f"C{i}", ms=5, capsize=2,
                    mfc=f"C{i}" if inside else "white",
                    label=f"N = {c[n_key]:,.0f}" if c is mine[0] else None)
      if f is not None and mine:
        xs = np.geomspace(min(c["tokens"] for c in cells), max(c["tokens"] for c in cells))
        n_fit = math.log(mine[0][n_key])
        ys = np.exp(f["c"] + (f["a"] or 0) * np.log(xs) + (f["b"] or 0) * n_fit)
        ax.plot(xs, ys, "-", c=f"C{i}", lw=1)
    ax.set(xscale="log", yscale="log", xlabel="D (tokens)", ylabel=q, title=LABELS.get(q, q)
           + ("" if f is None else f"\n{text(f)}"))
    ax.title.set_fontsize(8)
    ax.legend(fontsize=7)
  figures.save(fig, path, f"Power laws in D and N ({n_key} parameters; {level:.0%} intervals; "
               "hollow: not fitted, e.g. at the grid's edge)")
  return True


def build_parser():
  p = CliParser("-m tools.scaling_fit", __doc__, config=False, overrides=False)
  p.add_argument("csv", help="the scaling lab's CSV (python -m experiments.critical_batch_scaling)")
  p.add_argument("--boot", default="", help="bootstrap replicates (default <CSV stem>_boot.csv "
                 "where it exists; 'none': use the fit's covariance)")
  p.add_argument("--out", default="", help="writes OUT.png and OUT.json (default <CSV stem>_fit)")
  p.add_argument("--quantities", default=",".join(QUANTITIES))
  p.add_argument("--level", type=float, default=0.95, help="interval coverage")
  p.add_argument("--n", default="", choices=("", "params", "non_embedding"),
                 help="the column N is (default non_embedding where the CSV has it, as Step Law "
                      "and Kaplan count N; else params)")
  return p


def main(argv: list[str]) -> int:
  try:
    args, _ = build_parser().parse(argv)
    qs = [q for q in args.quantities.split(",") if q]
    cells = figures.read_table(args.csv, ("params", "tokens", *qs), LAB_CSV)
    n_key = args.n or ("non_embedding" if "non_embedding" in cells[0] else "params")
    figures.read_table(args.csv, (n_key,), LAB_CSV)
    if not 0 < args.level < 1:
      raise ConfigError(f"--level {args.level}: give a coverage between 0 and 1, e.g. 0.95")
  except ConfigError as e:
    print(f"error: {e}", file=sys.stderr)
    return 2
  stem = os.path.splitext(args.csv)[0]
  boot = args.boot or stem + "_boot.csv"
  replicates = figures.read_csv(boot) if boot != "none" and os.path.isfile(boot) else None
  out = args.out or stem + "_fit"
  fits = {q: fit_quantity(cells, q, replicates, args.level, n_key) for q in qs}
  span = lambda k: f"{min(c[k] for c in cells):,.0f}-{max(c[k] for c in cells):,.0f}"
  print(f"[scaling_fit] {len(cells)} cells: N ({n_key}) {span(n_key)} parameters, "
        f"D {span('tokens')} tokens; {args.level:.0%} intervals")
  for q, f in fits.items():
    if f is None:
      print(f"[scaling_fit] {q}: too few cells inside the grid to fit")
      continue
    print(f"[scaling_fit] {q} ~ D^a N^b: {text(f)}  ({f['cells']} cells; {f['method']})")
    print("[scaling_fit]     residuals (log): " + ", ".join(
        f"N {r['params']:,.0f} D {r['tokens']:,.0f}: {r['residual']:+.2f}" for r in f["residuals"]))
    if f["local_a"]:
      print("[scaling_fit]     local exponents in D: " + ", ".join(
          f"N {x['params']:,.0f} {x['tokens'][0]:,.0f}-{x['tokens'][1]:,.0f}: {x['a']:+.2f}"
          for x in f["local_a"]))
    if f["lack_of_fit_p"] is not None:
      print(f"[scaling_fit]     lack of fit in D (F test against a level per budget): p = "
            f"{f['lack_of_fit_p']:.2g}" + ("  STRUCTURED: one power law does not describe this "
                                          "range; read the local exponents" if f["structured"]
                                          else ""))
    for paper, a, b, how in PAPERS.get(q, []):
      said = ", ".join(f"{e} = {v:g}" for e, v in (("a", a), ("b", b)) if v is not None)
      print(f"[scaling_fit]     {paper}: {said or 'no exponent'} ({how})")
  with open(out + ".json", "w") as fh:
    json.dump({q: f for q, f in fits.items()}, fh, indent=1, default=str)
  plotted = plot(out + ".png", cells, fits, args.level, n_key)
  print(f"[scaling_fit] wrote {out}.json" + (f", {out}.png" if plotted else figures.NO_PLOT))
  return 0


if __name__ == "__main__":
  sys.exit(main(sys.argv[1:]))

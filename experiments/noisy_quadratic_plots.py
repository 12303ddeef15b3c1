"""The figures of `python -m experiments.noisy_quadratic`: one per comparison (tools/figures.py)."""
from __future__ import annotations

import numpy as np

from tools import figures


def draw(out: str, exact: dict, sw: dict, me: dict, ap: dict, pr: dict, ad: dict, args
         ) -> list[str]:
  """OUT_{sweep,meter,autopilot,probe,adam}.png; the paths written ([] without matplotlib)."""
  plt = figures.pyplot()
  if plt is None:
    return []
  paths = []
  for name, fn in (("sweep", _sweep), ("meter", _meter), ("autopilot", _autopilot),
                   ("probe", _probe), ("adam", _adam)):
    path = f"{out}_{name}.png"
    fn(plt, path, exact, sw, me, ap, pr, ad, args)
    paths.append(path)
  return paths


def _sweep(plt, path, exact, sw, me, ap, pr, ad, args):
  fig, (ax1, ax2) = plt.subplots(1, 2, figsize=(11, 4.2))
  bs = np.geomspace(args.batch_sizes[0] / 1.5, args.batch_sizes[-1] * 1.5)
  for i, (name, e) in enumerate(exact.items()):
    ax1.plot(e["batches"], e["steps"], "-", c=f"C{i + 1}", lw=1.5 if i == 0 else 1,
             label=f"exact S(B), {name} (fit B_crit {e['b_crit_fit']:.0f})")
  ax1.plot(bs, sw["s_min"] + sw["e_min"] / bs, "--", c="C0", lw=1,
           label=f"fit to the sweep: B_crit {sw['b_crit']:.0f} ({sw['lo']:.0f}-{sw['hi']:.0f})")
  other = [r for b in sw["pool"] for r in sw["pool"][b].values() if not r["best"]
           and np.isfinite(r["steps"])]
  ax1.scatter([r["batch"] for r in other], [r["steps"] for r in other], c="0.7", s=12,
              label="other rates")
  ax1.scatter(args.batch_sizes, sw["steps"], c="C0", zorder=3,
              label=f"SGD sweep, mean of {args.seeds} seeds")
  ax1.set(xscale="log", yscale="log", xlabel="batch", ylabel=f"steps to loss {args.target:g}",
          title="steps to the target: sweep vs exact")
  ax1.legend(fontsize=7)
  e = exact["sgd"]
  ax2.plot(e["batches"], e["rates"], "-", c="C1", label="exact best rate (SGD)")
  ax2.scatter(args.batch_sizes, [sw["best"][b]["rate"] for b in args.batch_sizes], c="C0",
              zorder=3, label="the sweep's best rate")
  ax2.set(xscale="log", yscale="log", xlabel="batch", ylabel="rate", title="best rate per batch")
  ax2.legend(fontsize=8)
  figures.save(fig, path, f"NQM ({args.dim} coordinates): the critical-batch sweep")


def _meter(plt, path, exact, sw, me, ap, pr, ad, args):
  fig, (ax1, ax2) = plt.subplots(1, 2, figsize=(11, 4.2))
  for i, b in enumerate(sorted(sw["best"])):
    r = sw["best"][b]
    n = len(r["analytic_b_simple"])
    x = np.arange(1, n + 1) * b
    ax1.plot(x, r["analytic_b_simple"], "-", c=f"C{i % 10}", lw=1, label=f"B={b}")
    logged = r["rows"]["noise_scale"][:n]
    shown = np.isfinite(logged).any(axis=1)  # steps where some seed's meter has a value
    ax1.plot(x[shown], np.nanmedian(logged[shown], axis=1), ":", c=f"C{i % 10}", lw=1)
  ax1.set(xscale="log", yscale="log", xlabel="examples", ylabel="B_simple",
          title="analytic (solid) and logged (dotted, median of seeds)")
  ax1.legend(fontsize=7, ncol=2)
  per = me["per_batch"]
  bs = sorted(per)
  for j, (key, what) in enumerate((
      ("b_simple", "logged / analytic B_simple"),
      ("estimator", "its estimator part: logged / noise-free meter on the run"),
      ("trajectory", "its trajectory part: noise-free meter on the run / analytic"))):
    if key not in per[bs[0]]:
      continue
    q = lambda k: np.array([per[b][key][k] or np.nan for b in bs], float)
    ax2.errorbar(np.array(bs) * 1.12 ** (j - 1), q("median"), capsize=3, c=f"C{[0, 1, 4][j]}",
                 yerr=[q("median") - q("p10"), q("p90") - q("median")], fmt="o",
                 ms=5 if j == 0 else 3, label=f"{what} (median, p10-p90)")
  ax2.plot(bs, [per[b]["b_noise"]["median"] or np.nan for b in bs], "s", c="C2", ms=4,
           label="logged / analytic B_noise (median)")
  ax2.axhspan(0.8, 1.25, color="0.85", zorder=0, label="[0.8, 1.25]")
  for y in (0.5, 2):
    ax2.axhline(y, c="0.6", ls=":", lw=0.8)
  ax2.axhline(1, c="0.5", lw=0.8)
  ax2.set(xscale="log", yscale="log", xlabel="batch", ylabel="ratio",
          title="the meter against the analytic noise scale")
  ax2.set_ylim(0.12, 8)
  ax2.legend(fontsize=6, loc="lower center")
  figures.save(fig, path, "NQM: the gradient-noise meter (optim/noise_scale.py)")


def _autopilot(plt, path, exact, sw, me, ap, pr, ad, args):
  fig, (ax1, ax2) = plt.subplots(1, 2, figsize=(11, 4.2))
  for i, r in enumerate(ap["runs"]):
    steps = np.arange(1, len(r["batch"]) + 1)
    ax1.step(steps, r["batch"], where="post", c=f"C{i}", lw=1,
             label="the autopilot's batch" if i == 0 else None)
    ax2.plot(steps, r["logged"], ":", c=f"C{i}", lw=1, label="logged" if i == 0 else None)
  r = ap["runs"][0]
  steps = np.arange(1, len(r["batch"]) + 1)
  ax1.step(steps, r["prescribed"], where="post", c="k", ls="--", lw=1,
           label=f"prescribed: smallest batch with {ap['margin']:g} x batch >= analytic B_simple")
  ax2.plot(steps, r["analytic"], "-", c="k", lw=1, label="analytic (seed 0's batches)")
  ax1.set(xscale="log", yscale="log", xlabel="step", ylabel="batch",
          title=f"batch over training (median ratio {ap['ratio']['median']:.2f})")
  ax2.set(xscale="log", yscale="log", xlabel="step", ylabel="B_simple",
          title="the noise scale the autopilot reads")
  ax1.legend(fontsize=7)
  ax2.legend(fontsize=7)
  figures.save(fig, path, f"NQM: the batch autopilot (SGD at rate {args.auto_rate:g})")


def _probe(plt, path, exact, sw, me, ap, pr, ad, args):
  fig, (ax1, ax2) = plt.subplots(1, 2, figsize=(11, 4.2))
  pts = pr["points"]
  loss = [p["loss"] for p in pts]
  ax1.plot(loss, [p["critical_batch"] for p in pts], "o-", label="branching probe")
  ax1.plot(loss, [p["critical_batch_analytic"] for p in pts], "s--", label="the rule on the "
           "expected losses")
  ax1.plot(loss, [p["b_simple"] for p in pts], ":", c="C2", label="B_simple (expected state)")
  ax1.plot(loss, [p["b_noise"] for p in pts], ":", c="C3", label="B_noise (expected state)")
  ax1.set(xscale="log", yscale="log", xlabel="loss at the branch point", ylabel="batch",
          title="critical batch by branching")
  ax1.invert_xaxis()
  ax1.legend(fontsize=7)
  top = 6 * pr["tolerance"]  # branches beyond it (diverged ones) drawn at the edge
  clip = lambda y: min(y, top) if np.isfinite(y) else top
  for i, p in enumerate(pts):
    ks = sorted(p["measured"])
    base_m, base_a = p["measured"][1], p["analytic"][1]
    ax2.plot([k * args.batch_sizes[0] for k in ks],
             [clip(p["measured"][k] / base_m - 1) for k in ks], "o-", c=f"C{i}", ms=3,
             label=f"step {p['step']}")
    ax2.plot([k * args.batch_sizes[0] for k in ks],
             [clip(p["analytic"][k] / base_a - 1) for k in ks], "--", c=f"C{i}", lw=1)
  ax2.axhline(pr["tolerance"], c="0.5", ls=":", lw=1, label=f"tolerance {pr['tolerance']:g}")
  ax2.set_ylim(-top / 3, top * 1.05)
  ax2.set(xscale="log", xlabel="branch batch", ylabel="smoothed loss / k = 1's - 1",
          title=f"after {pr['examples']:,} examples (dashed: expected; top edge: beyond)")
  ax2.legend(fontsize=7)
  figures.save(fig, path, "NQM: the branching probe (tools/batch_probe.py's rule)")


def _adam(plt, path, exact, sw, me, ap, pr, ad, args):
  fig, ax = plt.subplots(1, 1, figsize=(6.5, 4.2))
  for i, a in enumerate(ad["batches"]):
    ax.plot(np.arange(1, len(a["loss_adam"]) + 1), a["loss_adam"], "-", c=f"C{i}", lw=1,
            label=f"adamw, batch {a['batch']} (mean of {args.seeds})")
    ax.plot(np.arange(1, len(a["loss_predicted"]) + 1), a["loss_predicted"], "--", c=f"C{i}",
            lw=1, label="fixed-P prediction")
  ax.axhline(args.target, c="0.5", ls=":", lw=1)
  ax.set(xscale="log", yscale="log", xlabel="step", ylabel="loss",
         title="adamw vs momentum SGD with P = 1/sqrt(c/B) (its best rate)")
  ax.legend(fontsize=7)
  figures.save(fig, path, "NQM: Adam against its late-phase stand-in (an approximation)")

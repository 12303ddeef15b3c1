"""The batch-size instruments against a known answer: the noisy quadratic model (experiments/nqm.py)
trained by the stack's own optimizer factory, meter and autopilot, against its closed forms.

    python -m experiments.noisy_quadratic [--quick] [--json PATH] [--out docs/noisy_quadratic]
        [--seeds 8] [--dim 1000] [--power 1] [--target 0.1] [--config.optim.KEY=VALUE ...]

1. sweep: SGD at batches 8..1024, rates bracketed (tools.tradeoff), steps to the target from the
   mean over seeds, McCandlish's fit bootstrapped over seeds, against the exact S(B) and B_crit.
2. meter: the logged noise_scale over the analytic B_simple (and B_noise) along those runs.
3. autopilot: its batch over the one its rule prescribes from the analytic B_simple.
4. probe: tools.batch_probe's rule on branches from checkpoints, against it on expected losses.
5. Adam against the fixed-preconditioner prediction (an approximation).
Outputs: OUT.csv (the sweep's runs), OUT.json (or --json; `meter_ratio_*` = `meter_estimator_
ratio` x `meter_trajectory_ratio`, experiments/nqm_meter.py), OUT_{sweep,meter,autopilot,probe,
adam}.png. Results: docs/noisy_quadratic.md
"""
from __future__ import annotations

import json
import math
import sys

import jax
import numpy as np

from experiments import common, nqm, nqm_meter
from experiments import noisy_quadratic_plots as plots
from optim.autopilot import AutoConfig
from tools import batch_probe, batch_sweep
from tools.tradeoff import next_multipliers

QUICK = dict(dim=100, seeds=5, batch_sizes=[8, 64, 512], bootstrap=50, auto_seeds=1,
             probe_seeds=8, probe_factors=[2, 4, 8, 16], probe_points=2, adam_batches=[64])


def build_parser():
  p = common.parser("noisy_quadratic", __doc__, seeds=False)
  p.add_argument("--quick", action="store_true", help="a small problem and few runs (tests)")
  p.add_argument("--json", default="", help="where the numbers go (default OUT.json)")
  p.add_argument("--dim", type=int, default=1000, help="coordinates (h_i = i^-power)")
  p.add_argument("--power", type=float, default=1.0)
  p.add_argument("--target", type=float, default=0.1, help="target loss (from 1/2 sum h_i)")
  p.add_argument("--seeds", type=int, default=8, help="stochastic runs per sweep point")
  p.add_argument("--batch_sizes", type=common.ints, default="8,16,32,64,128,256,512,1024")
  p.add_argument("--bootstrap", type=int, default=400, help="replicates for B_crit's interval")
  p.add_argument("--auto_rate", type=float, default=0.1, help="the autopilot run's SGD rate")
  p.add_argument("--auto_seeds", type=int, default=2)
  p.add_argument("--probe_rate", type=float, default=0.05,
                 help="the probe's base run rate at the smallest batch (linear rule)")
  p.add_argument("--probe_factors", type=common.ints, default="2,4,8,16,32,64")
  p.add_argument("--probe_tolerance", type=float, default=0.02,
                 help="loss difference still 'the same', a fraction of the loss at the point")
  p.add_argument("--probe_seeds", type=int, default=16, help="continuations per branch")
  p.add_argument("--probe_points", type=int, default=4, choices=range(1, 5),
                 help="branch points (where the loss is 0.3, 0.15, 0.08, 0.05 of its start)")
  p.add_argument("--adam_batches", type=common.ints, default="8,64,512")
  return p


def parse(argv):
  p = build_parser()
  args, overrides = p.parse(argv)
  if args.quick:
    for k, v in QUICK.items():
      setattr(args, k, v)
  args.batch_sizes = sorted(set(args.batch_sizes))
  if args.seeds < 2 or args.dim < 2 or not args.target > 0 or args.batch_sizes[0] < 2:
    p.error("--seeds >= 2, --dim >= 2, --target > 0 and batches >= 2 (two small batches each)")
  args.json = args.json or args.out + ".json"
  return args, overrides


def quantiles(x) -> dict:
  x = np.asarray(x, float)
  x = x[np.isfinite(x)]
  if not len(x):
    return {"median": None, "p10": None, "p90": None, "n": 0}
  return {"median": float(np.median(x)), "p10": float(np.percentile(x, 10)),
          "p90": float(np.percentile(x, 90)), "n": int(len(x))}


# ------------------------------------------------------------------------------------------------
# 1. The analytic S(B) and the stochastic sweep


def analytic(problem, args) -> dict:
  """Exact S(B), its fit and limits for SGD, momentum 0.9 and the fixed preconditioner (SGD
  alone with --quick)."""
  arms = {"sgd": (0.0, None)}
  if not args.quick:
    arms.update({"momentum 0.9": (0.9, None), "preconditioner h^-1/2": (0.0, problem.h ** -0.5)})
  out = {}
  for name, (mu, p) in arms.items():
    out[name] = e = nqm.critical_batch(problem, args.batch_sizes, args.target, momentum=mu,
                                       precond=p)
    print(f"[nqm] analytic {name}: B_crit {e['b_crit_fit']:.1f} (fit of the exact S(B) over "
          f"{args.batch_sizes[0]}-{args.batch_sizes[-1]}); limits S_min {e['s_min']:.1f}, E_min "
          f"{e['e_min']:,.0f}, E_min/S_min {e['b_crit_limits']:.1f}", flush=True)
  return out


COARSE, FINE = 2.0, 2 ** 0.25  # the rate grid: bracketed by doubling, then refined in between


def sweep(problem, base, args, exact: dict) -> dict:
  """SGD at every batch B, `args.seeds` runs per rate for 2 x the exact S(B) + 50 steps (only
  the budget comes from the closed form). The rates: multiples of 0.25 sqrt(B / B_0), bracketed
  by tools.tradeoff's `next_multipliers` (x2 beyond a winning edge) until the fastest is inside,
  then refined by 2^(1/4) between its neighbours and by 2^(1/8) beside the best (the optimum
  sits at the edge where the noise floor meets the target: steps rise ~8% one 2^(1/4) below
  it); every round of every batch one program. Steps
  to the target from the mean loss over the seeds (`nqm.crossing`); the fit and its bootstrap over
  seeds (the best rate chosen again each time, among those within 30% of the best)."""
  batches = args.batch_sizes
  budget = {b: int(2 * s) + 50 for b, s in zip(batches, exact["steps"])}
  center = {b: 0.25 * math.sqrt(b / batches[0]) for b in batches}
  pool = {b: {} for b in batches}

  def run_round(pending):
    keys = [(b, m) for b in pending for m in pending[b]]
    jobs = [(nqm.run_config(base, "sgd", center[b] * m, b), budget[b], args.seeds, b)
            for b, m in keys]
    for (b, m), (rows, _) in zip(keys, nqm.run_many(problem, jobs)):
      pool[b][m] = {"batch": b, "rate": center[b] * m, "rows": rows,
                    "steps": nqm.crossing(rows["loss"], b, args.target)}

  scores = lambda b: {m: r["steps"] if math.isfinite(r["steps"]) else None
                      for m, r in pool[b].items()}
  pending = {b: [0.5, 1.0, 2.0] for b in batches}
  for _ in range(8):
    run_round(pending)
    pending = {}
    for b in batches:
      new = next_multipliers(scores(b), factor=COARSE)
      if not any(scores(b).values()):  # nothing reached: below if any diverged, else above
        diverged = any(not np.isfinite(r["rows"]["loss"][-1]).all() for r in pool[b].values())
        new = [min(pool[b]) / COARSE] if diverged else [max(pool[b]) * COARSE]
      new = [m for m in new if m not in pool[b]]
      if new:
        pending[b] = new
    if not pending:
      break
  for factor, ks in ((FINE, (-3, -2, -1, 1, 2, 3)), (FINE ** 0.5, (-1, 1))):  # refined twice
    best_m = {b: min(pool[b], key=lambda m: pool[b][m]["steps"]) for b in batches}
    run_round({b: [best_m[b] * factor ** k for k in ks] for b in batches})
  best = {}
  for b in batches:
    top = min(pool[b], key=lambda m: pool[b][m]["steps"])
    for m, r in pool[b].items():
      r["best"] = m == top
      if m != top:  # only the best run's meter readings are kept
        r["rows"] = {"loss": r["rows"]["loss"]}
    best[b] = r = pool[b][top]
    s_exact = exact["steps"][batches.index(b)]
    print(f"[nqm] sweep batch {b}: best rate {r['rate']:.3g} of {len(pool[b])} (interior: "
          f"{min(pool[b]) < top < max(pool[b])}), {r['steps']:.1f} steps to the target (exact "
          f"{s_exact:.1f} at rate {exact['rates'][batches.index(b)]:.3g})", flush=True)
  fit = batch_sweep.fit_tradeoff(batches, [best[b]["steps"] for b in batches])
  rng, boot = np.random.default_rng(0), []
  near = {b: [r for r in pool[b].values() if r["steps"] <= 1.3 * best[b]["steps"]]
          for b in batches}
  for _ in range(args.bootstrap):
    s = []
    for b in batches:
      pick = rng.integers(0, args.seeds, args.seeds)
      s.append(min(nqm.crossing(r["rows"]["loss"][:, pick], b, args.target) for r in near[b]))
    if all(math.isfinite(x) for x in s):
      boot.append(batch_sweep.fit_tradeoff(batches, s).b_crit)
  lo, hi = (float(np.percentile(boot, q)) for q in (2.5, 97.5))
  print(f"[nqm] sweep fit: B_crit {fit.b_crit:.1f} (95% bootstrap over seeds {lo:.1f}-"
        f"{hi:.1f}, {len(boot)} replicates), S_min {fit.s_min:.1f}, E_min {fit.e_min:,.0f}",
        flush=True)
  return {"pool": pool, "best": best, "b_crit": fit.b_crit, "lo": lo, "hi": hi,
          "s_min": fit.s_min, "e_min": fit.e_min, "steps": [best[b]["steps"] for b in batches]}


# ------------------------------------------------------------------------------------------------
# 2. The meter along the sweep's best runs


def meter(problem, sw: dict, base) -> dict:
  """Logged B_simple over the analytic one at the expected state (and over B_noise, and over the
  truth at each run's own iterate, tr(C) / |G(theta_t)|^2) at every step up to the target,
  every seed; `iterate_spread`: that truth over the expected state's (how far one run's own
  noise scale strays from the mean's); the others (`estimator`, ...): `nqm_meter.parts`."""
  per_batch = {}
  pooled = {k: [] for k in ("b_simple", "b_noise", "at_iterate", "iterate_spread",
                            *nqm_meter.PARTS)}
  for b, r in sw["best"].items():
    rows = r["rows"]
    n = min(len(rows["loss"]), math.ceil(r["steps"]))
    cur = nqm.curves(problem, [r["rate"]], [b], n)
    logged = rows["noise_scale"][:n]
    truth = rows["b_simple_true"][:n]
    split = nqm_meter.parts(problem, nqm.run_config(base, "sgd", r["rate"], b), rows,
                            cur["b_simple"][:, 0], n)
    ratios = {"b_simple": logged / cur["b_simple"][1:n + 1], "b_noise":
              logged / cur["b_noise"][1:n + 1], "at_iterate": logged / truth,
              "iterate_spread": truth / cur["b_simple"][1:n + 1],
              **{k: split[k] for k in nqm_meter.PARTS}}
    per_batch[b] = {k: quantiles(v) for k, v in ratios.items()}
    per_batch[b]["with_value"] = float(np.isfinite(logged).mean())
    why = rows["noise_why"][:n]  # the meter's reason for no value (optim.noise_scale.readout)
    per_batch[b].update(zip(("too_few", "g_sq_not_positive", "imprecise"),
                            (float(np.mean(why == k)) for k in (1, 2, 3))))
    r["analytic_b_simple"] = cur["b_simple"][1:n + 1, 0]
    for k, v in ratios.items():
      pooled[k].append(v.ravel())
    print(f"[nqm] meter batch {b}: " + "; ".join(
        f"{what} {q['median']:.3g} ({q['p10']:.3g}-{q['p90']:.3g})" for what, q in (
            (k, per_batch[b][k]) for k in ("b_simple", "at_iterate", "estimator", "trajectory")))
          + f" (median (p10-p90) over analytic, the run's iterate, noise-free, analytic); "
          "{with_value:.0%} of steps with a value, none: {g_sq_not_positive:.1%} as |G|^2 <= 0, "
          "{imprecise:.1%} as its relative standard error > {bound:g}".format(
              **per_batch[b], bound=base.optim.noise_scale_max_rse), flush=True)
  return {"per_batch": per_batch, **{k: quantiles(np.concatenate(v)) for k, v in pooled.items()}}


# ------------------------------------------------------------------------------------------------
# 3. The autopilot


def autopilot(problem, base, args) -> dict:
  """SGD at a constant `--auto_rate` from the smallest batch under data.batch_ramp = "auto"
  (up to the largest), to the target; its batch over the one its rule prescribes from the
  analytic B_simple along its own batches, after its first growth."""
  cfg = nqm.run_config(base, "sgd", args.auto_rate, args.batch_sizes[0], ramp="auto")
  cfg.data.batch_auto.update(max=args.batch_sizes[-1], factor=2)
  auto = AutoConfig.from_config(cfg.data)
  # at most the steps to the target at the smallest batch (the batch only grows)
  alone = nqm.curves(problem, [args.auto_rate], [args.batch_sizes[0]], 32768)["loss"]
  steps = int(min(nqm.steps_to(alone, args.target)[0], 32768)) + 10
  runs, ratios = [], []
  for seed in range(args.auto_seeds):
    rows, pilot = nqm.autopilot_run(problem, cfg, steps,
                                    seed=seed, stop_loss=args.target)
    batch = np.array([r["batch"] for r in rows], float)
    cur = nqm.curves(problem, np.array([r["rate"] for r in rows])[:, None], batch[:, None],
                     len(rows))
    analytic = cur["b_simple"][1:, 0]
    sizes = np.array(auto.sizes(), float)
    prescribed = np.array([sizes[min(np.searchsorted(auto.margin * sizes, x), len(sizes) - 1)]
                           for x in analytic])
    first = pilot.changes[0].step if pilot.changes else len(rows) + 1
    ratio = batch[first - 1:] / prescribed[first - 1:]
    ratios.append(ratio)
    runs.append({"batch": batch, "prescribed": prescribed, "analytic": analytic,
                 "logged": np.array([r["noise_scale"] for r in rows]), "first": first,
                 "changes": [c.describe() for c in pilot.changes]})
    print(f"[nqm] autopilot seed {seed}: {len(rows)} steps, " + "; ".join(runs[-1]["changes"])
          + f"; batch / prescribed after the first growth: median "
          f"{np.median(ratio) if len(ratio) else math.nan:.3g}", flush=True)
  pooled = np.concatenate(ratios)
  return {"runs": runs, "margin": auto.margin, "ratio": quantiles(pooled),
          "within_2x": float(np.mean((pooled <= 2) & (pooled >= 0.5))) if len(pooled) else None}


# ------------------------------------------------------------------------------------------------
# 4. The branching probe


def probe(problem, base, args) -> dict:
  """A run at the smallest batch b (SGD, `--probe_rate`, the linear rule) checkpointed where its
  expected loss crosses 0.3, 0.15, 0.08 and 0.05 of its start; from each, branches at k b
  (`--probe_factors`) train the same examples (`--probe_seeds` continuations each), scored by
  tools.batch_probe's `smoothed` mean loss at 4 equal-example points and `critical_factor`
  (tolerance: `--probe_tolerance` x the loss at the point). The analytic critical batch: the
  same rule on the expected losses from the checkpoint (closed form). Beside them B_simple and
  B_noise at the base run's expected state there (and B_simple at the checkpoint itself)."""
  b0, a0, evals = args.batch_sizes[0], args.probe_rate, 4
  factors = [1] + sorted(args.probe_factors)
  examples = b0 * factors[-1] * evals * 4
  start = problem.loss(problem.theta0 ** 2)
  levels = [0.3, 0.15, 0.08, 0.05][:args.probe_points]  # of the starting loss
  base_run = {k: v[:, 0] for k, v in nqm.curves(problem, [a0], [b0], 32768).items()}
  at = [int(np.argmax(base_run["loss"] <= f * start)) for f in levels]
  config = lambda k, t: nqm.run_config(base, "sgd", a0, k * b0, lr_rule="linear",
                                       reference_batch=b0,
                                       ramp=f"{b0}:0,{k * b0}:{t * b0}" if k > 1 else "")
  first = lambda tree: jax.tree.map(lambda x: x[0], tree)  # seed 0's state
  # the base run to each point (one program: the longer runs repeat the shorter ones' steps)
  states = [first(final) for _, final in nqm.run_many(
      problem, [(config(1, 0), t, 1, 1000) for t in at])]
  lengths = {k: examples // (k * b0) for k in factors}
  branches = nqm.run_many(problem, [(config(k, t), lengths[k], args.probe_seeds, k, state)
                                    for t, state in zip(at, states) for k in factors])
  points = []
  for i, (t, state) in enumerate(zip(at, states)):
    theta = np.asarray(state[0]["theta"], np.float64)
    here = nqm.Problem(problem.h, problem.c, theta)
    loss0 = here.loss(theta ** 2)
    tol = args.probe_tolerance * loss0
    measured, exact = {}, {}
    for k, (rows, _) in zip(factors, branches[i * len(factors):(i + 1) * len(factors)]):
      n = lengths[k]
      idx = [j * n // evals - 1 for j in range(1, evals + 1)]
      measured[k] = batch_probe.smoothed(list(rows["loss"].mean(1)[idx]))
      expected = nqm.curves(here, [a0 * k], [k * b0], n)["loss"][1:, 0]
      exact[k] = batch_probe.smoothed(list(expected[idx]))
    k_m, k_e = (batch_probe.critical_factor(x, tol) for x in (measured, exact))
    points.append({"step": t, "loss": loss0, "critical_batch": k_m * b0,
                   "critical_batch_analytic": k_e * b0, "ratio": k_m / k_e,
                   "censored": ">=" if k_m == factors[-1] else "",
                   "b_simple": float(base_run["b_simple"][t]),
                   "b_noise": float(base_run["b_noise"][t]),
                   "b_simple_checkpoint": float(here.b_simple(theta ** 2)),
                   "measured": measured, "analytic": exact})
    print(f"[nqm] probe at step {t} (loss {loss0:.3f}): critical batch {k_m * b0} vs analytic "
          f"{k_e * b0} (B_simple there {points[-1]['b_simple']:.0f}, B_noise "
          f"{points[-1]['b_noise']:.0f})", flush=True)
  return {"points": points, "ratio_median": float(np.median([p["ratio"] for p in points])),
          "examples": examples, "tolerance": args.probe_tolerance}


# ------------------------------------------------------------------------------------------------
# 5. Adam against the fixed-preconditioner prediction


def adam(problem, base, args) -> dict:
  """adamw (the base config's b1, b2, eps) against heavy-ball SGD with momentum b1, rate
  lr (1 - b1) and P = 1 / (sqrt(c / B) + eps): Adam's late phase, where its second moment is
  the gradient noise c / B (an approximation: early, v also holds h^2 theta^2, and v_hat is an
  average, not E g^2). Adam runs at the rate lr that is best for the prediction."""
  o = base.optim
  p = {b: 1.0 / (np.sqrt(problem.c / b) + float(o.eps)) for b in args.adam_batches}
  rate = {b: nqm.best_rate(problem, b, args.target, momentum=float(o.b1), precond=p[b])[0]
          / (1 - o.b1) for b in args.adam_batches}
  predicted = lambda b, steps: nqm.curves(problem, [rate[b] * (1 - o.b1)], [b], steps,
                                          float(o.b1), precond=p[b])
  steps = {b: int(min(nqm.steps_to(predicted(b, 32768)["loss"], args.target)[0], 16384) * 2)
           + 50 for b in args.adam_batches}
  runs = nqm.run_many(problem, [(nqm.run_config(base, "adamw", rate[b], b), steps[b],
                                 args.seeds, 7 * b) for b in args.adam_batches])
  out = []
  for b, (rows, _) in zip(args.adam_batches, runs):
    pred = predicted(b, steps[b])
    s_adam = nqm.crossing(rows["loss"], b, args.target)
    s_pred = float(nqm.steps_to(pred["loss"], args.target)[0])
    n = min(steps[b], math.ceil(s_adam) if math.isfinite(s_adam) else steps[b])
    row = {"batch": b, "rate": rate[b], "steps_adam": s_adam, "steps_predicted": s_pred,
           "loss_adam": rows["loss"].mean(1), "loss_predicted": pred["loss"][1:, 0]}
    if "noise_scale_precond" in rows:  # the meter's preconditioned reading, when it has one
      logged = rows["noise_scale_precond"][:n]
      row.update(precond_ratio=quantiles(logged / pred["b_precond"][1:n + 1]),
                 precond_ratio_at_iterate=quantiles(logged / rows["b_precond_true"][:n]))
    out.append(row)
    at = row.get("precond_ratio_at_iterate") or {}
    print(f"[nqm] adam batch {b} (lr {rate[b]:.3g}): {s_adam:.1f} steps to the target, the "
          f"fixed-P prediction {s_pred:.1f}" + (
              f"; logged noise_scale_precond / tr(P C) / G^T P G at the iterate median "
              f"{at['median']:.3g} ({at['n']} readings)" if at.get("median") else ""), flush=True)
  return {"batches": out}


# ------------------------------------------------------------------------------------------------
# The experiment


def experiment(args, cfg) -> list[dict]:
  problem = nqm.Problem.power_law(args.dim, args.power)
  print(f"[nqm] {args.dim} coordinates, h_i = i^-{args.power:g}, c = h, theta0 = 1: loss "
        f"{problem.loss(problem.theta0 ** 2):.3f} -> target {args.target:g}", flush=True)
  exact = analytic(problem, args)
  sw = sweep(problem, cfg, args, exact["sgd"])
  me = meter(problem, sw, cfg)
  ap = autopilot(problem, cfg, args)
  pr = probe(problem, cfg, args)
  ad = adam(problem, cfg, args)
  numbers = {
      "b_crit_analytic": exact["sgd"]["b_crit_fit"], "b_crit_fitted": sw["b_crit"],
      "b_crit_fitted_lo": sw["lo"], "b_crit_fitted_hi": sw["hi"],
      "meter_ratio_median": me["b_simple"]["median"], "meter_ratio_p10": me["b_simple"]["p10"],
      "meter_ratio_p90": me["b_simple"]["p90"],
      "meter_ratio_per_batch": {str(b): q for b, q in me["per_batch"].items()},
      "meter_ratio_b_noise": me["b_noise"], "meter_ratio_at_iterate": me["at_iterate"],
      "iterate_over_expected": me["iterate_spread"],
      **{f"meter_{k}_ratio{s}": v for k in nqm_meter.PARTS for s, v in (
          ("", me[k]), ("_per_batch", {str(b): q[k] for b, q in me["per_batch"].items()}))},
      "autopilot_ratio_median": ap["ratio"]["median"], "autopilot_ratio": ap["ratio"],
      "autopilot_within_2x": ap["within_2x"],
      "autopilot_changes": [r["changes"] for r in ap["runs"]],
      "probe_ratio_median": pr["ratio_median"],
      "probe_points": [{k: v for k, v in p.items() if k not in ("measured", "analytic")}
                       for p in pr["points"]],
      "analytic": exact, "sweep_steps": dict(zip(map(str, args.batch_sizes), sw["steps"])),
      "sweep_s_min": sw["s_min"], "sweep_e_min": sw["e_min"],
      "adam": [{k: v for k, v in a.items() if not k.startswith("loss_")} for a in ad["batches"]],
      "settings": {k: getattr(args, k) for k in (
          "quick", "dim", "power", "target", "seeds", "batch_sizes", "bootstrap", "auto_rate",
          "auto_seeds", "probe_rate", "probe_factors", "probe_tolerance", "probe_seeds",
          "probe_points", "adam_batches")},
      "meter_settings": {k: cfg.optim.get(k) for k in cfg.optim if k.startswith("noise_scale")},
      "command": "python -m experiments.noisy_quadratic " + " ".join(args.argv)}
  with open(args.json, "w") as f:
    json.dump(numbers, f, indent=1, default=float)
  rows = [{"batch": r["batch"], "rate": r["rate"], "steps": r["steps"], "best": r["best"]}
          for b in sw["pool"] for r in sw["pool"][b].values()]
  common.write(args, rows)
  drawn = plots.draw(args.out, exact, sw, me, ap, pr, ad, args)
  print(f"[nqm] B_crit: analytic {numbers['b_crit_analytic']:.1f}, sweep {sw['b_crit']:.1f} "
        f"({sw['lo']:.1f}-{sw['hi']:.1f}); meter logged / analytic median "
        f"{numbers['meter_ratio_median']:.3g} (p10 {numbers['meter_ratio_p10']:.3g}, p90 "
        f"{numbers['meter_ratio_p90']:.3g}); autopilot / prescribed median "
        f"{numbers['autopilot_ratio_median']:.3g}; probe / analytic median "
        f"{numbers['probe_ratio_median']:.3g}", flush=True)
  print(f"[nqm] wrote {args.json}, {args.out}.csv" + (", " + ", ".join(drawn) if drawn else
                                                     common.figures.NO_PLOT))
  return rows


def main(argv: list[str]) -> int:
  def parse_with_argv(a):
    args, overrides = parse(a)
    args.argv = list(a)
    return args, overrides
  return common.main("nqm", parse_with_argv, experiment, argv, seeds_inside=True)


if __name__ == "__main__":
  sys.exit(main(sys.argv[1:]))

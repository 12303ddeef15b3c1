"""The scaling lab's beta2 bracket: is the rule's Adam b2 no worse than fixed values at the edges
of the batch window?

Once the rates are bracketed, at each width's smallest and largest batch the rate multiplier
with the fewest mean steps to the lowest target runs again, every seed, at each fixed b2 of
`--b2_grid` (b2_rule "constant"), beside the grid's run at the rule's b2 (the half-life rule
moves it with the batch: b2_ref ** (B / B_ref)). Per (width, batch, budget) and b2: the seeds'
mean steps to the target and the paired difference of log steps against the rule's, with its t
interval (`tools.stats.paired`). A fixed b2 whose interval lies below 0 is faster than the rule
there: the rates at that batch were bracketed at a b2 that is not the best, and the lab says so.
Output: OUT_b2.csv.
"""
from __future__ import annotations

import math

import numpy as np

from experiments.scaling_runs import Task, grid_rows
from tools import stats


def run(args, runs: list[dict], targets, counts, seeds, ref: int, seq: int, config,
        rule_optim) -> list[dict]:
  """Train the b2 runs (`config(task)` their configs, `rule_optim(task)` the optim block whose
  rule sets b2 at the task's batch) and return `report`'s rows."""
  from optim import derive  # noqa: PLC0415  start-up

  lowest = {w: min(targets[w]) for w in args.widths}
  todo = tasks(runs, args.widths, args.batch_sizes, seeds, args.b2_grid, lowest)
  b2_runs = [{**row, "b2": t.b2} for t, rows in grid_rows(todo, config, targets, counts, ref,
                                                             args, seq).items() for row in rows]
  rule_b2 = {(t.width, t.batch): derive(rule_optim(t), t.batch, t.batch).b2 for t in todo}
  return report(runs, b2_runs, rule_b2)


def tasks(runs: list[dict], widths, batches, seeds, b2_grid, lowest: dict) -> list[Task]:
  """The b2 runs: per width, at the smallest and largest batch, the multiplier with the fewest
  mean steps to that width's lowest target (over the seeds that reached it), each seed, each b2."""
  out = []
  for w in widths:
    for b in sorted({min(batches), max(batches)}):
      m = best_multiplier(runs, w, b, lowest[w])
      if m is not None:
        out += [Task(w, b, m, s, x) for s in seeds for x in b2_grid]
  return out


def best_multiplier(runs: list[dict], width: int, batch: int, target: float) -> float | None:
  """The multiplier with the fewest mean steps to `target` at (width, batch); None if none
  reached it (a seed that did not counts as infinitely slow)."""
  mine = [r for r in runs if (r["width"], r["batch_size"]) == (width, batch)
          and r["target"] == target]
  means = {}
  for m in {r["lr_multiplier"] for r in mine}:
    steps = [r["steps"] for r in mine if r["lr_multiplier"] == m]
    means[m] = math.inf if any(s is None for s in steps) else float(np.mean(steps))
  finite = {m: s for m, s in means.items() if math.isfinite(s)}
  return min(finite, key=finite.get) if finite else None


def report(rule_runs: list[dict], b2_runs: list[dict], rule_b2: dict) -> list[dict]:
  """Rows of OUT_b2.csv: per (width, batch, budget, b2) the mean steps and, for a fixed b2, the
  paired difference of log steps against the rule's run at the same multiplier (negative:
  faster than the rule); prints a line per (width, batch) at the lowest target. `rule_b2`:
  {(width, batch): the rule's b2 there}."""
  rows = []
  keys = sorted({(r["width"], r["batch_size"], r["lr_multiplier"]) for r in b2_runs})
  for w, b, m in keys:
    budgets = sorted({r["budget"] for r in b2_runs if (r["width"], r["batch_size"]) == (w, b)})
    rule = {d: {r["seed"]: log(r["steps"]) for r in rule_runs
                if (r["width"], r["batch_size"], r["lr_multiplier"], r["budget"]) == (w, b, m, d)}
            for d in budgets}
    said = []
    for d in budgets:
      rows.append(dict(width=w, batch_size=b, lr_multiplier=m, budget=d, b2="rule",
                       b2_value=rule_b2[w, b], steps=mean_steps(rule[d])))
      for x in sorted({r["b2"] for r in b2_runs}):
        fixed = {r["seed"]: log(r["steps"]) for r in b2_runs if (r["width"], r["batch_size"],
                 r["lr_multiplier"], r["budget"], r["b2"]) == (w, b, m, d, x)}
        p = stats.paired(fixed, rule[d])
        faster = p.significant and p.diff.mean < 0
        rows.append(dict(width=w, batch_size=b, lr_multiplier=m, budget=d, b2=x, b2_value=x,
                         steps=mean_steps(fixed), **p.as_dict("log_steps_vs_rule"),
                         faster_than_rule=faster))
        if d == budgets[-1]:  # the largest budget's: the lowest target
          verdict = "faster" if faster else "slower" if p.significant else "no difference"
          said.append(f"b2 {x:g}: {p.diff.text('+.3f')} ({verdict})")
    print(f"[scaling] b2 at d{w} b{b} (x{m:g}; the rule's b2 {rule_b2[w, b]:.4f}), log steps "
          "to the lowest target against the rule's: " + "; ".join(said), flush=True)
  flagged = sorted({(r["width"], r["batch_size"], r["budget"], r["b2"]) for r in rows
                    if r.get("faster_than_rule")})
  print("[scaling] b2: " + ("the rule's b2 is no slower than any fixed one at every edge batch "
                            "and budget" if not flagged else "a fixed b2 is faster than the "
                            "rule's at " + ", ".join(f"d{w} b{b} D {d:,} (b2 {x:g})"
                                                     for w, b, d, x in flagged)
                            + ": there the rates were bracketed at a b2 that is not the best"),
        flush=True)
  return rows


def log(steps) -> float:
  return math.log(steps) if steps is not None else math.nan


def mean_steps(logs: dict) -> float | None:
  v = [math.exp(x) for x in logs.values() if math.isfinite(x)]
  return float(np.mean(v)) if len(v) == len(logs) and v else None

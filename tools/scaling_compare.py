"""Two scaling labs' cells side by side: per (N, D) the ratio A / B of each estimate, with a
paired bootstrap interval, e.g. the same grid run with two warmups.

    python -m tools.scaling_compare A.csv B.csv [--quantities b_crit,b_zhang] [--level 0.95] \\
        [--json OUT.json]

The labs' `_boot.csv` replicates are paired when both drew the same seed indices
(`experiments.scaling_cells.draws` with the same replicate count and seed count, which the lab
does by default): replicate k of A and of B then hold the same seeds, and the interval of the
ratio over k carries their shared data order and initialisation. Unpaired (different counts),
the tool says so and gives no interval. A ratio whose interval holds 1 is "no change detected".
No jax here. docs/scaling_lab.md#warmup-check
"""
from __future__ import annotations

import json
import math
import os
import sys

from tools import figures
from tools.scaling_fit import LAB_CSV, interval
from trainer.config import ConfigError
from trainer.config.cli import CliParser


def _replicates(csv_path: str) -> dict[tuple, dict[int, dict]]:
  """{(params, tokens): {replicate: row}} from the lab's `<stem>_boot.csv` ({} if none)."""
  path = os.path.splitext(csv_path)[0] + "_boot.csv"
  out: dict = {}
  if os.path.isfile(path):
    for r in figures.read_csv(path):
      out.setdefault((r["params"], r["tokens"]), {})[int(r["replicate"])] = r
  return out


def compare(a_csv: str, b_csv: str, quantities, level: float = 0.95) -> list[dict]:
  """A row per (cell in both, quantity): a, b, ratio a / b, its interval (paired replicates
  only) and `paired`."""
  a_cells = {(c["params"], c["tokens"]): c
             for c in figures.read_table(a_csv, ("params", "tokens", *quantities), LAB_CSV)}
  b_cells = {(c["params"], c["tokens"]): c
             for c in figures.read_table(b_csv, ("params", "tokens", *quantities), LAB_CSV)}
  rows = []
  a_rep, b_rep = _replicates(a_csv), _replicates(b_csv)
  for q in quantities:
    for key in sorted(set(a_cells) & set(b_cells)):
      a, b = a_cells[key].get(q), b_cells[key].get(q)
      ok = all(isinstance(v, (int, float)) and math.isfinite(v) and v > 0 for v in (a, b))
      ra = {k: r.get(q) for k, r in a_rep.get(key, {}).items()}
      rb = {k: r.get(q) for k, r in b_rep.get(key, {}).items()}
      paired = bool(ra) and set(ra) == set(rb) and \
          a_cells[key].get("seeds") == b_cells[key].get("seeds")
      ratios = [ra[k] / rb[k] for k in ra if paired and ra[k] and rb[k]
                and math.isfinite(ra[k]) and math.isfinite(rb[k]) and rb[k] > 0]
      lo, hi = interval(ratios, level) if ok and paired else (None, None)
      rows.append(dict(quantity=q, params=key[0], tokens=key[1], a=a, b=b,
                       ratio=a / b if ok else None, lo=lo, hi=hi, paired=paired,
                       changed=None if lo is None else not lo <= 1 <= hi))
  return rows


def build_parser():
  p = CliParser("-m tools.scaling_compare", __doc__, config=False, overrides=False)
  p.add_argument("a", help="a scaling lab's CSV (the arm)")
  p.add_argument("b", help="another lab's CSV over the same cells (the baseline)")
  p.add_argument("--quantities", default="b_crit,b_zhang")
  p.add_argument("--level", type=float, default=0.95)
  p.add_argument("--json", default="", help="also write the rows here")
  return p


def main(argv: list[str]) -> int:
  try:
    args, _ = build_parser().parse(argv)
    if not 0 < args.level < 1:
      raise ConfigError(f"--level {args.level}: give a coverage between 0 and 1, e.g. 0.95")
    rows = compare(args.a, args.b, [q for q in args.quantities.split(",") if q], args.level)
  except ConfigError as e:
    print(f"error: {e}", file=sys.stderr)
    return 2
  if not rows:
    print("[scaling_compare] no (N, D) cell is in both CSVs")
  for r in rows:
    said = "no estimate in one of them" if r["ratio"] is None else (
        f"{r['ratio']:.2f}" + (" (unpaired replicates: no interval)" if r["lo"] is None else
                               f" [{r['lo']:.2f}, {r['hi']:.2f}]: " +
                               ("changed" if r["changed"] else "no change detected")))
    print(f"[scaling_compare] {r['quantity']} N {r['params']:,.0f} D {r['tokens']:,.0f}: "
          f"{r['a'] if r['a'] is None else format(r['a'], '.3g')} / "
          f"{r['b'] if r['b'] is None else format(r['b'], '.3g')} = {said}")
  if args.json:
    with open(args.json, "w") as f:
      json.dump(rows, f, indent=1)
  return 0


if __name__ == "__main__":
  sys.exit(main(sys.argv[1:]))

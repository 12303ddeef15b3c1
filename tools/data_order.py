"""How independent are a run's sequences? Distinct documents per step against independent draws.

    python -m tools.data_order --config configs/sweep_tiny.py --batch_sizes 8,16,32,64,128 \\
        [--steps 100] [--config.seed=1 ...]

Reads the windows a run of the config would train on (data/pipeline.py: the config's data,
sequence length and seed; nothing is trained) and prints, per global batch B, the distinct
documents a step holds (mean and its standard error over `--steps` steps) beside what B
independent uniform draws of a window give, sum over documents of 1 - (1 - p_d)^B with p_d the
share of the windows that touch document d (a mixture: that times the source's weight), and how
often two windows share a document within a step against across two consecutive steps (equal
for independent draws). A step's sequences are independent draws when the columns agree.
"""
from __future__ import annotations

import sys

import numpy as np

from data import mixture
from data.meta import DataError
from data.mixture import MixtureError
from data.prepare import ensure_default_corpus
from trainer.config import ConfigError
from trainer.config.cli import CliParser, load


def document_sets(windows, batch: int, steps: int) -> list[list[set]]:
  """Per step, per window: the (source, document) pairs it touches."""
  return [[{(s, d) for s, d, _, _ in row} for row in windows.locate(range(t * batch,
                                                                              (t + 1) * batch))]
          for t in range(steps)]


def expected_documents(windows, batch: int) -> float:
  """Distinct documents among `batch` independent uniform windows."""
  weights = [1.0] if windows.selection is None else [
      u / sum(windows.selection.units) for u in windows.selection.units]
  total = 0.0
  for order, w in zip(windows.orders, weights):
    p = w * np.minimum((order.lengths + order.width - 1) / order.tokens, 1.0)
    total += float(np.sum(1 - (1 - p) ** batch))
  return total


def shared(sets: list[list[set]]) -> tuple[float, float]:
  """(share of window pairs of one step that touch a common document, the same for a window of
  step t and one of step t + 1)."""
  within = [bool(a & b) for step in sets for i, a in enumerate(step) for b in step[i + 1:]]
  across = [bool(a & b) for s, t in zip(sets, sets[1:]) for a in s for b in t]
  return float(np.mean(within)), float(np.mean(across))


def report(cfg, batch_sizes, steps: int) -> list[dict]:
  from data import pipeline  # noqa: PLC0415  start-up
  d = cfg.data
  spec = pipeline.StreamSpec(d.dir or ensure_default_corpus(), "train", d.seq_len, 1,
                             seed=cfg.seed, mixture=mixture.parse(d.mixture) if d.mixture else ())
  windows = pipeline.Windows(spec)
  rows = []
  for batch in batch_sizes:
    sets = document_sets(windows, batch, steps)
    counts = np.array([len(set().union(*step)) for step in sets])
    within, across = shared(sets)
    rows.append({"batch": batch, "documents": counts.mean(),
                 "stderr": counts.std(ddof=1) / np.sqrt(len(counts)),
                 "expected": expected_documents(windows, batch), "within": within,
                 "across": across})
  return rows


def build_parser():
  parser = CliParser("-m tools.data_order", __doc__)
  parser.add_argument("--batch_sizes", required=True, help="comma-separated, e.g. 8,16,32")
  parser.add_argument("--steps", type=int, default=100, help="steps read per batch size")
  return parser


def main(argv=None) -> int:
  parser = build_parser()
  try:
    args, overrides = parser.parse(sys.argv[1:] if argv is None else argv)
    sizes = [int(b) for b in args.batch_sizes.split(",") if b.strip().isdigit()]
    if len(sizes) != len(args.batch_sizes.split(",")) or min(sizes) < 1 or args.steps < 2:
      raise ConfigError(f"--batch_sizes {args.batch_sizes} --steps {args.steps}: give positive "
                        "whole batch sizes (e.g. 8,16,32) and at least 2 steps")
    cfg = load(args.config, overrides)
    rows = report(cfg, sizes, args.steps)
  except (ConfigError, DataError, MixtureError) as e:
    print(f"error: {e}", file=sys.stderr)
    return 2
  d = cfg.data
  print(f"data: {d.mixture or d.dir or 'the embedded corpus'}; seq_len {d.seq_len}, seed "
        f"{cfg.seed}; {args.steps} steps per batch size")
  print("| global batch | distinct documents per step | expected for B independent windows | "
        "window pairs sharing a document: within a step | across consecutive steps |")
  print("|---|---|---|---|---|")
  for r in rows:
    print(f"| {r['batch']} | {r['documents']:.1f} +- {r['stderr']:.1f} | {r['expected']:.1f} | "
          f"{r['within']:.4f} | {r['across']:.4f} |")
  return 0


if __name__ == "__main__":
  sys.exit(main())

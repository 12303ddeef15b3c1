"""What every research tool does with its results: rows to a CSV file, panels to a PNG.

matplotlib is optional (the `tools` extra): `pyplot()` returns None without it, and the tools
then write their CSV and say how to get the figure (`NO_PLOT`).
"""
from __future__ import annotations

import csv

NO_PLOT = " (no plot: pip install -e '.[tools]')"


def write_csv(path: str, rows: list[dict], fields: list[str] | None = None) -> None:
  """One row per dict; the columns are `fields`, or every row's keys in the order first seen
  (a row without one leaves its cell empty)."""
  with open(path, "w", newline="") as f:
    w = csv.DictWriter(f, fieldnames=fields or list(dict.fromkeys(k for r in rows for k in r)))
    w.writeheader()
    w.writerows(rows)


def pyplot():
  """matplotlib.pyplot on the file-only Agg backend, or None when matplotlib is missing."""
  try:
    import matplotlib  # noqa: PLC0415  optional
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt  # noqa: PLC0415  optional
  except ImportError:
    return None
  return plt


def save(fig, path: str, title: str) -> None:
  """Title the figure, lay it out, write it to `path` and free it."""
  import matplotlib.pyplot as plt  # noqa: PLC0415  optional
  fig.suptitle(title, fontsize=10)
  fig.tight_layout()
  fig.savefig(path, dpi=110)
  plt.close(fig)

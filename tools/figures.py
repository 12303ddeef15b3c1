"""What every research tool does with its results: rows to a CSV file and back, panels to a PNG.

matplotlib is optional (the `tools` extra): `pyplot()` returns None without it, and the tools
then write their CSV and say how to get the figure (`NO_PLOT`).
"""
from __future__ import annotations

import csv
import os

from trainer.config import ConfigError

NO_PLOT = " (no plot: pip install -e '.[tools]')"


def write_csv(path: str, rows: list[dict], fields: list[str] | None = None) -> None:
  """One row per dict; the columns are `fields`, or every row's keys in the order first seen
  (a row without one leaves its cell empty)."""
  with open(path, "w", newline="") as f:
    w = csv.DictWriter(f, fieldnames=fields or list(dict.fromkeys(k for r in rows for k in r)))
    w.writeheader()
    w.writerows(rows)


def read_csv(path: str) -> list[dict]:
  """Rows with numbers as floats, booleans as bool and empty cells as None."""
  def value(v: str):
    if v in ("", "None"):
      return None
    if v in ("True", "False"):
      return v == "True"
    try:
      return float(v)
    except ValueError:
      return v
  with open(path, newline="") as f:
    return [{k: value(v) for k, v in row.items()} for row in csv.DictReader(f)]


def read_table(path: str, columns, what: str) -> list[dict]:
  """`read_csv` of a tool's input, or a ConfigError in one line: no such file, not a .csv (`what`
  says which file the tool wants), unreadable, no rows, or a missing one of `columns`."""
  if not os.path.isfile(path):
    raise ConfigError(f"{path}: no such file; give {what}")
  if not path.endswith(".csv"):
    raise ConfigError(f"{path}: not a .csv; give {what}")
  try:
    rows = read_csv(path)
  except (UnicodeDecodeError, csv.Error) as e:
    raise ConfigError(f"{path}: not a CSV ({e}); give {what}") from None
  missing = [k for k in columns if rows and k not in rows[0]]
  if not rows or missing:
    raise ConfigError(f"{path}: " + (f"no column {missing[0]!r} (columns: {', '.join(rows[0])})"
                                      if rows else "no rows") + f"; give {what}")
  return rows


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

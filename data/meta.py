"""A prepared directory's meta.json (`read_meta`), its format version, and `DataError`, the
error missing or unreadable data raises. Below everything else in `data/` that reads prepared
directories (data/prepare.py writes them)."""
from __future__ import annotations

import json
import os

FORMAT_VERSION = 3  # 3: token files with document offsets; 1 and 2: ArrayRecord documents


class DataError(ValueError):
  """Missing or unreadable data (a user error, reported in one line)."""


def read_meta(data_dir: str, what: str = "") -> dict:
  """meta.json of a prepared directory; `what` names the directory in errors (default
  `data.dir=DIR`). A directory of another format, or an unreadable meta.json, is one line saying
  to prepare it again."""
  default = "" if what else " or leave data.dir empty for the default corpus"
  what = what or f"data.dir={data_dir!r}"
  path = os.path.join(data_dir, "meta.json")
  again = "prepare it again (python -m data.prepare --out NEW_DIR ...)"
  if not os.path.exists(path):
    raise DataError(f"{what} has no meta.json; prepare it with "
                    f"`python -m data.prepare --out {data_dir} FILES...`{default}")
  try:
    with open(path) as f:
      meta = json.load(f)
  except (OSError, ValueError) as e:
    raise DataError(f"{what}: {path} is unreadable ({type(e).__name__}: "
                    f"{str(e).splitlines()[0][:120]}); {again}") from None
  if not isinstance(meta, dict) or meta.get("format") != FORMAT_VERSION:
    version = meta.get("format") if isinstance(meta, dict) else None
    old = " (documents as ArrayRecord records, read whole)" if version in (1, 2) else ""
    raise DataError(f"{what} was prepared in format {version}{old}; this version reads format "
                    f"{FORMAT_VERSION} (token files read by offset): {again}")
  return meta

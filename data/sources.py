"""Where documents come from: text files, JSONL, Parquet, Hugging Face datasets.

Inputs become *units* of work (`Unit`: a group of small files, one large file, or one shard of
a Hugging Face dataset); data.prepare tokenizes units in parallel, one set of shards each.
`documents(unit, text_field)` yields `Document`s (key, text, cleaned); the key (file path +
position) decides the split. Text is made valid Unicode here: non-UTF-8 bytes and lone UTF-16
surrogates become U+FFFD (`cleaned`); a null text is skipped.

  * `.txt` / `.md` / `.py` (and any other file): the whole file is one document.
  * `.jsonl`: one document per line, its text in `text_field`.
  * `.parquet`: one document per row of column `text_field` (needs `pyarrow`: the `data` extra).
  * a `datasets.Dataset.save_to_disk` directory, or `hf:NAME[:CONFIG][@SPLIT]` for
    `datasets.load_dataset` (needs `datasets`; a name may download).
Details: docs/data.md#inputs-and-tokenizers
"""
from __future__ import annotations

import dataclasses
import glob
import json
import os
import re
from collections.abc import Iterator
from typing import NamedTuple

TEXT_SUFFIXES = (".txt", ".md", ".py", ".jsonl", ".parquet")
UNIT_BYTES = (1 << 20, 256 << 20)  # bounds on the input bytes grouped into one unit
HF_ROWS_PER_UNIT = 100_000


class SourceError(ValueError):
  """Inputs that cannot be read (reported in one line)."""


class Document(NamedTuple):
  key: str  # decides the split
  text: str  # valid Unicode (encodes to UTF-8)
  cleaned: bool  # invalid bytes or lone surrogates were replaced by U+FFFD


_SURROGATE = re.compile("[\ud800-\udfff]")


def _document(key: str, text, where: str, raw_invalid: bool = False) -> Document | None:
  """A Document of `text` with lone surrogates replaced (None for a null text)."""
  if text is None:
    return None
  if not isinstance(text, str):
    raise SourceError(f"{where}: the text is a {type(text).__name__}, not a string; set "
                      "--text_field to a field that holds text")
  replaced = 0
  if not text.isascii():
    text, replaced = _SURROGATE.subn("\ufffd", text)
  return Document(key, text, raw_invalid or replaced > 0)


def _decode(raw: bytes) -> tuple[str, bool]:
  """UTF-8 bytes -> (text, whether some were invalid and replaced by U+FFFD)."""
  try:
    return raw.decode("utf-8"), False
  except UnicodeDecodeError:
    return raw.decode("utf-8", errors="replace"), True


def _read_text(path: str) -> tuple[str, bool]:
  """(text, whether some bytes were invalid and replaced by U+FFFD) of a whole file, read as
  text (newlines made \\n, as reading in text mode makes them)."""
  with open(path, "rb") as f:
    text, replaced = _decode(f.read())
  return text.replace("\r\n", "\n").replace("\r", "\n"), replaced


@dataclasses.dataclass(frozen=True)
class Unit:
  kind: str  # "files" | "hf"
  paths: tuple[str, ...] = ()  # kind "files"
  dataset: str = ""  # kind "hf": a save_to_disk dir or "hf:NAME[:CONFIG][@SPLIT]"
  shard: int = 0
  num_shards: int = 1
  root: str = ""  # keys of files are relative to this (stable across machines)


def _is_hf_dir(path: str) -> bool:
  return os.path.isdir(path) and any(
      os.path.exists(os.path.join(path, f)) for f in ("dataset_info.json", "dataset_dict.json"))


def expand(inputs: list[str]) -> tuple[list[str], list[str]]:
  """(sorted files, HF datasets) named by files, directories, globs and hf: names."""
  paths, datasets = [], []
  for item in inputs:
    if item.startswith("hf:") or _is_hf_dir(item):
      datasets.append(item)
    elif os.path.isdir(item):
      paths += [p for p in glob.glob(os.path.join(item, "**", "*"), recursive=True)
                if p.endswith(TEXT_SUFFIXES) and os.path.isfile(p)]
    elif os.path.isfile(item):
      paths.append(item)
    else:
      matched = glob.glob(item)
      if not matched:
        raise SourceError(f"data.prepare: {item!r} does not exist")
      paths += matched
  return sorted(set(paths)), datasets


def group_files(paths: list[str], root: str = "") -> list[Unit]:
  """Consecutive files grouped into units of about total/16 bytes (within UNIT_BYTES)."""
  sizes = [os.path.getsize(p) for p in paths]
  target = min(max(sum(sizes) // 16, UNIT_BYTES[0]), UNIT_BYTES[1])
  units, group, size = [], [], 0
  for path, n in zip(paths, sizes):
    group.append(path)
    size += n
    if size >= target:
      units.append(Unit("files", tuple(group), root=root))
      group, size = [], 0
  if group:
    units.append(Unit("files", tuple(group), root=root))
  return units


def _load_hf(name: str):
  try:
    import datasets  # noqa: PLC0415  optional
  except ImportError:
    raise SourceError(f"{name!r} is a Hugging Face dataset; install the `datasets` package "
                      "(pip install 'scaletrain[datasets]')") from None
  if name.startswith("hf:"):
    spec, _, split = name[3:].partition("@")
    path, _, config = spec.partition(":")
    ds = datasets.load_dataset(path, config or None, split=split or "train")
  else:
    ds = datasets.load_from_disk(name)
  if isinstance(ds, datasets.DatasetDict):
    ds = datasets.concatenate_datasets([ds[k] for k in sorted(ds)])
  return ds


def hf_units(name: str) -> list[Unit]:
  n = len(_load_hf(name))
  shards = max(1, -(-n // HF_ROWS_PER_UNIT))
  return [Unit("hf", dataset=name, shard=i, num_shards=shards) for i in range(shards)]


def _missing_field(where: str, field: str, fields) -> SourceError:
  return SourceError(f"{where}: no field {field!r} (fields: {sorted(fields)}); set --text_field")


def documents(unit: Unit, text_field: str) -> Iterator[Document]:
  """Every document of a unit, in a fixed order, its text valid Unicode (module docstring)."""
  if unit.kind == "hf":
    ds = _load_hf(unit.dataset).shard(unit.num_shards, unit.shard, contiguous=True)
    if text_field not in ds.column_names:
      raise _missing_field(unit.dataset, text_field, ds.column_names)
    for i, text in enumerate(ds[text_field]):
      doc = _document(f"{unit.dataset}#{unit.shard}:{i}", text, f"{unit.dataset} row {i}")
      if doc:
        yield doc
    return
  for path in unit.paths:
    key = os.path.relpath(path, unit.root) if unit.root else path
    if path.endswith(".jsonl"):
      with open(path, "rb") as f:
        for lineno, raw in enumerate(f):
          line, invalid = _decode(raw)
          if line.strip():
            try:
              record = json.loads(line)
            except json.JSONDecodeError as e:
              raise SourceError(f"{path}:{lineno + 1}: not a JSON record ({e.msg})") from None
            if not isinstance(record, dict) or text_field not in record:
              raise _missing_field(f"{path}:{lineno + 1}", text_field,
                                   record if isinstance(record, dict) else ())
            doc = _document(f"{key}:{lineno}", record[text_field], f"{path}:{lineno + 1}",
                            invalid)
            if doc:
              yield doc
    elif path.endswith(".parquet"):
      yield from _parquet_documents(path, key, text_field)
    else:
      text, invalid = _read_text(path)
      yield _document(key, text, path, invalid)


def _parquet_documents(path: str, key: str, text_field: str) -> Iterator[Document]:
  try:
    import pyarrow.parquet as pq  # noqa: PLC0415  optional
  except ImportError:
    raise SourceError(f"{path} is Parquet; install pyarrow (pip install 'scaletrain[data]')") \
        from None
  f = pq.ParquetFile(path)
  if text_field not in f.schema_arrow.names:
    raise _missing_field(path, text_field, f.schema_arrow.names)
  row = 0
  for batch in f.iter_batches(columns=[text_field], batch_size=4096):
    for text in batch.column(0).to_pylist():
      doc = _document(f"{key}:{row}", text, f"{path} row {row}")
      if doc:
        yield doc
      row += 1

"""Turn text into tokenized ArrayRecord shards that the training pipeline reads.

    python -m data.prepare --out DIR                       # the default corpus (Python stdlib)
    python -m data.prepare --out DIR a.txt docs/ b.jsonl   # your files: .txt = one document,
                                                           # .jsonl = one document per line

A prepared directory holds `train-*.array_record`, `validation-*.array_record` (one record per
document: little-endian uint16 token ids, no pickle) and `meta.json` (tokenizer, counts,
fingerprint). Directories are written under a temporary name and renamed when complete, so a
killed prepare never leaves a half-written corpus behind.
"""
from __future__ import annotations

import argparse
import glob
import hashlib
import json
import os
import shutil
import tempfile
from collections.abc import Iterable, Iterator

import numpy as np
from array_record.python.array_record_module import ArrayRecordWriter

from data import corpus, tokenizer

FORMAT_VERSION = 1
SPLITS = ("train", "validation")
SHARD_BYTES = 256 << 20  # start a new shard after this many bytes of tokens


class DataError(ValueError):
  """Missing or unreadable data (a user error, reported in one line)."""


def _write_split(out_dir: str, split: str, docs: Iterable[np.ndarray]) -> dict:
  files, writer, shard_bytes, n_docs, n_tokens = [], None, 0, 0, 0
  for ids in docs:
    if writer is None or shard_bytes >= SHARD_BYTES:
      if writer is not None:
        writer.close()
      files.append(f"{split}-{len(files):05d}.array_record")
      writer = ArrayRecordWriter(os.path.join(out_dir, files[-1]), "group_size:1")
      shard_bytes = 0
    data = ids.astype("<u2").tobytes()
    writer.write(data)
    shard_bytes += len(data)
    n_docs += 1
    n_tokens += len(ids)
  if writer is not None:
    writer.close()
  return {"files": files, "documents": n_docs, "tokens": n_tokens}


def write_prepared(out_dir: str, split_docs: dict[str, Iterable[np.ndarray]], source: dict) -> str:
  """Write every split into `out_dir` atomically (temp dir + rename). Returns `out_dir`."""
  parent = os.path.dirname(os.path.abspath(out_dir)) or "."
  os.makedirs(parent, exist_ok=True)
  tmp = tempfile.mkdtemp(prefix=".prepare-", dir=parent)
  try:
    meta = {"format": FORMAT_VERSION, "tokenizer": "byte", "vocab_size": tokenizer.VOCAB_SIZE,
            "bos_id": tokenizer.BOS_ID, "eos_id": tokenizer.EOS_ID, "source": source,
            "splits": {}}
    for split in SPLITS:
      meta["splits"][split] = _write_split(tmp, split, split_docs.get(split, ()))
      if meta["splits"][split]["documents"] == 0:
        raise DataError(f"data.prepare: the {split} split is empty; give more documents")
    with open(os.path.join(tmp, "meta.json"), "w") as f:
      json.dump(meta, f, indent=1)
    try:
      os.rename(tmp, out_dir)
    except OSError:
      if not os.path.exists(os.path.join(out_dir, "meta.json")):
        raise
      shutil.rmtree(tmp)  # someone else finished the same corpus first; theirs is identical
  except BaseException:
    shutil.rmtree(tmp, ignore_errors=True)
    raise
  return out_dir


# ----------------------------------------------------------------------------------------------
# The default corpus


def default_data_dir() -> str:
  """Where the default corpus is prepared: `$SCALETRAIN_DATA` or ~/.cache/scaletrain."""
  info = corpus.describe()
  base = os.environ.get("SCALETRAIN_DATA") or os.path.join(
      os.environ.get("XDG_CACHE_HOME") or os.path.expanduser("~/.cache"), "scaletrain")
  return os.path.join(base, f"stdlib-py{info['python']}-{info['fingerprint']}")


def prepare_stdlib(out_dir: str) -> str:
  root = corpus.stdlib_root()
  files = corpus.stdlib_files(root)
  by_split = {s: [f for f in files if corpus.split_of(f) == s] for s in SPLITS}

  def docs(paths):
    for rel in paths:
      with open(os.path.join(root, rel), encoding="utf-8", errors="replace") as f:
        yield tokenizer.encode(f.read())

  return write_prepared(out_dir, {s: docs(p) for s, p in by_split.items()}, corpus.describe())


def ensure_default_corpus(data_dir: str = "") -> str:
  """The prepared default corpus, preparing it on first use."""
  data_dir = data_dir or default_data_dir()
  if not os.path.exists(os.path.join(data_dir, "meta.json")):
    prepare_stdlib(data_dir)
  return data_dir


# ----------------------------------------------------------------------------------------------
# User files


def _expand(inputs: list[str]) -> list[str]:
  paths = []
  for item in inputs:
    if os.path.isdir(item):
      paths += [p for p in glob.glob(os.path.join(item, "**", "*"), recursive=True)
                if p.endswith((".txt", ".jsonl", ".md", ".py")) and os.path.isfile(p)]
    elif os.path.isfile(item):
      paths.append(item)
    else:
      matched = glob.glob(item)
      if not matched:
        raise DataError(f"data.prepare: {item!r} does not exist")
      paths += matched
  return sorted(set(paths))


def _user_documents(paths: list[str], text_field: str) -> Iterator[tuple[str, str]]:
  for path in paths:
    if path.endswith(".jsonl"):
      with open(path, encoding="utf-8") as f:
        for lineno, line in enumerate(f):
          if line.strip():
            record = json.loads(line)
            if text_field not in record:
              raise DataError(f"{path}:{lineno + 1}: no field {text_field!r} "
                              f"(fields: {sorted(record)}); set --text_field")
            yield f"{path}:{lineno}", record[text_field]
    else:
      with open(path, encoding="utf-8", errors="replace") as f:
        yield path, f.read()


def prepare_files(out_dir: str, inputs: list[str], *, text_field: str = "text",
                  validation_fraction: float = 0.01) -> str:
  paths = _expand(inputs)
  if not paths:
    raise DataError(f"data.prepare: no input files found in {inputs}")
  every = max(2, round(1 / validation_fraction)) if validation_fraction > 0 else 0

  def split(key: str) -> str:
    digest = int(hashlib.sha1(key.encode()).hexdigest(), 16)
    return "validation" if every and digest % every == 0 else "train"

  # Two passes over the inputs (one per split) keep memory flat for large corpora.
  def docs(which):
    for key, text in _user_documents(paths, text_field):
      if split(key) == which:
        yield tokenizer.encode(text)

  h = hashlib.sha256("\n".join(f"{p}\t{os.path.getsize(p)}" for p in paths).encode())
  source = {"name": "files", "inputs": inputs, "files": len(paths),
            "fingerprint": h.hexdigest()[:16]}
  return write_prepared(out_dir, {s: docs(s) for s in SPLITS}, source)


def read_meta(data_dir: str) -> dict:
  path = os.path.join(data_dir, "meta.json")
  if not os.path.exists(path):
    raise DataError(f"data.dir={data_dir!r} has no meta.json; prepare it with "
                    f"`python -m data.prepare --out {data_dir} FILES...` or leave data.dir empty "
                    "for the default corpus")
  with open(path) as f:
    return json.load(f)


def main(argv=None):
  parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
  parser.add_argument("--out", default="", help="output directory (default: the cache dir)")
  parser.add_argument("--text_field", default="text", help="JSONL field holding the text")
  parser.add_argument("--validation_fraction", type=float, default=0.01)
  parser.add_argument("inputs", nargs="*", help="files, directories or globs; none = stdlib")
  args = parser.parse_args(argv)
  try:
    if args.inputs:
      if not args.out:
        parser.error("--out is required when preparing your own files")
      out = prepare_files(args.out, args.inputs, text_field=args.text_field,
                          validation_fraction=args.validation_fraction)
    else:
      out = ensure_default_corpus(args.out)
  except DataError as e:
    raise SystemExit(f"error: {e}") from None
  meta = read_meta(out)
  counts = ", ".join(f"{s}: {v['documents']} docs / {v['tokens']:,} tokens"
                     for s, v in meta["splits"].items())
  print(f"prepared {out} ({counts})")


if __name__ == "__main__":
  main()

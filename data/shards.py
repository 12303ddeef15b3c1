"""One unit of a preparation (data/prepare.py), run in a worker process: its documents
tokenized into ArrayRecord shards (one record per document, `SHARD_BYTES` of tokens a shard) and
the marker that says the unit is done; and the JSON files of a preparation, each written whole
(a temporary file, then a rename) so that an interrupted preparation finds each complete or
absent.
"""
from __future__ import annotations

import hashlib
import json
import os

import numpy as np
from array_record.python.array_record_module import ArrayRecordWriter

from data import corpus, sources
from data import tokenizer as tokenizers
from data.sources import Unit

SPLITS = ("train", "validation")
SHARD_BYTES = 256 << 20  # start a new shard after this many bytes of tokens
COUNTS = ("documents", "tokens", "targets", "bytes")


def split_of(key: str, rule: str, fraction: float) -> str:
  """'train' or 'validation' for a document key: the stdlib file rule, or a hash fraction."""
  if rule == "stdlib":
    return corpus.split_of(key)
  digest = int(hashlib.sha1(key.encode()).hexdigest(), 16)
  return "validation" if digest % 1_000_000 < fraction * 1_000_000 else "train"


_TOKENIZERS: dict = {}


def write_unit(work: str, index: int, unit: Unit, plan: dict) -> dict:
  """Tokenize one unit's documents into its shards in `work` (each put in place whole), then
  mark the unit done (done-INDEX.json: the shards and their counts per split, and how many
  documents had their text cleaned); the counts."""
  key = json.dumps(plan["tokenizer"], sort_keys=True)
  if key not in _TOKENIZERS:
    _TOKENIZERS[key] = tokenizers.from_meta(plan["tokenizer"], work)
  tok, dtype = _TOKENIZERS[key], plan["token_dtype"]
  writers, out = {}, {s: {"files": [], **dict.fromkeys(COUNTS, 0)} for s in SPLITS}
  shard_bytes = dict.fromkeys(SPLITS, 0)
  cleaned = 0
  for doc_key, text, was_cleaned in sources.documents(unit, plan["text_field"]):
    cleaned += was_cleaned
    split = split_of(doc_key, plan["split_rule"], plan["validation_fraction"])
    if split not in writers or shard_bytes[split] >= SHARD_BYTES:
      if split in writers:
        writers[split].close()
      name = f"{split}-{index:05d}-{len(out[split]['files']):03d}.array_record"
      out[split]["files"].append(name)
      writers[split] = ArrayRecordWriter(os.path.join(work, name + ".tmp"), "group_size:1")
      shard_bytes[split] = 0
    data = tok.encode(text).astype(dtype).tobytes()
    writers[split].write(data)
    shard_bytes[split] += len(data)
    c = out[split]
    n = len(data) // np.dtype(dtype).itemsize
    c["documents"] += 1
    c["tokens"] += n
    c["targets"] += n - 1  # a document's first token is never predicted
    c["bytes"] += len(text.encode("utf-8"))
  for w in writers.values():
    w.close()
  for s in SPLITS:
    for name in out[s]["files"]:
      os.replace(os.path.join(work, name + ".tmp"), os.path.join(work, name))
  write_json(os.path.join(work, f"done-{index:05d}.json"), {**out, "cleaned": cleaned})
  return out


def write_json(path: str, obj) -> None:
  """Write `path` whole or not at all (a temporary file, then a rename)."""
  with open(path + ".tmp", "w") as f:
    json.dump(obj, f, indent=1)
  os.replace(path + ".tmp", path)


def read_json(path: str):
  """The JSON in `path`, or None when there is none (or only an unreadable one)."""
  try:
    with open(path) as f:
      return json.load(f)
  except (OSError, ValueError):
    return None

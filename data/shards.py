"""One unit of a preparation (data/prepare.py), run in a worker process: its documents
tokenized into shards (`SHARD_BYTES` of tokens a shard) and the marker that says the unit is
done; and the JSON files of a preparation, each written whole (a temporary file, then a rename)
so that an interrupted preparation finds each complete or absent.

A shard NAME is two files: `NAME.bin`, its documents' token ids back to back (little-endian
`token_dtype`, no header), and `NAME.idx`, the end offset of each document in NAME.bin (in
tokens, little-endian uint64). Reading any token range is a slice of NAME.bin (data/tokens.py).
"""
from __future__ import annotations

import hashlib
import json
import os

import numpy as np

from data import corpus, sources
from data import tokenizer as tokenizers
from data.sources import Unit

SPLITS = ("train", "validation")
SHARD_BYTES = 256 << 20  # start a new shard after this many bytes of tokens
COUNTS = ("documents", "tokens", "targets", "bytes")
OFFSET_DTYPE = "<u8"  # NAME.idx


def split_of(key: str, rule: str, fraction: float) -> str:
  """'train' or 'validation' for a document key: the stdlib file rule, or a hash fraction."""
  if rule == "stdlib":
    return corpus.split_of(key)
  digest = int(hashlib.sha1(key.encode()).hexdigest(), 16)
  return "validation" if digest % 1_000_000 < fraction * 1_000_000 else "train"


class ShardWriter:
  """Writes one shard: `write(ids)` per document, then `close()` puts NAME.bin and NAME.idx in
  place (each written under .tmp, then renamed: a shard is never seen half written) and returns
  its entry for meta.json, {"name", "documents", "tokens"}."""

  def __init__(self, directory: str, name: str, dtype: str):
    self.directory, self.name, self.dtype = directory, name, dtype
    self._bin = open(os.path.join(directory, name + ".bin.tmp"), "wb")
    self._ends: list[int] = []
    self.tokens = 0

  def write(self, ids: np.ndarray) -> int:
    """Append one document; returns its size in bytes."""
    data = np.asarray(ids).astype(self.dtype).tobytes()
    self._bin.write(data)
    self.tokens += len(ids)
    self._ends.append(self.tokens)
    return len(data)

  def close(self) -> dict:
    self._bin.close()
    path = os.path.join(self.directory, self.name)
    with open(path + ".idx.tmp", "wb") as f:
      f.write(np.asarray(self._ends, OFFSET_DTYPE).tobytes())
    os.replace(path + ".bin.tmp", path + ".bin")
    os.replace(path + ".idx.tmp", path + ".idx")
    return {"name": self.name, "documents": len(self._ends), "tokens": self.tokens}


def shard_files(entry: dict) -> tuple[str, str]:
  """The two file names of a shard entry of meta.json."""
  return entry["name"] + ".bin", entry["name"] + ".idx"


_TOKENIZERS: dict = {}


def write_unit(work: str, index: int, unit: Unit, plan: dict) -> dict:
  """Tokenize one unit's documents into its shards in `work` (each put in place whole), then
  mark the unit done (done-INDEX.json: the shards and their counts per split, and how many
  documents had their text cleaned); the counts."""
  key = json.dumps(plan["tokenizer"], sort_keys=True)
  if key not in _TOKENIZERS:
    _TOKENIZERS[key] = tokenizers.from_meta(plan["tokenizer"], work)
  tok, dtype = _TOKENIZERS[key], plan["token_dtype"]
  writers: dict[str, ShardWriter] = {}
  out = {s: {"shards": [], **dict.fromkeys(COUNTS, 0)} for s in SPLITS}
  shard_bytes = dict.fromkeys(SPLITS, 0)
  cleaned = 0
  for doc_key, text, was_cleaned in sources.documents(unit, plan["text_field"]):
    cleaned += was_cleaned
    split = split_of(doc_key, plan["split_rule"], plan["validation_fraction"])
    if split not in writers or shard_bytes[split] >= SHARD_BYTES:
      if split in writers:
        out[split]["shards"].append(writers[split].close())
      name = f"{split}-{index:05d}-{len(out[split]['shards']):03d}"
      writers[split] = ShardWriter(work, name, dtype)
      shard_bytes[split] = 0
    ids = tok.encode(text)
    shard_bytes[split] += writers[split].write(ids)
    c = out[split]
    c["documents"] += 1
    c["tokens"] += len(ids)
    c["targets"] += len(ids) - 1  # a document's first token is never predicted
    c["bytes"] += len(text.encode("utf-8"))
  for split, w in writers.items():
    out[split]["shards"].append(w.close())
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

"""The tokens of one split of a prepared directory, read by offset (`SplitTokens`).

A split is a list of shards (data/shards.py): NAME.bin holds the documents' token ids back to
back, NAME.idx each document's end offset. Both are memory-mapped, so reading a piece of a
document (`read`) is a slice: the bytes read are the piece's tokens, wherever the document lies
and however long it is. Documents are numbered across the split's shards in stored order.

Opening a split checks every file against meta.json before anything is read or compiled (sizes,
document counts, offsets): a missing, truncated or foreign file is one line naming it and saying
to prepare the directory again.
"""
from __future__ import annotations

import mmap
import os

import numpy as np

from data.meta import DataError, read_meta
from data.shards import OFFSET_DTYPE, shard_files


def _map(path: str, dtype: str) -> np.ndarray:
  """The file as a read-only array (memory-mapped; an empty file is an empty array). Random
  access is announced to the kernel, which then reads no more than the pages a slice touches."""
  with open(path, "rb") as f:
    size = os.fstat(f.fileno()).st_size
    if size == 0:
      return np.empty(0, dtype)
    mm = mmap.mmap(f.fileno(), 0, access=mmap.ACCESS_READ)
  if hasattr(mm, "madvise") and hasattr(mmap, "MADV_RANDOM"):
    mm.madvise(mmap.MADV_RANDOM)
  return np.frombuffer(mm, dtype)


class SplitTokens:
  """One split's documents, by number: `lengths[i]`, `read(i, start, stop)`, `document(i)`."""

  def __init__(self, data_dir: str, split: str, what: str = "", meta: dict | None = None):
    self.what = what or f"data.dir={data_dir!r}"
    meta = meta or read_meta(data_dir, self.what)
    self.dtype = meta["token_dtype"]
    self.meta = meta
    self._tokens, lengths, self._first = [], [], [0]
    for entry in meta["splits"][split]["shards"]:
      tokens, ends = self._open(data_dir, entry)
      self._tokens.append(tokens)
      lengths.append(np.diff(ends, prepend=0))
      self._first.append(self._first[-1] + len(ends))
    self.lengths = np.concatenate(lengths) if lengths else np.zeros(0, np.int64)
    self.starts = np.zeros(len(self.lengths), np.int64)  # of each document in its shard
    for k, (a, b) in enumerate(zip(self._first, self._first[1:])):
      self.starts[a:b] = np.cumsum(self.lengths[a:b]) - self.lengths[a:b]
    self._shard = np.repeat(np.arange(len(self._tokens)), np.diff(self._first))

  def _open(self, data_dir: str, entry: dict) -> tuple[np.ndarray, np.ndarray]:
    """(tokens, document end offsets) of one shard, checked against its meta.json entry."""
    bin_name, idx_name = shard_files(entry)
    again = "; prepare the directory again (python -m data.prepare)"
    paths = [os.path.join(data_dir, n) for n in (bin_name, idx_name)]
    for path in paths:
      if not os.path.isfile(path):
        raise DataError(f"{self.what}: {path} is missing{again}")
    tokens, ends = _map(paths[0], self.dtype), _map(paths[1], OFFSET_DTYPE)
    docs, count = int(entry["documents"]), int(entry["tokens"])
    for path, got, want, unit in ((paths[0], len(tokens), count, "tokens"),
                                  (paths[1], len(ends), docs, "document offsets")):
      if got != want:
        raise DataError(f"{self.what}: {path} holds {got} {unit}, meta.json says {want} "
                        f"(truncated or replaced){again}")
    ends = ends.astype(np.int64)
    if docs and (ends[-1] != count or np.any(np.diff(ends, prepend=0) < 0)):
      raise DataError(f"{self.what}: {paths[1]} holds offsets that do not fit {paths[0]}{again}")
    return tokens, ends

  def __len__(self) -> int:
    return len(self.lengths)

  def read(self, doc: int, start: int, stop: int) -> np.ndarray:
    """Tokens [start, stop) of document `doc` (a view of the mapped file)."""
    s = self._shard[doc]
    base = self.starts[doc]
    return self._tokens[s][base + start:base + stop]

  def document(self, doc: int) -> np.ndarray:
    """The whole document `doc` as int32 token ids."""
    return self.read(doc, 0, self.lengths[doc]).astype(np.int32)

  def documents(self):
    """Every document in stored order, as int32 token ids."""
    for i in range(len(self)):
      yield self.document(i)

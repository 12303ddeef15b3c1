"""grain input pipelines: prepared ArrayRecord documents -> packed, shifted token batches.

Layout of the stream. The global micro-batch has `rows` rows. Row r is its own packing stream:
it reads the shuffled documents r, r + rows, r + 2*rows, ... and packs them back to back into
sequences of `seq_len + 1` tokens (a document that does not fit continues at the start of the
row's next sequence; segment ids 1, 2, ... number the pieces of a sequence, positions restart at
0 in each piece). A process reads only the rows its devices hold (`row_ids`, from the batch
sharding: `sharding.process_rows`), so

  * each process reads only its shard of the data, and
  * the global batch at every step is the same whatever the number of processes or devices,

which is what makes a multi-host run equal a single-host one, and a restore onto a different
mesh continue the same data order. A step with gradient accumulation draws several consecutive
micro-batches. The iterator state (each row's document and offset in it) is checkpointable.

How it is fast (`PackedRows`): all of a process's rows are packed in one pass per micro-batch.
The documents the rows need are read in one batched call per round (grain's `_getitems` through
the shuffle down to ArrayRecord, one reader call per file), and tokens, segment ids and
positions of all rows come from a few numpy calls over the concatenated pieces, so the Python
work is per document piece, not per token or per grain element. `prefetch` runs it in a
background thread (grain's ThreadPrefetchIterDataset) that many micro-batches ahead.

With `mixture` (sources from `data.mixture`, see data/mixture.py) each sequence is filled from
one source, chosen by a pure function of its global index (micro-batch x rows + row) so that
the sources' shares of tokens are their weights. Row r then has one packing stream per source:
it reads that source's shuffled documents r, r + rows, ... and a document continues in the row's
next sequence of the same source; the state holds each row's document and offset per source and
the micro-batch count, so everything above holds for mixtures too.

Batches are dicts of [rows_on_this_process, seq_len] numpy arrays:
  inputs, targets (next token), positions (within the document), segment_ids (1, 2, ... per
  document, 0 = padding), loss_mask (target belongs to the same document as the input).
"""
from __future__ import annotations

import dataclasses
import os

import grain
import numpy as np

from data import mixture as mixture_lib
from data.prepare import DataError, read_meta

BATCH_KEYS = ("inputs", "targets", "positions", "segment_ids", "loss_mask")


@dataclasses.dataclass(frozen=True)
class StreamSpec:
  data_dir: str
  split: str  # "train" or "validation"
  seq_len: int
  rows: int  # global rows of one micro-batch
  seed: int = 0
  shuffle: bool = True
  row_ids: tuple[int, ...] | None = None  # the rows this process reads; None = all of them
  prefetch: int = 0  # batches prepared ahead in a background thread (0 = none)
  mixture: tuple[mixture_lib.Source, ...] = ()  # when set, read these instead of data_dir

  @property
  def local_rows(self) -> tuple[int, ...]:
    return tuple(range(self.rows)) if self.row_ids is None else tuple(self.row_ids)


@dataclasses.dataclass(frozen=True)
class _Decode:
  dtype: str  # the stored token dtype (meta.json's token_dtype)

  def __call__(self, record: bytes) -> np.ndarray:
    return np.frombuffer(record, dtype=self.dtype).astype(np.int32)


def documents(data_dir: str, split: str, what: str = "", meta: dict | None = None
              ) -> grain.MapDataset:
  """The raw records (one per document) of one split of a prepared directory (`what` names it
  in errors; default `data.dir=DIR`; `meta`: its meta.json when the caller has read it)."""
  what = what or f"data.dir={data_dir!r}"
  meta = meta or read_meta(data_dir, what)
  files = [os.path.join(data_dir, f) for f in meta["splits"][split]["files"]]
  missing = [f for f in files if not os.path.exists(f)]
  if missing:
    raise DataError(f"{what} is incomplete: {missing[0]} is missing; prepare it again")
  return grain.MapDataset.source(_BatchedArrayRecord(files))


class _BatchedArrayRecord(grain.sources.ArrayRecordDataSource):
  """grain's ArrayRecord source with batched reads. grain's source dataset reads a batch of
  indices (`MapDataset._getitems`) through the source's `_getitems` when it has one; this one
  reads each file's records in one call of its ArrayRecord reader (what array_record's own
  `__getitems__` does, without starting a thread pool per call)."""

  def _getitems(self, indices):
    out = [None] * len(indices)
    for reader, pairs in self._split_keys_per_reader(indices).items():
      self._ensure_reader_exists(reader)
      positions, where = zip(*pairs)
      for i, record in zip(where, self._readers[reader].read(list(positions))):
        out[i] = record
    return out


def decoded_documents(data_dir: str, split: str) -> grain.MapDataset:
  """Every document of one split, in stored order, as int32 token ids."""
  meta = read_meta(data_dir)
  return documents(data_dir, split, meta=meta).map(_Decode(meta["token_dtype"]))


def _shuffled(data_dir: str, split: str, seed: int, shuffle: bool,
              what: str = "", meta: dict | None = None) -> grain.MapDataset:
  """Decoded documents, shuffled anew every epoch (when `shuffle`) and repeated forever."""
  meta = meta or read_meta(data_dir, what or f"data.dir={data_dir!r}")
  docs = documents(data_dir, split, what, meta)
  if shuffle:
    docs = docs.shuffle(seed=seed)
  return docs.repeat(None).map(_Decode(meta["token_dtype"]))


def _mixed(spec: "StreamSpec") -> tuple[tuple[grain.MapDataset, ...],
                                        mixture_lib.MixtureSelection]:
  """The sources' document streams (each shuffled with a seed of its own) and the selection of
  the source of every sequence."""
  metas = mixture_lib.read_metas(spec.mixture)
  parents = tuple(_shuffled(s.dir, spec.split, spec.seed + 1_000_003 * (i + 1), spec.shuffle,
                            f"data.mixture entry {s.name}={s.dir}", meta)
                  for i, (s, meta) in enumerate(zip(spec.mixture, metas)))
  return parents, mixture_lib.MixtureSelection([s.weight for s in spec.mixture], spec.seed)


class PackedRows(grain.IterDataset):
  """This process's row streams, packed together: element n is micro-batch n (the module
  docstring). A grain IterDataset, so grain's prefetch and checkpointing wrap it as any other.
  `sources` are the document streams (one, or a mixture's), `selection` picks the source of each
  sequence (None for one source)."""

  def __init__(self, sources: tuple[grain.MapDataset, ...], spec: StreamSpec,
               selection: mixture_lib.MixtureSelection | None = None):
    super().__init__()
    self._sources, self._spec, self._selection = sources, spec, selection

  def __iter__(self) -> "_PackedRowsIterator":
    return _PackedRowsIterator(self._sources, self._spec, self._selection)


class _PackedRowsIterator(grain.DatasetIterator):
  """Packs every row of a micro-batch in one pass: the documents the rows need are read in one
  batched `_getitems` call per source and round (a row needs a new document when its current one
  runs out), and the rows' tokens, segment ids and positions are built with a few numpy calls
  over all rows at once, not per document. State: per row and source, its current document and
  the offset in it; with a mixture also the micro-batch count (which picks the sources)."""

  def __init__(self, sources: tuple[grain.MapDataset, ...], spec: StreamSpec,
               selection: mixture_lib.MixtureSelection | None):
    super().__init__()
    self._sources, self._selection = sources, selection
    self._rows = list(spec.local_rows)
    self._stride = spec.rows
    self._length = spec.seq_len + 1
    n, k = len(self._rows), len(sources)
    # Row i's current document of source s: element rows[i] + doc[i][s] * stride of the
    # source's shuffled documents; offset: its first token not yet emitted; tokens, once read
    # (a row keeps the document it is in of every source, so a switch of source reads nothing).
    self._doc = [[0] * k for _ in range(n)]
    self._offset = [[0] * k for _ in range(n)]
    self._tokens: list[list[np.ndarray | None]] = [[None] * k for _ in range(n)]
    self._micro_batch = 0

  def _read(self, which: list[int], src: list[int]) -> None:
    """Read the current documents (of source src[i]) of rows `which` that are not read yet, in
    one call per source."""
    by_source: dict[int, list[int]] = {}
    for i in which:
      if self._tokens[i][src[i]] is None:
        by_source.setdefault(src[i], []).append(i)
    for s, rows in by_source.items():
      index = [self._rows[i] + self._doc[i][s] * self._stride for i in rows]
      for i, tokens in zip(rows, self._sources[s]._getitems(index)):  # noqa: SLF001  batch read
        self._tokens[i][s] = tokens

  def __next__(self) -> dict[str, np.ndarray]:
    n, length = len(self._rows), self._length
    if self._selection is None:
      src = [0] * n
    else:
      src = self._selection(self._micro_batch * self._stride + np.asarray(self._rows)).tolist()
    pieces: list[list[np.ndarray]] = [[] for _ in range(n)]
    need = [length] * n
    pending = list(range(n))
    while pending:
      self._read(pending, src)
      short = []
      for i in pending:
        s = src[i]
        tokens, start = self._tokens[i][s], self._offset[i][s]
        take = min(len(tokens) - start, need[i])
        if take > 0:
          pieces[i].append(tokens[start:start + take])
          need[i] -= take
        if start + take >= len(tokens):  # the document is used up: the row moves to its next
          self._doc[i][s] += 1
          self._offset[i][s], self._tokens[i][s] = 0, None
        else:
          self._offset[i][s] = start + take
        if need[i]:
          short.append(i)
      pending = short
    self._micro_batch += 1
    return _batch(pieces, length)

  def get_state(self) -> dict:
    if self._selection is None:  # one source: a row's document and offset
      return {"doc": [d[0] for d in self._doc], "offset": [o[0] for o in self._offset]}
    return {"doc": [list(d) for d in self._doc], "offset": [list(o) for o in self._offset],
            "micro_batch": self._micro_batch}

  def set_state(self, state: dict) -> None:
    if len(state["doc"]) != len(self._rows) or len(state["offset"]) != len(self._rows):
      raise DataError(f"a data state of {len(state['doc'])} rows cannot restore a stream of "
                      f"{len(self._rows)} rows")
    if self._selection is None:
      self._doc = [[int(k)] for k in state["doc"]]
      self._offset = [[int(o)] for o in state["offset"]]
    else:
      self._doc = [[int(k) for k in d] for d in state["doc"]]
      self._offset = [[int(o) for o in off] for off in state["offset"]]
      self._micro_batch = int(state["micro_batch"])
    self._tokens = [[None] * len(self._sources) for _ in self._rows]


def _batch(pieces: list[list[np.ndarray]], length: int) -> dict[str, np.ndarray]:
  """Rows of `length` tokens, each the concatenation of its pieces (one per document, segment
  ids 1, 2, ... and positions from 0 in each), shifted into inputs and next-token targets."""
  flat = [p for row in pieces for p in row]
  n = len(pieces)
  lengths = np.fromiter((len(p) for p in flat), np.int64, len(flat))
  per_row = np.fromiter((len(row) for row in pieces), np.int64, n)
  first = np.cumsum(per_row) - per_row  # index of each row's first piece
  segment = np.arange(1, len(flat) + 1) - np.repeat(first, per_row)
  start = np.cumsum(lengths) - lengths  # of each piece in the flat [n * length] buffer
  tokens = np.concatenate(flat).reshape(n, length)
  segments = np.repeat(segment.astype(np.int32), lengths).reshape(n, length)
  positions = (np.arange(n * length) - np.repeat(start, lengths)).astype(np.int32)
  positions = positions.reshape(n, length)
  return {
      "inputs": tokens[:, :-1],
      "targets": tokens[:, 1:],
      "positions": positions[:, :-1],
      "segment_ids": segments[:, :-1],
      "loss_mask": (segments[:, 1:] == segments[:, :-1]) & (segments[:, :-1] > 0),
  }


def dataset(spec: StreamSpec) -> grain.IterDataset:
  """The per-process stream of micro-batches described in the module docstring."""
  if spec.mixture:
    sources, selection = _mixed(spec)
    ds = PackedRows(sources, spec, selection)
  else:
    ds = PackedRows((_shuffled(spec.data_dir, spec.split, spec.seed, spec.shuffle),), spec)
  if spec.prefetch:
    ds = grain.experimental.ThreadPrefetchIterDataset(ds, prefetch_buffer_size=spec.prefetch)
  return ds


# ----------------------------------------------------------------------------------------------
# Iterator state that survives a change in the number of processes.
#
# The iterator's state has one entry per row this process owns: the row's current document (its
# k-th: element row + k * rows of the shuffled documents) and the offset of its next token in it;
# with a mixture, one such pair per source and the micro-batch count. Each process saves its
# rows' entries together with which global rows they are; a restore assembles the entries of
# every row from every process's file and hands each process the rows it owns now. So a run
# saved by 4 hosts can continue on 2, or on 1, with the same data order.


def shard_state(iterator_state: dict, spec: StreamSpec) -> dict:
  """What one process saves: its rows' states and which global rows they are."""
  extra = {"micro_batch": iterator_state["micro_batch"]} if spec.mixture else {}
  names = {"sources": [s.name for s in spec.mixture]} if spec.mixture else {}
  return {"rows": list(spec.local_rows), "total_rows": spec.rows, **names,
          "row_states": [{"doc": k, "offset": o, **extra}
                         for k, o in zip(iterator_state["doc"], iterator_state["offset"])]}


def state_from_shards(shards: list[dict], spec: StreamSpec) -> dict:
  """This process's iterator state, assembled from the shards saved by any process count."""
  by_row = {}
  for shard in shards:
    if shard["total_rows"] != spec.rows:
      raise DataError(f"the saved data stream has {shard['total_rows']} rows per micro-batch, "
                      f"this run {spec.rows}")
    by_row.update(zip(shard["rows"], shard["row_states"]))
  missing = [r for r in spec.local_rows if r not in by_row]
  if missing:
    raise DataError(f"the saved data state lacks rows {missing}")
  states = [by_row[r] for r in spec.local_rows]
  restart = "whose data order this version does not continue; resume it with the version " \
            "that wrote it, or start a new run"
  if any("doc" not in s for s in states):
    raise DataError("the saved data state was written by the earlier per-row grain packer "
                    f"(ConcatThenSplit), {restart}")
  saved = {len(s["doc"]) if isinstance(s["doc"], list) else 0 for s in states}
  if not spec.mixture:
    if saved != {0}:
      raise DataError(f"the saved data state is a mixture's of {max(saved)} sources; this run "
                      "reads one directory (data.dir): set data.mixture as the saved run did")
    return {"doc": [int(s["doc"]) for s in states],
            "offset": [int(s["offset"]) for s in states]}
  if saved == {0}:
    raise DataError("the saved data state was written by a single directory or by the earlier "
                    f"mixture of documents (not of sequences), {restart}")
  names = [s.name for s in spec.mixture]
  for shard in shards:  # each source's position is kept by its place in data.mixture
    if shard.get("sources") != names:
      raise DataError(f"the saved data state is of the mixture {shard.get('sources')}; "
                      f"data.mixture names {names}: give the saved run's sources in its order")
  micro_batch = {int(s["micro_batch"]) for s in states}
  if len(micro_batch) != 1:
    raise DataError(f"the saved data state's rows are at different micro-batches {micro_batch}")
  return {"doc": [[int(k) for k in s["doc"]] for s in states],
          "offset": [[int(o) for o in s["offset"]] for s in states],
          "micro_batch": micro_batch.pop()}


def take(spec: StreamSpec, n: int) -> list[dict[str, np.ndarray]]:
  """The first n micro-batches of a stream (used for the fixed validation set)."""
  it = iter(dataset(dataclasses.replace(spec, prefetch=0)))
  return [next(it) for _ in range(n)]

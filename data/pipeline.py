"""grain input pipelines: prepared ArrayRecord documents -> packed, shifted token batches.

Layout of the stream. The global micro-batch has `rows` rows. Row r is its own packing stream:
it reads the shuffled documents r, r + rows, r + 2*rows, ... and packs them back to back into
sequences of `seq_len + 1` tokens (grain's ConcatThenSplit, which also emits segment ids and
positions). A process reads only the rows its devices hold (`row_ids`, from the batch sharding:
`sharding.process_rows`), so

  * each process reads only its shard of the data, and
  * the global batch at every step is the same whatever the number of processes or devices,

which is what makes a multi-host run equal a single-host one, and a restore onto a different
mesh continue the same data order. A step with gradient accumulation draws several consecutive
micro-batches. The iterator state (position of every row stream) is checkpointable.

With `mixture` (sources from `data.mixture`, see data/mixture.py) the shuffled documents are a
weighted mixture of several prepared directories whose element i is a pure function of i, so
everything above holds for mixtures too.

Batches are dicts of [rows_on_this_process, seq_len] numpy arrays:
  inputs, targets (next token), positions (within the document), segment_ids (1, 2, ... per
  document, 0 = padding), loss_mask (target belongs to the same document as the input).
"""
from __future__ import annotations

import dataclasses
import os
import sys

import grain
import numpy as np

from data import mixture as mixture_lib
from data.prepare import DataError, read_meta

_NO_THREADS = grain.ReadOptions(num_threads=0, prefetch_buffer_size=0)
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

  def __call__(self, record: bytes) -> dict[str, np.ndarray]:
    return {"tokens": np.frombuffer(record, dtype=self.dtype).astype(np.int32)}


def documents(data_dir: str, split: str) -> grain.MapDataset:
  """The raw records (one per document) of one split of a prepared directory."""
  meta = read_meta(data_dir)
  files = [os.path.join(data_dir, f) for f in meta["splits"][split]["files"]]
  missing = [f for f in files if not os.path.exists(f)]
  if missing:
    raise DataError(f"data.dir={data_dir!r} is incomplete: {missing[0]} is missing; "
                    "prepare it again")
  return grain.MapDataset.source(grain.sources.ArrayRecordDataSource(files))


def _shuffled(data_dir: str, split: str, seed: int, shuffle: bool) -> grain.MapDataset:
  """Decoded documents, shuffled anew every epoch (when `shuffle`) and repeated forever."""
  docs = documents(data_dir, split)
  if shuffle:
    docs = docs.shuffle(seed=seed)
  return docs.repeat(None).map(_Decode(read_meta(data_dir)["token_dtype"]))


@dataclasses.dataclass(frozen=True, eq=False)
class _Pick:
  parents: tuple
  selection: mixture_lib.MixtureSelection

  def __call__(self, i: int):
    s, k = self.selection[i]
    return self.parents[s][k]


def _mixed(spec: "StreamSpec") -> grain.MapDataset:
  metas = [read_meta(s.dir) for s in spec.mixture]
  mixture_lib.check(spec.mixture, metas)
  parents = tuple(_shuffled(s.dir, spec.split, spec.seed + 1_000_003 * (i + 1), spec.shuffle)
                  for i, s in enumerate(spec.mixture))
  selection = mixture_lib.MixtureSelection(
      mixture_lib.document_fractions(spec.mixture, metas), spec.seed)
  return grain.MapDataset.range(sys.maxsize).map(_Pick(parents, selection))


def _shift(elements: tuple[dict[str, np.ndarray], ...]) -> dict[str, np.ndarray]:
  tokens = np.stack([e["tokens"] for e in elements])
  segments = np.stack([e["tokens_segment_ids"] for e in elements])
  positions = np.stack([e["tokens_positions"] for e in elements])
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
    docs = _mixed(spec)
  else:
    docs = _shuffled(spec.data_dir, spec.split, spec.seed, spec.shuffle)
  streams = [
      grain.experimental.ConcatThenSplitIterDataset(
          docs[r::spec.rows].to_iter_dataset(_NO_THREADS),
          length_struct={"tokens": spec.seq_len + 1})
      for r in spec.local_rows
  ]
  ds = grain.experimental.ZipIterDataset(streams).map(_shift)
  if spec.prefetch:
    ds = grain.experimental.ThreadPrefetchIterDataset(ds, prefetch_buffer_size=spec.prefetch)
  return ds


# ----------------------------------------------------------------------------------------------
# Iterator state that survives a change in the number of processes.
#
# The iterator's state is a list with one entry per row stream this process owns. Each process
# saves its block together with the row range it covers; a restore assembles the full list from
# every process's block and hands each process the rows it owns now. So a run saved by 4 hosts
# can continue on 2, or on 1, with the same data order.


def shard_state(iterator_state: dict, spec: StreamSpec) -> dict:
  """What one process saves: its rows' states and which global rows they are."""
  return {"rows": list(spec.local_rows), "total_rows": spec.rows,
          "row_states": iterator_state["parents"]}


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
  return {"parents": [_from_json(by_row[r]) for r in spec.local_rows]}


def _from_json(row_state: dict) -> dict:
  """A row stream's state as grain wrote it. JSON turns the packer's "no remainder" slices
  (-1, -1) into a list, which grain would read as a remainder (a wrong batch after a restore at
  a document boundary that falls exactly on a sequence boundary): make them tuples again."""
  slices = row_state.get("remainder_slices")
  if slices is None:
    return row_state
  return {**row_state, "remainder_slices": {k: tuple(v) for k, v in slices.items()}}


def take(spec: StreamSpec, n: int) -> list[dict[str, np.ndarray]]:
  """The first n micro-batches of a stream (used for the fixed validation set)."""
  it = iter(dataset(dataclasses.replace(spec, prefetch=0)))
  return [next(it) for _ in range(n)]

"""grain input pipelines: prepared token files -> packed, shifted micro-batches.

The order is data/windows.py's: global window g is the g-th sequence a run trains on. Row r of
the micro-batch that starts at window g holds window g + r, and a step of batch B reads windows
[g_t, g_t + B) as B / rows micro-batches. So micro-batches, devices, processes and the mesh only
place a step's sequences; each process reads only its devices' rows (`row_ids`, from
`sharding.process_rows`); the iterator state is one number (`{"windows": g}`), and a restore
onto another mesh continues exactly. With `mixture` (data/mixture.py) all of it holds too.
With `masking` (data/masking.py, the masked LM) each row is corrupted by draws keyed by the
order's seed and its global window, so that holds for masked-LM batches as well.

Batches are dicts of [rows_on_this_process, seq_len] numpy arrays:
  inputs, targets (next token), positions (within the document piece), segment_ids (1, 2, ...
  per piece, 0 = padding), loss_mask (target belongs to the same piece as the input).
Why and details: docs/data.md#the-order-a-run-reads
"""
from __future__ import annotations

import dataclasses
import functools

import grain
import numpy as np

from data import mixture as mixture_lib
from data import mnist1d
from data.masking import Masking
from data.meta import DataError, read_meta
from data.tokens import SplitTokens
from data.windows import WindowOrder

BATCH_KEYS = ("inputs", "targets", "positions", "segment_ids", "loss_mask")
# The validation order's seed: the evaluation set never depends on the run's seed.
EVAL_SEED = 20_240_601


@dataclasses.dataclass(frozen=True)
class StreamSpec:
  data_dir: str
  split: str  # "train" or "validation"
  seq_len: int
  rows: int  # global rows of one micro-batch
  seed: int = 0
  row_ids: tuple[int, ...] | None = None  # the rows this process reads; None = all of them
  prefetch: int = 0  # micro-batches prepared ahead in a background thread (0 = none)
  mixture: tuple[mixture_lib.Source, ...] = ()  # when set, read these instead of data_dir
  masking: Masking | None = None  # masked-LM rows instead of next-token ones (data/masking.py)

  @property
  def local_rows(self) -> tuple[int, ...]:
    return tuple(range(self.rows)) if self.row_ids is None else tuple(self.row_ids)

  def sources(self) -> tuple[mixture_lib.Source, ...]:
    return self.mixture or (mixture_lib.Source("data", self.data_dir),)


def _source_seed(seed: int, i: int, mixed: bool) -> int:
  """The order's seed of source i (a mixture's sources each shuffle with a seed of their own)."""
  return seed + 1_000_003 * (i + 1) if mixed else seed


class Windows:
  """Global window index -> its tokens, for a spec's source or mixture (module docstring);
  `evaluation`: the order of a fixed evaluation set (documents in stored order, the last and
  shorter window kept). Opening checks every file of the split (data/tokens.py)."""

  def __init__(self, spec: StreamSpec, *, evaluation: bool = False):
    sources = spec.sources()
    if spec.mixture:
      metas = mixture_lib.read_metas(sources)
      whats = [f"data.mixture entry {s.name}={s.dir}" for s in sources]
    else:
      whats = [f"data.dir={spec.data_dir!r}"]
      metas = [read_meta(spec.data_dir, whats[0])]
    self.width = spec.seq_len + 1
    self.seed, self.masking = spec.seed, spec.masking
    self.metas = metas
    self.tokens = [SplitTokens(s.dir, spec.split, what, meta)
                   for s, what, meta in zip(sources, whats, metas)]
    self.orders = [WindowOrder(t.lengths, spec.seq_len,
                               _source_seed(spec.seed, i, bool(spec.mixture)),
                               shuffle_documents=not evaluation, keep_tail=evaluation,
                               what=f"the {spec.split} split of {what}")
                   for i, (t, what) in enumerate(zip(self.tokens, whats))]
    self.selection = (mixture_lib.MixtureSelection([s.weight for s in sources], spec.seed)
                      if spec.mixture else None)

  def locate(self, indices) -> list[list[tuple[int, int, int, int]]]:
    """Where each global window in `indices` lies: [(source, document, start, stop), ...]."""
    indices = np.asarray(indices, np.int64)
    if self.selection is None:
      source, rank = np.zeros(len(indices), np.int64), indices
    else:
      source, rank = self.selection.rank(indices)
    out: list[list[tuple[int, int, int, int]]] = [[] for _ in indices]
    for s in np.unique(source):
      where = np.flatnonzero(source == s)
      for i, row in zip(where, self.orders[s].pieces(rank[where])):
        out[i] = [(int(s), doc, start, stop) for doc, start, stop in row]
    return out

  def pieces(self, indices) -> list[list[np.ndarray]]:
    """The token pieces of each global window in `indices` (one list per window)."""
    return [[self.tokens[s].read(doc, start, stop) for s, doc, start, stop in row]
            for row in self.locate(indices)]

  def batch(self, indices) -> dict[str, np.ndarray]:
    """Rows of the global windows `indices` (a negative index is an empty padding row)."""
    indices = np.asarray(indices, np.int64)
    real = indices >= 0
    pieces = iter(self.pieces(indices[real]))
    rows = _batch([next(pieces) if r else [] for r in real], self.width)
    return rows if self.masking is None else self.masking.apply(rows, indices, self.seed)


def _batch(pieces: list[list[np.ndarray]], length: int) -> dict[str, np.ndarray]:
  """Rows of `length` tokens, each the concatenation of its pieces (segment ids 1, 2, ... and
  positions from 0 in each piece) and padding after them (segment id 0, no loss), shifted into
  inputs and next-token targets."""
  n = len(pieces)
  pad = [length - sum(len(p) for p in row) for row in pieces]
  rows = [row + [np.zeros(k, np.int32)] if k else row for row, k in zip(pieces, pad)]
  flat = [p for row in rows for p in row]
  lengths = np.fromiter((len(p) for p in flat), np.int64, len(flat))
  per_row = np.fromiter((len(row) for row in rows), np.int64, n)
  first = np.cumsum(per_row) - per_row  # index of each row's first piece
  segment = np.arange(1, len(flat) + 1) - np.repeat(first, per_row)
  last = first + per_row - 1  # a padded row's last piece is its padding
  segment[last[np.asarray(pad, np.int64) > 0]] = 0
  start = np.cumsum(lengths) - lengths  # of each piece in the flat [n * length] buffer
  tokens = (np.concatenate(flat) if flat else np.zeros(0, np.int32)).astype(np.int32)
  tokens = tokens.reshape(n, length)
  segments = np.repeat(segment.astype(np.int32), lengths).reshape(n, length)
  positions = (np.arange(n * length) - np.repeat(start, lengths)).astype(np.int32)
  positions = np.where(segments > 0, positions.reshape(n, length), 0)
  return {
      "inputs": tokens[:, :-1],
      "targets": tokens[:, 1:],
      "positions": positions[:, :-1],
      "segment_ids": segments[:, :-1],
      "loss_mask": (segments[:, 1:] == segments[:, :-1]) & (segments[:, :-1] > 0),
  }


class MicroBatches(grain.IterDataset):
  """This process's rows of consecutive micro-batches of the window order: element n holds the
  windows start + n rows + r for its rows r. A grain IterDataset, so grain's prefetch and
  checkpointing wrap it as any other; its state is the count of windows read."""

  def __init__(self, windows: Windows, spec: StreamSpec):
    super().__init__()
    self._windows, self._spec = windows, spec

  def __iter__(self) -> "_MicroBatchIterator":
    return _MicroBatchIterator(self._windows, self._spec)


class _MicroBatchIterator(grain.DatasetIterator):

  def __init__(self, windows: Windows, spec: StreamSpec):
    super().__init__()
    self._windows = windows
    self._rows = np.asarray(spec.local_rows, np.int64)
    self._stride = spec.rows
    self._next = 0  # the global window of the next micro-batch's row 0

  def __next__(self) -> dict[str, np.ndarray]:
    batch = self._windows.batch(self._next + self._rows)
    self._next += self._stride
    return batch

  def get_state(self) -> dict:
    return {"windows": self._next}

  def set_state(self, state: dict) -> None:
    self._next = int(state["windows"])


def check(spec: StreamSpec, evaluation: bool) -> None:
  """Raise the DataError (or MixtureError) a run on `spec` would meet when it opens its data:
  meta.json, every token and offset file of the training split (and, with `evaluation`, of the
  validation split), and at least one training window. Cheap: files are mapped, not read."""
  Windows(spec)
  if evaluation:
    Windows(dataclasses.replace(spec, split="validation"), evaluation=True)


def dataset(spec: StreamSpec) -> grain.IterDataset:
  """The per-process stream of micro-batches described in the module docstring (the vision
  workload's examples for an ExampleSpec, data/mnist1d.py)."""
  if isinstance(spec, mnist1d.ExampleSpec):
    return mnist1d.dataset(spec)
  ds = MicroBatches(Windows(spec), spec)
  if spec.prefetch:
    ds = grain.experimental.ThreadPrefetchIterDataset(ds, prefetch_buffer_size=spec.prefetch)
  return ds


def validation_batches(source: mixture_lib.Source, seq_len: int, sequences: int, rows: int,
                       row_ids=None, masking: Masking | None = None
                       ) -> list[dict[str, np.ndarray]]:
  """The fixed evaluation set of a source: the first `sequences` windows of its validation split
  (documents in stored order, windows permuted with `EVAL_SEED`: a uniform sample of the split's
  windows; all of them, the last and shorter one included, when it has fewer), in micro-batches
  of `rows` rows of which this process reads `row_ids`; rows past the set are padding (no loss).
  Independent of the run's seed, micro-batch size, devices and processes; with `masking`, masked
  by draws keyed by `EVAL_SEED` (the same masks in every run)."""
  spec = StreamSpec(source.dir, "validation", seq_len, rows, seed=EVAL_SEED, row_ids=row_ids,
                    masking=masking)
  windows = Windows(spec, evaluation=True)
  count = min(sequences, windows.orders[0].per_epoch)
  local = np.asarray(spec.local_rows, np.int64)
  out = []
  for start in range(0, count, rows):
    g = start + local
    out.append(windows.batch(np.where(g < count, g, -1)))
  return out


# ----------------------------------------------------------------------------------------------
# The iterator state in a checkpoint: the windows read, and what they were read from.


@functools.cache
def identity(spec: StreamSpec) -> dict:
  """What a position in the order means: the seed, sequence length and each source's data
  (tokenizer, documents, tokens, weight). Saved beside the position (`saved_state`)."""
  sources = spec.sources()
  metas = [read_meta(s.dir) for s in sources]
  return {"seed": spec.seed, "seq_len": spec.seq_len, "sources": [
      {"name": s.name, "weight": s.weight, "tokenizer": _tokenizer_id(m),
       "documents": m["splits"][spec.split]["documents"],
       "tokens": m["splits"][spec.split]["tokens"]} for s, m in zip(sources, metas)]}


def _tokenizer_id(meta: dict) -> str:
  t = meta["tokenizer"]
  return f"{t['kind']}/{t['hash'] or '-'}/vocab {t['vocab_size']}"


def saved_state(iterator_state: dict, spec: StreamSpec) -> dict:
  """What a checkpoint keeps of the data stream (the same on every process)."""
  if isinstance(spec, mnist1d.ExampleSpec):
    return mnist1d.saved_state(iterator_state, spec)
  return {"windows": int(iterator_state["windows"]), **identity(spec)}


def restored_state(saved: list[dict], spec: StreamSpec, windows_before: int | None = None
                   ) -> tuple[dict, str | None]:
  """(iterator state, a line to log or None) from the data states a checkpoint's processes
  saved. A run on another tokenizer is refused (DataError): its ids mean other text. Another
  dataset, mixture or seed is taken, from the same position, with one line saying so (skipping
  data after a loss spike is such a change). A state written by the earlier per-row reader
  continues at `windows_before` (the windows the steps before the checkpoint read in this
  order; None: refused), also said in one line."""
  if not saved:
    raise ValueError("the checkpoint holds no data state")
  if isinstance(spec, mnist1d.ExampleSpec):
    return mnist1d.restored_state(saved, spec)
  if "windows" not in saved[0]:
    if windows_before is None:
      raise DataError("the checkpoint's data position was saved by the earlier per-row reader, "
                      "which this version does not continue")
    return {"windows": windows_before}, (
        "the checkpoint's data position was saved by the earlier per-row reader: continuing at "
        f"window {windows_before} of this version's order (the steps after the checkpoint read "
        "other sequences than that version would have)")
  positions = {int(s["windows"]) for s in saved}
  if len(positions) != 1:
    raise ValueError(f"the processes saved different data positions {sorted(positions)}")
  state, now = {"windows": positions.pop()}, identity(spec)
  old = saved[0]
  old_tok = {s["tokenizer"] for s in old["sources"]}
  new_tok = {s["tokenizer"] for s in now["sources"]}
  if old_tok != new_tok:
    raise DataError(f"the checkpoint was trained on data tokenized by {', '.join(old_tok)}; "
                    f"this run's data uses {', '.join(new_tok)}, whose token ids mean other text")
  changes = [f"{key} {old[key]} -> {now[key]}" for key in ("seed",) if old[key] != now[key]]
  describe = lambda info: ", ".join(f"{s['name']} ({s['documents']} documents, {s['tokens']:,} "
                                    f"tokens, weight {s['weight']:.3g})" for s in info)
  if old["sources"] != now["sources"]:
    changes.append(f"data {describe(old['sources'])} -> {describe(now['sources'])}")
  if not changes:
    return state, None
  return state, (f"the data order changes from window {state['windows']} on ("
                 f"{'; '.join(changes)}): the steps after the checkpoint read windows of the new "
                 "order")

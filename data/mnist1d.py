"""The vision workload's data: mnist1d's 1-D digits (Greydanus 2020), generated and cached.

`prepare` calls the `mnist1d` package's generator (`get_dataset_args` + `make_dataset`, never its
download path) for `train_examples` examples from the config's seed and for a fixed test set
(`TEST_EXAMPLES` from `TEST_SEED`, the same in every run), and caches the arrays as .npy files
beside a meta.json, so a second run reads them. The order is the token windows' (data/pipeline.py):
global example g is the g-th a run trains on, drawn from epoch g // N's permutation keyed by
(seed, epoch), so micro-batches, devices and processes only place a step's examples; the
iterator's state is one number. Rows: inputs [rows, 40] float32, targets and loss_mask
[rows, 1] (a padding row has no loss). Details: docs/vision.md
"""
from __future__ import annotations

import dataclasses
import functools
import hashlib
import os
import shutil

import grain
import numpy as np

from data.meta import DataError
from data.shards import read_json, write_json

TEST_SEED, TEST_EXAMPLES = 20_240_601, 4_000
SALT = 0x766973  # "vis": the order's permutations are a stream of their own
VERSION = 1  # of the cache's layout and generation


def cache_dir(train_examples: int, seed: int) -> str:
  """Where the arrays of (train_examples, seed) are cached: under `$SCALETRAIN_DATA` or
  ~/.cache/scaletrain, like the default corpus."""
  base = os.environ.get("SCALETRAIN_DATA") or os.path.join(
      os.environ.get("XDG_CACHE_HOME") or os.path.expanduser("~/.cache"), "scaletrain")
  return os.path.join(base, f"mnist1d-n{train_examples}-s{seed}-v{VERSION}")


def _generate(examples: int, seed: int) -> tuple[np.ndarray, np.ndarray]:
  try:
    from mnist1d.data import get_dataset_args, make_dataset  # noqa: PLC0415  optional (the vision extra)
  except ImportError:
    raise DataError("the vision workload generates its data with the mnist1d package, which is "
                    "not installed: pip install -e '.[vision]'") from None
  args = get_dataset_args()
  args.num_samples, args.train_split, args.seed = examples, 1.0, seed
  d = make_dataset(args)  # examples // 10 per digit, standardised, shuffled
  return d["x"].astype(np.float32), d["y"].astype(np.int32)


def prepare(train_examples: int, seed: int, out_dir: str = "") -> str:
  """The cached directory of (train_examples, seed), generating it on first use."""
  out_dir = out_dir or cache_dir(train_examples, seed)
  if read_json(os.path.join(out_dir, "meta.json")) is not None:
    return out_dir
  work = out_dir + f".partial{os.getpid()}"
  os.makedirs(work, exist_ok=True)
  meta = {"source": {"name": "mnist1d", "seed": seed, "test_seed": TEST_SEED}, "splits": {}}
  for split, n, s in (("train", train_examples, seed), ("test", TEST_EXAMPLES, TEST_SEED)):
    x, y = _generate(n, s)
    np.save(os.path.join(work, f"{split}_x.npy"), x)
    np.save(os.path.join(work, f"{split}_y.npy"), y)
    meta["splits"][split] = {"examples": len(y), "tokens": len(y)}
  h = hashlib.sha256(np.load(os.path.join(work, "train_x.npy")).tobytes())
  meta["source"]["fingerprint"] = h.hexdigest()[:16]
  write_json(os.path.join(work, "meta.json"), meta)
  try:
    os.rename(work, out_dir)
  except OSError:  # another process finished first: theirs is the same
    shutil.rmtree(work, ignore_errors=True)
  return out_dir


@functools.cache
def _arrays(data_dir: str, split: str) -> tuple[np.ndarray, np.ndarray]:
  try:
    return (np.load(os.path.join(data_dir, f"{split}_x.npy")),
            np.load(os.path.join(data_dir, f"{split}_y.npy")))
  except OSError as e:
    raise DataError(f"mnist1d data in {data_dir!r} is unreadable ({e}); delete the directory "
                    "to generate it again") from None


@dataclasses.dataclass(frozen=True)
class ExampleSpec:
  """The train stream of examples (data/pipeline.py's StreamSpec for the vision workload)."""
  data_dir: str
  rows: int  # global rows of one micro-batch
  seed: int = 0
  row_ids: tuple[int, ...] | None = None  # the rows this process reads; None = all
  prefetch: int = 0

  @property
  def local_rows(self) -> tuple[int, ...]:
    return tuple(range(self.rows)) if self.row_ids is None else tuple(self.row_ids)


def _rows(x: np.ndarray, y: np.ndarray, index: np.ndarray) -> dict[str, np.ndarray]:
  """Rows of the examples `index` of (x, y); a negative index is a padding row."""
  real = index >= 0
  take = np.where(real, index, 0)
  return {"inputs": np.where(real[:, None], x[take], 0.0).astype(np.float32),
          "targets": np.where(real, y[take], 0).astype(np.int32)[:, None],
          "loss_mask": real[:, None]}


class ExampleOrder:
  """Global example index -> example, epoch e a permutation keyed by (seed, e)."""

  def __init__(self, spec: ExampleSpec):
    self.x, self.y = _arrays(spec.data_dir, "train")
    self.seed = spec.seed

  @functools.lru_cache(maxsize=2)
  def permutation(self, epoch: int) -> np.ndarray:
    return np.random.default_rng([SALT, self.seed, epoch]).permutation(len(self.y))

  def batch(self, indices: np.ndarray) -> dict[str, np.ndarray]:
    n = len(self.y)
    index = np.array([self.permutation(int(g) // n)[int(g) % n] for g in indices], np.int64)
    return _rows(self.x, self.y, index)


class _Iterator(grain.DatasetIterator):

  def __init__(self, spec: ExampleSpec):
    super().__init__()
    self._order, self._stride = ExampleOrder(spec), spec.rows
    self._rows = np.asarray(spec.local_rows, np.int64)
    self._next = 0  # the global example of the next micro-batch's row 0

  def __next__(self) -> dict[str, np.ndarray]:
    batch = self._order.batch(self._next + self._rows)
    self._next += self._stride
    return batch

  def get_state(self) -> dict:
    return {"examples": self._next}

  def set_state(self, state: dict) -> None:
    self._next = int(state["examples"])


class Examples(grain.IterDataset):

  def __init__(self, spec: ExampleSpec):
    super().__init__()
    self._spec = spec

  def __iter__(self) -> _Iterator:
    return _Iterator(self._spec)


def dataset(spec: ExampleSpec) -> grain.IterDataset:
  ds = Examples(spec)
  if spec.prefetch:
    ds = grain.experimental.ThreadPrefetchIterDataset(ds, prefetch_buffer_size=spec.prefetch)
  return ds


def test_batches(data_dir: str, examples: int, rows: int, row_ids=None) -> list[dict]:
  """The first `examples` of the fixed test set (all of it when fewer) in micro-batches of
  `rows` rows, this process's `row_ids` of each; rows past the set are padding."""
  x, y = _arrays(data_dir, "test")
  count = min(examples, len(y))
  local = np.asarray(range(rows) if row_ids is None else row_ids, np.int64)
  return [_rows(x, y, np.where(start + local < count, start + local, -1))
          for start in range(0, count, rows)]


def read_meta(data_dir: str) -> dict:
  meta = read_json(os.path.join(data_dir, "meta.json"))
  if not isinstance(meta, dict) or meta.get("source", {}).get("name") != "mnist1d":
    raise DataError(f"data.dir={data_dir!r} holds no mnist1d arrays; leave data.dir empty "
                    "(they are generated and cached on first use)")
  return meta


def identity(spec: ExampleSpec) -> dict:
  source = read_meta(spec.data_dir)["source"]
  return {"seed": spec.seed, "data": f"mnist1d {source['fingerprint']}"}


def saved_state(iterator_state: dict, spec: ExampleSpec) -> dict:
  return {"examples": int(iterator_state["examples"]), **identity(spec)}


def restored_state(saved: list[dict], spec: ExampleSpec) -> tuple[dict, str | None]:
  """(iterator state, a line saying the order changes, or None)."""
  positions = {int(s.get("examples", -1)) for s in saved}
  if len(positions) != 1 or -1 in positions:
    raise DataError(f"the checkpoint's data positions {sorted(positions)} are not one mnist1d "
                    "position (was it written by another workload?)")
  state, old, now = {"examples": positions.pop()}, saved[0], identity(spec)
  changes = [f"{k} {old[k]} -> {now[k]}" for k in ("seed", "data") if old.get(k) != now[k]]
  return state, (f"the data order changes from example {state['examples']} on "
                 f"({'; '.join(changes)})" if changes else None)

"""Weighted mixtures of prepared directories (`data.mixture`).

    --config.data.mixture="code=data/a:0.7,prose=data/b:0.3"     # NAME=DIR:WEIGHT, ...

Weights are fractions of training *tokens* (normalised to sum to 1). They become fractions of
documents through each source's mean document length (from its meta.json), and the mixture is
a grain MapDataset whose element i is a document of the source `MixtureSelection` picks for i:

  * the global index space is cut into blocks of `BLOCK` documents; in each block every source
    has a fixed count (largest remainder of its document fraction x BLOCK), placed at positions
    given by a permutation seeded by (seed, block);
  * so the source and the index within the source of element i are a pure function of i, which
    is what keeps the pipeline's row streams (row r reads elements r, r + rows, ...) and their
    checkpointed state exact on any process count, as for a single directory.

Each source is shuffled and repeated on its own (a small source repeats more often). All sources
must share one tokenizer. Evaluation scores each source's validation split on its own
(`eval_loss/NAME`, `eval_bpb/NAME`).
"""
from __future__ import annotations

import dataclasses

import numpy as np

BLOCK = 4096


class MixtureError(ValueError):
  """A malformed `data.mixture` (reported in one line)."""


@dataclasses.dataclass(frozen=True)
class Source:
  name: str
  dir: str
  weight: float = 1.0


def parse(text: str) -> tuple[Source, ...]:
  """"name=dir:weight,..." -> Sources with weights normalised to sum to 1."""
  out = []
  for item in (s.strip() for s in text.split(",") if s.strip()):
    name, eq, rest = item.partition("=")
    if not eq:
      raise MixtureError(f"data.mixture: {item!r} is not NAME=DIR:WEIGHT "
                         "(e.g. 'code=data/a:0.7,prose=data/b:0.3')")
    path, colon, weight = rest.rpartition(":")
    try:
      w = float(weight) if colon else float("nan")
    except ValueError:
      w = float("nan")
    if not name or not path or not w > 0:
      raise MixtureError(f"data.mixture: {item!r} is not NAME=DIR:WEIGHT with a positive "
                         "weight (e.g. 'code=data/a:0.7')")
    out.append(Source(name.strip(), path.strip(), w))
  if not out:
    raise MixtureError(f"data.mixture={text!r} names no sources")
  names = [s.name for s in out]
  if len(set(names)) != len(names):
    raise MixtureError(f"data.mixture: source names repeat in {names}")
  total = sum(s.weight for s in out)
  return tuple(dataclasses.replace(s, weight=s.weight / total) for s in out)


def check(sources: tuple[Source, ...], metas: list[dict]) -> None:
  """All sources must share one tokenizer."""
  first = metas[0]["tokenizer"]
  for s, m in zip(sources[1:], metas[1:]):
    t = m["tokenizer"]
    if (t["kind"], t["hash"], t["vocab_size"]) != (first["kind"], first["hash"],
                                                  first["vocab_size"]):
      raise MixtureError(f"data.mixture: source {s.name!r} ({s.dir}) uses tokenizer "
                         f"{t['kind']}/{t['hash'] or '-'} vocab {t['vocab_size']}, source "
                         f"{sources[0].name!r} {first['kind']}/{first['hash'] or '-'} vocab "
                         f"{first['vocab_size']}; prepare them with the same tokenizer")


def document_fractions(sources: tuple[Source, ...], metas: list[dict]) -> np.ndarray:
  """Token weights -> document fractions, through each source's mean train document length."""
  mean_len = np.array([m["splits"]["train"]["tokens"] / max(m["splits"]["train"]["documents"], 1)
                       for m in metas])
  p = np.array([s.weight for s in sources]) / mean_len
  return p / p.sum()


class MixtureSelection:
  """Element i -> (source, index within the source); see the module docstring."""

  def __init__(self, fractions, seed: int, block: int = BLOCK):
    exact = np.asarray(fractions, np.float64) * block
    counts = np.floor(exact).astype(np.int64)
    order = np.argsort(-(exact - counts), kind="stable")
    counts[order[:block - counts.sum()]] += 1
    self.counts, self.seed, self.block = counts, seed, block
    self._slots = np.repeat(np.arange(len(counts)), counts)
    self._cache: dict[int, tuple[np.ndarray, np.ndarray]] = {}

  def _block(self, b: int) -> tuple[np.ndarray, np.ndarray]:
    if b not in self._cache:
      if len(self._cache) > 8:
        self._cache.clear()
      src = self._slots[np.random.default_rng([self.seed, b]).permutation(self.block)]
      rank = np.empty(self.block, np.int64)
      for s in range(len(self.counts)):
        where = np.nonzero(src == s)[0]
        rank[where] = np.arange(len(where))
      self._cache[b] = (src, rank)
    return self._cache[b]

  def __getitem__(self, i: int) -> tuple[int, int]:
    b, j = divmod(int(i), self.block)
    src, rank = self._block(b)
    s = int(src[j])
    return s, b * int(self.counts[s]) + int(rank[j])

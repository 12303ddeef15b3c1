"""Weighted mixtures of prepared directories (`data.mixture`).

    --config.data.mixture="code=data/a:0.7,prose=data/b:0.3"     # NAME=DIR:WEIGHT, ...

Weights are fractions of the tokens trained on. Every window of `seq_len + 1` tokens comes from
one source, so a source's share of windows is its share of tokens, whatever its documents'
lengths. Which source fills global window g is a pure function of g, the same on any process
count, and g is window `rank` of that source's own order (`MixtureSelection.rank`):

  apportionment  N_s(x), source s's windows among the first x, in closed form from integer
                 weights: within S - 1 of w_s x at every x (S sources)
  placement      blocks of BLOCK windows, each block's sources permuted by a seed of (seed, b)

Each source is shuffled with a seed of its own and repeats on its own; all share one tokenizer.
Why and details: docs/data.md#mixtures
"""
from __future__ import annotations

import dataclasses
import math

import numpy as np

from data.meta import DataError, read_meta

BLOCK = 256  # sequences per placement block
UNITS = 1 << 48  # weights are integers: units of 2^-48 of the total


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
    if not name or not path or not 0 < w < math.inf:
      raise MixtureError(f"data.mixture: {item!r} is not NAME=DIR:WEIGHT with a positive "
                         "finite weight (e.g. 'code=data/a:0.7')")
    out.append(Source(name.strip(), path.strip(), w))
  if not out:
    raise MixtureError(f"data.mixture={text!r} names no sources")
  names = [s.name for s in out]
  if len(set(names)) != len(names):
    raise MixtureError(f"data.mixture: source names repeat in {names}")
  total = sum(s.weight for s in out)
  sources = tuple(dataclasses.replace(s, weight=s.weight / total) for s in out)
  for s in sources:
    if round(s.weight * UNITS) == 0:
      raise MixtureError(f"data.mixture: source {s.name!r} has weight {s.weight:.3g} of the "
                         f"total, below the 2^-48 the mixture resolves, so it would never be "
                         "read; raise its weight or leave it out")
  return sources


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


def read_metas(sources: tuple[Source, ...]) -> list[dict]:
  """Each source's meta.json, checked (`check`); an unreadable source is one line naming its
  mixture entry (NAME=DIR)."""
  metas = []
  for s in sources:
    try:
      metas.append(read_meta(s.dir, what=f"data.mixture entry {s.name}={s.dir}"))
    except DataError as e:
      raise MixtureError(str(e)) from None
  check(sources, metas)
  return metas


class MixtureSelection:
  """Global sequence index g -> the source that fills it; see the module docstring."""

  def __init__(self, weights, seed: int, block: int = BLOCK):
    units = [round(float(w) * UNITS) for w in weights]
    assert min(units) > 0, weights  # `parse` refuses a weight below one unit
    self.units = units
    self.order = sorted(range(len(units)), key=lambda s: (units[s], s))  # smallest first
    self.seed, self.block = seed, block
    self._cache: dict[int, np.ndarray] = {}

  def counts(self, x: int) -> list[int]:
    """N_s(x) for every source s: its sequences among the first x (exact integer arithmetic)."""
    out = [0] * len(self.units)
    rest, total = int(x), sum(self.units)
    for s in self.order[:-1]:
      out[s] = rest * self.units[s] // total
      rest, total = rest - out[s], total - self.units[s]
    out[self.order[-1]] = rest
    return out

  def _block(self, b: int) -> np.ndarray:
    """The source of each sequence of block b."""
    if b not in self._cache:
      if len(self._cache) > 8:
        self._cache.clear()
      per = np.subtract(self.counts((b + 1) * self.block), self.counts(b * self.block))
      slots = np.repeat(np.arange(len(per)), per)
      self._cache[b] = slots[np.random.default_rng([self.seed, b]).permutation(self.block)]
    return self._cache[b]

  def __call__(self, g) -> np.ndarray:
    """Sources of the global sequence indices `g` (an int array)."""
    return self.rank(g)[0]

  def rank(self, g) -> tuple[np.ndarray, np.ndarray]:
    """(source of each global index in `g`, how many sequences of that source come before it):
    global sequence g is sequence rank[g] of its source's own order."""
    g = np.asarray(g, np.int64)
    source, rank = np.empty(g.shape, np.int64), np.empty(g.shape, np.int64)
    blocks = g // self.block
    for b in np.unique(blocks):
      where = blocks == b
      slots = self._block(int(b))
      offset = g[where] % self.block
      s = slots[offset]
      # sequences of source s before g: those of the blocks before, then those of this block
      # at earlier positions
      before = np.asarray(self.counts(int(b) * self.block))[s]
      within = np.cumsum(slots[None, :] == np.arange(len(self.units))[:, None], axis=1)
      source[where] = s
      rank[where] = before + within[s, offset] - 1
    return source, rank

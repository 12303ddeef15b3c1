"""The order a split is read in: every sequence an independent draw (`WindowOrder`).

    epoch e:   documents in a seeded shuffled order, packed back to back into one stream
               | doc 5 ....... | doc 2 .. | doc 9 ............ | doc 0 ... |  ...
    windows:   the stream cut into windows of seq_len + 1 tokens (the tail shorter than one
               window is dropped in training)
               |  w0  |  w1  |  w2  |  w3  |  w4  |  w5  |  w6  | ...  (K per epoch)
    order:     the windows of epoch e permuted by a seeded bijection (`permute`, a Feistel
               network: O(1) memory, random access): global index g = e K + j reads window
               pi_e(j)

Step t reads the global indices [g_t, g_t + B_t), g_t the windows of the steps before it, however
they are split into micro-batches, devices and processes. A window holds (document, start, stop)
pieces of the 1-3 documents it overlaps, a pure function of the lengths, the seed and the index.
Why: docs/data.md#the-order-a-run-reads
"""
from __future__ import annotations

import numpy as np

from data.meta import DataError

ROUNDS = 4  # Feistel rounds: 4 with independent round functions make a pseudorandom permutation


def _seed32(*words: int) -> int:
  """A 32-bit seed from integers."""
  return int(np.random.SeedSequence([int(w) for w in words]).generate_state(1)[0])


def _mix(x: np.ndarray) -> np.ndarray:
  """splitmix64's finaliser: every output bit depends on every input bit (uint64, wrapping)."""
  x = (x ^ (x >> np.uint64(30))) * np.uint64(0xBF58476D1CE4E5B9)
  x = (x ^ (x >> np.uint64(27))) * np.uint64(0x94D049BB133111EB)
  return x ^ (x >> np.uint64(31))


def permute(indices, n: int, seed: int) -> np.ndarray:
  """A seeded bijection of [0, n), applied to `indices` (vectorised, O(1) memory: any index
  without the others). A balanced Feistel network over the smallest even number of bits that
  holds n (Luby-Rackoff: ROUNDS rounds of keyed splitmix64), walked until it lands in [0, n)
  (cycle walking keeps it a bijection; fewer than 4 steps on average). grain's index_shuffle is
  the same idea, but one Python call per index at ~10-40 us each, too slow for a step's rows."""
  bits = max(2, (n - 1).bit_length())
  half = np.uint64((bits + 1) // 2)
  mask = np.uint64((1 << int(half)) - 1)
  keys = np.random.SeedSequence([seed, n]).generate_state(ROUNDS, np.uint64)
  x = np.asarray(indices, np.uint64).copy()
  todo = np.arange(x.size)
  with np.errstate(over="ignore"):
    while todo.size:
      left, right = x[todo] >> half, x[todo] & mask
      for key in keys:
        left, right = right, left ^ (_mix(right ^ key) & mask)
      x[todo] = (left << half) | right
      todo = todo[x[todo] >= np.uint64(n)]
  return x.astype(np.int64)


class WindowOrder:
  """Global window index -> the document pieces of that window (module docstring).

  `lengths`: the split's document lengths in tokens, in stored order. `shuffle_documents`:
  shuffle the documents anew each epoch (training) or keep the stored order (a fixed evaluation
  set); the windows are permuted either way. `keep_tail`: the tail shorter than a window is a
  window of its own (an evaluation set scores every token) instead of being dropped."""

  def __init__(self, lengths: np.ndarray, seq_len: int, seed: int, *,
               shuffle_documents: bool = True, keep_tail: bool = False,
               what: str = "the split"):
    self.lengths = np.asarray(lengths, np.int64)
    self.width = seq_len + 1
    self.seed = int(seed)
    self.shuffle_documents = shuffle_documents
    self.tokens = int(self.lengths.sum())
    # K: windows of one epoch; with `keep_tail` (an evaluation set) the last, shorter window too
    self.per_epoch = -(-self.tokens // self.width) if keep_tail else self.tokens // self.width
    if self.per_epoch == 0:
      raise DataError(f"{what} holds {self.tokens} tokens, fewer than one sequence of "
                      f"data.seq_len + 1 = {self.width}: lower data.seq_len or prepare more text")
    self._epochs: dict[int, tuple[np.ndarray, np.ndarray, int]] = {}

  def epoch(self, e: int) -> tuple[np.ndarray, np.ndarray]:
    """(documents in epoch e's order, end offset of each in the epoch's stream)."""
    return self._epoch(e)[:2]

  def _epoch(self, e: int) -> tuple[np.ndarray, np.ndarray, int]:
    """epoch(e) and the seed of its window permutation."""
    if e not in self._epochs:
      if len(self._epochs) >= 2:  # the current epoch and the next are all a reader needs
        self._epochs.pop(min(self._epochs))
      n = len(self.lengths)
      order = (np.random.default_rng(_seed32(self.seed, e, 0)).permutation(n)
               if self.shuffle_documents else np.arange(n))
      self._epochs[e] = order, np.cumsum(self.lengths[order]), _seed32(self.seed, e, 1)
    return self._epochs[e]

  def window_of(self, g: int) -> tuple[int, int]:
    """(epoch, window of that epoch's stream) that global index g reads."""
    e, j = divmod(int(g), self.per_epoch)
    return e, int(permute([j], self.per_epoch, self._epoch(e)[2])[0])

  def pieces(self, indices) -> list[list[tuple[int, int, int]]]:
    """For each global index, its window's pieces [(document, start, stop), ...] in order."""
    indices = np.asarray(indices, np.int64).reshape(-1)
    epochs = indices // self.per_epoch
    out: list[list[tuple[int, int, int]]] = [[] for _ in indices]
    for e in np.unique(epochs):
      where = np.flatnonzero(epochs == e)
      order, ends = self.epoch(int(e))
      w = permute(indices[where] % self.per_epoch, self.per_epoch, self._epoch(int(e))[2])
      a = w * self.width
      b = np.minimum(a + self.width, self.tokens)
      first = np.searchsorted(ends, a, side="right")  # the first document ending after a
      count = np.searchsorted(ends, b - 1, side="right") - first + 1
      k = np.repeat(first, count) + np.arange(count.sum()) - np.repeat(np.cumsum(count) - count,
                                                                       count)
      begin = ends[k] - self.lengths[order[k]]
      lo = np.maximum(np.repeat(a, count), begin)
      hi = np.minimum(np.repeat(b, count), ends[k])
      row = np.repeat(where, count)
      for i, doc, start, stop in zip(row.tolist(), order[k].tolist(), (lo - begin).tolist(),
                                     (hi - begin).tolist()):
        if stop > start:  # (an empty document gives no piece)
          out[i].append((doc, start, stop))
    return out

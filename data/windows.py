"""The order a split is read in: every sequence an independent draw (`WindowOrder`).

    epoch e:   documents in a seeded shuffled order, packed back to back into one stream
               | doc 5 ....... | doc 2 .. | doc 9 ............ | doc 0 ... |  ...
    windows:   the stream cut into windows of seq_len + 1 tokens (the tail shorter than one
               window is dropped in training)
               |  w0  |  w1  |  w2  |  w3  |  w4  |  w5  |  w6  | ...  (K per epoch)
    order:     the windows of epoch e permuted by a seeded bijection (grain's index_shuffle:
               O(1) memory, random access): global index g = e K + j reads window pi_e(j)

Step t of a run reads the global indices [g_t, g_t + B_t), g_t the windows of the steps before
it. Every sequence is thus a uniform draw from the epoch's windows, whatever the batch: a step's
windows are no more alike than two steps' windows, and the extra sequences of a bigger batch are
new documents, not the next chunks of the same ones. How the B_t windows are split into
micro-batches, devices and processes does not change which windows they are.

A window holds the pieces of the 1-3 documents (usually) it overlaps: (document, start, stop)
in the document's tokens. Everything here is a pure function of the documents' lengths, the
seed and the index, so any process computes the same windows without talking to the others,
and a position in the order is one integer (the count of windows read).
"""
from __future__ import annotations

import grain
import numpy as np

from data.meta import DataError


def _seed32(*words: int) -> int:
  """A 32-bit seed from integers (grain's index_shuffle takes seeds below 2^32)."""
  return int(np.random.SeedSequence([int(w) for w in words]).generate_state(1)[0])


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
    self._epochs: dict[int, tuple[np.ndarray, np.ndarray]] = {}

  def epoch(self, e: int) -> tuple[np.ndarray, np.ndarray]:
    """(documents in epoch e's order, end offset of each in the epoch's stream)."""
    if e not in self._epochs:
      if len(self._epochs) >= 2:  # the current epoch and the next are all a reader needs
        self._epochs.pop(min(self._epochs))
      n = len(self.lengths)
      order = (np.random.default_rng(_seed32(self.seed, e, 0)).permutation(n)
               if self.shuffle_documents else np.arange(n))
      self._epochs[e] = order, np.cumsum(self.lengths[order])
    return self._epochs[e]

  def window_of(self, g: int) -> tuple[int, int]:
    """(epoch, window of that epoch's stream) that global index g reads."""
    e, j = divmod(int(g), self.per_epoch)
    return e, grain.experimental.index_shuffle(j, max_index=self.per_epoch - 1,
                                               seed=_seed32(self.seed, e, 1), rounds=4)

  def pieces(self, indices) -> list[list[tuple[int, int, int]]]:
    """For each global index, its window's pieces [(document, start, stop), ...] in order."""
    out = []
    for g in indices:
      e, w = self.window_of(g)
      order, ends = self.epoch(e)
      a = w * self.width
      b = min(a + self.width, self.tokens)
      k = int(np.searchsorted(ends, a, side="right"))  # the first document ending after a
      row = []
      while a < b:
        begin = int(ends[k]) - int(self.lengths[order[k]])
        stop = min(b, int(ends[k]))
        if stop > a:  # (an empty document gives no piece)
          row.append((int(order[k]), a - begin, stop - begin))
        a, k = stop, k + 1
      out.append(row)
    return out

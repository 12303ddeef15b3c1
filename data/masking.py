"""BERT's masked-LM corruption of packed rows (`Masking`), drawn per sequence of the data order.

    select    each real token (segment id > 0) with probability `rate` (BERT: 0.15)
    replace   a selected token by [MASK] (80%), by a uniformly random token id of the tokenizer
              (10%), or leave it as it is (10%) (Devlin et al. 2019, section 3.1)
    batch     inputs = the corrupted tokens, targets = the original tokens at the same
              positions, loss_mask = the selected positions; positions and segment ids as read

The draws of a sequence are a pure function of (the order's seed, the sequence's global index g
in the data order, its length): never of the micro-batch, step, device or process that reads it,
so a masked-LM run's losses do not depend on how its batches are placed, exactly as the causal
LM's. The validation set's masks are keyed by its own fixed seed (data/pipeline.py `EVAL_SEED`).
[MASK] is the first id past the tokenizer's (the model's vocabulary must hold it). Why and what
is measured: docs/mlm.md
"""
from __future__ import annotations

import dataclasses

import numpy as np

SALT = 0x6D6C6D  # "mlm": the masks' draws are a stream of their own, not the window order's
MASK_FRACTION, RANDOM_FRACTION = 0.8, 0.1  # of the selected tokens; the rest stay unchanged


@dataclasses.dataclass(frozen=True)
class Masking:
  rate: float  # the probability that a real token is selected
  mask_id: int  # the [MASK] token's id
  vocab: int  # random replacements are drawn from [0, vocab): the tokenizer's ids

  @classmethod
  def of(cls, rate: float, meta: dict) -> "Masking | None":
    """The masking of `data.mask_rate` = rate (None when 0: the causal LM's next-token
    batches) for data prepared with the tokenizer of `meta` (a prepared directory's)."""
    if not rate:
      return None
    vocab = int(meta["tokenizer"]["vocab_size"])
    return cls(rate=float(rate), mask_id=vocab, vocab=vocab)

  def draws(self, seed: int, index: int, length: int) -> tuple[np.ndarray, np.ndarray]:
    """(selected bool [length], the token each position shows if selected int32 [length]) of
    the sequence at global `index` of the order with `seed`."""
    rng = np.random.default_rng([SALT, int(seed), int(index)])
    select, kind = rng.random(length), rng.random(length)
    random_ids = rng.integers(0, self.vocab, length, dtype=np.int64)
    shown = np.where(kind < MASK_FRACTION, self.mask_id,
                     np.where(kind < MASK_FRACTION + RANDOM_FRACTION, random_ids, -1))
    return select < self.rate, shown.astype(np.int32)

  def apply(self, batch: dict[str, np.ndarray], indices, seed: int) -> dict[str, np.ndarray]:
    """The masked-LM rows of data/pipeline.py's next-token rows `batch` whose global windows are
    `indices` (a negative index is a padding row: nothing selected)."""
    tokens = batch["inputs"]
    rows, length = tokens.shape
    selected = np.zeros((rows, length), bool)
    shown = np.full((rows, length), -1, np.int32)
    for r, g in enumerate(np.asarray(indices, np.int64).tolist()):
      if g >= 0:
        selected[r], shown[r] = self.draws(seed, g, length)
    selected &= batch["segment_ids"] > 0
    corrupt = selected & (shown >= 0)
    return {**batch, "inputs": np.where(corrupt, shown, tokens).astype(tokens.dtype),
            "targets": tokens, "loss_mask": selected}

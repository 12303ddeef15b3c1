"""Loss, perplexity and bits per byte over a whole split, every document once, no sampling
(`evaluate_split`, which tools.evaluate runs).

Each document is scored on its own, every token after its first exactly once, in windows of at
most `seq_len` inputs that each start a fresh context (`windows`):
  stride = seq_len (default)  disjoint windows: a target sees the 1 to seq_len tokens since its
                              window's start
  stride < seq_len            windows every `stride` tokens, each scoring what the one before
                              did not reach: at least seq_len - stride + 1 tokens of context,
                              for about seq_len / stride times the forward passes
Windows are packed into rows of seq_len + 1 (segment ids, a loss mask) and rows into fixed-size
batches: one compiled program. Bits per byte = cross-entropy in bits / UTF-8 bytes of the text.
Why and details: docs/models_io.md#evaluation.
"""
from __future__ import annotations

import math
from collections.abc import Callable, Iterator

import jax
import numpy as np

from data import pipeline
from data.prepare import read_meta
from data.tokens import SplitTokens
from sharding.mesh import batch_sharding
from trainer.step.train_step import loss_sums


def windows(tokens: np.ndarray, seq_len: int,
            stride: int | None = None) -> Iterator[tuple[np.ndarray, int]]:
  """(window, scored) pairs: windows of at most seq_len + 1 tokens starting every `stride`
  (default seq_len: disjoint, overlapping by one), each to be scored on its last `scored`
  targets, the ones no earlier window reached; together they score every token but the first
  exactly once (the module docstring)."""
  stride = stride or seq_len
  if not 1 <= stride <= seq_len:
    raise ValueError(f"stride {stride} must be between 1 and seq_len={seq_len}")
  last, done = len(tokens) - 1, 0  # index of the last target; targets 1..done are scored
  for start in range(0, max(last, 0), stride):
    end = min(start + seq_len, last)  # this window's last target
    yield tokens[start:end + 1], end - done
    done = end
    if end == last:
      break


def packed_rows(docs: Iterator[np.ndarray], seq_len: int,
                stride: int | None = None) -> Iterator[dict[str, np.ndarray]]:
  """Rows of seq_len (+1 shifted) with inputs/targets/positions/segment_ids/loss_mask, the
  windows of `windows` packed back to back; loss_mask marks each window's scored targets."""
  width = seq_len + 1
  tokens, segments, positions = (np.zeros(width, np.int32) for _ in range(3))
  scored = np.zeros(width, bool)  # the token at this index is a scored target
  used, seg = 0, 0

  def emit():
    return {"inputs": tokens[:-1].copy(), "targets": tokens[1:].copy(),
            "positions": positions[:-1].copy(), "segment_ids": segments[:-1].copy(),
            "loss_mask": scored[1:].copy()}

  for doc in docs:
    for w, n in windows(doc, seq_len, stride):
      if used + len(w) > width:
        yield emit()
        tokens[:], segments[:], positions[:], scored[:] = 0, 0, 0, False
        used, seg = 0, 0
      seg += 1
      tokens[used:used + len(w)] = w
      segments[used:used + len(w)] = seg
      positions[used:used + len(w)] = np.arange(len(w))
      scored[used + len(w) - n:used + len(w)] = True
      used += len(w)
  if used:
    yield emit()


def split_documents(data_dir: str, split: str) -> Iterator[np.ndarray]:
  """Every document of a prepared split, in stored order, as int32 token ids."""
  return SplitTokens(data_dir, split).documents()


def split_bytes(data_dir: str, split: str, decode: Callable[[np.ndarray], str]) -> int:
  recorded = read_meta(data_dir)["splits"][split].get("bytes")
  if recorded is not None:
    return int(recorded)
  return sum(len(decode(doc).encode("utf-8")) for doc in split_documents(data_dir, split))


def evaluate_split(spec, params_by_name: dict, data_dir: str, split: str, *, seq_len: int,
                   batch_rows: int, decode: Callable[[np.ndarray], str],
                   stride: int | None = None,
                   log: Callable[[str], None] | None = None) -> dict[str, dict[str, float]]:
  """{name: {loss, perplexity, bits_per_byte, tokens, bytes}} for each parameter set (e.g.
  {"params": ..., "ema": ...}), all evaluated in one pass over the split, in windows of
  `seq_len` every `stride` tokens (default seq_len; the module docstring)."""
  mesh = spec.mesh
  sharding = batch_sharding(mesh)
  step = jax.jit(lambda p, b: loss_sums(spec, p, b), out_shardings=None)
  totals = {name: [0.0, 0.0] for name in params_by_name}
  rows = packed_rows(split_documents(data_dir, split), seq_len, stride)
  batches = 0
  with jax.set_mesh(mesh):
    while True:
      chunk = [r for _, r in zip(range(batch_rows), rows)]
      if not chunk:
        break
      while len(chunk) < batch_rows:  # padding rows: no loss
        chunk.append({k: np.zeros_like(v) for k, v in chunk[0].items()})
      batch = {k: jax.device_put(np.stack([r[k] for r in chunk]), sharding)
               for k in pipeline.BATCH_KEYS}
      for name, params in params_by_name.items():
        s, n = jax.device_get(step(params, batch))
        totals[name][0] += float(s)
        totals[name][1] += float(n)
      batches += 1
      if log and batches % 50 == 0:
        log(f"  {batches} batches, {int(next(iter(totals.values()))[1])} tokens")
  n_bytes = split_bytes(data_dir, split, decode)
  out = {}
  for name, (nats, tokens) in totals.items():
    loss = nats / tokens if tokens else math.nan  # nothing scored: no score, not 0
    out[name] = {"loss": loss, "perplexity": math.exp(loss),
                 "bits_per_byte": nats / math.log(2) / max(n_bytes, 1) if tokens else math.nan,
                 "tokens": int(tokens), "bytes": n_bytes}
  return out

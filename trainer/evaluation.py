"""Loss, perplexity and bits per byte over a whole split (every document once, no sampling).

Each document is cut into windows of `seq_len + 1` tokens that overlap by one token, so every
token after a document's first is a target exactly once; a window starts a fresh context
(positions from 0), as training sequences do. Windows are packed back to back into rows of
`seq_len + 1` (segment ids keep them apart) and rows into fixed-size batches, so one program
is compiled; the last batch is padded with empty rows that carry no loss.

Bits per byte = total cross-entropy in bits / UTF-8 bytes of the split's text: the split's
byte count from meta.json when the data preparation recorded it (`splits.<split>.bytes`),
else counted by decoding every document with the data's tokenizer.
"""
from __future__ import annotations

import math
from collections.abc import Callable, Iterator

import jax
import numpy as np

from data import pipeline
from data.prepare import read_meta
from sharding.mesh import batch_sharding
from trainer.step import loss_sums


def windows(tokens: np.ndarray, seq_len: int) -> Iterator[np.ndarray]:
  """Windows of at most seq_len + 1 tokens overlapping by one; together they predict every
  token but the first exactly once."""
  for start in range(0, max(len(tokens) - 1, 0), seq_len):
    yield tokens[start:start + seq_len + 1]


def packed_rows(docs: Iterator[np.ndarray], seq_len: int) -> Iterator[dict[str, np.ndarray]]:
  """Rows of seq_len (+1 shifted) with inputs/targets/positions/segment_ids/loss_mask."""
  width = seq_len + 1
  tokens, segments, positions = (np.zeros(width, np.int32) for _ in range(3))
  used, seg = 0, 0

  def emit():
    return {"inputs": tokens[:-1].copy(), "targets": tokens[1:].copy(),
            "positions": positions[:-1].copy(), "segment_ids": segments[:-1].copy(),
            "loss_mask": (segments[1:] == segments[:-1]) & (segments[:-1] > 0)}

  for doc in docs:
    for w in windows(doc, seq_len):
      if used + len(w) > width:
        yield emit()
        tokens[:], segments[:], positions[:] = 0, 0, 0
        used, seg = 0, 0
      seg += 1
      tokens[used:used + len(w)] = w
      segments[used:used + len(w)] = seg
      positions[used:used + len(w)] = np.arange(len(w))
      used += len(w)
  if used:
    yield emit()


def split_documents(data_dir: str, split: str) -> Iterator[np.ndarray]:
  """Every document of a prepared split, in stored order, as int32 token ids."""
  dtype = read_meta(data_dir)["token_dtype"]  # how the ids are stored
  docs = pipeline.documents(data_dir, split)
  for i in range(len(docs)):
    yield np.frombuffer(docs[i], dtype=dtype).astype(np.int32)


def split_bytes(data_dir: str, split: str, decode: Callable[[np.ndarray], str]) -> int:
  recorded = read_meta(data_dir)["splits"][split].get("bytes")
  if recorded is not None:
    return int(recorded)
  return sum(len(decode(doc).encode("utf-8")) for doc in split_documents(data_dir, split))


def evaluate_split(spec, params_by_name: dict, data_dir: str, split: str, *, seq_len: int,
                   batch_rows: int, decode: Callable[[np.ndarray], str],
                   log: Callable[[str], None] | None = None) -> dict[str, dict[str, float]]:
  """{name: {loss, perplexity, bits_per_byte, tokens, bytes}} for each parameter set (e.g.
  {"params": ..., "ema": ...}), all evaluated in one pass over the split."""
  mesh = spec.mesh
  sharding = batch_sharding(mesh)
  step = jax.jit(lambda p, b: loss_sums(spec, p, b), out_shardings=None)
  totals = {name: [0.0, 0.0] for name in params_by_name}
  rows = packed_rows(split_documents(data_dir, split), seq_len)
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
    loss = nats / max(tokens, 1.0)
    out[name] = {"loss": loss, "perplexity": math.exp(loss),
                 "bits_per_byte": nats / math.log(2) / max(n_bytes, 1),
                 "tokens": int(tokens), "bytes": n_bytes}
  return out

"""Byte-level tokenizer: ids 0..255 are bytes, then a few special tokens.

No vocabulary file, no unknown tokens, exact round trip for any UTF-8 text. Models use a vocab
of at least `VOCAB_SIZE` (the tiny config pads to 512 so the vocab splits evenly over devices).
"""
from __future__ import annotations

import numpy as np

BOS_ID = 256
EOS_ID = 257
PAD_ID = 258
VOCAB_SIZE = 259
TOKEN_DTYPE = np.uint16  # what prepared shards store


def encode(text: str, *, bos: bool = True, eos: bool = True) -> np.ndarray:
  """Text -> token ids (uint16): [BOS] + UTF-8 bytes + [EOS]."""
  body = np.frombuffer(text.encode("utf-8", errors="replace"), dtype=np.uint8)
  parts = ([np.array([BOS_ID], TOKEN_DTYPE)] if bos else []) + [body.astype(TOKEN_DTYPE)]
  if eos:
    parts.append(np.array([EOS_ID], TOKEN_DTYPE))
  return np.concatenate(parts)


def decode(ids) -> str:
  """Token ids -> text; special tokens are dropped."""
  ids = np.asarray(ids)
  return bytes(ids[ids < 256].astype(np.uint8)).decode("utf-8", errors="replace")

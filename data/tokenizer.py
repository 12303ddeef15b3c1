"""Tokenizers behind one small interface: byte-level, Hugging Face `tokenizers`, SentencePiece.

Every tokenizer has `.kind` ("byte" | "hf" | "sentencepiece"), `.vocab_size`, `.bos_id`,
`.eos_id`, `.pad_id` (int or None), `.encode(text, *, bos=True, eos=True) -> np.ndarray` (int64
ids), `.decode(ids) -> str` (special tokens dropped) and `.files()` (empty for bytes).

  byte           ids 0..255 are UTF-8 bytes, BOS 256, EOS 257, PAD 258 (the module-level names)
  hf             a `tokenizer.json` (or a Hugging Face model directory holding one)
  sentencepiece  a SentencePiece `.model` file

Only the ids `encode` inserts are special: text that spells a special token encodes as text.
`from_path(path)` loads an hf or sentencepiece tokenizer, `load_tokenizer(data_dir)` the one a
prepared directory names; `train_bpe(texts, vocab_size, out_dir)` trains a byte-level BPE with
`<|bos|>`, `<|eos|>`, `<|pad|>` at ids 0, 1, 2. Details: docs/data.md#inputs-and-tokenizers
"""
from __future__ import annotations

import hashlib
import json
import os
from collections.abc import Iterable
from typing import Protocol

import numpy as np
import sentencepiece
import tokenizers

from data.meta import read_meta

BOS_ID = 256
EOS_ID = 257
PAD_ID = 258
VOCAB_SIZE = 259
TOKEN_DTYPE = np.uint16  # what byte-level shards store

# Names under which tokenizers commonly carry their special tokens, most specific first.
_BOS_NAMES = ("<|bos|>", "<|begin_of_text|>", "<s>", "<bos>", "[BOS]", "<|startoftext|>")
_EOS_NAMES = ("<|eos|>", "<|end_of_text|>", "</s>", "<eos>", "[EOS]", "<|endoftext|>")
_PAD_NAMES = ("<|pad|>", "<pad>", "[PAD]", "<|padding|>")
BPE_SPECIALS = ("<|bos|>", "<|eos|>", "<|pad|>")


class TokenizerError(ValueError):
  """A tokenizer the user named cannot be loaded (reported in one line)."""


class Tokenizer(Protocol):
  kind: str
  vocab_size: int
  bos_id: int | None
  eos_id: int | None
  pad_id: int | None

  def encode(self, text: str, *, bos: bool = True, eos: bool = True) -> np.ndarray: ...
  def decode(self, ids) -> str: ...
  def files(self) -> list[str]: ...


def _wrap(body, bos_id, eos_id, bos, eos) -> np.ndarray:
  head = [bos_id] if bos and bos_id is not None else []
  tail = [eos_id] if eos and eos_id is not None else []
  return np.concatenate([np.asarray(head, np.int64), np.asarray(body, np.int64),
                         np.asarray(tail, np.int64)])


def encode(text: str, *, bos: bool = True, eos: bool = True) -> np.ndarray:
  """Text -> byte-level token ids (uint16): [BOS] + UTF-8 bytes + [EOS]."""
  body = np.frombuffer(text.encode("utf-8", errors="replace"), dtype=np.uint8)
  parts = ([np.array([BOS_ID], TOKEN_DTYPE)] if bos else []) + [body.astype(TOKEN_DTYPE)]
  if eos:
    parts.append(np.array([EOS_ID], TOKEN_DTYPE))
  return np.concatenate(parts)


def decode(ids) -> str:
  """Byte-level token ids -> text; special tokens are dropped."""
  ids = np.asarray(ids)
  return bytes(ids[ids < 256].astype(np.uint8)).decode("utf-8", errors="replace")


class ByteTokenizer:
  kind = "byte"
  vocab_size, bos_id, eos_id, pad_id = VOCAB_SIZE, BOS_ID, EOS_ID, PAD_ID

  def encode(self, text: str, *, bos: bool = True, eos: bool = True) -> np.ndarray:
    return encode(text, bos=bos, eos=eos).astype(np.int64)

  def decode(self, ids) -> str:
    return decode(ids)

  def files(self) -> list[str]:
    return []


class HFTokenizer:
  """A `tokenizers` tokenizer.json; special ids from tokenizer_config.json or common names."""
  kind = "hf"

  def __init__(self, path: str, special: dict | None = None):
    self.path = path
    self._tok = tokenizers.Tokenizer.from_file(path)
    self.vocab_size = self._tok.get_vocab_size(with_added_tokens=True)
    names = _config_special_names(os.path.dirname(path))
    vocab = self._tok.get_vocab(with_added_tokens=True)

    def find(key, candidates):
      if special and key in special:
        return special[key]
      for name in ([names[key]] if names.get(key) else []) + list(candidates):
        if name in vocab:
          return int(vocab[name])
      return None

    self.bos_id = find("bos_id", _BOS_NAMES)
    self.eos_id = find("eos_id", _EOS_NAMES)
    self.pad_id = find("pad_id", _PAD_NAMES)
    # Text that spells a special token ("<|bos|>" in a document) is encoded as the text it is:
    # only the ids `encode` inserts are special.
    self._tok.encode_special_tokens = True
    self._special = {i for i in (self.bos_id, self.eos_id, self.pad_id) if i is not None}

  def encode(self, text: str, *, bos: bool = True, eos: bool = True) -> np.ndarray:
    encoding = self._tok.encode(text, add_special_tokens=False)
    body = encoding.ids
    if self._special.intersection(body):  # spelled by a non-special added or vocabulary token
      body = self._spell_out(text, encoding)
    return _wrap(body, self.bos_id, self.eos_id, bos, eos)

  def _spell_out(self, text: str, encoding) -> list[int]:
    """`encoding`'s ids with each bos/eos/pad id (a stretch of text the tokenizer maps to it)
    replaced by the ids of that text encoded one character at a time; a character the tokenizer
    can only encode as one of them is dropped."""
    out = []
    for i, (start, end) in zip(encoding.ids, encoding.offsets):
      if i not in self._special:
        out.append(i)
        continue
      for char in text[start:end]:
        out += [j for j in self._tok.encode(char, add_special_tokens=False).ids
                if j not in self._special]
    return out

  def decode(self, ids) -> str:
    return self._tok.decode([int(i) for i in np.asarray(ids) if int(i) not in self._special],
                            skip_special_tokens=True)

  def files(self) -> list[str]:
    config = os.path.join(os.path.dirname(self.path), "tokenizer_config.json")
    return [self.path] + ([config] if os.path.exists(config) else [])


def _config_special_names(directory: str) -> dict:
  """bos/eos/pad token strings named by a Hugging Face tokenizer_config.json, if any."""
  path = os.path.join(directory, "tokenizer_config.json")
  if not os.path.exists(path):
    return {}
  with open(path) as f:
    config = json.load(f)
  out = {}
  for key in ("bos", "eos", "pad"):
    value = config.get(f"{key}_token")
    if isinstance(value, dict):  # AddedToken serialised as {"content": ...}
      value = value.get("content")
    out[f"{key}_id"] = value
  return out


class SentencePieceTokenizer:
  kind = "sentencepiece"

  def __init__(self, path: str):
    self.path = path
    self._sp = sentencepiece.SentencePieceProcessor(model_file=path)
    self.vocab_size = self._sp.get_piece_size()
    ids = (self._sp.bos_id(), self._sp.eos_id(), self._sp.pad_id())
    self.bos_id, self.eos_id, self.pad_id = (i if i >= 0 else None for i in ids)

  def encode(self, text: str, *, bos: bool = True, eos: bool = True) -> np.ndarray:
    return _wrap(self._sp.encode(text), self.bos_id, self.eos_id, bos, eos)

  def decode(self, ids) -> str:
    return self._sp.decode([int(i) for i in np.asarray(ids)])

  def files(self) -> list[str]:
    return [self.path]


def from_path(path: str) -> Tokenizer:
  """An HF tokenizer.json, a directory holding one (or a SentencePiece tokenizer.model), or a
  SentencePiece .model file."""
  if os.path.isdir(path):
    for name in ("tokenizer.json", "tokenizer.model"):
      if os.path.exists(os.path.join(path, name)):
        return from_path(os.path.join(path, name))
    models = sorted(f for f in os.listdir(path) if f.endswith(".model"))
    if models:
      return from_path(os.path.join(path, models[0]))
    raise TokenizerError(f"tokenizer {path!r}: the directory holds no tokenizer.json or "
                         "SentencePiece .model")
  if not os.path.exists(path):
    raise TokenizerError(f"tokenizer {path!r} does not exist; give a tokenizer.json, a Hugging "
                         "Face model directory or a SentencePiece .model")
  if path.endswith(".json"):
    try:
      return HFTokenizer(path)
    except Exception as e:  # the tokenizers library raises plain Exceptions on bad files
      raise TokenizerError(f"tokenizer {path!r} is not a Hugging Face tokenizer.json: "
                           f"{str(e).splitlines()[0]}") from None
  if path.endswith(".model"):
    return SentencePieceTokenizer(path)
  raise TokenizerError(f"tokenizer {path!r}: expected a tokenizer.json, a directory or a "
                       "SentencePiece .model")


def file_hash(paths: Iterable[str]) -> str:
  h = hashlib.sha256()
  for p in sorted(paths, key=os.path.basename):
    with open(p, "rb") as f:
      h.update(f.read())
  return h.hexdigest()[:16]


def describe(tok: Tokenizer, data_dir: str | None = None) -> dict:
  """What meta.json records: kind, files (relative to the data dir), hash, vocab, special ids."""
  files = tok.files()
  return {"kind": tok.kind,
          "files": [os.path.relpath(f, data_dir) if data_dir else f for f in files],
          "hash": file_hash(files) if files else "", "vocab_size": int(tok.vocab_size),
          "bos_id": tok.bos_id, "eos_id": tok.eos_id, "pad_id": tok.pad_id}


def from_meta(info: dict, data_dir: str) -> Tokenizer:
  """The tokenizer a meta.json `tokenizer` entry describes (files relative to data_dir)."""
  if info["kind"] == "byte":
    return ByteTokenizer()
  path = os.path.join(data_dir, info["files"][0])
  if info["kind"] == "hf":
    return HFTokenizer(path, {k: info[k] for k in ("bos_id", "eos_id", "pad_id")})
  return SentencePieceTokenizer(path)


def load_tokenizer(data_dir: str) -> Tokenizer:
  """The tokenizer a prepared data directory was made with."""
  return from_meta(read_meta(data_dir)["tokenizer"], data_dir)


def storage_dtype(vocab_size: int) -> str:
  """Little-endian dtype of stored ids: uint16 up to 65,536 ids, uint32 above."""
  return "<u2" if vocab_size <= 1 << 16 else "<u4"


def train_bpe(texts: Iterable[str], vocab_size: int, out_dir: str) -> HFTokenizer:
  """Train a byte-level BPE of `vocab_size` ids (3 specials + 256 bytes + merges) on `texts`;
  saves `out_dir/tokenizer.json`."""
  if vocab_size < 256 + len(BPE_SPECIALS):
    raise TokenizerError(f"bpe:{vocab_size}: a byte-level BPE needs at least "
                         f"{256 + len(BPE_SPECIALS)} ids")
  tok = tokenizers.Tokenizer(tokenizers.models.BPE())
  tok.pre_tokenizer = tokenizers.pre_tokenizers.ByteLevel(add_prefix_space=False)
  tok.decoder = tokenizers.decoders.ByteLevel()
  trainer = tokenizers.trainers.BpeTrainer(
      vocab_size=vocab_size, special_tokens=list(BPE_SPECIALS),
      initial_alphabet=tokenizers.pre_tokenizers.ByteLevel.alphabet(), show_progress=False)
  tok.train_from_iterator(texts, trainer=trainer)
  os.makedirs(out_dir, exist_ok=True)
  path = os.path.join(out_dir, "tokenizer.json")
  tok.save(path)
  return HFTokenizer(path)

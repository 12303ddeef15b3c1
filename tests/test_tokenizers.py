"""Tokenizers (data/tokenizer.py), each built locally: byte, trained BPE, an HF tokenizer.json and
model dir, SentencePiece, and a vocabulary above 65,535 stored as uint32."""
import json
import os

import numpy as np
import pytest

from data import corpus, pipeline, prepare, tokenizer
from data.tokens import SplitTokens
from test_prepare import refused

TEXT = "def f(x):\n    return  'héllo ✓'  # ünïcode\n\n"


def _stdlib_texts(n=20):
  root = corpus.stdlib_root()
  return [open(os.path.join(root, f), encoding="utf-8").read()
          for f in corpus.stdlib_files(root)[:n]]


def _round_trip(tok, text=TEXT):
  ids = tok.encode(text)
  assert ids[0] == tok.bos_id and ids[-1] == tok.eos_id
  assert ids.max() < tok.vocab_size
  assert tok.decode(ids) == text
  body = tok.encode(text, bos=False, eos=False)
  np.testing.assert_array_equal(body, ids[1:-1])
  return ids


def _docs(tmp_path, n=30):
  d = tmp_path / "docs"
  d.mkdir()
  for i, text in enumerate(_stdlib_texts(n)):
    (d / f"{i:03d}.txt").write_text(text)
  return d


def test_byte_tokenizer():
  tok = tokenizer.ByteTokenizer()
  ids = _round_trip(tok)
  np.testing.assert_array_equal(ids, tokenizer.encode(TEXT))
  assert (tok.vocab_size, tok.bos_id, tok.eos_id, tok.pad_id) == (259, 256, 257, 258)
  assert tok.files() == []


@pytest.fixture(scope="module")
def bpe_dir(tmp_path_factory):
  out = tmp_path_factory.mktemp("bpe")
  tokenizer.train_bpe(_stdlib_texts(), 400, str(out))
  return str(out)


def test_trained_bpe_round_trips_with_special_ids(bpe_dir):
  tok = tokenizer.from_path(bpe_dir)  # a directory holding tokenizer.json
  assert tok.kind == "hf" and tok.vocab_size == 400
  assert (tok.bos_id, tok.eos_id, tok.pad_id) == (0, 1, 2)
  ids = _round_trip(tok)
  assert len(ids) < len(TEXT.encode()) + 2  # merges compress
  assert tok.decode([tok.bos_id, tok.pad_id]) == ""  # specials are dropped


def test_hf_model_dir_special_tokens_from_tokenizer_config(bpe_dir, tmp_path):
  """A Hugging Face model dir: tokenizer_config.json names the special tokens."""
  model_dir = tmp_path / "model"
  model_dir.mkdir()
  (model_dir / "tokenizer.json").write_text(open(os.path.join(bpe_dir, "tokenizer.json")).read())
  (model_dir / "tokenizer_config.json").write_text(json.dumps(
      {"bos_token": {"content": "<|eos|>"}, "eos_token": "<|pad|>", "pad_token": None}))
  tok = tokenizer.from_path(str(model_dir))
  assert (tok.bos_id, tok.eos_id) == (1, 2)
  assert len(tok.files()) == 2


def _train_sentencepiece(prefix: str) -> str:
  spm = pytest.importorskip("sentencepiece")
  spm.SentencePieceTrainer.train(
      sentence_iterator=iter(_stdlib_texts()), model_prefix=prefix,
      vocab_size=600, model_type="bpe", byte_fallback=True, normalization_rule_name="identity",
      remove_extra_whitespaces=False, unk_id=0, bos_id=1, eos_id=2, pad_id=3, minloglevel=2,
      max_sentence_length=1 << 20)
  return prefix + ".model"


def test_sentencepiece_model(tmp_path):
  tok = tokenizer.from_path(_train_sentencepiece(str(tmp_path / "sp")))
  assert tok.kind == "sentencepiece" and tok.vocab_size == 600
  assert (tok.bos_id, tok.eos_id, tok.pad_id) == (1, 2, 3)
  _round_trip(tok)
  # Prepared data carries the model; load_tokenizer gives it back from the data dir alone.
  out = prepare.prepare_files(str(tmp_path / "prepared"), [str(_docs(tmp_path, 10))],
                              tokenizer=str(tmp_path / "sp.model"))
  meta = prepare.read_meta(out)
  assert meta["tokenizer"]["files"] == ["tokenizer/sp.model"] and meta["token_dtype"] == "<u2"
  os.remove(tmp_path / "sp.model")
  again = tokenizer.load_tokenizer(out)
  np.testing.assert_array_equal(again.encode(TEXT), tok.encode(TEXT))


SPELLED = "x <|bos|> y <|eos|>z<|pad|> <|eot_id|> <s> </s> <pad> <unk> [BOS] <|endoftext|>"


def _spelled_stays_text(tok, exact=True):
  """Only the ids encode inserts are special (none of bos/eos/pad, nor another special token of
  an HF tokenizer, inside); the text comes back as it was."""
  ids = tok.encode(SPELLED)
  assert ids[0] == tok.bos_id and ids[-1] == tok.eos_id
  special = {tok.bos_id, tok.eos_id, tok.pad_id}
  if tok.kind == "hf":
    special |= {i for i, t in tok._tok.get_added_tokens_decoder().items() if t.special}
  assert not special & set(ids[1:-1].tolist())
  if exact:
    assert tok.decode(ids) == SPELLED


def test_text_that_spells_special_tokens_stays_text(bpe_dir, tmp_path):
  """A document quoting <|bos|> or <|eot_id|> gets no special ids mid-document, whatever the
  tokenizer: byte, a trained BPE (special added tokens) and one with another special token, a
  tokenizer.json whose bos/eos/pad are added tokens not marked special, a word-level vocabulary holding <s> and </s> as words
  (they become unknown characters, not bos/eos), SentencePiece; and prepared data keeps them."""
  _spelled_stays_text(tokenizer.ByteTokenizer())
  bpe = tokenizer.from_path(bpe_dir)
  _spelled_stays_text(bpe)
  tokenizers = pytest.importorskip("tokenizers")
  chat = tokenizers.Tokenizer.from_file(os.path.join(bpe_dir, "tokenizer.json"))
  chat.add_special_tokens(["<|eot_id|>"])  # a special token that is not bos/eos/pad
  chat.save(str(tmp_path / "chat.json"))
  _spelled_stays_text(tokenizer.from_path(str(tmp_path / "chat.json")))
  spec = json.load(open(os.path.join(bpe_dir, "tokenizer.json")))
  for added in spec["added_tokens"]:
    added["special"] = False
  (tmp_path / "plain.json").write_text(json.dumps(spec))
  plain = tokenizer.from_path(str(tmp_path / "plain.json"))
  assert (plain.bos_id, plain.eos_id, plain.pad_id) == (0, 1, 2)
  _spelled_stays_text(plain)
  vocab = {w: i for i, w in enumerate(["<unk>", "<s>", "</s>", "x", "y"])}
  words = tokenizers.Tokenizer(tokenizers.models.WordLevel(vocab, unk_token="<unk>"))
  words.pre_tokenizer = tokenizers.pre_tokenizers.WhitespaceSplit()
  words.save(str(tmp_path / "words.json"))
  word_level = tokenizer.from_path(str(tmp_path / "words.json"))
  assert (word_level.bos_id, word_level.eos_id) == (1, 2)
  _spelled_stays_text(word_level, exact=False)
  _spelled_stays_text(tokenizer.from_path(_train_sentencepiece(str(tmp_path / "sp"))))
  (tmp_path / "docs").mkdir()
  (tmp_path / "docs" / "quote.txt").write_text(SPELLED)
  (tmp_path / "docs" / "other.txt").write_text("x y z")
  out = prepare.prepare_files(str(tmp_path / "prepared"), [str(tmp_path / "docs")],
                              tokenizer=os.path.join(bpe_dir, "tokenizer.json"))
  stored = [ids for s in prepare.SPLITS for ids in SplitTokens(out, s).documents()]
  assert sorted(bpe.decode(ids) for ids in stored) == sorted([SPELLED, "x y z"])
  assert all((ids == bpe.bos_id).sum() == 1 and (ids == bpe.eos_id).sum() == 1 for ids in stored)


def test_prepare_trains_bpe_and_saves_it_beside_the_data(tmp_path):
  out = str(tmp_path / "prepared")
  prepare.main(["--out", out, "--train_tokenizer", "bpe:300", "--workers", "1",
                str(_docs(tmp_path))])
  meta = prepare.read_meta(out)
  t = meta["tokenizer"]
  assert t["kind"] == "hf" and t["vocab_size"] == 300 and t["files"] == ["tokenizer/tokenizer.json"]
  assert (t["bos_id"], t["eos_id"], t["pad_id"]) == (0, 1, 2) and len(t["hash"]) == 16
  tok = tokenizer.load_tokenizer(out)
  train = meta["splits"]["train"]
  assert train["bytes"] > 1.5 * train["tokens"]  # BPE tokens hold more than one byte
  batch = next(iter(pipeline.dataset(pipeline.StreamSpec(out, "train", 64, 2, seed=0))))
  assert batch["inputs"].max() < 300
  text = tok.decode(batch["inputs"][0])
  assert text and tok.decode(tok.encode(text)) == text


def test_vocab_above_65535_is_stored_as_uint32(tmp_path):
  tokenizers = pytest.importorskip("tokenizers")
  words = [f"w{i}" for i in range(70_000)]
  vocab = {w: i for i, w in enumerate(words + ["<unk>", "<s>", "</s>"])}
  tok = tokenizers.Tokenizer(tokenizers.models.WordLevel(vocab, unk_token="<unk>"))
  tok.pre_tokenizer = tokenizers.pre_tokenizers.WhitespaceSplit()
  tok.save(str(tmp_path / "tokenizer.json"))
  t = tokenizer.from_path(str(tmp_path / "tokenizer.json"))
  assert t.vocab_size == 70_003 and (t.bos_id, t.eos_id) == (70_001, 70_002)
  text = "w69999 w3 w65536 w65535 w12"
  ids = t.encode(text)
  assert ids.max() == 70_002 and 65_536 in ids
  assert t.decode(ids) == text
  docs = tmp_path / "docs"
  docs.mkdir()
  rng = np.random.default_rng(0)
  for i in range(5):
    (docs / f"{i}.txt").write_text(" ".join(f"w{j}" for j in rng.integers(60_000, 70_000, 200)))
  out = prepare.prepare_files(str(tmp_path / "prepared"), [str(docs)],
                              tokenizer=str(tmp_path / "tokenizer.json"))
  assert prepare.read_meta(out)["token_dtype"] == "<u4"
  batch = next(iter(pipeline.dataset(pipeline.StreamSpec(out, "train", 32, 1, seed=0))))
  assert batch["inputs"].max() >= 65_536  # stored and read back without wrapping
  assert set(t.decode(batch["inputs"][0]).split()) <= {f"w{j}" for j in range(60_000, 70_000)}


def test_bad_tokenizer_paths_are_one_line_errors(tmp_path, capsys):
  with pytest.raises(tokenizer.TokenizerError, match="does not exist"):
    tokenizer.from_path(str(tmp_path / "nope.json"))
  (tmp_path / "bad.json").write_text("{}")
  with pytest.raises(tokenizer.TokenizerError, match="not a Hugging Face tokenizer.json"):
    tokenizer.from_path(str(tmp_path / "bad.json"))
  with pytest.raises(tokenizer.TokenizerError, match="no tokenizer.json"):
    tokenizer.from_path(str(tmp_path))
  assert "expected bpe:VOCAB" in refused(capsys, ["--out", str(tmp_path / "o"),
                                                "--train_tokenizer", "bpe:x",
                                                str(tmp_path / "bad.json")])

"""data.prepare: input formats, the validation split of small corpora, parallel and resumable
preparation, old prepared directories."""
import json
import os

import numpy as np
import pytest

from data import pipeline, prepare, tokenizer


def _texts(n, seed=0):
  rng = np.random.default_rng(seed)
  return [f"doc {i}: " + " ".join(f"w{j}" for j in rng.integers(0, 50, 20)) for i in range(n)]


def _documents(out, split):
  """Decoded texts of every document of a split, in stored order."""
  ds = pipeline.documents(out, split)
  dtype = prepare.read_meta(out)["token_dtype"]
  tok = tokenizer.load_tokenizer(out)
  return [tok.decode(np.frombuffer(ds[i], dtype)) for i in range(len(ds))]


def _all_texts(out):
  return sorted(_documents(out, "train") + _documents(out, "validation"))


def test_txt_and_jsonl_with_a_text_field(tmp_path):
  texts = _texts(30)
  (tmp_path / "a.txt").write_text(texts[0])
  with open(tmp_path / "b.jsonl", "w") as f:
    for t in texts[1:]:
      f.write(json.dumps({"content": t, "id": 1}) + "\n")
  with pytest.raises(SystemExit, match="no field 'text'.*--text_field"):
    prepare.main(["--out", str(tmp_path / "x"), str(tmp_path)])
  out = prepare.prepare_files(str(tmp_path / "p"), [str(tmp_path)], text_field="content")
  assert _all_texts(out) == sorted(texts)
  with pytest.raises(SystemExit, match="already holds prepared data"):
    prepare.main(["--out", out, "--text_field", "content", str(tmp_path / "a.txt")])
  meta = prepare.read_meta(out)
  total = sum(meta["splits"][s]["bytes"] for s in prepare.SPLITS)
  assert total == sum(len(t.encode()) for t in texts)


def test_parquet(tmp_path):
  pa = pytest.importorskip("pyarrow")
  import pyarrow.parquet as pq  # noqa: PLC0415
  texts = _texts(40)
  pq.write_table(pa.table({"body": texts, "n": list(range(40))}), tmp_path / "d.parquet",
                 row_group_size=7)
  out = prepare.prepare_files(str(tmp_path / "p"), [str(tmp_path / "d.parquet")],
                              text_field="body")
  assert _all_texts(out) == sorted(texts)


def test_hugging_face_saved_dataset(tmp_path):
  datasets = pytest.importorskip("datasets")
  texts = _texts(40)
  datasets.Dataset.from_dict({"text": texts}).save_to_disk(str(tmp_path / "hf"))
  out = prepare.prepare_files(str(tmp_path / "p"), [str(tmp_path / "hf")])
  assert _all_texts(out) == sorted(texts)
  assert prepare.read_meta(out)["source"]["datasets"] == [str(tmp_path / "hf")]


def test_small_corpus_gets_a_validation_split(tmp_path):
  """25 text files (1% by hash would usually give no validation document)."""
  texts = _texts(25)
  for i, t in enumerate(texts):
    (tmp_path / f"{i:02d}.txt").write_text(t)
  out = prepare.prepare_files(str(tmp_path / "p"), [str(tmp_path)])
  meta = prepare.read_meta(out)
  assert meta["splits"]["validation"]["documents"] >= 1
  assert meta["splits"]["train"]["documents"] + meta["splits"]["validation"]["documents"] == 25
  assert _all_texts(out) == sorted(texts)  # moved, not copied or lost
  for split in prepare.SPLITS:  # counts still describe the stored documents
    stored = _documents(out, split)
    assert meta["splits"][split]["bytes"] == sum(len(t.encode()) for t in stored)
  # The fraction is a flag: half the documents go to validation.
  out = prepare.prepare_files(str(tmp_path / "h"), [str(tmp_path)], validation_fraction=0.5)
  assert 6 <= prepare.read_meta(out)["splits"]["validation"]["documents"] <= 19


def test_single_document_is_split_by_tokens(tmp_path):
  text = " ".join(_texts(10))
  (tmp_path / "one.txt").write_text(text)
  out = prepare.prepare_files(str(tmp_path / "p"), [str(tmp_path / "one.txt")],
                              validation_fraction=0.1)
  train, val = _documents(out, "train"), _documents(out, "validation")
  assert len(train) == len(val) == 1 and train[0] + val[0] == text
  assert 0.05 < len(val[0]) / len(text) < 0.15


def test_parallel_and_interrupted_preparation(tmp_path, monkeypatch):
  """Workers give the same directory as one process; an interrupted run redoes only the units
  it had not finished."""
  d = tmp_path / "in"
  d.mkdir()
  for i, t in enumerate(_texts(60)):
    (d / f"{i:02d}.txt").write_text(t * 2000)  # ~0.2 MB each: several units
  one = prepare.prepare_files(str(tmp_path / "one"), [str(d)], workers=1)
  two = prepare.prepare_files(str(tmp_path / "two"), [str(d)], workers=2)
  assert prepare.read_meta(one)["splits"] == prepare.read_meta(two)["splits"]
  assert _documents(one, "train") == _documents(two, "train")

  calls, real = [], prepare._prepare_unit

  def flaky(work, index, unit, plan):
    calls.append(index)
    if index == 3:
      raise KeyboardInterrupt
    return real(work, index, unit, plan)

  monkeypatch.setattr(prepare, "_prepare_unit", flaky)
  out = str(tmp_path / "resumed")
  with pytest.raises(KeyboardInterrupt):
    prepare.prepare_files(out, [str(d)])
  assert calls == [0, 1, 2, 3] and not os.path.exists(out)
  calls.clear()
  monkeypatch.setattr(prepare, "_prepare_unit", real)
  monkeypatch.setattr(prepare, "_prepare_unit",
                      lambda *a: calls.append(a[1]) or real(*a))
  prepare.prepare_files(out, [str(d)])
  assert calls[0] == 3 and 0 not in calls  # restarted at the unfinished unit
  assert prepare.read_meta(out)["splits"] == prepare.read_meta(one)["splits"]
  assert _documents(out, "train") == _documents(one, "train")
  assert not os.path.exists(out + ".partial")


def test_old_format_directory_is_read(tmp_path, data_dir):
  """A format-1 (byte-level, uint16) directory is read as format 2; unknown formats refuse."""
  meta = prepare.read_meta(data_dir)
  old = {"format": 1, "tokenizer": "byte", "vocab_size": 259, "bos_id": 256, "eos_id": 257,
         "source": meta["source"],
         "splits": {s: {k: meta["splits"][s][k] for k in ("files", "documents", "tokens")}
                    for s in prepare.SPLITS}}
  for s in prepare.SPLITS:
    for f in meta["splits"][s]["files"]:
      os.symlink(os.path.join(data_dir, f), tmp_path / f)
  (tmp_path / "meta.json").write_text(json.dumps(old))
  got = prepare.read_meta(str(tmp_path))
  assert got["tokenizer"]["kind"] == "byte" and got["token_dtype"] == "<u2"
  assert got["splits"]["validation"]["bytes"] == meta["splits"]["validation"]["bytes"]
  batch = next(iter(pipeline.dataset(pipeline.StreamSpec(str(tmp_path), "train", 16, 2))))
  assert batch["inputs"].shape == (2, 16)
  (tmp_path / "meta.json").write_text(json.dumps({**old, "format": 9}))
  with pytest.raises(prepare.DataError, match="format 9.*prepare it again"):
    prepare.read_meta(str(tmp_path))

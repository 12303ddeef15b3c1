"""data.prepare: input formats, the validation split of small corpora, parallel and resumable
preparation, old prepared directories."""
import json
import os
import shutil

import numpy as np
import pytest

from data import pipeline, prepare, shards, sources, tokenizer
from data.tokens import SplitTokens


def _texts(n, seed=0):
  rng = np.random.default_rng(seed)
  return [f"doc {i}: " + " ".join(f"w{j}" for j in rng.integers(0, 50, 20)) for i in range(n)]


def _documents(out, split):
  """Decoded texts of every document of a split, in stored order."""
  tok = tokenizer.load_tokenizer(out)
  return [tok.decode(ids) for ids in SplitTokens(out, split).documents()]


def _all_texts(out):
  return sorted(_documents(out, "train") + _documents(out, "validation"))


def refused(capsys, argv) -> str:
  """The one line `python -m data.prepare ARGV` prints on stderr as it exits with status 2."""
  with pytest.raises(SystemExit) as exit_:
    prepare.main(argv)
  assert exit_.value.code == 2
  err = capsys.readouterr().err
  assert err.startswith("error: ") and err.count("\n") == 1 and "Traceback" not in err, err
  return err.strip()


def test_txt_and_jsonl_with_a_text_field(tmp_path, capsys):
  texts = _texts(30)
  (tmp_path / "a.txt").write_text(texts[0])
  with open(tmp_path / "b.jsonl", "w") as f:
    for t in texts[1:]:
      f.write(json.dumps({"content": t, "id": 1}) + "\n")
  assert "no field 'text'" in refused(capsys, ["--out", str(tmp_path / "x"), str(tmp_path)])
  out = prepare.prepare_files(str(tmp_path / "p"), [str(tmp_path)], text_field="content")
  assert _all_texts(out) == sorted(texts)
  assert "already holds prepared data" in refused(
      capsys, ["--out", out, "--text_field", "content", str(tmp_path / "a.txt")])
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

  calls, real = [], shards.write_unit

  def flaky(work, index, unit, plan):
    calls.append(index)
    if index == 3:
      raise KeyboardInterrupt
    return real(work, index, unit, plan)

  monkeypatch.setattr(shards, "write_unit", flaky)
  out = str(tmp_path / "resumed")
  with pytest.raises(KeyboardInterrupt):
    prepare.prepare_files(out, [str(d)])
  assert calls == [0, 1, 2, 3] and not os.path.exists(out)
  calls.clear()
  monkeypatch.setattr(shards, "write_unit",
                      lambda *a: calls.append(a[1]) or real(*a))
  prepare.prepare_files(out, [str(d)])
  assert calls[0] == 3 and 0 not in calls  # restarted at the unfinished unit
  assert prepare.read_meta(out)["splits"] == prepare.read_meta(one)["splits"]
  assert _documents(out, "train") == _documents(one, "train")
  assert not os.path.exists(out + ".partial")


def _copy(data_dir, to):
  shutil.copytree(data_dir, to)
  return str(to)


def test_old_formats_and_damaged_files_are_one_line_errors(tmp_path, data_dir):
  """A directory of an earlier format (ArrayRecord documents), an unreadable meta.json, and a
  missing, truncated or replaced token or offset file are each one line naming what is wrong
  and saying to prepare again; the config checks report them before anything is compiled."""
  from conftest import tiny_config  # noqa: PLC0415
  from trainer.config import ConfigError  # noqa: PLC0415
  from trainer.config.checks import validate  # noqa: PLC0415

  meta = prepare.read_meta(data_dir)
  old = _copy(data_dir, tmp_path / "old")
  for version in (1, 2, 9):
    (tmp_path / "old" / "meta.json").write_text(json.dumps({**meta, "format": version}))
    with pytest.raises(prepare.DataError, match=f"prepared in format {version}.*this version "
                       "reads format 3 .*prepare it again"):
      prepare.read_meta(old)
  (tmp_path / "old" / "meta.json").write_text(json.dumps(meta)[:100])
  with pytest.raises(prepare.DataError, match="meta.json is unreadable .JSONDecodeError"):
    prepare.read_meta(old)

  first = meta["splits"]["train"]["shards"][0]["name"]
  last_val = meta["splits"]["validation"]["shards"][-1]["name"]
  damages = {  # what is done to a copy -> the error
      "truncated tokens": (f"{first}.bin", lambda p: os.truncate(p, os.path.getsize(p) - 2),
                           f"{first}.bin holds .* tokens, meta.json says"),
      "truncated offsets": (f"{first}.idx", lambda p: os.truncate(p, 8),
                            f"{first}.idx holds 1 document offsets, meta.json says"),
      "missing": (f"{first}.idx", os.remove, f"{first}.idx is missing"),
      "empty validation": (f"{last_val}.bin", lambda p: os.truncate(p, 0),
                           f"{last_val}.bin holds 0 tokens"),
  }
  for name, (file, damage, message) in damages.items():
    broken = _copy(data_dir, tmp_path / name.replace(" ", "_"))
    damage(os.path.join(broken, file))
    with pytest.raises(prepare.DataError, match=message + ".*prepare the directory again"):
      pipeline.check(pipeline.StreamSpec(broken, "train", 64, 1), evaluation=True)
    with pytest.raises(ConfigError, match=message):
      validate(tiny_config(**{"data.dir": broken, "eval_every": 10}), 8)
  with pytest.raises(ConfigError, match="holds 2 tokens, fewer than one sequence of "
                                        "data.seq_len \\+ 1 = 33"):
    (tmp_path / "a.txt").write_text("ab")
    tiny = prepare.prepare_files(str(tmp_path / "tiny"), [str(tmp_path / "a.txt")])
    validate(tiny_config(**{"data.dir": tiny}), 8)


def test_an_out_that_holds_anything_is_refused_before_any_work(tmp_path, capsys, monkeypatch):
  """--out must not exist yet or be empty: a directory with files (or a file) is refused in one
  line before the inputs are even listed, and no DIR.partial is left."""
  (tmp_path / "a.txt").write_text(_texts(1)[0])
  (tmp_path / "full").mkdir()
  (tmp_path / "full" / "notes.md").write_text("mine")
  (tmp_path / "file").write_text("x")
  monkeypatch.setattr(sources, "expand", lambda inputs: pytest.fail("work began"))
  err = refused(capsys, ["--out", str(tmp_path / "full"), str(tmp_path / "a.txt")])
  assert err == (f"error: {tmp_path}/full is not empty (1 entries, e.g. 'notes.md') and holds "
                 "no prepared data; preparation writes a new directory: remove it or choose "
                 "another --out")
  assert "is a file" in refused(capsys, ["--out", str(tmp_path / "file"), str(tmp_path)])
  # The default corpus with another tokenizer: refused before the tokenizer is loaded.
  assert "is not empty" in refused(capsys, ["--out", str(tmp_path / "full"), "--tokenizer",
                                            str(tmp_path / "none.json")])
  assert sorted(os.listdir(tmp_path)) == ["a.txt", "file", "full"]
  monkeypatch.undo()
  (tmp_path / "empty").mkdir()  # an empty directory is taken
  prepare.main(["--out", str(tmp_path / "empty"), "--workers", "1", str(tmp_path / "a.txt")])
  assert prepare.read_meta(str(tmp_path / "empty"))["splits"]["train"]["documents"] == 1


def test_invalid_unicode_is_replaced_once_for_every_tokenizer(tmp_path, capsys):
  """A lone surrogate in JSONL (a truncated emoji, "\\ud83d") and bytes that are not UTF-8 in a
  text file become U+FFFD where documents are read: training a BPE and encoding with a
  tokenizer.json both go through, and meta.json counts the two cleaned documents."""
  d = tmp_path / "in"
  d.mkdir()
  with open(d / "d.jsonl", "wb") as f:
    for t in _texts(20):
      f.write(json.dumps({"text": t}).encode() + b"\n")
    f.write(b'{"text": "broken emoji \\ud83d here"}\n')
    f.write(b'{"text": "latin-1 caf\xe9"}\n')
  (d / "bad.txt").write_bytes(b"caf\xe9 au lait\n")
  bpe = str(tmp_path / "bpe")
  prepare.main(["--out", bpe, "--train_tokenizer", "bpe:300", "--workers", "1", str(d)])
  assert "3 documents held invalid Unicode" in capsys.readouterr().out
  given = str(tmp_path / "given")
  prepare.main(["--out", given, "--tokenizer", os.path.join(bpe, "tokenizer", "tokenizer.json"),
                "--workers", "1", str(d)])
  for out in (bpe, given):
    meta = prepare.read_meta(out)
    assert meta["cleaned_documents"] == 3
    texts = _all_texts(out)
    for want in ("broken emoji \ufffd here", "latin-1 caf\ufffd", "caf\ufffd au lait\n"):
      assert want in texts
    assert sum(meta["splits"][s]["bytes"] for s in prepare.SPLITS) == sum(
        len(t.encode()) for t in texts)


def test_jsonl_nulls_are_skipped_and_malformed_lines_are_one_line_errors(tmp_path, capsys):
  texts = _texts(10)
  with open(tmp_path / "d.jsonl", "w") as f:
    for t in texts:
      f.write(json.dumps({"text": t}) + "\n")
    f.write('{"text": null}\n')  # skipped, as Parquet's nulls are
  out = prepare.prepare_files(str(tmp_path / "p"), [str(tmp_path / "d.jsonl")])
  assert _all_texts(out) == sorted(texts)
  for line, want in (('{"text": 3}', "d.jsonl:1: the text is a int, not a string"),
                     ('{"text": "a"', "d.jsonl:1: not a JSON record (Expecting ',' delimiter)"),
                     ('["text"]', "d.jsonl:1: no field 'text'")):
    (tmp_path / "bad.jsonl").write_text(line + "\n")
    assert want in refused(capsys, ["--out", str(tmp_path / "q"), str(tmp_path / "bad.jsonl")])


def _prepared(out):
  """Every split's decoded documents and meta.json's counts, checked against each other."""
  meta = prepare.read_meta(out)
  docs = {}
  for split in prepare.SPLITS:
    docs[split] = _documents(out, split)
    c = meta["splits"][split]
    ids = list(SplitTokens(out, split).documents())
    assert c["documents"] == len(docs[split]) and c["tokens"] == sum(map(len, ids))
    assert c["bytes"] == sum(len(t.encode()) for t in docs[split])
  assert sorted(os.listdir(out)) == sorted(
      ["meta.json"] + [f for s in prepare.SPLITS for e in meta["splits"][s]["shards"]
                       for f in shards.shard_files(e)])
  return docs, meta["splits"]


def test_preparation_interrupted_at_any_file_operation_resumes_exactly(tmp_path, monkeypatch):
  """A preparation killed at its k-th file operation (each file put in place, removed or
  renamed), for every k, then run again, gives the directory an uninterrupted run gives: no
  document lost or duplicated, meta.json's counts those of its files. The corpus is small, so
  validation would be empty and the move of a document to it is among the operations."""
  d = tmp_path / "in"
  d.mkdir()
  for i, t in enumerate(_texts(6)):
    (d / f"{i}.txt").write_text(t)
  want = _prepared(prepare.prepare_files(str(tmp_path / "whole"), [str(d)]))
  assert [e["name"] for e in want[1]["validation"]["shards"]] == ["validation-moved"]
  assert sorted(want[0]["train"] + want[0]["validation"]) == sorted(_texts(6))

  real = {"replace": os.replace, "remove": os.remove, "rename": os.rename,
          "rmtree": shutil.rmtree}
  calls = []

  def interrupt_at(k):
    calls.clear()

    def wrap(name):
      def op(*args, **kwargs):
        calls.append(name)
        if len(calls) == k:
          raise KeyboardInterrupt(f"killed at {name} {args[0]}")
        return real[name](*args, **kwargs)
      return op

    for name in ("replace", "remove", "rename"):
      monkeypatch.setattr(os, name, wrap(name))
    monkeypatch.setattr(shutil, "rmtree", wrap("rmtree"))

  interrupt_at(0)
  prepare.prepare_files(str(tmp_path / "count"), [str(d)])
  total = len(calls)
  assert {"replace", "remove", "rename"} <= set(calls)
  for k in range(1, total + 1):
    out = str(tmp_path / f"k{k}")
    interrupt_at(k)
    with pytest.raises(KeyboardInterrupt):
      prepare.prepare_files(out, [str(d)])
    interrupt_at(0)
    prepare.prepare_files(out, [str(d)])
    assert _prepared(out) == want, k
    assert not os.path.exists(out + ".partial")
  # Killed at its last operation (the plan's removal, after the rename): the data is in place,
  # and another preparation there is refused (the same one finishes, above).
  out = str(tmp_path / "other")
  interrupt_at(total)
  with pytest.raises(KeyboardInterrupt):
    prepare.prepare_files(out, [str(d)])
  interrupt_at(0)
  with pytest.raises(prepare.DataError, match="already holds prepared data"):
    prepare.prepare_files(out, [str(d)], validation_fraction=0.5)
  # Killed just before its rename, its clean-up done: the rerun renames, nothing is redone.
  out = str(tmp_path / "again")
  interrupt_at(total - 1)
  with pytest.raises(KeyboardInterrupt):
    prepare.prepare_files(out, [str(d)])
  assert calls[-1] == "rename"
  interrupt_at(0)
  prepare.prepare_files(out, [str(d)])
  assert calls == ["replace", "rename", "remove"] and _prepared(out) == want  # plan.json rewritten


_RACE = """
import os, sys, time
from data import prepare
out, counter = sys.argv[1], sys.argv[2]
def slow_prepare(out_dir, **kw):
  with open(counter, "a") as f:
    f.write("x")
  time.sleep(1.0)
  os.makedirs(out_dir)
  open(os.path.join(out_dir, "meta.json"), "w").write("{}")
prepare.prepare_stdlib = slow_prepare
open(out + ".ready" + str(os.getpid()), "w").close()
while not os.path.exists(out + ".go2"):
  time.sleep(0.01)
print(prepare.ensure_default_corpus(out))
"""


def test_processes_starting_together_prepare_the_default_corpus_once(tmp_path):
  """Two processes (the suite's xdist workers, two train.py runs on a fresh machine) asking for
  the default corpus at the same moment: one prepares it, the other waits and reuses it."""
  import subprocess, sys  # noqa: E401, PLC0415
  out, counter = str(tmp_path / "corpus"), str(tmp_path / "calls")
  root = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
  procs = [subprocess.Popen([sys.executable, "-c", _RACE, out, counter], cwd=root,
                            stdout=subprocess.PIPE, text=True) for _ in range(2)]
  import glob, time  # noqa: E401, PLC0415
  deadline = time.time() + 60
  while len(glob.glob(out + ".ready*")) < 2 and time.time() < deadline:
    time.sleep(0.01)  # both imported and waiting at the gate
  open(out + ".go2", "w").close()
  outs = [p.communicate(timeout=60)[0].strip() for p in procs]
  assert [p.returncode for p in procs] == [0, 0]
  assert outs == [out, out]
  assert open(counter).read() == "x"  # prepared once

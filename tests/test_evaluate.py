"""Whole-split evaluation: every target once, packed evaluation equals document-by-document
evaluation, bits per byte from the bytes of the split, the EMA weights beside the raw ones."""
import json
import math
import os

import jax
import numpy as np
import pytest

from data import prepare
from tests.conftest import tiny_config
from tools import evaluate as evaluate_cli
from tools.convert import mesh_from_overrides
from tools import generate as generate_cli
from trainer.evaluation import packed_rows, split_documents
from trainer.inference import restore_with_ema
from trainer.loop import Run

SEQ = 32


def test_packed_rows_predict_every_token_but_the_first_once():
  rng = np.random.default_rng(0)
  docs = [rng.integers(0, 100, n).astype(np.int32) for n in (1, 2, 5, 33, 34, 70, 100)]
  rows = list(packed_rows(iter(docs), SEQ))
  assert sum(int(r["loss_mask"].sum()) for r in rows) == sum(len(d) - 1 for d in docs)
  got = sorted(int(t) for r in rows for t in r["targets"][r["loss_mask"]])
  assert got == sorted(int(t) for d in docs for t in d[1:])
  for r in rows:  # a window's positions restart at 0 and follow its segment
    seg, pos = r["segment_ids"], r["positions"]
    starts = np.r_[True, seg[1:] != seg[:-1]] & (seg > 0)
    assert (pos[starts] == 0).all()


def make_data(out_dir, texts):
  """A small prepared byte-level dataset with a validation split."""
  src = os.path.join(os.path.dirname(out_dir), "docs.jsonl")
  with open(src, "w") as f:
    f.write("\n".join(json.dumps({"text": t}) for t in texts))
  return prepare.prepare_files(out_dir, [src], validation_fraction=0.3)


@pytest.fixture(scope="module")
def run(tmp_path_factory):
  """A 3-step run with a parameter EMA on a small prepared dataset."""
  root = tmp_path_factory.mktemp("eval")
  texts = [f"document {i}: " + "the quick brown fox é " * (i % 5 + 1) for i in range(60)]
  data_dir = make_data(str(root / "data"), texts)
  cfg = tiny_config(**{"steps": 3, "data.dir": data_dir, "data.seq_len": SEQ,
                       "optim.ema_decay": 0.5})
  Run(cfg, str(root / "run")).train()
  return str(root / "run"), data_dir


def test_whole_split_matches_document_by_document(run, tmp_path):
  workdir, data_dir = run
  out = tmp_path / "eval.json"
  assert evaluate_cli.main(["--checkpoint", workdir, "--batch_size", "8",
                            "--json", str(out)]) == 0
  result = json.loads(out.read_text())
  assert set(result) >= {"params", "ema"}
  assert result["params"]["loss"] != result["ema"]["loss"]

  # Reference: each document's windows evaluated alone, unpacked, one at a time.
  mesh = mesh_from_overrides([])
  spec, weights, _ = restore_with_ema(workdir, mesh)
  forward = jax.jit(lambda p, t: spec.model(p)(t))
  nats, count = 0.0, 0
  for doc in split_documents(data_dir, "validation"):
    for start in range(0, len(doc) - 1, SEQ):
      w = doc[start:start + SEQ + 1]
      logits = np.asarray(forward(weights["ema"], w[None, :-1]))[0]
      logp = logits - np.log(np.exp(logits - logits.max(-1, keepdims=True)).sum(-1,
                                                                                 keepdims=True)) \
          - logits.max(-1, keepdims=True)
      nats -= float(logp[np.arange(len(w) - 1), w[1:]].sum())
      count += len(w) - 1
  n_bytes = sum(int((doc < 256).sum()) for doc in split_documents(data_dir, "validation"))
  ema = result["ema"]
  assert ema["tokens"] == count and ema["bytes"] == n_bytes
  assert ema["loss"] == pytest.approx(nats / count, rel=1e-5)
  assert ema["perplexity"] == pytest.approx(math.exp(nats / count), rel=1e-5)
  assert ema["bits_per_byte"] == pytest.approx(nats / math.log(2) / n_bytes, rel=1e-5)


def test_generate_from_a_training_run_with_text(run, capsys):
  workdir, _ = run
  args = ["--checkpoint", workdir, "--prompt", "the quick", "--prompt", "a",
          "--max_new_tokens", "5", "--temperature", "0.7", "--top_k", "20", "--seed", "3"]
  assert generate_cli.main(args) == 0
  lines = capsys.readouterr().out.strip().splitlines()
  assert lines[-2].startswith("'the quick' -> ") and lines[-1].startswith("'a' -> ")
  assert generate_cli.main(args + ["--ema"]) == 0  # the EMA weights sample other text
  assert capsys.readouterr().out.strip().splitlines()[-2:] != lines[-2:]


def test_evaluate_refuses_unknown_split(run, capsys):
  workdir, _ = run
  assert evaluate_cli.main(["--checkpoint", workdir, "--split", "test"]) == 2
  err = capsys.readouterr().err
  assert "--split test" in err and len(err.strip().splitlines()) == 1, err


def test_run_data_dir_of_a_mixture_run_is_its_first_source():
  from trainer.inference import run_data_dir
  assert run_data_dir({"dir": "", "mixture": "code=/d/a:0.7,prose=/d/b:0.3"}) == "/d/a"
  assert run_data_dir({"dir": "/d/c", "mixture": ""}) == "/d/c"

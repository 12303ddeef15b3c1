"""Whole-split evaluation: every target once, packed evaluation equals document-by-document
evaluation, disjoint and sliding windows (`--stride`), bits per byte from the bytes of the
split, the EMA weights beside the raw ones."""
import json
import math
import os

import jax
import numpy as np
import pytest
from tests.conftest import tiny_config

from data import prepare
from tools import evaluate as evaluate_cli
from tools import generate as generate_cli
from tools.convert import mesh_from_overrides
from trainer.checkpoint.model_dirs import restore_with_ema
from trainer.evaluation import split as evaluation
from trainer.evaluation.split import packed_rows, split_documents, windows
from trainer.run.loop import Run

SEQ = 32


@pytest.mark.parametrize("stride", [None, SEQ, 7, 1])
def test_packed_rows_predict_every_token_but_the_first_once(stride):
  rng = np.random.default_rng(0)
  docs = [rng.integers(0, 100, n).astype(np.int32) for n in (1, 2, 5, 33, 34, 70, 100)]
  rows = list(packed_rows(iter(docs), SEQ, stride))
  assert sum(int(r["loss_mask"].sum()) for r in rows) == sum(len(d) - 1 for d in docs)
  got = sorted(int(t) for r in rows for t in r["targets"][r["loss_mask"]])
  assert got == sorted(int(t) for d in docs for t in d[1:])
  for r in rows:  # a window's positions restart at 0 and follow its segment
    seg, pos = r["segment_ids"], r["positions"]
    starts = np.r_[True, seg[1:] != seg[:-1]] & (seg > 0)
    assert (pos[starts] == 0).all()
    assert not (r["loss_mask"] & (seg == 0)).any()
  # Each document's targets in order, each once, with at least seq_len - stride + 1 tokens of
  # context (all earlier ones when there are fewer).
  context = SEQ - (stride or SEQ) + 1
  for doc in docs:
    scored = []
    for w, n in windows(doc, SEQ, stride):
      assert len(w) <= SEQ + 1 and 1 <= n <= len(w) - 1
      first = len(scored) + 1  # the document index of this window's first scored target
      assert len(w) - n >= min(context, first)
      scored += list(w[len(w) - n:])
    assert scored == list(doc[1:])


def make_data(out_dir, texts):
  """A small prepared byte-level dataset with a validation split."""
  src = os.path.join(os.path.dirname(out_dir), "docs.jsonl")
  with open(src, "w") as f:
    f.write("\n".join(json.dumps({"text": t}) for t in texts))
  return prepare.prepare_files(out_dir, [src], validation_fraction=0.3)


@pytest.fixture(scope="module")
def run(tmp_path_factory):
  """A 120-step run with a parameter EMA on a small prepared dataset, long enough to have learnt
  to use its context (at 60 steps sliding and disjoint windows scored within 0.4%; at 120 the
  sliding windows' loss is 5% lower)."""
  root = tmp_path_factory.mktemp("eval")
  texts = [f"document {i}: " + "the quick brown fox é " * (i % 5 + 1) for i in range(60)]
  data_dir = make_data(str(root / "data"), texts)
  cfg = tiny_config(**{"steps": 120, "log_every": 20, "data.dir": data_dir,
                       "data.seq_len": SEQ, "optim.ema_decay": 0.9})
  Run(cfg, str(root / "run")).train()
  return str(root / "run"), data_dir


def _evaluate(workdir, out, *extra):
  assert evaluate_cli.main(["--checkpoint", workdir, "--batch_size", "8", "--json", str(out),
                            *extra]) == 0
  return json.loads(out.read_text())


@pytest.mark.parametrize("stride", [None, 8])
def test_whole_split_matches_a_direct_computation(run, tmp_path, stride):
  """tools.evaluate (packed windows, batched) against Hugging Face's sliding-window loop
  written out by hand: one document and one window at a time, unpacked, windows of
  max_length = SEQ + 1 tokens (SEQ inputs) every `stride` tokens, each scoring the targets
  past the previous window's end; stride = SEQ is the disjoint mode (the default)."""
  workdir, data_dir = run
  result = _evaluate(workdir, tmp_path / "eval.json", *(["--stride", str(stride)] if stride
                                                        else []))
  assert set(result) >= {"params", "ema"} and result["stride"] == (stride or SEQ)
  assert result["params"]["loss"] != result["ema"]["loss"]

  mesh = mesh_from_overrides([])
  spec, weights, _ = restore_with_ema(workdir, mesh)
  forward = jax.jit(lambda p, t: spec.model(p)(t))
  max_length, step = SEQ + 1, stride or SEQ
  nats, count = 0.0, 0
  for doc in split_documents(data_dir, "validation"):
    prev_end = 0
    for begin in range(0, len(doc), step):
      end = min(begin + max_length, len(doc))
      ids = doc[begin:end]
      n = min(end - prev_end, len(ids) - 1)  # the targets no window scored yet
      if n > 0:  # inputs right-padded to SEQ (one compile; a causal model ignores the pad)
        inputs = np.zeros((1, SEQ), np.int32)
        inputs[0, :len(ids) - 1] = ids[:-1]
        logits = np.asarray(forward(weights["ema"], inputs), np.float64)[0, :len(ids) - 1]
        logp = logits - logits.max(-1, keepdims=True)
        logp -= np.log(np.exp(logp).sum(-1, keepdims=True))
        picked = logp[np.arange(len(ids) - 1), ids[1:]]
        nats -= float(picked[-n:].sum())
        count += n
      prev_end = end
      if end == len(doc):
        break
  n_bytes = sum(int((doc < 256).sum()) for doc in split_documents(data_dir, "validation"))
  assert count == sum(max(len(d) - 1, 0) for d in split_documents(data_dir, "validation"))
  ema = result["ema"]
  assert ema["tokens"] == count and ema["bytes"] == n_bytes
  assert ema["loss"] == pytest.approx(nats / count, rel=1e-5)
  assert ema["perplexity"] == pytest.approx(math.exp(nats / count), rel=1e-5)
  assert ema["bits_per_byte"] == pytest.approx(nats / math.log(2) / n_bytes, rel=1e-5)


def test_stride_seq_len_is_the_disjoint_mode_and_more_context_scores_lower(run, tmp_path):
  workdir, _ = run
  disjoint = _evaluate(workdir, tmp_path / "a.json")
  same = _evaluate(workdir, tmp_path / "b.json", "--stride", str(SEQ))
  sliding = _evaluate(workdir, tmp_path / "c.json", "--stride", "8")
  assert same == disjoint
  for name in ("params", "ema"):
    assert sliding[name]["tokens"] == disjoint[name]["tokens"]  # every token once, both ways
    assert sliding[name]["loss"] < disjoint[name]["loss"]  # >= 25 tokens of context, not 1


def test_evaluate_refuses_a_stride_longer_than_the_windows(run, capsys):
  workdir, _ = run
  assert evaluate_cli.main(["--checkpoint", workdir, "--stride", str(SEQ + 1)]) == 2
  err = capsys.readouterr().err
  assert f"--stride {SEQ + 1}: give 1 to seq_len={SEQ}" in err
  assert len(err.strip().splitlines()) == 1, err


def test_a_split_with_nothing_to_score_has_no_loss_not_zero(run, monkeypatch):
  workdir, data_dir = run
  monkeypatch.setattr(evaluation, "split_documents", lambda *_: iter([np.array([7], np.int32)]))
  spec, weights, _ = restore_with_ema(workdir, mesh_from_overrides([]))
  out = evaluation.evaluate_split(spec, weights, data_dir, "validation", seq_len=SEQ,
                                  batch_rows=8, decode=str)
  assert out["params"]["tokens"] == 0 and math.isnan(out["params"]["loss"])
  assert math.isnan(out["params"]["bits_per_byte"])


def test_an_in_training_evaluation_of_nothing_is_nan_not_zero(data_dir):
  """eval_sequences=0 is refused by the config checks (tests/test_config.py); an evaluator built
  without them scores nothing, and says so with NaN, never a perfect 0."""
  from data import mixture
  from sharding import make_mesh
  from trainer.evaluation.periodic import make_evaluator
  from trainer.step.program import Program
  from trainer.step.state import init_state
  cfg = tiny_config(eval_sequences=0)
  program = Program(cfg, make_mesh(cfg.mesh))
  evaluate = make_evaluator(program, [mixture.Source("data", data_dir)],
                            tuple(range(program.micro_rows)))
  row = evaluate(init_state(program.spec, program.tx))
  assert math.isnan(row["eval_loss"]) and math.isnan(row["eval_bpb"])


def test_generate_from_a_training_run_with_text(run, capsys):
  workdir, _ = run
  args = ["--checkpoint", workdir, "--prompt", "the quick", "--prompt", "a",
          "--max_new_tokens", "24", "--temperature", "1.5", "--top_k", "0", "--seed", "3"]
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
  from trainer.checkpoint.model_dirs import run_data_dir
  assert run_data_dir({"dir": "", "mixture": "code=/d/a:0.7,prose=/d/b:0.3"}) == "/d/a"
  assert run_data_dir({"dir": "/d/c", "mixture": ""}) == "/d/c"


def test_tools_name_what_the_user_typed_and_keep_quiet(run, tmp_path, capsys, caplog,
                                                       monkeypatch):
  workdir, _ = run
  import logging  # noqa: PLC0415
  from tools import convert as convert_cli  # noqa: PLC0415
  monkeypatch.setattr(logging.getLogger("absl"), "level", logging.NOTSET)  # as a fresh process
  missing = str(tmp_path / "no" / "such")
  assert generate_cli.main(["--checkpoint", missing, "--prompt", "a"]) == 2
  assert capsys.readouterr().err.strip() == (
      f"error: --checkpoint={missing!r}: no checkpoint found there (give a workdir, its "
      "checkpoints/ dir, or a step dir)")
  with open(os.path.join(workdir, "config.json")) as f:
    config_json = f.read()
  assert convert_cli.main(["to-hf", workdir, "--out", workdir]) == 2
  err = capsys.readouterr().err.strip()
  assert err.startswith(f"error: --out {workdir}: is the source's own directory") \
      and len(err.splitlines()) == 1, err
  with open(os.path.join(workdir, "config.json")) as f:
    assert f.read() == config_json
  # Orbax's "Metadata file does not exist" (and other absl warnings) are not shown.
  caplog.set_level(logging.WARNING)
  assert generate_cli.main(["--checkpoint", workdir, "--prompt_ids", "1,2",
                            "--max_new_tokens", "2"]) == 0
  assert convert_cli.main(["to-hf", workdir, "--out", str(tmp_path / "hf")]) == 0
  assert not [r.getMessage() for r in caplog.records if r.name == "absl"]

"""train.py end to end on the tiny config: it learns and writes what it promises."""
import glob
import json
import os
import subprocess
import sys

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


def test_train_py_learns_and_writes_outputs(tmp_path):
  workdir = tmp_path / "run"
  proc = subprocess.run(
      [sys.executable, "train.py", "--config", "configs/lm_tiny.py", "--workdir", str(workdir),
       "--config.steps=40", "--config.log_every=10", "--config.eval_every=20",
       "--config.checkpoint.every_steps=20", "--config.eval_sequences=16"],
      cwd=ROOT, capture_output=True, text=True, timeout=600)
  assert proc.returncode == 0, proc.stdout[-2000:] + proc.stderr[-2000:]
  rows = [json.loads(line) for line in open(workdir / "metrics.jsonl")]
  train_rows = [r for r in rows if "loss" in r]
  eval_rows = [r for r in rows if "eval_loss" in r]
  assert [r["step"] for r in train_rows] == [10, 20, 30, 40]
  assert [r["step"] for r in eval_rows] == [20, 40]
  for key in ("step", "loss", "learning_rate", "grad_norm", "tokens_per_sec", "mfu"):
    assert all(key in r for r in train_rows), key
  assert train_rows[-1]["loss"] < 0.8 * train_rows[0]["loss"], train_rows
  assert eval_rows[-1]["eval_loss"] < eval_rows[0]["eval_loss"]
  assert glob.glob(str(workdir / "tensorboard" / "events.out.tfevents.*"))
  assert json.load(open(workdir / "config.json"))["steps"] == 40
  assert sorted(os.listdir(workdir / "checkpoints")) == ["20", "40"]
  assert "fingerprint" in proc.stdout


def test_metrics_writer_does_not_import_torch(tmp_path):
  """tensorboardX imports torch where it is installed (~2 s of every start): the writer hides
  it, writes its events, and torch stays importable afterwards."""
  code = ("import sys; from trainer.tracking.metrics import MetricsWriter; "
          f"w = MetricsWriter({str(tmp_path)!r}, progress_bar=False); w.write(1, {{'loss': 1.0}}); "
          "w.close(); print('torch' in sys.modules); import torch; print(torch.__name__)")
  out = subprocess.run([sys.executable, "-c", code], cwd=ROOT, capture_output=True, text=True,
                       timeout=120)
  assert out.returncode == 0, out.stderr[-2000:]
  assert out.stdout.split()[-2:] == ["False", "torch"]
  assert glob.glob(str(tmp_path / "tensorboard" / "events.out.tfevents.*"))

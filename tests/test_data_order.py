"""The data order from the outside: what a step trains on is decided by the config, the seed and
the step alone. Micro-batches, devices, the mesh, processes and restarts only place the step's
sequences, so the logged losses (and the evaluation) do not change with them. The pieces inside
(windows, their order, the iterator state) are tested in tests/test_data.py; the noise meter
against per-example gradients in tests/test_noise_scale.py."""
import json
import subprocess
import sys

import jax
import numpy as np
import pytest
from test_multihost import ROOT, child_env

from conftest import losses, tiny_config
from trainer.config.checks import validate
from trainer.run.loop import Run

BATCH = 32
# The tiny test model (conftest.tiny_config) as train.py overrides, for runs in other processes.
ARGS = ["--config.model.d_model=32", "--config.model.mlp_dim=64", "--config.model.num_heads=4",
        "--config.model.num_kv_heads=2", "--config.data.seq_len=32", "--config.data.prefetch=0",
        "--config.optim.learning_rate=1e-2", "--config.optim.warmup_steps=2",
        "--config.optim.decay_steps=50", "--config.log_every=1",
        "--config.trainer.progress_bar=false", "--config.trainer.peak_flops_per_device=1e9",
        f"--config.data.global_batch_size={BATCH}", "--config.eval_sequences=20"]


def _run(workdir, micro: int, mesh: dict, steps: int = 3, **extra) -> dict:
  """A run of `steps` steps at global batch 32 in micro-batches of `micro` on the test's 8
  devices; its metrics rows by step."""
  cfg = tiny_config(**{"data.global_batch_size": BATCH, "data.micro_batch_size": micro,
                       "steps": steps, "eval_every": steps, "eval_sequences": 20,
                       **{f"mesh.{k}": v for k, v in mesh.items()}, **extra})
  validate(cfg, jax.devices())
  Run(cfg, str(workdir)).train()
  return _rows(workdir)


def _rows(workdir) -> dict:
  rows = {}
  for line in open(workdir / "metrics.jsonl"):
    row = json.loads(line)
    if "loss" in row or "eval_loss" in row:
      rows.setdefault(row["step"], {}).update(row)
  return rows


def _train_py(workdir, devices: int, *args):
  proc = subprocess.run([sys.executable, "train.py", "--config", "configs/lm_tiny.py",
                         "--workdir", str(workdir), *ARGS, *args], cwd=ROOT,
                        env=child_env(devices), capture_output=True, text=True, timeout=600)
  assert proc.returncode == 0, proc.stdout[-2000:] + proc.stderr[-2000:]
  return proc


def _same(a: dict, b: dict, keys=("loss", "grad_norm", "eval_loss"), rtol=1e-5) -> None:
  assert sorted(a) == sorted(b)
  for step in a:
    for key in keys:
      if key in a[step] or key in b[step]:
        np.testing.assert_allclose(a[step][key], b[step][key], rtol=rtol, err_msg=(step, key))


def test_losses_do_not_depend_on_micro_batches_devices_or_mesh(tmp_path):
  """Global batch 32 in micro-batches of 4 (data=4 x tensor=2), 8 (data=8) and 32 (data=2 x
  fsdp=2 x tensor=2) on 8 devices, and of 4 on 1 device in its own process: the same losses,
  gradient norms and evaluation, to float summation order (per-row streams: 2.8e-2 apart)."""
  want = _run(tmp_path / "m8", 8, {"data": 8})
  assert sorted(want) == [1, 2, 3] and "eval_loss" in want[3]
  _same(_run(tmp_path / "m4", 4, {"data": 4, "tensor": 2}), want)
  _same(_run(tmp_path / "m32", 32, {"data": 2, "fsdp": 2, "tensor": 2}), want)
  _train_py(tmp_path / "one", 1, "--config.steps=3", "--config.eval_every=3",
            "--config.data.micro_batch_size=4", "--config.mesh.data=1")
  _same(_rows(tmp_path / "one"), want)


@pytest.mark.slow  # an elastic restart; the default run keeps test_local_tier's rescale
def test_a_restart_on_fewer_devices_keeps_the_batch_and_the_losses(tmp_path):
  """Elastic restart: 2 steps on 8 devices (micro-batches of 8), then on from the checkpoint
  with 2 devices (micro-batches of 2, four times as many): the same global batch, so the same
  losses as the run that never stopped."""
  straight = _run(tmp_path / "straight", 8, {"data": 8}, steps=4)
  _train_py(tmp_path / "elastic", 8, "--config.steps=2", "--config.eval_every=0",
            "--config.checkpoint.every_steps=2", "--config.data.micro_batch_size=8",
            "--config.mesh.data=8")
  proc = _train_py(tmp_path / "elastic", 2, "--config.steps=4", "--config.eval_every=4",
                   "--config.data.micro_batch_size=2", "--config.mesh.data=2")
  assert "resumed from" in proc.stdout
  _same(_rows(tmp_path / "elastic"), straight)


def test_the_data_order_tool_prints_documents_per_step_against_independent_draws(capsys):
  from tools import data_order  # noqa: PLC0415
  assert data_order.main(["--config", "configs/sweep_tiny.py", "--batch_sizes", "4,32",
                          "--steps", "30"]) == 0
  out = capsys.readouterr().out
  rows = [line.split("|")[1:-1] for line in out.splitlines() if line.startswith("| 4 ")
          or line.startswith("| 32 ")]
  assert len(rows) == 2
  for batch, got, want, within, across in rows:
    mean, err = (float(x) for x in got.split("+-"))
    assert abs(mean - float(want)) < 4 * err + 0.03 * float(want), (batch, got, want)
    assert float(within) < float(across) + 0.01
  assert data_order.main(["--config", "configs/sweep_tiny.py", "--batch_sizes", "8,x"]) == 2
  assert "give positive whole batch sizes" in capsys.readouterr().err
  assert data_order.main(["--batch_sizes", "8"]) == 2  # no --config: the help names the command
  assert capsys.readouterr().err.strip().endswith("(python -m tools.data_order --help)")


@pytest.mark.slow  # resume refusals: the default run keeps test_run_policies' mismatched config
def test_resume_on_other_data_is_refused_or_said(tmp_path, data_dir):
  """A checkpoint of the byte-level corpus resumed on data of another tokenizer: refused in one
  line (exit 2) naming both, the checkpoint untouched. Resumed with another seed: it goes on
  from the same window with one line saying the order changes from there."""
  from data import prepare  # noqa: PLC0415
  run = tmp_path / "run"
  _train_py(run, 1, "--config.steps=2", "--config.eval_every=0", "--config.mesh.data=1",
            "--config.checkpoint.every_steps=2")
  (tmp_path / "a.txt").write_text("some other text, tokenized otherwise " * 300)
  bpe = prepare.prepare_files(str(tmp_path / "bpe"), [str(tmp_path / "a.txt")],
                              tokenizer="bpe:300")
  proc = subprocess.run([sys.executable, "train.py", "--config", "configs/lm_tiny.py",
                         "--workdir", str(run), *ARGS, "--config.steps=4", "--config.mesh.data=1",
                         f"--config.data.dir={bpe}"], cwd=ROOT, env=child_env(1),
                        capture_output=True, text=True, timeout=600)
  err = proc.stderr.strip().splitlines()
  assert proc.returncode == 2 and len(err) == 1 and "Traceback" not in proc.stderr, proc.stderr
  assert "tokenized by byte/-/vocab 259; this run's data uses hf/" in err[0], err[0]
  assert sorted(p.name for p in (run / "checkpoints").iterdir()) == ["2"]
  proc = _train_py(run, 1, "--config.steps=3", "--config.eval_every=0", "--config.mesh.data=1",
                   "--config.seed=5")
  assert ("checkpoint 2: the data order changes from window 64 on (seed 0 -> 5)"
          in proc.stdout), proc.stdout[-2000:]

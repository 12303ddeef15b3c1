"""The vision workload (docs/vision.md): ghost batch norm (per-group statistics, running
statistics in the train state and checkpoints), mnist1d data generated once and cached, its order
keyed by (seed, global index), losses independent of micro-batches and devices, a bit-identical
resume, AdamW and LARS end to end, and config mistakes as one line with exit code 2."""
import csv
import json
import subprocess
import sys

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from conftest import metric_rows, tiny_config
from flax import nnx
from test_multihost import ROOT, child_env

import train
from data import mnist1d
from models.resnet import GhostBatchNorm, ResNet1D, ResNetConfig
from optim.factory import masks
from sharding import make_mesh
from trainer.checkpoint.saved import CheckpointError
from trainer.config.checks import validate
from trainer.run.loop import Run
from trainer.step.state import ModelSpec

pytest.importorskip("mnist1d", reason="the vision workload's data: pip install -e '.[vision]'")

# a 1-block ResNet of 8 channels on 200 training examples, ghost groups of 8
VISION = {"model.kind": "resnet1d", "model.resnet.channels": 8, "model.resnet.blocks": 1,
          "model.resnet.bn_group": 8, "data.mnist1d.train_examples": 200, "data.seq_len": 40,
          "data.global_batch_size": 32, "eval_sequences": 64, "optim.name": "adamw",
          "optim.learning_rate": 3e-3}


@pytest.fixture(scope="module", autouse=True)
def data_cache(tmp_path_factory):
  """The tests' mnist1d arrays, generated once into a directory of their own (a test set of
  400: the 4,000 of a run take ~10 s to generate on busy cores)."""
  with pytest.MonkeyPatch.context() as mp:
    mp.setattr(mnist1d, "TEST_EXAMPLES", 400)
    mp.setenv("SCALETRAIN_DATA", str(tmp_path_factory.mktemp("mnist1d")))
    yield mnist1d.prepare(200, 1)


def _run(workdir, steps: int, **extra) -> dict:
  cfg = tiny_config(**{**VISION, "steps": steps, "eval_every": steps, **extra})
  validate(cfg, jax.devices())
  assert Run(cfg, str(workdir)).train().status == "done"
  return metric_rows(workdir), _evals(workdir)


def _evals(workdir) -> dict:
  return {r["step"]: r for r in map(json.loads, open(workdir / "metrics.jsonl"))
          if "eval_accuracy" in r}


def test_ghost_batch_norm_normalises_each_group_by_itself():
  """Each group of 4 is normalised as flax's BatchNorm normalises it alone; the running
  statistics move by the mean of the groups' statistics; eval uses them."""
  x = np.random.default_rng(0).normal(size=(8, 5, 3)) * np.arange(1, 9)[:, None, None]

  @jax.jit  # one compile, not one per eager op
  def outputs(x):
    ghost = GhostBatchNorm(3, 4, 0.9, rngs=nnx.Rngs(0))
    y = ghost(x)
    alone = [nnx.BatchNorm(3, momentum=0.9, rngs=nnx.Rngs(0))(x[4 * g:4 * g + 4])
             for g in range(2)]
    return y, jnp.concatenate(alone), ghost.mean[...], ghost.var[...], ghost(
        x, use_running_average=True)

  y, alone, mean, var, evaluated = outputs(jnp.asarray(x, jnp.float32))
  np.testing.assert_allclose(y, alone, atol=1e-5)
  groups = x.reshape(2, 4 * 5, 3)
  np.testing.assert_allclose(mean, 0.1 * groups.mean(1).mean(0), rtol=1e-5)
  np.testing.assert_allclose(var, 0.9 + 0.1 * groups.var(1).mean(0), rtol=1e-5)
  np.testing.assert_allclose(evaluated, (x - mean) / np.sqrt(var + 1e-5), rtol=1e-4, atol=1e-5)


def test_label_smoothing_is_mlperfs():
  """model.resnet.label_smoothing=a: each example's loss is (1 - a) x its cross-entropy plus
  a x the mean of -log p over the classes; accuracy and the example count as without it."""
  batch = {"inputs": jnp.asarray(np.random.default_rng(0).normal(size=(16, 40)), jnp.float32),
           "targets": jnp.arange(16, dtype=jnp.int32)[:, None] % 10,
           "loss_mask": jnp.ones((16, 1), bool)}

  @jax.jit
  def sums(batch):
    out = {}
    for a in (0.0, 0.1):
      model = ResNet1D(ResNetConfig(channels=8, blocks=1, bn_group=8, label_smoothing=a),
                       rngs=nnx.Rngs(0))
      out[a] = model.sums(batch, train=False)
    logp = jax.nn.log_softmax(model(batch["inputs"], train=False))
    return out, logp

  out, logp = sums(batch)
  nll = -np.take_along_axis(np.asarray(logp), np.asarray(batch["targets"]), 1).sum()
  np.testing.assert_allclose(out[0.0][0], nll, rtol=1e-5)
  np.testing.assert_allclose(out[0.1][0], 0.9 * nll - 0.1 * np.asarray(logp).mean(1).sum(),
                             rtol=1e-5)
  assert out[0.1][1:] == out[0.0][1:] and out[0.0][1] == 16


def test_data_is_cached_and_its_order_keyed_by_seed_and_global_index(data_cache, monkeypatch):
  monkeypatch.setattr(mnist1d, "_generate", lambda *a: pytest.fail("generated again"))
  assert mnist1d.prepare(200, 1) == data_cache  # the second run reads the cache
  first = lambda rows, seed=0, n=2: [next(it) for it in [iter(mnist1d.dataset(
      mnist1d.ExampleSpec(data_cache, rows, seed=seed)))] for _ in range(n)]
  two_of_8, one_of_16 = first(8), first(16, n=1)[0]
  for key in one_of_16:
    np.testing.assert_array_equal(np.concatenate([b[key] for b in two_of_8]), one_of_16[key])
  assert not np.array_equal(first(16, seed=1, n=1)[0]["inputs"], one_of_16["inputs"])
  order = mnist1d.ExampleOrder(mnist1d.ExampleSpec(data_cache, 8))
  x, _ = mnist1d._arrays(data_cache, "train")
  epoch = order.batch(np.arange(200, 400))["inputs"]  # the second epoch: every example once
  assert sorted(map(bytes, epoch)) == sorted(map(bytes, x))
  assert len(mnist1d.test_batches(data_cache, 10_000, 32)) == -(-mnist1d.TEST_EXAMPLES // 32)


def test_lars_and_decay_skip_biases_and_norm_parameters():
  """optim/factory.py's masks from the ResNet's logical names: the trust ratio and weight
  decay apply to the conv and head kernels only."""
  spec = ModelSpec(ResNetConfig(channels=8, blocks=1), make_mesh({}, jax.devices()[:1]), 0)
  m = masks(spec.logical_names)
  flat = {"/".join(map(str, k)): v for k, v in nnx.traversals.flatten_mapping(
      m["trust_ratio"]).items()}
  assert flat and all(v == k.endswith("kernel") for k, v in flat.items()), flat
  assert m["decay"] == m["trust_ratio"]


def test_losses_do_not_depend_on_micro_batches_devices_or_the_meter(tmp_path):
  """Batch 64 in micro-batches of 8 on data=8, and in one of 64 on data 2 x fsdp 2 x tensor 2
  with the noise meter on (it splits each device's 16 rows into its two ghost groups of 8, kept
  whole): the same losses, gradient norms and evaluation (which reads the running statistics);
  the meter logs its sums."""
  want, want_eval = _run(tmp_path / "m8", 2, **{"data.micro_batch_size": 8, "mesh.data": 8,
                                                "data.global_batch_size": 64})
  got, got_eval = _run(tmp_path / "m64", 2, **{
      "data.global_batch_size": 64, "data.micro_batch_size": 64, "mesh.data": 2,
      "mesh.fsdp": 2, "mesh.tensor": 2, "optim.noise_scale_every": 1})
  assert sorted(want) == [1, 2] and 0 <= want_eval[2]["eval_accuracy"] <= 1
  assert all(np.isfinite(got[s]["noise_trace_step"]) for s in (1, 2)), got[1]
  for step in want:
    for key in ("loss", "grad_norm"):
      np.testing.assert_allclose(got[step][key], want[step][key], rtol=1e-6, err_msg=key)
  for key in ("eval_loss", "eval_accuracy"):
    np.testing.assert_allclose(got_eval[2][key], want_eval[2][key], rtol=1e-6, err_msg=key)


def test_lars_resume_is_bit_identical(tmp_path):
  """LARS, 4 steps straight and 2 + 2 resumed from the checkpoint at 2: the same losses and the
  same evaluation at step 4, bit for bit (the batch statistics are restored exactly)."""
  lars = {"optim.name": "lars", "optim.learning_rate": 1.0, "checkpoint.every_steps": 2,
          "mesh.data": 8, "data.prefetch": 2}  # the iterator's state through grain's prefetch
  want, want_eval = _run(tmp_path / "straight", 4, **lars)
  _run(tmp_path / "resumed", 2, **{**lars, "eval_every": 4})
  got, got_eval = _run(tmp_path / "resumed", 4, **lars)
  assert [got[s]["loss"] for s in range(1, 5)] == [want[s]["loss"] for s in range(1, 5)]
  assert got_eval[4]["eval_loss"] == want_eval[4]["eval_loss"]
  assert np.isfinite(want[4]["loss"]) and want[4]["skipped"] == 0
  with pytest.raises(CheckpointError, match="model.resnet.channels=8, the config has 16"):
    _run(tmp_path / "resumed", 6, **{**lars, "model.resnet.channels": 16})


@pytest.mark.slow  # a sweep of two runs, ~15-30 s; the default run keeps the meter's test above
def test_the_sweep_reads_the_classifier_error_and_the_meter(tmp_path):
  """tools.batch_sweep on the vision workload with `--target_metric eval_error` (1 - accuracy):
  each run stops where its error falls to the target (its evaluations before it above, the one
  at it below), with the noise meter's B_simple read there."""
  from tools import batch_sweep
  out = tmp_path / "sweep"
  args = ["--config", "configs/mnist1d_resnet.py", "--batch_sizes", "16,32", "--lr_grid", "1",
          "--max_extensions", "0", "--target_loss", "0.8", "--target_metric", "eval_error",
          "--max_examples", "640", "--eval_examples", "64", "--eval_sequences", "64",
          "--smooth_examples", "0", "--micro_batch_size", "8", "--out", str(out)]
  args += [f"--config.{k}={v}" for k, v in {**VISION, "log_every": 1, "optim.learning_rate": 1e-2,
                                            "optim.schedule": "constant",
                                            "optim.noise_scale_window": 1.0}.items()
           if k not in ("data.global_batch_size", "eval_sequences")]
  assert batch_sweep.main(args) == 0
  summary = json.load(open(out / "batch_sweep.json"))
  assert summary["target_metric"] == "eval_error"
  noise = []
  for batch in (16, 32):
    evals = [r["eval_accuracy"] for r in _evals(out / "runs" / f"b{batch}_lr1").values()]
    assert evals[-1] >= 0.2 and all(a < 0.2 for a in evals[:-1]), (batch, evals)
    row = next(r for r in csv.DictReader(open(out / "batch_sweep.csv"))
               if int(r["batch_size"]) == batch)
    assert float(row["steps"]) > 0, row
    noise.append(float(row["noise_scale"] or "nan"))
  assert np.nanmax(noise) > 0, noise  # the meter's value where its gate let one through


@pytest.mark.slow  # two train.py processes (~30 s on busy cores); the default run keeps the above
def test_train_py_on_one_and_eight_devices(tmp_path):
  """configs/mnist1d_resnet.py through train.py (small sizes) on 1 device in micro-batches of 16
  and on 8 devices in one micro-batch: the same losses and evaluation to 1e-6."""
  args = ["--config.steps=3", "--config.eval_every=3", "--config.log_every=1",
          "--config.model.resnet.channels=8", "--config.model.resnet.blocks=1",
          "--config.data.mnist1d.train_examples=200", "--config.data.global_batch_size=32",
          "--config.eval_sequences=64", "--config.trainer.progress_bar=false"]
  runs = {}
  for name, devices, more in (("one", 1, ["--config.data.micro_batch_size=16"]), ("eight", 8, [])):
    proc = subprocess.run([sys.executable, "train.py", "--config", "configs/mnist1d_resnet.py",
                           "--workdir", str(tmp_path / name), *args, *more], cwd=ROOT,
                          env=child_env(devices), capture_output=True, text=True, timeout=600)
    assert proc.returncode == 0, proc.stdout[-2000:] + proc.stderr[-2000:]
    runs[name] = metric_rows(tmp_path / name), _evals(tmp_path / name)
  (one, one_eval), (eight, eight_eval) = runs["one"], runs["eight"]
  assert sorted(one) == [1, 2, 3] and sorted(one_eval) == [3]
  for step in one:
    for key in ("loss", "grad_norm"):
      np.testing.assert_allclose(eight[step][key], one[step][key], rtol=1e-6, err_msg=key)
  for key in ("eval_loss", "eval_accuracy"):
    np.testing.assert_allclose(eight_eval[3][key], one_eval[3][key], rtol=1e-6, err_msg=key)


@pytest.mark.parametrize("args, says", [
    (["--config.data.global_batch_size=24"], "data.global_batch_size=24 is not a multiple of "
     "model.resnet.bn_group=16"),
    (["--config.data.micro_batch_size=8"], "data.micro_batch_size=8 is not a multiple of"),
    (["--config.mesh.stage=2"], "mesh.stage=2 with model.kind='resnet1d': the vision workload "
     "does not support it; use mesh.stage=1"),
    (["--config.model.kind=cnn"], "model.kind='cnn': must be one of transformer, resnet1d"),
    (["--config.data.seq_len=128"], "data.seq_len=128 with model.kind='resnet1d': mnist1d's "
     "signals have 40 samples"),
])
def test_config_mistakes_are_one_line_exit_2(tmp_path, capsys, args, says):
  code = train.main(["--config", "configs/mnist1d_resnet.py", "--workdir", str(tmp_path / "w"),
                     *args])
  err = capsys.readouterr().err
  assert code == 2 and says in err and len(err.strip().splitlines()) == 1, err

"""Test setup: 8 fake CPU devices (set before jax is imported) and small shared fixtures."""
import importlib
import json
import os
import sys

# Which platforms JAX may use is decided here, before jax is imported (this module is imported
# before any test module and before pytest_configure runs, so the `-m gpu` marker expression is
# not known yet; reading sys.argv would miss PYTEST_ADDOPTS, ini addopts and `-mgpu`). JAX picks
# its backends from JAX_PLATFORMS alone, so that variable is the robust signal: the suite runs
# on CPU (the default set here), and the GPU tier sees a GPU only when run as
# `JAX_PLATFORMS=cuda,cpu python -m pytest -m gpu` (without it the tier is skipped, below).
# An empty JAX_PLATFORMS lets JAX choose an accelerator by itself, so it counts as one.
_CPU_ONLY = os.environ.setdefault("JAX_PLATFORMS", "cpu").split(",") == ["cpu"]
# 8 fake CPU devices for the sharding tests. On CPU only: optimisation level 0 makes XLA:CPU
# compile ~3x faster (tests compare programs compiled with the same flags, and subprocesses such
# as train.py inherit them); it also applies to XLA:GPU's code generation, so where a GPU runs
# the tier's programs (kernels, fp8 GEMMs, memory and speed as a user gets them) it is left out.
os.environ["XLA_FLAGS"] = (os.environ.get("XLA_FLAGS", "") +
                           " --xla_force_host_platform_device_count=8" +
                           (" --xla_backend_optimization_level=0" if _CPU_ONLY else "")).strip()
if not _CPU_ONLY:
  # JAX's GPU client reserves 75% of the GPU's memory at start; the tier's processes (pytest and
  # the train.py / tools.memory_check subprocesses it starts, which inherit this) would each
  # try to. Allocate on demand instead (tools.memory_check reads peak_bytes_in_use, which counts
  # what was handed out, not the reservation).
  os.environ.setdefault("XLA_PYTHON_CLIENT_PREALLOCATE", "false")
ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, ROOT)

import tempfile  # noqa: E402

import jax  # noqa: E402
import pytest  # noqa: E402

from trainer.step.program import setup_compilation_cache  # noqa: E402

CACHE_DIR = setup_compilation_cache(  # as train.py sets it, in the temp directory
    os.path.join(tempfile.gettempdir(), "scaletrain-test-jax-cache"))
from data.prepare import ensure_default_corpus  # noqa: E402
from trainer.config import default_config  # noqa: E402


def bench_module(name: str):
  """bench/<name>.py as a module: `bench.<name>` (bench/ holds scripts; they import each other
  the same way)."""
  return importlib.import_module(f"bench.{name}")


def tiny_config(**overrides):
  """A very small model/config for fast tests; dotted keys as overrides."""
  c = default_config()
  c.steps = 6
  c.log_every = 1
  c.eval_every = 0
  c.model.update(vocab_size=512, d_model=32, num_layers=2, num_heads=4, num_kv_heads=2,
                 mlp_dim=64)
  c.data.update(global_batch_size=8, seq_len=32, prefetch=0)
  c.optim.update(learning_rate=1e-2, warmup_steps=2, decay_steps=50)
  c.checkpoint.update(every_steps=0, keep=3)
  c.trainer.update(peak_flops_per_device=1e9, progress_bar=False, compile_cache_dir=CACHE_DIR)
  return override(c, **overrides)


def tiny_config_file(directory, name: str = "tiny.py", global_batch_size: int = 8,
                     **optim) -> str:
  """A config file of a one-layer model on `global_batch_size`-sequence batches, for commands run
  end to end (experiments, sweeps), with `optim` as optim.* values; returns its path."""
  path = os.path.join(str(directory), name)
  with open(path, "w") as f:
    f.write("from trainer.config.defaults import default_config\n"
            "def get_config():\n"
            "  c = default_config()\n"
            "  c.model.update(vocab_size=512, d_model=32, num_layers=1, num_heads=4,\n"
            "                 num_kv_heads=2, mlp_dim=64)\n"
            f"  c.data.update(global_batch_size={global_batch_size}, seq_len=32, prefetch=0)\n"
            + (f"  c.optim.update(**{optim!r})\n" if optim else "") +
            "  c.trainer.update(peak_flops_per_device=1e9)\n"
            "  return c\n")
  return path


def override(cfg, **overrides):
  """Set dotted keys (`**{"model.d_model": 64}`) on a ConfigDict; returns it."""
  for key, value in overrides.items():
    node = cfg
    *path, last = key.split(".")
    for p in path:
      node = node[p]
    node[last] = value
  return cfg


def write_sweep_config(directory) -> str:
  """A config file for sweep commands (tools.batch_sweep, experiments): the tiny model at batch
  16, AdamW stated there with the sqrt rule, constant rate after 32 sequences."""
  return tiny_config_file(directory, "tiny_sweep.py", global_batch_size=16, learning_rate=1e-2,
                          schedule="constant", warmup_steps=0, warmup_examples=32,
                          reference_batch_size=16, lr_rule="sqrt")


def metric_rows(workdir) -> dict[int, dict]:
  """{step: training row} of a workdir's metrics.jsonl; a restarted run redoes steps, and the
  last record of each step wins."""
  rows = {}
  with open(os.path.join(workdir, "metrics.jsonl")) as f:
    for line in f:
      row = json.loads(line)
      if "loss" in row:
        rows[row["step"]] = row
  return rows


def trained(workdir, cfg):
  """(the `trainer.run.loop.Run` of `cfg` in `workdir`, trained to its end; `workdir`): a module
  fixture's one straight run, which its tests compare with stopped and resumed ones."""
  from trainer.run.loop import Run  # noqa: PLC0415
  run = Run(cfg, str(workdir))
  assert run.train().status == "done"
  return run, workdir


def losses(workdir) -> dict[int, float]:
  return {step: row["loss"] for step, row in metric_rows(workdir).items()}


def assert_adam_params_close(got, want, lr: float, rel: float = 1e-5):
  """Parameters after Adam-type steps of two programs that differ only in float rounding
  (another reduction order, sharding, an outer step done in numpy). Adam divides each
  coordinate's step by that coordinate's own gradient scale, so where a gradient is ~0 a
  rounding difference in it moves the coordinate by up to ~lr x 1e-4 (measured 2.9e-6 for 1 of
  16,384 coordinates at lr 1e-2): the tight check is each tensor's relative difference (< `rel`),
  the elementwise one bounds the outliers by lr x 1e-3. Returns the worst per-tensor difference."""
  import numpy as np  # noqa: PLC0415
  worst = max(jax.tree.leaves(jax.tree.map(
      lambda a, b: float(np.linalg.norm(a - b) / np.linalg.norm(b)), got, want)))
  assert worst < rel, worst
  jax.tree.map(lambda a, b: np.testing.assert_allclose(a, b, rtol=1e-4, atol=lr * 1e-3), got,
               want)
  return worst


def pytest_collection_modifyitems(config, items):
  """The GPU tier (`-m gpu`) needs a GPU that JAX sees; this file makes JAX_PLATFORMS=cpu the
  default for the rest of the suite, so the tier runs as `JAX_PLATFORMS=cuda,cpu python -m
  pytest -m gpu` and is skipped, with that reason, anywhere else."""
  tier = [item for item in items if item.get_closest_marker("gpu")]
  if not tier:
    return
  try:
    jax.devices("gpu")
  except RuntimeError:
    skip = pytest.mark.skip(reason="no GPU visible to JAX: run the tier on a GPU machine as "
                            "`JAX_PLATFORMS=cuda,cpu python -m pytest -m gpu`")
    for item in tier:
      item.add_marker(skip)


@pytest.fixture(scope="session")
def data_dir():
  return ensure_default_corpus()


@pytest.fixture(scope="session")
def devices():
  assert jax.device_count() == 8, "tests need 8 fake CPU devices (XLA_FLAGS set in conftest)"
  return jax.devices()

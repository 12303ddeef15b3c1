"""Weights & Biases offline logging from the metrics writer and a training run; the profiler
trace window."""
import glob
import os

import jax
import jax.numpy as jnp
import pytest
from tests.conftest import tiny_config

from trainer.config import ConfigError
from trainer.config.checks import validate
from trainer.config.defaults import parse_window
from trainer.tracking.profiling import ProfileWindow


def _wandb_run_files(workdir):
  return glob.glob(os.path.join(workdir, "wandb", "offline-run-*", "run-*.wandb"))


@pytest.fixture
def offline(monkeypatch, tmp_path):
  pytest.importorskip("wandb", reason="needs the `wandb` extra")
  # No account, no network: an unreachable server would make any upload attempt fail.
  monkeypatch.setenv("WANDB_MODE", "offline")
  monkeypatch.setenv("WANDB_BASE_URL", "http://127.0.0.1:9")
  monkeypatch.setenv("WANDB_API_KEY", "")
  monkeypatch.setenv("WANDB_CONFIG_DIR", str(tmp_path / "wandb-config"))
  monkeypatch.setenv("WANDB_CACHE_DIR", str(tmp_path / "wandb-cache"))


def test_training_run_logs_to_wandb_offline(offline, tmp_path):
  from trainer.run.loop import Run
  cfg = tiny_config(**{"steps": 2, "trainer.wandb.project": "scaletrain-test",
                       "trainer.wandb.mode": "offline", "trainer.wandb.name": "tiny"})
  workdir = str(tmp_path / "run")
  Run(cfg, workdir).train()
  files = _wandb_run_files(workdir)
  assert len(files) == 1
  data = open(files[0], "rb").read()
  # The history rows (loss per step) and the run config are in the offline run's records.
  assert b"loss" in data and b"tokens_per_sec" in data and b"scaletrain-test" in data
  with open(os.path.join(workdir, "wandb_run_id")) as f:
    run_id = f.read().strip()
  assert files[0].endswith(f"run-{run_id}.wandb")


def test_wandb_project_without_package_or_bad_mode_is_a_config_error(monkeypatch):
  cfg = tiny_config(**{"trainer.wandb.mode": "sometimes"})
  with pytest.raises(ConfigError, match="trainer.wandb.mode='sometimes'"):
    validate(cfg, 8)
  import builtins
  real_import = builtins.__import__
  monkeypatch.setattr(builtins, "__import__", lambda name, *a, **k: (
      (_ for _ in ()).throw(ImportError(name)) if name == "wandb" else real_import(name, *a, **k)))
  with pytest.raises(ConfigError, match=r"needs the wandb package: pip install"):
    validate(tiny_config(**{"trainer.wandb.project": "p"}), 8)


@pytest.mark.parametrize("bad", ["5", "3:2", "0:4", "a:b", "2:"])
def test_profile_steps_validation(bad):
  with pytest.raises(ConfigError, match="trainer.profile_steps"):
    validate(tiny_config(**{"trainer.profile_steps": bad}), 8)
  assert parse_window("20:25") == (20, 25) and parse_window("") is None


def test_profile_window_traces_steps_a_to_b(tmp_path):
  f = jax.jit(lambda x: jnp.tanh(x @ x))
  x = jnp.ones((64, 64))
  window = ProfileWindow("2:3", str(tmp_path), log=lambda _: None,
                         create_perfetto_trace=False)
  active = []
  for step in range(1, 6):
    window.before_step(step)
    x = f(x)
    window.after_step(step, x)
    active.append(window.active)
  window.close()
  assert active == [False, True, False, False, False]
  traces = glob.glob(str(tmp_path / "profile" / "plugins" / "profile" / "*" / "*.xplane.pb"))
  assert len(traces) == 1 and os.path.getsize(traces[0]) > 0


def test_profile_window_stops_when_the_run_ends_inside_it(tmp_path):
  window = ProfileWindow("1:100", str(tmp_path), log=lambda _: None,
                         create_perfetto_trace=False)
  window.before_step(1)
  jax.jit(lambda x: x + 1)(jnp.ones(3)).block_until_ready()
  window.after_step(1)
  assert window.active
  window.close()
  assert not window.active
  assert glob.glob(str(tmp_path / "profile" / "plugins" / "profile" / "*" / "*.xplane.pb"))


def test_training_run_writes_the_profile_window(tmp_path):
  from trainer.run.loop import Run
  workdir = str(tmp_path / "run")
  Run(tiny_config(**{"steps": 4, "trainer.profile_steps": "2:3"}), workdir).train()
  assert glob.glob(os.path.join(workdir, "profile", "plugins", "profile", "*", "*.xplane.pb"))

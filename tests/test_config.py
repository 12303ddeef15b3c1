"""Config errors: one line naming the key and what would work, exit code 2, nothing compiled."""
import os
import subprocess
import sys

import jax
import pytest

import train
from conftest import tiny_config
from trainer.config import ConfigError, default_config
from trainer.config.cli import load

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
TINY = os.path.join(ROOT, "configs", "lm_tiny.py")


@pytest.mark.parametrize("args,needle", [
    (["--config.no_such_key=1"], "unknown key 'no_such_key'"),
    (["--config.optim.learnin_rate=1"], "did you mean 'optim.learning_rate'"),
    (["--config.mesh.data=3", "--config.mesh.fsdp=1"], "has 3 devices but 8 are available"),
    (["--config.steps=ten"], "--config.steps='ten': expected int"),
    (["--config.optim.learning_rate=fast"], "expected float"),
    (["--config.model.tie_embeddings=maybe"], "expected bool"),
    (["--config.mesh=2"], "is a group"),
    (["--config.data.global_batch_size=12", "--config.mesh.data=8"],
     "not divisible by the data-parallel size 8"),
    (["--config.mesh.data=2", "--config.mesh.sequence=4", "--config.data.seq_len=126"],
     "data.seq_len=126 is not divisible by mesh.sequence=4"),
    (["--config.mesh.data=1", "--config.mesh.tensor=8"], "does not split over mesh.tensor=8"),
    (["--config.optim.name=adam"], "optim.name='adam': choose one of adamw, lamb, lars, sgd"),
    (["--config.trainer.norm_metrics=false"],  # was a bool: says what works now
     "trainer.norm_metrics='false': choose one of log_steps, every_step, off"),
    (["--config.model.num_kv_heads=3"], "must divide model.num_heads=4"),
    (["--config.data.micro_batch_size=5"], "must divide data.global_batch_size=16"),
    (["--config.eval_sequences=0"], "eval_sequences=0 with eval_every=100: an evaluation "),
    (["--config.eval_steps=4"],  # renamed: says what replaced it
     "unknown key 'eval_steps'; it is now eval_sequences (validation sequences per evaluation"),
    (["--config.model.moe.shared_expert=True"],  # a width now: says so
     "--config.model.moe.shared_expert='True': expected int"),
    (["--config.steps=1.5"], "--config.steps='1.5': expected int"),
    # a pipeline setting without stages would be ignored: refused, as pipeline.repeats was
    (["--config.pipeline.schedule=zero_bubble"], "pipeline.schedule='zero_bubble' with "
     "mesh.stage=1: pipeline settings apply to pipeline stages only and would be ignored"),
    (["--config.pipeline.schedule=1f1b", "--config.pipeline.remat_stage=false"],
     "pipeline.schedule='1f1b' with mesh.stage=1"),
    (["--config.pipeline.remat_stage=false"], "pipeline.remat_stage=False with mesh.stage=1"),
    (["--config.mesh.stage=16"], "mesh.data=-1 cannot fill 8 devices: the other axes multiply "
     "to 16, which does not divide 8 (the fixed sizes ask for 16 devices; this process sees 8 "
     "cpu device(s): run where there are 16, or on CPU set "
     "XLA_FLAGS=--xla_force_host_platform_device_count=16 before starting)"),
])
def test_config_error_is_one_line_exit_2(args, needle, tmp_path, capsys):
  code = train.main(["--config", TINY, "--workdir", str(tmp_path / "w")] + args)
  err = capsys.readouterr().err
  assert code == 2, err
  assert needle in err, err
  assert len(err.strip().splitlines()) == 1, err
  assert not os.path.exists(tmp_path / "w"), "nothing may be written for a bad config"


def test_url_workdir_is_refused(capsys):
  assert train.main(["--config", TINY, "--workdir", "gs://bucket/runs/x"]) == 2
  err = capsys.readouterr().err
  assert "must be a filesystem path" in err and "gcsfuse" in err
  assert len(err.strip().splitlines()) == 1, err


def test_missing_config_file(tmp_path, capsys):
  assert train.main(["--config", str(tmp_path / "nope.py"), "--workdir", str(tmp_path)]) == 2
  assert "no such file" in capsys.readouterr().err


def test_unknown_key_in_config_file(tmp_path):
  path = tmp_path / "bad.py"
  path.write_text("from trainer.config.defaults import default_config\n"
                  "def get_config():\n  c = default_config()\n  c.optim.lr = 1.0\n  return c\n")
  with pytest.raises(ConfigError, match="unknown key 'optim.lr'"):
    load(str(path), [])


def test_overrides_parse_types():
  cfg = load(TINY, [("steps", "7"), ("optim.learning_rate", "1e-3"),
                    ("model.tie_embeddings", "true"), ("optim.name", "lamb"),
                    ("optim.decay_tokens", "2e9"), ("model.moe.shared_expert", "384")])
  assert (cfg.steps, cfg.optim.learning_rate, cfg.model.tie_embeddings, cfg.optim.name) == (
      7, 1e-3, True, "lamb")
  assert (cfg.optim.decay_tokens, cfg.model.moe.shared_expert) == (2_000_000_000, 384)
  assert type(cfg.optim.decay_tokens) is int
  assert set(default_config().keys()) == set(cfg.keys())


def test_eval_sequences_zero_is_fine_without_evaluation():
  from trainer.config.checks import validate
  validate(load(TINY, [("eval_sequences", "0"), ("eval_every", "0")]), 1)


def test_real_process_exit_code(tmp_path):
  """The same through a real process: exit status 2, one line on stderr, no traceback."""
  proc = subprocess.run([sys.executable, "train.py", "--config", TINY, "--workdir",
                         str(tmp_path / "w"), "--config.steps=ten"],
                        cwd=ROOT, capture_output=True, text=True, timeout=120)
  assert proc.returncode == 2
  assert "Traceback" not in proc.stderr
  assert proc.stderr.strip().splitlines() == ["error: --config.steps='ten': expected int "
                                              "(like the default 300)"]


def test_platform_choice_skips_absent_tpus():
  from trainer.multihost import platforms  # noqa: PLC0415
  cases = [({}, {"0x8086"}, "cpu"), ({}, {"0x8086", "0x10de"}, "cuda,cpu"),
           ({}, {"0x1ae0"}, None), ({}, set(), None), ({}, {"0x1002"}, None),
           ({"JAX_PLATFORMS": "tpu"}, {"0x8086"}, "tpu")]
  for environ, vendors, want in cases:
    platforms.choose(environ, vendors)
    assert environ.get("JAX_PLATFORMS") == want, (environ, vendors)


class _Gpu:  # what validate reads of a device: its platform (one slice)
  platform = "gpu"


def test_gpu_matmul_widths_not_multiple_of_64_warn_in_one_line(capsys):
  """On GPUs (issue 25: an MLP of 5461 cost XLA 35% against 5632) each matmul width a device
  multiplies that is not a multiple of 64 gets one warning line naming the nearest good values;
  the run goes on; nothing is said on CPU or for widths that are fine."""
  from trainer.config.checks import matmul_width_warnings, validate
  cfg = tiny_config(**{"model.d_model": 2048, "model.num_heads": 16, "model.num_kv_heads": 16,
                       "model.mlp_dim": 5461, "model.vocab_size": 50257, "mesh.data": 1})
  validate(cfg, [_Gpu()])
  err = capsys.readouterr().err.strip().splitlines()
  assert len(err) == 2, err
  assert err[0] == ("warning: model.mlp_dim=5461 is not a multiple of 64: GPU matmuls of that "
                    "width run slower (35% for an MLP of 5461 vs 5632 on an H200); the nearest "
                    "good values are 5440 or 5504")
  assert err[1].startswith("warning: model.vocab_size=50257 is not") and "50240 or 50304" in err[1]
  validate(cfg, 1)  # a device count (no platform) or CPU devices: no warning
  validate(cfg, jax.devices()[:1])
  assert capsys.readouterr().err == ""
  # over mesh.tensor=2 the widths are per device: 5632 / 2 = 2816 is fine, 5504 / 2 = 2752 too,
  # 5440 / 2 = 2720 is not (nearest 5376 or 5504)
  cfg.mesh.update(data=1, tensor=2)
  cfg.model.update(mlp_dim=5440, vocab_size=50304)
  lines = matmul_width_warnings(cfg, {"tensor": 2})
  assert lines == ["model.mlp_dim=5440 (2720 per device over mesh.tensor=2) is not a multiple of "
                   "64: GPU matmuls of that width run slower (35% for an MLP of 5461 vs 5632 on "
                   "an H200); the nearest good values are 5376 or 5504"]
  cfg.model.update(mlp_dim=5632, num_heads=12, num_kv_heads=4, head_dim=80)  # 960, 320: fine
  assert matmul_width_warnings(cfg, {"tensor": 1}) == []
  cfg.model.update(head_dim=72)  # 12 x 72 = 864, 4 x 72 = 288
  assert [line.split("=")[0] for line in matmul_width_warnings(cfg, {"tensor": 1})] == [
      "model.num_heads x head dim", "model.num_kv_heads x head dim"]

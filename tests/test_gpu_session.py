"""bench/gpu_session.sh, the script a GPU session runs in a few device calls: valid bash, every
stage's steps name files and modules that exist, shapes the benches know and config keys the
config has, an unknown stage is refused; and the stage runner itself, on CPU with a stand-in
for python: limits, skipping what no longer fits, the summary."""
import os
import re
import subprocess

import pytest

from conftest import bench_module
from trainer.config import default_config

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
SCRIPT = os.path.join(ROOT, "bench", "gpu_session.sh")
STAGES = ("table", "checks", "tune", "extra")


def _steps(stage):
  out = subprocess.run(["bash", SCRIPT, stage], cwd=ROOT, env={**os.environ, "DRY_RUN": "1"},
                       capture_output=True, text=True, check=True).stdout
  return [line.split(": ", 1) for line in out.strip().splitlines()]


def test_script_is_valid_bash_and_refuses_an_unknown_stage():
  subprocess.run(["bash", "-n", SCRIPT], check=True)
  proc = subprocess.run(["bash", SCRIPT, "everything"], capture_output=True, text=True)
  assert proc.returncode == 2 and "usage: bash bench/gpu_session.sh" in proc.stderr


@pytest.mark.parametrize("stage", STAGES)
def test_every_step_names_what_exists(stage):
  import importlib.util  # noqa: PLC0415
  baseline = bench_module("baseline")
  cfg = default_config()
  steps = _steps(stage)
  assert steps, stage
  for name, command in steps:
    args = command.split()
    assert args[0] == "python3", command
    if args[1] == "-m":  # a module of this repository, or an installed one (pytest)
      path = os.path.join(ROOT, args[2].replace(".", "/") + ".py")
      assert os.path.exists(path) or importlib.util.find_spec(args[2]), (name, args[2])
    else:
      assert os.path.exists(os.path.join(ROOT, args[1])), (name, args[1])
    for size in re.findall(r"--size (\S+)", command):
      assert set(size.split(",")) <= set(baseline.SIZES) | set(baseline.SHAPES), (name, size)
    for key in re.findall(r"--vary (\S+?)=", command) + re.findall(r"--config\.(\S+?)=",
                                                                   command):
      node = cfg
      for part in key.split("."):
        assert part in node, (name, key)
        node = node[part]


@pytest.mark.slow  # ~35 s of waiting for a time limit
def test_stage_runner_limits_skips_and_summarises(tmp_path):
  """A stand-in `python3` that prints, and sleeps 45 s for pytest: the first step's limit (330
  s) is cut to the stage's time left (~34 s) and it is stopped there, saying so; the next step
  no longer fits and is skipped; the summary comes last."""
  fake = tmp_path / "python3"
  fake.write_text('#!/bin/bash\necho "ran $*"\necho line2\n'
                  'case "$*" in *pytest*) sleep 45;; esac\n')
  fake.chmod(0o755)
  (tmp_path / ".whl").mkdir()
  env = {**os.environ, "OUT": str(tmp_path / "out"), "PYTHON": str(fake),
         "STAGE_SECONDS": "50"}
  (tmp_path / ".whl" / "x-1-py3-none-any.whl").write_text("")  # setup wants wheels to install
  proc = subprocess.run(["bash", SCRIPT, "checks"], cwd=tmp_path, env=env, capture_output=True,
                        text=True, timeout=200)
  assert proc.returncode == 0, proc.stderr
  summary = (tmp_path / "out" / "summary.txt").read_text()
  assert re.search(r"## GPU test tier: exit 124 after 3\ds \(stopped at its limit\)", summary), \
      summary
  assert "ran -m pytest -m gpu -q -rA tests/test_gpu.py" in summary
  assert re.search(r"## memory lm_125m as shipped: skipped, -?\d+s left in the stage", summary)
  assert proc.stdout.rstrip().endswith(summary.rstrip().splitlines()[-1])

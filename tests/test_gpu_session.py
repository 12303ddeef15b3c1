"""bench/gpu_session.sh, the script a GPU session runs in a few device calls: valid bash, every
stage's steps name files and modules that exist, shapes the benches know and config keys the
config has, an unknown stage is refused; each stage's step limits fit its deadline, the memory
check runs once in the session and fp8's speed before the table's longer shapes; and the stage
runner itself, on CPU with a stand-in for python: limits, skipping what no longer fits, the
summary."""
import os
import re
import subprocess

import pytest

from conftest import bench_module
from trainer.config import default_config

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
SCRIPT = os.path.join(ROOT, "bench", "gpu_session.sh")
STAGES = ("table", "checks", "tune", "extra")


def _dry_run(stage, **env):
  """(the steps' [name, limit in seconds, command], the budget line) of DRY_RUN=1."""
  proc = subprocess.run(["bash", SCRIPT, stage], cwd=ROOT,
                        env={**os.environ, "DRY_RUN": "1", **env}, capture_output=True,
                        text=True)
  *lines, budget = proc.stdout.strip().splitlines()
  steps = [re.fullmatch(r"(.+) \[(\d+)s\]: (.+)", line).groups() for line in lines]
  return [[name, int(limit), command] for name, limit, command in steps], budget, proc.returncode


def _steps(stage):
  steps, _, rc = _dry_run(stage)
  assert rc == 0, stage
  return [[name, command] for name, _, command in steps]


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


@pytest.mark.parametrize("stage", STAGES)
def test_step_limits_fit_the_stage(stage):
  """A stage's limits add up to its STAGE_SECONDS (default 500) less the 50 s kept for setup and
  a stopped step's grace, so no step is promised time the stage does not have; the dry run
  says so, and refuses a stage whose limits do not fit (a smaller STAGE_SECONDS)."""
  steps, budget, rc = _dry_run(stage)
  total = sum(limit for _, limit, _ in steps)
  assert rc == 0 and total <= 450 and budget == f"budget: {total}s of 450s", (steps, budget)
  assert all(limit <= 450 for _, limit, _ in steps)
  _, budget, rc = _dry_run(stage, STAGE_SECONDS=str(total + 49))
  assert rc == 1 and budget == f"budget: {total}s of {total - 1}s", budget


def test_memory_is_measured_once_and_fp8_speed_early():
  """One measuring run of tools.memory_check in the session: the tier's memory test (the same
  check at a smaller batch) is deselected where the tier runs, and the deselected id exists.
  fp8's speed comes right after the table's first shape, before its longer ones."""
  gpu_tests = open(os.path.join(ROOT, "tests", "test_gpu.py")).read()
  measuring = []
  for stage in STAGES:
    for name, command in _steps(stage):
      if "tools.memory_check" in command and "--measure" in command:
        measuring.append(name)
      if "pytest -m gpu" in command:
        deselected = re.findall(r"--deselect tests/test_gpu.py::(\w+)", command)
        memory_tests = re.findall(r"def (test_memory\w*)\(", gpu_tests)
        assert memory_tests and set(memory_tests) <= set(deselected), (command, memory_tests)
        assert all(f"def {t}(" in gpu_tests for t in deselected), deselected
  assert measuring == ["memory lm_125m as shipped"], measuring
  names = [name for name, _ in _steps("table")]
  assert names[:2] == ["table d768 1024x32", "fp8 speed d768 1024x32"], names


@pytest.mark.slow  # ~35 s of waiting for a time limit
def test_stage_runner_limits_skips_and_summarises(tmp_path):
  """A stand-in `python3` that prints, and sleeps 45 s for pytest: the first step's limit (260
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

"""bench/gpu_session.sh, the script a GPU session runs in two device calls: valid bash, every
stage's steps name files and modules that exist, shapes the benches know and config keys the
config has, an unknown stage is refused; `all` takes the whole table (three shapes: plain, ours,
torch), the attention table (S 2k/8k x D 64/128, packed and not), the GPU tier and the memory
check, its step limits (steps side by side counted once) fitting 9 minutes; the memory check
runs once in the session; and the stage runner itself, on CPU with a stand-in for python:
limits, steps side by side, skipping what no longer fits, the summary."""
import os
import re
import subprocess

import pytest

from conftest import bench_module
from trainer.config import default_config

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
SCRIPT = os.path.join(ROOT, "bench", "gpu_session.sh")
STAGES = ("all", "profile", "extra")
SECONDS = {"all": (540, 50), "profile": (200, 20), "extra": (500, 50)}  # stage, reserve
LINE = re.compile(r"(.+) \[(\d+)s(, side by side)?\]: (.+)")


def _dry_run(stage, **env):
  """(the steps' [name, limit in seconds, side by side, command], the budget line, exit code)
  of DRY_RUN=1."""
  proc = subprocess.run(["bash", SCRIPT, stage], cwd=ROOT,
                        env={**os.environ, "DRY_RUN": "1", **env}, capture_output=True,
                        text=True)
  *lines, budget = proc.stdout.strip().splitlines()
  steps = [LINE.fullmatch(line).groups() for line in lines]
  return ([[name, int(limit), bool(side), command] for name, limit, side, command in steps],
          budget, proc.returncode)


def _steps(stage):
  steps, _, rc = _dry_run(stage)
  assert rc == 0, stage
  return [[name, command] for name, _, _, command in steps]


def test_script_is_valid_bash_and_refuses_an_unknown_stage():
  subprocess.run(["bash", "-n", SCRIPT], check=True)
  proc = subprocess.run(["bash", SCRIPT, "everything"], capture_output=True, text=True)
  assert proc.returncode == 2 and "usage: bash bench/gpu_session.sh all|profile" in proc.stderr


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


def _budget(steps) -> int:
  """A stage's time as the script counts it: its steps' limits, steps side by side once."""
  alone = sum(limit for _, limit, side, _ in steps if not side)
  return alone + max((limit for _, limit, side, _ in steps if side), default=0)


@pytest.mark.parametrize("stage", STAGES)
def test_step_limits_fit_the_stage(stage):
  """A stage's limits add up to its STAGE_SECONDS (all: 540, under 9 minutes) less what is kept
  for setup and a stopped step's grace, steps side by side counted once; the dry run says so,
  and refuses a stage whose limits do not fit (a smaller STAGE_SECONDS)."""
  seconds, reserve = SECONDS[stage]
  steps, budget, rc = _dry_run(stage)
  total = _budget(steps)
  assert rc == 0 and total <= seconds - reserve, (steps, budget)
  assert budget == f"budget: {total}s of {seconds - reserve}s", budget
  _, budget, rc = _dry_run(stage, STAGE_SECONDS=str(total + reserve - 1))
  assert rc == 1 and budget == f"budget: {total}s of {total - 1}s", budget


def test_all_takes_the_whole_table_attention_tier_and_memory_in_nine_minutes():
  """Issue 34's goal 8: one call, < 9 minutes, the three shapes with plain, ours and torch, the
  attention table at S 2k/8k x D 64/128 packed and not, the GPU tier and the memory check (those
  two side by side: neither is timed)."""
  baseline = bench_module("baseline")
  steps, budget, _ = _dry_run("all")
  assert SECONDS["all"][0] <= 9 * 60
  shapes = {}
  for _, _, _, command in steps:
    if "bench/peers.py" in command:
      runners = set(re.search(r"--runners (\S+)", command).group(1).split(","))
      for shape in re.search(r"--size (\S+)", command).group(1).split(","):
        shapes[shape] = runners
  assert set(shapes) == set(baseline.ISSUE_SHAPES), shapes
  assert all({"plain", "ours", "torch"} <= runners for runners in shapes.values()), shapes
  attention = next(c for _, _, _, c in steps if "bench/attention.py" in c)
  assert "--seq 2048,8192" in attention and "--head-dim 64,128" in attention
  assert "--packed none,docs" in attention
  side = {name: command for name, _, s, command in steps if s}
  assert any("pytest -m gpu" in c for c in side.values()), side
  assert any("tools.memory_check" in c and "--measure" in c for c in side.values()), side


def test_memory_is_measured_once():
  """One measuring run of tools.memory_check in the session: the tier's memory test (the same
  check at a smaller batch) is deselected where the tier runs, and the deselected id exists."""
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


@pytest.mark.slow  # ~60 s of waiting for a time limit
def test_stage_runner_limits_side_by_side_and_summarises(tmp_path):
  """A stand-in `python3` that prints, and sleeps 90 s for pytest: the table and attention steps
  run, then the GPU tier and the memory check run side by side; the tier's limit (130 s) is cut
  to the stage's time left and it is stopped there, saying so, while the memory step beside it
  finishes; the summary comes last."""
  fake = tmp_path / "python3"
  fake.write_text('#!/bin/bash\necho "ran $*"\necho line2\n'
                  'case "$*" in *pytest*) sleep 90;; esac\n')
  fake.chmod(0o755)
  (tmp_path / ".whl").mkdir()
  (tmp_path / ".whl" / "x-1-py3-none-any.whl").write_text("")  # setup wants wheels to install
  env = {**os.environ, "OUT": str(tmp_path / "out"), "PYTHON": str(fake),
         "STAGE_SECONDS": "75"}
  proc = subprocess.run(["bash", SCRIPT, "all"], cwd=tmp_path, env=env, capture_output=True,
                        text=True, timeout=200)
  assert proc.returncode == 0, proc.stderr
  summary = (tmp_path / "out" / "summary.txt").read_text()
  for name in ("table d768 1024x32", "attention S2k/8k D64/128 packed and not",
               "memory lm_125m as shipped"):
    assert re.search(rf"## {re.escape(name)}: exit 0 after \d+s", summary), (name, summary)
  assert re.search(r"## GPU test tier: exit 124 after [4-6]\ds \(stopped at its limit\)",
                   summary), summary
  assert "ran -m pytest -m gpu -q -rA tests/test_gpu.py" in summary
  assert "ran -m tools.memory_check --config configs/lm_125m.py" in summary
  assert proc.stdout.rstrip().endswith(summary.rstrip().splitlines()[-1])

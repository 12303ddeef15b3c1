"""tools.memory_check: the predicted memory of every program a run holds memory for (train step,
logging step, evaluation) on a TPU topology compiled here, each with the whole train state;
measuring needs devices that count their memory (one-line refusal on CPU)."""
import os

import pytest

from conftest import override
from tools import aot, memory_check
from trainer.cli import load

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
TINY = os.path.join(ROOT, "configs", "lm_tiny.py")


@pytest.mark.skipif(not aot.libtpu_available(), reason="libtpu is not installed: nothing can be "
                    "compiled for TPU here (pip install -e \".[tpu]\")")
def test_phases_each_hold_the_whole_state():
  cfg = override(load(TINY, []), **{"mesh.data": 2, "mesh.fsdp": 2, "model.attention": "auto",
                                    "data.micro_batch_size": 8})
  target = aot.tpu_target("v5e:2x2")
  report, phases = memory_check.predict(cfg, target, "lm_tiny")
  assert list(phases) == ["train step", "logging step", "evaluation"]
  assert phases["train step"] == report.total_bytes  # tools.aot's own number
  # Every phase holds the train state besides its own buffers.
  assert all(v > report.state_bytes for v in phases.values()), (phases, report.state_bytes)


def test_measure_needs_devices_that_count_memory(capsys):
  assert memory_check.main(["--config", TINY, "--topology", "local", "--measure",
                            "--config.mesh.data=8"]) == 2
  err = capsys.readouterr().err.strip()
  assert err == ("error: --measure: cpu devices report no memory statistics (memory_stats() is "
                 "None); measure on a GPU or TPU"), err


def test_measure_records_the_allocator_through_the_run(monkeypatch):
  """The measuring run trains, logs, evaluates and saves as train.py does, and reads the
  allocator before and after each train-step compile, at every logged row and at the end
  (here a counter stands in for a GPU's memory_stats); Program.compile is left as it was."""
  from conftest import tiny_config
  from trainer.program import Program
  calls = []
  monkeypatch.setattr(memory_check, "_stats",
                      lambda: calls.append(1) or {"peak_bytes_in_use": 100 * len(calls)})
  compile_before = Program.compile
  peak, timeline = memory_check.measure(tiny_config(**{"eval_steps": 1}), 4)
  assert Program.compile is compile_before
  names = [name for name, _ in timeline]
  assert names[:2] == ["before compiling the train step (measure_noise=False, logs=False)",
                       "after compiling it"]
  assert "step 2 train row" in names and "step 4 eval row" in names
  assert "before compiling the train step (measure_noise=False, logs=True)" in names, names
  assert names[-1] == "end (checkpoint written)" and peak == 100 * len(calls)

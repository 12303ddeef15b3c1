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
  cfg.trainer.norm_metrics = "every_step"  # then every step is the logging step
  assert list(memory_check.predict(cfg, target, "lm_tiny")[1]) == ["train step", "evaluation"]


def test_measure_needs_devices_that_count_memory(capsys):
  assert memory_check.main(["--config", TINY, "--topology", "local", "--measure",
                            "--config.mesh.data=8"]) == 2
  err = capsys.readouterr().err.strip()
  assert err == ("error: --measure: cpu devices report no memory statistics (memory_stats() is "
                 "None); measure on a GPU or TPU"), err

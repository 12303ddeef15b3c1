"""What a resumed run keeps from its checkpoints: the schedule's horizon, and the check that the
checkpoint fits the config (a checkpoint whose config cannot be read is an unreadable one)."""
import glob
import os

import pytest

from conftest import metric_rows, tiny_config
from trainer.checkpoint.saved import CheckpointError
from trainer.run.loop import Run

# A horizon left unset (decay_steps=0 means `steps`), warmup of one step, a checkpoint every 2.
UNSET = {"optim.decay_steps": 0, "optim.warmup_steps": 1, "checkpoint.every_steps": 2}


def _lrs(workdir):
  return {s: row["learning_rate"] for s, row in metric_rows(workdir).items()}


def test_unset_horizon_is_fixed_at_the_first_start(tmp_path, capsys):
  straight = tmp_path / "straight"  # the curve of a 4-step horizon, run for 8 steps
  Run(tiny_config(**{**UNSET, "steps": 8, "optim.decay_steps": 4}), str(straight)).train()
  resumed = tmp_path / "resumed"
  Run(tiny_config(**{**UNSET, "steps": 4}), str(resumed)).train()
  capsys.readouterr()
  Run(tiny_config(**{**UNSET, "steps": 8}), str(resumed)).train()
  out = capsys.readouterr().out
  want, got = _lrs(straight), _lrs(resumed)
  assert sorted(got) == list(range(1, 9))
  assert [got[s] for s in range(1, 9)] == [want[s] for s in range(1, 9)]  # no re-warming
  lines = [l for l in out.splitlines() if "schedule horizon" in l]
  assert len(lines) == 1 and "optim.decay_steps=4, fixed at the run's first start" in lines[0]
  assert "checkpoint 4" in lines[0]
  # A horizon the config sets wins, and the change is said.
  Run(tiny_config(**{**UNSET, "steps": 10, "optim.decay_steps": 20}), str(resumed)).train()
  lines = [l for l in capsys.readouterr().out.splitlines() if "schedule horizon" in l]
  assert len(lines) == 1 and "optim.decay_steps=20 from the config" in lines[0]
  assert "written with optim.decay_steps=4" in lines[0] and "from step 8" in lines[0]


def test_truncated_checkpoint_config_is_an_unreadable_checkpoint(tmp_path, capsys):
  cfg = {**UNSET, "steps": 4}
  Run(tiny_config(**cfg), str(tmp_path)).train()
  metadata = os.path.join(tmp_path, "checkpoints", "4", "config", "metadata")
  with open(metadata) as f:
    text = f.read()
  with open(metadata, "w") as f:
    f.write(text[:len(text) // 2])
  # Not "no check": checkpoint 4 is skipped, and checkpoint 2's config refuses the change.
  with pytest.raises(CheckpointError, match="data.seq_len=32"):
    Run(tiny_config(**{**cfg, "steps": 6, "data.seq_len": 16}), str(tmp_path)).train()
  assert os.path.isdir(os.path.join(tmp_path, "checkpoints", "4")), "nothing moved on a refusal"
  capsys.readouterr()
  Run(tiny_config(**{**cfg, "steps": 6}), str(tmp_path)).train()
  out = capsys.readouterr().out
  # The step's checksums catch it first: one line naming the file and its size.
  damaged = [l for l in out.splitlines() if "is damaged" in l]
  assert len(damaged) == 1 and "checkpoints/4 is damaged (config/metadata has" in damaged[0]
  assert "resumed from" in out and out.split("resumed from")[1].split()[0].endswith("/2")
  assert len(glob.glob(os.path.join(tmp_path, "checkpoints.unreadable", "4-*"))) == 1

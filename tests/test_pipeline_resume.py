"""Pipeline stages through crashes and mesh changes, with real processes (train.py): a circular
pipeline (mesh.stage=2, pipeline.repeats=2, its layer stack stored stage-major) resumes bit for
bit after SIGKILL on the same mesh, its checkpoint (the plain layer stack) continues on one
device, on 4 stages under zero bubble and under interleaved 1F1B, and a one-device checkpoint
continues with stages; across meshes and schedules the losses agree to fp32 reduction order."""
import os
import shutil

import numpy as np
import pytest

from conftest import losses
from test_reliability import assert_same_tail, kill_once_saved, start, train

# 4 layers in 2 stages x 2 repeats, 4 micro-batches of 2 rows, saved every 4 steps.
PIPE = ["--config.model.num_layers=4", "--config.data.micro_batch_size=2",
        "--config.checkpoint.every_steps=4", "--config.pipeline.schedule=circular",
        "--config.pipeline.repeats=2"]
STAGES = ["--config.mesh.stage=2", "--config.mesh.data=2", "--config.mesh.tensor=2"]
# one device has no stages: the pipeline settings go back to their defaults (a schedule set
# without stages is refused, not ignored)
ONE_DEVICE = ["--config.mesh.data=1", "--config.pipeline.schedule=gpipe",
              "--config.pipeline.repeats=1"]


@pytest.fixture(scope="module")
def straight(tmp_path_factory):
  """The uninterrupted 8-step run with stages."""
  workdir = tmp_path_factory.mktemp("pipeline_straight")
  train(workdir, 8, *PIPE, *STAGES)
  return losses(workdir)


@pytest.fixture(scope="module")
def killed(straight, tmp_path_factory):
  """A run with stages killed once its step-4 checkpoint is written; its workdir (not resumed)."""
  workdir = tmp_path_factory.mktemp("pipeline_killed")
  kill_once_saved(start(workdir, 8, *PIPE, *STAGES), workdir, 4, timeout=300)
  return workdir


@pytest.mark.slow  # the default run keeps the next test (the same killed run, on one device) and
# test_reliability's SIGKILL during an async save
def test_sigkill_resumes_bit_for_bit(straight, killed, tmp_path):
  """SIGKILL after the step-4 checkpoint, resumed on the same mesh: every loss of the straight
  run, bit for bit (the stage-major layer stack went to the plain checkpoint and back)."""
  workdir = tmp_path / "run"
  shutil.copytree(killed, workdir)
  proc = train(workdir, 8, *PIPE, *STAGES)
  assert "resumed from" in proc.stdout and "bubble 11.1%" in proc.stdout  # 1 / (4 x 2 + 1)
  assert_same_tail(losses(workdir), straight, 1, last=8)


def test_stage_checkpoint_resumes_on_one_device(straight, killed, tmp_path):
  """The checkpoint of the run with stages, continued on one device: the straight run's losses
  from the same saved state, to fp32 reduction order."""
  workdir = tmp_path / "run"
  shutil.copytree(killed, workdir)
  train(workdir, 8, *PIPE, *ONE_DEVICE, devices=1)
  got = losses(workdir)
  assert [got[s] for s in range(1, 5)] == [straight[s] for s in range(1, 5)]  # same mesh
  np.testing.assert_allclose([got[s] for s in range(5, 9)], [straight[s] for s in range(5, 9)],
                             rtol=1e-5)


@pytest.mark.slow
def test_one_device_checkpoint_resumes_with_stages(straight, tmp_path):
  """A one-device run's checkpoint (the plain stack) continued with stages (stored stage-major):
  the straight run's losses to fp32 reduction order."""
  train(tmp_path, 4, *PIPE, *ONE_DEVICE, devices=1)
  train(tmp_path, 8, *PIPE, *STAGES)
  got = losses(tmp_path)
  np.testing.assert_allclose([got[s] for s in range(1, 9)], [straight[s] for s in range(1, 9)],
                             rtol=1e-5)
  assert os.path.isdir(tmp_path / "checkpoints" / "8")


@pytest.mark.parametrize("name,mesh", [  # the default run keeps the resume on one device above
    pytest.param("zero_bubble", ["--config.mesh.stage=4", "--config.mesh.data=2",
                                 "--config.pipeline.repeats=1"], marks=pytest.mark.slow),
    pytest.param("1f1b", STAGES, marks=pytest.mark.slow)])
def test_checkpoint_continues_on_another_schedule_and_stage_count(straight, killed, tmp_path,
                                                                  name, mesh):
  """The circular run's checkpoint (step 4) continued by zero bubble on 4 stages (the explicit
  loop, one layer per stage, the plain layer order) and by interleaved 1F1B on 2 stages (the
  same stage-major order): the straight run's losses to fp32 reduction order."""
  shutil.copytree(killed, tmp_path / "run")
  proc = train(tmp_path / "run", 8, *PIPE, *mesh, f"--config.pipeline.schedule={name}")
  assert "resumed from" in proc.stdout and "schedule stage" in proc.stdout
  got = losses(tmp_path / "run")
  np.testing.assert_allclose([got[s] for s in range(5, 9)], [straight[s] for s in range(5, 9)],
                             rtol=1e-5)


@pytest.mark.slow
def test_1f1b_sigkill_resumes_bit_for_bit(tmp_path):
  """Interleaved 1F1B killed after its step-4 checkpoint resumes on the same mesh bit for bit."""
  one_f = [*PIPE, *STAGES, "--config.pipeline.schedule=1f1b"]
  straight_dir = tmp_path / "straight"
  train(straight_dir, 8, *one_f)
  workdir = tmp_path / "killed"
  kill_once_saved(start(workdir, 8, *one_f), workdir, 4, timeout=300)
  train(workdir, 8, *one_f)
  assert_same_tail(losses(workdir), losses(straight_dir), 1, last=8)

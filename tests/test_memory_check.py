"""tools.memory_check: the predicted memory of every program a run holds memory for (train step,
logging step, evaluation; a DiLoCo run's outer step) on a TPU topology compiled here, each with
the whole train state (DiLoCo's: a replica's parameters and inner optimizer state, the anchor
and the outer momentum), on the target tools.aot compiles the config for; measuring needs
devices that count their memory (one-line refusal on CPU)."""
import os

import pytest

from conftest import override, tiny_config
from tools import aot, memory_check
from trainer.config.cli import load

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


@pytest.mark.slow  # compiles a DiLoCo program; the default run keeps two memory_check programs
def test_diloco_prediction_holds_the_replicas_state_and_the_outer_step(monkeypatch, capsys):
  """DiLoCo, 2 replicas of data=4 on the 8 CPU devices, parameters replicated inside a replica:
  each device holds its replica's parameters and AdamW moments, the anchor and the outer
  momentum, 5 x the parameters' bytes (+ counters); evaluation scores the anchor; the outer
  step is a phase of its own; every phase holds that state, and the printed line says what it
  is. (norm_metrics=every_step: no separate logging step to compile.)"""
  import jax

  from models.llama import ModelConfig
  from models.sizes import param_counts
  diloco = {"mesh.data": 4, "optim.diloco.replicas": 2, "optim.diloco.inner_steps": 2,
            "eval_every": 2, "steps": 4, "trainer.norm_metrics": "every_step"}
  cfg = override(load(TINY, []), **diloco)
  report, phases = memory_check.predict(cfg, aot.Target("local", jax.devices()), "lm_tiny")
  param_bytes = 4 * param_counts(ModelConfig.from_config(cfg.model))["total"]  # fp32
  assert 0 <= report.state_bytes - 5 * param_bytes < 256, (report.state_bytes, param_bytes)
  assert list(phases) == ["train step", "evaluation", "outer step"], phases
  assert all(v > report.state_bytes for v in phases.values()), (phases, report.state_bytes)
  monkeypatch.setattr(memory_check, "predict", lambda *a: (report, phases))
  assert memory_check.main(["--config", TINY, "--topology", "local",
                            *(f"--config.{k}={v}" for k, v in diloco.items())]) == 0
  out = capsys.readouterr().out
  assert "(DiLoCo: one of 2 replicas' parameters and inner optimizer state, the anchor and the " \
      "outer momentum)" in out and ", outer step " in out, out


@pytest.mark.slow  # compiles a circular pipeline; the default run keeps the 1F1B one
def test_circular_pipeline_predicts_its_checkpoint_save():
  """A circular pipeline (mesh.stage=2, pipeline.repeats=2) on the 8 CPU devices: tools.aot's
  report counts the bubble in the compiled step, and the prediction adds the program that turns
  the stage-major state into the checkpoint's plain stack (its output beside the state)."""
  import jax

  stages = {"mesh.stage": 2, "mesh.data": 4, "model.num_layers": 4, "data.micro_batch_size": 4,
            "pipeline.schedule": "circular", "pipeline.repeats": 2}
  cfg = override(load(TINY, []), **stages)
  report, phases = memory_check.predict(cfg, aot.Target("local", jax.devices()), "lm_tiny")
  assert list(phases) == ["train step", "logging step", "evaluation", "checkpoint save"]
  assert report.pipeline["pipeline/ticks"] == 4 * 2 + 2 - 1  # M R + S - 1
  assert report.pipeline["pipeline/bubble"] == pytest.approx(1 / 9)
  assert "bubble 11.1% (1 idle of 9 ticks per stage" in report.pipeline["line"]
  layers = sum(aot.per_device_bytes(leaf) for leaf in jax.tree.leaves(
      report_state(cfg)["params"]["blocks"]))
  assert phases["checkpoint save"] >= report.state_bytes + layers


STAGES = {"mesh.stage": 2, "mesh.data": 4, "model.num_layers": 4, "data.micro_batch_size": 8,
          "model.remat": "full", "pipeline.repeats": 2}


@pytest.mark.slow  # 42 s; the default run keeps memory_check's phases (the first test here) and
# the explicit schedules' compiled loops and stash (tests/test_pipeline_schedule.py)
def test_1f1b_predicts_its_phases_and_stash():
  """Interleaved 1F1B on 2 stages at M = 16 (the 8 CPU devices): tools.memory_check predicts
  its phases (the stage-major layers' checkpoint save included), and tools.aot's report carries
  the schedule table and the stash it holds, (R - 1) S + 2 S - 1 stage inputs."""
  import jax

  cfg = override(load(TINY, []), **STAGES, **{"pipeline.schedule": "1f1b",
                                                "data.global_batch_size": 128})
  report, phases = memory_check.predict(cfg, aot.Target("local", jax.devices()), "lm_tiny")
  assert list(phases) == ["train step", "logging step", "evaluation", "checkpoint save"]
  assert report.pipeline["pipeline/stash"] == 5
  assert report.pipeline["table"][0].startswith("stage 0: F×4 FB×")
  assert all(v > report.state_bytes for v in phases.values()), (phases, report.state_bytes)


@pytest.mark.slow
def test_1f1b_temporaries_do_not_grow_with_the_micro_batches():
  """From M = 8 to 16 the circular schedule's compiled step holds 16 more tick inputs (autodiff
  keeps every tick's), interleaved 1F1B's the same stash: its temporaries stay put."""
  import jax

  target = aot.Target("local", jax.devices())
  temp = {(schedule, m): aot.compile_report(override(load(TINY, []), **STAGES, **{
      "pipeline.schedule": schedule, "data.global_batch_size": 8 * m}), target, "lm_tiny"
      ).temp_bytes for schedule in ("circular", "1f1b") for m in (8, 16)}
  activation = 8 // 4 * 128 * 128 * 4  # one micro-batch's stage input per device (fp32)
  assert temp["circular", 16] - temp["circular", 8] >= 16 * activation, temp
  assert abs(temp["1f1b", 16] - temp["1f1b", 8]) < activation, temp
  assert temp["1f1b", 16] < temp["circular", 16], temp


def report_state(cfg):
  """The abstract train state of `cfg` on the 8 CPU devices, as a dict of its fields."""
  import dataclasses  # noqa: PLC0415

  from trainer.step.program import Program, run_mesh  # noqa: PLC0415
  state = Program(cfg, run_mesh(cfg)).abstract_state()
  return {f.name: getattr(state, f.name) for f in dataclasses.fields(state)}


@pytest.mark.skipif(not aot.libtpu_available(), reason="libtpu is not installed: no TPU "
                    "topology can be described here (pip install -e \".[tpu]\")")
def test_diloco_target_is_tools_aots(monkeypatch):
  """A DiLoCo config is predicted on the devices tools.aot compiles it for: a copy of the TPU
  topology per replica (2 x v5e:2x2 = 8 chips), not one copy."""
  seen = []

  def predict(cfg, target, name):
    seen.append(target)
    raise aot.AotError("stop here")

  monkeypatch.setattr(memory_check, "predict", predict)
  assert memory_check.main(["--config", TINY, "--topology", "v5e:2x2",
                            "--config.optim.diloco.replicas=2"]) == 2
  assert len(seen[0].devices) == 8 and seen[0].slices == 2, seen


def test_diloco_on_a_gpu_topology_splits_its_devices(monkeypatch):
  """h100:HOSTSxGPUS names every device: DiLoCo's replicas split them (one topology, as in
  training), where a TPU topology is copied per replica."""
  from tools import targets  # noqa: PLC0415
  built = []
  monkeypatch.setattr(targets, "gpu_target", lambda topology: built.append(topology) or "gpu")
  monkeypatch.setattr(targets, "tpu_target", lambda topology, slices: (topology, slices))
  cfg = tiny_config(**{"optim.diloco.replicas": 2})
  assert targets.config_target(cfg, "h100:2x8") == "gpu" and built == ["h100:2x8"]
  assert targets.config_target(cfg, "v5e:2x2") == ("v5e:2x2", 2)


def test_measure_needs_devices_that_count_memory(capsys):
  assert memory_check.main(["--config", TINY, "--topology", "local", "--measure",
                            "--config.mesh.data=8"]) == 2
  err = capsys.readouterr().err.strip()
  assert err == ("error: --measure: cpu devices report no memory statistics (memory_stats() is "
                 "None); measure on a GPU or TPU"), err


def test_measuring_diloco_covers_an_outer_step(capsys):
  """The outer step is a predicted phase, so the measuring run must reach one: --steps a
  multiple of optim.diloco.inner_steps, else one line (before any device is asked)."""
  assert memory_check.main(["--config", TINY, "--topology", "local", "--measure",
                            "--config.mesh.data=4", "--config.optim.diloco.replicas=2"]) == 2
  err = capsys.readouterr().err.strip()
  assert err == ("error: --steps 4: a DiLoCo run's outer step (a phase predicted here) runs "
                 "every optim.diloco.inner_steps=32 steps; measure over a multiple of it "
                 "(--steps 32)"), err


def test_measure_records_the_allocator_through_the_run(monkeypatch):
  """The measuring run trains, logs, evaluates and saves as train.py does, and reads the
  allocator before and after each train-step compile, at every logged row and at the end
  (here a counter stands in for a GPU's memory_stats); Program.compile is left as it was."""
  from conftest import tiny_config
  from trainer.step.program import Program
  calls = []
  monkeypatch.setattr(memory_check, "_stats",
                      lambda: calls.append(1) or {"peak_bytes_in_use": 100 * len(calls)})
  compile_before = Program.compile
  peak, timeline = memory_check.measure(tiny_config(**{"eval_sequences": 8}), 4)
  assert Program.compile is compile_before
  names = [name for name, _ in timeline]
  assert names[:2] == ["before compiling the train step (measure_noise=False, logs=False)",
                       "after compiling it"]
  assert "step 2 train row" in names and "step 4 eval row" in names
  assert "before compiling the train step (measure_noise=False, logs=True)" in names, names
  assert names[-1] == "end (checkpoint written)" and peak == 100 * len(calls)


def test_a_measuring_run_that_raises_shows_its_own_error(monkeypatch):
  """An exception inside the measuring run reaches the caller as itself (not as a failure to
  read the run's result), with Program.compile restored."""
  from conftest import tiny_config
  from trainer.run.loop import Run
  from trainer.step.program import Program
  compile_before = Program.compile

  def train(self):
    raise ValueError("the run failed")

  monkeypatch.setattr(Run, "train", train)
  with pytest.raises(ValueError, match="the run failed"):
    memory_check.measure(tiny_config(), 2)
  assert Program.compile is compile_before

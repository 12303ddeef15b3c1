"""Ahead-of-time compile for a TPU topology on this CPU machine (tools/aot.py).

Needs libtpu (the TPU compiler; `pip install -e ".[test]"` brings it on Linux x86-64); without it
the module is skipped with the reason. One compile of the tiny model, shared by the tests, goes
through the TPU attention path (splash attention, a Mosaic kernel); a deliberately oversized
config must fail with the one-line message that names the knob to turn.
"""
import dataclasses
import json
import os

import jax
import numpy as np
import pytest
from jax.sharding import AxisType

from conftest import override
from models.llama import ModelConfig
from models.sizes import flops_per_token
from tools import aot, roofline
from trainer.config import ConfigError
from trainer.config.checks import validate
from trainer.config.cli import load
from trainer.step.program import run_mesh
from trainer.tracking.peaks import known_hbm_bandwidth

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
TINY = os.path.join(ROOT, "configs", "lm_tiny.py")

if not aot.libtpu_available():
  pytest.skip("libtpu is not installed, so nothing can be compiled for TPU here "
              "(pip install -e \".[tpu]\"; its wheels exist for Linux x86-64 only)",
              allow_module_level=True)


# The attention dispatcher (models/attention.py) sends `auto` to splash attention on TPU.
ATTENTION = "auto"


def tiny(**overrides):
  cfg = load(TINY, [])
  cfg.model.attention = ATTENTION
  cfg.mesh.update(data=2, fsdp=2)
  return override(cfg, **overrides)


@pytest.fixture(scope="module")
def target():
  return aot.tpu_target("v5e:2x2")


@pytest.fixture(scope="module")
def report(target):
  return aot.compile_report(tiny(), target, "lm_tiny")


def test_topology_devices(target):
  assert len(target.devices) == 4 and target.platform == "tpu" and target.hosts == 1
  assert "v5 lite" in target.kind
  assert target.hbm_bytes == 16 * 2**30 and target.peak_flops == 197e12
  assert target.hbm_bandwidth == 819e9


def test_tpu_attention_kernel_is_in_the_program(report):
  assert report.attention == "splash"
  assert report.kernel_calls >= 1, "the Mosaic attention kernel must be in the compiled program"


def test_tiny_model_compiles_and_fits(report):
  assert report.mesh["data"] == 2 and report.mesh["fsdp"] == 2
  assert 0 < report.state_bytes <= report.argument_bytes < report.total_bytes < report.hbm_bytes


def test_flops_and_step_time_come_from_the_model(report):
  cfg = tiny()
  tokens = cfg.data.global_batch_size * cfg.data.seq_len
  model_flops = flops_per_token(ModelConfig.from_config(cfg.model), cfg.data.seq_len)["total"]
  assert report.tokens_per_step == tokens
  assert report.model_flops == pytest.approx(model_flops * tokens)
  assert report.roofline.step_seconds == pytest.approx(model_flops * tokens / (4 * 197e12))
  assert report.remat_mfu_bound == 1.0  # lm_tiny recomputes nothing
  row = report.markdown_row()
  assert row.startswith("| lm_tiny | 0.5")
  assert row.split(" | ", 2)[2].startswith("v5e:2x2 (4 x TPU v5 lite) | data=2 fsdp=2 |")
  assert json.loads(json.dumps(report.to_json()))["total_bytes"] == report.total_bytes


def test_roofline_from_the_compiled_cost_analysis(report):
  """compute = executed FLOPs at the bf16 peak; memory = XLA's bytes accessed per chip at the
  HBM bandwidth; the bound is the larger, and the MFU ceiling follows from it."""
  r = report.roofline
  assert r.hbm_bandwidth == 819e9 and r.xla_bytes > report.state_bytes
  assert r.compute_seconds == pytest.approx(r.step_seconds / r.remat_mfu_bound)
  assert r.memory_seconds == pytest.approx(r.xla_bytes / 819e9)
  assert r.seconds == max(r.compute_seconds, r.memory_seconds)
  assert r.mfu == pytest.approx(r.step_seconds / r.seconds)
  # lm_tiny is tiny: its step is bound by memory traffic, not by the MXUs.
  assert r.memory_seconds > r.compute_seconds and r.mfu < 1
  line = r.line()
  assert line in report.lines() and line.startswith("  roofline: compute ")
  assert "(memory-bound), MFU <= " in line and f"{r.mfu:.0%}" in line
  assert r.step_line() in report.lines()
  # A program with (almost) no memory traffic is compute-bound at the remat ceiling.
  light = dataclasses.replace(report, xla_bytes=1.0, remat_mfu_bound=0.75).roofline
  assert light.seconds == light.compute_seconds
  assert light.mfu == pytest.approx(0.75)
  assert "(compute-bound), MFU <= 75%" in light.line()
  unknown = dataclasses.replace(report, hbm_bandwidth=None).roofline
  assert unknown.seconds == unknown.compute_seconds
  assert "memory unknown (no HBM bandwidth known" in unknown.line()
  no_peak = dataclasses.replace(report, peak_flops=None)
  assert no_peak.roofline.seconds is None and no_peak.roofline.step_line() is None
  assert "  roofline: no peak FLOP/s known for TPU v5 lite" in no_peak.lines()
  data = json.loads(json.dumps(report.to_json()))
  assert data["roofline_seconds"] == pytest.approx(r.seconds)
  assert data["roofline_mfu"] == pytest.approx(r.mfu)
  # The estimate scales XLA's bytes by its undercount of the FLOPs it sees (splash attention's
  # run inside the kernel, so they are left out).
  assert r.kernel_flops > 0
  visible = (r.model_flops / r.remat_mfu_bound - r.kernel_flops) / 4
  scale = max(visible / r.xla_flops, 1.0)
  assert r.estimated_bytes == pytest.approx(r.xla_bytes * scale)
  assert report.lines()[-1].startswith(f"  estimate with loop bodies scaled ({scale:.1f}x")
  assert data["estimated_bytes"] == pytest.approx(r.estimated_bytes)


def test_hbm_bandwidth_table():
  assert known_hbm_bandwidth("TPU v5 lite") == 819e9
  assert known_hbm_bandwidth("TPU v5") == 2765e9  # v5p
  assert known_hbm_bandwidth("NVIDIA H100 80GB HBM3") == 3.35e12
  assert known_hbm_bandwidth("NVIDIA H100 PCIe") == 2.0e12
  assert known_hbm_bandwidth("cpu") is None


def test_remat_bound():
  m = ModelConfig(d_model=256, num_layers=4, num_heads=4, num_kv_heads=4, mlp_dim=1024)
  full = roofline.remat_mfu_bound(ModelConfig(**{**m.__dict__, "remat": "full"}), 1024)
  assert roofline.remat_mfu_bound(m, 1024) == 1.0
  assert 0.7 < full < 0.8  # recomputing the blocks' forward: ~3/4 of the FLOPs are the model's


def test_oversized_config_fails_with_the_knob_to_turn(capsys):
  """8192 sequences of 2048 tokens at once: the activations cannot fit 4 x 16 GiB."""
  code = aot.main(["--config", TINY, "--topology", "v5e:2x2",
                   f"--config.model.attention={ATTENTION}",
                   "--config.data.global_batch_size=8192", "--config.data.seq_len=2048"])
  err = capsys.readouterr().err.strip()
  assert code == 2, err
  assert len(err.splitlines()) == 1, err
  assert "lm_tiny does not fit v5e:2x2 (4 x TPU v5 lite, 16 GiB HBM per chip)" in err
  assert "memory" in err.lower()  # the compiler's own words
  assert "model.remat=full (now 'none')" in err
  assert "data.micro_batch_size=4096 (now 8192" in err


@pytest.mark.parametrize("args,needle", [
    (["--topology", "v5e-8"], "--topology 'v5e-8': expected CHIP:AxB[xC]"),
    (["--topology", "v5e:2x2", "--config.mesh.data=3"], "has 3 devices but 4 are available"),
    (["--topology", "v5e:2x2", "--config.mesh.dcn_data=2", "--config.mesh.data=8"],
     "lm_tiny on 2x v5e:2x2: mesh (data=8) has 8 devices but each of the 2 slices has 4"),
    (["--topology", "v5e:2x2", "--config.mesh.dcn_data=-1"],
     "an ahead-of-time compile has no slices to count"),
    (["--topology", "v5e:2x2", "--slices", "2"], "unknown argument '--slices'"),
])
def test_user_errors_are_one_line_exit_2(args, needle, capsys):
  code = aot.main(["--config", TINY, *args])
  err = capsys.readouterr().err.strip()
  assert code == 2 and needle in err and len(err.splitlines()) == 1, err


@pytest.fixture(scope="module")
def two_slices():
  return aot.tpu_target("v5e:2x2", slices=2)


def test_aot_and_training_build_the_same_multi_slice_mesh(two_slices, monkeypatch):
  """Two v5e:2x2 slices, data across them (mesh.dcn_data=2) and data=2 x fsdp=2 inside each:
  the mesh tools.aot compiles on is the one training builds on those devices, and only the
  data axis leaves a slice."""
  cfg = tiny(**{"mesh.dcn_data": 2})
  assert aot.config_slices(cfg.mesh) == 2 and two_slices.slices == 2
  sizes, aot_mesh = aot.target_mesh(cfg, two_slices, "lm_tiny")
  # Training on these devices: train.py validates against jax.devices(), trainer.run.loop.Run
  # builds `run_mesh(cfg)` (`make_mesh(cfg.mesh)`) over them.
  monkeypatch.setattr(jax, "devices", lambda *a, **k: list(two_slices.devices))
  assert validate(cfg, jax.devices()) == sizes
  train_mesh = run_mesh(cfg)
  ids = lambda mesh: np.vectorize(lambda d: d.id)(mesh.devices)
  np.testing.assert_array_equal(ids(aot_mesh), ids(train_mesh))
  assert dict(train_mesh.shape) == {"stage": 1, "data": 4, "fsdp": 2, "tensor": 1,
                                    "sequence": 1, "expert": 1} == sizes
  assert set(train_mesh.axis_types) == {AxisType.Auto}
  slice_of = np.vectorize(lambda d: d.slice_index)(train_mesh.devices).reshape(4, 2)  # data x fsdp
  assert (slice_of[:2] == 0).all() and (slice_of[2:] == 1).all()  # fsdp stays inside a slice


def test_slices_the_devices_report_must_match_the_config(two_slices):
  with pytest.raises(ConfigError, match=r"has 1 slice\(s\) but the devices form 2"):
    validate(tiny(), two_slices.devices)


@pytest.mark.slow
def test_multi_slice_compiles_from_the_config_keys(tmp_path, capsys):
  out = tmp_path / "report.json"
  code = aot.main(["--config", TINY, "--topology", "v5e:2x2",
                   f"--config.model.attention={ATTENTION}", "--config.mesh.dcn_data=2", "--config.mesh.data=1", "--config.mesh.fsdp=4",
                   "--json", str(out)])
  assert code == 0, capsys.readouterr().err
  report = json.loads(out.read_text())
  assert report["chips"] == 8 and report["hosts"] == 2 and report["topology"] == "2x v5e:2x2"
  assert report["mesh"]["data"] == 2 and report["mesh"]["fsdp"] == 4
  assert report["kernel_calls"] >= 1


@pytest.mark.slow
@pytest.mark.parametrize("config,topology", [
    ("lm_125m", "v5e:2x2"), ("lm_1b", "v5e:4x4"), ("lm_1b_32k", "v5e:4x4"), ("lm_8b", "v5:2x2x4"),
])
def test_shipped_configs_fit_their_documented_topologies(config, topology):
  cfg = load(os.path.join(ROOT, "configs", f"{config}.py"), [])
  report = aot.compile_report(cfg, aot.tpu_target(topology), config)
  assert report.total_bytes < report.hbm_bytes


@pytest.mark.slow
def test_diloco_replicas_are_slices_and_only_the_outer_step_crosses_them(two_slices):
  """DiLoCo with M = 2 on two v5e:2x2 slices: each replica is one whole slice, and compiled for
  TPU the inner step sends nothing between slices while the outer step reduces the parameters
  across them (Megascale host transfers) and plain data parallelism on the same chips does
  so at every step."""
  cfg = tiny(**{"optim.diloco.replicas": 2, "optim.diloco.inner_steps": 4, "eval_every": 0,
                "steps": 8})
  _, mesh = aot.target_mesh(cfg, two_slices, "lm_tiny")
  slices = np.vectorize(lambda d: d.slice_index)(mesh.devices)
  assert mesh.axis_names[0] == "replica" and (slices[0] == 0).all() and (slices[1] == 1).all()
  report = aot.compile_report(cfg, two_slices, "lm_tiny")
  inner, dp = report.communication
  assert "inner step 0 B (no collective joins two replicas)" in inner
  assert "outer step 0 B" not in inner and " 0 B per step" not in dp, report.communication


@pytest.mark.slow
def test_pipeline_bubble_bench_counts_each_compiled_program(tmp_path, capsys):
  """bench/pipeline_bubble.py on the tiny model, 2 stages on v5e:2x2: every GPipe and circular
  program's counted ticks are M R + S - 1 and its bubble the formula, 1F1B's (residuals kept)
  and zero bubble's ticks and stash their table's, zero bubble's bubble below the formula; the programs without stages are the
  reference rows; the roofline gives each a step time."""
  import csv  # noqa: PLC0415

  from conftest import bench_module  # noqa: PLC0415
  from sharding.schedule import build  # noqa: PLC0415
  out = tmp_path / "pipeline.csv"
  assert bench_module("pipeline_bubble").main([
      "--config", TINY, "--topology", "v5e:2x2", "--stages", "2", "--micro", "2,4",
      "--schedules", "gpipe,circular,1f1b_residuals,zero_bubble", "--repeats", "1,2",
      "--config.data.micro_batch_size=8", "--config.model.num_layers=4", "--jobs", "2",
      "--csv", str(out)]) == 0
  rows = list(csv.DictReader(open(out)))
  assert [(r["schedule"], r["repeats"], r["micro"]) for r in rows] == [
      ("gpipe", "1", "2"), ("gpipe", "1", "4"), ("circular", "2", "2"), ("circular", "2", "4"),
      ("1f1b_residuals", "1", "2"), ("1f1b_residuals", "1", "4"), ("1f1b_residuals", "2", "2"),
      ("1f1b_residuals", "2", "4"), ("zero_bubble", "1", "2"), ("zero_bubble", "1", "4"), ("zero_bubble", "2", "2"),
      ("zero_bubble", "2", "4"), ("none", "1", "2"), ("none", "1", "4")]
  for r in rows:
    assert r["fits"] == "True" and float(r["step_ms"]) > 0
    if r["schedule"] in ("gpipe", "circular"):
      assert int(r["ticks"]) == int(r["micro"]) * int(r["repeats"]) + 1
      assert float(r["bubble"]) == pytest.approx(float(r["bubble_formula"]))
    elif r["schedule"] != "none":  # their table's ticks and stash; zero bubble's W fills some
      schedule = "1f1b" if r["schedule"] == "1f1b_residuals" else r["schedule"]
      table = build(schedule, 2, int(r["repeats"]), int(r["micro"]))
      assert int(r["ticks"]) == table.ticks and int(r["stash"]) == table.held("F", "B").max()
      if schedule == "1f1b":  # its idle slots are F and B in the proportion of its busy ones
        assert float(r["bubble"]) == pytest.approx(float(r["bubble_formula"]))
      else:
        assert 0 < float(r["bubble"]) < float(r["bubble_formula"])
  assert "| circular | 2 | 4 | 32 | 9 | 1 | 11.1% | 11.1% |" in capsys.readouterr().out

"""Run policies, in process: non-finite and spike guards, wall-time saves, config mismatches,
warm starts from another run."""
import jax
import jax.numpy as jnp
import numpy as np
import pytest

from conftest import metric_rows, tiny_config
from trainer.checkpoint.persistent import Checkpointer
from trainer.checkpoint.saved import CheckpointError
from trainer.run.loop import Run
from trainer.step.state import init_guard
from trainer.step.train_step import GuardConfig, _judge


def _run(workdir, **overrides):
  return Run(tiny_config(**overrides), str(workdir)).train()


def test_nan_skip_policy_drops_the_update(tmp_path):
  result = _run(tmp_path, **{"steps": 6, "trainer.debug_nan_at_step": 3})
  assert result.status == "done" and result.exit_code == 0
  rows = metric_rows(tmp_path)
  assert rows[3]["skipped"] == 1 and rows[3]["nonfinite"] == 1 and not np.isfinite(rows[3]["loss"])
  assert rows[3]["param_norm"] == rows[2]["param_norm"], "the bad update must not be applied"
  assert rows[4]["learning_rate"] < rows[3]["learning_rate"], "one clock: step 3 used its slot"
  assert all(np.isfinite(rows[s]["loss"]) and rows[s]["skipped"] == 0 for s in (4, 5, 6))


NORMS = {"param_norm", "update_norm"}


def test_norm_metrics_on_log_steps_every_step_or_off(tmp_path):
  """trainer.norm_metrics: "log_steps" (the default) runs a second compiled step on the steps
  that log, and their rows carry the same norms as a run that computes them on every step;
  the other steps' program leaves them out. "off": the same training without the two norms."""
  runs, rows = {}, {}
  for mode in ("every_step", "log_steps", "off"):
    runs[mode] = Run(tiny_config(**{"steps": 6, "log_every": 3, "trainer.norm_metrics": mode}),
                     str(tmp_path / mode))
    assert runs[mode].train().status == "done"
    rows[mode] = metric_rows(tmp_path / mode)
  assert {m: sorted(r) for m, r in rows.items()} == {m: [3, 6] for m in rows}
  assert {m: run.steps.count for m, run in runs.items()} == {
      "every_step": 1, "log_steps": 2, "off": 1}
  for step in (3, 6):
    for key in ("loss", "grad_norm", "skipped"):
      assert rows["log_steps"][step][key] == rows["every_step"][step][key] \
          == rows["off"][step][key], (step, key)
    for key in NORMS:
      assert rows["log_steps"][step][key] == pytest.approx(rows["every_step"][step][key],
                                                            rel=1e-6), (step, key)
    assert not NORMS & set(rows["off"][step]), rows["off"][step]
  # the program of the steps that do not log computes no norms; the log steps' one does
  outputs = {norms: set(step.out_info[1]) for (_, _, norms), step
             in runs["log_steps"].steps.compiled.items()}
  assert NORMS <= outputs[True] and not NORMS & outputs[False], outputs
  assert tiny_config().trainer.norm_metrics == "log_steps"


def test_nan_stop_policy_keeps_the_last_good_checkpoint(tmp_path):
  result = _run(tmp_path, **{"steps": 8, "checkpoint.every_steps": 2,
                             "trainer.debug_nan_at_step": 5, "trainer.nonfinite_policy": "stop"})
  assert result.status == "nonfinite" and result.exit_code == 3
  assert "non-finite loss/gradient at step 5" in result.message
  assert "newest checkpoint: step 4" in result.message
  assert Checkpointer(str(tmp_path / "checkpoints"), keep=3).all_steps() == [2, 4]


def test_spike_detector_flags_only_spikes():
  cfg = GuardConfig(spike_zscore=4.0, spike_window=20)
  judge = jax.jit(lambda g, loss: _judge(g, loss, jnp.float32(1.0), cfg))
  guard = init_guard()
  rng = np.random.default_rng(0)
  flags = []
  for loss in list(3.0 + 0.05 * rng.standard_normal(60)) + [4.0, 3.0, float("nan"), 3.01]:
    bad, finite, spike, guard = judge(guard, jnp.float32(loss))
    flags.append((bool(bad), bool(spike), bool(finite)))
  assert not any(b for b, _, _ in flags[:60]), "no false alarms on noise"
  assert flags[60] == (True, True, True)  # 4.0 is ~20 sigma above the mean
  assert flags[61] == (False, False, True)
  assert flags[62] == (True, False, False)  # NaN: bad, not a spike
  assert not flags[63][0]
  assert int(guard["skipped"]) == 2 and int(guard["good_steps"]) == 62


def test_every_seconds_policy_saves_by_wall_time(tmp_path):
  _run(tmp_path, **{"steps": 6, "checkpoint.every_steps": 0,
                    "checkpoint.every_seconds": 1e-6})
  assert Checkpointer(str(tmp_path / "checkpoints"), keep=3).all_steps() == [4, 5, 6]


def test_mismatched_config_is_refused(tmp_path):
  _run(tmp_path, **{"steps": 2, "checkpoint.every_steps": 2})
  with pytest.raises(CheckpointError, match="written with optim.name='adamw', the config has"):
    _run(tmp_path, **{"steps": 4, "optim.name": "lamb"})
  with pytest.raises(CheckpointError, match="model.d_model=32, the config has 64"):
    _run(tmp_path, **{"steps": 4, "model.d_model": 64})
  # Same shapes, another function: an SP checkpoint does not resume as muP.
  with pytest.raises(CheckpointError, match="model.parametrization='sp', the config has 'mup' "
                                            r"\(its config: --config.model.parametrization=sp\)"):
    _run(tmp_path, **{"steps": 4, "model.parametrization": "mup", "model.base_width": 16})
  # Run length, logging, checkpoint intervals and the learning rate may change, and muP at its
  # base width (SP exactly; models/config.py compares what the weights compute).
  result = _run(tmp_path, **{"steps": 4, "log_every": 2, "checkpoint.every_steps": 1,
                             "optim.learning_rate": 5e-3, "model.parametrization": "mup"})
  assert result.status == "done" and result.step == 4
  # The global batch and the micro-batch are not part of what a checkpoint fixes: the data
  # order continues at the windows consumed (data/pipeline.py), as a batch ramp does.
  # The schedule's clock keeps the batch history (trainer/checkpoint/elastic.py; tests/test_local_tier.py).
  run = Run(tiny_config(**{"steps": 6, "data.global_batch_size": 16,
                           "data.micro_batch_size": 8, "model.parametrization": "mup"}),
            str(tmp_path))
  result = run.train()
  assert result.status == "done" and result.step == 6
  assert run.ramp.stages_by_step() == [(0, 8), (4, 16)]


def test_init_from_loads_parameters_only(tmp_path):
  source = tmp_path / "source"
  _run(source, **{"steps": 4, "checkpoint.every_steps": 4})
  saved = Run(tiny_config(), str(source))
  saved.checkpointer = Checkpointer(str(source / "checkpoints"), keep=3)
  want, _, _, _ = saved._start()
  warm = Run(tiny_config(**{"checkpoint.init_from": str(source)}), str(tmp_path / "warm"))
  warm.checkpointer = Checkpointer(str(tmp_path / "warm" / "checkpoints"), keep=3)
  state, _, resumed, _ = warm._start()
  assert resumed is None and int(state.step) == 0
  jax.tree.map(np.testing.assert_array_equal, jax.device_get(state.params),
               jax.device_get(want.params))
  assert not np.any(jax.device_get(state.opt_state[1][0].mu["embed_VE"])), "fresh optimizer"
  with pytest.raises(CheckpointError, match="model.d_model=32, the config has 64"):
    Run(tiny_config(**{"checkpoint.init_from": str(source), "model.d_model": 64}),
        str(tmp_path / "bad")).train()
  # Same shapes, another model: named with the override that fixes it.
  with pytest.raises(CheckpointError, match="run with --config.model.rope_theta=10000.0"):
    Run(tiny_config(**{"checkpoint.init_from": str(source), "model.rope_theta": 5e5}),
        str(tmp_path / "rope")).train()
  with pytest.raises(CheckpointError, match="model.parametrization='sp', the config has 'mup'; "
                     "run with --config.model.parametrization=sp$"):
    Run(tiny_config(**{"checkpoint.init_from": str(source), "model.parametrization": "mup",
                       "model.base_width": 16}), str(tmp_path / "mup")).train()

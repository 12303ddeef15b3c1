"""Damaged bytes are caught in both tiers and a non-finite state is never saved: checksums taken
at save, verified before a restore accepts a step (trainer/checkpoint/integrity.py).

Each test damages files the way the issue's reproduction did (4 KiB inverted inside an array
file) and checks the one line, the fallback and the losses against an undamaged run.
"""
import glob
import json
import os
import pathlib
import shutil

import jax.numpy as jnp
import pytest

from conftest import losses, tiny_config
from trainer.checkpoint import integrity
from trainer.checkpoint.persistent import Checkpointer
from trainer.run.loop import Run
from trainer.run.readback import MetricsWindow


def invert(path, size=4096):
  """Invert `size` bytes in the middle of a file (a damage that still decodes)."""
  data = bytearray(open(path, "rb").read())
  start = max(len(data) // 2 - size // 2, 0)
  data[start:start + size] = bytes(b ^ 0xFF for b in data[start:start + size])
  open(path, "wb").write(bytes(data))


def largest_file(directory):
  files = [p for p in glob.glob(os.path.join(directory, "**"), recursive=True)
           if os.path.isfile(p) and not p.endswith(integrity.SUMS)]
  return max(files, key=os.path.getsize)


def local_step_dir(root, step):
  return glob.glob(os.path.join(root, "**", "process_0", str(step)), recursive=True)[0]


@pytest.fixture(scope="module")
def straight_run(tmp_path_factory):
  """The workdir of an undamaged 6-step run saving persistently every 3 steps (read only: copy
  it to damage it)."""
  workdir = tmp_path_factory.mktemp("straight")
  assert Run(tiny_config(**{"checkpoint.every_steps": 3}), str(workdir)).train().status == "done"
  return workdir


@pytest.fixture(scope="module")
def straight(straight_run):
  """Losses of that run."""
  return losses(straight_run)


def test_a_damaged_persistent_checkpoint_is_set_aside_and_the_previous_one_restored(
    straight, tmp_path, capsys):
  cfg = tiny_config(**{"checkpoint.every_steps": 2, "steps": 4})
  workdir = tmp_path / "w"
  assert Run(cfg, str(workdir)).train().status == "done"
  victim = largest_file(workdir / "checkpoints" / "4" / "state")
  invert(victim)
  capsys.readouterr()
  cfg.steps = 6
  assert Run(cfg, str(workdir)).train().status == "done"
  out = capsys.readouterr().out
  damaged = [l for l in out.splitlines() if "is damaged" in l]
  assert len(damaged) == 1 and "checkpoints/4 is damaged (state/" in damaged[0] \
      and "does not match its checksum" in damaged[0], out
  assert "resumed from" in out and out.split("resumed from")[1].split()[0].endswith("/2"), out
  assert len(glob.glob(str(workdir / "checkpoints.unreadable" / "4-*"))) == 1
  got = losses(workdir)
  assert [got[s] for s in range(3, 7)] == [straight[s] for s in range(3, 7)]


def test_a_damaged_local_step_falls_back_and_nan_is_never_trained_on(straight, tmp_path, capsys):
  """The issue's reproduction: 4 KiB inverted inside the data file of the newest local step.
  It is named in one line and not restored; the run resumes from the previous local step and
  ends on the undamaged run's losses (no NaN step, no checkpoint written from a damaged state)."""
  root, workdir = tmp_path / "local", tmp_path / "w"
  cfg = tiny_config(**{"checkpoint.every_steps": 3, "checkpoint.local_dir": str(root),
                       "checkpoint.local_every_steps": 1, "checkpoint.local_keep": 2})
  assert Run(cfg, str(workdir)).train().status == "done"
  shutil.rmtree(workdir / "checkpoints" / "6")  # killed before the final save: local 5 is newest
  invert(largest_file(os.path.join(local_step_dir(root, 5), "state")))
  capsys.readouterr()
  assert Run(cfg, str(workdir)).train().status == "done"
  out = capsys.readouterr().out
  lines = [l for l in out.splitlines() if "local checkpoint 5" in l]
  assert len(lines) == 1 and "process_0/state is damaged" in lines[0] and \
      "does not match its checksum" in lines[0], out
  assert "resumed from" in out and "/4 " in out.split("resumed from")[1].splitlines()[0], out
  got = losses(workdir)
  assert [got[s] for s in range(5, 7)] == [straight[s] for s in range(5, 7)]


def test_a_state_with_nan_is_never_saved(tmp_path):
  """A NaN anywhere in the parameters or optimizer state: the save fails in its background
  commit (every process alike), nothing is committed, earlier steps stay."""
  ckpt = Checkpointer(str(tmp_path / "c"), keep=3)
  from data import pipeline  # noqa: PLC0415
  from data.prepare import ensure_default_corpus  # noqa: PLC0415
  spec = pipeline.StreamSpec(ensure_default_corpus(), "train", 32, 2, prefetch=0)
  it = iter(pipeline.dataset(spec))
  good = {"params": {"w": jnp.ones((8, 8))}}
  ckpt.save(1, good, it, spec, {})
  ckpt.wait()
  bad = {"params": {"w": jnp.ones((8, 8)).at[3, 3].set(jnp.nan)}}
  ckpt.save(2, bad, it, spec, {})
  with pytest.raises(integrity.NonFiniteState, match="NaN or inf"):
    ckpt.wait()
  assert ckpt.all_steps() == [1]
  ckpt.close()


# computed: the save's own reduction in a run (slow; the default run keeps its mechanism in
# test_a_state_with_nan_is_never_saved and the run path in read_back)
@pytest.mark.parametrize("flag", ["read_back", pytest.param("computed", marks=pytest.mark.slow)])
def test_a_run_whose_state_turns_non_finite_stops_without_saving_it(tmp_path, monkeypatch,
                                                                     capsys, flag):
  """The parameters after step 4 are NaN (as a parameter overflowed to inf or a flipped bit in
  memory would), known either way a save learns it: `read_back`, step 4's param_norm as the
  loop read it back (every step logs its norms: no save computes anything); `computed`, the
  save's own reduction (`trainer.norm_metrics=never`). Nothing of step 4 is written, the
  failure is found once its write ended, and the run stops with status nonfinite (exit 3),
  naming the last good checkpoint."""
  real, calls = integrity.all_finite, []

  def finite_until_step_4(tree):
    calls.append(1)
    return real(tree) & (len(calls) != 2)  # the second save: step 4

  monkeypatch.setattr(integrity, "all_finite", finite_until_step_4)
  overrides = {"checkpoint.every_steps": 2, "steps": 8}
  if flag == "read_back":
    read = MetricsWindow.read

    def nan_norm_at_4(self, upto=None):
      rows = read(self, upto)
      for step, host, _ in rows:
        if step == 4:
          host["param_norm"] = float("nan")
      return rows

    monkeypatch.setattr(MetricsWindow, "read", nan_norm_at_4)
  else:
    overrides["trainer.norm_metrics"] = "never"
  result = Run(tiny_config(**overrides), str(tmp_path)).train()
  err = capsys.readouterr().err
  assert len(calls) == (0 if flag == "read_back" else 2), calls
  # Found at the first log step after the write ended (5), or by the save at 6 waiting for it.
  assert (result.status, result.exit_code) == ("nonfinite", 3) and result.step in (5, 6), result
  assert result.message == ("stopped: the parameters at step 4 are not finite, so they were not "
                            "saved; the newest checkpoint (2) is the last good state")
  assert "checkpoint save at step 4 failed (the state holds NaN or inf in its parameters; it is " \
         "not saved)" in err, err
  assert Checkpointer(str(tmp_path / "checkpoints"), keep=3).all_steps() == [2]


def test_checksums_name_the_file_and_skip_items_written_without_them(tmp_path):
  item = tmp_path / "item"
  (item / "d").mkdir(parents=True)
  (item / "d" / "a").write_bytes(b"x" * 10000)
  (item / "b").write_bytes(b"y" * 10)
  assert integrity.write_checksums(str(item)) == 10010
  assert integrity.verify_item(str(item)) is None
  invert(str(item / "d" / "a"), 16)
  assert integrity.verify_item(str(item)).startswith("d/a does not match its checksum")
  # Each process reads its share (round robin over b, d/a): the damaged file is process 1's.
  assert integrity.verify_item(str(item), (0, 2)) is None
  assert integrity.verify_item(str(item), (1, 2)).startswith("d/a")
  (item / "b").write_bytes(b"y")
  assert integrity.verify_item(str(item)) == "b has 1 bytes, 10 were written"
  os.remove(item / integrity.SUMS)
  assert integrity.verify_item(str(item)) is None  # written before checksums existed


# --- a local step belongs to its run -----------------------------------------------------------


@pytest.mark.slow  # the default run keeps the run identity test below
def test_a_local_dir_shared_by_two_runs_restores_each_only_its_own(tmp_path, capsys):
  """The issue's reproduction: run A leaves local steps; a fresh run B (another seed and rate)
  pointed at the same local_dir must not resume from them (one line names A's steps, B starts
  clean), and A resumed afterwards must not take B's newer local step. Both end on the losses
  of their own uninterrupted runs."""
  root = str(tmp_path / "local")
  local = {"checkpoint.local_dir": root, "checkpoint.local_every_steps": 1,
           "checkpoint.every_steps": 3}
  a = lambda **k: tiny_config(**{"seed": 7, **local, **k})
  b = lambda **k: tiny_config(**{"seed": 0, "optim.learning_rate": 3e-3, **local, **k})
  straight = {}
  for name, cfg in (("a", a(steps=8)), ("b", b(steps=8))):
    cfg.checkpoint.local_dir, cfg.checkpoint.local_every_steps = "", 0
    assert Run(cfg, str(tmp_path / f"straight_{name}")).train().status == "done"
    straight[name] = losses(tmp_path / f"straight_{name}")
  assert Run(a(steps=6), str(tmp_path / "a")).train().status == "done"
  shutil.rmtree(tmp_path / "a" / "checkpoints" / "6")  # killed before its final save
  capsys.readouterr()
  assert Run(b(steps=8), str(tmp_path / "b")).train().status == "done"
  out = capsys.readouterr().out
  other = [l for l in out.splitlines() if "also holds local checkpoints of run" in l]
  assert len(other) == 1 and f"of {tmp_path / 'a'} (steps 4, 5)" in other[0] \
      and "never restored here and left untouched" in other[0], out
  assert "resumed from" not in out, out
  assert losses(tmp_path / "b") == straight["b"]
  capsys.readouterr()
  assert Run(a(steps=8), str(tmp_path / "a")).train().status == "done"  # b's local 7 is newer
  out = capsys.readouterr().out
  assert "resumed from" in out and "/5 " in out.split("resumed from")[1].splitlines()[0], out
  got = losses(tmp_path / "a")
  assert [got[s] for s in range(1, 9)] == [straight["a"][s] for s in range(1, 9)]


def test_the_run_identity_is_kept_in_the_workdir_and_every_checkpoint(tmp_path, capsys):
  from trainer.checkpoint import identity  # noqa: PLC0415
  cfg = tiny_config(**{"steps": 2, "checkpoint.every_steps": 1})
  # what a save interrupted by a double Ctrl-C leaves: removed (under the workdir's lock)
  interrupted = tmp_path / "w" / "checkpoints" / "7.orbax-checkpoint-tmp" / "state"
  interrupted.mkdir(parents=True)
  (interrupted / "x").write_bytes(b"partial")
  assert Run(cfg, str(tmp_path / "w")).train().status == "done"
  assert sorted(os.listdir(tmp_path / "w" / "checkpoints")) == ["1", "2"]
  assert (f"removed {interrupted.parent}, left by a save that was interrupted before it "
          "completed") in capsys.readouterr().out
  kept = identity.read_identity(str(tmp_path / "w"))
  assert kept["workdir"] == str(tmp_path / "w") and len(kept["id"]) == 12
  for step in (1, 2):
    saved = json.load(open(tmp_path / "w" / "checkpoints" / str(step) / "run" / "metadata"))
    assert saved == kept
  assert identity.run_identity(str(tmp_path / "w")) == (kept, None)
  os.symlink(tmp_path / "w", tmp_path / "link")  # the same workdir through a symlink: same run
  assert identity.run_identity(str(tmp_path / "link")) == (kept, None)
  # A step of this version (it has the run item) must have its sums: a missing one is damage.
  os.remove(tmp_path / "w" / "checkpoints" / "2" / "config" / integrity.SUMS)
  ckpt = Checkpointer(str(tmp_path / "w" / "checkpoints"), keep=3)
  assert ckpt.verify(2) == f"config/{integrity.SUMS} is missing (the step was written with " \
      "checksums)"
  ckpt.close()
  # A copied workdir is another run: a new identity, said in one line.
  shutil.copytree(tmp_path / "w", tmp_path / "copy")
  new, note = identity.run_identity(str(tmp_path / "copy"))
  assert new["id"] != kept["id"] and new["workdir"] == str(tmp_path / "copy")
  assert note == (f"{tmp_path / 'copy'}/run.json names run {kept['id']} of {tmp_path / 'w'} "
                  "(a copied or moved workdir): this is a new run")


def test_local_copies_without_checksums_or_with_a_truncated_state_are_named_in_one_line_each(
    straight, tmp_path, capsys):
  """Every local copy has its sums (they came before run identities, and so before this
  layout): a copy without them is refused (it was restored unverified as "an earlier
  version's"), a truncated state is named by its size, and the run resumes from the persistent
  step on the undamaged run's losses."""
  root, workdir = tmp_path / "local", tmp_path / "w"
  cfg = tiny_config(**{"checkpoint.every_steps": 3, "checkpoint.local_dir": str(root),
                       "checkpoint.local_every_steps": 1, "checkpoint.local_keep": 2})
  assert Run(cfg, str(workdir)).train().status == "done"
  shutil.rmtree(workdir / "checkpoints" / "6")
  for sums in glob.glob(os.path.join(local_step_dir(root, 5), "**", integrity.SUMS),
                        recursive=True):
    os.remove(sums)
  state = largest_file(os.path.join(local_step_dir(root, 4), "state"))
  open(state, "r+b").truncate(os.path.getsize(state) // 2)
  capsys.readouterr()
  assert Run(cfg, str(workdir)).train().status == "done"
  out = capsys.readouterr().out
  five = [l for l in out.splitlines() if "local checkpoint 5" in l]
  assert len(five) == 1 and "process_0/5/meta is damaged (checksums.json is missing (the step " \
      "was written with checksums))" in five[0], out
  four = [l for l in out.splitlines() if "local checkpoint 4" in l]
  assert len(four) == 1 and "process_0/state is damaged (" in four[0] and \
      " bytes, " in four[0] and "TensorStore" not in four[0], out
  assert out.split("resumed from")[1].split()[0].endswith("checkpoints/3"), out
  got = losses(workdir)
  assert [got[s] for s in range(4, 7)] == [straight[s] for s in range(4, 7)]


# --- reads outside a resume: warm starts and the tools --------------------------------------


def test_a_warm_start_and_the_tools_read_only_verified_finite_steps(straight_run, tmp_path,
                                                                      capsys):
  """The issue's reproduction: 4 KiB inverted in the newest step of a run, then a warm start
  (`checkpoint.init_from`) and the tools' `restore_params` from it. Both fall back to the
  previous step with the resume's one line; a damaged step named alone, or weights with NaN
  whose sums are right (a converted dir), are refused in one line: never NaN loaded."""
  import jax
  import numpy as np
  from sharding.mesh import make_mesh
  from trainer.checkpoint.model_dirs import load_params, restore_params, write_converted
  from trainer.checkpoint.saved import CheckpointError
  from trainer.config import default_config

  source = tmp_path / "source"
  shutil.copytree(straight_run / "checkpoints", source / "checkpoints")
  invert(largest_file(source / "checkpoints" / "6" / "state"))
  capsys.readouterr()
  warm = tmp_path / "warm"
  cfg = tiny_config(**{"steps": 1, "checkpoint.init_from": str(source)})
  run = Run(cfg, str(warm))
  assert run.train().status == "done"
  out = capsys.readouterr().out
  damaged = [l for l in out.splitlines() if "is damaged" in l]
  assert damaged == [f"checkpoint {source}/checkpoints/6 is damaged (state/"
                     + damaged[0].split("(state/")[1]] and damaged[0].endswith(
                         "; trying the previous one") and "does not match its checksum" in \
      damaged[0], out
  assert f"initialised parameters from {source}/checkpoints/3 " in out, out

  mesh = make_mesh(default_config().mesh, jax.devices()[:1])
  lines = []
  spec, params, _, _ = restore_params(str(source), mesh, log=lines.append)
  assert len(lines) == 1 and lines[0].startswith(f"checkpoint {source}/checkpoints/6 is damaged")
  want, _ = load_params(str(source / "checkpoints" / "3"), spec.abstract_params)
  jax.tree.map(np.testing.assert_array_equal, params, want)
  with pytest.raises(CheckpointError) as e:  # one step named: nothing to fall back to
    restore_params(str(source / "checkpoints" / "6"), mesh)
  assert "checkpoints/6 is damaged (state/" in str(e.value) and \
      str(e.value).endswith("nothing was loaded") and "\n" not in str(e.value)

  nan = jax.tree.map(lambda x: np.full(x.shape, np.nan, x.dtype), want)
  write_converted(str(tmp_path / "nan"), nan, spec.cfg, source="test")
  with pytest.raises(CheckpointError, match=r"is unreadable \(it holds NaN or inf \(its "
                                            r"parameters hold NaN or inf\)\); nothing was loaded"):
    load_params(str(tmp_path / "nan"), spec.abstract_params)


def test_processes_restore_only_steps_every_one_lists_and_verify_the_same_step(tmp_path,
                                                                                monkeypatch):
  """Two processes, one of which does not list step 6 yet (an NFS or FUSE listing cache): the
  restore iterates their intersection; the checksum agreement carries the step, and processes
  verifying different steps (a restore mixing two steps) is a bug raised at once."""
  import jax  # noqa: PLC0415
  from trainer.checkpoint import persistent  # noqa: PLC0415
  ckpt = Checkpointer(str(tmp_path / "c"), keep=5)
  for step in (2, 4, 6):
    (tmp_path / "c" / str(step)).mkdir(parents=True)
  ckpt.manager.reload()
  assert ckpt.all_steps() == [2, 4, 6]
  sent = []

  def exchange(payload, timeout_s):  # process 1 lists steps 2 and 4, and verifies `other`
    sent.append(payload)
    if "steps" in payload:
      return [payload, {"steps": [2, 4]}]
    return [payload, {"problem": None, "step": other}]

  monkeypatch.setattr(jax, "process_count", lambda: 2)
  monkeypatch.setattr(persistent, "exchange", exchange)
  monkeypatch.setattr(integrity, "exchange", exchange)
  assert ckpt.agreed_steps() == [2, 4]
  other = 4
  assert ckpt.verify(4) is None and sent[-1] == {"problem": None, "step": 4}
  other = 6
  with pytest.raises(AssertionError, match=r"processes verify different checkpoint steps \[4, 6\]"):
    ckpt.verify(4)
  monkeypatch.undo()
  ckpt.close()

"""Training you can trust through crashes: real processes, real signals, real broken files.

Every test compares against an uninterrupted run of the same command: the losses of the steps
after the interruption must be identical (bit for bit on CPU fp32, same mesh) or, on a
different mesh, equal up to fp32 reduction order.
"""
import glob
import os
import shutil
import signal
import subprocess
import sys
import time

import numpy as np
import pytest

from conftest import CACHE_DIR, losses

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))

# A very small model so that every process is quick; state is saved every 2 steps.
TINY = ["--config.model.d_model=32", "--config.model.mlp_dim=64", "--config.data.seq_len=32",
        "--config.data.global_batch_size=8", "--config.log_every=1", "--config.eval_every=0",
        "--config.optim.decay_steps=40", "--config.checkpoint.every_steps=2",
        f"--config.trainer.compile_cache_dir={CACHE_DIR}", "--config.trainer.progress_bar=false",
        "--config.trainer.peak_flops_per_device=1e9"]


def _cmd(workdir, steps, extra=()):
  return [sys.executable, "train.py", "--config", "configs/lm_tiny.py", "--workdir",
          str(workdir), f"--config.steps={steps}", *TINY, *extra]


def _env(devices=8):
  env = dict(os.environ)
  flags = [f for f in env.get("XLA_FLAGS", "").split() if "device_count" not in f]
  env["XLA_FLAGS"] = " ".join(flags + [f"--xla_force_host_platform_device_count={devices}"])
  return env


def train(workdir, steps, *extra, devices=8, expect=0):
  proc = subprocess.run(_cmd(workdir, steps, extra), cwd=ROOT, capture_output=True, text=True,
                        timeout=300, env=_env(devices))
  assert proc.returncode == expect, (proc.returncode, proc.stdout[-3000:], proc.stderr[-3000:])
  return proc


def start(workdir, steps, *extra):
  return subprocess.Popen(_cmd(workdir, steps, extra), cwd=ROOT, stdout=subprocess.PIPE,
                          stderr=subprocess.STDOUT, text=True, env=_env())


def wait_for_line(proc, needle, timeout=120):
  """Read the child's output until a line contains `needle`; returns that line."""
  deadline = time.time() + timeout
  while time.time() < deadline:
    line = proc.stdout.readline()
    if not line:
      break
    if needle in line:
      return line
  raise AssertionError(f"never saw {needle!r}")


def kill_once_saved(proc, workdir, step, timeout=120):
  """SIGKILL `proc` as soon as its checkpoint `step` is complete in `workdir`."""
  deadline = time.time() + timeout
  while step not in checkpoint_steps(workdir) and time.time() < deadline:
    time.sleep(0.002)
  proc.kill()
  proc.wait()
  assert step in checkpoint_steps(workdir)


def checkpoint_steps(workdir):
  d = os.path.join(workdir, "checkpoints")
  return sorted(int(n) for n in os.listdir(d) if n.isdigit()) if os.path.isdir(d) else []


@pytest.fixture(scope="module")
def straight(tmp_path_factory):
  """The uninterrupted 12-step reference run."""
  small = tmp_path_factory.mktemp("straight_small")
  train(small, 12)
  return {"small": losses(small)}


def assert_same_tail(got, want, first, last=12):
  assert [got[s] for s in range(first, last + 1)] == [want[s] for s in range(first, last + 1)]


# --- SIGKILL -------------------------------------------------------------------------------


@pytest.mark.slow  # a kill -9; the default run keeps test_sigkill_during_async_save
def test_sigkill_before_first_checkpoint_then_right_after_one(straight, tmp_path):
  """Two hard kills in one workdir: before anything was saved, then just after step 4 was."""
  proc = start(tmp_path, 12)
  wait_for_line(proc, "step 1:")
  proc.kill()
  proc.wait()
  assert checkpoint_steps(tmp_path) == []
  kill_once_saved(start(tmp_path, 12), tmp_path, 4)
  train(tmp_path, 12)
  assert_same_tail(losses(tmp_path), straight["small"], 1)


def test_sigkill_during_async_save(straight, tmp_path):
  """Kill while a checkpoint is being written (its temporary directory exists)."""
  proc = start(tmp_path, 12)
  ckpt_dir = os.path.join(tmp_path, "checkpoints")
  interrupted = None
  deadline = time.time() + 120
  while interrupted is None and time.time() < deadline and proc.poll() is None:
    tmps = glob.glob(os.path.join(ckpt_dir, "*.orbax-checkpoint-tmp*"))
    if tmps:
      proc.kill()
      interrupted = int(os.path.basename(tmps[0]).split(".")[0])
    else:
      time.sleep(0.002)
  proc.wait()
  assert interrupted is not None, "never caught a checkpoint in progress"
  assert interrupted not in checkpoint_steps(tmp_path), "the interrupted save must not count"
  train(tmp_path, 12)
  assert_same_tail(losses(tmp_path), straight["small"], 1)


# --- SIGTERM / SIGINT ----------------------------------------------------------------------


@pytest.mark.parametrize("sig", [signal.SIGTERM,
                                 pytest.param(signal.SIGINT, marks=pytest.mark.slow)])
def test_preemption_signal_saves_and_exits_75(straight, tmp_path, sig):
  proc = start(tmp_path, 12, "--config.checkpoint.every_steps=100")
  wait_for_line(proc, "step 5:")
  proc.send_signal(sig)
  rest = proc.communicate(timeout=60)[0]
  assert proc.returncode == 75, rest
  assert f"{signal.Signals(sig).name} received: stopped after step" in rest
  stopped = checkpoint_steps(tmp_path)[-1]
  assert stopped >= 5 and f"checkpoint saved to" in rest
  train(tmp_path, 12)
  assert_same_tail(losses(tmp_path), straight["small"], stopped + 1)


def test_a_second_ctrl_c_stops_at_once_in_one_line(tmp_path):
  proc = start(tmp_path, 100000, "--config.checkpoint.every_steps=0")
  wait_for_line(proc, "step 3:")
  proc.send_signal(signal.SIGINT)
  time.sleep(0.05)  # two signals before the handler runs would count as one
  proc.send_signal(signal.SIGINT)
  out, _ = proc.communicate(timeout=120)
  assert proc.returncode == 130, out[-3000:]
  assert "Traceback" not in out, out[-3000:]
  assert out.strip().splitlines()[-1].startswith("interrupted: stopped at once, without saving")


# --- broken checkpoints ----------------------------------------------------------------------


def _largest_file(directory):
  files = [p for p in glob.glob(os.path.join(directory, "**"), recursive=True)
           if os.path.isfile(p)]
  return max(files, key=os.path.getsize)


@pytest.mark.parametrize("damage", [  # the default run keeps tests/test_integrity.py's
    pytest.param("truncate", marks=pytest.mark.slow), pytest.param("delete", marks=pytest.mark.slow)])
def test_corrupt_newest_checkpoint_falls_back(straight, tmp_path, damage):
  train(tmp_path, 8)
  assert checkpoint_steps(tmp_path) == [4, 6, 8]
  victim = _largest_file(os.path.join(tmp_path, "checkpoints", "8", "state"))
  if damage == "truncate":
    open(victim, "w").close()
  else:
    os.remove(victim)
  proc = train(tmp_path, 12)
  unreadable = [l for l in proc.stdout.splitlines() if "checkpoints/8 is " in l]
  # Its checksums name the file: truncated (its size) or deleted (missing).
  assert len(unreadable) == 1 and "checkpoints/8 is damaged (state/" in unreadable[0] and \
      ("bytes" if damage == "truncate" else "is missing") in unreadable[0], proc.stdout
  assert "resumed from" in proc.stdout and proc.stdout.split("resumed from")[1].split()[0] \
      .endswith("/6")
  kept = glob.glob(os.path.join(tmp_path, "checkpoints.unreadable", "8-*"))
  assert len(kept) == 1, "the unreadable checkpoint is set aside, not deleted"
  assert_same_tail(losses(tmp_path), straight["small"], 7)


@pytest.mark.slow  # damaged checkpoints: the default run keeps tests/test_integrity.py's
def test_no_readable_checkpoint_stops_with_exit_2(tmp_path):
  train(tmp_path, 4)
  for step in checkpoint_steps(tmp_path):
    shutil.rmtree(os.path.join(tmp_path, "checkpoints", str(step), "data"))
  before = sorted(glob.glob(os.path.join(tmp_path, "**"), recursive=True))
  proc = train(tmp_path, 8, expect=2)
  assert "no readable checkpoint" in proc.stderr and "allow_fresh_start" in proc.stderr
  assert sorted(glob.glob(os.path.join(tmp_path, "**"), recursive=True)) == before
  # With the explicit flag the run sets them aside and starts over.
  train(tmp_path, 4, "--config.checkpoint.allow_fresh_start=true")
  assert len(glob.glob(os.path.join(tmp_path, "checkpoints.unreadable", "*"))) == 2


# --- storage errors --------------------------------------------------------------------------


def _make_read_only(path):
  """Make `path` unwritable even for root (chattr +i), or skip if that is impossible."""
  if os.geteuid() != 0:
    os.chmod(path, 0o555)
    return lambda: os.chmod(path, 0o755)
  if shutil.which("chattr") is None or subprocess.run(["chattr", "+i", path]).returncode:
    pytest.skip("running as root without chattr +i: cannot make a directory read-only")
  return lambda: subprocess.run(["chattr", "-i", path], check=True)


@pytest.mark.slow  # a save that fails: the default run keeps test_local_tier's small-disk saves
@pytest.mark.parametrize("policy", ["stop", "continue"])
def test_read_only_checkpoint_dir(straight, tmp_path, policy):
  train(tmp_path, 4)
  undo = _make_read_only(os.path.join(tmp_path, "checkpoints"))
  try:
    proc = train(tmp_path, 8, f"--config.checkpoint.on_error={policy}", expect=4)
  finally:
    undo()
  failures = [l for l in proc.stderr.splitlines() if "failed" in l and "checkpoint save" in l]
  assert len(failures) == 1, proc.stderr  # reported once, on stderr
  assert "checkpoint save" not in proc.stdout
  assert "earlier checkpoints are untouched (newest: 4)" in failures[0]
  steps_run = max(losses(tmp_path))
  assert steps_run == (6 if policy == "stop" else 8)
  # Every earlier checkpoint is still readable: the restart resumes from 4 and matches.
  proc = train(tmp_path, 12)
  assert proc.stdout.split("resumed from")[1].split()[0].endswith("/4")
  assert_same_tail(losses(tmp_path), straight["small"], 5)


@pytest.fixture
def small_disk(tmp_path):
  """`tmp_path/checkpoints` on a 4 MiB tmpfs (root only), and a function that leaves `free`
  bytes free on it."""
  mount = tmp_path / "checkpoints"
  mount.mkdir()
  if os.geteuid() != 0 or subprocess.run(["mount", "-t", "tmpfs", "-o", "size=4m", "tmpfs",
                                          str(mount)], capture_output=True).returncode:
    pytest.skip("cannot mount a small tmpfs (needs root)")
  filler = mount / "filler"

  def leave_free(free):
    filler.unlink(missing_ok=True)
    with open(filler, "wb") as f:
      f.write(b"\0" * max(shutil.disk_usage(mount).free - free, 0))
    assert abs(shutil.disk_usage(mount).free - free) <= 4096

  yield leave_free
  subprocess.run(["umount", "-l", str(mount)], check=True)


@pytest.mark.slow  # a full disk: the default run keeps test_local_tier's small-disk tests
def test_full_disk_during_a_save(straight, tmp_path, small_disk):
  train(tmp_path, 4)
  ckpts = os.path.join(tmp_path, "checkpoints")
  # The disk fills while step 26's checkpoint is written: there is room for its bytes, not for
  # the 4 KiB pages its ~30 files take. The failure is found at a log step after the write
  # ended, long before the next save (step 52: where it was found before), and named on stderr
  # in one line (step and cause).
  small_disk(sum(os.path.getsize(p) for p in glob.glob(os.path.join(ckpts, "4", "**"),
                                                       recursive=True) if os.path.isfile(p))
             + 16384)
  proc = train(tmp_path, 60, "--config.checkpoint.every_steps=26", expect=4)
  failures = [l for l in proc.stderr.splitlines() if "checkpoint save" in l]
  assert len(failures) == 1 and failures[0].startswith(
      "checkpoint save at step 26 failed (no space left on device in"), proc.stderr
  assert "removed its partial 26.orbax-checkpoint-tmp" in failures[0]
  assert "earlier checkpoints are untouched (newest: 4)" in failures[0]
  assert "checkpoint save" not in proc.stdout
  assert "Traceback" not in proc.stderr and "ERROR" not in proc.stderr, proc.stderr[-3000:]
  stopped = max(losses(tmp_path))
  assert 26 < stopped < 52 and f"stopped at step {stopped}: checkpoint storage failed" in \
      proc.stdout, proc.stdout[-2000:]
  assert sorted(os.listdir(ckpts)) == ["2", "4", "filler"]
  # Too little space for a checkpoint: refused before anything is written; the run stops there.
  small_disk(64 * 1024)
  proc = train(tmp_path, 12, expect=4)
  failures = [l for l in proc.stderr.splitlines() if "checkpoint save" in l]
  assert len(failures) == 1 and failures[0].startswith(
      "checkpoint save at step 6 failed (no space left on device: the checkpoint of step 6 "
      "needs"), proc.stderr
  steps_run = [l.split(":")[0] for l in proc.stdout.splitlines() if l.startswith("step ")]
  assert "stopped at step 6" in proc.stdout and steps_run == ["step 5", "step 6"]
  assert "Traceback" not in proc.stderr and "ERROR" not in proc.stderr, proc.stderr[-3000:]
  assert sorted(os.listdir(ckpts)) == ["2", "4", "filler"]
  # Space again: the run resumes from 4 and follows the uninterrupted run.
  os.remove(os.path.join(ckpts, "filler"))
  proc = train(tmp_path, 12)
  assert proc.stdout.split("resumed from")[1].split()[0].endswith("/4")
  assert_same_tail(losses(tmp_path), straight["small"], 5)


# --- restore elsewhere -------------------------------------------------------------------------


@pytest.mark.slow  # an elastic restart; the default run keeps test_local_tier's rescale
def test_elastic_restore_8_to_4_to_1_devices(straight, tmp_path):
  """Same global batch and data order on any device count; losses within fp32 noise."""
  train(tmp_path, 4, devices=8)
  train(tmp_path, 8, "--config.mesh.data=2", "--config.mesh.tensor=2", devices=4)
  train(tmp_path, 12, devices=1)
  got, want = losses(tmp_path), straight["small"]
  np.testing.assert_allclose([got[s] for s in range(5, 13)], [want[s] for s in range(5, 13)],
                             rtol=1e-5)


def test_the_host_queues_at_most_one_step_behind_the_running_one(tmp_path, monkeypatch):
  """Steps slower than the host's work for one (no row read back before the last): the host
  raced 3-4 steps ahead on CPU, and a stop signal acted only after those. Now every step
  before the one just dispatched has finished once the dispatch returns."""
  from conftest import tiny_config  # noqa: PLC0415
  from trainer.run.loop import Run  # noqa: PLC0415
  queued, dispatch = [], Run._dispatch

  def recording(self, *args):
    state, metrics = dispatch(self, *args)
    queued.append(metrics)
    unfinished = [i + 1 for i, m in enumerate(queued[:-1]) if not m["loss"].is_ready()]
    assert not unfinished, (f"step {len(queued)} dispatched while steps {unfinished} had not "
                            "finished")
    return state, metrics

  monkeypatch.setattr(Run, "_dispatch", recording)
  cfg = tiny_config(**{"steps": 4, "log_every": 4, "model.d_model": 64, "model.mlp_dim": 256,
                       "data.seq_len": 64, "data.global_batch_size": 16})
  assert Run(cfg, str(tmp_path)).train().status == "done" and len(queued) == 4


@pytest.mark.slow  # a real SIGINT into a run of slow steps; the default run keeps the test above
def test_ctrl_c_stops_after_the_running_step_or_the_one_queued_behind_it(tmp_path):
  """Steps long enough that the host could queue many (a log row every 10 steps: nothing is
  read back in between). SIGINT as step 10's row appears, while step 11 runs: the run stops
  after step 11 or 12 (the one queued behind it), not several steps later."""
  proc = start(tmp_path, 100000, "--config.log_every=10", "--config.checkpoint.every_steps=0",
               "--config.model.d_model=256", "--config.model.mlp_dim=1024",
               "--config.data.seq_len=128", "--config.data.global_batch_size=32")
  wait_for_line(proc, "step 10:")
  proc.send_signal(signal.SIGINT)
  rest = proc.communicate(timeout=300)[0]
  assert proc.returncode == 75, rest[-3000:]
  stopped = int(rest.split("SIGINT received: stopped after step ")[1].split(";")[0])
  assert stopped in (11, 12), rest[-3000:]

"""One run per workdir (trainer/run/workdir_lock.py): a second run on a live workdir is refused
in one line naming the live run, a lock left by a dead run is taken over with a line saying so.
The holders are real processes (a live one, one killed with SIGKILL)."""
import os
import signal
import socket
import subprocess
import sys
import time

import pytest

from trainer.run.workdir_lock import LOCK_FILE, WorkdirBusy, WorkdirLock

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
HOLD = ("import sys, time\n"
        "from trainer.run.workdir_lock import WorkdirLock\n"
        "WorkdirLock(sys.argv[1]).acquire()\n"
        "print('held', flush=True)\n"
        "time.sleep(600)\n")


def hold(workdir):
  """A process holding `workdir`'s lock (once it has printed 'held')."""
  proc = subprocess.Popen([sys.executable, "-c", HOLD, str(workdir)], cwd=ROOT,
                          stdout=subprocess.PIPE, text=True,
                          env={**os.environ, "JAX_PLATFORMS": "cpu"})
  assert proc.stdout.readline().strip() == "held"
  return proc


def test_a_live_holder_is_named_and_a_dead_ones_lock_taken_over(tmp_path):
  holder = hold(tmp_path)
  try:
    with pytest.raises(WorkdirBusy) as e:
      WorkdirLock(str(tmp_path)).acquire()
    line = str(e.value)
    assert "\n" not in line and line.startswith(f"--workdir {tmp_path} is in use by another "
                                                f"run: process {holder.pid} on host "
                                                f"{socket.gethostname()} (started "), line
  finally:
    holder.send_signal(signal.SIGKILL)
    holder.wait()
  assert os.path.exists(tmp_path / LOCK_FILE)  # a SIGKILL leaves the file, not the lock
  lines = []
  lock = WorkdirLock(str(tmp_path), log=lines.append)
  lock.acquire()
  assert lines == [f"{tmp_path}/{LOCK_FILE} was left by process {holder.pid} on host "
                   f"{socket.gethostname()} (started " + lines[0].split("(started ")[1]]
  assert lines[0].endswith("which is no longer running: taking the workdir over")
  assert f'"pid": {os.getpid()}' in (tmp_path / LOCK_FILE).read_text()
  with pytest.raises(WorkdirBusy, match=f"process {os.getpid()} on host"):  # another open file
    WorkdirLock(str(tmp_path)).acquire()
  lock.release()
  assert not os.path.exists(tmp_path / LOCK_FILE)
  again = WorkdirLock(str(tmp_path), log=lines.append)  # released cleanly: nothing to say
  again.acquire()
  again.release()
  assert len(lines) == 1


@pytest.mark.slow  # two train.py processes; the default run keeps the test above
def test_a_second_train_on_a_live_workdir_exits_2_in_one_line(tmp_path):
  from test_reliability import _env, start, train, wait_for_line  # noqa: PLC0415
  first = start(tmp_path, 100000, "--config.checkpoint.every_steps=0")
  try:
    wait_for_line(first, "step 2:")
    second = train(tmp_path, 4, expect=2)
    assert second.stderr.strip().splitlines() == [
        f"error: --workdir {tmp_path} is in use by another run: process {first.pid} on host "
        f"{socket.gethostname()} (started " + second.stderr.split("(started ")[1].strip()]
    assert "checkpoints" not in os.listdir(tmp_path) or not os.listdir(tmp_path / "checkpoints")
  finally:
    first.kill()
    first.wait()
  third = train(tmp_path, 2)
  assert f"was left by process {first.pid} on host" in third.stdout


def test_a_filesystem_without_locks_is_said_in_one_line_and_nothing_is_held(tmp_path,
                                                                           monkeypatch):
  import errno  # noqa: PLC0415
  import fcntl  # noqa: PLC0415

  def no_locks(fd, op):
    raise OSError(errno.ENOLCK, "No locks available")

  monkeypatch.setattr(fcntl, "flock", no_locks)
  lines = []
  lock = WorkdirLock(str(tmp_path), log=lines.append)
  lock.acquire()
  assert not lock.held and lines == [
      f"{tmp_path}/{LOCK_FILE}: this filesystem cannot lock files (No locks available); the run "
      "goes on without guarding its workdir against a second run"]
  lock.release()

"""One run per workdir (`WorkdirLock`): two runs writing the same checkpoints and metrics would
interleave them, so a run holds `<workdir>/run.lock` while it trains.

  <workdir>/run.lock    {"pid": 1234, "host": "vm-1", "started": "2026-01-01T00:00:00Z"}

The lock is an advisory `flock` on that file, taken without waiting: the kernel releases it when
its process dies however it dies (SIGKILL, a crashed host's NFS lease), so a live holder is told
from a stale file without guessing from process ids, and a pid reused by another program cannot
hold a workdir. A second run on a live workdir stops in one line naming the holder (exit code
2); a lock file left by a dead run is taken over with one line naming it. With several
processes only process 0 takes it (they share the workdir; a second launch's process 0 is
refused and every one of its processes stops with the same line). On NFS, Linux turns `flock`
into a lock of the whole file that the server keeps, so two hosts see each other's; on a
filesystem without locks (some FUSE mounts) the run says so in one line and goes on unlocked.
Why: docs/reliability.md#one-run-per-workdir.
"""
from __future__ import annotations

import errno
import fcntl
import json
import os
import socket
import time
from collections.abc import Callable

import jax

from trainer.checkpoint.saved import CheckpointError
from trainer.multihost.agreement import exchange

LOCK_FILE = "run.lock"


class WorkdirBusy(CheckpointError):
  """Another live run holds the workdir (one line, exit code 2)."""


def _holder(text: str) -> dict | None:
  try:
    found = json.loads(text)
  except ValueError:
    return None
  return found if isinstance(found, dict) else None


def describe(holder: dict | None) -> str:
  if not holder:
    return "a run that left no pid or host"
  return (f"process {holder.get('pid')} on host {holder.get('host')} (started "
          f"{holder.get('started')})")


class WorkdirLock:
  """`<workdir>/run.lock` held from `acquire` to `release` (see the module docstring)."""

  def __init__(self, workdir: str, log: Callable[[str], None] = print, timeout_s: float = 300):
    self.path = os.path.join(workdir, LOCK_FILE)
    self.log, self.timeout_s = log, timeout_s
    self._fd: int | None = None
    self.held = False  # whether this process holds it (process 0, on a filesystem with locks)

  def acquire(self) -> None:
    """Take the lock (process 0), or raise WorkdirBusy on every process."""
    busy = self._take() if jax.process_index() == 0 else None
    if jax.process_count() > 1:
      busy = exchange({"busy": busy}, self.timeout_s)[0]["busy"]
    if busy:
      raise WorkdirBusy(busy)

  def _take(self) -> str | None:
    """None once this process holds the lock, else the line naming the live holder."""
    while True:
      fd = os.open(self.path, os.O_RDWR | os.O_CREAT, 0o644)
      try:
        fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
      except BlockingIOError:
        holder = None
        for _ in range(10):  # a holder that has just taken it may not have written it yet
          holder = _holder(os.pread(fd, 4096, 0).decode(errors="replace"))
          if holder:
            break
          time.sleep(0.05)
        os.close(fd)
        return (f"--workdir {os.path.dirname(self.path)} is in use by another run: "
                f"{describe(holder)} holds {self.path}; wait for it to end, stop it, or give "
                "another --workdir")
      except OSError as e:
        if e.errno not in (errno.ENOLCK, errno.EOPNOTSUPP, errno.ENOSYS):
          os.close(fd)
          raise
        os.close(fd)
        self.held = False
        self.log(f"{self.path}: this filesystem cannot lock files ({e.strerror}); the run goes "
                 "on without guarding its workdir against a second run")
        return None
      # The file may have been removed (a holder releasing) between open and flock: then this
      # lock is on a file nobody else can find. Hold only the one at the path.
      try:
        same = os.stat(self.path).st_ino == os.fstat(fd).st_ino
      except FileNotFoundError:
        same = False
      if same:
        break
      os.close(fd)
    stale = os.pread(fd, 4096, 0).decode(errors="replace").strip()
    if stale:  # its run died holding it (the kernel released the flock, the file stayed)
      self.log(f"{self.path} was left by {describe(_holder(stale))}, which is no longer "
               "running: taking the workdir over")
    mine = json.dumps({"pid": os.getpid(), "host": socket.gethostname(),
                       "started": time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime())})
    os.ftruncate(fd, 0)
    os.pwrite(fd, mine.encode(), 0)
    os.fsync(fd)
    self._fd, self.held = fd, True
    return None

  def release(self) -> None:
    """Remove the lock file and let go (the file is removed while still held, so nobody can
    lock it in between)."""
    if self._fd is None:
      return
    try:
      os.remove(self.path)
    except OSError:
      pass
    os.close(self._fd)
    self._fd, self.held = None, False

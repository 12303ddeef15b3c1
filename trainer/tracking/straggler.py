"""Which process is slow (`StragglerReport`): at each log row every process contributes its
seconds per step of the window by part (`StepTimer.parts`: compute, the host's work on a step
before the step's collectives can start there; data, waiting for input; save, checkpoint saves
blocking the loop), gathered to every process in one small all-gather of three floats at the log
step (no sync of its own between log steps). A process whose median over the last `WINDOW` rows
of a part exceeds `trainer.straggler_factor` x the other processes' median of it, by at least
`MIN_SHARE` of the median step time, is named in one line and in the row (`straggler`). The time
lost to the slowest process (every process waits for it at the step's collectives) goes into the
goodput events, for `tools.goodput`. Why, and the limits (it times the host, not the devices):
docs/reliability.md#slow-and-hung-processes.
"""
from __future__ import annotations

import socket
import time

import jax
import numpy as np

from trainer.multihost.agreement import exchange, gather_floats

KINDS = ("compute", "data", "save")
WINDOW = 5  # log rows whose median is compared
MIN_ROWS = 3  # rows before anyone is named (a median of fewer is one noisy row)
MIN_SHARE = 0.1  # of the median step time: a smaller excess is noise, not a straggler


def slow_processes(history: np.ndarray, step_time: float, factor: float
                   ) -> list[tuple[int, str, float, float, float]]:
  """[(process, part, ratio, its median, the others' median)] named over the last `WINDOW` rows
  of `history` ([rows, processes, parts]: seconds per step), at most one part per process (the
  largest ratio); nothing before `MIN_ROWS` rows."""
  rows = history[-WINDOW:]
  if len(rows) < MIN_ROWS or rows.shape[1] < 2:
    return []
  named = []
  for p in range(rows.shape[1]):
    mine = np.median(rows[:, p], axis=0)
    others = np.median(np.delete(rows, p, axis=1), axis=(0, 1))
    found = [(mine[k] / max(others[k], 1e-12), KINDS[k], mine[k], others[k])
             for k in range(len(KINDS))
             if mine[k] > factor * others[k] and mine[k] - others[k] > MIN_SHARE * step_time]
    if found:
      ratio, kind, m, o = max(found)
      named.append((p, kind, ratio, m, o))
  return named


class StragglerReport:
  """The report of a run of several processes (module docstring). `gather(values)` -> [processes,
  len(values)] (trainer/multihost/agreement.py `gather_floats`); `hosts`: each process's host
  name; `log(line)`: the run's console (process 0's)."""

  def __init__(self, factor: float, gather, hosts: list[str], log):
    self.factor, self.gather, self.hosts, self.log = factor, gather, hosts, log
    self.history: list[np.ndarray] = []
    self.step_times: list[float] = []
    self.named: tuple = ()

  def __call__(self, parts: tuple[float, float, float], step_time: float, steps: int
               ) -> tuple[dict, dict]:
    """This process's seconds per step by part over the window just logged -> (fields for the
    row, fields for the goodput `steps` event)."""
    t = time.perf_counter()
    table = np.asarray(self.gather(np.asarray(parts, np.float64)), np.float64)  # [procs, parts]
    self.history = (self.history + [table])[-WINDOW:]
    self.step_times = (self.step_times + [step_time])[-WINDOW:]
    named = slow_processes(np.stack(self.history), float(np.median(self.step_times)), self.factor)
    totals = table.sum(axis=1)
    slowest = int(np.argmax(totals))
    others = np.median(np.delete(totals, slowest))  # what a step would take without it
    event = {"slowest": slowest, "lost_to_slowest": float((totals[slowest] - others) * steps)}
    row = {}
    if named:
      row["straggler"] = "; ".join(f"process {p} {kind} {ratio:.2f}x"
                                   for p, kind, ratio, _, _ in named)
    if tuple((p, kind) for p, kind, *_ in named) != self.named:
      for p, kind, ratio, mine, others in named:
        self.log(f"straggler: process {p} (host {self.hosts[p]}) is slow in {kind}: "
                 f"{1e3 * mine:.1f} ms per step, {ratio:.2f}x the other processes' median "
                 f"{1e3 * others:.1f} ms (medians of the last {len(self.history)} log rows)")
      if not named:
        self.log("straggler: no process is slow any more")
      self.named = tuple((p, kind) for p, kind, *_ in named)
    row["straggler_ms"] = 1e3 * (time.perf_counter() - t)
    return row, event


def make_report(cfg, log):
  """The run's report, or None (one process, or `trainer.straggler_factor` 0). Learns every
  process's host name once (one small exchange at the start)."""
  if jax.process_count() == 1 or not cfg.trainer.straggler_factor:
    return None
  timeout = float(cfg.distributed.initialization_timeout)
  hosts = [p["host"] for p in exchange({"host": socket.gethostname()}, timeout)]
  return StragglerReport(cfg.trainer.straggler_factor, gather_floats, hosts, log)

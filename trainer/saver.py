"""`Saver`: the training loop's checkpoint saves, to the persistent tier and to the local one, and
when a save counts as written.

A save hands the state, the data iterator's position, the config, the batch autopilot's
decisions and the topology (`trainer/elastic.py`) to `trainer/checkpoint.py` (persistent) or
`trainer/local_tier.py` (local), which write them asynchronously unless the save is blocking
(the final one, or a preemption's); an error of the previous background write surfaces at the
next save. A failing persistent storage is logged once per streak of failures (earlier
checkpoints stay readable) and once more when saving works again; with several processes, a
persistent save counts as written only if it was written on all of them (one collective,
`agree_any`), so every process takes the same decision after it. A local save is best effort:
one that fails or would fill the disk is logged once per streak and the run goes on (a restore
counts a local step only where it is complete). Time spent saving is not step time
(`StepTimer.paused`); how long each save blocked the loop is a goodput event.
"""
from __future__ import annotations

import time

from data import pipeline
from trainer.checkpoint import Checkpointer, first_line
from trainer.decisions import agree_any
from trainer.local_tier import LocalSaveSkipped, LocalTier


class Saver:
  """Starts checkpoints of both tiers (module docstring). `topology()`: the topology item of a
  save now; `events`: the run's goodput events (`trainer.run_report.Events`)."""

  def __init__(self, checkpointer: Checkpointer, data_spec, config: dict, timer, decider, log,
               autopilot=None, *, local: LocalTier | None = None, topology=dict,
               events=lambda *a, **k: None):
    self.checkpointer, self.data_spec, self.config = checkpointer, data_spec, config
    self.timer, self.decider, self.log = timer, decider, log
    self.autopilot, self.local, self.topology, self.events = autopilot, local, topology, events
    self.failing = False
    self.local_failing = False
    self.last_step = None

  def __call__(self, step: int, state, train_iter, *, blocking: bool = False) -> bool:
    ckpt = self.checkpointer
    t = time.perf_counter()
    with self.timer.paused():
      failed_step, error = step, None
      try:
        failed_step = self.last_step  # a background write of the previous save may have failed
        ckpt.check_for_errors()
        failed_step = step
        ckpt.save(step, state, train_iter, self.data_spec, self.config,
                  autopilot=self._autopilot(), topology=self.topology())
        self.last_step = step
        if blocking:
          ckpt.wait()
      except Exception as e:  # noqa: BLE001  storage errors of any kind
        error = e
      failed = agree_any(error is not None)
    self.events("checkpoint", step=step, tier="persistent", seconds=time.perf_counter() - t,
                ok=not failed)
    if failed:
      if not self.failing:
        good = [s for s in ckpt.all_steps() if s < (failed_step or step)]
        reason = first_line(error) if error is not None else "failed on another process"
        self.log(f"checkpoint save at step {failed_step} failed ({reason}); earlier "
                 f"checkpoints are untouched (newest: {good[-1] if good else 'none'})")
      self.failing = True
      return False
    if self.failing:
      self.log(f"checkpoint save at step {step} succeeded again")
    self.failing = False
    self.decider.saved()
    return True

  def to_local(self, step: int, state, train_iter) -> bool:
    """Start a save to the local tier (every process, the same step). Never stops the run."""
    t = time.perf_counter()
    error = None
    with self.timer.paused():
      try:
        self.local.check_for_errors()
        meta = {"config": self.config, "autopilot": self._autopilot(),
                "topology": self.topology(),
                "data": pipeline.saved_state(train_iter.get_state(), self.data_spec)}
        self.local.save(step, state, meta)
      except Exception as e:  # noqa: BLE001  full disk, storage errors: the next save retries
        error = e
    self.events("checkpoint", step=step, tier="local", seconds=time.perf_counter() - t,
                ok=error is None)
    if error is not None:
      if not self.local_failing:
        reason = str(error) if isinstance(error, LocalSaveSkipped) else first_line(error)
        self.log(f"local checkpoint at step {step} not written ({reason}); training goes on, "
                 "and the next local save tries again")
      self.local_failing = True
      return False
    if self.local_failing:
      self.log(f"local checkpoint at step {step} written again")
    self.local_failing = False
    return True

  def _autopilot(self) -> dict | None:
    return None if self.autopilot is None else self.autopilot.state_dict()

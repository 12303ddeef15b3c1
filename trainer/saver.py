"""`Saver`: the training loop's checkpoint saves and when one counts as written.

A save hands the state, the data iterator's position, the config and the batch autopilot's
decisions to `trainer/checkpoint.py`, which writes them asynchronously unless the save is
blocking (the final one, or a preemption's); an error of the previous background write surfaces
at the next save. A failing storage is logged once per streak of failures (earlier checkpoints
stay readable) and once more when saving works again. With several processes, a save counts as
written only if it was written on all of them (one collective, `agree_any`), so every process
takes the same decision after it. Time spent saving is not step time (`StepTimer.paused`).
"""
from __future__ import annotations

from trainer.checkpoint import Checkpointer, first_line
from trainer.decisions import agree_any


class Saver:
  """Starts checkpoints; a failing storage is reported once per streak (earlier checkpoints stay
  readable). With several processes, a save counts as written only if it was on all of them."""

  def __init__(self, checkpointer: Checkpointer, data_spec, config: dict, timer, decider, log,
               autopilot=None, to_saved=lambda state: state):
    """`to_saved(state)`: the state as a checkpoint holds it (a circular pipeline's layer stack
    in the plain order, trainer/stages.py)."""
    self.checkpointer, self.data_spec, self.config = checkpointer, data_spec, config
    self.timer, self.decider, self.log = timer, decider, log
    self.autopilot = autopilot
    self.to_saved = to_saved
    self.failing = False
    self.last_step = None

  def __call__(self, step: int, state, train_iter, *, blocking: bool = False) -> bool:
    ckpt = self.checkpointer
    with self.timer.paused():
      failed_step, error = step, None
      try:
        failed_step = self.last_step  # a background write of the previous save may have failed
        ckpt.check_for_errors()
        failed_step = step
        ckpt.save(step, self.to_saved(state), train_iter, self.data_spec, self.config,
                  autopilot=None if self.autopilot is None else self.autopilot.state_dict())
        self.last_step = step
        if blocking:
          ckpt.wait()
      except Exception as e:  # noqa: BLE001  storage errors of any kind
        error = e
      if agree_any(error is not None):
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

"""Orbax checkpoints of the whole run: train state, data-iterator position, config.

Layout: `<workdir>/checkpoints/<step>/{state,data,config}`. `state` is the TrainState (arrays
written by tensorstore, restored straight into the shardings of the *current* mesh, so a run
saved on 8 devices continues on 1 or on a different split); `data` is the grain iterator state
(JSON, one file per process); `config` is the resolved config (JSON) for the record.
Saves are asynchronous: `save` returns once the arrays are copied off the devices, and the
files are written in the background while training continues.
"""
from __future__ import annotations

import os

import grain
import orbax.checkpoint as ocp


class Checkpointer:

  def __init__(self, directory: str, *, keep: int, async_save: bool = True):
    self.directory = os.path.abspath(directory)
    options = ocp.CheckpointManagerOptions(
        max_to_keep=keep, create=True, enable_async_checkpointing=async_save)
    self.manager = ocp.CheckpointManager(self.directory, options=options)

  def latest_step(self) -> int | None:
    return self.manager.latest_step()

  def all_steps(self) -> list[int]:
    return list(self.manager.all_steps())

  def save(self, step: int, state, data_iterator, config: dict) -> None:
    self.manager.save(step, args=ocp.args.Composite(
        state=ocp.args.StandardSave(state),
        data=grain.checkpoint.CheckpointSave(data_iterator),
        config=ocp.args.JsonSave(config),
    ), force=True)

  def restore(self, step: int, abstract_state, data_iterator):
    """Restore state into the shardings carried by `abstract_state`; rewind the iterator."""
    restored = self.manager.restore(step, args=ocp.args.Composite(
        state=ocp.args.StandardRestore(abstract_state),
        data=grain.checkpoint.CheckpointRestore(data_iterator),
    ))
    return restored.state

  def wait(self) -> None:
    self.manager.wait_until_finished()

  def close(self) -> None:
    self.manager.close()

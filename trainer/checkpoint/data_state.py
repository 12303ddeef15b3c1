"""The checkpoint item that holds the data stream's position: one JSON file per process (all
alike), restorable by any number of processes, devices or micro-batches (`DataStateHandler`).
"""
from __future__ import annotations

import asyncio
import dataclasses
import json
import re

import jax
import orbax.checkpoint as ocp
from etils import epath

from data import pipeline


class DataStateHandler(ocp.AsyncCheckpointHandler):
  """Saves the data stream's position (`data.pipeline.saved_state`: the windows read and what
  they were read from) as JSON, one file per process (all alike); restores from any process's
  files, so the number of processes, devices or micro-batches may differ between save and
  restore.

  Asynchronous like the arrays: the state is taken in the caller (the iterator moves on as soon
  as `save` returns) and written by a commit future in the background, so a save does not wait
  for a thread that writes a small file (a synchronous handler costs a thread start and join in
  the loop's thread at every save)."""

  async def async_save(self, directory: epath.Path, args: "DataStateSave"):
    index, count = jax.process_index(), jax.process_count()
    text = json.dumps(pipeline.saved_state(args.iterator.get_state(), args.spec))
    path = directory / f"process_{index}-of-{count}.json"

    async def write():
      path.write_text(text)

    return [ocp.future.CommitFutureAwaitingContractedSignals(write(), name="data_state_save")]

  def save(self, directory: epath.Path, args: "DataStateSave"):
    async def save_and_wait():
      for f in await self.async_save(directory, args):
        f.result()

    asyncio.run(save_and_wait())

  def restore(self, directory: epath.Path, args: "DataStateRestore"):
    state, _ = pipeline.restored_state(read_data_states(directory), args.spec,
                                       args.windows_before)
    args.iterator.set_state(state)
    return args.iterator


def read_data_states(directory) -> list[dict]:
  """The data states every process saved in a checkpoint's `data` item (raises if incomplete)."""
  directory = epath.Path(directory)
  files = sorted(directory.glob("process_*-of-*.json"))
  counts = {re.fullmatch(r"process_\d+-of-(\d+)\.json", f.name).group(1) for f in files}
  if len(counts) != 1 or len(files) != int(next(iter(counts))):
    raise ValueError(f"incomplete data state in {directory}: {[f.name for f in files]}")
  return [json.loads(f.read_text()) for f in files]


@ocp.args.register_with_handler(DataStateHandler, for_save=True)
@dataclasses.dataclass
class DataStateSave(ocp.args.CheckpointArgs):
  iterator: object
  spec: pipeline.StreamSpec


@ocp.args.register_with_handler(DataStateHandler, for_restore=True)
@dataclasses.dataclass
class DataStateRestore(ocp.args.CheckpointArgs):
  iterator: object
  spec: pipeline.StreamSpec
  windows_before: int | None = None  # where a per-row state of an earlier version continues

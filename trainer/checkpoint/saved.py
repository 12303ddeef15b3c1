"""What a checkpoint says about itself, and whether it fits this run: its saved config, the
paths and shapes of its arrays, its data position; `CheckpointError` for what a user must fix.

Shared by both tiers: a step of either is checked against the config (`check_saved`) before it
is read, so a mismatch is refused with a line naming it instead of a shape error deep in Orbax.
"""
from __future__ import annotations

import json
import os

import jax

from data import pipeline
from data.meta import DataError
from models.config import ModelConfig, functional_differences, overrides_to_match
from trainer.errors import first_line


class CheckpointError(RuntimeError):
  """A checkpoint problem the user must act on (reported in one line, exit code 2)."""


# Config keys that must agree between a checkpoint and the run restoring it: every model field
# that changes what the weights compute (models/config.py FUNCTIONAL, compared as the weights see
# them), and these, which the rest of the saved state depends on. Everything else (steps, mesh,
# learning rate, intervals, logging, ...) may change between restarts.
# data.mask_rate: a masked LM's objective (data/masking.py); a checkpoint without it (written
# before the key) is read as matching
MUST_MATCH = ("model.param_dtype", "optim.name", "data.seq_len", "optim.diloco.replicas",
              "data.mask_rate")


class UnreadableConfig(ValueError):
  """A checkpoint's `config` item is missing or is not the JSON it was written as."""


def read_saved_config(step_dir: str) -> dict:
  """The config saved in one checkpoint's directory; raises UnreadableConfig naming the file."""
  path = os.path.join(step_dir, "config", "metadata")
  try:
    with open(path) as f:
      saved = json.load(f)
  except (OSError, ValueError) as e:
    raise UnreadableConfig(f"its config {path} cannot be read ({first_line(e)})") from None
  if not isinstance(saved, dict):
    raise UnreadableConfig(f"its config {path} holds no config")
  return saved


def newest_saved_config(directory: str) -> tuple[int, dict] | None:
  """(step, config) of the newest checkpoint under `directory` whose config can be read, or
  None (no checkpoint, or none with a readable config)."""
  steps = sorted((int(n) for n in os.listdir(directory) if n.isdigit()), reverse=True) \
      if os.path.isdir(directory) else []
  for step in steps:
    try:
      return step, read_saved_config(os.path.join(directory, str(step)))
    except UnreadableConfig:
      continue
  return None


def _get(tree: dict, dotted: str):
  for part in dotted.split("."):
    if not isinstance(tree, dict) or part not in tree:
      return None
    tree = tree[part]
  return tree


class SavedShapes(dict):
  """{leaf path: shape} of a saved tree, where the tree itself is not at hand (a local step)."""


def leaf_keys(tree) -> list[str]:
  """"a/b/c" paths of a pytree's leaves, in flatten order."""
  return ["/".join(_key_name(k) for k in path)
          for path, _ in jax.tree_util.tree_flatten_with_path(tree)[0]]


def _paths_and_shapes(tree) -> dict[str, tuple]:
  if isinstance(tree, SavedShapes):
    return {k: tuple(v) for k, v in tree.items()}
  out = {}
  for path, leaf in jax.tree_util.tree_flatten_with_path(tree)[0]:
    key = "/".join(_key_name(k) for k in path)
    out[key] = tuple(getattr(leaf, "shape", ()))
  return out


def _key_name(k) -> str:
  for attr in ("key", "name", "idx"):
    if hasattr(k, attr):
      return str(getattr(k, attr))
  return str(k)


def describe_mismatch(saved_config: dict, config: dict, saved_tree, target_tree) -> str | None:
  """Why a checkpoint cannot be restored into this run, or None if it can.

  Compares the key config values first (for a message in the user's terms), then every array
  path and shape of the saved tree (None: not readable, skipped) against the target.
  """
  if "model" in saved_config and "model" in config:
    differences = functional_differences(ModelConfig.from_config(saved_config["model"]),
                                         ModelConfig.from_config(config["model"]))
    if differences:
      key, a, b = differences[0]
      return (f"it was written with model.{key}={a!r}, the config has {b!r} (its config: "
              f"{overrides_to_match(differences)})")
  for key in MUST_MATCH:
    a, b = _get(saved_config, key), _get(config, key)
    if a is not None and a != b:
      return f"it was written with {key}={a!r}, the config has {b!r}"
  if saved_tree is None:
    return None
  saved, target = _paths_and_shapes(saved_tree), _paths_and_shapes(target_tree)
  missing = sorted(set(target) - set(saved))
  extra = sorted(set(saved) - set(target))
  if missing:
    return f"it has no {missing[0]} (and {len(missing) - 1} more) that the config needs"
  if extra:
    return f"it has {extra[0]} (and {len(extra) - 1} more) that the config does not"
  for key, shape in target.items():
    if saved[key] != shape:
      return f"{key} has shape {saved[key]} in it, {shape} in the config"
  return None


def check_saved(where: str, saved_config: dict, saved_tree, saved_data: list[dict] | None,
                abstract_state, config: dict, data_spec: pipeline.StreamSpec | None,
                windows_before: int | None) -> str | None:
  """Raise CheckpointError if the checkpoint at `where` (its config, its tree or
  `SavedShapes`, and its data states; None: unreadable, left to the restore) was written by
  an incompatible config or on data of another tokenizer; returns the line that says how the
  data order changes, if it does (`data.pipeline.restored_state`)."""
  reason = describe_mismatch(saved_config, config, saved_tree, abstract_state)
  if not reason and data_spec is not None and saved_data is not None:
    try:
      return pipeline.restored_state(saved_data, data_spec, windows_before)[1]
    except DataError as e:
      reason = str(e)
    except (KeyError, TypeError, ValueError):
      pass  # malformed: the restore attempt will report it
  if reason:
    raise CheckpointError(
        f"checkpoint {where} does not match this config: {reason}. Use a new "
        "--workdir (optionally with --config.checkpoint.init_from=<old workdir> to start from "
        "its parameters), or the config it was written with")
  return None

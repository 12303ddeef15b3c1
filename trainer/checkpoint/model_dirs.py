"""Models outside training: read a checkpoint for generation/evaluation/export, and write the
"converted" directory that an imported model lives in.

A *source* is a training workdir (its newest checkpoint), its `checkpoints/` dir, one step
dir, or a converted dir. A converted dir has the layout of one checkpoint step, so
`--config.checkpoint.init_from=DIR` reads it as it reads another run:

  DIR/state/            Orbax PyTree {"params": ...} (our layout, scanned layers)
  DIR/config/metadata   JSON {"model": {...every ModelConfig field...}, "source": ...}
  DIR/tokenizer/        the tokenizer files, when the model came with some (tokenizer.json, ...)

Every source carries its model config, so no command that reads one asks for dimensions.
"""
from __future__ import annotations

import json
import os
import shutil
import sys
from collections.abc import Callable
from typing import Any

import jax
import ml_collections
import orbax.checkpoint as ocp

from data import mixture, tokenizer
from data.prepare import ensure_default_corpus
from models.config import ModelConfig, functional_differences, overrides_to_match
from optim.ema import find_ema
from trainer.checkpoint.integrity import all_finite, verify_agreed, write_checksums
from trainer.checkpoint.saved import (CheckpointError, UnreadableConfig, describe_mismatch,
                                      read_saved_config)
from trainer.config import default_config
from trainer.errors import first_line
from trainer.multihost.agreement import agree_all
from trainer.step.program import Program
from trainer.step.state import ModelSpec

TOKENIZER_FILES = ("tokenizer.json", "tokenizer_config.json", "special_tokens_map.json",
                   "tokenizer.model")
_VOCAB_FILES = ("tokenizer.json", "tokenizer.model")  # without one of these there is none


def source_config(src: str, flag: str = "--checkpoint") -> tuple[str, dict]:
  """(step dir, the config saved with it) of a source; `flag`: what the user gave it as."""
  step_dir = resolve_step_dir(src, flag)
  try:
    config = read_saved_config(step_dir)
  except UnreadableConfig as e:
    raise CheckpointError(f"{flag}={src!r}: {e}") from None
  if "model" not in config:
    raise CheckpointError(f"{flag}={src!r}: its config ({step_dir}/config/metadata) has no "
                          "model block")
  return step_dir, config


def causal_source(src: str, flag: str = "--checkpoint") -> tuple[str, dict]:
  """`source_config` of a source that a next-token tool (generation, next-token evaluation,
  lm-eval) can read: a masked-LM encoder's (model.causal=False) is refused in one line before
  anything is restored: it sees the tokens it would be asked to predict."""
  step_dir, config = source_config(src, flag)
  if not config["model"].get("causal", True):
    raise CheckpointError(f"{flag}={src!r}: a masked-LM encoder (model.causal=False) does not "
                          "predict the next token; its eval_masked_accuracy and eval_loss are in "
                          "its run's metrics")
  return step_dir, config


def model_config(config: dict) -> ModelConfig:
  return ModelConfig.from_config(config["model"])


def restore_params(src: str, mesh, *, ema: bool = False, flag: str = "--checkpoint",
                   log: Callable[[str], None] | None = None):
  """(ModelSpec on `mesh`, params sharded by the rule table, config dict, which weights) of the
  newest step of `src` that verifies (`read_verified`; `log`: where its fallback lines go).

  With `ema=True` and a checkpoint whose optimizer kept a parameter EMA (`optim.ema_decay`),
  the EMA weights are returned instead of the raw ones.
  """
  def read(step_dir, config):
    spec = ModelSpec(model_config(config), mesh, seed=0)
    if ema and config.get("optim", {}).get("ema_decay", 0) > 0:
      return (spec, _restore_ema(step_dir, config, mesh), "ema"), None
    return (spec, _read_params(step_dir, spec.abstract_params, flag), "params"), None

  (spec, params, which), _, config = read_verified(src, flag, read, log)
  return spec, params, config, which


def restore_with_ema(src: str, mesh, log: Callable[[str], None] | None = None):
  """(ModelSpec, {"params": ..., "ema": ...} ("ema" only when the checkpoint kept one),
  config dict): both weight sets of a checkpoint from one read (of a verified step, as
  `restore_params`)."""
  def read(step_dir, config):
    spec = ModelSpec(model_config(config), mesh, seed=0)
    if config.get("optim", {}).get("ema_decay", 0) > 0:
      params, ema = _restore_ema(step_dir, config, mesh, with_params=True)
      return (spec, {"params": params, "ema": ema}), None
    return (spec, {"params": _read_params(step_dir, spec.abstract_params, "--checkpoint")}), None

  (spec, weights), _, config = read_verified(src, "--checkpoint", read, log)
  return spec, weights, config


def _restore_ema(step_dir: str, config: dict, mesh, *, with_params: bool = False):
  """The EMA weights of a training checkpoint: the full state is restored (its structure comes
  from the optimizer the config builds) and the EMA picked out of the optimizer state. Raises
  NotFinite if the parameters or the EMA hold NaN or inf."""

  cfg = default_config()
  cfg.update_from_flattened_dict(_flatten(config, cfg))
  abstract = Program(cfg, mesh).abstract_state()
  with ocp.StandardCheckpointer() as checkpointer:
    state = checkpointer.restore(os.path.join(step_dir, "state"), abstract)
  ema = find_ema(state.opt_state, state.params)
  _check_finite((state.params, ema), "its parameters or their EMA")
  return (state.params, ema) if with_params else ema


def _flatten(config: dict, ref: ml_collections.ConfigDict, prefix: str = "") -> dict:
  """The saved config's values for keys the current defaults know (a saved config may come
  from an older version)."""
  out = {}
  for key, value in config.items():
    if key not in ref:
      continue
    if isinstance(value, dict) and isinstance(ref[key], ml_collections.ConfigDict):
      out.update(_flatten(value, ref[key], prefix + key + "."))
    else:
      out[prefix + key] = value
  return out


def write_converted(out_dir: str, params, cfg: ModelConfig, *, source: str,
                    tokenizer_dir: str | None = None, extra: dict | None = None) -> None:
  """Write a converted dir (layout in the module docstring)."""
  out_dir = os.path.abspath(out_dir)
  if os.path.exists(os.path.join(out_dir, "state")):
    raise CheckpointError(f"--out {out_dir} already holds a converted model; choose a new dir")
  os.makedirs(os.path.join(out_dir, "config"), exist_ok=True)
  with ocp.PyTreeCheckpointer() as checkpointer:
    checkpointer.save(os.path.join(out_dir, "state"), {"params": params})
  config = {"model": cfg.to_dict(), "source": source, **(extra or {})}
  copied = copy_tokenizer(tokenizer_dir, os.path.join(out_dir, "tokenizer"))
  if copied:
    config["tokenizer"] = "tokenizer"
  if jax.process_index() == 0:
    with open(os.path.join(out_dir, "config", "metadata"), "w") as f:
      json.dump(config, f, indent=1)
    for item in ("state", "config") + (("tokenizer",) if copied else ()):
      write_checksums(os.path.join(out_dir, item))  # verified when read, like a training step


def copy_tokenizer(src_dir: str | None, dst_dir: str) -> list[str]:
  """Copy the tokenizer files present in `src_dir` (names in TOKENIZER_FILES), if it holds a
  tokenizer (a tokenizer.json or a SentencePiece tokenizer.model); returns the names copied."""
  if not src_dir or not os.path.isdir(src_dir):
    return []
  names = [n for n in TOKENIZER_FILES if os.path.isfile(os.path.join(src_dir, n))]
  if not set(names) & set(_VOCAB_FILES):
    return []
  os.makedirs(dst_dir, exist_ok=True)
  for n in names:
    shutil.copy2(os.path.join(src_dir, n), os.path.join(dst_dir, n))
  return names


def tokenizer_dir(step_dir: str, config: dict) -> str | None:
  """Where a source's tokenizer files are: the converted dir's tokenizer/, else None."""
  if config.get("tokenizer"):
    path = os.path.join(step_dir, config["tokenizer"])
    return path if os.path.isdir(path) else None
  return None


def source_tokenizer(step_dir: str, config: dict):
  """The tokenizer of a source, or None if it has none: a converted dir's tokenizer files
  (`data.tokenizer.from_path`), or a training run's data (`data.tokenizer.load_tokenizer` of
  its data dir, the first mixture source, or the default corpus)."""
  files = tokenizer_dir(step_dir, config)
  if files:
    try:
      return tokenizer.from_path(files)
    except ValueError as e:  # the tokenizer module's errors (TokenizerError)
      raise CheckpointError(f"{step_dir}: its tokenizer cannot be read ({e})") from None
  if "data" not in config:
    return None
  return data_tokenizer(run_data_dir(config["data"]))


def run_data_dir(data: dict) -> str:
  """A training run's prepared data dir: data.dir, the first data.mixture source (they share a
  tokenizer), or the embedded default corpus."""
  if data.get("dir"):
    return data["dir"]
  if data.get("mixture"):
    return mixture.parse(data["mixture"])[0].dir
  return ensure_default_corpus()


def data_tokenizer(data_dir: str):
  """The tokenizer a prepared data dir was made with."""
  return tokenizer.load_tokenizer(data_dir)


def init_from_mismatch(src: str, model_cfg: ModelConfig, config: dict | None = None) -> str | None:
  """None if `src` (for checkpoint.init_from; `config`: the one saved with the step read, else
  its newest step's) was made with a model that computes what `model_cfg` does
  (models/config.py FUNCTIONAL), else one line naming the first differing key and the
  overrides that would fix it."""
  if config is None:
    _, config = source_config(src, "checkpoint.init_from")
  differences = functional_differences(model_config(config), model_cfg)
  if not differences:
    return None
  key, a, b = differences[0]
  return (f"checkpoint.init_from={src!r} holds a model with model.{key}={a!r}, the config has "
          f"{b!r}; run with {overrides_to_match(differences)}")


def step_dirs(path: str, flag: str = "checkpoint.init_from") -> list[str]:
  """The step dirs a source names, newest first: the dir itself for one step's dir or a
  converted dir, every numbered step of a workdir or its checkpoints/ dir. `flag`: what the
  user gave the path as (named in the error)."""
  path = os.path.abspath(path)
  if os.path.isdir(os.path.join(path, "checkpoints")):
    path = os.path.join(path, "checkpoints")
  if os.path.isdir(os.path.join(path, "state")):
    return [path]
  steps = sorted(int(n) for n in os.listdir(path) if n.isdigit()) if os.path.isdir(path) else []
  if not steps:
    raise CheckpointError(f"{flag}={path!r}: no checkpoint found there "
                          "(give a workdir, its checkpoints/ dir, or a step dir)")
  return [os.path.join(path, str(step)) for step in reversed(steps)]


def resolve_step_dir(path: str, flag: str = "checkpoint.init_from") -> str:
  """A workdir, its checkpoints dir, or one step's dir -> the newest step dir (unverified: what
  a source says about itself; reads of its arrays go through `read_verified`)."""
  return step_dirs(path, flag)[0]


class NotFinite(ValueError):
  """Weights read from a checkpoint hold NaN or inf."""


def _check_finite(tree, what: str) -> None:
  if not bool(all_finite(tree)):
    raise NotFinite(f"{what} hold NaN or inf")


def read_verified(src: str, flag: str, read: Callable, log: Callable[[str], None] | None = None,
                  timeout_s: float = 300):
  """(result, step dir, saved config) of `read(step_dir, config)` on the newest step of `src`
  that a resume would accept: its files match their checksums (`verify_agreed`, every process
  its share), its config is readable, and what it holds is finite (`read` returns (result,
  None) after checking what it read with `_check_finite`). A step that fails is named in the
  one line a resume prints (`log`, stderr by default) and the previous step is tried; none
  left: CheckpointError. `read` raising CheckpointError (the source does not fit) stops at
  once. Every process settles on the same step."""
  log = log or (lambda line: print(line, file=sys.stderr, flush=True))
  dirs = step_dirs(src, flag)
  for i, step_dir in enumerate(dirs):
    result = config = None
    damaged = problem = verify_agreed(step_dir, timeout_s, os.path.basename(step_dir))
    if not problem:
      try:
        config = read_saved_config(step_dir)
        result, _ = read(step_dir, config)
      except CheckpointError:
        raise
      except UnreadableConfig as e:
        problem = str(e)
      except NotFinite as e:
        problem = f"it holds NaN or inf ({e})"
      except Exception as e:  # noqa: BLE001  any read failure means "try the previous one"
        problem = first_line(e)
    if agree_all(problem is None):
      return result, step_dir, config
    what = (f"checkpoint {step_dir} is {'damaged' if damaged else 'unreadable'} "
            f"({problem or 'on another process'})")
    if i + 1 < len(dirs):
      log(f"{what}; trying the previous one")
      continue
    raise CheckpointError(f"{flag}={src!r}: {what}"
                          + ("; no earlier step of it can be read either" if i else "")
                          + "; nothing was loaded")
  raise AssertionError("unreachable")


def load_params(path: str, abstract_params, *, model_cfg: ModelConfig | None = None,
                log: Callable[[str], None] | None = None) -> tuple[Any, str]:
  """Parameters of another run's checkpoint (its newest step that verifies, `read_verified`),
  resharded to `abstract_params`' shardings (a DiLoCo run's: its anchor, the outer model the
  replicas agreed on), and the step dir they came from. `model_cfg`: the model they are for; a
  source made by a model that computes something else is refused (`init_from_mismatch`)."""
  def read(step_dir, config):
    if model_cfg is not None and "model" in config:
      reason = init_from_mismatch(path, model_cfg, config)
      if reason:
        raise CheckpointError(reason)
    return _read_params(step_dir, abstract_params, f"checkpoint.init_from={path!r}"), None

  params, step_dir, _ = read_verified(path, "checkpoint.init_from", read, log)
  return params, step_dir


def _read_params(step_dir: str, abstract_params, source: str):
  """The parameters of one step dir (finite, else NotFinite), resharded to `abstract_params`.
  `source`: how the user named it (in the error if it holds no such parameters)."""
  state_dir = os.path.join(step_dir, "state")
  with ocp.PyTreeCheckpointer() as checkpointer:
    saved = checkpointer.metadata(state_dir).item_metadata.tree  # unreadable: read_verified
    key = "anchor" if "anchor" in saved else "params"
    if key not in saved:
      raise CheckpointError(f"{source}: {state_dir} holds no params")
    reason = describe_mismatch({}, {}, saved[key], abstract_params)
    if reason:
      raise CheckpointError(f"{source} does not fit this model: {reason}")
    target = {key: abstract_params}
    restored = checkpointer.restore(state_dir, args=ocp.args.PyTreeRestore(
        item=target, restore_args=ocp.checkpoint_utils.construct_restore_args(target),
        partial_restore=True))
  _check_finite(restored[key], "its parameters")
  return restored[key]

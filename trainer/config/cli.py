"""Config files and command lines: the one place that reads `--config FILE.py` and parses
`--config.KEY=VALUE` overrides, for train.py and every tool and bench (`CliParser`).

A config file's mistakes (missing, a directory, a syntax error, an exception in `get_config()`,
an unknown key, a wrong type) and a command line's (an unknown argument, a bad override) are
each one `ConfigError` line naming the file and line or the key, the value and what would work.
"""
from __future__ import annotations

import argparse
import ast
import difflib
import importlib.util
import math
import os
import traceback
from collections.abc import Sequence

import ml_collections
from absl import logging as absl_logging

from trainer.config import ConfigError, default_config


def quiet_library_logs() -> None:
  """Silence the libraries' absl chatter below ERROR (Orbax's "Metadata file does not exist",
  ...): train.py and the tools say what matters in their own lines."""
  absl_logging.set_verbosity(absl_logging.ERROR)


def load_config_file(path: str) -> ml_collections.ConfigDict:
  """The ConfigDict of a config file's `get_config()`. Every way the file can fail (missing, a
  directory, a syntax error, an exception while it runs) is one ConfigError line naming the file
  and, where there is one, the line."""
  if os.path.isdir(path):
    raise ConfigError(f"--config {path}: is a directory; give a config file, e.g. "
                      "configs/lm_tiny.py")
  if not os.path.isfile(path):
    raise ConfigError(f"--config {path}: no such file (configs live in configs/*.py)")
  spec = importlib.util.spec_from_file_location("_run_config", path)
  if spec is None:
    raise ConfigError(f"--config {path}: not a Python file; a config is a .py file with "
                      "get_config()")
  module = importlib.util.module_from_spec(spec)
  try:
    spec.loader.exec_module(module)
  except SyntaxError as e:
    where = "" if os.path.realpath(e.filename or path) == os.path.realpath(path) else \
        f" ({e.filename})"
    raise ConfigError(f"--config {path}, line {e.lineno}{where}: {type(e).__name__}: "
                      f"{e.msg}") from None
  except Exception as e:  # noqa: BLE001  the user's code: report where it failed, in one line
    raise ConfigError(f"--config {path}{_where(e, path)}: {_one_line(e)}") from None
  if not callable(getattr(module, "get_config", None)):
    raise ConfigError(f"--config {path}: the file must define get_config()")
  try:
    cfg = module.get_config()
  except ConfigError:
    raise
  except Exception as e:  # noqa: BLE001
    raise ConfigError(f"--config {path}{_where(e, path)}: get_config() raised "
                      f"{_one_line(e)}") from None
  if not isinstance(cfg, (ml_collections.ConfigDict, dict)):
    raise ConfigError(f"--config {path}: get_config() returned a {type(cfg).__name__}; return an "
                      "ml_collections.ConfigDict")
  _check_keys(cfg, default_config(), path)
  return cfg


def _where(e: BaseException, path: str) -> str:
  """', line N' of the innermost frame of `e` in the config file, or ''."""
  target = os.path.realpath(path)
  frames = [f for f in traceback.extract_tb(e.__traceback__)
            if os.path.realpath(f.filename) == target]
  return f", line {frames[-1].lineno}" if frames else ""


def _one_line(e: BaseException) -> str:
  text = " ".join(str(e).split())
  return f"{type(e).__name__}: {text[:300]}" if text else type(e).__name__


def _check_keys(cfg, ref, where, prefix=""):
  for key in cfg.keys():
    full = prefix + key
    if key not in ref:
      raise ConfigError(f"{where}: unknown key {full!r}{_suggest(full, ref, prefix)}")
    if isinstance(ref[key], ml_collections.ConfigDict):
      _check_keys(cfg[key], ref[key], where, full + ".")


# Keys of earlier versions: what replaced them, for the unknown-key message.
RENAMED = {"eval_steps": "eval_sequences (validation sequences per evaluation, not batches: "
                         "eval_steps x the micro-batch rows)",
           "optim.noise_scale_ema": "optim.noise_scale_window (the meter's memory as a fraction "
                                    "of the tokens trained so far, e.g. 0.25; an average per "
                                    "measurement remembered 1 / (1 - ema) measurements)"}


def _suggest(full: str, ref, prefix: str) -> str:
  if full in RENAMED:
    return f"; it is now {RENAMED[full]}"
  known = [prefix + k for k in ref.keys()]
  close = difflib.get_close_matches(full, known, n=1)
  return f"; did you mean {close[0]!r}?" if close else f"; known keys here: {', '.join(known)}"


def _parse_value(text: str, current, key: str):
  """Parse `text` into the type of the current value of `key`."""
  kind = type(current)
  try:
    if kind is bool:
      low = text.lower()
      if low in ("true", "1", "yes"):
        return True
      if low in ("false", "0", "no"):
        return False
      raise ValueError
    if kind is int:
      value = in_type(int, ast.literal_eval(text))  # 2e9 tokens, 1e6 steps
      if isinstance(value, bool) or not isinstance(value, int):
        raise ValueError
      return value
    if kind is float:
      value = float(text)
      if not math.isfinite(value):
        raise ValueError
      return value
    if kind is str:
      return text
  except (ValueError, SyntaxError):
    pass
  else:
    raise ConfigError(f"--config.{key}: cannot override a {kind.__name__} value")
  raise ConfigError(f"--config.{key}={text!r}: expected {kind.__name__} "
                    f"(like the default {current!r})")


def apply_override(cfg: ml_collections.ConfigDict, dotted: str, text: str) -> None:
  node, parts = cfg, dotted.split(".")
  for i, part in enumerate(parts):
    prefix = ".".join(parts[:i]) + ("." if i else "")
    if not isinstance(node, ml_collections.ConfigDict) or part not in node:
      ref = node if isinstance(node, ml_collections.ConfigDict) else ml_collections.ConfigDict()
      raise ConfigError(f"--config.{dotted}: unknown key {dotted!r}"
                        f"{_suggest(dotted, ref, prefix)}")
    if i < len(parts) - 1:
      node = node[part]
  if isinstance(node[parts[-1]], ml_collections.ConfigDict):
    raise ConfigError(f"--config.{dotted}: is a group; set one of its keys "
                      f"({', '.join(node[parts[-1]].keys())})")
  node[parts[-1]] = _parse_value(text, node[parts[-1]], dotted)


def load(path: str, overrides: list[tuple[str, str]]) -> ml_collections.ConfigDict:
  """The config file, merged over the defaults, with the command-line overrides applied."""
  cfg = default_config()
  _merge(cfg, load_config_file(path), path)
  for dotted, text in overrides:
    apply_override(cfg, dotted, text)
  return cfg


def from_dict(values: dict, where: str) -> ml_collections.ConfigDict:
  """A saved config (a run's config.json, a checkpoint's config item) merged over the defaults,
  as `load` merges a file: an unknown key or a wrong type is a ConfigError naming `where`."""
  saved = ml_collections.ConfigDict(values)
  _check_keys(saved, default_config(), where)
  cfg = default_config()
  _merge(cfg, saved, where)
  return cfg


# ----------------------------------------------------------------------------------------------
# Command lines: one parser of `--config.KEY=VALUE` for train.py, tools/ and bench/


def parse_overrides(args: Sequence[str]) -> list[tuple[str, str]]:
  """`--config.a.b=value` (or `--config.a.b value`) arguments -> [("a.b", "value")], in order.
  Anything else is a ConfigError (keys and values are checked by `apply_override`)."""
  out, i = [], 0
  while i < len(args):
    arg = args[i]
    name, eq, value = arg.partition("=")
    if not name.startswith("--config.") or name == "--config.":
      raise ConfigError(f"unknown argument {arg!r}; config overrides are --config.KEY=VALUE")
    if not eq:
      if i + 1 >= len(args) or args[i + 1].startswith("--"):
        raise ConfigError(f"{name}: no value; write {name}=VALUE")
      value, i = args[i + 1], i + 1
    out.append((name[len("--config."):], value))
    i += 1
  return out


class CliParser(argparse.ArgumentParser):
  """argparse for the project's command lines: `--config FILE.py` (when `config`), the CLI's own
  options, and `--config.KEY=VALUE` overrides (`parse_overrides`). A mistake is one ConfigError
  line (argparse would print its usage and exit); the CLI prints it and exits with code 2.
  `overrides=False`: a CLI with no config to override refuses them (one line)."""

  def __init__(self, prog: str, description: str = "", *, config: bool = True,
               overrides: bool = True):
    super().__init__(prog=prog, description=description, allow_abbrev=False,
                     formatter_class=argparse.RawDescriptionHelpFormatter)
    self.overrides = overrides
    if config:
      self.add_argument("--config", required=True, metavar="FILE.py",
                        help="config file; --config.KEY=VALUE overrides any of its keys")

  def parse(self, argv: Sequence[str] | None) -> tuple[argparse.Namespace, list[tuple[str, str]]]:
    """(the CLI's own options, the config overrides in order)."""
    args, rest = self.parse_known_args(argv)
    pairs = parse_overrides(rest)
    if pairs and not self.overrides:
      raise ConfigError(f"{pairs[0][0]}: python {self.prog} takes no config overrides")
    return args, pairs

  def error(self, message: str):
    raise ConfigError(f"{message} (python {self.prog} --help)")


def ints(text: str) -> list[int]:
  """An argparse type: "8,16,32" -> [8, 16, 32] (a mistake is the parser's one-line error)."""
  return _numbers(text, int, "integers")


def floats(text: str) -> list[float]:
  """An argparse type: "0.5,1,2" -> [0.5, 1.0, 2.0]."""
  return _numbers(text, float, "numbers")


def _numbers(text: str, kind, what: str) -> list:
  try:
    return [kind(x) for x in text.split(",") if x]
  except ValueError:
    raise argparse.ArgumentTypeError(f"{text!r}: give comma-separated {what}") from None


def load_from_cli(path: str, args: Sequence[str], *, devices=None) -> ml_collections.ConfigDict:
  """`load` with the overrides of a command line; validated against `devices` (a device list,
  or a count for one slice) unless None."""
  cfg = load(path, parse_overrides(args))
  if devices is not None:
    from trainer.config.checks import validate  # noqa: PLC0415  start-up (jax: not for argparse types)
    validate(cfg, devices)
  return cfg


def in_type(want: type, value):
  """A number in the key's numeric type when that keeps its value: an int for a float key, an
  integral float (2e9) for an int key; anything else as it is."""
  if want is float and isinstance(value, int) and not isinstance(value, bool):
    return float(value)
  if want is int and isinstance(value, float) and value.is_integer():
    return int(value)
  return value


def _merge(dst, src, where, prefix=""):
  for key in src.keys():
    value = src[key]
    if isinstance(value, ml_collections.ConfigDict):
      _merge(dst[key], value, where, prefix + key + ".")
      continue
    want = type(dst[key])
    value = in_type(want, value)
    if type(value) is not want:
      raise ConfigError(f"{where}: {prefix}{key}={value!r} should be a {want.__name__}")
    dst[key] = value

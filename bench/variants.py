"""Our train step under variants of one config key, timed alternately on the same model.

    python bench/variants.py --vary model.scan_unroll=1,64 [--size 3m,25m] [--rounds 5]
        [--steps 2] [--config.a.b=v ...]
    python bench/variants.py --vary model.attention=xla,flash --size none --config FILE
    python bench/variants.py --vary model.fp8=false,true --size d768-s1024   # issue 25's shapes
    python bench/variants.py --xla xla_gpu_enable_latency_hiding_scheduler=false,true ...

Each value of `--vary KEY=V1,V2,...` is a `--config.KEY=V` override added last; `--xla
OPTION=V1,V2,...` varies an XLA compiler option instead. Every variant is compiled up front and
timed in turns, so machine drift hits them alike. Prints each variant's median time per step
and its time over the first variant's (the median of the per-round ratios: < 1 is faster).
Details: docs/performance.md#ab-of-one-config-key
"""
from __future__ import annotations

import contextlib
import os
import statistics
import sys

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))  # the repository
from bench import baseline  # noqa: E402
from trainer.config import ConfigError  # noqa: E402
from trainer.config.cli import CliParser, apply_override  # noqa: E402
from trainer.multihost import platforms  # noqa: E402


def parse_vary(text: str) -> tuple[str, list[str]]:
  """`KEY=V1,V2,...` -> (KEY, [V1, V2, ...]); a mistake raises ConfigError."""
  key, sep, values = text.partition("=")
  values = [v for v in values.split(",") if v]
  if not sep or not key or len(values) < 2:
    raise ConfigError(f"--vary {text!r}: give a config key and two or more values, e.g. "
                      "--vary model.scan_unroll=1,64")
  return key.removeprefix("--config."), values


def option_value(text: str):
  """An XLA option's value from the command line: a bool, an int, or the text."""
  if text.lower() in ("true", "false"):
    return text.lower() == "true"
  try:
    return int(text)
  except ValueError:
    return text


@contextlib.contextmanager
def compiler_option(name: str, value):
  """The train step compiled in this block has XLA option `name` = `value` on this platform."""
  import jax  # noqa: PLC0415  start-up

  from trainer.step import program  # noqa: PLC0415  start-up
  platform = jax.default_backend()
  saved = program.COMPILER_OPTIONS.get(platform)
  program.COMPILER_OPTIONS[platform] = {**(saved or {}), name: option_value(value)}
  try:
    yield
  finally:
    if saved is None:
      program.COMPILER_OPTIONS.pop(platform)
    else:
      program.COMPILER_OPTIONS[platform] = saved


def vary(cfg, key: str, value: str, devices: int = 1):
  """A copy of `cfg` with `--config.KEY=VALUE` applied (and checked, as train.py checks it, for
  `devices` devices)."""
  from trainer.config.checks import validate  # noqa: PLC0415  start-up
  out = cfg.copy_and_resolve_references()
  apply_override(out, key, value)
  validate(out, devices)
  return out


VARIED = {**baseline.SIZES, **baseline.SHAPES}  # the matched models and issue 25's shapes


def build_parser():
  parser = CliParser("bench/variants.py", __doc__, config=False)
  parser.add_argument("--vary", default="", metavar="KEY=V1,V2",
                      help="the config key to vary and its values, e.g. model.scan_unroll=1,64")
  parser.add_argument("--xla", default="", metavar="OPTION=V1,V2",
                      help="an XLA compiler option to vary instead, e.g. "
                      "xla_gpu_enable_latency_hiding_scheduler=false,true")
  baseline.add_timing_args(parser, steps=2)
  baseline.add_size_args(parser, "models, of " + ", ".join(VARIED)
                         + " (default 3m,25m), or none: --config as it is")
  return parser


def main(argv=None):
  platforms.choose()  # as train.py: no TPU probing (and its start-up noise) without TPUs
  try:  # a mistake in the command line or config: one line, exit 2
    args, configs = baseline.load_sized(build_parser(), argv, sizes=VARIED)
    if bool(args.vary) == bool(args.xla):
      raise ConfigError("give one of --vary KEY=V1,V2 (a config key) or --xla OPTION=V1,V2 "
                        "(an XLA compiler option)")
    key, values = parse_vary(args.vary or args.xla)
    variants = [[(value, cfg if args.xla else vary(cfg, key, value)) for value in values]
                for _, cfg in configs]
  except ConfigError as e:
    print(f"error: {e}", file=sys.stderr)
    return 2
  print(baseline.header(args))
  for (label, _), cfgs in zip(configs, variants):
    runners = {}
    for value, cfg in cfgs:
      with compiler_option(key, value) if args.xla else contextlib.nullcontext():
        runners[f"{key}={value}"] = baseline.Ours(cfg)
    times = baseline.alternate(runners, rounds=args.rounds, steps=args.steps)
    first = next(iter(times))
    print(f"\n{label}: {baseline.describe(cfgs[0][1])}")
    for name, ts in times.items():
      ratio = statistics.median(t / f for t, f in zip(ts, times[first]))
      print(f"  {name:<44} {statistics.median(ts) * 1e3:8.1f} ms/step  x{ratio:.3f} the time of "
            f"{first}  (rounds: {', '.join(f'{t * 1e3:.0f}' for t in ts)} ms)")
  return 0


if __name__ == "__main__":
  sys.exit(main())

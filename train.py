"""Train a model from a config file.

    python train.py --config configs/lm_tiny.py --workdir runs/tiny [--config.a.b=value ...]

Rerunning with the same --workdir resumes from its newest checkpoint. A mistake in the command
line or the config, down to a step that cannot fit a device's memory by a cheap lower bound
(trainer/config/memory_bound.py), is one line and exit code 2 before anything is compiled
(docs/configs.md#what-a-run-does). Several processes (hosts): this same command on each of them
(docs/multihost.md).

Exit codes: 0 finished, 2 a user error, 3 stopped on a non-finite loss or a spike, 4 checkpoint
storage failed, 5 hung (no step completed within trainer.hang_timeout_s: restart to continue),
75 preempted (restart to continue), 130 a second Ctrl-C: docs/reliability.md#exit-codes.
"""
from __future__ import annotations

import os
import sys
import tempfile

from data.prepare import DataError
from trainer.config import ConfigError, memory_bound
from trainer.config.cli import CliParser, load, quiet_library_logs
from trainer.multihost import launch, platforms

EXIT_CONFIG_ERROR = 2


def build_parser():
  """The command line's parser (`trainer.config.cli.CliParser`): --config FILE, --workdir DIR, and
  --config.a.b=v (or --config.a.b v) overrides."""
  parser = CliParser("train.py", __doc__)
  parser.add_argument("--workdir", required=True, metavar="DIR",
                      help="run directory: checkpoints, metrics.jsonl; rerun to resume")
  return parser


def parse_args(argv: list[str]) -> tuple[str, str, list[tuple[str, str]]]:
  """(config file, workdir, overrides) of a command line; a mistake is one ConfigError."""
  args, overrides = build_parser().parse(argv)
  if "://" in args.workdir:
    raise ConfigError(
        f"--workdir {args.workdir}: the workdir must be a filesystem path (metrics.jsonl is "
        "appended to, checkpoints are renamed into place); for a bucket, mount it (e.g. "
        "gcsfuse --implicit-dirs BUCKET /gcs/BUCKET) and pass /gcs/BUCKET/...")
  return args.config, args.workdir, overrides


def check_workdir(workdir: str) -> None:
  """Create the workdir (if new) and make sure this process can write in it; a ConfigError
  otherwise. Permission bits do not stop root, so it really writes (and removes) a file."""
  if os.path.exists(workdir) and not os.path.isdir(workdir):
    raise ConfigError(f"--workdir {workdir}: is a file, not a directory; give a directory "
                      "(it is created if missing)")
  try:
    os.makedirs(workdir, exist_ok=True)
    with tempfile.TemporaryFile(dir=workdir):
      pass
  except OSError as e:
    raise ConfigError(f"--workdir {workdir}: cannot write there ({e.strerror or e}); give a "
                      "directory this user can create and write") from None


def main(argv: list[str]) -> int:
  platforms.choose()  # before anything imports jax: no TPU probing on machines without TPUs
  from trainer.checkpoint.saved import CheckpointError  # noqa: PLC0415  start-up
  from trainer.config.checks import validate  # noqa: PLC0415  start-up

  try:
    config_path, workdir, overrides = parse_args(argv)
    cfg = load(config_path, overrides)
    # Several processes (hosts): join them before anything touches a jax backend, then make
    # sure they all run the same thing (a disagreement is an error here, not a hang later).
    launch.initialize(cfg.distributed)
    import jax  # noqa: PLC0415  start-up (imported after the config parses: errors stay fast)
    quiet_library_logs()
    from trainer.multihost.agreement import check_agreement  # noqa: PLC0415  start-up
    check_agreement(cfg, workdir)
    # A rescaling restart runs the checkpoint's batch scaled to these devices: check that one.
    from trainer.checkpoint.elastic import as_resumed  # noqa: PLC0415  start-up
    checked = as_resumed(cfg, workdir, jax.devices())
    sizes = validate(checked, jax.devices())
    too_big = memory_bound.check(checked, sizes, jax.local_devices())  # before compiling terabytes
    if too_big:
      raise ConfigError(too_big)
    check_workdir(workdir)
    from trainer.run.loop import Run  # noqa: PLC0415  start-up
    run = Run(cfg, workdir)
    result = run.train()
  except (ConfigError, DataError, CheckpointError, launch.DistributedError) as e:
    print(f"error: {e}", file=sys.stderr)
    return EXIT_CONFIG_ERROR
  except KeyboardInterrupt:  # a Ctrl-C before the loop's handlers (a second one: StopSignals)
    from trainer.run.decisions import EXIT_INTERRUPTED, INTERRUPTED  # noqa: PLC0415  start-up
    print(INTERRUPTED, file=sys.stderr)
    return EXIT_INTERRUPTED
  return result.exit_code


if __name__ == "__main__":
  sys.exit(main(sys.argv[1:]))

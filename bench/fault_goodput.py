"""Goodput of a run that is killed three times: the persistent tier alone against the local tier
beside it.

    python bench/fault_goodput.py [--steps 200] [--kills 45,130,185] [--every 50] \\
        [--local-every 10] [--rounds 1]

Runs `configs/lm_tiny.py` with `train.py` in a fresh workdir per configuration, SIGKILLs it as
soon as a start has recorded reaching each step of `--kills` (one kill per start) and restarts
it at once; then `tools.goodput` accounts for the wall time. Both configurations save to the
persistent tier every `--every` steps; "local" also saves every `--local-every` steps to a local
directory (under /dev/shm when it exists). `--rounds` alternates the configurations (compare
within a round). The last lines check that both runs ended on the same losses.
Setup and results: docs/reliability.md#failures-with-and-without-the-local-tier
"""
from __future__ import annotations

import contextlib
import json
import os
import shutil
import subprocess
import sys
import tempfile
import time


ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, ROOT)
from tools.goodput import account, read_events  # noqa: E402
from trainer.config import ConfigError  # noqa: E402
from trainer.config.cli import CliParser  # noqa: E402


def build_parser():
  parser = CliParser("bench/fault_goodput.py", __doc__, config=False)
  parser.add_argument("--steps", type=int, default=200)
  parser.add_argument("--kills", default="45,130,185", help="steps after which to SIGKILL")
  parser.add_argument("--every", type=int, default=50, help="persistent save interval")
  parser.add_argument("--local-every", type=int, default=10, help="local save interval")
  parser.add_argument("--rounds", type=int, default=1, help="alternations of the two")
  return parser


def recorded_step(workdir: str) -> int:
  """The last step the current start recorded (goodput.jsonl `steps` events)."""
  path = os.path.join(workdir, "goodput.jsonl")
  if not os.path.exists(path):
    return 0
  events = read_events(path)
  starts = [i for i, e in enumerate(events) if e["event"] == "start"]
  mine = events[starts[-1]:] if starts else []
  return max((e["last"] for e in mine if e["event"] == "steps"), default=0)


def run_with_kills(command: list[str], workdir: str, kills: list[int], log) -> None:
  for k in kills:
    proc = subprocess.Popen(command, cwd=ROOT, stdout=log, stderr=subprocess.STDOUT)
    while recorded_step(workdir) < k:
      if proc.poll() is not None:
        raise RuntimeError(f"{workdir}: the run ended before step {k} (see its log)")
      time.sleep(0.01)
    proc.kill()
    proc.wait()
  subprocess.run(command, cwd=ROOT, stdout=log, stderr=subprocess.STDOUT, check=True)


def last_losses(workdir: str) -> dict[int, float]:
  out = {}
  for line in open(os.path.join(workdir, "metrics.jsonl")):
    row = json.loads(line)
    if "loss" in row:
      out[row["step"]] = row["loss"]
  return out


def main(argv=None) -> int:
  try:
    args = build_parser().parse_args(argv)
    kills = [int(k) for k in args.kills.split(",")]
  except (ConfigError, ValueError) as e:
    print(f"error: {e}", file=sys.stderr)
    return 2

  scratch = tempfile.mkdtemp(prefix="fault-goodput-")
  fast = "/dev/shm" if os.path.isdir("/dev/shm") else scratch
  cache = os.path.join(scratch, "jax-cache")
  base = [sys.executable, "train.py", "--config", "configs/lm_tiny.py",
          f"--config.steps={args.steps}", "--config.eval_every=0", "--config.log_every=5",
          f"--config.checkpoint.every_steps={args.every}", "--config.trainer.progress_bar=false",
          f"--config.trainer.compile_cache_dir={cache}"]
  local_dir = tempfile.mkdtemp(dir=fast, prefix="fault-goodput-")  # removed at the end
  configs = {"persistent only": lambda _: [],
             "local tier": lambda round_: [
                 f"--config.checkpoint.local_dir={local_dir}/{round_}",
                 f"--config.checkpoint.local_every_steps={args.local_every}"]}
  reports = []
  with open(os.path.join(scratch, "log.txt"), "w") as log, contextlib.ExitStack() as done:
    done.callback(shutil.rmtree, local_dir, ignore_errors=True)
    warm = os.path.join(scratch, "warm")
    subprocess.run(base + ["--workdir", warm, "--config.steps=2"], cwd=ROOT, stdout=log,
                   stderr=subprocess.STDOUT, check=True)
    for round_ in range(1, args.rounds + 1):
      for name, extra in configs.items():
        workdir = os.path.join(scratch, f"{name.replace(' ', '_')}_{round_}")
        run_with_kills(base + ["--workdir", workdir] + extra(round_), workdir, kills, log)
        reports.append((f"{name}" + (f", round {round_}" if args.rounds > 1 else ""),
                        account(read_events(os.path.join(workdir, "goodput.jsonl"))),
                        last_losses(workdir)))
  print(f"lm_tiny, {args.steps} steps, SIGKILL after steps {args.kills}; persistent saves "
        f"every {args.every} steps, local saves every {args.local_every} (workdirs under "
        f"{scratch})\n")
  print("| | restarts | steps redone | goodput | wall s | productive s | redone s | "
        "checkpoint s | compile s | startup s | other s |")
  print("|---|---|---|---|---|---|---|---|---|---|---|")
  for name, r, _ in reports:
    s = r["seconds"]
    print(f"| {name} | {r['restarts']} | {r['steps_redone']} | {100 * r['goodput']:.1f}% | "
          f"{r['wall_seconds']:.1f} | {s['productive']:.1f} | {s['redone']:.1f} | "
          f"{s['checkpoint']:.1f} | {s['compile']:.1f} | {s['startup']:.1f} | "
          f"{s['other']:.1f} |")
  print(f"\nsame losses in every run: {all(l == reports[0][2] for *_, l in reports)}; all "
        f"finished: {all(r['finished'] for _, r, _ in reports)}")
  return 0


if __name__ == "__main__":
  sys.exit(main())

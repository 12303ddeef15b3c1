"""Faults that do not crash, measured on two processes of one CPU (gloo collectives, 4 devices
each, the tiny model of tests/test_multihost.py): the straggler report and the hang watchdog.

    python bench/faults.py [--steps 200] [--slow-steps 30] [--timeout 10] [--what all]

clean  STEPS steps, a log row every step: rows that name a process (false positives), and the
       report's overhead on step time as a same-run ratio: median `straggler_ms` (its all-gather
       and decision, timed after the running step finished) over the median `step_time`
slow   `trainer.fault=slow:1:2`: the first row that names a process, what it names, the first
       slowed step (3: the fault measures two steps first), and tools.goodput's time lost to
       the slowest process
hang   `trainer.fault=hang:1:8`, `trainer.hang_timeout_s=TIMEOUT`: both exit codes, seconds from
       the last metrics row to the later exit (over the timeout), the watchdog's line; then the
       restart, and whether its losses equal a straight run's bit for bit
Results: docs/reliability.md#slow-and-hung-processes
"""
from __future__ import annotations

import json
import os
import socket
import statistics
import subprocess
import sys
import tempfile
import time

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, ROOT)
from tools.goodput import account, describe, read_events  # noqa: E402
from trainer.config import ConfigError  # noqa: E402
from trainer.config.cli import CliParser  # noqa: E402

MODEL = ["--config.model.d_model=32", "--config.model.mlp_dim=64",
         "--config.data.global_batch_size=8", "--config.data.seq_len=32",
         "--config.data.prefetch=0", "--config.optim.warmup_steps=2", "--config.log_every=1",
         "--config.eval_every=0", "--config.trainer.progress_bar=false",
         "--config.trainer.peak_flops_per_device=1e9", "--config.mesh.data=2",
         "--config.mesh.fsdp=2", "--config.mesh.tensor=2"]


def build_parser():
  parser = CliParser("bench/faults.py", __doc__, config=False)
  parser.add_argument("--steps", type=int, default=200, help="steps of the clean run")
  parser.add_argument("--slow-steps", type=int, default=30, help="steps of the slow run")
  parser.add_argument("--timeout", type=float, default=10.0, help="trainer.hang_timeout_s")
  parser.add_argument("--what", default="all", help="clean, slow, hang or all")
  return parser


def two_processes(workdir: str, *args: str) -> list[tuple[int, str, str, float]]:
  """train.py as 2 processes x 4 CPU devices: [(exit code, stdout, stderr, exit time)]."""
  with socket.socket() as s:
    s.bind(("127.0.0.1", 0))
    port = s.getsockname()[1]
  procs = []
  for pid in range(2):
    env = dict(os.environ, JAX_PLATFORMS="cpu", JAX_NUM_CPU_DEVICES="4",
               JAX_CPU_COLLECTIVES_IMPLEMENTATION="gloo",
               JAX_COORDINATOR_ADDRESS=f"127.0.0.1:{port}", JAX_NUM_PROCESSES="2",
               JAX_PROCESS_ID=str(pid))
    env["XLA_FLAGS"] = " ".join(f for f in env.get("XLA_FLAGS", "").split()
                                if "device_count" not in f)
    procs.append(subprocess.Popen(
        [sys.executable, "train.py", "--config", "configs/lm_tiny.py", "--workdir", workdir,
         *MODEL, *args], cwd=ROOT, env=env, stdout=subprocess.PIPE, stderr=subprocess.PIPE,
        text=True))
  out = []
  for p in procs:
    stdout, stderr = p.communicate(timeout=1800)
    out.append((p.returncode, stdout, stderr, time.time()))
  return out


def rows(workdir: str) -> list[dict]:
  with open(os.path.join(workdir, "metrics.jsonl")) as f:
    return [r for r in map(json.loads, f) if "loss" in r]


def clean(tmp: str, steps: int) -> None:
  d = os.path.join(tmp, "clean")
  results = two_processes(d, f"--config.steps={steps}", "--config.checkpoint.every_steps=50")
  r = rows(d)
  named = [x["step"] for x in r if "straggler" in x]
  report = statistics.median(x["straggler_ms"] for x in r)
  step = 1e3 * statistics.median(x["step_time"] for x in r)
  print(f"clean: exit {[c for c, *_ in results]}; {len(r)} rows, {len(named)} naming a process "
        f"{named[:5]}; report {report:.2f} ms / step {step:.1f} ms = same-run ratio "
        f"{report / step:.4f}")


def slow(tmp: str, steps: int) -> None:
  d = os.path.join(tmp, "slow")
  results = two_processes(d, f"--config.steps={steps}", "--config.trainer.fault=slow:1:2",
                          "--config.checkpoint.every_steps=0")
  r = rows(d)
  first = next((x for x in r if "straggler" in x), None)
  lines = [ln for ln in results[0][1].splitlines() if ln.startswith("straggler:")]
  print(f"slow: exit {[c for c, *_ in results]}; first slowed step 3; first row naming a "
        f"process: step {first and first['step']} ({first and first['straggler']}); rows naming "
        f"process 1: {sum('process 1' in x.get('straggler', '') for x in r)}/{len(r)}, process "
        f"0: {sum('process 0' in x.get('straggler', '') for x in r)}; line: {lines[:1]}")
  report = account(read_events(os.path.join(d, "goodput.jsonl")))
  lost = [ln for ln in describe(report).splitlines() if "lost to the slowest" in ln]
  print(f"  tools.goodput: {lost[0].strip() if lost else None}")


def hang(tmp: str, timeout: float) -> None:
  args = ["--config.steps=12", "--config.checkpoint.every_steps=4"]
  straight, hung = os.path.join(tmp, "straight"), os.path.join(tmp, "hung")
  two_processes(straight, *args)
  results = two_processes(hung, *args, "--config.trainer.fault=hang:1:8",
                          f"--config.trainer.hang_timeout_s={timeout:g}")
  since = max(t for *_, t in results) - os.path.getmtime(os.path.join(hung, "metrics.jsonl"))
  print(f"hang: exit {[c for c, *_ in results]}; {since:.1f} s from the last row to both exits "
        f"= {since / timeout:.2f} x the timeout {timeout:g} s")
  print("  " + results[0][2].strip().splitlines()[-1])
  restart = two_processes(hung, *args)
  last = lambda d: {x["step"]: x["loss"] for x in rows(d)}
  print(f"  restart: exit {[c for c, *_ in restart]}; losses of steps 1-12 equal the straight "
        f"run's bit for bit: {last(hung) == last(straight)}")


def main(argv: list[str]) -> int:
  try:
    args, _ = build_parser().parse(argv)
    if args.what not in ("clean", "slow", "hang", "all"):
      raise ConfigError(f"--what {args.what}: choose clean, slow, hang or all")
  except ConfigError as e:
    print(f"error: {e}", file=sys.stderr)
    return 2
  with tempfile.TemporaryDirectory() as tmp:
    if args.what in ("clean", "all"):
      clean(tmp, args.steps)
    if args.what in ("slow", "all"):
      slow(tmp, args.slow_steps)
    if args.what in ("hang", "all"):
      hang(tmp, args.timeout)
  return 0


if __name__ == "__main__":
  sys.exit(main(sys.argv[1:]))

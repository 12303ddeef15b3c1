"""Goodput of a run across its restarts, and where the rest of the time went.

    python -m tools.goodput WORKDIR [--json]

Reads `WORKDIR/goodput.jsonl`, the events every start of the run appended
(`trainer/tracking/goodput.py` `Events`), and splits the wall time from the first process's start
to the end (the last event of a run that finished; now, while it runs or waits for a restart)
into productive (step time of steps that stayed done, less data waits), compile, restore,
checkpoint, evaluation, data, redone (steps a later start did again), startup (a process's start
to its run's first event), down (from the last event of a start that did not finish to the next
process's start, or to now while none runs) and other. goodput = productive / wall. Step time
is measured per window of steps between two log rows, so a crash loses at most one window of
records (down time then).
What each part holds: docs/reliability.md#goodput
"""
from __future__ import annotations

import json
import os
import socket
import sys
import time

from trainer.config import ConfigError
from trainer.config.cli import CliParser
from trainer.tracking.goodput import process_start_time

CATEGORIES = ("productive", "compile", "restore", "checkpoint", "evaluation", "data",
              "redone", "startup", "down", "other")
SUMMED = {"compile": "compile", "restore": "restore", "checkpoint": "checkpoint",
          "eval": "evaluation"}


def build_parser():
  parser = CliParser("-m tools.goodput", __doc__, config=False)
  parser.add_argument("workdir", help="the run's --workdir")
  parser.add_argument("--json", action="store_true", help="print the numbers as JSON")
  return parser


def read_events(path: str) -> list[dict]:
  """The events of goodput.jsonl (a partial last line, left by a killed process, is skipped);
  raises ValueError naming the first line that is not an event."""
  with open(path) as f:
    lines = f.read().split("\n")
  out = []
  for n, line in enumerate(lines, 1):
    if not line.strip():
      continue
    try:
      event = json.loads(line)
    except ValueError:
      if n == len(lines):  # the partial last line of a killed process (no newline after it)
        continue
      event = None
    if not (isinstance(event, dict) and isinstance(event.get("event"), str)
            and isinstance(event.get("time"), (int, float))):
      raise ValueError(f"line {n} is not a goodput event ({line[:80]!r})")
    out.append(event)
  return out


def process_alive(start: dict) -> bool | None:
  """Whether the process of a `start` event still runs: True or False where it ran on this
  host (its pid, with the same start time: not a reused pid), None where that cannot be told
  (another host, or a start recorded without its pid)."""
  if "pid" not in start or start.get("host") != socket.gethostname():
    return None
  began = process_start_time(start["pid"])
  return began is not None and abs(began - start.get("process_start", began)) < 2.0


def attempts(events: list[dict]) -> list[list[dict]]:
  """The events grouped by start (each `start` event begins one)."""
  out: list[list[dict]] = []
  for e in events:
    if e["event"] == "start" or not out:
      out.append([])
    out[-1].append(e)
  return out


def account(events: list[dict], now: float | None = None, alive=process_alive) -> dict:
  """Goodput and the breakdown of the module docstring, as a dict. `alive(start event)`: whether
  the last start, if it has not stopped, still runs (True, False, None: cannot tell)."""
  runs = attempts(events)
  if not runs:
    raise ValueError("no events")
  seconds = dict.fromkeys(CATEGORIES, 0.0)
  begin = lambda run: run[0].get("process_start", run[0]["time"])
  restored = [next((e["step"] or 0 for e in run if e["event"] == "restore"), 0) for run in runs]
  last = runs[-1][-1]
  finished = last["event"] == "stop" and last.get("status") == "done"
  end = last["time"] if finished else (time.time() if now is None else now)
  running = None if last["event"] == "stop" else alive(runs[-1][0])
  if not finished and running is not True:  # stopped, killed, or cannot tell: waiting since
    seconds["down"] += max(end - last["time"], 0.0)
  redone_steps = 0
  for k, run in enumerate(runs):
    seconds["startup"] += max(run[0]["time"] - begin(run), 0.0)
    # A step done here is redone if a later start resumed from before it.
    kept_upto = min(restored[k + 1:], default=None)
    for e in run:
      kind = e["event"]
      if kind in SUMMED:
        seconds[SUMMED[kind]] += e["seconds"]
      elif kind == "steps":
        work = e["seconds"] - e["data_wait"]
        seconds["data"] += e["data_wait"]
        count = e["last"] - e["first"] + 1
        again = 0 if kept_upto is None else min(max(e["last"] - kept_upto, 0), count)
        redone_steps += again
        seconds["redone"] += work * again / max(count, 1)
        seconds["productive"] += work * (count - again) / max(count, 1)
    if k + 1 < len(runs):
      seconds["down"] += max(begin(runs[k + 1]) - run[-1]["time"], 0.0)
  wall = max(end - begin(runs[0]), 1e-9)
  windows = [e for e in events if e["event"] == "steps" and "lost_to_slowest" in e]
  slowest = [e["slowest"] for e in windows]
  seconds["other"] = max(wall - sum(seconds.values()), 0.0)
  stops = [run[-1] for run in runs]
  return {
      "goodput": seconds["productive"] / wall, "wall_seconds": wall,
      "restarts": len(runs) - 1, "finished": finished, "steps_redone": redone_steps,
      "step": max((e["last"] for e in events if e["event"] == "steps"), default=0),
      "seconds": seconds,
      "starts": [{"restored_step": restored[k],
                  "tier": next((e["tier"] for e in run if e["event"] == "restore"), None),
                  "to_first_step": next((e["time"] - begin(run) for e in run
                                         if e["event"] == "first_step"), None),
                  "ended": stops[k].get("status") if stops[k]["event"] == "stop" else
                  "killed (no stop event)" if k + 1 < len(runs) or running is False else
                  "still running" if running else
                  f"no stop event (running or killed: on host {run[0].get('host', '?')}, "
                  "which this one cannot ask)"} for k, run in enumerate(runs)],
      "running": bool(running),
      # several processes: step time every process waited for the slowest one (in productive)
      "lost_to_slowest": sum(e["lost_to_slowest"] for e in windows) if windows else None,
      "slowest_process": max(set(slowest), key=slowest.count) if slowest else None,
  }


def describe(report: dict) -> str:
  wall = report["wall_seconds"]
  lines = [f"goodput {100 * report['goodput']:.1f}% of {wall:.1f} s wall time, "
           f"{report['restarts']} restart(s), up to step {report['step']}"
           + ("" if report["finished"] else " (not finished: wall time up to now)")]
  for name in CATEGORIES:
    value = report["seconds"][name]
    extra = f"  ({report['steps_redone']} steps)" if name == "redone" else ""
    lines.append(f"  {name:<11} {value:9.1f} s {100 * value / wall:6.1f}%{extra}")
  lost = report.get("lost_to_slowest")
  if lost is not None:
    share = lost / max(report["seconds"]["productive"], 1e-9)
    lines.append(f"  lost to the slowest process: {lost:.1f} s ({100 * share:.1f}% of productive; "
                 f"process {report['slowest_process']} the slowest in most log windows)")
  for k, start in enumerate(report["starts"]):
    source = f"resumed from step {start['restored_step']} ({start['tier']} tier)" \
        if start["tier"] else "fresh"
    first = start["to_first_step"]
    lines.append(f"  start {k + 1}: {source}; "
                 + (f"first step {first:.1f} s after its process started; " if first else "")
                 + f"ended: {start['ended']}")
  if report["running"]:
    lines.append("  (still running: the time since its last record is under other)")
  return "\n".join(lines)


def main(argv: list[str]) -> int:
  try:
    args, overrides = build_parser().parse(argv)
    if overrides:
      raise ConfigError("tools.goodput takes no --config overrides")
  except ConfigError as e:
    print(f"error: {e}", file=sys.stderr)
    return 2
  path = os.path.join(args.workdir, "goodput.jsonl")
  if not os.path.exists(path):
    print(f"error: {path} does not exist (a run of this version writes it in its --workdir)",
          file=sys.stderr)
    return 2
  try:
    report = account(read_events(path))
  except (ValueError, KeyError, TypeError) as e:
    what = f"lacks {e}" if isinstance(e, KeyError) else \
        f"a field of the wrong type: {e}" if isinstance(e, TypeError) else str(e)
    print(f"error: {path} holds no usable events ({what}; a run of this version writes them)",
          file=sys.stderr)
    return 2
  print(json.dumps(report, indent=1) if args.json else describe(report))
  return 0


if __name__ == "__main__":
  sys.exit(main(sys.argv[1:]))

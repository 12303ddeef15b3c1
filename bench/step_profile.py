"""Where the train step's time goes: a jax.profiler trace of the compiled step, by kind of work.

    python bench/step_profile.py [--size 3m,25m] [--steps 2] [--config.a.b=v ...]
    python bench/step_profile.py --size none --config configs/lm_small.py
    python bench/step_profile.py --size d768-s1024 --keep DIR   # a GPU; issue 25's shapes

Traces `--steps` steps of the step train.py runs (after two warm-up steps) and adds up each
compiled kernel's time per step by kind of work (layer and attention matmuls, fused attention,
softmax and mask, elementwise, the scan's stacked residuals, LM head, embedding and loss, after
the gradient), sorted from the optimized HLO (`tools/hlo.py`): a heuristic, good to a few
percent. What it cannot place is printed as "unattributed" with its largest kernel names.
`--keep DIR` keeps each trace and the step's HLO as DIR/<size>.perfetto.json.gz and
DIR/<size>.hlo.txt.gz.
How kernels are found and named (CPU and GPU): docs/performance.md#where-the-steps-time-goes
"""
from __future__ import annotations

import collections
import glob
import gzip
import json
import os
import re
import shutil
import sys
import tempfile
import time

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))  # the repository
from bench import baseline  # noqa: E402

from models.attention import CAUSAL_BLOCK  # noqa: E402
from tools.hlo import Module  # noqa: E402
import jax  # noqa: E402
from trainer.config import ConfigError  # noqa: E402
from trainer.config.cli import CliParser  # noqa: E402
from trainer.multihost import platforms  # noqa: E402

KINDS = ("layer matmuls (q, k, v, o, MLP)", "attention matmuls (QK^T, PV)",
         "attention softmax and mask", "layer elementwise (norms, RoPE, SwiGLU, residuals)",
         "scan: stacked residuals (zero-fill, copies)", "LM head matmul",
         "embedding, cross-entropy", "after the gradient (optimizer, clip, guard, norms)",
         "attention kernels (flash, cuDNN: fused)")
UNATTRIBUTED = "unattributed"
CONTAINERS = ("while", "conditional", "call")  # their events span the kernels they run
# Kernels of libraries, by name, when the trace does not say which instruction launched them.
GEMM_KERNELS = re.compile(r"gemm|xmma|cutlass|nvjet|cublas|wgmma|hmma", re.I)
ATTENTION_KERNELS = re.compile(r"fmha|sdpa|flash|attention|cudnn", re.I)


def kind(module: Module, name: str, seq_len: int) -> str | None:
  """The kind of work of instruction `name` of `module`; None for loops and calls (their
  events contain their kernels') and for what is not an instruction of the program."""
  inst = module.lookup(name)
  if inst is None or inst.opcode in CONTAINERS:
    return None
  op_name = inst.op_name
  dims = [int(d) for d in re.findall(r"\d+", inst.shape.split("{")[0])]
  # [..., S, S] scores, or a causal query block's [..., c, (i + 1) c] (models/attention.py)
  square = (len(dims) >= 4 and dims[-2] in (seq_len, CAUSAL_BLOCK) and dims[-1] <= seq_len
            and dims[-1] % dims[-2] == 0)
  if inst.name.startswith("wrapped_broadcast") or (inst.opcode == "copy" and len(dims) >= 4):
    return KINDS[4]
  if "jvp" not in op_name and "while" not in op_name and "closed_call" not in op_name:
    return KINDS[7]
  if inst.opcode == "custom-call" and ATTENTION_KERNELS.search(
      f"{inst.custom_call_target} {op_name}") and "dot_general" not in op_name:
    return KINDS[8]  # a Pallas (Triton, Mosaic) or cuDNN attention kernel
  dots = _dots(module, inst)
  if "while/body" in op_name or "closed_call" in op_name:  # the layers, scanned or unrolled
    if dots:
      return KINDS[1] if square or any("lhs_batch_dims" in d for d in dots) else KINDS[0]
    if square or "softmax" in op_name:
      return KINDS[2]
    if "dynamic-update-slice" in inst.name or "dynamic_update_slice" in inst.name:
      return KINDS[4]
    return KINDS[3]
  return KINDS[5] if dots else KINDS[6]


def _dots(module: Module, inst, depth: int = 0) -> list[str]:
  """The dot instructions of `inst` and of the computations it calls (fusion bodies), and a
  GEMM custom call's own line."""
  found = [inst.line] if inst.opcode == "dot" or "gemm" in inst.custom_call_target else []
  for called in inst.called if depth < 3 else []:
    for body in module.computations.get(called, []):
      if body.name != inst.name:
        found += _dots(module, body, depth + 1)
  return found


def device_pids(events) -> set:
  """The trace's processes that are accelerators (their kernels), empty on a CPU."""
  return {e["pid"] for e in events if e.get("ph") == "M" and e.get("name") == "process_name"
          and re.search(r"/device:(GPU|TPU)", str(e.get("args", {}).get("name", "")))}


def _thread_names(events) -> dict:
  return {(e["pid"], e.get("tid")): str(e.get("args", {}).get("name", "")) for e in events
          if e.get("ph") == "M" and e.get("name") == "thread_name"}


def device_kind(module: Module, event: dict, seq_len: int) -> str:
  """The kind of a device kernel's event: by the instruction its arguments or its name give,
  else (a library's kernel) by its name, else UNATTRIBUTED."""
  args = event.get("args", {}) or {}
  names = [args.get("hlo_op"), *(v for k, v in args.items() if k != "hlo_op"), event["name"]]
  for name in names:
    if isinstance(name, str) and module.lookup(name.split(":")[0].strip()) is not None:
      found = kind(module, name.split(":")[0].strip(), seq_len)
      if found is not None:
        return found
  if ATTENTION_KERNELS.search(event["name"]):
    return KINDS[8]
  if GEMM_KERNELS.search(event["name"]):
    return KINDS[0]
  return UNATTRIBUTED


def attribute(events, module: Module, seq_len: int, steps: int) -> tuple[dict, dict]:
  """(seconds per step of each kind, seconds per step of each unattributed kernel name) of a
  trace's complete events (module docstring: which events count where)."""
  devices = device_pids(events)
  threads = _thread_names(events)
  ops_tracks = {key for key, name in threads.items() if key[0] in devices and name == "XLA Ops"}
  totals, unnamed = collections.Counter(), collections.Counter()
  for e in events:  # complete events of compiled kernels (not the runtime's or Python's)
    if e.get("ph") != "X":
      continue
    seconds = e["dur"] * 1e-6 / steps
    if not devices:  # a CPU: XLA's thunks on the host's threads
      found = kind(module, e.get("args", {}).get("hlo_op") or e["name"], seq_len)
      if found is not None:
        totals[found] += seconds
      continue
    track = (e.get("pid"), e.get("tid"))
    if e.get("pid") not in devices or "XLA Modules" in threads.get(track, ""):
      continue
    if ops_tracks and track not in ops_tracks:
      continue
    found = device_kind(module, e, seq_len)
    totals[found] += seconds
    if found == UNATTRIBUTED:
      unnamed[e["name"]] += seconds
  return dict(totals), dict(unnamed)


def profile(run, steps: int, keep: str = "") -> tuple[dict[str, float], float, dict]:
  """(seconds per step of each kind, wall seconds per step, unattributed kernels' seconds per
  step by name) of `steps` traced steps of `run` (an `Ours`), after two warm-up steps; `keep`:
  a path stem to copy the Perfetto trace to (KEEP.perfetto.json.gz) and to write the optimized
  HLO to (KEEP.hlo.txt.gz)."""

  text = run.step.as_text()
  module = Module(text)
  if keep:
    with gzip.open(keep + ".hlo.txt.gz", "wt") as f:
      f.write(text)
  run(2)
  with tempfile.TemporaryDirectory() as out:
    t = time.perf_counter()
    with jax.profiler.trace(out, create_perfetto_trace=True):
      run(steps)
    wall = (time.perf_counter() - t) / steps
    path = glob.glob(os.path.join(out, "**", "perfetto_trace.json.gz"), recursive=True)[0]
    if keep:
      shutil.copyfile(path, keep + ".perfetto.json.gz")
    with gzip.open(path) as f:
      trace = json.load(f)
  events = trace["traceEvents"] if isinstance(trace, dict) else trace
  totals, unnamed = attribute(events, module, run.batch["inputs"].shape[-1], steps)
  return totals, wall, unnamed


PROFILED = {**baseline.SIZES, **baseline.SHAPES}  # the matched models and issue 25's shapes


def table(totals: dict, unnamed: dict) -> list[str]:
  """The markdown table of the kinds, most time first, and the largest unattributed kernels."""
  total = sum(totals.values())
  out = [f"{total * 1e3:.1f} ms/step of kernel time over all threads",
         "| work | ms/step | share |", "|---|---|---|"]
  out += [f"| {k} | {totals[k] * 1e3:.1f} | {totals[k] / total:.1%} |"
          for k in sorted(totals, key=totals.get, reverse=True)]
  for name in sorted(unnamed, key=unnamed.get, reverse=True)[:5]:
    out.append(f"  unattributed: {unnamed[name] * 1e3:.2f} ms/step in {name[:100]}")
  return out


def build_parser():
  parser = CliParser("bench/step_profile.py", __doc__, config=False)
  parser.add_argument("--steps", type=int, default=2)
  parser.add_argument("--keep", default="", metavar="DIR",
                      help="keep each trace and optimized HLO in DIR (<size>.perfetto.json.gz, "
                      "<size>.hlo.txt.gz)")
  baseline.add_size_args(parser, "models to profile, of " + ", ".join(PROFILED)
                         + " (default 3m,25m), or none: --config as it is")
  return parser


def main(argv=None):
  platforms.choose()
  try:  # a mistake in the command line or config: one line, exit 2
    args, configs = baseline.load_sized(build_parser(), argv, sizes=PROFILED)
  except ConfigError as e:
    print(f"error: {e}", file=sys.stderr)
    return 2
  for label, cfg in configs:
    keep = ""
    if args.keep:
      os.makedirs(args.keep, exist_ok=True)
      keep = os.path.join(args.keep, os.path.basename(label).removesuffix(".py"))
    totals, wall, unnamed = profile(baseline.Ours(cfg), args.steps, keep)
    print(f"\n{label}: {baseline.describe(cfg)}; {wall * 1e3:.0f} ms/step wall")
    print("\n".join(table(totals, unnamed)))
  return 0


if __name__ == "__main__":
  sys.exit(main())

"""Where the train step's time goes: a jax.profiler trace of the compiled step, by kind of work.

    python bench/step_profile.py [--size 3m,25m] [--steps 2] [--config.a.b=v ...]
    python bench/step_profile.py --size none --config configs/lm_small.py
    python bench/step_profile.py --size d768-s1024 --keep DIR   # a GPU; issue 25's shapes

Compiles the step train.py runs (bench/baseline.py's `Ours`, one device, the matched sizes by
default), runs two warm-up steps, then traces `--steps` steps with `jax.profiler` (a Perfetto
trace in a temporary directory) and adds up the time of each compiled kernel (XLA's thunks on
CPU, its fused ops elsewhere), sorted into kinds of work from the optimized HLO: matmuls inside
the layers (projections and MLP) and of attention (the batched ones over heads), the
attention's softmax and mask, the layers' other elementwise work, the copies and zero-fills of
the layer scan's stacked residuals, the LM head, embedding and loss, and everything after the
gradient (optimizer, clipping, guard, norms, metrics). The kinds come from each kernel's
`op_name` (forward or backward, inside the layer loop or not) and whether it contains a dot:
a heuristic, good to a few percent. Times are summed over threads (the cores' work), per
step; the runtime's own events (thread-pool waits, loops as a whole) are left out. On a GPU or
TPU only the device's own tracks count (its kernels, named by their HLO instruction or carrying
it as `hlo_op`), not the host threads that launch them; the kernel time no HLO instruction
claims is printed as "unattributed". `--size` also takes issue 25's shapes (bench/baseline.py's
SHAPES); `--keep DIR` keeps each traced Perfetto file as DIR/<size>.perfetto.json.gz and the
optimized HLO of the step as DIR/<size>.hlo.txt.gz.
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

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))  # the repository
from bench import baseline  # noqa: E402

from models.attention import CAUSAL_BLOCK  # noqa: E402

KINDS = ("layer matmuls (q, k, v, o, MLP)", "attention matmuls (QK^T, PV)",
         "attention softmax and mask", "layer elementwise (norms, RoPE, SwiGLU, residuals)",
         "scan: stacked residuals (zero-fill, copies)", "LM head matmul",
         "embedding, cross-entropy", "after the gradient (optimizer, clip, guard, norms)")
CONTAINERS = ("while", "conditional", "call")  # their events span the kernels they run


class Hlo:
  """The instructions of an optimized HLO module's text: name -> (shape, opcode, line)."""

  def __init__(self, text: str):
    self.computations, self.inst, current = {}, {}, None
    for line in text.splitlines():
      m = re.match(r"^(?:ENTRY )?%(\S+) .*\{$", line)
      if m:
        current = self.computations.setdefault(m.group(1), [])
        continue
      if current is not None:
        current.append(line)
        m = re.match(r"\s*(?:ROOT )?%(\S+) = (\S+) (\S+?)\(", line)
        if m:
          self.inst[m.group(1)] = (m.group(2), m.group(3), line)

  def dots(self, name: str, depth: int = 0) -> list[str]:
    """The dot instructions of `name` and of the computations it calls (fusion bodies)."""
    line = self.inst[name][2]
    found = [line] if self.inst[name][1] == "dot" else []
    for called in re.findall(r"calls=%([\w.\-]+)", line) if depth < 3 else []:
      for body_line in self.computations.get(called, []):
        m = re.match(r"\s*(?:ROOT )?%(\S+) = ", body_line)
        if m and m.group(1) in self.inst and m.group(1) != name:
          found += self.dots(m.group(1), depth + 1)
    return found

  def kind(self, name: str, seq_len: int) -> str | None:
    """The kind of work of kernel `name`; None for loops and calls (their events contain
    their kernels') and for what is not a kernel of this program."""
    if name not in self.inst or self.inst[name][1] in CONTAINERS:
      return None
    shape, opcode, line = self.inst[name]
    op_name = (re.search(r'op_name="([^"]*)"', line) or [None, ""])[1]
    dims = [int(d) for d in re.findall(r"\d+", shape.split("{")[0])]
    # [..., S, S] scores, or a causal query block's [..., c, (i + 1) c] (models/attention.py)
    square = (len(dims) >= 4 and dims[-2] in (seq_len, CAUSAL_BLOCK) and dims[-1] <= seq_len
              and dims[-1] % dims[-2] == 0)
    if name.startswith("wrapped_broadcast") or (opcode == "copy" and len(dims) >= 4):
      return KINDS[4]
    if "jvp" not in op_name and "while" not in op_name and "closed_call" not in op_name:
      return KINDS[7]
    dots = self.dots(name)
    if "while/body" in op_name or "closed_call" in op_name:  # the layers, scanned or unrolled
      if dots:
        return KINDS[1] if square or any("lhs_batch_dims" in d for d in dots) else KINDS[0]
      if square or "softmax" in op_name:
        return KINDS[2]
      if "dynamic-update-slice" in name:
        return KINDS[4]
      return KINDS[3]
    return KINDS[5] if dots else KINDS[6]


def device_pids(events) -> set:
  """The trace's processes that are accelerators (their kernels), empty on a CPU."""
  return {e["pid"] for e in events if e.get("ph") == "M" and e.get("name") == "process_name"
          and re.search(r"/device:(GPU|TPU)", str(e.get("args", {}).get("name", "")))}


def profile(run, steps: int, keep: str = "") -> tuple[dict[str, float], float]:
  """(seconds per step of each kind, wall seconds per step) of `steps` traced steps of `run`
  (an `Ours`), after two warm-up steps; `keep`: a path stem to copy the Perfetto trace to
  (KEEP.perfetto.json.gz) and to write the optimized HLO to (KEEP.hlo.txt.gz)."""
  import time  # noqa: PLC0415

  import jax  # noqa: PLC0415
  text = run.step.as_text()
  hlo = Hlo(text)
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
  seq_len = run.batch["inputs"].shape[-1]
  devices = device_pids(events)
  totals = collections.Counter()
  for e in events:  # complete events of compiled kernels (not the runtime's or Python's)
    if e.get("ph") != "X" or (devices and e.get("pid") not in devices):
      continue
    name = e.get("args", {}).get("hlo_op") or e["name"]
    kind = hlo.kind(name, seq_len)
    if kind is None and devices and name not in hlo.inst:
      kind = "unattributed"
    if kind is not None:
      totals[kind] += e["dur"] * 1e-6 / steps
  return dict(totals), wall


PROFILED = {**baseline.SIZES, **baseline.SHAPES}  # the matched models and issue 25's shapes


def build_parser():
  from trainer.cli import CliParser  # noqa: PLC0415
  parser = CliParser("bench/step_profile.py", __doc__, config=False)
  parser.add_argument("--steps", type=int, default=2)
  parser.add_argument("--keep", default="", metavar="DIR",
                      help="keep each trace and optimized HLO in DIR (<size>.perfetto.json.gz, "
                      "<size>.hlo.txt.gz)")
  baseline.add_size_args(parser, "models to profile, of " + ", ".join(PROFILED)
                         + " (default 3m,25m), or none: --config as it is")
  return parser


def main(argv=None):
  from trainer import platforms  # noqa: PLC0415
  platforms.choose()
  from trainer.config import ConfigError  # noqa: PLC0415
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
    totals, wall = profile(baseline.Ours(cfg), args.steps, keep)
    total = sum(totals.values())
    print(f"\n{label}: {baseline.describe(cfg)}; {wall * 1e3:.0f} ms/step wall, "
          f"{total * 1e3:.0f} ms/step of kernel time over all threads")
    print("| work | ms/step | share |\n|---|---|---|")
    for kind in sorted(totals, key=totals.get, reverse=True):
      print(f"| {kind} | {totals[kind] * 1e3:.0f} | {totals[kind] / total:.1%} |")
  return 0


if __name__ == "__main__":
  sys.exit(main())

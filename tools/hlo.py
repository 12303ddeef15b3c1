"""The kernels of an optimized (compiled) HLO module, with the bytes each moves and the FLOPs of
its matmuls, read from the module's text.

    from tools.hlo import Module
    module = Module(compiled.as_text())
    for k in module.kernels():
      print(k.name, k.trips, k.bytes, k.total_flops, k.op_name)

Every instruction that launches device work is a `Kernel`, weighted by the trips of the loops
around it; its bytes are its operands read and results written (a slice where it reads or
updates one), its FLOPs those of dots, cuBLAS GEMMs and cuDNN attention (elementwise work is not
counted), and `Kernel.seconds` its roofline at a device's rates: a count where XLA's cost
analysis is missing or counts a loop body once. Used by bench/compiled.py (`diff`),
tests/test_step_overhead.py (`passes_over`) and bench/step_profile.py (`Module.lookup`).
Why and the counting rules: docs/performance.md#kernels-counted-from-the-hlo
"""
from __future__ import annotations

import collections
import dataclasses
import json
import math
import re

DTYPE_BYTES = {"pred": 1, "s4": 0.5, "u4": 0.5, "s8": 1, "u8": 1, "f8e4m3fn": 1, "f8e5m2": 1,
               "f8e4m3": 1, "f8e5m2fnuz": 1, "f8e4m3fnuz": 1, "f8e4m3b11fnuz": 1, "bf16": 2,
               "f16": 2, "s16": 2, "u16": 2, "f32": 4, "s32": 4, "u32": 4, "f64": 8, "s64": 8,
               "u64": 8, "c64": 8, "c128": 16, "token": 0}
ARRAY_RE = re.compile(r"\b([a-z]+[0-9a-z]*)\[([\d,]*)\]")
INST_RE = re.compile(r"^\s*(ROOT )?%(\S+) = (.*?) ([a-z][a-z0-9\-]*)\((.*)$")
COMP_RE = re.compile(r"^(ENTRY )?%(\S+) .*\{\s*$")
# Instructions that launch nothing: views, tuples, parameters, constants, control.
FREE = {"parameter", "get-tuple-element", "tuple", "bitcast", "constant", "after-all",
        "partition-id", "replica-id", "opt-barrier", "add-dependency", "domain"}
CONTAINERS = {"while", "call", "conditional"}  # their work is the kernels they run
SLICING = {"dynamic-slice", "slice", "gather"}
GEMM_CALLS = ("__cublas$gemm", "__cublas$lt$matmul", "__cublas$lt$matmul$f8")
FP8_GEMM = "__cublas$lt$matmul$f8"


def arrays(shape: str) -> list[tuple[str, tuple[int, ...]]]:
  """[(dtype, dims)] of a shape's arrays (one for an array, several for a tuple)."""
  return [(t, tuple(int(d) for d in dims.split(",") if d)) for t, dims in ARRAY_RE.findall(shape)
          if t in DTYPE_BYTES]


def shape_bytes(shape: str) -> float:
  return sum(DTYPE_BYTES[t] * math.prod(d) for t, d in arrays(shape))


@dataclasses.dataclass
class Instruction:
  name: str
  shape: str
  opcode: str
  operands: list[str]
  line: str
  computation: str
  root: bool = False

  @property
  def bytes(self) -> float:
    return shape_bytes(self.shape)

  @property
  def called(self) -> list[str]:
    """The computations it calls (a fusion's body, a loop's body, a conditional's branches)."""
    names = re.findall(r"(?:calls|body|to_apply|true_computation|false_computation)="
                       r"%([\w.\-]+)", self.line)
    m = re.search(r"branch_computations=\{([^}]*)\}", self.line)
    return names + (re.findall(r"%([\w.\-]+)", m.group(1)) if m else [])

  @property
  def op_name(self) -> str:
    """The jax operation it comes from (`metadata={op_name=...}`), "" if none."""
    m = re.search(r'op_name="([^"]*)"', self.line)
    return m.group(1) if m else ""

  @property
  def backend_config(self) -> dict:
    m = re.search(r"backend_config=(\{.*\})(?:, [a-z_]+=|\s*$)", self.line)
    try:
      return json.loads(m.group(1)) if m else {}
    except ValueError:
      return {}

  @property
  def custom_call_target(self) -> str:
    m = re.search(r'custom_call_target="([^"]*)"', self.line)
    return m.group(1) if m else ""

  @property
  def fusion_kind(self) -> str:
    m = re.search(r"\bkind=(k\w+)", self.line)
    return m.group(1) if m else ""


@dataclasses.dataclass
class Kernel:
  """One launch of device work, `trips` times a step: instruction `name` of the module."""
  name: str
  opcode: str  # fusion, custom-call, copy, ...
  target: str  # a custom call's target, or a fusion's kind (kLoop, kInput, kCustom, ...)
  shape: str  # its result
  trips: int  # launches per step (the product of the enclosing loops' trip counts)
  read: float  # bytes read per launch
  written: float  # bytes written per launch
  flops: float  # matmul FLOPs per launch
  op_name: str
  loop: str  # the innermost while loop it runs in ("" = the entry computation)

  @property
  def bytes(self) -> float:
    """Bytes moved per step (all launches)."""
    return (self.read + self.written) * self.trips

  @property
  def total_flops(self) -> float:
    return self.flops * self.trips

  def seconds(self, peak_flops: float, bandwidth: float) -> float:
    """Per step, at the device's rates: the larger of its compute and its memory time."""
    return max(self.total_flops / peak_flops, self.bytes / bandwidth)

  def signature(self) -> tuple:
    """What makes two kernels the same work in two programs (names differ between programs):
    the operation (a custom call's target; not a fusion's kind, which is how XLA emits it),
    its result shape, launches per step and the bytes it moves (to 0.1%)."""
    dims = tuple(d for _, d in arrays(self.shape))
    rnd = lambda b: float(f"{b:.3g}")
    target = self.target if self.opcode == "custom-call" else ""
    return (self.opcode, target, dims, self.trips, rnd(self.read), rnd(self.written))

  def describe(self) -> str:
    """Its source operation (the end of the op_name, where the jax function is named) and
    result, for a report line."""
    what = self.op_name.replace("jit(step)/", "") or self.name
    what = re.sub(r"(transpose\()?jvp\(\)\)?/", lambda m: "bwd " if m.group(1) else "", what)
    return f"{what[-70:]} -> {self.shape.split('{')[0][:60]}"


class Module:
  """The computations and instructions of an optimized HLO module's text."""

  def __init__(self, text: str):
    self.computations: dict[str, list[Instruction]] = {}
    self.inst: dict[str, Instruction] = {}
    self.roots: dict[str, str] = {}
    self.entry = None
    current = None
    for line in text.splitlines():
      m = COMP_RE.match(line)
      if m:
        current = m.group(2)
        self.computations[current] = []
        self.entry = current if m.group(1) else self.entry
        continue
      m = INST_RE.match(line) if current else None
      if m:
        operands = re.findall(r"%([\w.\-]+)", _call_args(m.group(5)))
        inst = Instruction(m.group(2), m.group(3), m.group(4), operands, line, current,
                           bool(m.group(1)))
        self.computations[current].append(inst)
        self.inst[inst.name] = inst
        if inst.root:
          self.roots[current] = inst.name

  def kernels(self) -> list[Kernel]:
    """Every launch of device work, in program order, with its launches per step."""
    out: list[Kernel] = []
    self._walk(self.entry, 1, "", out)
    return out

  def lookup(self, name: str) -> Instruction | None:
    """The instruction a profiled kernel is named after: its HLO name, or the name a GPU
    kernel gets from it (dots and dashes as underscores, e.g. loop_add_fusion_3)."""
    if name in self.inst:
      return self.inst[name]
    if not hasattr(self, "_by_kernel_name"):
      self._by_kernel_name = {re.sub(r"[.\-]", "_", n): i for n, i in self.inst.items()}
    return self._by_kernel_name.get(re.sub(r"[.\-]", "_", name))

  # -- the walk and each kernel's costs --------------------------------------------------------

  def _walk(self, computation: str, trips: int, loop: str, out: list) -> None:
    for inst in self.computations.get(computation, []):
      if inst.opcode in FREE:
        continue
      if inst.opcode == "while":
        n = int(inst.backend_config.get("known_trip_count", {}).get("n", 1))
        body = re.search(r"\bbody=%([\w.\-]+)", inst.line).group(1)
        self._walk(body, trips * n, inst.name, out)
      elif inst.opcode in CONTAINERS:
        for called in inst.called:
          self._walk(called, trips, loop, out)
      elif inst.opcode == "fusion":
        read, written = self._fusion_bytes(inst)
        flops = sum(self._dot_flops(c) for c in inst.called)
        out.append(Kernel(inst.name, "fusion", inst.fusion_kind, inst.shape, trips, read,
                          written, flops, inst.op_name, loop))
      else:
        read = sum(self.inst[o].bytes for o in inst.operands if o in self.inst)
        flops = (self._custom_call_flops(inst) if inst.opcode == "custom-call" else
                 self._flops_of_dot(inst) if inst.opcode == "dot" else 0.0)
        out.append(Kernel(inst.name, inst.opcode, inst.custom_call_target, inst.shape, trips,
                          read, inst.bytes, flops, inst.op_name, loop))

  def _fusion_bytes(self, inst: Instruction) -> tuple[float, float]:
    """(read, written) of a fusion: an operand read only through slices counts its slices, an
    operand updated in place by a dynamic-update-slice counts nothing read and its update
    written."""
    body = inst.called[0] if inst.called else None
    params: dict[str, int] = {}
    users = collections.defaultdict(list)
    for i in self.computations.get(body, []):
      if i.opcode == "parameter":
        params[i.name] = int(re.search(r"parameter\((\d+)\)", i.line).group(1))
      for o in i.operands:
        users[o].append(i)
    root = self.inst.get(self.roots.get(body, ""))
    outputs = ([] if root is None else [self.inst[o] for o in root.operands]
               if root.opcode == "tuple" else [root])
    in_place, written = set(), 0.0
    for out in outputs:
      if out.opcode == "dynamic-update-slice" and out.operands[0] in params:
        in_place.add(out.operands[0])
        written += self.inst[out.operands[1]].bytes
      else:
        written += out.bytes
    read = 0.0
    for name, index in params.items():
      if name in in_place or index >= len(inst.operands):
        continue
      uses = users.get(name, [])
      if uses and all(u.opcode in SLICING and u.operands[0] == name for u in uses):
        read += sum(u.bytes for u in uses)
      elif inst.operands[index] in self.inst:
        read += self.inst[inst.operands[index]].bytes
    return read, written

  def _dot_flops(self, computation: str, depth: int = 0) -> float:
    """FLOPs of the dots in a fusion's body (and in the computations it nests)."""
    flops = 0.0
    for i in self.computations.get(computation, []):
      if i.opcode == "dot":
        flops += self._flops_of_dot(i)
      elif depth < 4 and i.opcode == "fusion":
        flops += sum(self._dot_flops(c, depth + 1) for c in i.called)
    return flops

  def _flops_of_dot(self, inst: Instruction) -> float:
    lhs = arrays(self.inst[inst.operands[0]].shape)[0][1] if inst.operands[0] in self.inst else ()
    m = re.search(r"lhs_contracting_dims=\{([\d,]*)\}", inst.line)
    k = math.prod(lhs[int(d)] for d in m.group(1).split(",") if d) if m and lhs else 1
    return 2.0 * math.prod(arrays(inst.shape)[0][1]) * k

  def _custom_call_flops(self, inst: Instruction) -> float:
    target = inst.custom_call_target
    if target in GEMM_CALLS:
      dims = inst.backend_config.get("gemm_backend_config", {}).get("dot_dimension_numbers", {})
      lhs = arrays(self.inst[inst.operands[0]].shape)[0][1]
      k = math.prod(lhs[int(d)] for d in dims.get("lhs_contracting_dimensions", []))
      return 2.0 * math.prod(arrays(inst.shape)[0][1]) * k
    if target.startswith("__cudnn$fmha"):
      q = arrays(self.inst[inst.operands[0]].shape)[0][1]  # [B, S, H, D]
      kv_len = arrays(self.inst[inst.operands[1]].shape)[0][1][1]
      cfg = inst.backend_config.get("cudnn_fmha_backend_config", {})
      causal = 0.5 if "CAUSAL" in str(cfg.get("mask_type", "")) else 1.0
      forward = 4.0 * math.prod(q) * kv_len * causal
      return 2.5 * forward if "Backward" in target else forward
    return 0.0


def _call_args(rest: str) -> str:
  """The text of an instruction's operand list (up to its closing parenthesis)."""
  depth = 1
  for i, ch in enumerate(rest):
    depth += ch == "("
    depth -= ch == ")"
    if depth == 0:
      return rest[:i]
  return rest


def passes_over(module: Module, shapes) -> int:
  """Kernel launches per step that read or write a whole array of one of `shapes` (e.g. the
  parameters'): the passes over the train state that a step makes, however they are fused."""
  want = {tuple(s) for s in shapes}
  n = 0
  for k in module.kernels():
    inst = module.inst[k.name]
    touched = [d for _, d in arrays(inst.shape)]
    touched += [d for o in inst.operands if o in module.inst
                for _, d in arrays(module.inst[o].shape)]
    n += k.trips * any(d in want for d in touched)
  return n


def diff(ours: list[Kernel], other: list[Kernel]) -> tuple[list[Kernel], list[Kernel]]:
  """(kernels of `ours` with no counterpart in `other`, and the other way round), matched by
  `Kernel.signature` as a multiset: the work one program does that the other does not."""
  a = collections.Counter(k.signature() for k in ours)
  b = collections.Counter(k.signature() for k in other)

  def unmatched(kernels, left):
    left, out = dict(left), []
    for k in kernels:
      if left.get(k.signature(), 0) > 0:
        left[k.signature()] -= 1
        out.append(k)
    return out

  return unmatched(ours, a - b), unmatched(other, b - a)


def custom_calls(module: Module) -> collections.Counter:
  """Launches per step of each custom call target (cuBLAS GEMMs, cuDNN attention, Pallas'
  Triton and Mosaic GPU kernels) in the program."""
  counts = collections.Counter()
  for k in module.kernels():
    if k.opcode == "custom-call":
      counts[k.target] += k.trips
  return counts

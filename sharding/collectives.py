"""The collectives of a compiled XLA program, the devices each one joins, and its bytes.

`collectives(hlo_text)` reads the optimized HLO (`jax.stages.Compiled.as_text()`) and lists
every all-reduce, all-gather, reduce-scatter, all-to-all and collective-permute (async forms
included), each with

  bytes   the array it operates on, per device (not what crosses the wire)
  count   runs per execution: 1 x the trip count of every while loop around it (None: unknown)
  groups  the device groups it joins, as positions in the program's device assignment

Transfers between slices (the Megascale runtime's) are `dcn-<type>` ops without groups.
`crossing(ops, labels)` keeps the ops whose groups join devices of different labels (DiLoCo's
replicas, pipeline stages); `unattributed` lists the transfers it cannot place.
Why and details: docs/sharding.md#counting-collectives
"""
from __future__ import annotations

import dataclasses
import math
import re
from collections.abc import Sequence

import numpy as np

KINDS = ("all-reduce", "all-gather", "reduce-scatter", "all-to-all", "collective-permute",
         "ragged-all-to-all")
_BYTES = {"pred": 1, "s8": 1, "u8": 1, "f8e4m3fn": 1, "f8e5m2": 1, "f8e4m3": 1, "f8e5m2fnuz": 1,
          "f8e4m3fnuz": 1, "s16": 2, "u16": 2, "f16": 2, "bf16": 2, "s32": 4, "u32": 4, "f32": 4,
          "s64": 8, "u64": 8, "f64": 8, "c64": 8, "c128": 16, "s4": 0.5, "u4": 0.5}
_ARRAY = re.compile(r"\b([a-z]+[0-9]*[a-z0-9]*)\[([0-9,]*)\]")
_INSTRUCTION = re.compile(
    r"^\s*(?:ROOT\s+)?%?\S+\s*=\s*(.*?)\s+(" + "|".join(KINDS) + r")(-start)?\((.*)$")
# Multi-slice TPU programs reduce across slices with host transfers run by the Megascale runtime
# (`send`s marked xla_megascale_runtime, one per reduced array, and their `recv`s).
_MEGASCALE = re.compile(r'^\s*%?\S+\s*=\s*\(\s*([a-z0-9]+\[[0-9,]*\]).*\bsend\('
                        r'.*xla_megascale_runtime(?:.*_xla_megascale_transfer_type="(\w+)")?')
_COMPUTATION = re.compile(r"^(ENTRY\s+)?%([\w.\-]+)\s+\(.*\{\s*$")
_CALLS = re.compile(r"\b(?:calls|to_apply|body|condition|true_computation|false_computation)"
                    r"=%?([\w.\-]+)")
_BRANCHES = re.compile(r"branch_computations=\{([^}]*)\}")
_TRIP = re.compile(r'"known_trip_count":\{"n":"(\d+)"\}')


@dataclasses.dataclass(frozen=True)
class Collective:
  kind: str
  bytes: float  # per device, per run (module docstring)
  count: int | None  # runs per execution of the program; None: in a loop of unknown trip count
  groups: tuple[tuple[int, ...], ...]  # device positions; () = every device in one group
  line: str  # the HLO instruction, shortened (for messages)

  @property
  def total_bytes(self) -> float | None:
    return None if self.count is None else self.bytes * self.count


def _array_bytes(text: str) -> list[float]:
  """Bytes of each array type in `text` (a result type: one array or a tuple of them)."""
  out = []
  for dtype, dims in _ARRAY.findall(text):
    if dtype in _BYTES:
      out.append(_BYTES[dtype] * math.prod(int(d) for d in dims.split(",") if d))
  return out


def _int_list(text: str) -> list[int]:
  return [int(x) for x in re.findall(r"-?\d+", text)]


def _iota_groups(shape: list[int], dims: list[int], perm: list[int] | None) -> np.ndarray:
  ids = np.arange(math.prod(dims)).reshape(dims)
  if perm:
    ids = ids.transpose(perm)
  return ids.reshape(shape)


def _mesh_groups(text: str) -> np.ndarray:
  """Groups [G, S] of XLA's mesh form: mesh['a'=2,'b'=4](, device_ids=(...)) {'b', 'a':(1)2}."""
  head, axes_text = text[:text.rindex("{")], text[text.rindex("{") + 1:]
  names, sizes = [], []
  for name, size in re.findall(r"'?([\w.]+)'?=(\d+)", head.split("]")[0]):
    names.append(name)
    sizes.append(int(size))
  ids = np.arange(math.prod(sizes)).reshape(sizes)
  device_ids = re.search(r"device_ids=\((.*)\)\s*$", head.strip())
  if device_ids:  # an iota ([dims]T(perm) or [shape]<=[dims]T(perm)) or the ids in order
    listed = device_ids.group(1)
    iota = re.fullmatch(r"\s*\[([\d,]+)\](?:<=\[([\d,]+)\])?(?:T\(([\d,]+)\))?\s*", listed)
    ids = (_iota_groups(sizes, _int_list(iota.group(2) or iota.group(1)),
                        _int_list(iota.group(3) or "")) if iota else
           np.array(_int_list(listed)).reshape(sizes))
  # Split sub-axes: axis a of size n read as (n / (pre * size), size, pre) ... as XLA's
  # AxisRef ':(pre)size' means the `size` devices at stride `pre` along a.
  grouped, dims, names_out = [], [], []
  subaxes = {}
  for ref in (a.strip() for a in axes_text.rstrip("}").split(",") if a.strip()):
    m = re.fullmatch(r"'?([\w.]+)'?(?::\((\d+)\)(\d+))?", ref)
    subaxes.setdefault(m.group(1), []).append(
        (int(m.group(2)), int(m.group(3))) if m.group(2) else None)
  for name, size in zip(names, sizes):
    refs = subaxes.get(name, [])
    if not refs:
      dims.append(size)
      names_out.append((name, None))
      continue
    if refs == [None]:
      dims.append(size)
      names_out.append((name, "all"))
      continue
    # Factor the axis into sub-axes, major to minor: size / next_pre, ..., pre (XLA's order).
    cuts = sorted({1, size} | {p for p, _ in refs} | {p * s for p, s in refs})
    parts = [cuts[i + 1] // cuts[i] for i in range(len(cuts) - 1)][::-1]
    wanted = {p for p, _ in refs}
    for i, part in enumerate(parts):
      pre = size // math.prod(parts[:i + 1])
      dims.append(part)
      names_out.append((name, "all" if pre in wanted else None))
  ids = ids.reshape(dims)
  keep = [i for i, (_, g) in enumerate(names_out) if g is None]
  group = [i for i, (_, g) in enumerate(names_out) if g == "all"]
  ids = ids.transpose(keep + group)
  return ids.reshape(math.prod(dims[i] for i in keep), math.prod(dims[i] for i in group))


def parse_groups(rest: str) -> tuple[tuple[int, ...], ...]:
  """The device groups named in the text after a collective's opcode."""
  pairs = re.search(r"source_target_pairs=\{((?:\{[\d,\s]*\},?\s*)*)\}", rest)
  if pairs:
    return tuple(tuple(_int_list(p)) for p in re.findall(r"\{([\d,\s]*)\}", pairs.group(1)))
  m = re.search(r"replica_groups=("
                r"mesh\[[^\]]*\](?:,\s*device_ids=\((?:[^()]|\([^()]*\))*\))?\s*\{[^}]*\}"
                r"|\[[\d,]+\]<=\[[\d,]+\](?:T\([\d,]+\))?"
                r"|\{(?:\{[\d,\s]*\},?\s*)*\})", rest)
  if m is None:
    return ()
  text = m.group(1)
  if text.startswith("mesh"):
    groups = _mesh_groups(text)
  elif text.startswith("["):
    shape, dims, perm = re.fullmatch(r"\[([\d,]+)\]<=\[([\d,]+)\](?:T\(([\d,]+)\))?",
                                     text).groups()
    groups = _iota_groups(_int_list(shape), _int_list(dims), _int_list(perm or ""))
  else:
    return tuple(tuple(_int_list(g)) for g in re.findall(r"\{([\d,\s]*)\}", text[1:-1]))
  return tuple(tuple(int(i) for i in g) for g in groups)


def _computations(hlo_text: str) -> tuple[dict[str, list[str]], str]:
  """{computation name: its instruction lines}, and the entry computation's name. (Some
  instructions span lines: a Mosaic kernel's backend config holds newlines, and its continuation
  lines may start with '}}'; a computation ends at a line that is just '}'.)"""
  comps, entry, current = {}, None, None
  for line in hlo_text.splitlines():
    head = _COMPUTATION.match(line)
    if head:
      current = head.group(2)
      comps[current] = []
      if head.group(1):
        entry = current
    elif line.rstrip() == "}":
      current = None
    elif current is not None:
      comps[current].append(line)
  return comps, entry


def _defs(lines: list[str]) -> dict[str, str]:
  """{instruction name: its line} of one computation."""
  out = {}
  for line in lines:
    m = re.match(r"\s*(?:ROOT\s+)?(%[\w.\-]+)\s*=", line)
    if m:
      out[m.group(1)] = line
  return out


def _through_copies(defs: dict[str, str], name: str) -> str | None:
  """The line defining `name`, looking through copies and bitcasts."""
  for _ in range(4):
    line = defs.get(name)
    hop = line and re.search(r"\b(?:copy|bitcast|convert)\((%[\w.\-]+)\)", line)
    if not hop:
      return line
    name = hop.group(1)
  return None


def _constant(defs: dict[str, str], name: str) -> int | None:
  line = _through_copies(defs, name)
  m = line and re.search(r"\bconstant\((-?\d+)\)", line)
  return int(m.group(1)) if m else None


def _trip_count(comps: dict[str, list[str]], parent: list[str], line: str) -> int | None:
  """The trip count of the while loop `line` (in computation `parent`): XLA's
  known_trip_count when it says (CPU and GPU programs), else read from the loop the way jax
  writes it (TPU programs carry no count): the condition compares a counter, tuple element i,
  with a constant (LT or LE), and element i of the loop's initial tuple is a constant. None
  when the loop is not of that form."""
  known = _TRIP.search(line)
  if known:
    return int(known.group(1))
  cond = re.search(r"condition=%?([\w.\-]+)", line)
  init = re.search(r"\bwhile\((%[\w.\-]+)\)", line)
  if not cond or not init or cond.group(1) not in comps:
    return None
  cdefs = _defs(comps[cond.group(1)])
  root = next((l for l in comps[cond.group(1)] if l.lstrip().startswith("ROOT")), "")
  cmp = re.search(r"compare\((%[\w.\-]+),\s*(%[\w.\-]+)\).*direction=(LT|LE)", root)
  if not cmp:
    return None
  gte = _through_copies(cdefs, cmp.group(1)) or ""
  index = re.search(r"get-tuple-element\(%[\w.\-]+\),\s*index=(\d+)", gte)
  bound = _constant(cdefs, cmp.group(2))
  pdefs = _defs(parent)
  init_line = re.sub(r"/\*.*?\*/", "", pdefs.get(init.group(1), ""))  # drop /*index=5*/
  tup = re.search(r"\btuple\((.*?)\)(?:,|$)", init_line)
  if index is None or bound is None or tup is None:
    return None
  operands = [o.strip() for o in tup.group(1).split(",")]
  i = int(index.group(1))
  start = _constant(pdefs, operands[i]) if i < len(operands) else None
  if start is None:
    return None
  return max(bound - start + (cmp.group(3) == "LE"), 0)


def _runs(comps: dict[str, list[str]], entry: str) -> dict[str, int | None]:
  """How often each computation reachable from the entry runs per execution (loop bodies times
  their trip counts, `_trip_count`; None where a loop's count is unknown)."""
  runs: dict[str, int | None] = {}

  def visit(name: str, times: int | None):
    if name not in comps:
      return
    before = runs.get(name, 0)
    runs[name] = None if before is None or times is None else before + times
    for line in comps[name]:
      is_while = re.search(r"\bwhile\(", line) is not None
      trip = _trip_count(comps, comps[name], line) if is_while else None
      for callee in _CALLS.findall(line):
        loop = is_while and re.search(rf"\b(?:body|condition)=%?{re.escape(callee)}\b", line)
        n = trip if loop else 1
        visit(callee, None if times is None or n is None else times * n)
      for branches in _BRANCHES.findall(line):
        for callee in re.findall(r"%?([\w.\-]+)", branches):
          visit(callee, times)

  visit(entry, 1)
  return runs


def collectives(hlo_text: str) -> list[Collective]:
  """Every collective of the compiled program `hlo_text`, with its bytes, runs and groups."""
  comps, entry = _computations(hlo_text)
  runs = _runs(comps, entry) if entry else {}
  out = []
  for name, lines in comps.items():
    if name not in runs:
      continue
    for line in lines:
      dcn = _MEGASCALE.match(line)
      if dcn is not None:  # a transfer between slices: one array, no device groups named
        kind = "dcn-" + (dcn.group(2) or "transfer").lower().replace("_", "-")
        out.append(Collective(kind, float(_array_bytes(dcn.group(1))[0]), runs[name], (),
                              line.strip()[:160]))
        continue
      m = _INSTRUCTION.match(line)
      if m is None:
        continue
      result, kind, start, rest = m.groups()
      sizes = _array_bytes(result)
      if start and kind in ("all-gather", "collective-permute", "all-to-all"):
        # (operands..., results..., [u32 contexts]): the results are the second half
        sizes = [b for b, t in zip(sizes, _ARRAY.findall(result)) if t[1] or t[0] not in
                 ("u32", "s32")]
        sizes = sizes[len(sizes) // 2:]
      groups = parse_groups(rest)
      size = float(sum(sizes))
      if kind == "reduce-scatter":
        size *= max((len(g) for g in groups), default=1) if groups else 1
      out.append(Collective(kind, size, runs[name], groups, line.strip()[:160]))
  return out


def is_dcn(op: Collective) -> bool:
  """A transfer between slices (module docstring): its groups are unknown, not `{}`."""
  return op.kind.startswith("dcn-")


def spans_slices(labels: Sequence, slices: Sequence | None) -> bool:
  """Whether some label's devices lie in more than one slice (`slices`: the slice of each device
  position; None: one slice)."""
  if slices is None:
    return False
  seen: dict = {}
  return any(seen.setdefault(label, s) != s for label, s in zip(labels, slices))


def crossing(ops: Sequence[Collective], labels: Sequence,
             slices: Sequence | None = None) -> list[Collective]:
  """The collectives some group of which joins devices of different `labels` (one label per
  device position of the program). A group-less op (`{}`: all devices) crosses any two labels;
  a transfer between slices does when no label spans two `slices` (those it cannot place are
  `unattributed`; docs/sharding.md#counting-collectives)."""
  distinct = len(set(labels)) > 1
  dcn_crosses = distinct and not spans_slices(labels, slices)
  out = []
  for op in ops:
    if is_dcn(op):
      if dcn_crosses:
        out.append(op)
      continue
    groups = op.groups or ((),)
    if any(len({labels[i] for i in g}) > 1 if g else distinct for g in groups):
      out.append(op)
  return out


def unattributed(ops: Sequence[Collective], labels: Sequence,
                 slices: Sequence | None = None) -> list[Collective]:
  """The transfers between slices that `crossing` cannot place: with more than one label and a
  label spanning several slices, the HLO does not say whether a transfer joins two labels."""
  if len(set(labels)) < 2 or not spans_slices(labels, slices):
    return []
  return [op for op in ops if is_dcn(op)]


def total_bytes(ops: Sequence[Collective]) -> float | None:
  """Bytes per device per execution summed over `ops`; None if one runs an unknown number of
  times."""
  totals = [op.total_bytes for op in ops]
  return None if any(t is None for t in totals) else float(sum(totals))


def format_bytes(n: float | None, unknown: str = "? B") -> str:
  """A byte count for reports (3 significant digits, decimal units); `unknown` for None."""
  if n is None:
    return unknown
  for unit, scale in (("GB", 1e9), ("MB", 1e6), ("kB", 1e3)):
    if n >= scale:
      return f"{n / scale:.3g} {unit}"
  return f"{n:.0f} B"

"""What a sharded train step communicates, under variants of one config key: the collectives of
the compiled program, counted by kind with the bytes they produce.

    python bench/collectives.py --vary optim.name=adamw,muon [--mesh fsdp=4,tensor=2]
        [--size 3m] [--config.a.b=v ...]

Each variant is the compiled step train.py runs (`trainer/program.py`) on a mesh of fake CPU
devices (`--mesh`, axis=size pairs; the device count is their product), compiled and never
run: the numbers are read from the optimized HLO, so they are exact for XLA's CPU SPMD
partitioner, and the same partitioner (GSPMD/Shardy) decides the collectives on GPU and TPU,
whose backends may still combine or reorder them. Per variant: the number of all-gather,
all-reduce, reduce-scatter, all-to-all and collective-permute ops and the bytes of their
results on one device (the partitioned program's shapes are per device: for an all-reduce the
bytes reduced, for an all-gather the gathered array), then the difference from the first
variant; and each variant's FLOPs per device from XLA's cost analysis (`tools.aot`). Counts
are per step program (a micro-batched step's loop body counted once).
"""
from __future__ import annotations

import math
import os
import re
import sys

FAKE_DEVICES = 8  # CPU devices the program is compiled for (set before jax is imported)
os.environ["XLA_FLAGS"] = (os.environ.get("XLA_FLAGS", "") +
                           f" --xla_force_host_platform_device_count={FAKE_DEVICES}").strip()
os.environ.setdefault("JAX_PLATFORMS", "cpu")
sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))  # the repository
from bench import variants as variants_bench  # noqa: E402


KINDS = ("all-gather", "all-reduce", "reduce-scatter", "all-to-all", "collective-permute")
_OP = re.compile(r"\s(" + "|".join(KINDS) + r")(?:-start)?\(")
_SHAPE = re.compile(r"\b(f64|f32|bf16|f16|s64|s32|u32|s16|u16|s8|u8|pred|f8e4m3fn|f8e5m2)"
                    r"\[([0-9,]*)\]")
_BYTES = {"f64": 8, "s64": 8, "f32": 4, "s32": 4, "u32": 4, "bf16": 2, "f16": 2, "s16": 2,
          "u16": 2, "s8": 1, "u8": 1, "pred": 1, "f8e4m3fn": 1, "f8e5m2": 1}


def collectives(hlo_text: str) -> dict[str, tuple[int, int]]:
  """{kind: (ops, bytes of their results)} of an optimized HLO module's text."""
  out = {k: [0, 0] for k in KINDS}
  for line in hlo_text.splitlines():
    m = _OP.search(line)
    if m is None or " = " not in line:
      continue
    result = line.split(" = ", 1)[1][:m.start()]
    size = 0
    for dtype, dims in _SHAPE.findall(result):
      n = 1
      for d in filter(None, dims.split(",")):
        n *= int(d)
      size += n * _BYTES[dtype]
    out[m.group(1)][0] += 1
    out[m.group(1)][1] += size
  return {k: (v[0], v[1]) for k, v in out.items()}


def parse_mesh(text: str) -> dict[str, int]:
  from trainer.config import ConfigError  # noqa: PLC0415
  try:
    mesh = {k: int(v) for k, v in (p.split("=") for p in text.split(",") if p)}
  except ValueError:
    mesh = {}
  if not mesh or math.prod(mesh.values()) > FAKE_DEVICES:
    raise ConfigError(f"--mesh {text!r}: give axis=size pairs of at most {FAKE_DEVICES} devices "
                      "in all, e.g. fsdp=4,tensor=2")
  return mesh


def build_parser():
  from trainer.cli import CliParser  # noqa: PLC0415
  parser = CliParser("bench/collectives.py", __doc__, config=False)
  parser.add_argument("--vary", required=True, metavar="KEY=V1,V2",
                      help="the config key to vary and its values, e.g. optim.name=adamw,muon")
  parser.add_argument("--mesh", default="fsdp=4,tensor=2",
                      help=f"axis=size pairs, at most {FAKE_DEVICES} devices in all")
  variants_bench.baseline.add_size_args(parser)
  return parser


def main(argv=None):
  from trainer import platforms  # noqa: PLC0415
  platforms.choose()
  from trainer.config import ConfigError  # noqa: PLC0415
  baseline = variants_bench.baseline
  try:  # a mistake in the command line or config: one line, exit 2
    args, configs = baseline.load_sized(build_parser(), argv)
    key, values = variants_bench.parse_vary(args.vary)
    mesh = parse_mesh(args.mesh)
    devices = math.prod(mesh.values())
    variants = []
    for _, cfg in configs:
      cfg.mesh.update(mesh)
      variants.append([(v, variants_bench.vary(cfg, key, v, devices)) for v in values])
  except ConfigError as e:
    print(f"error: {e}", file=sys.stderr)
    return 2
  import jax  # noqa: PLC0415

  from sharding.mesh import make_mesh  # noqa: PLC0415
  from tools import aot  # noqa: PLC0415
  from trainer.program import Program  # noqa: PLC0415
  print(f"mesh {args.mesh} on {devices} fake CPU devices; collectives of the compiled step")
  for (label, _), cfgs in zip(configs, variants):
    print(f"\n{label}: {baseline.describe(cfgs[0][1])}")
    counts, flops = {}, {}
    for value, cfg in cfgs:
      program = Program(cfg, make_mesh(cfg.mesh, jax.devices()[:devices]))
      lowered = program.lower()
      compiled = lowered.compile()
      counts[value] = collectives(compiled.as_text())
      loops = aot.while_loops(lowered)
      flops[value] = (aot.compiled_costs(compiled).xla_flops or 0.0,
                      f" (a loop body counted once: {loops} loops)" if loops else "")
    first = counts[values[0]]
    for value, (f, note) in flops.items():
      print(f"  {key}={value}: {f / 1e9:.2f} GFLOP per device (XLA's cost analysis{note}), "
            f"x{f / flops[values[0]][0]:.3f} the first's")
    for value, c in counts.items():
      parts = []
      for kind in KINDS:
        (ops, size), (ops0, size0) = c[kind], first[kind]
        if ops or ops0:
          delta = "" if c is first else f" ({ops - ops0:+d} ops, {(size - size0) / 2**20:+.2f} MiB)"
          parts.append(f"{kind} {ops} ops {size / 2**20:.2f} MiB{delta}")
      print(f"  {key}={value}: " + ("; ".join(parts) or "no collectives"))
  return 0


if __name__ == "__main__":
  sys.exit(main())

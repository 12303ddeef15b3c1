"""What a sharded train step communicates, under variants of one config key: the collectives of
the compiled program, counted by kind with the bytes they produce.

    python bench/collectives.py --vary optim.name=adamw,muon [--mesh fsdp=4,tensor=2]
        [--size 3m] [--config.a.b=v ...]

Each variant is the compiled step train.py runs on a mesh of fake CPU devices (`--mesh`,
axis=size pairs), compiled and never run. Per variant: the number of all-gather, all-reduce,
reduce-scatter, all-to-all and collective-permute ops and the bytes they move per device per
step (read from the optimized HLO by `sharding.collectives`, loop trips counted), the difference
from the first variant, and its FLOPs per device from XLA's cost analysis.
What is exact and what is counted: docs/performance.md#what-a-sharded-step-communicates
"""
from __future__ import annotations

import math
import os
import sys

FAKE_DEVICES = 8  # CPU devices the program is compiled for (set before jax is imported)
os.environ["XLA_FLAGS"] = (os.environ.get("XLA_FLAGS", "") +
                           f" --xla_force_host_platform_device_count={FAKE_DEVICES}").strip()
os.environ.setdefault("JAX_PLATFORMS", "cpu")
sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))  # the repository
from bench import variants as variants_bench  # noqa: E402
from sharding.collectives import collectives, total_bytes  # noqa: E402
import jax  # noqa: E402
from sharding.mesh import make_mesh  # noqa: E402
from tools import aot  # noqa: E402
from trainer.config import ConfigError  # noqa: E402
from trainer.config.cli import CliParser  # noqa: E402
from trainer.multihost import platforms  # noqa: E402
from trainer.step.program import Program  # noqa: E402


KINDS = ("all-gather", "all-reduce", "reduce-scatter", "all-to-all", "collective-permute")


def summarize(hlo_text: str) -> dict[str, tuple[int, float | None]]:
  """{kind: (ops, bytes per device per step)} of an optimized HLO module's text, read by
  `sharding.collectives` (the bytes of each op times the runs of the loops around it; None
  where a loop's trip count is unknown). Kinds outside KINDS (multi-slice transfers) are kept
  under their own names."""
  ops = collectives(hlo_text)
  kinds = list(KINDS) + sorted({op.kind for op in ops} - set(KINDS))
  return {k: (sum(op.kind == k for op in ops), total_bytes([op for op in ops if op.kind == k]))
          for k in kinds}


def parse_mesh(text: str) -> dict[str, int]:
  try:
    mesh = {k: int(v) for k, v in (p.split("=") for p in text.split(",") if p)}
  except ValueError:
    mesh = {}
  if not mesh or math.prod(mesh.values()) > FAKE_DEVICES:
    raise ConfigError(f"--mesh {text!r}: give axis=size pairs of at most {FAKE_DEVICES} devices "
                      "in all, e.g. fsdp=4,tensor=2")
  return mesh


def build_parser():
  parser = CliParser("bench/collectives.py", __doc__, config=False)
  parser.add_argument("--vary", required=True, metavar="KEY=V1,V2",
                      help="the config key to vary and its values, e.g. optim.name=adamw,muon")
  parser.add_argument("--mesh", default="fsdp=4,tensor=2",
                      help=f"axis=size pairs, at most {FAKE_DEVICES} devices in all")
  variants_bench.baseline.add_size_args(parser)
  return parser


def main(argv=None):
  platforms.choose()
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

  print(f"mesh {args.mesh} on {devices} fake CPU devices; collectives of the compiled step")
  for (label, _), cfgs in zip(configs, variants):
    print(f"\n{label}: {baseline.describe(cfgs[0][1])}")
    counts, flops = {}, {}
    for value, cfg in cfgs:
      program = Program(cfg, make_mesh(cfg.mesh, jax.devices()[:devices]))
      lowered = program.lower()
      compiled = lowered.compile()
      counts[value] = summarize(compiled.as_text())
      loops = aot.while_loops(lowered)
      flops[value] = (aot.compiled_costs(compiled).xla_flops or 0.0,
                      f" (a loop body counted once: {loops} loops)" if loops else "")
    first = counts[values[0]]
    for value, (f, note) in flops.items():
      print(f"  {key}={value}: {f / 1e9:.2f} GFLOP per device (XLA's cost analysis{note}), "
            f"x{f / flops[values[0]][0]:.3f} the first's")
    mib = lambda b: "? MiB (a loop of unknown trip count)" if b is None else f"{b / 2**20:.2f} MiB"
    for value, c in counts.items():
      parts = []
      for kind in c:
        (ops, size), (ops0, size0) = c[kind], first.get(kind, (0, 0.0))
        if ops or ops0:
          delta = "" if c is first else f" ({ops - ops0:+d} ops, " + (
              f"{(size - size0) / 2**20:+.2f} MiB)" if None not in (size, size0) else "? MiB)")
          parts.append(f"{kind} {ops} ops {mib(size)}{delta}")
      print(f"  {key}={value}: " + ("; ".join(parts) or "no collectives"))
  return 0


if __name__ == "__main__":
  sys.exit(main())

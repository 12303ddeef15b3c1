"""Issue 25's table: our train step against its peers on one device, at the same shapes, tokens
and optimizer settings, with one MFU formula.

    python bench/peers.py                       # on a GPU: the three shapes of issue 25
    python bench/peers.py --size tiny --torch-compile off   # on a CPU, seconds (tests run this)
    python bench/peers.py --size d768-s1024 --runners ours,torch [--rounds 5] [--steps 5]
        [--nanodo_dir DIR] [--torch-compile default] [--config.a.b=v ...]

Runners (`--runners`, in this order of columns; ours always runs): nanodo, plain, plain-docs,
ours, torch (bench/torch_peer.py; the `hf` extra). All train on the same random tokens, timed
alternately (`--rounds` rounds of `--steps` steps), so drift hits them alike; prints tokens/s
and MFU per runner (medians over rounds) and ours/peer ratios (medians of per-round ratios).
Runners, shapes, the MFU formula, memory: docs/performance.md#against-the-peers-on-a-gpu
"""
from __future__ import annotations

import os
import statistics
import sys

os.environ.setdefault("XLA_PYTHON_CLIENT_PREALLOCATE", "false")  # before jax starts
sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))  # the repository
from bench import baseline, nanodo, torch_peer  # noqa: E402
from trainer.config import ConfigError  # noqa: E402
from trainer.config.cli import CliParser  # noqa: E402
from trainer.multihost import platforms  # noqa: E402

RUNNERS = ("nanodo", "plain", "plain-docs", "ours", "torch")


def build_parser():
  import jax  # noqa: PLC0415  start-up

  parser = CliParser("bench/peers.py", __doc__, config=False)
  parser.add_argument("--runners", default="plain,ours,torch",
                      help=f"comma-separated, of {', '.join(RUNNERS)} (default plain,ours,torch; "
                      "nanodo added when --nanodo_dir is given)")
  parser.add_argument("--nanodo_dir", default="", metavar="DIR",
                      help="a checkout of github.com/google-deepmind/nanodo (bench/nanodo.py)")
  parser.add_argument("--torch-compile", dest="torch_compile", default="default",
                      choices=torch_peer.COMPILE_MODES, help="torch.compile mode of the peer")
  baseline.add_timing_args(parser, steps=5)
  default = "tiny" if jax.default_backend() == "cpu" else ",".join(baseline.ISSUE_SHAPES)
  baseline.add_size_args(parser, f"shapes, of {', '.join(baseline.SHAPES)} (default {default}), "
                         "or none: --config as it is", default=default)
  return parser


def parse(argv):
  """(args, [(label, config)], runners); a mistake raises ConfigError."""
  args, configs = baseline.load_sized(build_parser(), argv, sizes=baseline.SHAPES)
  runners = [r for r in args.runners.split(",") if r]
  unknown = [r for r in runners if r not in RUNNERS]
  if unknown or not runners:
    raise ConfigError(f"--runners {args.runners!r}: use a comma-separated list of "
                      f"{', '.join(RUNNERS)}")
  runners.append("ours")  # every ratio is against ours
  if args.nanodo_dir:
    runners.append("nanodo")
  if "nanodo" in runners:
    missing = (nanodo.find_nanodo(args.nanodo_dir) if args.nanodo_dir else
               "the nanodo runner needs --nanodo_dir (a checkout of google-deepmind/nanodo)")
    if missing:
      raise ConfigError(missing)
  if "torch" in runners and (why := torch_peer.torch_available()):
    raise ConfigError(why)
  return args, configs, [r for r in RUNNERS if r in runners]


def make_runners(names, cfg, args) -> dict:
  """The runners of `names` for one shape, all on the same random tokens."""
  ours = baseline.Ours(cfg)
  model_cfg = ours.program.model_cfg
  out = {}
  for name in names:
    if name == "ours":
      out[name] = ours
    elif name in ("plain", "plain-docs"):
      out[name] = baseline.Plain(cfg, model_cfg, documents=name == "plain-docs")
    elif name == "torch":
      out[name] = torch_peer.Torch(
          cfg, model_cfg, baseline.random_tokens(cfg, model_cfg.vocab_size),
          compile_mode=args.torch_compile)
    else:
      out[name] = nanodo.Nanodo(cfg, model_cfg.vocab_size)
  return out


def peak_flops(dtype: str) -> tuple[float, str]:
  """The device's peak for the model's matmul dtype: the table's, or on a CPU measured."""
  import jax  # noqa: PLC0415  start-up

  from trainer.tracking.peaks import known_peak_flops, measure_matmul_peak  # noqa: PLC0415  start-up
  kind = jax.devices()[0].device_kind
  table = known_peak_flops(kind, dtype)
  if table is not None:
    return table, f"{kind} {dtype} table peak"
  return measure_matmul_peak(dtype=dtype), f"{dtype} matmul measured on {kind}"


def main(argv=None):
  platforms.choose()  # as train.py: no TPU probing (and its start-up noise) without TPUs
  from models.sizes import flops_per_token  # noqa: PLC0415  start-up
  try:  # a mistake in the command line or config: one line, exit 2
    args, configs, names = parse(argv)
  except ConfigError as e:
    print(f"error: {e}", file=sys.stderr)
    return 2
  print(baseline.header(args))
  table = []
  for label, cfg in configs:
    runners = make_runners(names, cfg, args)
    times = baseline.alternate(runners, rounds=args.rounds, steps=args.steps)
    model_cfg = runners["ours"].program.model_cfg
    tokens = cfg.data.global_batch_size * cfg.data.seq_len
    fpt = flops_per_token(model_cfg, cfg.data.seq_len, causal=False)["total"]
    peak, source = peak_flops(cfg.model.dtype)
    print(f"\n{label}: {baseline.describe(cfg)}, vocab {cfg.model.vocab_size}, "
          f"dtype {cfg.model.dtype}, remat {cfg.model.remat}")
    print(f"  {fpt / 1e6:.4g} MFLOPs/token (issue 25's formula); MFU against "
          f"{peak / 1e12:.4g} TFLOP/s ({source})")
    row = {"shape": f"{label} ({cfg.data.seq_len} x {cfg.data.global_batch_size})"}
    for name, ts in times.items():
      med = statistics.median(ts)
      tps = tokens / med
      row[name] = (tps, tps * fpt / peak)
      print(f"  {name:<10} {med * 1e3:9.1f} ms/step {tps:>12,.0f} tokens/s  MFU "
            f"{tps * fpt / peak:6.1%}  loss {runners[name].loss:.3f}  (rounds: "
            f"{', '.join(f'{t * 1e3:.0f}' for t in ts)} ms)")
    for other in (n for n in names if n != "ours"):
      ratio = statistics.median(o / u for o, u in zip(times[other], times["ours"]))
      row[f"ours/{other}"] = ratio
      print(f"  ours/{other} throughput {ratio:.3f} (median of per-round ratios)")
    table.append(row)
  print("\n" + "\n".join(markdown(table, names)))
  return 0


def markdown(table: list[dict], names: list[str]) -> list[str]:
  """Issue 25's table: tokens/s (MFU) per runner and ours/torch."""
  ratios = [f"ours/{n}" for n in names if n != "ours"]
  lines = ["| model, seq x batch | " + " | ".join(names + ratios) + " |",
           "|---" * (1 + len(names) + len(ratios)) + "|"]
  for row in table:
    cells = [f"{row[n][0] / 1e3:,.1f}k ({row[n][1]:.1%})" for n in names]
    cells += [f"{row[r]:.2f}" for r in ratios]
    lines.append(f"| {row['shape']} | " + " | ".join(cells) + " |")
  return lines


if __name__ == "__main__":
  sys.exit(main())

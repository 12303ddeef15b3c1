"""Issue 25's table: our train step against its peers on one device, at the same shapes, tokens
and optimizer settings, with one MFU formula.

    python bench/peers.py                       # on a GPU: the three shapes of issue 25
    python bench/peers.py --size tiny --torch-compile off   # on a CPU, seconds (tests run this)
    python bench/peers.py --size d768-s1024 --runners ours,torch [--rounds 5] [--steps 5]
        [--nanodo_dir DIR] [--torch-compile default] [--config.a.b=v ...]

Runners (`--runners`, comma-separated, in this order of columns; ours always runs):
  nanodo  google-deepmind/nanodo's step (bench/nanodo.py; only with --nanodo_dir);
  plain   the plainest jit + optax step on our model (bench/baseline.py's `Plain`): causal
          attention, no segment ids;
  plain-docs  the same step fed the segment ids ours is fed (`Plain(documents=True)`): ours'
          model work, so ours/plain-docs is what our step itself costs and plain-docs/plain
          what keeping packed documents apart costs (issue 34);
  ours    the compiled step train.py runs (bench/baseline.py's `Ours`);
  torch   Hugging Face LlamaForCausalLM + torch.compile, SDPA attention, bf16 autocast over fp32
          parameters, clip_grad_norm_ 1, fused AdamW (bench/torch_peer.py; the `hf` extra).
All train on the same random tokens; they are timed alternately (`--rounds` rounds of `--steps`
steps each, after two warm-up steps that compile), so drift hits them alike; the numbers are
medians over rounds, ratios the medians of per-round ratios.

Shapes (`--size`, bench/baseline.py's SHAPES): issue 25's -- d768 L12 (GPT-2 small) at seq x
batch 1024 x 32 and 2048 x 16, d2048 L16 (~1B) at 2048 x 4 -- with GPT-2's vocabulary padded
to 50,304, tied embeddings, as many kv heads as heads, SwiGLU of 2/3 x 4d (nanodo's GELU 4d
has the same FLOPs), bf16 compute over fp32 parameters, our attention `auto` and remat `dots`
(the issue's best setting; --config.model.* overrides change ours and the plain step's model,
and the torch model follows the widths); `tiny` for CPUs. Default: the three issue shapes on
an accelerator, `tiny` on a CPU.

MFU = (6 (N_non-embedding + V d) + 12 L S d) tokens/s / peak: `models.sizes.flops_per_token`
with `causal=False` (attention counted whole, as the issue's formula; the norm scales' 6 x
(2L + 1) d FLOPs, < 0.1%, are the one difference), over the table peak of the device in the
model's dtype (H100 bf16: 989 TFLOP/s; `trainer.tracking.metrics`), or on a CPU the measured matmul
peak. JAX and PyTorch share the GPU in one process, so JAX's preallocation of 75% of the GPU is
turned off here (XLA_PYTHON_CLIENT_PREALLOCATE=false) and each framework allocates what it
uses: at d2048 four ~1B-parameter runners at once may not fit 80 GB (run two, e.g.
`--runners ours,torch`).
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

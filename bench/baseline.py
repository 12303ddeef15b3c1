"""Our train step against the plainest correct step a user would write for the same model.

    python bench/baseline.py [--size 3m,25m] [--rounds 5] [--steps 3] [--config.a.b=v ...]
    python bench/baseline.py --size none --config configs/lm_small.py [--config.a.b=v ...]

The baseline is jit + optax and nothing else: the same Transformer module, mean token
cross-entropy, `optax.chain(clip_by_global_norm(clip), adamw(...))`, donated parameters and
optimizer state. Ours is the compiled step `train.py` runs (`trainer/step/program.py`: exact
token-weighted accumulation, non-finite/spike guard, metrics, explicit shardings). Both get the
same random batch on one device; they are timed alternately (`--rounds` rounds of `--steps`
steps each, after two warm-up steps), so machine drift hits both alike. `--size` runs the two
models matched to nanodo's (SIZES: 3.3M and 25.4M parameters, overrides of configs/lm_tiny.py,
before the command line's own); `--size none` runs --config as it is. Prints each step's
median time and tokens/s, and ours/plain throughput (the median of the rounds' ratios): >= 1.0
means the framework's features cost nothing.
"""
from __future__ import annotations

import functools
import os
import statistics
import sys
import time

import numpy as np


ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, ROOT)
from trainer.config import ConfigError  # noqa: E402
from trainer.config.cli import CliParser, load_from_cli  # noqa: E402
from trainer.multihost import platforms  # noqa: E402


def plain_step(model_cfg, hp, b1: float, clip_norm: float, seed: int):
  """(params, opt_state, step) of the baseline: jit + optax, no framework; `hp` are the run's
  derived AdamW hyperparameters (`optim.derive`), so both steps do the same arithmetic.
  `step(params, opt_state, inputs, targets, segment_ids=None)`: with segment ids [B, S] the
  model keeps packed documents apart as ours does (the same attention masks; `Plain`'s
  `documents`), without them it is the plainest causal step."""
  import jax  # noqa: PLC0415  start-up
  import optax  # noqa: PLC0415  start-up
  from flax import nnx  # noqa: PLC0415  start-up

  from models.llama import Transformer  # noqa: PLC0415  start-up

  graphdef, params = nnx.split(Transformer(model_cfg, rngs=nnx.Rngs(params=seed)))
  params = nnx.to_pure_dict(params)
  tx = optax.chain(optax.clip_by_global_norm(clip_norm),
                   optax.adamw(hp.learning_rate, b1=b1, b2=hp.b2,
                               weight_decay=hp.weight_decay))

  def loss_fn(params, inputs, targets, segment_ids):
    model = nnx.merge(graphdef, params)
    logits = model(inputs, None, segment_ids)
    return optax.softmax_cross_entropy_with_integer_labels(logits, targets).mean()

  @functools.partial(jax.jit, donate_argnums=(0, 1))
  def step(params, opt_state, inputs, targets, segment_ids=None):
    loss, grads = jax.value_and_grad(loss_fn)(params, inputs, targets, segment_ids)
    updates, opt_state = tx.update(grads, opt_state, params)
    return optax.apply_updates(params, updates), opt_state, loss

  return params, tx.init(params), step


# The two models of issue 14, matched to google-deepmind/nanodo's (bench/nanodo.py): tied
# embeddings, as many kv heads as heads, SwiGLU of 2/3 x 4d (nanodo: GELU of 4d, the same FLOPs),
# the layers unrolled (`model.scan_unroll` = layers; nanodo's are a Python loop). The plain step
# runs the same model config.
SIZES = {
    "3m": dict(d_model=256, num_layers=4, num_heads=4, mlp_dim=683, batch=16, seq_len=256),
    "25m": dict(d_model=512, num_layers=8, num_heads=8, mlp_dim=1365, batch=8, seq_len=512),
}


# Issue 25's shapes (bench/peers.py's table; step_profile and variants take them too): GPT-2
# small at two lengths and a ~1B model, GPT-2's padded vocabulary, bf16 over fp32 parameters,
# attention auto and remat dots (the issue's best setting); `tiny` for CPUs. Every matmul width
# is a multiple of 128: the ~1B model's SwiGLU is 5632 wide (issue 25 ran 8/3 d = 5461, which
# cost XLA 35% on an H200; trainer/config/checks.py warns about such widths on GPUs).
_ISSUE = dict(vocab_size=50_304, dtype="bfloat16", param_dtype="float32", attention="auto",
              remat="dots", scan_unroll=1)
SHAPES = {
    "d768-s1024": dict(d_model=768, num_layers=12, num_heads=12, mlp_dim=2048, batch=32,
                       seq_len=1024, model=_ISSUE),
    "d768-s2048": dict(d_model=768, num_layers=12, num_heads=12, mlp_dim=2048, batch=16,
                       seq_len=2048, model=_ISSUE),
    "d2048-s2048": dict(d_model=2048, num_layers=16, num_heads=16, mlp_dim=5632, batch=4,
                        seq_len=2048, model=_ISSUE),
    "tiny": dict(d_model=64, num_layers=2, num_heads=4, mlp_dim=128, batch=4, seq_len=64,
                 model=dict(vocab_size=512, scan_unroll=1)),
}
ISSUE_SHAPES = ("d768-s1024", "d768-s2048", "d2048-s2048")


def size_overrides(size: str, sizes: dict = SIZES) -> list[str]:
  """The `--config.*` overrides that make configs/lm_tiny.py the `size` model of `sizes`; a
  size's optional `model` dict adds model keys (last, so they win)."""
  s = sizes[size]
  return [f"--config.model.d_model={s['d_model']}", f"--config.model.num_layers={s['num_layers']}",
          f"--config.model.num_heads={s['num_heads']}",
          f"--config.model.num_kv_heads={s['num_heads']}", f"--config.model.mlp_dim={s['mlp_dim']}",
          f"--config.model.scan_unroll={s['num_layers']}",
          "--config.model.tie_embeddings=true", "--config.model.attention=xla",
          f"--config.data.global_batch_size={s['batch']}", f"--config.data.seq_len={s['seq_len']}",
          "--config.data.micro_batch_size=0"] + [
              f"--config.model.{key}={value}" for key, value in s.get("model", {}).items()]


def random_tokens(cfg, vocab_size: int, seed: int = 0):
  """[B, S + 1] random token ids (both steps, and nanodo's, train on the same ones)."""
  d = cfg.data
  return np.random.default_rng(seed).integers(0, vocab_size, (d.global_batch_size,
                                                              d.seq_len + 1), dtype=np.int32)


class Ours:
  """The compiled step `train.py` runs, on one device, fed one fixed random batch."""

  def __init__(self, cfg):
    import jax  # noqa: PLC0415  start-up

    from sharding.mesh import make_mesh  # noqa: PLC0415  start-up
    from trainer.step.program import Program  # noqa: PLC0415  start-up
    from trainer.step.state import init_state  # noqa: PLC0415  start-up

    self.program = program = Program(cfg, make_mesh(cfg.mesh, jax.devices()[:1]))
    self.step = program.compile()
    self.state = init_state(program.spec, program.tx)
    tokens = random_tokens(cfg, program.model_cfg.vocab_size)
    inputs, targets = tokens[:, :-1], tokens[:, 1:]
    positions = np.broadcast_to(np.arange(inputs.shape[1], dtype=np.int32), inputs.shape)
    micro = lambda a: a.reshape(program.num_micro, program.micro_rows, inputs.shape[1])
    host = {"inputs": micro(inputs), "targets": micro(targets), "positions": micro(positions),
            "segment_ids": micro(np.ones_like(inputs)),
            "loss_mask": micro(np.ones(inputs.shape, bool))}
    self.batch = {k: jax.device_put(v, program.batch_sharding) for k, v in host.items()}
    self.loss = None

  def __call__(self, n: int) -> float:
    """Seconds per step over `n` steps."""
    import jax  # noqa: PLC0415  start-up
    t = time.perf_counter()
    with jax.set_mesh(self.program.mesh):
      for _ in range(n):
        self.state, metrics = self.step(self.state, self.batch)
      self.loss = float(metrics["loss"])  # waits for the last step
    return (time.perf_counter() - t) / n


class Plain:
  """The baseline step (`plain_step`) on the same model, optimizer settings and tokens.
  `documents`: the step also takes the batch's segment ids (one document per row, as `Ours`
  is fed), so the model masks attention as ours does: the plain step doing ours' model work,
  against which what our step itself adds is measured (bench/peers.py's `plain-docs`)."""

  def __init__(self, cfg, model_cfg, documents: bool = False):
    import jax  # noqa: PLC0415  start-up

    from optim import derive  # noqa: PLC0415  start-up
    hp = derive(cfg.optim, cfg.data.global_batch_size, cfg.data.global_batch_size)
    self.params, self.opt_state, self.step = plain_step(
        model_cfg, hp, cfg.optim.b1, cfg.optim.clip_norm, cfg.seed)
    tokens = random_tokens(cfg, model_cfg.vocab_size)
    self.inputs, self.targets = jax.device_put(tokens[:, :-1]), jax.device_put(tokens[:, 1:])
    self.segment_ids = (jax.device_put(np.ones(tokens[:, 1:].shape, np.int32)) if documents
                        else None)
    self.loss = None

  def args(self) -> tuple:
    """The step's arguments after the state: tokens, and segment ids with `documents`."""
    return (self.inputs, self.targets) + ((self.segment_ids,) if self.segment_ids is not None
                                          else ())

  def __call__(self, n: int) -> float:
    t = time.perf_counter()
    for _ in range(n):
      self.params, self.opt_state, loss = self.step(self.params, self.opt_state, *self.args())
    self.loss = float(loss)
    return (time.perf_counter() - t) / n


def alternate(runners: dict, *, rounds: int, steps: int) -> dict[str, list[float]]:
  """Seconds per step of each runner in each round; the runners take turns within a round, so
  machine drift hits them alike (two warm-up steps each first, which compile)."""
  for run in runners.values():
    run(2)
  times = {name: [] for name in runners}
  for _ in range(rounds):
    for name, run in runners.items():
      times[name].append(run(steps))
  return times


def one_device(cfg):
  """The config on one device (both steps run unsharded)."""
  cfg.mesh.update(data=1, fsdp=1, tensor=1, sequence=1, expert=1)
  return cfg


SIZE_HELP = ("matched models to run, of " + ", ".join(SIZES) + " (default both), or none: "
             "--config as it is")


def add_timing_args(parser, steps: int):
  """`--rounds` and `--steps` of the alternated timing (`alternate`)."""
  parser.add_argument("--rounds", type=int, default=5, help="rounds; the runners take turns")
  parser.add_argument("--steps", type=int, default=steps, help="steps per runner per round")


def add_size_args(parser, size_help: str = SIZE_HELP, default: str = "3m,25m") -> None:
  """`--config` (default configs/lm_tiny.py) and `--size` of a bench that runs sized models
  (`load_sized`)."""
  parser.add_argument("--config", default=os.path.join(ROOT, "configs", "lm_tiny.py"),
                      metavar="FILE.py", help="config file (default configs/lm_tiny.py)")
  parser.add_argument("--size", default=default, help=size_help)


def load_sized(parser, argv, sizes: dict = SIZES):
  """(args, [(label, config)]) from a bench command line (a parser with `add_size_args`):
  `--size` picks models of `sizes` (default the matched models of SIZES; overrides of
  configs/lm_tiny.py, applied before the command line's own), or `--size none` takes --config
  as it is. A mistake raises ConfigError."""
  from trainer.config.checks import validate  # noqa: PLC0415  start-up
  args, rest = parser.parse_known_args(argv)
  chosen = [] if args.size == "none" else args.size.split(",")
  for size in chosen:
    if size not in sizes:
      raise ConfigError(f"--size {size!r}: use a comma-separated list of {', '.join(sizes)}, "
                        "or none")
  out = []
  for size in chosen or [None]:
    overrides = size_overrides(size, sizes) if size else []
    cfg = one_device(load_from_cli(args.config, overrides + rest))
    validate(cfg, 1)
    if cfg.optim.name != "adamw":
      raise ConfigError(f"optim.name={cfg.optim.name!r}: the baseline is an AdamW step; "
                        "run with --config.optim.name=adamw")
    out.append((size or args.config, cfg))
  return args, out


def describe(cfg) -> str:
  m, d = cfg.model, cfg.data
  return (f"d_model {m.d_model}, {m.num_layers} layers, {m.num_heads} heads, seq {d.seq_len}, "
          f"batch {d.global_batch_size}, mlp {m.mlp_dim}, attention {m.attention}, "
          f"scan_unroll {m.scan_unroll}")


def header(args) -> str:
  """The first line a bench prints: the device and how the steps are timed."""
  import jax  # noqa: PLC0415  start-up
  return (f"device     1 x {jax.devices()[0].device_kind}; {args.rounds} rounds x {args.steps} "
          f"steps, alternated; medians")


def build_parser():
  parser = CliParser("bench/baseline.py", __doc__, config=False)
  add_timing_args(parser, steps=3)
  add_size_args(parser)
  return parser


def main(argv=None):
  platforms.choose()  # as train.py: no TPU probing (and its start-up noise) without TPUs
  try:  # a mistake in the command line or config: one line, exit 2
    args, configs = load_sized(build_parser(), argv)
  except ConfigError as e:
    print(f"error: {e}", file=sys.stderr)
    return 2
  print(header(args))
  for label, cfg in configs:
    ours = Ours(cfg)
    times = alternate({"plain": Plain(cfg, ours.program.model_cfg), "ours": ours},
                      rounds=args.rounds, steps=args.steps)
    tokens = cfg.data.global_batch_size * cfg.data.seq_len
    print(f"\n{label}: {describe(cfg)}")
    for name, ts in times.items():
      med = statistics.median(ts)
      print(f"  {name:<6} {med * 1e3:8.1f} ms/step {tokens / med:>10,.0f} tokens/s  "
            f"(rounds: {', '.join(f'{t * 1e3:.0f}' for t in ts)} ms)")
    ratio = statistics.median(p / o for p, o in zip(times["plain"], times["ours"]))
    print(f"  ours/plain throughput {ratio:.3f} (median of per-round ratios; target >= 1.0)")
  return 0


if __name__ == "__main__":
  sys.exit(main())

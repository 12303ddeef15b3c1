"""Our train step against google-deepmind/nanodo's on the matched models, in one process.

    python bench/nanodo.py --nanodo_dir DIR [--size 3m,25m] [--rounds 5] [--steps 3]
        [--config.a.b=v ...]

nanodo is not a dependency and nothing is downloaded: DIR is a checkout of
https://github.com/google-deepmind/nanodo (the directory holding its `nanodo/` package); without
one the bench says so and exits with code 2. Its modules import `tensorflow_datasets`: `pip
install tensorflow-datasets` (TensorFlow itself is not needed). nanodo's side runs nanodo's own
model, optimizer, loss, metrics and step; ours is the compiled step train.py runs, on a model of
the same FLOPs per token. Both are timed alternately with a matmul peak measured in every round;
prints tokens/s, ours/nanodo and MFU.
How each side is built and timed: docs/performance.md#against-nanodo
"""
from __future__ import annotations

import functools
import os
import statistics
import sys
import time

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))  # the repository
from bench import baseline  # noqa: E402
import ml_collections  # noqa: E402
from trainer.config import ConfigError  # noqa: E402
from trainer.config.cli import CliParser  # noqa: E402
from trainer.multihost import platforms  # noqa: E402


def _train_step(state, in_BxL, c, get_loss_fn):
  """nanodo/train.py's `_train_step` (commit 10aefdee), without its mesh constraint (one
  device): the loss and gradient, the optimizer update, and nanodo's per-step metrics."""
  import jax  # noqa: PLC0415  start-up
  import optax  # noqa: PLC0415  start-up
  from nanodo import metrics as metrics_lib  # noqa: PLC0415  optional
  grad_fn = jax.value_and_grad(get_loss_fn(in_BxL, state.apply_fn, c), has_aux=True)
  (loss, aux_data), grads = grad_fn(state.params)
  updates, new_opt_state = state.tx.update(grads, state.opt_state, state.params)
  new_params = optax.apply_updates(state.params, updates)
  new_state = state.replace(step=state.opt_state.gradient_step + 1, params=new_params,
                            opt_state=new_opt_state)
  metrics = metrics_lib.get_metrics(aux_data, c, loss, state, grads, updates)
  return new_state, metrics


def nanodo_config(cfg, vocab_size: int):
  """nanodo's config for the model and optimizer matched to our `cfg`."""
  import jax.numpy as jnp  # noqa: PLC0415  start-up

  from optim import derive  # noqa: PLC0415  start-up
  m, o = cfg.model, cfg.optim
  hp = derive(o, cfg.data.global_batch_size, cfg.data.global_batch_size)  # as our step's
  return ml_collections.ConfigDict(dict(
      model=dict(D=m.d_model, H=m.num_heads, L=cfg.data.seq_len, N=m.num_layers,
                 F=4 * m.d_model, dtype=jnp.dtype(m.dtype), fsdp_enabled=False, remat=False),
      opt=dict(num_train_steps=cfg.steps, peak_learning_rate=hp.learning_rate,
               init_learning_rate=0.0, final_learning_rate=hp.learning_rate * o.min_lr_ratio,
               warmup_steps=o.warmup_steps, decay_type="cosine", weight_decay=hp.weight_decay,
               clip_by_global_norm=o.clip_norm, optimizer="adamw", b1=o.b1, b2=hp.b2),
      log_internal_metrics=False, vocab_size=vocab_size))


class Nanodo:
  """nanodo's model, optimizer, loss, metrics and step (module docstring), one device."""

  def __init__(self, cfg, vocab_size: int):

    import jax  # noqa: PLC0415  start-up
    import jax.numpy as jnp  # noqa: PLC0415  start-up
    from flax.training.train_state import TrainState  # noqa: PLC0415  start-up
    from nanodo import model_factory, optimizer  # noqa: PLC0415  optional
    c = nanodo_config(cfg, vocab_size)
    module, get_loss_fn = model_factory.get_model_and_loss(c, vocab_size)
    try:
      from nanodo.train import _train_step as step  # noqa: PLC0415  optional
      self.source = "nanodo.train._train_step"
    except ImportError as e:
      step = _train_step
      self.source = (f"nanodo/train.py's _train_step copied in bench/nanodo.py (nanodo.train "
                     f"does not import here: {e})")

    def init(rng):
      params = module.init(rng, jnp.zeros((1, c.model.L), jnp.int32))["params"]
      return TrainState.create(apply_fn=module.apply, params=params,
                               tx=optimizer.get_optimizer(c.opt))

    self.state = jax.jit(init)(jax.random.PRNGKey(cfg.seed))
    self.params = sum(x.size for x in jax.tree.leaves(self.state.params))
    self.step = jax.jit(functools.partial(step, c=c, get_loss_fn=get_loss_fn),
                        donate_argnums=0)
    self.tokens = jax.device_put(baseline.random_tokens(cfg, vocab_size)[:, :-1])
    self.loss = None

  def __call__(self, n: int) -> float:
    t = time.perf_counter()
    for _ in range(n):
      self.state, metrics = self.step(self.state, self.tokens)
    self.loss = float(metrics["train_loss"])
    return (time.perf_counter() - t) / n


def find_nanodo(path: str) -> str | None:
  """Why `path` is not a nanodo checkout, or None when it is."""
  if not os.path.isfile(os.path.join(path, "nanodo", "model.py")):
    return (f"--nanodo_dir {path!r} has no nanodo/model.py: pass a checkout of "
            "https://github.com/google-deepmind/nanodo (git clone it there); skipping")
  sys.path.insert(0, os.path.abspath(path))
  try:
    import nanodo.loss  # noqa: F401, PLC0415  optional
  except ImportError as e:
    return (f"nanodo at {path!r} does not import ({e}); it needs tensorflow_datasets: pip "
            "install tensorflow-datasets")
  return None


def build_parser():
  parser = CliParser("bench/nanodo.py", __doc__, config=False)
  parser.add_argument("--nanodo_dir", required=True, metavar="DIR",
                      help="a checkout of github.com/google-deepmind/nanodo")
  baseline.add_timing_args(parser, steps=3)
  baseline.add_size_args(parser, "matched models to run, of " + ", ".join(baseline.SIZES)
                         + " (default both)")
  return parser


def main(argv=None):
  platforms.choose()
  try:  # a mistake in the command line or config: one line, exit 2
    args, configs = baseline.load_sized(build_parser(), argv)
    if any(cfg.model.num_kv_heads != cfg.model.num_heads or not cfg.model.tie_embeddings
           for _, cfg in configs):
      raise ConfigError("nanodo's model has as many kv heads as heads and tied embeddings: "
                        "keep model.num_kv_heads = model.num_heads, model.tie_embeddings=true")
    missing = find_nanodo(args.nanodo_dir)
    if missing:
      raise ConfigError(missing)
  except ConfigError as e:
    print(f"error: {e}", file=sys.stderr)
    return 2

  from models.sizes import flops_per_token  # noqa: PLC0415  start-up
  from trainer.tracking.peaks import measure_matmul_peak  # noqa: PLC0415  start-up
  print(baseline.header(args))
  for label, cfg in configs:
    ours = baseline.Ours(cfg)
    theirs = Nanodo(cfg, ours.program.model_cfg.vocab_size)
    peaks = [measure_matmul_peak(n=1024, repeats=10)]

    def peak(n):  # the round's matmul peak, as one more "runner" of the rotation
      peaks.append(measure_matmul_peak(n=1024, repeats=3))
      return 0.0

    times = baseline.alternate({"nanodo": theirs, "ours": ours, "peak": peak},
                               rounds=args.rounds, steps=args.steps)
    best = max(peaks)
    peaks = peaks[-args.rounds:]  # the rounds' own (the warm-up's is not a round's)
    tokens = cfg.data.global_batch_size * cfg.data.seq_len
    fpt = flops_per_token(ours.program.model_cfg, cfg.data.seq_len)["total"]
    print(f"\n{label}: {baseline.describe(cfg)}")
    print(f"  nanodo: {theirs.params / 1e6:.2f}M params, step: {theirs.source}")
    for name in ("nanodo", "ours"):
      med = statistics.median(times[name])
      print(f"  {name:<6} {med * 1e3:8.1f} ms/step {tokens / med:>10,.0f} tokens/s  "
            f"(rounds: {', '.join(f'{t * 1e3:.0f}' for t in times[name])} ms)")
    ratio = statistics.median(n / o for n, o in zip(times["nanodo"], times["ours"]))
    mfu = tokens * fpt / statistics.median(times["ours"]) / best
    print(f"  ours/nanodo throughput {ratio:.3f} (median of per-round ratios; goal >= 1.2)")
    print(f"  ours MFU {mfu:.1%} of the best fp32 1024^3 matmul measured in this process "
          f"({best / 1e9:.0f} GFLOP/s; in-round median {statistics.median(peaks) / 1e9:.0f}); "
          f"{fpt / 1e6:.1f} MFLOPs/token")
    print(f"  losses after the last round: nanodo {theirs.loss:.3f}, ours {ours.loss:.3f}")
  return 0


if __name__ == "__main__":
  sys.exit(main())

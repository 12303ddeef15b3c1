"""Our train step against the plainest correct step a user would write for the same model.

    python bench/baseline.py --config configs/lm_small.py [--rounds 5] [--steps 10] [--config.a.b=v ...]

The baseline is jit + optax and nothing else: the same Transformer module, mean token
cross-entropy, `optax.chain(clip_by_global_norm(clip), adamw(...))`, donated parameters and
optimizer state. Ours is the compiled step `train.py` runs (`trainer/program.py`: exact
token-weighted accumulation, non-finite/spike guard, metrics, explicit shardings). Both get the
same random batches on one device; they are timed alternately (`--rounds` rounds of `--steps`
steps each, after a warm-up), so machine drift hits both alike. Prints the median step times and
ours/baseline throughput: >= 1.0 means the framework's features cost nothing.
"""
from __future__ import annotations

import functools
import os
import statistics
import sys
import time

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))


def plain_step(model_cfg, hp, b1: float, clip_norm: float, seed: int):
  """(params, opt_state, step) of the baseline: jit + optax, no framework; `hp` are the run's
  derived AdamW hyperparameters (`optim.derive`), so both steps do the same arithmetic."""
  import jax  # noqa: PLC0415
  import optax  # noqa: PLC0415
  from flax import nnx  # noqa: PLC0415

  from models.llama import Transformer  # noqa: PLC0415

  graphdef, params = nnx.split(Transformer(model_cfg, rngs=nnx.Rngs(params=seed)))
  params = nnx.to_pure_dict(params)
  tx = optax.chain(optax.clip_by_global_norm(clip_norm),
                   optax.adamw(hp.learning_rate, b1=b1, b2=hp.b2,
                               weight_decay=hp.weight_decay))

  def loss_fn(params, inputs, targets):
    model = nnx.merge(graphdef, params)
    logits = model(inputs)
    return optax.softmax_cross_entropy_with_integer_labels(logits, targets).mean()

  @functools.partial(jax.jit, donate_argnums=(0, 1))
  def step(params, opt_state, inputs, targets):
    loss, grads = jax.value_and_grad(loss_fn)(params, inputs, targets)
    updates, opt_state = tx.update(grads, opt_state, params)
    return optax.apply_updates(params, updates), opt_state, loss

  return params, tx.init(params), step


def run(cfg, *, rounds: int, steps: int) -> dict:
  """Median step seconds of ours and of the baseline, timed alternately."""
  import jax  # noqa: PLC0415
  import numpy as np  # noqa: PLC0415

  from optim import derive  # noqa: PLC0415
  from sharding.mesh import make_mesh  # noqa: PLC0415
  from trainer.program import Program  # noqa: PLC0415
  from trainer.state import init_state  # noqa: PLC0415

  program = Program(cfg, make_mesh(cfg.mesh))
  ours = program.compile()
  state = init_state(program.spec, program.tx)
  hp = derive(cfg.optim, cfg.data.global_batch_size, cfg.data.global_batch_size)
  params, opt_state, plain = plain_step(program.model_cfg, hp, cfg.optim.b1, cfg.optim.clip_norm,
                                        cfg.seed)

  d = cfg.data
  rng = np.random.default_rng(0)
  tokens = rng.integers(0, program.model_cfg.vocab_size, (d.global_batch_size, d.seq_len + 1),
                        dtype=np.int32)
  inputs, targets = tokens[:, :-1], tokens[:, 1:]
  positions = np.broadcast_to(np.arange(d.seq_len, dtype=np.int32), inputs.shape)
  micro = lambda a: a.reshape(program.num_micro, program.micro_rows, d.seq_len)
  host = {"inputs": micro(inputs), "targets": micro(targets), "positions": micro(positions),
          "segment_ids": micro(np.ones_like(inputs)),
          "loss_mask": micro(np.ones(inputs.shape, bool))}
  batch = {k: jax.device_put(v, program.batch_sharding) for k, v in host.items()}
  inputs, targets = jax.device_put(inputs), jax.device_put(targets)

  def time_ours(n):
    nonlocal state
    t = time.perf_counter()
    with jax.set_mesh(program.mesh):
      for _ in range(n):
        state, metrics = ours(state, batch)
      jax.block_until_ready(metrics)
    return (time.perf_counter() - t) / n

  def time_plain(n):
    nonlocal params, opt_state
    t = time.perf_counter()
    for _ in range(n):
      params, opt_state, loss = plain(params, opt_state, inputs, targets)
    jax.block_until_ready(loss)
    return (time.perf_counter() - t) / n

  time_ours(2), time_plain(2)  # compile and warm up
  ours_s, plain_s = [], []
  for _ in range(rounds):
    ours_s.append(time_ours(steps))
    plain_s.append(time_plain(steps))
  return {"ours": statistics.median(ours_s), "plain": statistics.median(plain_s),
          "ours_all": ours_s, "plain_all": plain_s}


def main(argv=None):
  from trainer import platforms  # noqa: PLC0415
  platforms.choose()  # as train.py: no TPU probing (and its start-up noise) without TPUs
  from trainer.cli import CliParser, load_from_cli  # noqa: PLC0415
  from trainer.config import ConfigError, validate  # noqa: PLC0415
  parser = CliParser("bench/baseline.py", __doc__)
  parser.add_argument("--rounds", type=int, default=5)
  parser.add_argument("--steps", type=int, default=10)
  import jax  # noqa: PLC0415
  try:  # a mistake in the command line or config: one line, exit 2
    args, rest = parser.parse_known_args(argv)
    cfg = load_from_cli(args.config, rest)
    cfg.mesh.update(data=1, fsdp=1, tensor=1, sequence=1, expert=1)  # one device
    validate(cfg, 1)
    if cfg.optim.name != "adamw":
      raise ConfigError(f"optim.name={cfg.optim.name!r}: the baseline is an AdamW step; "
                        "run with --config.optim.name=adamw")
  except ConfigError as e:
    print(f"error: {e}", file=sys.stderr)
    return 2
  r = run(cfg, rounds=args.rounds, steps=args.steps)
  tokens = cfg.data.global_batch_size * cfg.data.seq_len
  print(f"config     {args.config} {' '.join(rest)}")
  print(f"device     1 x {jax.devices()[0].device_kind}; {args.rounds} rounds x {args.steps} "
        f"steps, alternated")
  for name in ("plain", "ours"):
    print(f"{name:<10} median {r[name] * 1e3:8.1f} ms/step  {tokens / r[name]:>10,.0f} tokens/s  "
          f"(rounds: {', '.join(f'{t * 1e3:.1f}' for t in r[name + '_all'])} ms)")
  print(f"ours/plain throughput {r['plain'] / r['ours']:.3f}  (target >= 1.0)")


if __name__ == "__main__":
  sys.exit(main())

"""Step time of configs/moe_tiny.py against a dense model of the same active size, one process.

    python bench/moe_step_time.py [--rounds 5] [--steps 10]

Builds the real train steps (trainer/step/train_step.py) of: moe_tiny (dropless, ragged_dot), moe_tiny
with a capacity (capacity_factor 1.25, static buffers), and the dense model of moe_tiny's shape
whose MLP has the experts' active width (top_k x moe.mlp_dim = 384, i.e. configs/lm_tiny.py),
all on one device with the same batches. The three are timed in alternation, `--steps` steps
per round, so that a machine shared with other work slows all of them alike; prints the median
step time of each and the ratios to dense.
"""
from __future__ import annotations

import os
import statistics
import sys
import time

import numpy as np

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
from configs.moe_tiny import get_config  # noqa: E402
from data.prepare import ensure_default_corpus  # noqa: E402
from trainer.config import ConfigError  # noqa: E402
from trainer.config.cli import CliParser  # noqa: E402
from trainer.multihost import platforms  # noqa: E402


def build_parser():
  parser = CliParser("bench/moe_step_time.py", __doc__, config=False)
  parser.add_argument("--rounds", type=int, default=5)
  parser.add_argument("--steps", type=int, default=10)
  return parser


def main(argv=None):
  platforms.choose()
  try:  # a mistake in the command line: one line, exit 2
    args = build_parser().parse_args(argv)
  except ConfigError as e:
    print(f"error: {e}", file=sys.stderr)
    return 2
  import jax  # noqa: PLC0415  start-up

  from data import pipeline  # noqa: PLC0415  start-up
  from models.llama import ModelConfig  # noqa: PLC0415  start-up
  from models.sizes import param_counts  # noqa: PLC0415  start-up
  from optim import build_optimizer  # noqa: PLC0415  start-up
  from sharding import batch_sharding, make_mesh, replicated  # noqa: PLC0415  start-up
  from trainer.step.state import ModelSpec, init_state, state_shardings  # noqa: PLC0415  start-up
  from trainer.step.train_step import make_train_step  # noqa: PLC0415  start-up

  base = get_config()
  variants = {"moe dropless": {}, "moe capacity 1.25": {"capacity_factor": 1.25},
              "dense, same active": {"num_experts": 0}}
  mesh = make_mesh({"data": 1}, jax.devices()[:1])
  it = iter(pipeline.dataset(pipeline.StreamSpec(ensure_default_corpus(), "train",
                                                 base.data.seq_len, base.data.global_batch_size)))
  bsh = batch_sharding(mesh, microbatched=True)
  batch = {k: jax.device_put(np.asarray(v)[None], bsh) for k, v in next(it).items()}
  runs = {}
  for name, moe in variants.items():
    cfg = get_config()
    cfg.model.moe.update(**moe)
    model_cfg = ModelConfig.from_config(cfg.model)
    spec = ModelSpec(model_cfg, mesh, cfg.seed)
    tx, schedule = build_optimizer(cfg.optim, spec.logical_names, cfg.steps)
    sh = state_shardings(spec, tx)
    step = jax.jit(make_train_step(spec, tx, schedule), in_shardings=(sh, bsh),
                   out_shardings=(sh, replicated(mesh)), donate_argnums=0)
    with jax.set_mesh(mesh):
      state, _ = step(init_state(spec, tx), batch)  # compile + warm up
      jax.block_until_ready(state)
    counts = param_counts(model_cfg)
    runs[name] = {"step": step, "state": state, "times": [],
                  "params": f"{counts['total'] / 1e6:.2f}M total, {counts['active'] / 1e6:.2f}M active"}
  for _ in range(args.rounds):
    for run in runs.values():
      with jax.set_mesh(mesh):
        t0 = time.perf_counter()
        for _ in range(args.steps):
          run["state"], metrics = run["step"](run["state"], batch)
        jax.block_until_ready(metrics)
      run["times"].append((time.perf_counter() - t0) / args.steps)
  dense = statistics.median(runs["dense, same active"]["times"])
  for name, run in runs.items():
    t = statistics.median(run["times"])
    print(f"{name:20s} {run['params']:26s} median step {t * 1e3:7.1f} ms  x{t / dense:.2f} dense")
  return 0


if __name__ == "__main__":
  sys.exit(main())

"""How long a checkpoint blocks the training loop, async vs synchronous, and what saving every
N steps costs in step time.

    python bench/checkpoint_overhead.py [--steps 60] [--saves 5]

The model is sized for ~100 MB of train state (8.9M fp32 parameters + two Adam moments) but
fed tiny batches, so a step is short and the checkpoint cost is easy to see. Everything goes
through the real code path: `trainer.step.program.Program` for the step, `trainer.checkpoint.persistent.
Checkpointer` (Orbax) for saves, the grain pipeline for data. Prints medians; the machine's
noise is visible in the min/max columns.
"""
from __future__ import annotations

import os
import shutil
import statistics
import sys
import tempfile
import time

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
from data.prepare import ensure_default_corpus  # noqa: E402
from trainer.config import ConfigError, default_config  # noqa: E402
from trainer.config.cli import CliParser  # noqa: E402
from trainer.multihost import platforms  # noqa: E402


def build_parser():
  parser = CliParser("bench/checkpoint_overhead.py", __doc__, config=False)
  parser.add_argument("--steps", type=int, default=60, help="steps per overhead measurement")
  parser.add_argument("--saves", type=int, default=5, help="saves per blocking measurement")
  parser.add_argument("--every", default="0,20,10,5", help="checkpoint intervals to compare")
  parser.add_argument("--d-model", type=int, default=512,
                      help="model width: 512 gives ~107 MB of train state, 1024 ~4x that")
  return parser


def main(argv=None):
  platforms.choose()  # as train.py: no TPU probing (and its start-up noise) without TPUs
  try:
    args = build_parser().parse_args(argv)
  except ConfigError as e:
    print(f"error: {e}", file=sys.stderr)
    return 2

  import jax  # noqa: PLC0415  start-up

  from data import pipeline  # noqa: PLC0415  start-up
  from sharding import make_mesh  # noqa: PLC0415  start-up
  from trainer.checkpoint.persistent import Checkpointer  # noqa: PLC0415  start-up
  from trainer.step.program import Program  # noqa: PLC0415  start-up
  from trainer.step.state import init_state  # noqa: PLC0415  start-up

  cfg = default_config()
  cfg.model.update(d_model=args.d_model, num_layers=2, num_heads=8, num_kv_heads=8,
                   mlp_dim=4 * args.d_model)
  cfg.data.update(global_batch_size=2, seq_len=32, prefetch=2)
  program = Program(cfg, make_mesh({"data": 1}, jax.devices()[:1]))
  step_fn = program.compile()
  state = init_state(program.spec, program.tx)
  state_bytes = sum(x.nbytes for x in jax.tree.leaves(state))
  spec = pipeline.StreamSpec(ensure_default_corpus(), "train", 32, 2, prefetch=2)
  it = iter(pipeline.dataset(spec))

  def batch():
    mb = next(it)
    return {k: jax.device_put(mb[k][None], program.batch_sharding) for k in mb}

  root = tempfile.mkdtemp(prefix="ckpt-bench-")
  try:
    with jax.set_mesh(program.mesh):
      for _ in range(3):  # warm up
        state, m = step_fn(state, batch())
      jax.block_until_ready(m)

      print(f"train state {state_bytes / 1e6:.0f} MB "
            f"({sum(x.size for x in jax.tree.leaves(state.params)) / 1e6:.1f}M params + Adam)")
      print("\nblocking time of one save (the loop waits this long):")
      medians = {}
      for mode in ("async", "sync"):
        ckpt = Checkpointer(os.path.join(root, mode), keep=2, async_save=mode == "async")
        blocked = []
        for i in range(args.saves + 1):
          state, m = step_fn(state, batch())
          jax.block_until_ready(m)
          t = time.perf_counter()
          ckpt.save(i + 1, state, it, spec, cfg.to_dict())
          blocked.append(time.perf_counter() - t)
          ckpt.wait()  # let the background write finish before the next measurement
        ckpt.close()
        blocked = blocked[1:]  # the first save pays one-time setup
        medians[mode] = statistics.median(blocked)
        print(f"  {mode:<6} median {medians[mode] * 1e3:7.1f} ms  "
              f"(min {min(blocked) * 1e3:.1f}, max {max(blocked) * 1e3:.1f}; "
              f"{len(blocked)} saves)")
      ratio = medians["async"] / medians["sync"]
      print(f"  async / sync = {ratio:.1%} (target <= 10%: "
            f"{'PASS' if ratio <= 0.10 else 'FAIL'})")

      print(f"\nstep time with a checkpoint every N steps ({args.steps} steps each, async):")
      base = None
      for every in (int(x) for x in args.every.split(",")):
        directory = os.path.join(root, f"every{every}")
        ckpt = Checkpointer(directory, keep=2)
        t = time.perf_counter()
        for s in range(1, args.steps + 1):
          state, m = step_fn(state, batch())
          if every and s % every == 0:
            ckpt.save(s, state, it, spec, cfg.to_dict())
        jax.block_until_ready(m)
        ckpt.wait()
        per_step = (time.perf_counter() - t) / args.steps
        ckpt.close()
        shutil.rmtree(directory)
        if base is None:
          base = per_step
        label = "never" if not every else f"every {every:>3}"
        print(f"  {label:<10} {per_step * 1e3:7.1f} ms/step  overhead {per_step / base - 1:+6.1%}")
  finally:
    shutil.rmtree(root, ignore_errors=True)


if __name__ == "__main__":
  sys.exit(main())

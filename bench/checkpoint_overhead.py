"""How long a checkpoint blocks the training loop, async vs synchronous, with and without its
integrity checks (checksums, finiteness), and what saving every N steps costs in step time.

    python bench/checkpoint_overhead.py [--steps 60] [--saves 5] [--rounds 4]

~100 MB of train state (8.9M fp32 parameters + two Adam moments) fed tiny batches, so a step is
short and the checkpoint cost easy to see, through the real code path (`Program` for the step,
`Checkpointer` (Orbax) for saves, the grain pipeline for data). Prints medians; the machine's
noise is visible in the min/max columns. The integrity comparison alternates saves with them
(`Checkpointer(integrity=True)`) and without (`integrity=False`, a save as before they existed),
save by save in one process, so all see the same machine, each after a log step, in two kinds:
a save takes the parameters' finiteness from the step's param_norm as read back (what a run's
saves do with the default `log_every` and `checkpoint.every_steps`), or computes it (what a save
does where its step has no norms: `trainer.norm_metrics=never`, a local save between log steps).
The checksums' cost is timed where taken (Orbax's finalize, in the background), and a restore's.
"""
from __future__ import annotations

import os
import shutil
import statistics
import sys
import tempfile
import time

import numpy as np

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
  parser.add_argument("--rounds", type=int, default=4,
                      help="x --saves: saves with and without the integrity checks, alternated")
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
  from trainer.checkpoint.integrity import checkpoint_bytes  # noqa: PLC0415  start-up
  from trainer.checkpoint.persistent import Checkpointer  # noqa: PLC0415  start-up
  from trainer.step.program import Program  # noqa: PLC0415  start-up
  from trainer.step.state import init_state  # noqa: PLC0415  start-up

  cfg = default_config()
  cfg.model.update(d_model=args.d_model, num_layers=2, num_heads=8, num_kv_heads=8,
                   mlp_dim=4 * args.d_model)
  cfg.data.update(global_batch_size=2, seq_len=32, prefetch=2)
  program = Program(cfg, make_mesh({"data": 1}, jax.devices()[:1]))
  step_fn = program.compile()
  log_step = program.compile(logs=True)  # a log step's variant: its metrics have param_norm
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

      print(f"\nintegrity checks: {args.rounds} x {args.saves} async saves of each kind, "
            "alternated save by save:")
      kinds = {"without": "no checks", "log step": "with, the finiteness read back",
               "computed": "with, the finiteness computed by the save"}
      blocked = {k: [] for k in kinds}
      hashed, verified = [0, 0.0], [0, 0.0]
      ckpts = {k: Checkpointer(os.path.join(root, k.replace(" ", "_")), keep=2,
                               integrity=k != "without") for k in kinds}
      for i in range(args.rounds * args.saves + 1):
        order = list(kinds)[i % 3:] + list(kinds)[:i % 3]
        for kind in order:
          state, m = log_step(state, batch())  # every kind saves after a log step
          m = jax.device_get(m)  # as the loop reads a step's row back before saving it
          finite = bool(np.isfinite(m["param_norm"])) if kind == "log step" else None
          t = time.perf_counter()
          ckpts[kind].save(i + 1, state, it, spec, cfg.to_dict(), finite=finite)
          if i:  # the first save pays one-time setup
            blocked[kind].append(time.perf_counter() - t)
          ckpts[kind].wait()
        # what a restore reads to verify a step before accepting it (from the page cache)
        t = time.perf_counter()
        assert ckpts["computed"].verify(i + 1) is None
        verified = [verified[0] + checkpoint_bytes(os.path.join(ckpts["computed"].directory,
                                                                str(i + 1))),
                    verified[1] + time.perf_counter() - t]
      hashed = [sum(ckpts[k].handlers["state"].hashed[j] for k in kinds if k != "without")
                for j in (0, 1)]
      for ckpt in ckpts.values():
        ckpt.close()
      for kind, what in kinds.items():
        b = blocked[kind]
        print(f"  {kind:<9} median {statistics.median(b) * 1e3:7.1f} ms  (min {min(b) * 1e3:.1f}, "
              f"max {max(b) * 1e3:.1f}; {len(b)} saves: {what})")
      for kind in ("log step", "computed"):
        ratio = statistics.median(blocked[kind]) / statistics.median(blocked["without"])
        paired = statistics.median(a / b for a, b in zip(blocked[kind], blocked["without"]))
        print(f"  {kind} / without = {ratio:.3f} (medians; {paired:.3f} the median of the "
              f"{len(blocked[kind])} pairs; target <= 1.10: {'PASS' if ratio <= 1.10 else 'FAIL'})")
      print(f"  checksums (background, finalize step): {hashed[0] / 1e9:.2f} GB of state files "
            f"in {hashed[1]:.2f} s = {hashed[1] / max(hashed[0] / 1e9, 1e-9):.2f} s per GB")
      print(f"  verified before a restore: {verified[0] / 1e9:.2f} GB of checkpoint files in "
            f"{verified[1]:.2f} s = {verified[1] / max(verified[0] / 1e9, 1e-9):.2f} s per GB "
            "(from the page cache)")

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

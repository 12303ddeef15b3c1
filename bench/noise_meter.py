"""What the gradient-noise meter costs per step, plain and preconditioned, timed alternately.

    python bench/noise_meter.py --config configs/lm_tiny.py [--steps 10] [--rounds 5]
        [--config.a.b=v ...]

Three variants of the config's train step on the same batches: `off` (no meter), `plain` (the
measuring step with the meter's plain estimates only, as for an optimizer without Adam's second
moments) and `precond` (the measuring step with `noise_scale_precond` beside them, what adamw
and lamb run; needs one of them). Each is compiled up front and warmed up; then `--rounds`
rounds each time `--steps` steps of every variant in turn (the order rotating), so machine drift
hits them alike. Prints each variant's median time per step and its median per-round ratio to
`off`, and the preconditioned estimate's own cost, precond / plain. Every step here measures
(optim.noise_scale_every=1); a run measuring every Nth step pays 1/N of it.
"""
from __future__ import annotations

import os
import statistics
import sys
import tempfile
import time
from unittest import mock

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
from trainer.config import ConfigError  # noqa: E402
from trainer.config.cli import CliParser, load_from_cli  # noqa: E402
from trainer.multihost import platforms  # noqa: E402

VARIANTS = ("off", "plain", "precond")


def build_parser():
  parser = CliParser("bench/noise_meter.py", __doc__)
  parser.add_argument("--steps", type=int, default=10, help="timed steps per variant and round")
  parser.add_argument("--rounds", type=int, default=5)
  return parser


def main(argv=None):
  platforms.choose()
  import jax  # noqa: PLC0415  start-up
  try:
    args, rest = build_parser().parse_known_args(argv)
    cfg = load_from_cli(args.config, [*rest, "--config.optim.noise_scale_every=1"],
                        devices=jax.devices())
  except ConfigError as e:
    print(f"error: {e}", file=sys.stderr)
    return 2
  from data.pipeline import dataset  # noqa: PLC0415  start-up
  from optim import noise_scale  # noqa: PLC0415  start-up
  from trainer.run.loop import Run  # noqa: PLC0415  start-up
  from trainer.step.state import init_state  # noqa: PLC0415  start-up
  if cfg.optim.name not in noise_scale.PRECONDITIONED:
    print(f"error: optim.name={cfg.optim.name!r} has no preconditioned meter; use one of "
          f"{', '.join(noise_scale.PRECONDITIONED)}", file=sys.stderr)
    return 2

  with tempfile.TemporaryDirectory() as workdir:
    steps, state = {}, {}
    for name in VARIANTS:
      c = cfg.copy_and_resolve_references()
      if name == "off":
        c.optim.noise_scale_every = 0
      # `plain`: the factory builds the meter without P, as for an optimizer without moments
      with mock.patch.object(noise_scale, "PRECONDITIONED",
                             () if name == "plain" else noise_scale.PRECONDITIONED):
        run = Run(c, os.path.join(workdir, name))
        steps[name] = run.program.compile(measure_noise=name != "off")
        state[name] = init_state(run.program.spec, run.program.tx)
    it = iter(dataset(run.feed.spec))
    batches = [run.feed.global_batch([next(it) for _ in range(run.program.num_micro)])
               for _ in range(min(args.steps, 4))]
    times = {name: [] for name in VARIANTS}  # per round: the median step of its block
    with jax.set_mesh(run.mesh):
      for name in VARIANTS:  # warm-up
        for i in range(2):
          state[name], m = steps[name](state[name], batches[i % len(batches)])
          jax.block_until_ready(m)
      for r in range(args.rounds):
        for name in VARIANTS[r % 3:] + VARIANTS[:r % 3]:
          block = []
          for i in range(args.steps):
            t = time.perf_counter()
            state[name], m = steps[name](state[name], batches[i % len(batches)])
            jax.block_until_ready(m)
            block.append(time.perf_counter() - t)
          times[name].append(statistics.median(block))
  ratio = lambda a, b: statistics.median(x / y for x, y in zip(times[a], times[b]))
  print(f"config   {args.config} {' '.join(rest)}; {jax.device_count()} x "
        f"{jax.devices()[0].device_kind}; {args.rounds} rounds of {args.steps} steps each")
  print("| variant | median step (ms) | / off |")
  print("|---|---|---|")
  for name in VARIANTS:
    print(f"| {name} | {statistics.median(times[name]) * 1e3:.2f} | {ratio(name, 'off'):.3f} |")
  print(f"precond / plain: {ratio('precond', 'plain'):.3f} (the preconditioned estimate's own "
        "cost on a measuring step)")
  return 0


if __name__ == "__main__":
  sys.exit(main())

"""Steady-state training throughput and MFU of a config, against this machine's measured peak.

    python bench/throughput.py --config configs/lm_tiny.py [--steps 20] [--config.a.b=v ...]

Builds the real train step (same code path as train.py), feeds it real batches from the data
pipeline, and times `--steps` steps after two warm-up steps. `--noise-every N` turns on the
gradient-noise-scale meter as a run with `--config.optim.noise_scale_every=N` has it (the
measuring step on every Nth step) and times the same step without the meter alongside, in
`--rounds` alternating blocks, with the ratio of the two. Prints the median step time,
tokens/s, model FLOP/s, and MFU against (a) the matmul peak measured in this same process, in
the model's dtype on a product that fills the device (`trainer.tracking.peaks.measure_matmul_peak`:
1024^3 on a CPU, 8192^3 on an accelerator), and (b) the configured/known peak, so the ratio is
honest on any machine.
"""
from __future__ import annotations

import os
import statistics
import sys
import tempfile
import time

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
from trainer.config import ConfigError  # noqa: E402
from trainer.config.cli import CliParser, load_from_cli  # noqa: E402
from trainer.multihost import platforms  # noqa: E402


def build_parser():
  parser = CliParser("bench/throughput.py", __doc__)
  parser.add_argument("--steps", type=int, default=20)
  parser.add_argument("--noise-every", type=int, default=0, metavar="N",
                      help="run the gradient-noise-scale meter as a run with "
                      "optim.noise_scale_every=N does (the measuring step on every Nth step), "
                      "alternated with the same step without the meter")
  parser.add_argument("--rounds", type=int, default=1,
                      help="blocks of --steps steps (each variant's, alternating)")
  return parser


def main(argv=None):
  platforms.choose()  # as train.py: no TPU probing (and its start-up noise) without TPUs
  import jax  # noqa: PLC0415  start-up
  try:  # a mistake in the command line or config: one line, exit 2
    args, rest = build_parser().parse_known_args(argv)
    if args.noise_every:  # the meter in the optimizer, as in a run that logs the noise scale
      rest = [*rest, f"--config.optim.noise_scale_every={args.noise_every}"]
    cfg = load_from_cli(args.config, rest, devices=jax.devices())
  except ConfigError as e:
    print(f"error: {e}", file=sys.stderr)
    return 2

  from models.sizes import flops_per_token, param_counts  # noqa: PLC0415  start-up
  from trainer.run.loop import Run  # noqa: PLC0415  start-up
  from trainer.tracking.peaks import machine_peak_flops, matmul_probe_size, measure_matmul_peak  # noqa: PLC0415  start-up
  from trainer.step.state import init_state  # noqa: PLC0415  start-up

  with tempfile.TemporaryDirectory() as workdir:
    run = Run(cfg, workdir)
    t0 = time.perf_counter()
    step = run.program.compile()
    measuring = run.program.compile(measure_noise=True) if args.noise_every else None
    compile_s = time.perf_counter() - t0
    plain = None
    if args.noise_every:  # the same step without the meter in the optimizer, timed alongside
      off = cfg.copy_and_resolve_references()
      off.optim.noise_scale_every = 0
      plain = Run(off, os.path.join(workdir, "off"))
      plain_step, plain_state = plain.program.compile(), init_state(plain.program.spec,
                                                                     plain.program.tx)
    state = init_state(run.program.spec, run.program.tx)
    it = iter(__import__("data.pipeline", fromlist=["dataset"]).dataset(run.feed.spec))
    batches = [run.feed.global_batch([next(it) for _ in range(run.program.num_micro)])
               for _ in range(min(args.steps, 8))]
    times, plain_times = [], []
    with jax.set_mesh(run.mesh):
      for block in range(args.rounds):  # the two alternate in blocks of --steps steps
        for i in range(args.steps + 2):
          t = time.perf_counter()
          measure = bool(args.noise_every) and (i + 1) % args.noise_every == 0
          state, metrics = (measuring if measure else step)(state, batches[i % len(batches)])
          jax.block_until_ready(metrics)
          if i >= 2:
            times.append(time.perf_counter() - t)
        if plain is None:
          continue
        for i in range(args.steps + 2):
          t = time.perf_counter()
          plain_state, metrics = plain_step(plain_state, batches[i % len(batches)])
          jax.block_until_ready(metrics)
          if i >= 2:
            plain_times.append(time.perf_counter() - t)
  # The peak of the model's own arithmetic (model.dtype) on a product that fills the device.
  probe_n = matmul_probe_size(jax.default_backend())
  matmul_peak = measure_matmul_peak(probe_n, repeats=10, dtype=cfg.model.dtype)
  table_peak, source = machine_peak_flops(cfg.trainer.peak_flops_per_device, cfg.model.dtype)
  step_s = statistics.median(times)
  tokens = cfg.data.global_batch_size * cfg.data.seq_len
  fpt = flops_per_token(run.program.model_cfg, cfg.data.seq_len)["total"]
  tps = tokens / step_s
  counts = param_counts(run.program.model_cfg)
  print(f"config            {args.config} {' '.join(rest)}")
  print(f"devices           {jax.device_count()} x {jax.devices()[0].device_kind}; mesh "
        + " ".join(f"{k}={v}" for k, v in run.mesh.shape.items() if v > 1))
  print(f"params            {counts['total'] / 1e6:.2f}M; {fpt / 1e6:.2f} MFLOPs/token "
        f"(training, causal attention)")
  print(f"compile           {compile_s:.1f} s")
  print(f"step time         median {step_s * 1e3:.1f} ms over {len(times)} steps "
        f"(mean {statistics.mean(times) * 1e3:.1f}, min {min(times) * 1e3:.1f}, "
        f"max {max(times) * 1e3:.1f})")
  if args.noise_every:
    off_s = statistics.median(plain_times)
    every = "every step" if args.noise_every == 1 else f"every {args.noise_every} steps"
    print(f"noise scale       measured {every}; the same step without "
          f"the meter, alternated with it: median {off_s * 1e3:.1f} ms, mean "
          f"{statistics.mean(plain_times) * 1e3:.1f}; the meter's cost: {step_s / off_s - 1:+.1%} "
          f"median, {statistics.mean(times) / statistics.mean(plain_times) - 1:+.1%} mean")
  print(f"tokens/s          {tps:,.0f}")
  print(f"model FLOP/s      {tps * fpt / 1e9:.2f} GFLOP/s")
  print(f"matmul peak       {matmul_peak / 1e9:.2f} GFLOP/s ({cfg.model.dtype} {probe_n}^3, "
        "measured now)")
  print(f"MFU vs matmul     {tps * fpt / matmul_peak:.1%}")
  if not source.startswith("measured"):
    print(f"MFU vs {source:<10} {tps * fpt / table_peak:.1%}")


if __name__ == "__main__":
  sys.exit(main())

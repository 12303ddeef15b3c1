"""The memory a training run needs on each device: predicted ahead of time for every program the
run holds memory for, and checked against the device's own count.

    python -m tools.memory_check --config configs/lm_125m.py --topology h100:1 \\
        [--measure] [--steps 4] [--config.a.b=v ...]

Prediction (compile-only on `tools.aot`'s target devices, or `--topology local`): per device,
with the train state alive throughout, the train step, the logging step, evaluation, and where
the run has them DiLoCo's outer step and a circular pipeline's checkpoint save; the run's peak
is the largest. `--measure` (on devices of the target's kind) trains `--steps` steps as
train.py does (logged, evaluated, checkpointed), reads each device's peak_bytes_in_use and
prints measured / predicted (goal: within 10%) and the allocator's statistics around each
compile, at every logged row and at the end.
What each phase counts: docs/aot.md#predicted-against-measured-memory
"""
from __future__ import annotations

import os
import sys
import tempfile

from trainer.config import ConfigError
from trainer.config.cli import CliParser, load
from trainer.multihost import platforms

GOAL = 0.10  # |measured / predicted - 1| the prediction is held to (issue 25)


def predict(cfg, target, name: str):
  """(tools.aot's report of the train step, {phase: predicted bytes per device}) of a run of
  `cfg` on `target` (module docstring); raises tools.aot.AotError when the train step does not
  fit."""
  import jax  # noqa: PLC0415  start-up

  from tools import aot  # noqa: PLC0415  start-up
  from trainer.evaluation.periodic import jitted_eval_step  # noqa: PLC0415  start-up
  from trainer.step.program import Program  # noqa: PLC0415  start-up

  report = aot.compile_report(cfg, target, name)
  phases = {"train step": report.total_bytes}
  _, mesh = aot.target_mesh(cfg, target, name)
  program = Program(cfg, mesh)
  state, batch = program.abstract_state(), program.abstract_batch()
  eval_fn, flat = jitted_eval_step(program)
  micro = {k: jax.ShapeDtypeStruct(v.shape[1:], v.dtype, sharding=flat) for k, v in batch.items()}
  # What the evaluation scores: the parameters, or a DiLoCo run's anchor (part of the state).
  model_params = program.model_params(state)
  with jax.set_mesh(mesh), aot.no_persistent_cache():
    if program.computes_norms(True) != program.computes_norms(False):
      logging = program.jitted_step(logs=True).lower(state, batch).compile()
      phases["logging step"] = aot.compiled_costs(logging).total_bytes
    costs = aot.compiled_costs(eval_fn.lower(model_params, micro).compile())
  # The eval step's arguments are the parameters (in the state, counted once) + a batch.
  phases["evaluation"] = (report.state_bytes + costs.total_bytes
                          - aot.per_device_bytes(model_params))
  if program.diloco is not None:  # its argument is the whole (donated) state; compiled by aot
    phases["outer step"] = report.outer_step_bytes
  if program.layout.reordered:  # a circular pipeline's save: the plain-order copy beside it
    with jax.set_mesh(mesh), aot.no_persistent_cache():
      save = program.layout.conversion("to_saved").lower(state).compile()
    phases["checkpoint save"] = aot.compiled_costs(save).total_bytes
  return report, phases


def _stats() -> dict[str, int]:
  """`memory_stats()` of this process's device with the most bytes in use at their peak."""
  import jax  # noqa: PLC0415  start-up
  return max((d.memory_stats() or {} for d in jax.local_devices()),
             key=lambda st: st.get("peak_bytes_in_use", 0))


def measure(cfg, steps: int) -> tuple[int, list[tuple[str, dict]]]:
  """(the largest `peak_bytes_in_use` of this process's devices after training `cfg` for
  `steps` steps, logging every second, an evaluation and a checkpoint at the last; the
  allocator's statistics before and after each compile of a train step, at every logged row and
  at the end, to see when the peak came: a compile runs while the state is resident, and XLA's
  GPU autotuner allocates the buffers it tries candidate kernels on from the same allocator)."""
  from trainer.run.loop import Run  # noqa: PLC0415  start-up
  from trainer.step.program import Program  # noqa: PLC0415  start-up
  run_cfg = cfg.copy_and_resolve_references()
  run_cfg.steps = steps
  run_cfg.log_every = 2
  run_cfg.eval_every = steps
  run_cfg.checkpoint.update(every_steps=steps, async_save=True)
  run_cfg.trainer.progress_bar = False
  timeline = []

  def record(step, row):  # called with every logged row; never stops the run
    timeline.append((f"step {step} {'eval' if 'eval_loss' in row else 'train'} row", _stats()))

  compile_step = Program.compile

  def recorded_compile(program, *args, **kwargs):
    options = ", ".join(f"{k}={v}" for k, v in kwargs.items())
    timeline.append((f"before compiling the train step ({options})", _stats()))
    compiled = compile_step(program, *args, **kwargs)
    timeline.append(("after compiling it", _stats()))
    return compiled

  Program.compile = recorded_compile
  try:
    with tempfile.TemporaryDirectory() as workdir:
      result = Run(run_cfg, workdir, stop_when=record).train()
  finally:
    Program.compile = compile_step
  if result.status != "done":
    raise RuntimeError(f"the measuring run ended {result.status}: {result.message}")
  timeline.append(("end (checkpoint written)", _stats()))
  return timeline[-1][1].get("peak_bytes_in_use", 0), timeline


def build_parser():
  parser = CliParser("-m tools.memory_check", __doc__)
  parser.add_argument("--topology", required=True,
                      help="as tools.aot's (h100:1, v5e:2x2, ...), or local: this process's "
                      "own devices")
  parser.add_argument("--measure", action="store_true",
                      help="also train a few steps here and compare with the device's peak")
  parser.add_argument("--steps", type=int, default=4,
                      help="steps of the measuring run (DiLoCo: a multiple of "
                      "optim.diloco.inner_steps)")
  return parser


def main(argv: list[str]) -> int:
  platforms.choose()  # before jax starts: a machine with an NVIDIA GPU measures on it
  from tools import aot  # noqa: PLC0415  start-up
  from trainer.tracking.peaks import GiB  # noqa: PLC0415  start-up
  try:
    args, overrides = build_parser().parse(argv)
    name = os.path.splitext(os.path.basename(args.config))[0]
    cfg = load(args.config, overrides)
    if args.topology == "local":
      import jax  # noqa: PLC0415  start-up
      target = aot.Target("local", jax.devices())
    else:
      target = aot.config_target(cfg, args.topology)  # as tools.aot compiles for
    if args.measure:
      if args.steps < 2:
        raise ConfigError(f"--steps {args.steps}: measure over at least 2 steps")
      inner = cfg.optim.diloco.inner_steps
      if cfg.optim.diloco.replicas and args.steps % inner:
        raise ConfigError(f"--steps {args.steps}: a DiLoCo run's outer step (a phase predicted "
                          f"here) runs every optim.diloco.inner_steps={inner} steps; measure "
                          f"over a multiple of it (--steps {inner})")
      import jax  # noqa: PLC0415  start-up
      local = jax.local_devices()
      if local[0].device_kind != target.kind or len(jax.devices()) != len(target.devices):
        raise ConfigError(f"--measure needs the target's devices here ({len(target.devices)} x "
                          f"{target.kind}); this process has {len(jax.devices())} x "
                          f"{local[0].device_kind}")
      if local[0].memory_stats() is None:
        raise ConfigError(f"--measure: {local[0].platform} devices report no memory statistics "
                          "(memory_stats() is None); measure on a GPU or TPU")
    report, phases = predict(cfg, target, name)
  except (ConfigError, aot.AotError) as e:
    print(f"error: {e}", file=sys.stderr)
    return 2
  peak = max(phases.values())
  hbm = f" of {target.hbm_bytes / GiB:.1f} GiB" if target.hbm_bytes else ""
  replicas = cfg.optim.diloco.replicas
  state = (f"train state {report.state_bytes / GiB:.2f} GiB" + (
      f" (DiLoCo: one of {replicas} replicas' parameters and inner optimizer state, the anchor "
      "and the outer momentum)" if replicas else ""))
  print(f"{name} on {target.name} ({len(target.devices)} x {target.kind}), predicted per "
        f"device, {state}: " + ", ".join(f"{k} {v / GiB:.2f} GiB" for k, v in phases.items())
        + f" -> run peak {peak / GiB:.2f} GiB{hbm}")
  if args.measure:
    measured, timeline = measure(cfg, args.steps)
    for when, stats in timeline:
      print(f"  {when}: " + ", ".join(
          f"{k} {v / GiB:.2f} GiB" if "bytes" in k or "size" in k else f"{k} {v}"
          for k, v in sorted(stats.items())))
    ratio = measured / peak
    print(f"measured peak_bytes_in_use {measured / GiB:.2f} GiB after {args.steps} steps (logged, "
          f"evaluated, checkpointed) = {ratio:.3f} x predicted; within {GOAL:.0%}: "
          f"{'yes' if abs(ratio - 1) <= GOAL else 'no'}")
  return 0


if __name__ == "__main__":
  sys.exit(main(sys.argv[1:]))

"""What a training run reports about itself besides the metric rows of its steps: lines on the
console and event rows in metrics.jsonl, through the run's `MetricsWriter` (lead process only).

  log_setup            devices and mesh, model size, the data and its mixture
  log_batch_plan       the batch autopilot's settings and decisions, the ramp's stages, the
                       schedule in its unit, the hyperparameters each batch gets (optim/scaling.py)
  log_hyperparameters  one batch's derived hyperparameters, also as a `hyperparameters` event
  log_noise_meter      what the gradient-noise meter measures and the steps it averages over
  log_diloco           a DiLoCo run's replicas and steps, and the bytes that cross replicas next
                       to plain data parallelism's (trainer/tracking/communication.py)
  log_pipeline         a pipelined run's schedule, bubble and bytes between stages, counted from
                       the compiled step (`sharding.pipeline.count`), with its memory per device
  log_pipeline_plan    the pipeline's bubble by batch (`bubble_cost`, also the autopilot's cost)

The event rows: docs/tracking.md#what-a-run-writes.
"""
from __future__ import annotations

import jax
import ml_collections
from jax.sharding import Mesh

from data import mixture
from models.llama import ModelConfig
from models.resnet import row_group
from models.sizes import param_counts
from optim import BatchRamp, derive, noise_scale
from optim import schedules as schedules_lib
from optim.autopilot import Autopilot
from optim.scaling import describe as describe_hyperparameters
from sharding.pipeline import Count, count
from trainer.step.costs import compiled_costs
from trainer.tracking import communication
from trainer.tracking.metrics import MetricsWriter
from trainer.tracking.peaks import GiB


def log_setup(writer: MetricsWriter, mesh: Mesh, model_cfg: ModelConfig, data_meta: dict,
              data_dir: str, sources: tuple[mixture.Source, ...]) -> None:
  """Devices and mesh; parameters (total, non-embedding, active per token when not all are);
  the data (its name, fingerprint and train tokens from `data_meta`) and mixture weights."""
  counts = param_counts(model_cfg)
  src = data_meta["source"]
  writer.log(f"devices: {jax.device_count()} x {jax.devices()[0].device_kind} "
             f"({jax.process_count()} process(es)); mesh "
             + " ".join(f"{k}={v}" for k, v in mesh.shape.items()))
  writer.log(f"model: {counts['total'] / 1e6:.2f}M params "
             f"({counts['non_embedding'] / 1e6:.2f}M non-embedding"
             + (f", {counts['active'] / 1e6:.2f}M active per token" if counts["active"] !=
                counts["total"] else "") + "); "
             f"data: {src.get('name')} fingerprint {src.get('fingerprint')} "
             f"({data_meta['splits']['train']['tokens']:,} train "
             f"{'examples' if 'examples' in data_meta['splits']['train'] else 'tokens'}) from "
             f"{data_dir}")
  if len(sources) > 1:
    writer.log("mixture (token weights): " + ", ".join(
        f"{s.name}={s.dir}:{s.weight:g}" for s in sources))


def log_batch_plan(writer: MetricsWriter, cfg: ml_collections.ConfigDict, ramp: BatchRamp,
                   autopilot: Autopilot | None, step: int) -> None:
  """The batch autopilot's settings and decisions so far, the ramp's stages, the hyperparameters
  derived at each batch size (also as event rows at `step`), and the schedule when it is not
  simply in steps at one batch."""
  if autopilot is not None:
    a = autopilot.cfg
    writer.log(f"batch autopilot: {' -> '.join(map(str, a.sizes()))} sequences, x{a.factor} "
               + (f"when {'B_simple' if a.signal == 'noise_scale' else 'the preconditioned B_simple'}"
                  f" > {a.margin:g} x batch" if a.trigger == "noise_scale" else
                  f"when the norm test fails (eta={a.eta:g})")
               + f" at {a.patience} logged row(s) in a row (every {cfg.log_every} steps; the "
               f"meter measures every {cfg.optim.noise_scale_every}); decided so far: "
               + ("; ".join(c.describe() for c in autopilot.changes) or "none"))
  if not ramp.is_constant or ramp.cuts:
    writer.log(ramp.describe())
  for batch in dict.fromkeys(ramp.batches):
    log_hyperparameters(writer, cfg, step, batch)
  if cfg.optim.schedule_unit != "steps" or not ramp.is_constant:
    writer.log(schedules_lib.describe(cfg.optim, cfg.steps, ramp))


def log_noise_meter(writer: MetricsWriter, cfg: ml_collections.ConfigDict, ramp: BatchRamp,
                    micro_rows: int, dp: int, batches) -> None:
  """What the gradient-noise meter measures and the window it averages over, in steps (nothing
  when it is off)."""
  o = cfg.optim
  if not o.noise_scale_every:
    return
  pieces, staged = [], cfg.mesh.stage > 1  # a pipeline runs its micro-batches together
  group = row_group(cfg)  # whole ghost batch-norm groups
  for batch in dict.fromkeys(batches):
    m = batch // micro_rows
    parts = noise_scale.splits(m, int(o.noise_scale_pieces), micro_rows // dp, together=staged,
                               group=group)
    pieces.append(f"{parts if staged else m * parts} at batch {batch}")
  window = float(o.noise_scale_window)
  spans = []
  for n in sorted({min(100, cfg.steps), cfg.steps}):
    # the window holds at least the step's own measurement (a short run: "steps 3-3", not 4-3)
    first = min(ramp.first_step_at((1 - window) * ramp.examples_before(n)), n - 1)
    spans.append(f"at step {n:,} its steps {first + 1:,}-{n:,}")
  every = "every step" if o.noise_scale_every == 1 else f"every {o.noise_scale_every} steps"
  recency = (f", |G|^2 weighted by exp(-age / m of them), m the shortest of "
             f"{o.noise_scale_recency:g} x 1, 2, 4, 8, 16 (then even) whose mean's predicted "
             f"relative error is <= {noise_scale.MEMORY_RSE:g} (logged as noise_memory)"
             if o.noise_scale_recency else "")
  precond = ("; also preconditioned by Adam's second moments (noise_scale_precond)"
             if o.name in noise_scale.PRECONDITIONED else "")
  writer.log(f"gradient noise scale: measured {every} on small batches "
             f"({', '.join(pieces)}), averaged over the last {window:.0%} of the tokens trained "
             f"so far{recency} ({'; '.join(spans)}); a value once the window holds "
             f"{o.noise_scale_min_measurements} measurements"
             + (f" and its |G|^2 has a relative standard error <= {o.noise_scale_max_rse:g}"
                if o.noise_scale_max_rse else "") + precond)


def log_hyperparameters(writer: MetricsWriter, cfg: ml_collections.ConfigDict, step: int,
                        batch: int) -> None:
  """The hyperparameters the batch-size rules derive at `batch`: a line and an event row."""
  hp = derive(cfg.optim, batch, cfg.data.global_batch_size)
  writer.log(describe_hyperparameters(cfg.optim, hp))
  row = {f"hparams/{k}": v for k, v in hp.as_dict().items()}  # apart from the metrics
  writer.write(step, {"event": "hyperparameters", **row}, console=False)


def log_diloco(writer: MetricsWriter, program, batch: int, step: int, inner, outer, *,
               measure: bool) -> None:
  """A DiLoCo run's opening lines (`program`: its `trainer.step.program.Program`; `inner`, `outer`:
  its compiled steps for `batch`). With `measure` (the lead process) the communication across
  replicas is read from them, and plain data parallelism's step compiled to compare."""
  dl = program.diloco
  where = "; ".join(f"replica {r} on process(es) "
                    + ",".join(map(str, sorted({d.process_index for d in block.flat})))
                    for r, block in enumerate(program.mesh.devices))
  writer.log(f"{dl.describe()} ({where}); each replica steps on {batch // dl.replicas} of the "
             f"{batch} "
             "sequences of a step (the rows data parallelism reads); the batch-size rules derive "
             f"the inner optimizer's hyperparameters at the global batch {batch} (line above), "
             f"so H=1 with an outer SGD of rate 1 and a linear inner optimizer is data "
             f"parallelism at {batch}")
  if dl.replicas == 1:
    writer.log("one replica: nothing crosses replicas (the outer step is Lookahead-like)")
  elif measure:
    report = communication.measure(program, inner, outer, batch // program.micro_rows)
    for line in report.lines():
      writer.log(line)
    writer.write(step, {"event": "communication", **report.row()}, console=False)




def measure(program, compiled, micro: int) -> tuple[Count, object]:
  """(the pipeline's `Count`, the step's `CompiledCosts`) of a compiled train step."""
  weights = program.slot_flops() if program.pipeline.explicit else None
  return (count(program.pipeline, micro, compiled.as_text() or "", program.mesh, weights),
          compiled_costs(compiled))


def log_pipeline(writer, program, compiled, micro: int, step: int) -> None:
  """The pipeline's start-up line (module docstring) for the step compiled for `micro`
  micro-batches, and its event row."""
  found, costs = measure(program, compiled, micro)
  gib = lambda b: f"{b / GiB:.3g} GiB"
  writer.log(f"{program.pipeline.describe()}; " + found.line()
             + f"; memory per device {gib(costs.total_bytes)} (arguments "
             f"{gib(costs.argument_bytes)} + temporaries {gib(costs.temp_bytes)})")
  if found.table is not None:  # the table the loop runs, one line per stage
    for line in found.table.rows():
      writer.log(f"  schedule {line}")
  writer.write(step, {"event": "pipeline", **found.row(),
                      "pipeline/memory_bytes": costs.total_bytes}, console=False)


def bubble_cost(program):
  """batch -> the pipeline's bubble at that batch (the cost model the batch autopilot and the
  batch plan quote, M = batch / micro-batch rows: (S - 1) / (M R + S - 1) for GPipe and
  circular, the schedule table's weighted by the counted FLOPs of F, B, W for the explicit
  schedules), or None without a pipeline."""
  pipe = program.pipeline
  if pipe is None:
    return None
  weights = program.slot_flops() if pipe.explicit else None
  return lambda batch: pipe.bubble(batch // program.micro_rows, weights)


def log_pipeline_plan(writer, program, batches) -> None:
  """The cost model's bubble at every batch the run may use (the batch ramp's stages, the
  autopilot's sizes); nothing without a pipeline."""
  cost = bubble_cost(program)
  if cost is None:
    return
  pipe, rows = program.pipeline, program.micro_rows
  model = ("the schedule table's idle slot work, F:B:W weighted by their FLOPs" if pipe.explicit
           else "(S-1)/(MR+S-1)")
  writer.log(f"pipeline ({pipe.describe()}): bubble by batch ({model}), M = batch / {rows} "
             "rows: " + ", ".join(f"{b} -> M={b // rows}, {cost(b):.1%}"
                                  for b in dict.fromkeys(batches)))

"""What a training run reports about itself besides the metric rows of its steps.

  log_setup         the opening lines: devices and mesh, model size, the data and its mixture
  log_batch_plan    the batch-size plan: the batch autopilot's settings and decisions so far,
                    the ramp's stages, the schedule in its unit, and for each batch size the
                    hyperparameters the batch-size rules derive (`optim/scaling.py`)
  log_hyperparameters  one batch size's derived hyperparameters, printed and written to
                    metrics.jsonl as a `{"event": "hyperparameters", "hparams/...": ...}` row
  log_diloco        a DiLoCo run's replicas and steps, and the bytes that cross replicas next
                    to plain data parallelism's (`trainer/communication.py`), also as a
                    `{"event": "communication", "comm/...": ...}` row
  StepTimer         the timing columns of a log row: step_time, data_wait_ms, tokens_per_sec, mfu
  Events            the goodput events of every start of the run, appended to goodput.jsonl
                    (read by `python -m tools.goodput WORKDIR`)
  repair_jsonl      drop the partial last line of metrics.jsonl a killed process left

Lines go to the console through the run's `MetricsWriter` (`trainer/metrics.py`, the lead
process only), event rows to its metrics.jsonl.
"""
from __future__ import annotations

import contextlib
import json
import os
import time

import jax
import ml_collections
from jax.sharding import Mesh

from data import mixture
from models.llama import ModelConfig
from models.sizes import param_counts
from optim import BatchRamp, derive
from optim import schedules as schedules_lib
from optim.autopilot import Autopilot
from optim.scaling import describe as describe_hyperparameters
from trainer import communication
from trainer.metrics import MetricsWriter


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
             f"({data_meta['splits']['train']['tokens']:,} train tokens) from "
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
               + (f"when B_simple > {a.margin:g} x batch" if a.trigger == "noise_scale" else
                  f"when the norm test fails (eta={a.eta:g})")
               + f" at {a.patience} measurement(s) in a row (every "
               f"{cfg.optim.noise_scale_every} steps); decided so far: "
               + ("; ".join(c.describe() for c in autopilot.changes) or "none"))
  if not ramp.is_constant or ramp.cuts:
    writer.log(ramp.describe())
  for batch in dict.fromkeys(ramp.batches):
    log_hyperparameters(writer, cfg, step, batch)
  if cfg.optim.schedule_unit != "steps" or not ramp.is_constant:
    writer.log(schedules_lib.describe(cfg.optim, cfg.steps, ramp))


def log_hyperparameters(writer: MetricsWriter, cfg: ml_collections.ConfigDict, step: int,
                        batch: int) -> None:
  """The hyperparameters the batch-size rules derive at `batch`: a line and an event row."""
  hp = derive(cfg.optim, batch, cfg.data.global_batch_size)
  writer.log(describe_hyperparameters(cfg.optim, hp))
  row = {f"hparams/{k}": v for k, v in hp.as_dict().items()}  # apart from the metrics
  writer.write(step, {"event": "hyperparameters", **row}, console=False)


def log_diloco(writer: MetricsWriter, program, batch: int, step: int, inner, outer, *,
               measure: bool) -> None:
  """A DiLoCo run's opening lines (`program`: its `trainer.program.Program`; `inner`, `outer`:
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


class StepTimer:
  """Wall time per step over the window since the last log, excluding saves and evals, and the
  part of it the loop spent waiting for input (`data_wait_ms`: taking this step's micro-batches
  from the pipeline and assembling the global arrays). While the device is busy with the
  previous step, that wait is hidden; a `data_wait_ms` close to `step_time` means the input
  pipeline is the bottleneck."""

  def __init__(self):
    self.start = time.perf_counter()
    self.steps = 0
    self.excluded = 0.0
    self.data_wait = 0.0

  def step_dispatched(self):
    self.steps += 1

  def paused(self):
    """Time that is not step time (compiling, saving, evaluating)."""
    return self._adding_to("excluded")

  def waiting_for_data(self):
    return self._adding_to("data_wait")

  @contextlib.contextmanager
  def _adding_to(self, total: str):
    t = time.perf_counter()
    try:
      yield
    finally:
      setattr(self, total, getattr(self, total) + time.perf_counter() - t)

  def annotate(self, host: dict, tokens_per_step: int, flops_token: float, peak: float) -> dict:
    """Fill in the timing columns of the window since the last call, and start a new one. The
    window's totals stay in `window`: (steps, step seconds, of which waiting for data)."""
    now = time.perf_counter()
    steps = max(self.steps, 1)
    self.window = (self.steps, max(now - self.start - self.excluded, 0.0), self.data_wait)
    seconds = max(now - self.start - self.excluded, 1e-9) / steps
    host["step_time"] = seconds
    host["data_wait_ms"] = 1e3 * self.data_wait / steps
    host["tokens_per_sec"] = tokens_per_step / seconds
    host["mfu"] = host["tokens_per_sec"] * flops_token / peak
    self.start, self.steps, self.excluded, self.data_wait = now, 0, 0.0, 0.0
    return host


def process_start_time() -> float:
  """When this process started (wall clock, from /proc), or now where /proc cannot say."""
  try:
    with open("/proc/self/stat") as f:
      ticks = int(f.read().rsplit(")", 1)[1].split()[19])  # field 22, starttime after boot
    with open("/proc/uptime") as f:
      uptime = float(f.read().split()[0])
    return time.time() - (uptime - ticks / os.sysconf("SC_CLK_TCK"))
  except (OSError, ValueError, IndexError):
    return time.time()


class Events:
  """The run's goodput events, appended to `<workdir>/goodput.jsonl` by the lead process: one
  JSON line per event, each with its wall-clock `time`, written and flushed as it happens (a
  killed process loses nothing it wrote). What the loop records (trainer/loop.py):

    start       {process_start, processes, devices}: a process of the run began (each restart)
    restore     {seconds, step, tier, source}: the checkpoint it resumed from (step null: fresh)
    compile     {seconds, what}: a train step (or DiLoCo outer step) compiled
    first_step  {step}: the first step of this start was dispatched
    steps       {first, last, seconds, data_wait}: the step time of a window of steps between
                two log rows (saves, evaluations and compiles excluded; read with the metrics the
                loop reads anyway, so recording costs no device sync), and the part of it spent
                waiting for input
    checkpoint  {step, tier, seconds}: how long a save blocked the loop
    eval        {step, seconds}
    stop        {status, step, message}: how this start ended (a killed process writes none)

  `python -m tools.goodput WORKDIR` turns them into goodput and where the rest of the time went.
  """

  def __init__(self, workdir: str, enabled: bool):
    self.path = os.path.join(workdir, "goodput.jsonl")
    self._file = None
    if enabled:
      repair_jsonl(self.path)
      self._file = open(self.path, "a")

  def __call__(self, event: str, **fields) -> None:
    if self._file is not None:
      self._file.write(json.dumps({"event": event, "time": time.time(), **fields}) + "\n")
      self._file.flush()

  def close(self) -> None:
    if self._file is not None:
      self._file.close()
      self._file = None


def repair_jsonl(path: str) -> None:
  """Drop a partial last line left by a process killed mid-write."""
  if not os.path.exists(path):
    return
  with open(path, "rb+") as f:
    data = f.read()
    if data and not data.endswith(b"\n"):
      f.truncate(data.rfind(b"\n") + 1)

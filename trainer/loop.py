"""The training loop: build everything from the config, resume from the newest complete
checkpoint of either tier (the persistent one in the workdir, the local one in
`checkpoint.local_dir`), run the jitted step, log, evaluate, checkpoint, and stop cleanly when
told to (`Run`, and `RunResult`, how it ended). Around the loop: `trainer/saver.py` saves
checkpoints, `trainer/periodic_eval.py` evaluates every `eval_every` steps,
`trainer/run_report.py` prints the opening lines and batch-size plan, times the steps and
appends the goodput events (`python -m tools.goodput WORKDIR`), `trainer/elastic.py` says what
the batch becomes when a restart has other devices (`data.on_resize`).

The loop keeps the device busy: nothing is read back from the device between log steps, and a
log step's metrics are read while the next step runs (`trainer/decisions.py` says when the loop
logs, evaluates, saves and stops, the same on every process); the data pipeline prepares
micro-batches in a background thread.

How a run ends (`RunResult.status`, and train.py's exit code):
  done         reached `steps`                                                exit 0
  preempted    SIGTERM / SIGINT (to any one process): every process finishes
               the same step and they save one checkpoint together          exit 75
  nonfinite    a non-finite loss (or a spike) under policy "stop"             exit 3
  storage      a checkpoint could not be written under on_error="stop"        exit 4
Nothing in a step depends on wall-clock time or process state, so a run killed at any moment
and restarted continues bit for bit from its newest complete checkpoint.

Batch size. The global batch of step n is `data.global_batch_size`, or under a batch-size ramp
(`data.batch_ramp`, `optim/ramp.py`) the batch of the stage step n falls in: a pure function of
n, so a restart anywhere (also exactly on a stage boundary) continues the same sequence. A stage
is a number of micro-batches of the one fixed micro-batch shape: the data iterator simply yields
more or fewer micro-batches per step (step n reads the windows [examples before n, + batch) of
the data order, data/pipeline.py, whatever the micro-batch size), and the loop
compiles the train step once per distinct number of micro-batches and keeps it
(`compile_count` counts compilations), with a variant for the steps that compute more: those
that log (the norm metrics, `trainer.norm_metrics="log_steps"`) and those that measure the
gradient noise scale. At start the loop prints, once per batch size, the
hyperparameters the batch-size rules derive (`optim/scaling.py`), and writes them to
metrics.jsonl as `{"event": "hyperparameters", "hparams/learning_rate": ...}` rows
(`trainer/run_report.py`).

Batch autopilot (`data.batch_ramp = "auto"`, `optim/autopilot.py`). The ramp starts as one
stage of `data.global_batch_size` and grows as the run goes: the rows of the steps that measure
the noise scale are fed to the autopilot when the loop reads them back (at most one step late),
and a growth decided from step n's row starts at step n + 2, before which that row has always
been read. The new stage is added to the run's one ramp object, which the schedules' clocks
read when its step is compiled (once per batch size: the batch never shrinks). Each decision is
logged ("batch 8 -> 16 from step 42: B_simple=... > 2 x 8 ...") and written to metrics.jsonl as
an `{"event": "batch_change", ...}` row with its new hyperparameters; the decisions are saved in
every checkpoint (item `autopilot`) and replayed on resume, so a resumed run follows the same
batch sequence bit for bit.

With `optim.noise_scale_every` the gradient noise scale is logged every that many steps; with
`optim.ema_decay` every evaluation also scores the averaged parameters (`eval_loss_ema`,
`trainer/periodic_eval.py`).
"""
from __future__ import annotations

import contextlib
import dataclasses
import json
import os
import time
from collections.abc import Callable

import jax
import ml_collections
import numpy as np

from data import mixture, pipeline
from data.prepare import ensure_default_corpus, read_meta
from models.sizes import flops_per_token
from optim.autopilot import AutoConfig, Autopilot
from sharding.batch import assemble, process_rows
from trainer import elastic
from trainer.checkpoint import CheckpointError, Checkpointer, Restored, first_line, load_params
from trainer.decisions import Decider, MetricsWindow, StopSignals
from trainer.diloco import reduce_metrics
from trainer.horizon import fix_horizon
from trainer.inference import init_from_mismatch
from trainer.metrics import MetricsWriter, machine_peak_flops
from trainer.periodic_eval import make_evaluator
from trainer.profiling import ProfileWindow
from trainer.program import Program, run_mesh
from trainer.local_tier import LocalTier
from trainer.run_report import (Events, StepTimer, log_batch_plan, log_diloco,
                                log_hyperparameters, log_setup, process_start_time, repair_jsonl)
from trainer.saver import Saver
from trainer.stages import bubble_cost, log_pipeline, log_pipeline_plan

EXIT_CODES = {"done": 0, "nonfinite": 3, "storage": 4, "preempted": 75}


@dataclasses.dataclass
class RunResult:
  status: str  # done | preempted | nonfinite | storage
  step: int
  metrics: dict
  message: str = ""

  @property
  def exit_code(self) -> int:
    return EXIT_CODES[self.status]


def setup_compilation_cache(path: str) -> str | None:
  """Turn on JAX's persistent compilation cache (keyed by the program, so always safe)."""
  if path == "off":
    return None
  if not path:
    base = os.environ.get("SCALETRAIN_CACHE") or os.path.join(
        os.environ.get("XDG_CACHE_HOME") or os.path.expanduser("~/.cache"), "scaletrain")
    path = os.path.join(base, "jax")
  jax.config.update("jax_compilation_cache_dir", path)
  jax.config.update("jax_persistent_cache_min_compile_time_secs", 1.0)
  jax.config.update("jax_persistent_cache_min_entry_size_bytes", 0)
  return path


class Run:
  """One training run in one workdir. `Run(cfg, workdir).train()`."""

  def __init__(self, cfg: ml_collections.ConfigDict, workdir: str, *,
               stop_when: Callable[[int, dict], str | None] | None = None):
    """`stop_when(step, row)`, called with every logged training or evaluation row, may end the
    run early by returning a reason (tools/batch_sweep.py stops at a target loss)."""
    self.cfg = cfg
    self.stop_when = stop_when
    self.stop_reason: str | None = None
    self.workdir = os.path.abspath(workdir)
    self.is_lead = jax.process_index() == 0
    setup_compilation_cache(cfg.trainer.compile_cache_dir)
    # An unset schedule horizon is `steps` at the first start, kept in the checkpoints after.
    cfg, self.horizon_note = fix_horizon(cfg, os.path.join(self.workdir, "checkpoints"))
    self.mesh = run_mesh(cfg)
    self._build(cfg)
    # (micro-batches, measures noise, computes the norm metrics) -> compiled train step
    self.compiled_steps: dict = {}
    self.compile_count = 0
    self._pipeline_logged: set = set()  # micro-batch counts whose pipeline line was printed
    d = self.cfg.data
    # One source (data.dir or the default corpus) or a weighted mixture (data.mixture).
    self.sources = mixture.parse(d.mixture) if d.mixture else (
        mixture.Source("data", d.dir or ensure_default_corpus()),)
    self.data_dir = self.sources[0].dir
    self.data_meta = read_meta(self.data_dir)
    self._set_train_spec()
    self.writer = None
    self.checkpointer = None
    self.local = None
    self.events = Events(self.workdir, enabled=False)

  def _build(self, cfg: ml_collections.ConfigDict) -> None:
    """The program of `cfg` on the run's mesh and what follows from it (again after a restore
    that changes the batch, `trainer/elastic.py`)."""
    self.program = p = Program(cfg, self.mesh)
    self.cfg = cfg = p.cfg  # with the batch autopilot's defaults filled in (logged at start)
    self.micro_rows, self.num_micro = p.micro_rows, p.num_micro
    self.model_cfg, self.spec, self.tx = p.model_cfg, p.spec, p.tx
    self.shardings, self.batch_sharding = p.shardings, p.batch_sharding
    self.ramp = p.ramp  # the run's one ramp, shared with the schedules
    self.autopilot = Autopilot(AutoConfig.from_config(cfg.data), self.ramp, cost=bubble_cost(p)) \
        if cfg.data.batch_ramp == "auto" else None

  def _set_train_spec(self) -> None:
    d = self.cfg.data
    # This process reads the rows its devices hold (any mesh device order works).
    self.local_rows = process_rows(self.batch_sharding, (1, self.micro_rows, d.seq_len), 1)
    self.train_spec = pipeline.StreamSpec(
        self.data_dir, "train", d.seq_len, self.micro_rows, seed=self.cfg.seed,
        row_ids=self.local_rows, prefetch=d.prefetch,
        mixture=self.sources if d.mixture else ())

  # --------------------------------------------------------------------------------------------

  def log(self, message: str) -> None:
    if self.writer is not None:
      self.writer.log(message)
    elif self.is_lead:
      print(message, flush=True)

  def global_batch(self, micro_batches: list[dict[str, np.ndarray]]) -> dict[str, jax.Array]:
    """Stack this process's micro-batches and assemble the global [M, B, S] arrays."""
    out = {}
    for key in pipeline.BATCH_KEYS:
      local = np.stack([mb[key] for mb in micro_batches])
      global_shape = (local.shape[0], self.micro_rows, local.shape[2])
      out[key] = assemble(local, self.local_rows, self.batch_sharding, global_shape, row_axis=1)
    return out

  def train_step_for(self, num_micro: int, measure_noise: bool = False, logs: bool = False):
    """The compiled train step for `num_micro` micro-batches, measuring the gradient noise scale
    or not, for a step that logs or not (`Program.jitted_step`; each variant compiled on first
    use, and a step that logs shares the other steps' program unless it computes more)."""
    key = self._step_key(num_micro, measure_noise, logs)
    if key not in self.compiled_steps:
      t = time.perf_counter()
      self.compiled_steps[key] = self.program.compile(num_micro, measure_noise=measure_noise,
                                                      logs=logs)
      self.compile_count += 1
      self.events("compile", seconds=time.perf_counter() - t,
                  what=f"train step, {num_micro} micro-batch(es)"
                  + (", noise scale" if measure_noise else "") + (", log" if logs else ""))
    return self.compiled_steps[key]

  def _log_pipeline(self, num_micro: int, step: int) -> None:
    """A pipelined run's line for the first step compiled for `num_micro` micro-batches: the
    bubble and bytes between stages counted from it (trainer/stages.py)."""
    if self.program.pipeline is None or num_micro in self._pipeline_logged:
      return
    compiled = next((c for (m, noise, _), c in self.compiled_steps.items()
                     if m == num_micro and not noise), None)
    if compiled is not None:
      self._pipeline_logged.add(num_micro)
      log_pipeline(self.writer, self.program, compiled, num_micro, step)

  def _step_key(self, num_micro: int, measure_noise: bool, logs: bool) -> tuple:
    return num_micro, measure_noise, self.program.computes_norms(logs)

  def _steer(self, step: int, host: dict) -> None:
    """Feed a measuring step's row to the batch autopilot; log the change it decides."""
    change = self.autopilot.observe(step, host)
    if change is None:
      return
    self.log(self.autopilot.describe(change))
    self.writer.write(step, {"event": "batch_change", "batch": change.batch,
                             "old_batch": change.old, "from_step": change.step,
                             "reason": change.reason}, console=False)
    log_hyperparameters(self.writer, self.cfg, step, change.batch)

  def _stop_check(self, step: int, row: dict) -> None:
    if self.stop_when is not None and self.stop_reason is None:
      self.stop_reason = self.stop_when(step, row)

  def _start_state(self, checkpointer: Checkpointer):
    """(state, data iterator, restored step or None) from the newest readable checkpoint of
    either tier, `init_from`, or fresh. `self.restored`: the `Restored` checkpoint, if any."""
    make_iterator = lambda: iter(pipeline.dataset(self.train_spec))
    t = time.perf_counter()
    self.restored = restored = checkpointer.restore_latest(
        self.program.abstract_state(), self.train_spec, self.cfg.to_dict(),
        allow_fresh_start=self.cfg.checkpoint.allow_fresh_start,
        windows_before=self.ramp.examples_before, local=self.local)
    self.restore_seconds = time.perf_counter() - t
    if restored is not None:
      iterator = self._resize(restored)
      # a checkpoint holds the plain layer stack (a circular pipeline stores another order)
      restored = dataclasses.replace(restored, state=self.program.layout.from_saved(restored.state))
      if self.autopilot is not None:
        saved = restored.items.get("autopilot")
        if saved is None:
          self.log(f"checkpoint {restored.step} has no batch autopilot state: the autopilot "
                   f"starts at batch {self.ramp.batch_at(0)} from here")
        else:
          self.autopilot.load_state_dict(saved)
      return restored.state, iterator, restored.step
    if self.cfg.checkpoint.init_from:
      # Shapes alone miss a different rope_theta, rope scaling, norm eps, parametrization or
      # router top_k (models/config.py FUNCTIONAL): name it.
      reason = init_from_mismatch(self.cfg.checkpoint.init_from, self.model_cfg)
      if reason:
        raise CheckpointError(reason)
      params, source = load_params(self.cfg.checkpoint.init_from, self.spec.abstract_params)
      self.log(f"initialised parameters from {source} (optimizer state and data start fresh)")
      return self.program.init_state(params), make_iterator(), None
    return self.program.init_state(), make_iterator(), None

  def _resize(self, restored: Restored):
    """The data iterator to continue with after a restore, rebuilding the program when the batch
    or its history differ from the config's (`trainer/elastic.py`: `data.on_resize`)."""
    cfg, line = elastic.plan(self.cfg, restored.items.get("topology"), restored.step,
                             self.mesh, self.ramp)
    self._resize_line = line
    if cfg is None:
      return restored.iterator
    self._build(cfg)
    self._set_train_spec()
    iterator = iter(pipeline.dataset(self.train_spec))
    iterator.set_state(restored.iterator.get_state())
    return iterator

  # --------------------------------------------------------------------------------------------

  def train(self) -> RunResult:
    cfg = self.cfg
    started, process_start = time.time(), process_start_time()
    os.makedirs(self.workdir, exist_ok=True)
    self.checkpointer = checkpointer = Checkpointer(
        os.path.join(self.workdir, "checkpoints"), keep=cfg.checkpoint.keep,
        async_save=cfg.checkpoint.async_save, log=self.log)
    ck = cfg.checkpoint
    self.local = LocalTier(ck.local_dir, self.mesh, keep=ck.local_keep,
                           async_save=ck.async_save, log=self.log,
                           timeout_s=cfg.distributed.initialization_timeout) \
        if ck.local_dir else None
    status = None
    try:
      with StopSignals(multi_process=jax.process_count() > 1) as signals:
        # Restore first: a run that cannot start (unreadable or mismatched checkpoints) leaves
        # the workdir exactly as it found it.
        t = time.perf_counter()
        start_state = self._start_state(checkpointer)
        init_seconds = time.perf_counter() - t - self.restore_seconds
        cfg = self.cfg  # a resize may have changed the batch (trainer/elastic.py)
        repair_jsonl(os.path.join(self.workdir, "metrics.jsonl"))
        self.events = Events(self.workdir, enabled=self.is_lead)
        self.events("start", time=started, process_start=process_start,
                    processes=jax.process_count(), devices=jax.device_count())
        r = self.restored
        self.events("restore", seconds=self.restore_seconds, step=r and r.step,
                    tier=r and r.tier, source=r and r.source)
        if r is None:  # a fresh state: its initialiser is compiled, then run
          self.events("compile", seconds=init_seconds, what="state initialisation")
        self.writer = MetricsWriter(self.workdir, enabled=self.is_lead,
                                    progress_total=cfg.steps,
                                    progress_bar=cfg.trainer.progress_bar,
                                    wandb=cfg.trainer.wandb.to_dict(), run_config=cfg.to_dict())
        if self.is_lead:
          with open(os.path.join(self.workdir, "config.json"), "w") as f:
            json.dump(cfg.to_dict(), f, indent=1)
        result = self._train(checkpointer, signals, *start_state)
        status = (result.status, result.step, result.message)
        return result
    except BaseException as e:
      status = ("error", None, first_line(e))
      raise
    finally:
      if status is not None:
        self.events("stop", status=status[0], step=status[1], message=status[2])
      checkpointer.close()
      if self.local is not None:
        self.local.close()
      self.events.close()
      if self.writer is not None:
        self.writer.close()

  def _log_start(self, state, resumed_at) -> int:
    """The run's opening lines; returns the step the run starts from."""
    log_setup(self.writer, self.mesh, self.model_cfg, self.data_meta, self.data_dir,
              self.sources)
    start = int(jax.device_get(state.step))
    if resumed_at is not None:
      self.log(f"resumed from {self.restored.source}" + (
          " (local tier)" if self.restored.tier == "local" else ""))
      self.writer.write(start, {"event": "resumed", "tier": self.restored.tier}, console=False)
      if self._resize_line:
        self.log(self._resize_line)
    if self.horizon_note and resumed_at is not None:
      self.log(self.horizon_note)
    for line in self.program.defaults_filled:
      self.log(line)
    log_batch_plan(self.writer, self.cfg, self.ramp, self.autopilot, start)
    log_pipeline_plan(self.writer, self.program,
                      self.autopilot.cfg.sizes() if self.autopilot else self.ramp.batches)
    return start

  def _train(self, checkpointer: Checkpointer, signals: StopSignals, state, train_iter,
             resumed_at) -> RunResult:
    cfg = self.cfg
    start = self._log_start(state, resumed_at)
    decider = Decider(cfg, signals, start=start, evaluating=bool(cfg.eval_every))
    t0 = time.perf_counter()
    self.train_step_for(self.ramp.batch_at(start) // self.micro_rows,
                        decider.measures_noise(start + 1), decider.logs(start + 1))
    if self.program.diloco:
      t = time.perf_counter()
      self.outer_step = self.program.compile_outer()
      self.events("compile", seconds=time.perf_counter() - t, what="DiLoCo outer step")
    else:
      self.outer_step = None
    compile_seconds = time.perf_counter() - t0
    evaluate = make_evaluator(self.program, self.sources, self.local_rows) \
        if cfg.eval_every else None
    self.flops_token = flops_per_token(self.model_cfg, cfg.data.seq_len)["total"]
    self.peak, peak_source = machine_peak_flops(cfg.trainer.peak_flops_per_device,
                                                cfg.model.dtype)
    self.log(f"compiled train step in {compile_seconds:.1f}s; {self.flops_token / 1e6:.2f} "
             f"MFLOPs per token; peak {self.peak / 1e12:.3g} TFLOP/s ({peak_source})")
    if self.program.diloco is not None:  # replicas, and the bytes that cross them
      log_diloco(self.writer, self.program, self.ramp.batch_at(start), start,
                 next(iter(self.compiled_steps.values())), self.outer_step,
                 measure=self.is_lead)
    self._log_pipeline(self.ramp.batch_at(start) // self.micro_rows, start)
    if start >= cfg.steps:
      self.log(f"already at step {start} >= steps={cfg.steps}; nothing to do")
      return RunResult("done", start, {})

    self.timer = timer = StepTimer()
    self._recorded = self._dispatched = start  # steps in goodput events / dispatched so far
    self.last_metrics = {}
    self._stage = None  # the batch ramp's stage of the last step dispatched
    window = MetricsWindow(reduce_metrics(self.mesh) if self.program.diloco else None)
    save = Saver(checkpointer, self.train_spec, cfg.to_dict(), timer, decider, self.log,
                  autopilot=self.autopilot, local=self.local, events=self.events,
                  topology=lambda: elastic.topology(self.mesh, cfg, self.ramp),
                  to_saved=self.program.layout.to_saved)
    outcome = None  # (status, message) once the run must end early
    deferred = None  # a log step whose row is read while the next step runs
    step = start
    profile = ProfileWindow(cfg.trainer.profile_steps, self.workdir, log=self.log)
    with jax.set_mesh(self.mesh), contextlib.closing(profile):
      while step < cfg.steps:
        profile.before_step(step + 1)
        state, metrics = self._dispatch(state, train_iter, step, decider.measures_noise(step + 1),
                                        decider.logs(step + 1))
        step += 1
        if step == start + 1:
          self.events("first_step", step=step)
        profile.after_step(step, metrics)
        decision = decider.after(step)
        if decision.outer:  # DiLoCo: average the replicas into the anchor, restart them there
          state, outer_metrics = self.outer_step(state)
          metrics = {**metrics, **outer_metrics}
        window.add(step, metrics, decision.log)
        if deferred is not None:
          outcome, deferred = self._read(window, upto=deferred), None
          if outcome or self.stop_reason is not None:
            break
        if not decision.read:
          deferred = step if decision.log else None
          continue
        # A save, an evaluation or a stop reads the window first: a bad step is never
        # checkpointed or evaluated.
        outcome = self._read(window)
        if outcome:
          break
        if decision.preempted:
          ok = save(step, state, train_iter, blocking=True)
          outcome = ("preempted", f"{decision.preempted}: stopped after step {step}; " + (
              f"checkpoint saved to {checkpointer.directory}/{step}" if ok else
              "the checkpoint could not be written"))
          break
        if decision.save and not save(step, state, train_iter, blocking=decision.final):
          if decision.final or cfg.checkpoint.on_error == "stop":
            outcome = ("storage", f"stopped at step {step}: checkpoint storage failed"
                       if not decision.final else
                       f"finished step {step} but its checkpoint could not be written")
            break
        if decision.local_save:
          save.to_local(step, state, train_iter)
        if decision.evaluate:
          self._evaluate(evaluate, state, step)
        if self.stop_reason is not None:
          break
      if outcome is None:
        outcome = self._read(window)
    status, message = outcome or ("done", "")
    if status == "done" and self.stop_reason is not None:
      message = f"stopped after step {step}: {self.stop_reason}"
    t = time.perf_counter()
    try:
      checkpointer.wait()
    except Exception as e:  # noqa: BLE001
      if status == "done":
        status, message = "storage", f"the last checkpoint could not be written ({first_line(e)})"
    if self.local is not None:
      try:
        self.local.wait()
      except Exception as e:  # noqa: BLE001  a local write is best effort
        self.log(f"the last local checkpoint could not be written ({first_line(e)})")
    self.events("checkpoint", step=step, tier="wait", seconds=time.perf_counter() - t)
    if message:
      self.log(message)
    return RunResult(status, step, self.last_metrics, message)

  def _dispatch(self, state, train_iter, step: int, measure_noise: bool, logs: bool):
    """Start step `step + 1` on the devices (the batch ramp's stage decides its batch)."""
    stage = self.ramp.stage_at(step)
    if stage != self._stage and not self.ramp.is_constant:
      self.log(f"step {step + 1}: batch {self.ramp.batch_at(step)} (stage {stage + 1} of "
               f"{len(self.ramp.batches)}, {self.ramp.tokens_before(step):,} tokens seen)")
    self._stage = stage
    num_micro = self.ramp.batch_at(step) // self.micro_rows
    if self._step_key(num_micro, measure_noise, logs) not in self.compiled_steps:
      # Compiling a new variant (a new stage's, the first log step's) is not step time, but the
      # steps still running on the device are: wait for them before pausing the timer.
      jax.block_until_ready(state)
    with self.timer.paused():
      train_step = self.train_step_for(num_micro, measure_noise, logs)
      self._log_pipeline(num_micro, step)
    with self.timer.waiting_for_data():
      batch = self.global_batch([next(train_iter) for _ in range(num_micro)])
    state, metrics = train_step(state, batch)
    self.timer.step_dispatched()
    self._dispatched = step + 1
    self.writer.advance(1)
    return state, metrics

  def _evaluate(self, evaluate, state, step: int) -> None:
    t = time.perf_counter()
    with self.timer.paused():
      row = evaluate(state)
    self.events("eval", step=step, seconds=time.perf_counter() - t)
    self.writer.write(step, row)
    self.last_metrics.update(row)
    self._stop_check(step, row)

  def _read(self, window: MetricsWindow, upto: int | None = None) -> tuple[str, str] | None:
    """Write the due rows of the steps read back; apply the non-finite / spike policies.
    Returns (status, message) when the run must stop."""
    cfg = self.cfg
    for step, host, log in window.read(upto):
      if log:
        batch = self.ramp.batch_at(step - 1)
        if not self.ramp.is_constant or self.autopilot is not None:
          host["batch_size"] = batch
        self.timer.annotate(host, batch * cfg.data.seq_len, self.flops_token, self.peak)
        _, seconds, data_wait = self.timer.window  # the steps dispatched since the last row
        self.events("steps", first=self._recorded + 1, last=self._dispatched, seconds=seconds,
                    data_wait=data_wait)
        self._recorded = self._dispatched
      if log or host["skipped"]:
        self.writer.write(step, host)
        self.writer.advance(0, loss=host["loss"])
        self.last_metrics = host
        self._stop_check(step, host)
      if log and self.autopilot is not None and "noise_scale" in host:
        self._steer(step, host)
      if not host["skipped"]:
        continue
      kind = "non-finite loss/gradient" if host["nonfinite"] else "loss spike"
      policy = cfg.trainer.nonfinite_policy if host["nonfinite"] else cfg.trainer.spike_policy
      if policy == "stop":
        steps = self.checkpointer.all_steps()
        newest = f"newest checkpoint: step {steps[-1]}" if steps else "no checkpoint yet"
        return "nonfinite", (f"{kind} at step {step} (loss={host['loss']}); stopping without "
                             f"applying it; {newest}")
      self.log(f"{kind} at step {step} (loss={host['loss']}): update skipped")
    return None

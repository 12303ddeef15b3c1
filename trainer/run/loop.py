"""The training loop (`Run(cfg, workdir).train()` -> `RunResult`): build the program, restore the
newest complete checkpoint of either tier or start fresh, then step, read back, save, evaluate,
until `steps` or a stop. The parts it calls:

  Program          trainer/step/program.py       model, optimizer, shardings, the jitted step
  Feed             trainer/run/feed.py           the data order of this process's rows
  CompiledSteps    trainer/run/steps.py          one compiled step per batch / variant
  Decider          trainer/run/decisions.py      when to log, save, evaluate, stop
  Readback         trainer/run/readback.py       metrics rows, NaN / spike policies, autopilot
  Saver            trainer/checkpoint/saver.py   saves to both tiers
  MetricsWriter    trainer/tracking/metrics.py   metrics.jsonl, TensorBoard, console

Nothing is read back from the device between log steps, and nothing in a step depends on wall
clock or process state, so a killed run restarted resumes bit for bit (docs/reliability.md).
How the batch follows a ramp or the autopilot: docs/batch_size.md.
"""
from __future__ import annotations

import contextlib
import dataclasses
import json
import os
import socket
import sys
import time

import jax
import ml_collections

from models.sizes import flops_per_token
from optim.autopilot import AutoConfig, Autopilot
from sharding.mesh import data_parallel_size
from trainer.checkpoint import elastic
from trainer.checkpoint.horizon import fix_horizon
from trainer.checkpoint.identity import keep_identity, run_identity
from trainer.checkpoint.integrity import NonFiniteState
from trainer.checkpoint.local_tier import LocalTier
from trainer.checkpoint.model_dirs import load_params
from trainer.checkpoint.persistent import Checkpointer
from trainer.checkpoint.saver import Saver
from trainer.errors import first_line
from trainer.evaluation.periodic import make_evaluator
from trainer.run.decisions import Decider, StopSignals
from trainer.run.faults import Fault
from trainer.run.feed import Feed, sources
from trainer.run.readback import Readback
from trainer.run.steps import CompiledSteps
from trainer.run.watchdog import EXIT_HUNG, watching
from trainer.run.workdir_lock import WorkdirLock
from trainer.step.diloco import reduce_metrics
from trainer.step.program import Program, run_mesh, setup_compilation_cache
from trainer.tracking.goodput import Events, StepTimer, process_start_time, repair_jsonl
from trainer.tracking.metrics import MetricsWriter
from trainer.tracking.peaks import machine_peak_flops
from trainer.tracking.profiling import ProfileWindow
from trainer.tracking.report import (bubble_cost, log_batch_plan, log_diloco, log_noise_meter,
                                     log_pipeline_plan, log_setup)

EXIT_CODES = {"done": 0, "nonfinite": 3, "storage": 4, "hung": EXIT_HUNG, "preempted": 75}


@dataclasses.dataclass
class RunResult:
  """How a run ended: done (reached `steps`), preempted (SIGTERM / SIGINT: every process saved
  the same step), nonfinite (policy "stop"), storage (a checkpoint could not be written)."""
  status: str
  step: int
  metrics: dict
  message: str = ""

  @property
  def exit_code(self) -> int:
    return EXIT_CODES[self.status]


class Run:
  """One training run in one workdir. `stop_when(step, row)`, called with every logged training
  or evaluation row, may end the run early by returning a reason (a sweep's target loss)."""

  def __init__(self, cfg: ml_collections.ConfigDict, workdir: str, *,
               stop_when=None):
    self.stop_when = stop_when
    self.workdir = os.path.abspath(workdir)
    self.is_lead = jax.process_index() == 0
    setup_compilation_cache(cfg.trainer.compile_cache_dir)
    # An unset schedule horizon is `steps` at the first start, kept in the checkpoints after.
    cfg, self.horizon_note = fix_horizon(cfg, os.path.join(self.workdir, "checkpoints"))
    self.config_batch = cfg.data.global_batch_size
    cfg = elastic.as_resumed(cfg, self.workdir, jax.devices())  # a rescaling restart's batch
    self.mesh = run_mesh(cfg)
    self.events = Events(self.workdir, enabled=False)
    self.sources = sources(cfg)
    self._build(cfg)
    self.writer = self.checkpointer = self.local = None

  def _build(self, cfg: ml_collections.ConfigDict) -> None:
    """The program of `cfg` on the run's mesh and what follows from it (again after a restore
    that changes the batch, trainer/checkpoint/elastic.py)."""
    self.program = p = Program(cfg, self.mesh)
    self.cfg = p.cfg  # with the batch autopilot's or Seesaw's defaults filled in
    self.ramp = p.ramp  # the run's one ramp, shared with the schedules
    self.autopilot = Autopilot(AutoConfig.from_config(p.cfg.data), self.ramp,
                               cost=bubble_cost(p)) if p.cfg.data.batch_ramp == "auto" else None
    self.feed = Feed(p.cfg, p, self.sources)
    self.steps = CompiledSteps(p, lambda *a, **k: self.events(*a, **k))

  def log(self, message: str, *, stderr: bool = False) -> None:
    if self.writer is not None:
      self.writer.log(message, stderr=stderr)
    elif self.is_lead:
      print(message, flush=True, file=sys.stderr if stderr else sys.stdout)

  def warn(self, message: str, *, here: bool = False) -> None:
    """A line about something that failed (a save): to stderr; `here`: it happened on this
    process alone (a local save), so this process says it even if it does not lead."""
    if here and not self.is_lead:
      print(f"process {jax.process_index()}: {message}", file=sys.stderr, flush=True)
    else:
      self.log(message, stderr=True)

  # --------------------------------------------------------------------------------------------

  def train(self) -> RunResult:
    """Train in the workdir, holding its lock (a second run on it is refused: WorkdirBusy)."""
    started, process_start = time.time(), process_start_time()
    os.makedirs(self.workdir, exist_ok=True)
    lock = WorkdirLock(self.workdir, log=self.log,
                       timeout_s=self.cfg.distributed.initialization_timeout)
    lock.acquire()
    try:
      return self._train_locked(started, process_start, lock.held)
    finally:
      lock.release()

  def _train_locked(self, started: float, process_start: float, locked: bool) -> RunResult:
    ck, timeout = self.cfg.checkpoint, self.cfg.distributed.initialization_timeout
    self.identity, note = run_identity(self.workdir, timeout)  # run.json once it has started
    if note:
      self.log(note)
    self.checkpointer = Checkpointer(os.path.join(self.workdir, "checkpoints"), keep=ck.keep,
                                     async_save=ck.async_save, log=self.log, timeout_s=timeout)
    if locked:  # no save of another run can be in flight: what an interrupted one left goes
      self.checkpointer.remove_interrupted()
    self.local = LocalTier(ck.local_dir, self.mesh, run=self.identity, keep=ck.local_keep,
                           async_save=ck.async_save, log=self.log, timeout_s=timeout) \
        if ck.local_dir else None
    status = None
    try:
      with StopSignals(multi_process=jax.process_count() > 1) as signals:
        # Restore first: a run that cannot start (unreadable or mismatched checkpoints) leaves
        # the workdir exactly as it found it.
        t = time.perf_counter()
        state, iterator, restored, restore_seconds = self._start()
        init_seconds = time.perf_counter() - t - restore_seconds
        repair_jsonl(os.path.join(self.workdir, "metrics.jsonl"))
        self.events = Events(self.workdir, enabled=self.is_lead)
        self.events("start", time=started, process_start=process_start, pid=os.getpid(),
                    host=socket.gethostname(), processes=jax.process_count(),
                    devices=jax.device_count())
        self.events("restore", seconds=restore_seconds, step=restored and restored.step,
                    tier=restored and restored.tier, source=restored and restored.source)
        if restored is None:  # a fresh state: its initialiser is compiled, then run
          self.events("compile", seconds=init_seconds, what="state initialisation")
        cfg = self.cfg  # a resize may have changed the batch
        self.writer = MetricsWriter(self.workdir, enabled=self.is_lead, progress_total=cfg.steps,
                                    progress_bar=cfg.trainer.progress_bar,
                                    wandb=cfg.trainer.wandb.to_dict(), run_config=cfg.to_dict())
        if self.is_lead:
          with open(os.path.join(self.workdir, "config.json"), "w") as f:
            json.dump(cfg.to_dict(), f, indent=1)
          keep_identity(self.workdir, self.identity)
        self.timer, newest = StepTimer(), lambda: (self.checkpointer.all_steps() or [None])[-1]
        with watching(self.timer, cfg.trainer.hang_timeout_s, self.workdir, newest, self.events):
          result = self._train(signals, state, iterator, restored)
        status = (result.status, result.step, result.message)
        return result
    except BaseException as e:
      status = ("error", None, first_line(e))
      raise
    finally:
      if status is not None:
        self.events("stop", status=status[0], step=status[1], message=status[2])
      self.checkpointer.close()
      if self.local is not None:
        self.local.close()
      self.events.close()
      if self.writer is not None:
        self.writer.close()

  def _start(self):
    """(state, data iterator, the `Restored` checkpoint or None, seconds restoring): the newest
    readable checkpoint of either tier, else `checkpoint.init_from`'s parameters, else fresh."""
    t = time.perf_counter()
    restored = self.checkpointer.restore_latest(
        self.program.abstract_state(), self.feed.spec, self.cfg.to_dict(),
        allow_fresh_start=self.cfg.checkpoint.allow_fresh_start,
        windows_before=self.ramp.examples_before, local=self.local)
    seconds = time.perf_counter() - t
    self.resize_line = None
    if restored is None:
      return self._fresh_state(), self.feed.iterator(), None, seconds
    # Other devices: the batch kept or rescaled (data.on_resize), the program rebuilt for it.
    cfg, self.resize_line = elastic.plan(self.cfg, restored.items.get("topology"), restored.step,
                                         self.mesh, self.ramp, self.config_batch)
    iterator = restored.iterator
    if cfg is not None:
      self._build(cfg)
      iterator = self.feed.iterator()
      iterator.set_state(restored.iterator.get_state())
    # a checkpoint holds the plain layer stack (a circular pipeline stores another order)
    state = self.program.layout.from_saved(restored.state)
    if self.autopilot is not None:  # its decisions so far, replayed
      saved = restored.items.get("autopilot")
      if saved is None:
        self.log(f"checkpoint {restored.step} has no batch autopilot state: the autopilot "
                 f"starts at batch {self.ramp.batch_at(0)} from here")
      else:
        self.autopilot.load_state_dict(saved)
    return state, iterator, restored, seconds

  def _fresh_state(self):
    """A fresh train state, with `checkpoint.init_from`'s parameters where it names a run."""
    source = self.cfg.checkpoint.init_from
    if not source:
      return self.program.init_state()
    # Verified like a resume (checksums, finiteness; falls back past a damaged step). Shapes
    # alone miss a different rope_theta, rope scaling, norm eps, parametrization or router
    # top_k (models/config.py FUNCTIONAL): load_params names it.
    params, found = load_params(source, self.program.spec.abstract_params,
                                model_cfg=self.program.model_cfg, log=self.log)
    self.log(f"initialised parameters from {found} (optimizer state and data start fresh)")
    return self.program.init_state(params)

  def _log_start(self, start: int, restored) -> None:
    """The run's opening lines."""
    log_setup(self.writer, self.mesh, self.program.model_cfg, self.feed.meta, self.feed.dir,
              self.sources)
    if restored is not None:
      self.log(f"resumed from {restored.source}"
               + (" (local tier)" if restored.tier == "local" else ""))
      self.writer.write(start, {"event": "resumed", "tier": restored.tier}, console=False)
      for line in (self.resize_line, self.horizon_note):
        if line:
          self.log(line)
    for line in self.program.defaults_filled:
      self.log(line)
    batches = self.autopilot.cfg.sizes() if self.autopilot else self.ramp.batches
    log_batch_plan(self.writer, self.cfg, self.ramp, self.autopilot, start)
    log_noise_meter(self.writer, self.cfg, self.ramp, self.program.micro_rows,
                    data_parallel_size(self.mesh.shape), batches)
    log_pipeline_plan(self.writer, self.program, batches)

  def _compile_first(self, start: int, decider: Decider):
    """Compile the first step (and a DiLoCo run's outer step) and say what it costs; returns the
    outer step or None and the model FLOPs per token."""
    cfg, program = self.cfg, self.program
    t0 = time.perf_counter()
    micro = self.ramp.batch_at(start) // program.micro_rows
    self.steps.get(micro, decider.measures_noise(start + 1), decider.logs(start + 1))
    outer = None
    if program.diloco:
      t = time.perf_counter()
      outer = program.compile_outer()
      self.events("compile", seconds=time.perf_counter() - t, what="DiLoCo outer step")
    flops_token = flops_per_token(program.model_cfg, cfg.data.seq_len)["total"]
    self.peak, source = machine_peak_flops(cfg.trainer.peak_flops_per_device, cfg.model.dtype)
    self.log(f"compiled train step in {time.perf_counter() - t0:.1f}s; {flops_token / 1e6:.2f} "
             f"MFLOPs per token; peak {self.peak / 1e12:.3g} TFLOP/s ({source})")
    if program.diloco is not None:  # replicas, and the bytes that cross them
      log_diloco(self.writer, program, self.ramp.batch_at(start), start,
                 next(iter(self.steps.compiled.values())), outer, measure=self.is_lead)
    self.steps.log_pipeline(self.writer, micro, start)
    return outer, flops_token

  def _train(self, signals: StopSignals, state, train_iter, restored) -> RunResult:
    cfg = self.cfg
    start = int(jax.device_get(state.step))
    self._log_start(start, restored)
    decider = Decider(cfg, signals, start=start, evaluating=bool(cfg.eval_every))
    self.fault = Fault(cfg.trainer.fault, jax.process_index(), log=self.log)
    with self.timer.paused("compile"):  # (the hang watchdog's clock stands still)
      outer_step, flops_token = self._compile_first(start, decider)
    if start >= cfg.steps:
      self.log(f"already at step {start} >= steps={cfg.steps}; nothing to do")
      return RunResult("done", start, {})
    evaluate = make_evaluator(self.program, self.sources, self.feed.local_rows) \
        if cfg.eval_every else None
    readback = Readback(cfg, self.ramp, self.autopilot, self.writer, self.timer, self.events,
                        flops_token=flops_token, peak=self.peak, start=start,
                        newest_checkpoint=lambda: (self.checkpointer.all_steps() or [None])[-1],
                        stop_when=self.stop_when,
                        reduce=reduce_metrics(self.mesh) if self.program.diloco else None)
    self.saver = save = Saver(
        self.checkpointer, self.feed.spec, cfg.to_dict(), self.timer, decider, self.log,
        autopilot=self.autopilot, local=self.local, events=self.events, run=self.identity,
        topology=lambda: elastic.topology(self.mesh, cfg, self.ramp),
        to_saved=self.program.layout.to_saved, warn=self.warn)
    stops = lambda: save.nonfinite or cfg.checkpoint.on_error == "stop"  # after a failed save
    outcome = None  # (status, message) once the run must end early
    deferred = None  # a log step whose row is read while the next step runs
    step = start
    self._stage = None  # the batch ramp's stage of the last step dispatched
    self._running = None  # the metrics of the step dispatched last (it runs or is queued)
    profile = ProfileWindow(cfg.trainer.profile_steps, self.workdir, log=self.log)
    with jax.set_mesh(self.mesh), contextlib.closing(profile):
      while step < cfg.steps:
        profile.before_step(step + 1)
        state, metrics = self._dispatch(state, train_iter, step, decider)
        step += 1
        readback.dispatched = step
        if step == start + 1:
          self.events("first_step", step=step)
        profile.after_step(step, metrics)
        decision = decider.after(step)
        if decision.outer:  # DiLoCo: average the replicas into the anchor, restart them there
          state, outer_metrics = outer_step(state)
          metrics = {**metrics, **outer_metrics}
        readback.window.add(step, metrics, decision.log)
        if deferred is not None:
          outcome, deferred = readback(upto=deferred), None
          if outcome or readback.stop_reason is not None:
            break
        if decision.log and not decision.save and save.poll() and stops():
          outcome = readback() or save.nonfinite or ("storage", f"stopped at step {step}: "
                                                     "checkpoint storage failed")
          break
        if not decision.read:
          deferred = step if decision.log else None
          continue
        # A save, an evaluation or a stop reads the window first: a bad step is never
        # checkpointed or evaluated.
        outcome = readback()
        if outcome:
          break
        # The saved parameters' finiteness, from the step's param_norm where it was read back
        # (not after DiLoCo's outer step, which moves them); else each save computes it.
        finite = None if decision.outer else readback.params_finite(step)
        if decision.preempted:
          ok = save(step, state, train_iter, blocking=True, finite=finite)
          outcome = ("preempted", f"{decision.preempted}: stopped after step {step}; " + (
              f"checkpoint saved to {self.checkpointer.directory}/{step}" if ok else
              "the checkpoint could not be written"))
          break
        if decision.save and not save(step, state, train_iter, blocking=decision.final,
                                      finite=finite):
          if decision.final or stops():
            outcome = save.nonfinite or ("storage", f"stopped at step {step}: checkpoint "
                                         "storage failed" if not decision.final else
                                         f"finished step {step} but its checkpoint could not be "
                                         "written")
            break
        if decision.local_save:
          save.to_local(step, state, train_iter, finite=finite)
        if decision.evaluate:
          t = time.perf_counter()
          with self.timer.paused("eval"):
            row = evaluate(state)
          self.events("eval", step=step, seconds=time.perf_counter() - t)
          readback.evaluated(step, row)
        if readback.stop_reason is not None:
          break
      if outcome is None:
        outcome = readback()
    return self._finish(step, outcome, readback)

  def _finish(self, step: int, outcome, readback: Readback) -> RunResult:
    """Wait for the last checkpoint writes; the run's result."""
    status, message = outcome or ("done", "")
    if status == "done" and readback.stop_reason is not None:
      message = f"stopped after step {step}: {readback.stop_reason}"
    t = time.perf_counter()
    try:
      self.checkpointer.wait()
    except Exception as e:  # noqa: BLE001
      if status == "done":
        status, message = ("nonfinite", str(e)) if isinstance(e, NonFiniteState) else \
            ("storage", f"the last checkpoint could not be written ({first_line(e)})")
    if self.local is not None:
      try:
        self.local.wait()
      except Exception as e:  # noqa: BLE001  a local write is best effort
        self.warn(f"the last local checkpoint could not be written ({first_line(e)})", here=True)
      if self.saver.summary():
        self.warn(self.saver.summary(), here=True)
    self.events("checkpoint", step=step, tier="wait", seconds=time.perf_counter() - t)
    if message:
      self.log(message)
    return RunResult(status, step, readback.last_metrics, message)

  def _dispatch(self, state, train_iter, step: int, decider: Decider):
    """Start step `step + 1` on the devices (the batch ramp's stage decides its batch)."""
    measure_noise, logs = decider.measures_noise(step + 1), decider.logs(step + 1)
    stage = self.ramp.stage_at(step)
    if stage != self._stage and not self.ramp.is_constant:
      self.log(f"step {step + 1}: batch {self.ramp.batch_at(step)} (stage {stage + 1} of "
               f"{len(self.ramp.batches)}, {self.ramp.tokens_before(step):,} tokens seen)")
    self._stage = stage
    num_micro = self.ramp.batch_at(step) // self.program.micro_rows
    if (num_micro, measure_noise, logs) not in self.steps:
      # Compiling a new variant (a new stage's, the first log step's) is not step time, but the
      # steps still running on the device are: wait for them before pausing the timer.
      jax.block_until_ready(state)
    with self.timer.paused():
      train_step = self.steps.get(num_micro, measure_noise, logs)
      self.steps.log_pipeline(self.writer, num_micro, step)
    with self.timer.waiting_for_data():
      batch = self.feed.global_batch([next(train_iter) for _ in range(num_micro)])
    with self.timer.computing():
      self.fault.before_step(step + 1, self.timer.clock)
      state, metrics = train_step(state, batch)
    # At most one step queued behind the running one (the host raced 3-4 ahead on CPU, up to a
    # log step on an accelerator), so a stop signal acts after the running step or the next.
    if self._running is not None:
      with self.timer.waiting_for_others():
        jax.block_until_ready(self._running)
      self.timer.step_completed(step)
    self._running = metrics
    self.timer.step_dispatched()
    self.writer.advance(1)
    return state, metrics

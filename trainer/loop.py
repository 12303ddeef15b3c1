"""The training loop: build everything from the config, resume if the workdir has a checkpoint,
run the jitted step, log, evaluate, checkpoint, and stop cleanly when told to.

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
more or fewer micro-batches per step (its checkpointed position stays valid), and the loop
compiles the train step once per distinct number of micro-batches and keeps it
(`compile_count` counts compilations). At start the loop prints, once per batch size, the
hyperparameters the batch-size rules derive (`optim/scaling.py`), and writes them to
metrics.jsonl as `{"event": "hyperparameters", "hparams/learning_rate": ...}` rows.

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
`optim.ema_decay` every evaluation also scores the averaged parameters (`eval_loss_ema`).
"""
from __future__ import annotations

import contextlib
import dataclasses
import json
import math
import os
import time
from collections.abc import Callable

import jax
import ml_collections
import numpy as np

from data import mixture, pipeline
from data.prepare import ensure_default_corpus, read_meta
from models.llama import flops_per_token, param_counts
from optim import derive
from optim import schedules as schedules_lib
from optim.autopilot import AutoConfig, Autopilot
from optim.ema import find_ema
from optim.scaling import describe as describe_hyperparameters
from sharding.batch import assemble, process_rows
from sharding.mesh import make_mesh, replicated
from trainer.checkpoint import CheckpointError, Checkpointer, first_line, load_params
from trainer.decisions import Decider, MetricsWindow, StopSignals, agree_any
from trainer.inference import init_from_mismatch
from trainer.metrics import MetricsWriter, machine_peak_flops
from trainer.profiling import ProfileWindow
from trainer.program import Program
from trainer.state import init_state
from trainer.step import make_eval_step

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
    self.mesh = make_mesh(cfg.mesh)
    self.program = p = Program(cfg, self.mesh)
    self.micro_rows, self.num_micro = p.micro_rows, p.num_micro
    self.model_cfg, self.spec, self.tx = p.model_cfg, p.spec, p.tx
    self.shardings, self.batch_sharding = p.shardings, p.batch_sharding

    d = cfg.data
    self.ramp = p.ramp  # the run's one ramp, shared with the schedules
    self.autopilot = Autopilot(AutoConfig.from_config(d), self.ramp) \
        if d.batch_ramp == "auto" else None
    self.compiled_steps: dict = {}  # (micro-batches, measures noise) -> compiled train step
    self.compile_count = 0
    # One source (data.dir or the default corpus) or a weighted mixture (data.mixture).
    self.sources = mixture.parse(d.mixture) if d.mixture else (
        mixture.Source("data", d.dir or ensure_default_corpus()),)
    self.data_dir = self.sources[0].dir
    self.data_meta = read_meta(self.data_dir)
    # This process reads the rows its devices hold (any mesh device order works).
    self.local_rows = process_rows(self.batch_sharding, (1, self.micro_rows, d.seq_len), 1)
    self.train_spec = pipeline.StreamSpec(
        self.data_dir, "train", d.seq_len, self.micro_rows, seed=cfg.seed,
        row_ids=self.local_rows, prefetch=d.prefetch,
        mixture=self.sources if d.mixture else ())
    self.writer = None
    self.checkpointer = None

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

  def _eval_fn(self):
    flat = jax.sharding.NamedSharding(self.mesh, jax.sharding.PartitionSpec(
        *self.batch_sharding.spec[1:]))
    fn = jax.jit(make_eval_step(self.spec), in_shardings=(self.shardings.params, flat),
                 out_shardings=replicated(self.mesh))
    hosts = [pipeline.take(
        pipeline.StreamSpec(src.dir, "validation", self.cfg.data.seq_len, self.micro_rows,
                            shuffle=False, row_ids=self.local_rows),
        self.cfg.eval_steps) for src in self.sources]
    # Bits per byte = nats per predicted token / ln 2 x predicted tokens / UTF-8 bytes of the
    # validation split (counted at preparation): comparable across tokenizers.
    bits = [(lambda v: v["targets"] / v["bytes"] / math.log(2))(
        read_meta(src.dir)["splits"]["validation"]) for src in self.sources]

    def evaluate(params) -> dict[str, float]:
      """eval_loss and eval_bpb (token-weighted over mixture sources), and per source
      eval_loss/NAME and eval_bpb/NAME when there are several."""
      row, total, total_bpb = {}, 0.0, 0.0
      with jax.set_mesh(self.mesh):
        for src, host, to_bits in zip(self.sources, hosts, bits):
          loss_sum, tokens = 0.0, 0.0
          for mb in host:
            batch = {k: assemble(mb[k], self.local_rows, flat, (self.micro_rows, mb[k].shape[1]))
                     for k in pipeline.BATCH_KEYS}
            s, n = jax.device_get(fn(params, batch))
            loss_sum, tokens = loss_sum + float(s), tokens + float(n)
          loss = loss_sum / max(tokens, 1.0)
          if len(self.sources) > 1:
            row[f"eval_loss/{src.name}"], row[f"eval_bpb/{src.name}"] = loss, loss * to_bits
          total, total_bpb = total + src.weight * loss, total_bpb + src.weight * loss * to_bits
      return {"eval_loss": total, "eval_bpb": total_bpb, **row}

    return evaluate

  def train_step_for(self, num_micro: int, measure_noise: bool = False):
    """The compiled train step for `num_micro` micro-batches, measuring the gradient noise scale
    or not (each variant compiled on first use)."""
    key = (num_micro, measure_noise)
    if key not in self.compiled_steps:
      self.compiled_steps[key] = self.program.compile(num_micro, measure_noise=measure_noise)
      self.compile_count += 1
    return self.compiled_steps[key]

  def _log_batch_science(self, step: int) -> None:
    """Print the derived hyperparameters once per batch size, and log them as event rows."""
    cfg = self.cfg
    if self.autopilot is not None:
      a = self.autopilot.cfg
      self.log(f"batch autopilot: {' -> '.join(map(str, a.sizes()))} sequences, x{a.factor} "
               + (f"when B_simple > {a.margin:g} x batch" if a.trigger == "noise_scale" else
                  f"when the norm test fails (eta={a.eta:g})")
               + f" at {a.patience} measurement(s) in a row (every "
               f"{cfg.optim.noise_scale_every} steps); decided so far: "
               + ("; ".join(c.describe() for c in self.autopilot.changes) or "none"))
    if not self.ramp.is_constant:
      self.log(self.ramp.describe())
    for batch in dict.fromkeys(self.ramp.batches):
      self._log_hyperparameters(step, batch)
    if cfg.optim.schedule_unit != "steps" or not self.ramp.is_constant:
      self.log(schedules_lib.describe(cfg.optim, cfg.steps, self.ramp))

  def _log_hyperparameters(self, step: int, batch: int) -> None:
    hp = derive(self.cfg.optim, batch, self.cfg.data.global_batch_size)
    self.log(describe_hyperparameters(self.cfg.optim, hp))
    row = {f"hparams/{k}": v for k, v in hp.as_dict().items()}  # apart from the metrics
    self.writer.write(step, {"event": "hyperparameters", **row}, console=False)

  def _steer(self, step: int, host: dict) -> None:
    """Feed a measuring step's row to the batch autopilot; log the change it decides."""
    change = self.autopilot.observe(step, host)
    if change is None:
      return
    self.log(change.describe())
    self.writer.write(step, {"event": "batch_change", "batch": change.batch,
                             "old_batch": change.old, "from_step": change.step,
                             "reason": change.reason}, console=False)
    self._log_hyperparameters(step, change.batch)

  def _stop_check(self, step: int, row: dict) -> None:
    if self.stop_when is not None and self.stop_reason is None:
      self.stop_reason = self.stop_when(step, row)

  def _start_state(self, checkpointer: Checkpointer):
    """(state, data iterator, restored step or None) from the newest readable checkpoint,
    `init_from`, or fresh."""
    make_iterator = lambda: iter(pipeline.dataset(self.train_spec))
    restored = checkpointer.restore_latest(
        self.program.abstract_state(), self.train_spec, self.cfg.to_dict(),
        allow_fresh_start=self.cfg.checkpoint.allow_fresh_start)
    if restored is not None:
      if self.autopilot is not None:
        saved = checkpointer.saved_autopilot(restored[2])
        if saved is None:
          self.log(f"checkpoint {restored[2]} has no batch autopilot state: the autopilot "
                   f"starts at batch {self.ramp.batch_at(0)} from here")
        else:
          self.autopilot.load_state_dict(saved)
      return restored
    if self.cfg.checkpoint.init_from:
      # Shapes alone miss a different rope_theta / rope scaling / norm eps: name it.
      reason = init_from_mismatch(self.cfg.checkpoint.init_from, self.model_cfg)
      if reason:
        raise CheckpointError(reason)
      params, source = load_params(self.cfg.checkpoint.init_from, self.spec.abstract_params)
      self.log(f"initialised parameters from {source} (optimizer state and data start fresh)")
      return init_state(self.spec, self.tx, params), make_iterator(), None
    return init_state(self.spec, self.tx), make_iterator(), None

  # --------------------------------------------------------------------------------------------

  def train(self) -> RunResult:
    cfg = self.cfg
    os.makedirs(self.workdir, exist_ok=True)
    self.checkpointer = checkpointer = Checkpointer(
        os.path.join(self.workdir, "checkpoints"), keep=cfg.checkpoint.keep,
        async_save=cfg.checkpoint.async_save, log=self.log)
    try:
      with StopSignals(multi_process=jax.process_count() > 1) as signals:
        # Restore first: a run that cannot start (unreadable or mismatched checkpoints) leaves
        # the workdir exactly as it found it.
        start_state = self._start_state(checkpointer)
        _repair_jsonl(os.path.join(self.workdir, "metrics.jsonl"))
        self.writer = MetricsWriter(self.workdir, enabled=self.is_lead,
                                    progress_total=cfg.steps,
                                    progress_bar=cfg.trainer.progress_bar,
                                    wandb=cfg.trainer.wandb.to_dict(), run_config=cfg.to_dict())
        if self.is_lead:
          with open(os.path.join(self.workdir, "config.json"), "w") as f:
            json.dump(cfg.to_dict(), f, indent=1)
        return self._train(checkpointer, signals, *start_state)
    finally:
      checkpointer.close()
      if self.writer is not None:
        self.writer.close()

  def _log_start(self, state, resumed_at) -> int:
    """The run's opening lines; returns the step the run starts from."""
    counts = param_counts(self.model_cfg)
    src = self.data_meta["source"]
    self.log(f"devices: {jax.device_count()} x {jax.devices()[0].device_kind} "
             f"({jax.process_count()} process(es)); mesh "
             + " ".join(f"{k}={v}" for k, v in self.mesh.shape.items()))
    self.log(f"model: {counts['total'] / 1e6:.2f}M params "
             f"({counts['non_embedding'] / 1e6:.2f}M non-embedding"
             + (f", {counts['active'] / 1e6:.2f}M active per token" if counts["active"] !=
                counts["total"] else "") + "); "
             f"data: {src.get('name')} fingerprint {src.get('fingerprint')} "
             f"({self.data_meta['splits']['train']['tokens']:,} train tokens) from "
             f"{self.data_dir}")
    if len(self.sources) > 1:
      self.log("mixture (token weights): " + ", ".join(
          f"{s.name}={s.dir}:{s.weight:g}" for s in self.sources))
    start = int(jax.device_get(state.step))
    if resumed_at is not None:
      self.log(f"resumed from {self.checkpointer.directory}/{resumed_at}")
      self.writer.write(start, {"event": "resumed"}, console=False)
    self._log_batch_science(start)
    return start

  def _train(self, checkpointer: Checkpointer, signals: StopSignals, state, train_iter,
             resumed_at) -> RunResult:
    cfg = self.cfg
    start = self._log_start(state, resumed_at)
    decider = Decider(cfg, signals, start=start, evaluating=bool(cfg.eval_every))
    t0 = time.perf_counter()
    self.train_step_for(self.ramp.batch_at(start) // self.micro_rows,
                        decider.measures_noise(start + 1))
    compile_seconds = time.perf_counter() - t0
    evaluate = self._eval_fn() if cfg.eval_every else None
    self.flops_token = flops_per_token(self.model_cfg, cfg.data.seq_len)["total"]
    self.peak, peak_source = machine_peak_flops(cfg.trainer.peak_flops_per_device,
                                                cfg.model.dtype)
    self.log(f"compiled train step in {compile_seconds:.1f}s; {self.flops_token / 1e6:.2f} "
             f"MFLOPs per token; peak {self.peak / 1e12:.3g} TFLOP/s ({peak_source})")
    if start >= cfg.steps:
      self.log(f"already at step {start} >= steps={cfg.steps}; nothing to do")
      return RunResult("done", start, {})

    self.timer = timer = _StepTimer()
    self.last_metrics = {}
    self._stage = None  # the batch ramp's stage of the last step dispatched
    window = MetricsWindow()
    save = _Saver(checkpointer, self.train_spec, cfg.to_dict(), timer, decider, self.log,
                  autopilot=self.autopilot)
    outcome = None  # (status, message) once the run must end early
    deferred = None  # a log step whose row is read while the next step runs
    step = start
    profile = ProfileWindow(cfg.trainer.profile_steps, self.workdir, log=self.log)
    with jax.set_mesh(self.mesh), contextlib.closing(profile):
      while step < cfg.steps:
        profile.before_step(step + 1)
        state, metrics = self._dispatch(state, train_iter, step, decider.measures_noise(step + 1))
        step += 1
        profile.after_step(step, metrics)
        decision = decider.after(step)
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
        if decision.evaluate:
          self._evaluate(evaluate, state, step)
        if self.stop_reason is not None:
          break
      if outcome is None:
        outcome = self._read(window)
    status, message = outcome or ("done", "")
    if status == "done" and self.stop_reason is not None:
      message = f"stopped after step {step}: {self.stop_reason}"
    try:
      checkpointer.wait()
    except Exception as e:  # noqa: BLE001
      if status == "done":
        status, message = "storage", f"the last checkpoint could not be written ({first_line(e)})"
    if message:
      self.log(message)
    return RunResult(status, step, self.last_metrics, message)

  def _dispatch(self, state, train_iter, step: int, measure_noise: bool):
    """Start step `step + 1` on the devices (the batch ramp's stage decides its batch)."""
    stage = self.ramp.stage_at(step)
    if stage != self._stage and not self.ramp.is_constant:
      self.log(f"step {step + 1}: batch {self.ramp.batch_at(step)} (stage {stage + 1} of "
               f"{len(self.ramp.batches)}, {self.ramp.tokens_before(step):,} tokens seen)")
    self._stage = stage
    num_micro = self.ramp.batch_at(step) // self.micro_rows
    with self.timer.paused():  # compiling a new stage's step is not step time
      train_step = self.train_step_for(num_micro, measure_noise)
    with self.timer.waiting_for_data():
      batch = self.global_batch([next(train_iter) for _ in range(num_micro)])
    state, metrics = train_step(state, batch)
    self.timer.step_dispatched()
    self.writer.advance(1)
    return state, metrics

  def _evaluate(self, evaluate, state, step: int) -> None:
    with self.timer.paused():
      row = evaluate(state.params)
      ema = find_ema(state.opt_state, like=state.params)
      if ema is not None:
        row["eval_loss_ema"] = evaluate(ema)["eval_loss"]
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


class _Saver:
  """Starts checkpoints; a failing storage is reported once per streak (earlier checkpoints stay
  readable). With several processes, a save counts as written only if it was on all of them."""

  def __init__(self, checkpointer: Checkpointer, data_spec, config: dict, timer, decider, log,
               autopilot=None):
    self.checkpointer, self.data_spec, self.config = checkpointer, data_spec, config
    self.timer, self.decider, self.log = timer, decider, log
    self.autopilot = autopilot
    self.failing = False
    self.last_step = None

  def __call__(self, step: int, state, train_iter, *, blocking: bool = False) -> bool:
    ckpt = self.checkpointer
    with self.timer.paused():
      failed_step, error = step, None
      try:
        failed_step = self.last_step  # a background write of the previous save may have failed
        ckpt.check_for_errors()
        failed_step = step
        ckpt.save(step, state, train_iter, self.data_spec, self.config,
                  autopilot=None if self.autopilot is None else self.autopilot.state_dict())
        self.last_step = step
        if blocking:
          ckpt.wait()
      except Exception as e:  # noqa: BLE001  storage errors of any kind
        error = e
      if agree_any(error is not None):
        if not self.failing:
          good = [s for s in ckpt.all_steps() if s < (failed_step or step)]
          reason = first_line(error) if error is not None else "failed on another process"
          self.log(f"checkpoint save at step {failed_step} failed ({reason}); earlier "
                   f"checkpoints are untouched (newest: {good[-1] if good else 'none'})")
        self.failing = True
        return False
    if self.failing:
      self.log(f"checkpoint save at step {step} succeeded again")
    self.failing = False
    self.decider.saved()
    return True


class _StepTimer:
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
    now = time.perf_counter()
    steps = max(self.steps, 1)
    seconds = max(now - self.start - self.excluded, 1e-9) / steps
    host["step_time"] = seconds
    host["data_wait_ms"] = 1e3 * self.data_wait / steps
    host["tokens_per_sec"] = tokens_per_step / seconds
    host["mfu"] = host["tokens_per_sec"] * flops_token / peak
    self.start, self.steps, self.excluded, self.data_wait = now, 0, 0.0, 0.0
    return host


def _repair_jsonl(path: str) -> None:
  """Drop a partial last line left by a process killed mid-write."""
  if not os.path.exists(path):
    return
  with open(path, "rb+") as f:
    data = f.read()
    if data and not data.endswith(b"\n"):
      f.truncate(data.rfind(b"\n") + 1)

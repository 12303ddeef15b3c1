"""Reading a run's metrics back from the device, and what follows from them (`Readback`).

`MetricsWindow` keeps what the device returns for each step and reads it back only when a
decision needs it: at log, save, evaluation and stop steps, in one transfer for the whole window,
so no step in between waits for the device. A skipped (non-finite or spike) step is therefore
seen at the next such step: before any checkpoint, evaluation or log row, never later.
`Readback` writes the rows due, feeds the batch autopilot the rows with a new noise
measurement, applies the non-finite and spike policies, and asks `stop_when` whether to end the run.
"""
from __future__ import annotations

from collections.abc import Callable

import jax
import numpy as np

from trainer.tracking.report import log_hyperparameters
from trainer.tracking.straggler import make_report


# What is read back for a step that is not a log step: enough to report a skipped update (and
# the target tokens that weight a DiLoCo run's replicas' losses, `trainer.step.diloco.reduce_metrics`).
FLAG_KEYS = ("loss", "skipped", "nonfinite", "spike", "target_tokens")


class MetricsWindow:
  """The device's metrics of the steps not yet read back, read in one transfer. `reduce` (a
  DiLoCo run's `trainer.step.diloco.reduce_metrics`) turns a step's metrics into the replicated row
  to read; it is dispatched when the step is added, so it queues behind that step and runs while
  the next one does (a read then only transfers)."""

  def __init__(self, reduce=None):
    self._pending: list[tuple[int, dict, bool]] = []
    self._reduce = reduce

  def add(self, step: int, metrics: dict, log: bool) -> None:
    """`log`: the whole row is wanted; otherwise only `FLAG_KEYS` are read back."""
    wanted = metrics if log else {k: metrics[k] for k in FLAG_KEYS}
    if self._reduce is not None:
      wanted = self._reduce(wanted)
    self._pending.append((step, wanted, log))

  def wait_running(self) -> None:
    """Wait for the newest step added (the one running on the devices)."""
    if self._pending:
      jax.block_until_ready(self._pending[-1][1])

  def read(self, upto: int | None = None) -> list[tuple[int, dict, bool]]:
    """[(step, host metrics, log)] for the pending steps up to `upto` (all by default)."""
    take = [p for p in self._pending if upto is None or p[0] <= upto]
    self._pending = self._pending[len(take):]
    if not take:
      return []
    host = jax.device_get([m for _, m, _ in take])
    return [(s, {k: _scalar(v) for k, v in h.items()}, log)
            for (s, _, log), h in zip(take, host)]


def _scalar(v):
  v = np.asarray(v)
  return int(v) if np.issubdtype(v.dtype, np.integer) else float(v)


class Readback:
  """The loop's reading of metrics (module docstring). `window` collects the steps' metrics;
  the loop sets `dispatched` to the steps it has started; `newest_checkpoint()` names the
  checkpoint a stop falls back to; `stop_when(step, row)` may end the run (a reason or None)."""

  def __init__(self, cfg, ramp, autopilot, writer, timer, events, *, flops_token: float,
               peak: float, newest_checkpoint: Callable[[], int | None], start: int,
               stop_when=None, reduce=None):
    self.cfg, self.ramp, self.autopilot = cfg, ramp, autopilot
    self.writer, self.timer, self.events = writer, timer, events
    self.flops_token, self.peak = flops_token, peak
    self.newest_checkpoint, self.stop_when = newest_checkpoint, stop_when
    self.straggler = make_report(cfg, writer.log)  # several processes: who is slow
    self.window = MetricsWindow(reduce)
    self.recorded = self.dispatched = start  # steps in goodput events / dispatched so far
    self.observed = start  # the last step whose row the autopilot saw
    self.last_metrics: dict = {}
    self.stop_reason: str | None = None
    self._norm: tuple[int, float] | None = None  # (step, param_norm) of the last row with one

  def evaluated(self, step: int, row: dict) -> None:
    """An evaluation's row: written, and shown to `stop_when`."""
    self.writer.write(step, row)
    self.last_metrics.update(row)
    self._stop_check(step, row)

  def _stop_check(self, step: int, row: dict) -> None:
    if self.stop_when is not None and self.stop_reason is None:
      self.stop_reason = self.stop_when(step, row)

  def __call__(self, upto: int | None = None) -> tuple[str, str] | None:
    """Write the due rows of the steps read back (up to `upto`, all by default); apply the
    non-finite / spike policies. Returns (status, message) when the run must stop."""
    cfg = self.cfg
    for step, host, log in self.window.read(upto):
      if "param_norm" in host:
        self._norm = step, host["param_norm"]
      if log:
        batch = self.ramp.batch_at(step - 1)
        if not self.ramp.is_constant or self.autopilot is not None:
          host["batch_size"] = batch
        self.timer.annotate(host, batch * cfg.data.seq_len, self.flops_token, self.peak)
        steps, seconds, data_wait = self.timer.window  # the steps dispatched since the last row
        lost = {}
        if self.straggler is not None:  # one small all-gather, the same log step everywhere
          with self.timer.waiting_for_others():
            # Its collective would queue behind the running step: waiting for that first
            # leaves the report's own time in `straggler_ms` (bench/straggler_overhead.py).
            self.window.wait_running()
            fields, lost = self.straggler(self.timer.parts, host["step_time"], steps)
          host.update(fields)
        self.events("steps", first=self.recorded + 1, last=self.dispatched, seconds=seconds,
                    data_wait=data_wait, **lost)
        self.recorded = self.dispatched
      if log or host["skipped"]:
        self.writer.write(step, host)
        self.writer.advance(0, loss=host["loss"])
        self.last_metrics = host
        self._stop_check(step, host)
      if log and self.autopilot is not None and self._measured_since(step):
        self._steer(step, host)
      if not host["skipped"]:
        continue
      kind = "non-finite loss/gradient" if host["nonfinite"] else "loss spike"
      policy = cfg.trainer.nonfinite_policy if host["nonfinite"] else cfg.trainer.spike_policy
      if policy == "stop":
        newest = self.newest_checkpoint()
        newest = f"newest checkpoint: step {newest}" if newest is not None else \
            "no checkpoint yet"
        return "nonfinite", (f"{kind} at step {step} (loss={host['loss']}); stopping without "
                             f"applying it; {newest}")
      self.writer.log(f"{kind} at step {step} (loss={host['loss']}): update skipped")
    return None

  def params_finite(self, step: int) -> bool | None:
    """Whether the parameters after `step` are finite, where its row was read back with their
    norm (a log step, `trainer.norm_metrics`): the norm is finite exactly when every parameter
    is, short of squares past float32's range (~1e19, where the save is refused too). None where
    not known: a save then computes it (`trainer.checkpoint.integrity.finite_guard`)."""
    if self._norm is None or self._norm[0] != step:
      return None
    return bool(np.isfinite(self._norm[1]))

  def _measured_since(self, step: int) -> bool:
    """Whether the meter measured since the last row the autopilot saw (so it never counts one
    measurement twice when rows come more often than measurements)."""
    every, seen = self.cfg.optim.noise_scale_every, self.observed
    if not every or step // every == seen // every:
      return False
    self.observed = step
    return True

  def _steer(self, step: int, host: dict) -> None:
    """Feed a measuring step's row to the batch autopilot; log the change it decides."""
    change = self.autopilot.observe(step, host)
    if change is None:
      return
    self.writer.log(self.autopilot.describe(change))
    self.writer.write(step, {"event": "batch_change", "batch": change.batch,
                             "old_batch": change.old, "from_step": change.step,
                             "reason": change.reason}, console=False)
    log_hyperparameters(self.writer, self.cfg, step, change.batch)

"""Batch-size autopilot (`data.batch_ramp = "auto"`): the batch grows with the noise scale.

`Autopilot.observe` reads the noise meter in every logged row (`log_every`; the meter measures
every `optim.noise_scale_every` steps), from replicated metrics only, so every process decides
the same. Its trigger, `data.batch_auto.trigger`:

  noise_scale   the smoothed B_simple (sequences) > `margin` x the batch: `signal` names the
                metric, `noise_scale` or `noise_scale_precond` (Adam's P; optim/noise_scale.py)
  norm_test     tr(Sigma) / (T |g_B|^2) > `eta`^2, the step's own |g_B| (Byrd et al. 2012)

held at `patience` rows in a row multiplies the batch by `factor` (up to `max`; it never shrinks),
from step n + `DELAY` (2) after the row of step n. Every batch is `global_batch_size` x factor^k,
whole micro-batches, so each size compiles once and the data order is a fixed batch's; the decisions
and the streak are checkpointed (`state_dict`). `with_defaults` fills in what the config leaves
unset. Why, the norm test's derivation, defaults: docs/batch_size.md#batch-autopilot
"""
from __future__ import annotations

import dataclasses
import math

from optim.noise_scale import PRECONDITIONED
from optim.ramp import UNITS, BatchRamp

TRIGGERS = ("noise_scale", "norm_test")
SIGNALS = ("noise_scale", "noise_scale_precond")  # the metrics the noise_scale trigger can read
DELAY = 2  # the row of step n (1-based) changes the batch from step n + DELAY
DEFAULT_GROWTHS = 3  # data.batch_auto.max = 0: global_batch_size x factor^3
DEFAULT_NOISE_SCALE_EVERY = 2  # optim.noise_scale_every = 0 under the autopilot
NO_HORIZON = ("constant", "rsqrt")  # schedules that never read their horizon


def with_defaults(cfg):
  """(run config with the autopilot's defaults filled in, one line per value filled in) for a
  run config (ConfigDict) under `data.batch_ramp = "auto"` (docs/batch_size.md#batch-autopilot);
  the config itself when there is nothing to fill in. The input is not changed."""
  d, o = cfg.data, cfg.optim
  if d.batch_ramp != "auto":
    return cfg, []
  out, notes = cfg.copy_and_resolve_references(), []
  start = int(d.global_batch_size)
  if not d.batch_auto.max and int(d.batch_auto.factor) >= 2:
    out.data.batch_auto.max = start * int(d.batch_auto.factor) ** DEFAULT_GROWTHS
    notes.append(f"data.batch_auto.max=0: the batch may grow to {out.data.batch_auto.max} "
                 f"sequences (data.global_batch_size={start} x factor {d.batch_auto.factor}^"
                 f"{DEFAULT_GROWTHS}; set data.batch_auto.max to choose)")
  if not d.micro_batch_size:
    out.data.micro_batch_size = start
    notes.append(f"data.micro_batch_size=0: micro-batches of {start} sequences (the starting "
                 "batch); larger batches accumulate them")
  if not o.noise_scale_every:
    out.optim.noise_scale_every = DEFAULT_NOISE_SCALE_EVERY
    notes.append(f"optim.noise_scale_every=0: the gradient noise scale is measured every "
                 f"{DEFAULT_NOISE_SCALE_EVERY} steps")
  lengths = schedule_lengths(o)
  if o.schedule_unit == "steps" and lengths and all(u != "steps" for _, u, _ in lengths):
    out.optim.schedule_unit = "tokens"
    seq = int(d.seq_len)
    given = ", ".join(f"optim.{w}_{u}={v:g}" + (f" = {v * seq:,.0f} tokens" if u == "examples"
                                                 else "") for w, u, v in lengths)
    notes.append(f"optim.schedule_unit='steps' -> 'tokens': the schedule's lengths are given in "
                 f"examples or tokens ({given}), which a schedule in steps would convert through "
                 "batches the autopilot has yet to choose")
  return out, notes


def schedule_lengths(optim_cfg) -> list[tuple[str, str, float | None]]:
  """[(warmup | decay, unit, value)] of the lengths the schedule uses: each one set, and the
  horizon's default when it is unset and the schedule reads it: ("decay", "steps", None), the
  run's `steps`."""
  out = []
  for what in ("warmup", "decay"):
    given = [(what, u, optim_cfg[f"{what}_{u}"]) for u in UNITS if optim_cfg[f"{what}_{u}"] > 0]
    if not given and what == "decay" and optim_cfg.schedule not in NO_HORIZON:
      given = [(what, "steps", None)]
    out += given
  return out


@dataclasses.dataclass(frozen=True)
class AutoConfig:
  """`data.batch_auto.*`: the rule's parameters (see the module docstring)."""
  start: int  # data.global_batch_size: the first (smallest) batch
  max: int
  factor: int = 2
  trigger: str = "noise_scale"
  signal: str = "noise_scale"
  margin: float = 2.0
  eta: float = 0.8
  patience: int = 2

  @classmethod
  def from_config(cls, data_cfg) -> "AutoConfig":
    a = data_cfg.batch_auto
    return cls(start=int(data_cfg.global_batch_size), max=int(a.max), factor=int(a.factor),
               trigger=str(a.trigger), signal=str(a.get("signal", "noise_scale")),
               margin=float(a.margin), eta=float(a.eta),
               patience=int(a.patience))

  def sizes(self) -> list[int]:
    """Every batch the autopilot can choose, smallest first."""
    out = [self.start]
    while out[-1] < self.max:
      out.append(min(out[-1] * self.factor, self.max))
    return out


def check(data_cfg, micro_rows: int, optimizer: str | None = None) -> str | None:
  """Why `data.batch_auto.*` is not usable, in one line naming the key, or None. `optimizer`
  (`optim.name`): checked against a preconditioned signal."""
  a, start = data_cfg.batch_auto, int(data_cfg.global_batch_size)
  if a.trigger not in TRIGGERS:
    return f"data.batch_auto.trigger={a.trigger!r}: choose one of {', '.join(TRIGGERS)}"
  signal = a.get("signal", "noise_scale")
  if signal not in SIGNALS:
    return f"data.batch_auto.signal={signal!r}: choose one of {', '.join(SIGNALS)}"
  if signal == "noise_scale_precond" and optimizer is not None and \
      optimizer not in PRECONDITIONED:
    return (f"data.batch_auto.signal='noise_scale_precond' reads the preconditioner of Adam's "
            f"second moments, which optim.name={optimizer!r} does not keep; use "
            f"signal='noise_scale' or optim.name in {', '.join(PRECONDITIONED)}")
  if int(a.factor) < 2:
    return f"data.batch_auto.factor={a.factor}: must be an integer >= 2"
  if int(a.max) <= start:
    return (f"data.batch_auto.max={a.max} must exceed data.global_batch_size={start} "
            "(the autopilot's first batch)")
  k = round(math.log(int(a.max) / start, int(a.factor)))
  if start * int(a.factor) ** k != int(a.max):
    return (f"data.batch_auto.max={a.max} is not data.global_batch_size={start} x "
            f"factor={a.factor}^k; e.g. {start * int(a.factor) ** max(k, 1)}")
  if start % micro_rows:
    return (f"data.global_batch_size={start} is not a multiple of the micro-batch "
            f"({micro_rows} rows)")
  if not float(a.margin) > 0:
    return f"data.batch_auto.margin={a.margin}: must be > 0"
  if not 0 < float(a.eta) < 1:
    return f"data.batch_auto.eta={a.eta}: must be in (0, 1)"
  if int(a.patience) < 1:
    return f"data.batch_auto.patience={a.patience}: must be >= 1"
  return None


@dataclasses.dataclass(frozen=True)
class Change:
  """A decision: from step `step` (1-based) the batch is `batch` (was `old`)."""
  step: int
  batch: int
  old: int
  measured_at: int
  reason: str

  def describe(self) -> str:
    return (f"batch {self.old} -> {self.batch} from step {self.step}: {self.reason} at step "
            f"{self.measured_at}")


class Autopilot:
  """The rule, its state (the streak) and the ramp it grows (`ramp`, shared with the schedules
  and the loop: the loop reads every step's batch from it).

  `cost(batch)`: the cost model of a batch size, the fraction of each step a pipelined run
  (mesh.stage > 1) idles in the pipeline's bubble at that batch, (S - 1) / (M R + S - 1) with
  M = batch / micro-batch rows (trainer/step/pipelined.py); None without stages. It does not
  change the rule (a larger batch only shrinks the bubble); every decision says what it does to
  it."""

  def __init__(self, cfg: AutoConfig, ramp: BatchRamp, cost=None):
    self.cfg, self.ramp = cfg, ramp
    self.cost = cost
    self.streak = 0
    self.changes: list[Change] = []

  def describe(self, change: Change) -> str:
    """A decision's line, with what it does to the pipeline's bubble (`cost`)."""
    if self.cost is None:
      return change.describe()
    return (f"{change.describe()}; pipeline bubble {self.cost(change.old):.1%} -> "
            f"{self.cost(change.batch):.1%} of each step")

  def statistic(self, row: dict, batch: int) -> tuple[bool, str]:
    """(fires, why) for one measuring step's metrics at batch `batch`."""
    c = self.cfg
    if c.trigger == "noise_scale":
      b = float(row.get(c.signal, math.nan))
      # False for NaN: too few measurements yet, or the meter's |G|^2 not yet positive
      fires = b > c.margin * batch
      name = "B_simple" if c.signal == "noise_scale" else "B_simple (preconditioned)"
      return fires, f"{name}={b:.4g} {'>' if fires else '<='} {c.margin:g} x {batch}"
    trace, tokens = float(row["noise_trace"]), float(row["target_tokens"])
    ratio = trace / (max(tokens, 1.0) * float(row["grad_norm"]) ** 2)
    fires = ratio > c.eta ** 2
    return fires, (f"norm test tr(Sigma)/(T |g|^2)={ratio:.4g} {'>' if fires else '<='} "
                   f"eta^2={c.eta ** 2:.4g}")

  def observe(self, step: int, row: dict) -> Change | None:
    """Feed the logged metrics row of step `step` (1-based); returns the change it causes.
    Skipped steps are ignored (their update was not applied)."""
    if row.get("skipped"):
      return None
    batch = self.ramp.batch_at(step - 1)
    if batch >= self.cfg.max:
      return None
    fires, why = self.statistic(row, batch)
    self.streak = self.streak + 1 if fires else 0
    if self.streak < self.cfg.patience:
      return None
    self.streak = 0
    new = min(batch * self.cfg.factor, self.cfg.max)
    reason = why + (f" ({self.cfg.patience} rows in a row)"
                    if self.cfg.patience > 1 else "")
    change = Change(step + DELAY, new, batch, step, reason)
    self.ramp.add_stage(new, change.step - 1)
    self.changes.append(change)
    return change

  # ---------------------------------------------------------------------------------------------
  # Checkpointed state: JSON

  def state_dict(self) -> dict:
    return {"streak": self.streak, "changes": [dataclasses.asdict(c) for c in self.changes]}

  def load_state_dict(self, state: dict) -> None:
    """Replay the saved decisions onto the (fresh, one-stage) ramp."""
    if self.changes or len(self.ramp.batches) != 1:
      raise ValueError("load_state_dict needs a fresh autopilot")
    self.streak = int(state["streak"])
    for c in state["changes"]:
      change = Change(**c)
      self.ramp.add_stage(change.batch, change.step - 1)
      self.changes.append(change)

"""Seesaw (`data.batch_ramp = "seesaw"`, `data.max_batch`; Meterez et al. 2025, arXiv 2510.14717):
where a step decay would halve the rate, the batch doubles and the rate is cut by the rule.

  step               0              c_1            c_2         c_3   (where the rate at B0 halves)
  batch              B0             2 B0           4 B0        4 B0   (data.max_batch = 4 B0)
  rate, sqrt rule    lr             lr / sqrt(2)   lr / 2      lr / 4
  rate, linear rule  lr             lr             lr          lr / 2

`Seesaw.from_config` plans it: the cuts are `optim.schedules.halvings` of the cosine, linear or
wsd schedule at B0 (the warmup kept), a doubled stage starts at its cut rounded up to a whole
number of its batch, and the token horizon stays (`seesaw_defaults`: `steps` at B0 becomes the
steps that read the same tokens). The rule is `optim.lr_rule`, else `SEESAW_RULES`; b2, weight
decay and EMA follow each stage's batch as under any ramp.
Why and details: docs/batch_size.md#seesaw
"""
from __future__ import annotations

import dataclasses
import math

from optim.ramp import UNITS, BatchRamp
from optim.schedules import DECAYING, halvings, length


# Seesaw's rate rule per optimizer: sqrt for the Adam-type ones (Muon's measured, optim/scaling.py),
# linear for SGD and LARS. Lion has none here: its sign update is scale-invariant like Adam's,
# but no rule was measured for it.
SEESAW_RULES = {"adamw": "sqrt", "adafactor": "sqrt", "lamb": "sqrt", "muon": "sqrt",
                "sgd": "linear", "lars": "linear"}


def seesaw_rule(optim_cfg) -> str | None:
  """The rate rule Seesaw cuts by: `optim.lr_rule` when set, else the optimizer's; None when
  neither gives one."""
  rule = optim_cfg.get("lr_rule", "none")
  return rule if rule != "none" else SEESAW_RULES.get(optim_cfg.name)


@dataclasses.dataclass(frozen=True)
class Seesaw:
  """The plan of a Seesaw run: batch doublings and rate cuts at the halvings of its schedule."""
  start: int  # data.global_batch_size, B0
  max_batch: int
  rule: str  # "sqrt" | "linear": the rate at 2B is lr x sqrt(2) | x 2 before the cut by 2
  halvings: tuple[int, ...]  # step indices at B0 where the schedule has fallen to 1/2^k
  horizon: int  # sequences to read (the schedule's horizon at B0: the token horizon / seq_len)
  seq_len: int
  schedule: str

  @classmethod
  def from_config(cls, optim_cfg, data_cfg, steps: int) -> "Seesaw":
    """The plan of a run config's `optim` and `data` blocks; `steps`: the horizon, in steps
    at B0, when no `optim.decay_*` key sets it. Raises ValueError (one line) when the
    settings are impossible (`seesaw_check` says which)."""
    start, seq, top = int(data_cfg.global_batch_size), int(data_cfg.seq_len), \
        int(data_cfg.max_batch)
    if top < start:
      raise ValueError(f"data.max_batch={top} is below data.global_batch_size={start}, "
                       f"Seesaw's first batch; set it to {start} x 2^k, e.g. {start * 8}")
    doublings = round(math.log2(top / start))
    if start * 2 ** doublings != top:
      raise ValueError(f"data.max_batch={top} is not data.global_batch_size={start} x 2^k "
                       f"(Seesaw doubles the batch); e.g. {start * 2 ** max(doublings, 1)}")
    rule = seesaw_rule(optim_cfg)
    if rule not in ("sqrt", "linear"):
      raise ValueError(f"data.batch_ramp='seesaw': optim.name={optim_cfg.name!r} has no "
                       "Seesaw rate rule (known: " + ", ".join(f"{k} {v}" for k, v in
                                                            SEESAW_RULES.items())
                       + "); set optim.lr_rule to 'sqrt' (Adam-type) or 'linear' (SGD-type)")
    if optim_cfg.schedule not in DECAYING:
      raise ValueError(f"data.batch_ramp='seesaw' turns the halvings of a decaying schedule "
                       f"into batch doublings; optim.schedule={optim_cfg.schedule!r} has none: "
                       f"use one of {', '.join(DECAYING)}")
    constant = BatchRamp.constant(start, seq)
    horizon = length(optim_cfg, "decay", "examples", constant, default_steps=int(steps))
    cuts = halvings(optim_cfg, int(steps), constant)
    if not cuts:
      raise ValueError(f"data.batch_ramp='seesaw': optim.schedule={optim_cfg.schedule!r} never "
                       f"falls to half its peak before its horizon (optim.min_lr_ratio="
                       f"{optim_cfg.min_lr_ratio}), so there is no cut to turn into a doubling")
    return cls(start, top, rule, cuts, math.ceil(horizon - 1e-9), seq, optim_cfg.schedule)

  def stages(self) -> list[tuple[int, int]]:
    """[(batch, start tokens)]: a doubling at each halving while the batch is below max, from
    the halving's sequences rounded up to a multiple of the new batch."""
    out = [(self.start, 0)]
    for cut in self.halvings:
      if out[-1][0] >= self.max_batch:
        break
      batch = out[-1][0] * 2
      out.append((batch, -(-cut * self.start // batch) * batch * self.seq_len))
    return out

  def ramp(self) -> BatchRamp:
    """The run's ramp: the doublings, and every halving as a cut at the first step whose
    tokens reach it (a doubling's cut is its stage's first step)."""
    ramp = BatchRamp(self.stages(), self.seq_len)
    doublings = len(ramp.batches) - 1
    ramp.cuts = ramp.start_steps[1:] + tuple(ramp.first_step_at(c * self.start)
                                             for c in self.halvings[doublings:])
    ramp.plan = self
    return ramp

  def steps(self, ramp: BatchRamp | None = None) -> int:
    """Steps of the Seesaw run: those that read the horizon's sequences, the last one not past
    it (all of them when the largest batch divides what is left after its stage starts)."""
    ramp = ramp or self.ramp()
    n = ramp.first_step_at(self.horizon)
    return n if ramp.examples_before(n) == self.horizon else n - 1

  @property
  def cut_per_doubling(self) -> float:
    """The rate's factor at a doubling: 2^(1/2) / 2 (sqrt) or 2 / 2 (linear)."""
    return (math.sqrt(2.0) if self.rule == "sqrt" else 2.0) / 2.0

  def describe(self, ramp: BatchRamp) -> str:
    """The start-up line: every doubling and cut, and the steps that read the horizon."""
    doublings = len(ramp.batches) - 1
    parts = [f"batch {ramp.batches[i]} -> {ramp.batches[i + 1]} and lr x "
             f"{self.cut_per_doubling:.4g} from step {ramp.cuts[i] + 1}"
             for i in range(doublings)]
    parts += [f"lr x 0.5 from step {c + 1}" for c in ramp.cuts[doublings:]]
    base = f"{-(-self.horizon // self.start):,} steps at batch {self.start}"
    steps = self.steps(ramp)
    read = ramp.examples_before(steps)
    return (f"Seesaw ({self.rule} rule) of the {self.schedule} schedule, halving at steps "
            f"{', '.join(str(c + 1) for c in self.halvings)} of batch {self.start}: "
            + "; ".join(parts) + f"; the horizon's {self.horizon * self.seq_len:,} tokens "
            f"({base}) in {steps:,} steps"
            + ("" if read == self.horizon else f" ({read * self.seq_len:,} tokens: the last "
               "batch does not divide the rest)")
            + ("" if ramp.batches[-1] == self.max_batch else
               f" (data.max_batch={self.max_batch} not reached)"))


def seesaw_defaults(cfg):
  """(run config with Seesaw's values filled in, one line per value filled in) for a run config
  under `data.batch_ramp = "seesaw"`; the config itself otherwise. The input is not changed.
  Fills in `optim.lr_rule` (the optimizer's rule), `data.micro_batch_size` (the starting
  batch), the horizon as `optim.decay_examples` when no `decay_*` key sets it (then `steps`
  steps at the starting batch), and `steps`: when it is the horizon at the starting batch, the
  steps that read the horizon under the ramp. A smaller `steps` with an explicit horizon stops
  the run early (to be resumed with more); a larger one is refused. A config filled in already
  comes back the same. Raises ValueError (one line) for impossible settings."""
  d, o = cfg.data, cfg.optim
  if d.batch_ramp != "seesaw":
    return cfg, []
  plan = Seesaw.from_config(o, d, cfg.steps)
  out, notes = cfg.copy_and_resolve_references(), []
  if o.lr_rule == "none":
    out.optim.lr_rule = plan.rule
    notes.append(f"optim.lr_rule='none' -> {plan.rule!r}, {o.name}'s rule: a doubling cuts the "
                 f"rate by {plan.cut_per_doubling:.4g} instead of 0.5")
  if not d.micro_batch_size:
    out.data.micro_batch_size = plan.start
    notes.append(f"data.micro_batch_size=0: micro-batches of {plan.start} sequences (the "
                 "starting batch); larger batches accumulate them")
  explicit = [u for u in UNITS if o[f"decay_{u}"] > 0]
  run_steps = plan.steps()
  if not explicit:
    out.optim.decay_examples = plan.horizon
    notes.append(f"the schedule's horizon, steps={cfg.steps} at batch {plan.start}, is "
                 f"optim.decay_examples={plan.horizon} (sequences: the token horizon)")
  elif cfg.steps > run_steps and cfg.steps * plan.start != plan.horizon:
    key = f"optim.decay_{explicit[0]}={o[f'decay_{explicit[0]}']}"
    raise ValueError(
        f"steps={cfg.steps} runs past the Seesaw run's horizon ({key}: {plan.horizon:,} "
        f"sequences, read in {run_steps} steps under its ramp); set steps <= {run_steps}, or "
        "leave the optim.decay_* keys at 0 for a horizon of `steps` steps at the starting batch")
  if cfg.steps * plan.start == plan.horizon and cfg.steps != run_steps:
    out.steps = run_steps
    notes.append(f"steps={cfg.steps} -> {run_steps}: the horizon's {plan.horizon:,} sequences "
                 f"under the Seesaw ramp")
  return out, notes


def planned_ramp(data_cfg, optim_cfg, steps: int) -> BatchRamp:
  """The run's ramp: Seesaw's, derived from the schedule of `optim_cfg` over `steps`, under
  `data.batch_ramp = "seesaw"`; else the one the `data` block states (`BatchRamp.from_config`)."""
  if data_cfg.get("batch_ramp", "") == "seesaw":
    return Seesaw.from_config(optim_cfg, data_cfg, steps).ramp()
  return BatchRamp.from_config(data_cfg)

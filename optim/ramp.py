"""The global batch as a function of the step: a batch-size ramp, and the step <-> examples <->
tokens clock that schedules and the data pipeline share.

A ramp grows the batch in stages during training, e.g. 64 -> 256 -> 1024 sequences at given
token counts (`data.batch_ramp = "64:0,256:2000000,1024:8000000"`, each stage `batch:start
tokens`). Growing the batch once the gradient noise scale has grown with falling loss is the
recipe of McCandlish et al. 2018 ("An Empirical Model of Large-Batch Training", Sec. 5) and of
Smith et al. 2018 ("Don't Decay the Learning Rate, Increase the Batch Size"); GPT-3 (Brown et
al. 2020) ramped its batch over the first tokens the same way.

A stage starts at the first step whose tokens seen so far reach its start, so a ramp is a pure
function of the step: the stage of step n, and the examples and tokens before it, follow from n
alone (`BatchRamp.batch_at`, `examples_before`). The trainer realises a stage's batch as more
or fewer accumulated micro-batches of one fixed shape, so nothing in the data order or the
compiled micro-batch changes; a run without a ramp is a one-stage ramp.

Under the batch autopilot (`data.batch_ramp = "auto"`, `optim/autopilot.py`) the ramp starts as
one stage and the run appends stages as it decides (`add_stage`): still a pure function of the
step given those decisions, which checkpoints save.

Seesaw (`data.batch_ramp = "seesaw"`, `data.max_batch`; Meterez et al. 2025, "Seesaw:
Accelerating Training by Balancing Learning Rate and Batch Size Scheduling", arXiv 2510.14717).
Wherever a step decay would cut the rate by 2, Seesaw cuts it by sqrt(2) and doubles the batch
(Adam-type optimizers, whose rate follows sqrt(B); for SGD and LARS, whose rate follows B, the
linear rule: keep the rate, double the batch). The paper's equivalence: lr x 1/alpha with batch
x beta follows the same loss curve in tokens as a halving when alpha sqrt(beta) = 2 (Adam, via
normalized SGD in the variance-dominated regime) or alpha beta = 2 (SGD), in fewer serial
steps, as long as the batch stays below the critical batch. The plan (`Seesaw.from_config`):

  1. The configured schedule (cosine, linear or wsd), evaluated at every step of the starting
     batch `data.global_batch_size` B0 up to its horizon, is discretised where it has halved
     (`optim.schedules.halvings`): cut k at the first step c_k whose rate is <= peak / 2^k,
     i.e. at c_k x B0 x seq_len tokens. The warmup is kept as it is.
  2. At each cut the batch doubles, while it is below `data.max_batch`; later cuts halve the rate.
     A doubled stage starts at its cut rounded up to a whole number of its own batch (so a
     horizon the largest batch divides is read exactly), a later cut at the first step whose
     tokens reach it, and the rate of a step is the stage's peak (the rule of `optim.lr_rule`
     from the reference batch, `optim/scaling.py`) x 1/2^k, k the cuts reached
     (`BatchRamp.cuts`, read by `optim.schedules.build_schedule`): per doubling x sqrt(2)/2
     (sqrt) or x 1 (linear).
  3. The token horizon is unchanged: `steps` at B0 (or the `optim.decay_*` horizon) becomes the
     steps that read the horizon's tokens under the ramp, the last one not past it
     (`seesaw_defaults`). With
     `data.max_batch = data.global_batch_size` nothing doubles: the plain step decay at B0,
     Seesaw's own baseline.

The rule is `optim.lr_rule` when it is set, else the optimizer's (`SEESAW_RULES`); an
optimizer without one (lion) must state it. Everything else the batch-size rules derive (b2,
weight decay, EMA) follows each stage's batch as under any ramp.
"""
from __future__ import annotations

import bisect
import dataclasses
import math

import jax.numpy as jnp

UNITS = ("steps", "examples", "tokens")
# Seesaw's rate rule per optimizer: sqrt for the Adam-type ones (Muon's measured, optim/scaling.py),
# linear for SGD and LARS. Lion has none here: its sign update is scale-invariant like Adam's,
# but no rule was measured for it.
SEESAW_RULES = {"adamw": "sqrt", "adafactor": "sqrt", "lamb": "sqrt", "muon": "sqrt",
                "sgd": "linear", "lars": "linear"}


def parse_ramp(text: str) -> list[tuple[int, int]]:
  """"64:0, 256:2_000_000" -> [(64, 0), (256, 2000000)]. Raises ValueError with the reason."""
  stages = []
  for part in text.replace(" ", "").split(","):
    if not part:
      continue
    batch, sep, start = part.partition(":")
    try:
      if not sep:
        raise ValueError
      b, t = int(batch.replace("_", "")), float(start.replace("_", ""))
    except ValueError:
      raise ValueError(f"stage {part!r} is not BATCH:START_TOKENS (e.g. 64:0,256:2000000)") \
          from None
    if t != int(t):
      raise ValueError(f"stage {part!r}: the start must be a whole number of tokens")
    stages.append((b, int(t)))
  if not stages:
    raise ValueError("no stages; e.g. 64:0,256:2000000")
  if stages[0][1] != 0:
    raise ValueError(f"the first stage must start at 0 tokens, not {stages[0][1]}")
  for (_, t0), (b, t1) in zip(stages, stages[1:]):
    if t1 <= t0:
      raise ValueError(f"stage starts must increase: {t1} tokens after {t0}")
  if any(b < 1 for b, _ in stages):
    raise ValueError("every stage needs a batch of at least 1 sequence")
  return stages


class BatchRamp:
  """Stages of (batch in sequences, start in tokens) at a fixed sequence length. `cuts`: step
  indices from which the schedule's rate is halved once more (Seesaw's step decay; none for
  other ramps)."""

  def __init__(self, stages: list[tuple[int, int]], seq_len: int, cuts: tuple[int, ...] = ()):
    self.seq_len = int(seq_len)
    self.cuts = tuple(cuts)
    self.plan: Seesaw | None = None
    self._set_stages(stages)

  def _set_stages(self, stages: list[tuple[int, int]]) -> None:
    self.batches = tuple(int(b) for b, _ in stages)
    self.start_tokens = tuple(int(t) for _, t in stages)
    # First step of each stage, and the examples seen before it.
    steps, examples = [0], [0]
    for k in range(1, len(stages)):
      per_step = self.batches[k - 1] * self.seq_len
      behind = self.start_tokens[k] - examples[-1] * self.seq_len
      n = max(0, math.ceil(behind / per_step))
      steps.append(steps[-1] + n)
      examples.append(examples[-1] + n * self.batches[k - 1])
    self.start_steps = tuple(steps)
    self.start_examples = tuple(examples)

  @classmethod
  def constant(cls, batch: int, seq_len: int) -> "BatchRamp":
    return cls([(batch, 0)], seq_len)

  @classmethod
  def from_config(cls, data_cfg, optim_cfg=None, steps: int | None = None) -> "BatchRamp":
    """The ramp of a `data` config block (one stage of `global_batch_size` without a ramp).
    Under `batch_ramp = "auto"` it starts as that one stage and grows by `add_stage` as the
    run decides (`optim/autopilot.py`). Under "seesaw" it is derived from the schedule of
    `optim_cfg` over `steps` (`Seesaw`)."""
    text = data_cfg.get("batch_ramp", "") if hasattr(data_cfg, "get") else ""
    if text == "seesaw":
      if optim_cfg is None or steps is None:
        raise ValueError("data.batch_ramp='seesaw' is derived from the schedule: pass the "
                         "optim config and steps")
      return Seesaw.from_config(optim_cfg, data_cfg, steps).ramp()
    if text and text != "auto":
      return cls(parse_ramp(text), data_cfg.seq_len)
    return cls.constant(data_cfg.global_batch_size, data_cfg.seq_len)

  def add_stage(self, batch: int, start_step: int) -> None:
    """Append a stage of `batch` sequences from step index `start_step` (0-based, after the
    last stage's start), in place: the steps before it keep their batches, so everything this
    ramp said about them stays true. The autopilot grows a run's ramp this way; the object is
    the one the schedules read (through `clock`) when a stage's step is compiled, and a step
    of a given batch is compiled only once its stage exists."""
    start_step = int(start_step)
    if start_step <= self.start_steps[-1]:
      raise ValueError(f"a new stage must start after step {self.start_steps[-1]}, "
                       f"not at {start_step}")
    stages = list(zip(self.batches, self.start_tokens))
    self._set_stages(stages + [(int(batch), self.tokens_before(start_step))])

  def stages_by_step(self) -> list[tuple[int, int]]:
    """[(first step index, batch)] of every stage."""
    return list(zip(self.start_steps, self.batches))

  @property
  def is_constant(self) -> bool:
    return len(set(self.batches)) == 1

  def stage_at(self, step: int) -> int:
    """Index of the stage that step `step` (0-based: the step that starts there) belongs to."""
    return bisect.bisect_right(self.start_steps, int(step)) - 1

  def batch_at(self, step: int) -> int:
    return self.batches[self.stage_at(step)]

  def examples_before(self, step: int) -> int:
    """Sequences consumed by steps 0 .. step-1 (exact, Python ints)."""
    k = self.stage_at(step)
    return self.start_examples[k] + (int(step) - self.start_steps[k]) * self.batches[k]

  def tokens_before(self, step: int) -> int:
    return self.examples_before(step) * self.seq_len

  def step_at_examples(self, examples: float) -> float:
    """The inverse of `examples_before`, as a fractional step (for lengths given in examples)."""
    k = bisect.bisect_right(self.start_examples, examples) - 1  # zero-length stages skipped
    return self.start_steps[k] + (examples - self.start_examples[k]) / self.batches[k]

  def examples_before_traced(self, count):
    """`examples_before` for a traced step count, in float32 (for schedules inside jit)."""
    count = jnp.asarray(count, jnp.float32)
    if len(self.batches) == 1:
      return count * float(self.batches[0])
    total = jnp.zeros((), jnp.float32)
    bounds = list(self.start_steps[1:]) + [None]
    for start, end, batch in zip(self.start_steps, bounds, self.batches):
      span = count - start
      span = jnp.clip(span, 0.0, None if end is None else float(end - start))
      total = total + span * float(batch)
    return total

  # ----------------------------------------------------------------------------------------------
  # Units: steps, examples (sequences), tokens.

  def convert(self, value: float, unit: str, to: str) -> float:
    """A length measured from the start of training, from `unit` to `to`."""
    if unit == to:
      return value
    examples = {"steps": lambda v: self.examples_before_fractional(v),
                "examples": lambda v: v,
                "tokens": lambda v: v / self.seq_len}[unit](value)
    if to == "examples":
      return examples
    if to == "tokens":
      return examples * self.seq_len
    return self.step_at_examples(examples)

  def examples_before_fractional(self, step: float) -> float:
    k = self.stage_at(math.floor(step))
    return self.start_examples[k] + (step - self.start_steps[k]) * self.batches[k]

  def clock(self, unit: str):
    """count -> position in `unit` (traced). For "steps" the count itself, untouched."""
    if unit == "steps":
      return lambda count: count
    if unit == "examples":
      return self.examples_before_traced
    if unit == "tokens":
      return lambda count: self.examples_before_traced(count) * float(self.seq_len)
    raise ValueError(f"unknown unit {unit!r}; choose from {UNITS}")

  def first_step_at(self, examples: float) -> int:
    """The first step index whose examples seen before it reach `examples` (exact)."""
    lo, hi = 0, max(1, math.ceil(self.step_at_examples(examples)) + 1)
    while lo < hi:
      mid = (lo + hi) // 2
      lo, hi = (mid + 1, hi) if self.examples_before(mid) < examples else (lo, mid)
    return lo

  def describe(self) -> str:
    """The stages, each from its first step counted from 1 (as the logs count steps); a Seesaw
    ramp's doublings and cuts (`Seesaw.describe`)."""
    if self.plan is not None:
      return self.plan.describe(self)
    parts = [f"{b} from step {s + 1} ({t:,} tokens)"
             for b, s, t in zip(self.batches, self.start_steps,
                                (e * self.seq_len for e in self.start_examples))]
    return "batch ramp: " + " -> ".join(parts)


# ------------------------------------------------------------------------------------------------
# Seesaw (module docstring)


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
    from optim.schedules import DECAYING, halvings, length  # noqa: PLC0415  (imports ramp)
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

"""The global batch as a function of the step: a batch-size ramp, and the step <-> examples <->
tokens clock that schedules and the data pipeline share.

  data.batch_ramp = "64:0,256:2000000,1024:8000000"          (batch:start tokens, ...)
  step    0 ......... n_1 ............ n_2 ...........        n_i: the first step whose
  batch   64          256              1024                   tokens seen reach stage i's start

So a ramp is a pure function of the step (`BatchRamp.batch_at`, `examples_before`). A stage's
batch is more or fewer accumulated micro-batches of one fixed shape: the data order and the
compiled micro-batch do not change; a run without a ramp is a one-stage ramp. The autopilot
(`data.batch_ramp = "auto"`, optim/autopilot.py) appends stages as it decides (`add_stage`);
Seesaw's ramp, derived from the schedule, is optim/seesaw.py's.
Why: docs/batch_size.md#batch-size-ramp
"""
from __future__ import annotations

import bisect
import math

import jax.numpy as jnp

UNITS = ("steps", "examples", "tokens")


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
    self.plan = None  # a Seesaw ramp's plan (optim/seesaw.py)
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
  def from_config(cls, data_cfg) -> "BatchRamp":
    """The ramp a `data` config block states (one stage of `global_batch_size` without a ramp).
    Under `batch_ramp = "auto"` it starts as that one stage and grows by `add_stage` as the run
    decides (`optim/autopilot.py`). A Seesaw ramp is derived from the schedule:
    `optim.seesaw.planned_ramp`."""
    text = data_cfg.get("batch_ramp", "") if hasattr(data_cfg, "get") else ""
    if text == "seesaw":
      raise ValueError("data.batch_ramp='seesaw' is derived from the schedule: "
                       "optim.seesaw.planned_ramp")
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




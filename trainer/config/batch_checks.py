"""The config checks of batch-size science (part of `trainer.config.checks.validate`): the
batch-size rules and schedule units, the batch ramp, Seesaw, the batch autopilot, Muon's keys.
Each problem is one `ConfigError` line naming the key, the value and what would work.
"""
from __future__ import annotations

import difflib

import ml_collections

from optim import B2_RULES, EMA_RULES, LR_RULES, UNITS, WEIGHT_DECAY_RULES
from optim.autopilot import AutoConfig, check, schedule_lengths, with_defaults
from optim.noise_scale import splits
from models.resnet import row_group
from optim.ramp import parse_ramp
from optim.scaling import B2_OPTIMIZERS, SCALE_INVARIANT_OPTIMIZERS, TIMESCALE_OPTIMIZERS, b2_owner
from optim.seesaw import Seesaw, seesaw_defaults
from trainer.config.defaults import ConfigError, choice, need


def check_batch_science(cfg: ml_collections.ConfigDict, dp: int, num_stages: int
                         ) -> list[int]:
  """The batch-size rules, schedule units, batch ramp, EMA and noise-scale keys; returns every
  global batch the run may use (the ramp's stages, the autopilot's sizes)."""
  o, d = cfg.optim, cfg.data
  for key, choices in (("lr_rule", LR_RULES), ("weight_decay_rule", WEIGHT_DECAY_RULES),
                       ("b2_rule", B2_RULES), ("ema_rule", EMA_RULES),
                       ("schedule_unit", UNITS)):
    choice(cfg, f"optim.{key}", choices)
  need(o.reference_batch_size >= 0,
        f"optim.reference_batch_size={o.reference_batch_size}: must be >= 0 "
        "(0 = data.global_batch_size)")
  need(o.weight_decay_rule == "constant" or o.name in TIMESCALE_OPTIMIZERS,
        f"optim.weight_decay_rule='timescale' needs a decay multiplied by the learning rate "
        f"({', '.join(TIMESCALE_OPTIMIZERS)}), not optim.name={o.name!r}; use 'constant'")
  owner = b2_owner(o)
  which = (f"optim.name={o.name!r}" if owner == o.name else
           f"optim.name='muon' with optim.muon.fallback={owner!r} (Muon's b2 is its fallback's)")
  need(o.b2_rule == "constant" or owner in B2_OPTIMIZERS,
        f"optim.b2_rule={o.b2_rule!r} scales Adam's second moment, which {which} does not have "
        f"({', '.join(B2_OPTIMIZERS)} do); use 'constant'")
  need(0 <= o.ema_decay < 1, f"optim.ema_decay={o.ema_decay}: must be in [0, 1) (0 = off)")
  for what in ("warmup", "decay"):
    keys = [f"{what}_{u}" for u in UNITS]
    for key in keys:
      need(o[key] >= 0, f"optim.{key}={o[key]}: must be >= 0")
    given = [f"optim.{k}={o[k]}" for k in keys if o[k] > 0]
    need(len(given) <= 1, f"{' and '.join(given)} both set the {what}; set one of them and "
          "the other to 0")
  if o.schedule == "power":
    need(o.lr_rule == "none", f"optim.schedule='power' scales the learning rate with the batch "
          f"itself; set optim.lr_rule='none' (not {o.lr_rule!r})")
    need(o.power_a > 0 and o.power_b < 0,
          f"optim.power_a={o.power_a}, optim.power_b={o.power_b}: need a > 0 and b < 0")
  if o.schedule == "rsqrt":
    need(any(o[f"warmup_{u}"] > 0 for u in UNITS),
          "optim.schedule='rsqrt' needs a warmup (its timescale): set optim.warmup_steps, "
          "warmup_examples or warmup_tokens")
  need(o.noise_scale_every >= 0,
        f"optim.noise_scale_every={o.noise_scale_every}: must be >= 0 (0 = off)")
  need(0 < o.noise_scale_window <= 1, f"optim.noise_scale_window={o.noise_scale_window}: must "
       "be in (0, 1], the fraction of the tokens trained so far that the meter averages over")
  need(o.noise_scale_pieces >= 2, f"optim.noise_scale_pieces={o.noise_scale_pieces}: must be "
       ">= 2 (small batches per measuring step)")
  need(o.noise_scale_recency >= 0, f"optim.noise_scale_recency={o.noise_scale_recency}: must "
       "be >= 0, the memory of |G|^2's recency weight as a fraction of the training so far "
       "(0: none)")
  need(o.noise_scale_min_measurements >= 1, f"optim.noise_scale_min_measurements="
       f"{o.noise_scale_min_measurements}: must be >= 1 (the measurements before a value)")
  need(o.noise_scale_max_rse >= 0, f"optim.noise_scale_max_rse={o.noise_scale_max_rse}: must "
       "be >= 0, the largest relative standard error of the window's |G|^2 with a value (0: none)")
  micro = d.micro_batch_size or d.global_batch_size
  batches = [d.global_batch_size]
  need(d.max_batch == 0 or d.batch_ramp == "seesaw", f"data.max_batch={d.max_batch} is "
        f"Seesaw's largest batch, but data.batch_ramp={d.batch_ramp!r}; set "
        "data.batch_ramp='seesaw' or leave data.max_batch at 0")
  if d.batch_ramp == "seesaw":
    batches = check_seesaw(cfg, micro)
  elif d.batch_ramp and d.batch_ramp != "auto":
    try:
      stages = parse_ramp(d.batch_ramp)
    except ValueError as e:
      word = difflib.get_close_matches(d.batch_ramp.strip().lower(), ["seesaw", "auto"], n=1)
      raise ConfigError(f"data.batch_ramp={d.batch_ramp!r}: " + (
          f"did you mean {word[0]!r}? (or stages BATCH:START_TOKENS,...)" if word else str(e))
      ) from None
    need(d.micro_batch_size > 0,
          "data.batch_ramp needs data.micro_batch_size: every stage is a number of "
          "micro-batches of that fixed shape")
    bad = [b for b, _ in stages if b % micro]
    need(not bad, f"data.batch_ramp stage of {bad[0] if bad else 0} sequences is not a "
          f"multiple of data.micro_batch_size={micro}")
    need(stages[-1][0] == d.global_batch_size,
          f"data.batch_ramp ends at {stages[-1][0]} sequences but data.global_batch_size="
          f"{d.global_batch_size}; the last stage is the global batch")
    batches = [b for b, _ in stages]
  if d.batch_ramp == "auto":
    batches = check_autopilot(cfg, micro)
  if o.noise_scale_every:
    # a part keeps whole ghost batch-norm groups (the vision workload, models/resnet.py)
    group = row_group(cfg)
    for batch in batches:  # a measuring step needs 2 or more small batches
      if num_stages > 1:
        need(micro % (2 * dp) == 0,
             f"optim.noise_scale_every with mesh.stage={num_stages} runs the pipeline on "
             f"optim.noise_scale_pieces={o.noise_scale_pieces} (at least two) parts of every "
             f"micro-batch's {micro} rows, which must divide over the data-parallel size {dp}; "
             f"use data.micro_batch_size a multiple of {2 * dp}")
      elif batch // micro * splits(batch // micro, o.noise_scale_pieces, micro // dp,
                                   group=group) < 2:
        need(False, f"optim.noise_scale_every at batch {batch} without accumulation splits its "
             f"{micro} rows into two halves, which must divide over the data-parallel size "
             f"{dp}" + (f" in whole ghost batch-norm groups of {group}" if group > 1 else "")
             + f"; use a multiple of {2 * dp * group} rows, or accumulate "
             "(data.micro_batch_size below the batch)" + ("; data.micro_batch_size and optim.noise_scale_every are "
                                   "the autopilot's default here, set them to choose"
                                   if d.batch_ramp == "auto" else ""))
  return batches


def check_seesaw(cfg: ml_collections.ConfigDict, micro: int) -> list[int]:
  """data.batch_ramp='seesaw' (optim/ramp.py), on the config with its defaults filled in
  (`seesaw_defaults`, which refuses impossible settings); returns its batches."""
  d = cfg.data
  need(d.global_batch_size % micro == 0,
        f"data.global_batch_size={d.global_batch_size} is not a multiple of "
        f"data.micro_batch_size={micro}")
  return list(Seesaw.from_config(cfg.optim, d, cfg.steps).ramp().batches)


def resolved(cfg: ml_collections.ConfigDict) -> ml_collections.ConfigDict:
  """The config with the batch autopilot's or Seesaw's defaults filled in, as the run fills
  them in (trainer/step/program.py); an impossible Seesaw setting is a ConfigError."""
  try:
    return seesaw_defaults(with_defaults(cfg)[0])[0]
  except ValueError as e:
    raise ConfigError(str(e)) from None


def check_muon(cfg: ml_collections.ConfigDict) -> None:
  """optim.muon.* (optim/muon.py)."""
  mc = cfg.optim.muon
  choice(cfg, "optim.muon.fallback", SCALE_INVARIANT_OPTIMIZERS)
  need(0 <= mc.beta < 1, f"optim.muon.beta={mc.beta}: must be in [0, 1)")
  need(mc.ns_steps >= 1, f"optim.muon.ns_steps={mc.ns_steps}: must be at least 1 (5 is usual)")
  need(mc.rms >= 0, f"optim.muon.rms={mc.rms}: must be >= 0 (0.2 = AdamW's update RMS, 0 = "
        "Jordan's scaling)")
  need(mc.fallback_lr >= 0, f"optim.muon.fallback_lr={mc.fallback_lr}: must be >= 0 (0 = the "
        "fallback shares optim.learning_rate)")


def check_autopilot(cfg: ml_collections.ConfigDict, micro: int) -> list[int]:
  """data.batch_auto.* (optim/autopilot.py), on the config with the autopilot's defaults filled
  in (`with_defaults`); returns the batches it may choose."""
  o, d = cfg.optim, cfg.data
  reason = check(d, micro, o.name)
  need(reason is None, reason or "")
  # Lengths in another unit than the schedule's are converted through the ramp when the
  # optimizer is built, before the autopilot has decided anything: refuse them.
  unit = o.schedule_unit
  other = [(w, u, v) for w, u, v in schedule_lengths(o) if (u == "steps") != (unit == "steps")]
  need(not any(v is None for *_, v in other),
        f"data.batch_ramp='auto' with optim.schedule_unit={unit!r}: set the horizon as "
        f"optim.decay_{unit} (unset, it is `steps` steps, whose {unit} depend on the batches "
        "still to be chosen)")
  need(not other, f"data.batch_ramp='auto' with optim.schedule_unit={unit!r}: "
        + (f"optim.{other[0][0]}_{other[0][1]}={other[0][2]}" if other else "")
        + " would be converted through batches not yet chosen; give every length of the "
        "schedule in steps, or every one in examples or tokens (the schedule then runs in "
        "tokens and keeps its shape in tokens as the batch grows)")
  need(o.schedule != "power" or unit != "steps", "data.batch_ramp='auto' with "
        "optim.schedule='power': set optim.schedule_unit='tokens' (the power law reads tokens)")
  return AutoConfig.from_config(d).sizes()

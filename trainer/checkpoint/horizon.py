"""The schedule's horizon, fixed at a run's first start.

A decaying schedule reads its horizon from `optim.decay_steps|examples|tokens`, and when all three
are 0 from the run's `steps` (optim/schedules.py). `steps` is what a user changes to continue a
run (`--config.steps=80` after 40), so an unset horizon is fixed when the run first starts: the
run's config gets `optim.decay_steps = steps`, and that config is saved in every checkpoint. A
resumed run whose config leaves the horizon unset takes the newest checkpoint's, and says so in
one line; a horizon the config sets is the config's (a changed one is said in one line too, as
the schedule then changes from the checkpoint's step). A checkpoint written before the horizon
was kept had the horizon of its own `steps`: that is the one taken.
"""
from __future__ import annotations

import ml_collections

from optim.autopilot import NO_HORIZON
from optim.ramp import UNITS
from trainer.checkpoint.saved import newest_saved_config

KEYS = tuple(f"decay_{u}" for u in UNITS)


def _given(optim_cfg) -> dict[str, float]:
  return {k: optim_cfg.get(k, 0) for k in KEYS if (optim_cfg.get(k, 0) or 0) > 0}


def _text(given: dict) -> str:
  return ", ".join(f"optim.{k}={v:g}" for k, v in given.items())


def fix_horizon(cfg: ml_collections.ConfigDict, checkpoints_dir: str
                ) -> tuple[ml_collections.ConfigDict, str | None]:
  """(the run config with its horizon fixed, the line that says where it came from or None).

  The input is not changed. Schedules without a horizon (constant, rsqrt) are left alone."""
  if cfg.optim.schedule in NO_HORIZON:
    return cfg, None
  found = newest_saved_config(checkpoints_dir)
  mine = _given(cfg.optim)
  saved = None
  if found is not None:
    step, saved_cfg = found
    saved_optim = saved_cfg.get("optim", {})
    saved = _given(saved_optim) or (
        {"decay_steps": int(saved_cfg["steps"])} if saved_cfg.get("steps") else None)
  if mine:
    if saved is not None and saved != mine:
      return cfg, (f"schedule horizon {_text(mine)} from the config (checkpoint {step} was "
                   f"written with {_text(saved)}): the learning rate changes from step {step}")
    return cfg, None
  out = cfg.copy_and_resolve_references()
  if saved is None:  # the first start: the horizon is this run's steps, from now on
    out.optim.decay_steps = int(cfg.steps)
    return out, None
  for key, value in saved.items():
    out.optim[key] = type(out.optim[key])(value)
  return out, (f"schedule horizon {_text(saved)}, fixed at the run's first start (kept in "
               f"checkpoint {step}; steps={cfg.steps} does not move it; set optim.decay_steps "
               "to change it)")

"""Optimizer factory: the `optim` config block -> an optax GradientTransformation.

`optim.name`: adamw, lamb, lars, sgd, adafactor, lion or muon (optim/muon.py). For all seven
weight decay is w -= lr * (u + wd * w) (inside the trust ratio for LAMB/LARS), and a
hyperparameter the config leaves unset takes the optimizer's default (`OPTIMIZER_DEFAULTS`,
optim/scaling.py). The chain:

  noise-scale meter (raw gradient) -> clipping -> optimizer (+ muP 1/m) -> parameter EMA
Masks come from the logical axis names: decay and trust ratio for matrices (two or more axes
besides `layers`), not for `vocab` embeddings unless `optim.decay_embeddings`. muP and CompleteP
multiply per-group learning rates, Adam epsilons and weight decay (`lr_multipliers`,
`depth_multipliers`; Muon's matrices take optim/muon.py's shape rule instead).
`update(..., batch_size=B, step=n)` applies the optimizer built for B (cached) at schedule
step n; the schedule beside it takes `.at(B)`. Why and details: docs/batch_size.md#optimizers,
docs/batch_size.md#batch-size-ramp, docs/mup.md.
"""
from __future__ import annotations

import functools
from typing import Any

import jax
import jax.numpy as jnp
import optax

from optim import noise_scale
from optim.ema import ema_params
from optim.muon import dimension_numbers, muon
from optim.muon import labels as muon_labels
from optim.ramp import BatchRamp
from optim.scaling import SCALE_INVARIANT_OPTIMIZERS, Hyperparameters, derive, fallback_lr_ratio
from optim.schedules import build_schedule
from optim.seesaw import planned_ramp
from optim.transforms import scale_by_layerwise_trust_ratio, scale_by_learning_rate_at

OPTIMIZERS = ("adamw", "lamb", "lars", "sgd", "adafactor", "lion", "muon")
MUP_OPTIMIZERS = SCALE_INVARIANT_OPTIMIZERS + ("muon",)  # muP's rules are defined for these


def _is_names(x) -> bool:
  return isinstance(x, tuple) and all(isinstance(n, (str, type(None))) for n in x)


def _core_axes(names):
  return [n for n in names if n != "layers"]


def masks(param_names: Any, *, decay_embeddings: bool = False) -> dict[str, Any]:
  """Trees of bools with the params' structure: `decay`, `trust_ratio`, `stacked`, `hidden`
  (matrices without a `vocab` axis: muP's hidden weights)."""
  def matrix(names):
    return len(_core_axes(names)) >= 2

  def decay(names):
    is_embedding = _core_axes(names)[:1] == ["vocab"]
    return matrix(names) and (decay_embeddings or not is_embedding)

  def stacked(names):
    return bool(names) and names[0] == "layers"

  def hidden(names):
    return matrix(names) and "vocab" not in names

  tree = lambda f: jax.tree.map(f, param_names, is_leaf=_is_names)
  return {"decay": tree(decay), "trust_ratio": tree(matrix), "stacked": tree(stacked),
          "hidden": tree(hidden)}


def lr_multipliers(param_names: Any, width_multiplier: float = 1.0,
                   depth: tuple[float, float] | None = None, muon: bool = False) -> Any:
  """Per-parameter learning-rate multipliers (floats, the params' structure): muP's 1/m on
  hidden matrices (not on those Muon orthogonalises when `muon`: its shape scaling carries muP,
  optim/muon.py), times, under a depth parametrization `depth` = (L / L_base, alpha),
  CompleteP's (L / L_base)^(alpha - 1) on every per-layer parameter (hidden matrices and the
  blocks' norms); 1 on the embedding, the head and the final norm."""
  names_tree = lambda f: jax.tree.map(f, param_names, is_leaf=_is_names)
  hidden = masks(param_names)["hidden"]
  if muon:
    orthogonalised = names_tree(lambda n: dimension_numbers(n) is not None)
    hidden = jax.tree.map(lambda h, o: h and not o, hidden, orthogonalised)
  width = jax.tree.map(lambda h: 1.0 / width_multiplier if h else 1.0, hidden)
  if depth is None:
    return width
  per_layer = names_tree(lambda n: bool(n) and n[0] == "layers")
  k = depth[0] ** (depth[1] - 1.0)
  return jax.tree.map(lambda w, l: w * k if l else w, width, per_layer)


def depth_multipliers(param_names: Any, width_multiplier: float,
                      depth: tuple[float, float]) -> dict[str, Any]:
  """CompleteP's (Dey et al. 2025, Table 1) Adam-epsilon and weight-decay multipliers under a
  depth parametrization `depth` = (L / L_base, alpha), composed with muP's width multiplier m:
  `eps_multipliers` 1/m on hidden matrices times (L / L_base)^-alpha on every per-layer
  parameter; `decay_multipliers` m on hidden matrices (their decoupled decay lr x wd then
  independent of width). 1 elsewhere."""
  names_tree = lambda f: jax.tree.map(f, param_names, is_leaf=_is_names)
  hidden = masks(param_names)["hidden"]
  per_layer = names_tree(lambda n: bool(n) and n[0] == "layers")
  k = depth[0] ** -depth[1]
  eps = jax.tree.map(lambda h, l: (1.0 / width_multiplier if h else 1.0) * (k if l else 1.0),
                     hidden, per_layer)
  decay = jax.tree.map(lambda h: width_multiplier if h else 1.0, hidden)
  return {"eps_multipliers": eps, "decay_multipliers": decay}


def add_decayed_weights_scaled(weight_decay: float, mask: Any, multipliers: Any
                               ) -> optax.GradientTransformation:
  """optax.add_decayed_weights with a per-parameter factor on the decay: u + wd x k x w where
  `mask`, k a Python float per parameter."""

  def update_fn(updates, state, params):
    add = lambda u, p, d, k: u + jnp.asarray(weight_decay * k, u.dtype) * p if d else u
    return jax.tree.map(add, updates, params, mask, multipliers), state

  return optax.GradientTransformation(optax.init_empty_state, update_fn)


def scale_by_multipliers(multipliers: Any) -> optax.GradientTransformation:
  """Multiplies each update by its (Python float) multiplier; 1.0 leaves it untouched."""

  def update_fn(updates, state, params=None):
    del params
    scale = lambda u, k: u if k == 1.0 else u * jnp.asarray(k, u.dtype)
    return jax.tree.map(scale, updates, multipliers), state

  return optax.GradientTransformation(optax.init_empty_state, update_fn)


class BatchSchedule:
  """The learning rate as a function of the step count, at the run's batch or any other."""

  def __init__(self, for_batch, default_batch):
    self._for_batch = for_batch
    self.default_batch = default_batch

  def at(self, batch_size: int | None) -> optax.Schedule:
    return self._for_batch(batch_size or self.default_batch)[1]

  def __call__(self, count):
    return self.at(None)(count)


def build_optimizer(cfg, param_names: Any, total_steps: int, data=None, *,
                    width_multiplier: float = 1.0, depth: tuple[float, float] | None = None,
                    ramp: BatchRamp | None = None):
  """Returns (tx, schedule). `param_names` maps each param to its logical axis names; `data`
  (the `data` config block) gives the global batch, sequence length and batch ramp: without it
  the rules and every unit but steps are unavailable, and the hyperparameters are as stated.
  `width_multiplier`: muP's m (`ModelConfig.width_multiplier`); hidden matrices step lr/m
  (Muon's: their orthogonalised step x sqrt(fan_out / fan_in), optim/muon.py). `depth`:
  (L / L_base, alpha) under a depth parametrization (`ModelConfig.depth_scaling`): CompleteP's
  per-group learning rates, Adam epsilons and weight decay (`lr_multipliers`,
  `depth_multipliers`). `ramp`: the run's own ramp object, shared with the trainer (the batch
  autopilot grows it)."""
  m = masks(param_names, decay_embeddings=bool(cfg.decay_embeddings))
  rules = {"lr_multipliers": lr_multipliers(param_names, width_multiplier, depth,
                                            muon=cfg.name == "muon")}
  if depth is not None:
    rules.update(depth_multipliers(param_names, width_multiplier, depth))
  # A rule whose every multiplier is 1 is left out: the chain is then today's exactly.
  rules = {k: v for k, v in rules.items() if any(x != 1.0 for x in jax.tree.leaves(v))}
  allowed = MUP_OPTIMIZERS if depth is None else SCALE_INVARIANT_OPTIMIZERS
  if (rules or width_multiplier != 1.0) and cfg.name not in allowed:
    raise ValueError(f"muP / CompleteP multipliers are defined for {allowed}, not "
                     f"optim.name={cfg.name!r}")
  m.update(rules)
  if ramp is None and data is not None:
    ramp = planned_ramp(data, cfg, total_steps)
  default_batch = data.global_batch_size if data is not None else None
  # The noise meter's clock: the examples read through a step (its memory is a fraction of it).
  clock = (lambda step: ramp.examples_before_traced(step + 1)) if ramp is not None else \
      (lambda step: step + 1)

  @functools.lru_cache(maxsize=None)
  def for_batch(batch_size):
    hp = derive(cfg, batch_size, default_batch)
    schedule = build_schedule(cfg, total_steps, ramp, peak=hp.learning_rate,
                              batch_size=batch_size)
    return _optimizer(cfg, hp, schedule, m, param_names, clock, width_multiplier), schedule

  reference_tx = for_batch(default_batch)[0]

  def update(updates, state, params=None, *, batch_size: int | None = None, **extra_args):
    tx = for_batch(batch_size or default_batch)[0]
    return tx.update(updates, state, params, **extra_args)

  tx = optax.GradientTransformationExtraArgs(reference_tx.init, update)
  return tx, BatchSchedule(for_batch, default_batch)


def _direction(name: str, cfg, hp: Hyperparameters) -> list[optax.GradientTransformation]:
  """The transformations of an optimizer whose step size does not depend on the gradient's
  scale (SCALE_INVARIANT_OPTIMIZERS), before its weight decay and learning rate: the whole of
  such an optimizer, and Muon's fallback (a list, so that `optax.chain(*...)` keeps each
  optimizer's state structure)."""
  if name == "adamw":
    return [optax.scale_by_adam(b1=cfg.b1, b2=hp.b2, eps=cfg.eps)]
  if name == "adafactor":
    # No parameter-scale multiplication, so `learning_rate` is an absolute step as for Adam;
    # updates clipped to block RMS 1.
    return [optax.scale_by_factored_rms(), optax.clip_by_block_rms(1.0)]
  if name == "lion":
    return [optax.scale_by_lion(b1=cfg.b1, b2=hp.b2)]
  raise ValueError(f"{name!r} has no scale-invariant direction; choose from "
                   f"{', '.join(SCALE_INVARIANT_OPTIMIZERS)}")


def _optimizer(cfg, hp: Hyperparameters, schedule, m, param_names, clock,
               width_multiplier: float = 1.0) -> optax.GradientTransformationExtraArgs:
  """The optax chain at one batch size: meter, clipping, the optimizer, parameter EMA. `m`: the
  `masks` of `param_names` (+ muP's / CompleteP's "lr_multipliers", "eps_multipliers",
  "decay_multipliers" where not all 1); `param_names`: the logical axis names; `clock(step)`:
  the noise meter's clock (`optim.noise_scale.meter`); `width_multiplier`: muP's m, for Muon.

  An Adam-epsilon multiplier k divides the gradient by k before the direction: Adam's
  m / (sqrt(v) + eps) of g / k is m / (sqrt(v) + k eps) of g exactly (Lion's sign ignores it).

  Every optimizer ends in `scale_by_learning_rate_at(schedule)` (the trainer's step drives the
  schedule) with the weight decay added just before it, so decay is multiplied by the learning
  rate everywhere (as in optax.adamw); for LAMB/LARS it is also scaled by the trust ratio, as in
  their papers."""
  wd = hp.weight_decay
  decay = (add_decayed_weights_scaled(wd, m["decay"], m["decay_multipliers"])
           if "decay_multipliers" in m else optax.add_decayed_weights(wd, mask=m["decay"]))
  lr = scale_by_learning_rate_at(schedule)
  name = cfg.name
  if name in SCALE_INVARIANT_OPTIMIZERS:
    # adamw = optax.adamw, lion = optax.lion, same states. optax.adafactor adds its decay after
    # the learning rate (w -= lr * u + wd * w); here it is AdamW's decoupled decay.
    tx = optax.chain(*_direction(name, cfg, hp), decay, lr)
    if "eps_multipliers" in m:
      tx = optax.chain(scale_by_multipliers(jax.tree.map(lambda k: 1.0 / k,
                                                         m["eps_multipliers"])), tx)
  elif name == "muon":  # optim/muon.py; the fallback's direction on the non-matrices
    mc = cfg.muon
    tx = optax.chain(
        muon(param_names, optax.chain(*_direction(mc.fallback, cfg, hp)), beta=float(mc.beta),
             ns_steps=int(mc.ns_steps), nesterov=bool(mc.nesterov), rms=float(mc.rms),
             width_multiplier=width_multiplier),
        decay, lr)
    ratio = fallback_lr_ratio(cfg, hp)
    if ratio != 1.0:  # the fallback at its own rate, the schedule's shape (its decay too)
      tx = optax.chain(tx, scale_by_multipliers(jax.tree.map(
          lambda label: ratio if label == "fallback" else 1.0, muon_labels(param_names))))
  elif name == "lamb":
    tx = optax.chain(
        optax.scale_by_adam(b1=cfg.b1, b2=hp.b2, eps=cfg.eps), decay,
        scale_by_layerwise_trust_ratio(m["trust_ratio"], m["stacked"],
                                       trust_coefficient=hp.trust_coefficient), lr)
  elif name == "lars":
    tx = optax.chain(
        decay,
        scale_by_layerwise_trust_ratio(m["trust_ratio"], m["stacked"],
                                       trust_coefficient=hp.trust_coefficient, eps=cfg.eps),
        lr, optax.trace(decay=cfg.momentum, nesterov=cfg.nesterov))
  elif name == "sgd":  # L2 decay added to the gradient (before momentum), times the lr
    momentum = optax.trace(decay=cfg.momentum, nesterov=cfg.nesterov) if cfg.momentum else \
        optax.identity()
    tx = optax.chain(decay, optax.chain(momentum, lr))  # = decay + optax.sgd, same state
  else:
    raise ValueError(f"optim.name={name!r}: choose from {OPTIMIZERS}")
  if "lr_multipliers" in m:  # muP / CompleteP: per-parameter learning rates (docstring)
    tx = optax.chain(tx, scale_by_multipliers(m["lr_multipliers"]))
  if float(cfg.clip_norm) > 0:
    tx = optax.chain(optax.clip_by_global_norm(float(cfg.clip_norm)), tx)
  if int(cfg.get("noise_scale_every", 0)) > 0:
    tx = optax.chain(noise_scale.meter(
        float(cfg.noise_scale_window), clock, recency=float(cfg.get("noise_scale_recency", 0)),
        min_measurements=int(cfg.get("noise_scale_min_measurements", 1)),
        max_rse=float(cfg.get("noise_scale_max_rse", 0)),
        second_moments=(hp.b2, float(cfg.eps), float(cfg.clip_norm))
        if name in noise_scale.PRECONDITIONED else None),
        tx)
  if hp.ema_decay > 0:
    tx = optax.chain(tx, ema_params(hp.ema_decay))
  return tx

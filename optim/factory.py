"""Optimizer factory: the `optim` config block -> an optax GradientTransformation.

  adamw  Loshchilov & Hutter 2019 (decoupled weight decay, multiplied by the learning rate)
  lamb   You et al. 2019: Adam direction + weight decay, scaled per layer by ||w|| / ||r||
  lars   You, Gitman & Ginsburg 2017: momentum SGD with a per-layer trust ratio
  sgd    SGD with (optionally Nesterov) momentum, optional L2 weight decay

Masks come from the parameters' logical axis names (what the model annotates anyway):
a parameter is a *matrix* when it has at least two axes besides the stacked `layers` axis;
norm scales and biases are not. Weight decay and the LAMB/LARS trust ratio apply to matrices
only; input embedding tables (first non-layer axis `vocab`, by the convention in
`sharding/rules.py`) are also spared weight decay unless `optim.decay_embeddings`.
"""
from __future__ import annotations

from typing import Any

import jax
import optax

from optim.schedules import build_schedule
from optim.transforms import scale_by_layerwise_trust_ratio

OPTIMIZERS = ("adamw", "lamb", "lars", "sgd")


def _is_names(x) -> bool:
  return isinstance(x, tuple) and all(isinstance(n, (str, type(None))) for n in x)


def _core_axes(names):
  return [n for n in names if n != "layers"]


def masks(param_names: Any, *, decay_embeddings: bool = False) -> dict[str, Any]:
  """Trees of bools with the params' structure: `decay`, `trust_ratio`, `stacked`."""
  def matrix(names):
    return len(_core_axes(names)) >= 2

  def decay(names):
    is_embedding = _core_axes(names)[:1] == ["vocab"]
    return matrix(names) and (decay_embeddings or not is_embedding)

  def stacked(names):
    return bool(names) and names[0] == "layers"

  tree = lambda f: jax.tree.map(f, param_names, is_leaf=_is_names)
  return {"decay": tree(decay), "trust_ratio": tree(matrix), "stacked": tree(stacked)}


def build_optimizer(cfg, param_names: Any, total_steps: int):
  """Returns (tx, schedule). `param_names` maps each param to its logical axis names."""
  schedule = build_schedule(cfg, total_steps)
  m = masks(param_names, decay_embeddings=bool(cfg.decay_embeddings))
  wd = float(cfg.weight_decay)
  name = cfg.name
  if name == "adamw":
    tx = optax.adamw(schedule, b1=cfg.b1, b2=cfg.b2, eps=cfg.eps, weight_decay=wd,
                     mask=m["decay"])
  elif name == "lamb":
    tx = optax.chain(
        optax.scale_by_adam(b1=cfg.b1, b2=cfg.b2, eps=cfg.eps),
        optax.add_decayed_weights(wd, mask=m["decay"]),
        scale_by_layerwise_trust_ratio(m["trust_ratio"], m["stacked"]),
        optax.scale_by_learning_rate(schedule),
    )
  elif name == "lars":
    tx = optax.chain(
        optax.add_decayed_weights(wd, mask=m["decay"]),
        scale_by_layerwise_trust_ratio(m["trust_ratio"], m["stacked"],
                                       trust_coefficient=cfg.trust_coefficient, eps=cfg.eps),
        optax.scale_by_learning_rate(schedule),
        optax.trace(decay=cfg.momentum, nesterov=cfg.nesterov),
    )
  elif name == "sgd":
    tx = optax.chain(
        optax.add_decayed_weights(wd, mask=m["decay"]),
        optax.sgd(schedule, momentum=cfg.momentum or None, nesterov=cfg.nesterov),
    )
  else:
    raise ValueError(f"optim.name={name!r}: choose from {OPTIMIZERS}")
  if float(cfg.clip_norm) > 0:
    tx = optax.chain(optax.clip_by_global_norm(float(cfg.clip_norm)), tx)
  return tx, schedule

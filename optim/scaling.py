"""Batch-size-aware hyperparameters: stated at a reference batch, derived at the run's batch.

A config states the optimizer's hyperparameters at `optim.reference_batch_size` sequences (0:
the run's own `data.global_batch_size`, so nothing changes) and one rule each for moving them
to batch B, with k = B / B_ref:

  learning rate  `optim.lr_rule`            none | linear: lr k | sqrt: lr sqrt(k)
  weight decay   `optim.weight_decay_rule`  constant | timescale: lambda' = lambda k lr / lr'
  Adam beta2     `optim.b2_rule`            constant | half_life: b2 ** k
  model EMA      `optim.ema_rule`           constant | half_life: rho ** k

`learning_rate`, `weight_decay`, `b2`, `trust_coefficient` left unset (0, -1, 0, 0) take the
optimizer's own default (`OPTIMIZER_DEFAULTS`). `derive` is the one place these formulas live:
the factory builds each batch size's optimizer from it, the trainer prints and logs it.
Why, the papers, Muon's rule: docs/batch_size.md#hyperparameters-stated-at-a-reference-batch
"""
from __future__ import annotations

import dataclasses
import math

LR_RULES = ("none", "linear", "sqrt")
WEIGHT_DECAY_RULES = ("constant", "timescale")
B2_RULES = ("constant", "half_life")
EMA_RULES = ("constant", "half_life")

# The optimizers' own defaults, used for the keys a config leaves unset (see `stated`).
OPTIMIZER_DEFAULTS = {
    # Loshchilov & Hutter 2019; b2 0.95 as in LLM practice (GPT-3, Llama)
    "adamw": dict(learning_rate=3e-3, weight_decay=0.1, b2=0.95, trust_coefficient=1.0),
    # You et al. 2019: b2 0.999, decay 0.01, trust ratio ||w|| / ||r|| (coefficient 1), so
    # lr is each layer's relative step
    "lamb": dict(learning_rate=3e-2, weight_decay=0.01, b2=0.999, trust_coefficient=1.0),
    # You, Gitman & Ginsburg 2017: trust coefficient 0.001, decay 5e-4, lr on the scale of 1
    "lars": dict(learning_rate=2.0, weight_decay=5e-4, b2=0.95, trust_coefficient=1e-3),
    # momentum SGD (Sutskever et al. 2013); L2 decay 1e-4
    "sgd": dict(learning_rate=0.1, weight_decay=1e-4, b2=0.95, trust_coefficient=1.0),
    # Shazeer & Stern 2018 with an absolute step (no parameter scaling), AdamW's lr and decay
    "adafactor": dict(learning_rate=3e-3, weight_decay=0.1, b2=0.95, trust_coefficient=1.0),
    # Chen et al. 2023: b2 0.99; lr 3x smaller and decay 3x larger than AdamW's (the paper:
    # 3-10x), so that lr * wd, the per-step shrink, is AdamW's
    "lion": dict(learning_rate=1e-3, weight_decay=0.3, b2=0.99, trust_coefficient=1.0),
    # Liu et al. 2025: the update RMS matched to AdamW's (optim.muon.rms = 0.2), so AdamW's lr
    # and decay carry over; no b2 of its own: its fallback's default (`b2_owner`)
    "muon": dict(learning_rate=3e-3, weight_decay=0.1, trust_coefficient=1.0),
}
UNSET = {"learning_rate": 0.0, "weight_decay": -1.0, "b2": 0.0, "trust_coefficient": 0.0}


def b2_owner(cfg) -> str:
  """The optimizer whose b2 `optim.b2` is: Muon's is its fallback's (optim/muon.py), which takes
  that optimizer's default b2 and rules."""
  return cfg.muon.fallback if cfg.name == "muon" else cfg.name


def _default_source(cfg, key: str) -> str:
  """The optimizer whose OPTIMIZER_DEFAULTS row gives `key` when the config leaves it unset."""
  return b2_owner(cfg) if key == "b2" else cfg.name


def stated(cfg) -> dict:
  """{key: (value, "set" | "default")} of the keys with per-optimizer defaults."""
  out = {}
  for key, unset in UNSET.items():
    value = float(cfg.get(key, unset))
    default = OPTIMIZER_DEFAULTS[_default_source(cfg, key)][key]
    out[key] = (default, "default") if value == unset else (value, "set")
  return out


# Optimizers whose per-coordinate step does not scale with the gradient: muP's Adam rule is
# derived for them (optim/factory.py), and Muon's fallback is one of them (optim/muon.py).
SCALE_INVARIANT_OPTIMIZERS = ("adamw", "adafactor", "lion")

# Which optimizers each non-trivial rule makes sense for (checked by trainer/config/checks.py).
# decay multiplied by the learning rate
TIMESCALE_OPTIMIZERS = ("adamw", "lion", "sgd", "adafactor", "muon")
B2_OPTIMIZERS = ("adamw", "lamb")  # Adam's second moment (Muon's: `b2_owner`, its fallback's)


def lr_factor(rule: str, k: float) -> float:
  if rule == "none":
    return 1.0
  if rule == "linear":
    return k
  if rule == "sqrt":
    return math.sqrt(k)
  raise ValueError(f"unknown lr rule {rule!r}; choose from {LR_RULES}")


def scaled_weight_decay(rule: str, weight_decay: float, k: float, lr_ratio: float) -> float:
  """lambda at k x the reference batch; `lr_ratio` = lr' / lr (Power Lines: tau fixed)."""
  if rule == "constant":
    return weight_decay
  if rule == "timescale":
    return weight_decay * k / lr_ratio
  raise ValueError(f"unknown weight decay rule {rule!r}; choose from {WEIGHT_DECAY_RULES}")


def scaled_decay_rate(rule: str, rate: float, k: float) -> float:
  """An EMA coefficient (Adam's b2, the model EMA) at k x the reference batch."""
  if rule == "constant":
    return rate
  if rule == "half_life":
    return rate ** k
  raise ValueError(f"unknown rule {rule!r}; choose from constant, half_life")


@dataclasses.dataclass(frozen=True)
class Hyperparameters:
  """The values a run uses at one global batch, and the reference they came from."""
  batch_size: int
  reference_batch_size: int
  learning_rate: float
  weight_decay: float
  b2: float
  ema_decay: float
  trust_coefficient: float = 1.0  # LARS / LAMB (not batch-dependent)
  reference: "Hyperparameters | None" = None  # the stated values (at the reference batch)

  @property
  def ratio(self) -> float:
    return self.batch_size / self.reference_batch_size

  def as_dict(self) -> dict:
    return {"batch_size": self.batch_size, "reference_batch_size": self.reference_batch_size,
            "learning_rate": self.learning_rate, "weight_decay": self.weight_decay,
            "b2": self.b2, "ema_decay": self.ema_decay,
            "trust_coefficient": self.trust_coefficient}


def derive(cfg, batch_size: int | None, reference_batch_size: int | None = None
           ) -> Hyperparameters:
  """Hyperparameters of the `optim` block `cfg` at a global batch of `batch_size` sequences.

  The reference batch is `cfg.reference_batch_size`, or `reference_batch_size` (the run's
  `data.global_batch_size`) when that is 0; with neither known, or `batch_size` None, k = 1.
  """
  ref = int(cfg.get("reference_batch_size", 0)) or reference_batch_size or batch_size
  batch = batch_size or ref
  given = {k: v for k, (v, _) in stated(cfg).items()}
  stated_hp = Hyperparameters(
      batch_size=ref or 1, reference_batch_size=ref or 1,
      learning_rate=given["learning_rate"], weight_decay=given["weight_decay"],
      b2=given["b2"], ema_decay=float(cfg.get("ema_decay", 0.0)),
      trust_coefficient=given["trust_coefficient"])
  if not ref or batch == ref:
    return dataclasses.replace(stated_hp, reference=stated_hp)
  k = batch / ref
  lr = stated_hp.learning_rate * lr_factor(cfg.get("lr_rule", "none"), k)
  return Hyperparameters(
      batch_size=batch, reference_batch_size=ref, learning_rate=lr,
      weight_decay=scaled_weight_decay(cfg.get("weight_decay_rule", "constant"),
                                       stated_hp.weight_decay, k, lr / stated_hp.learning_rate),
      b2=scaled_decay_rate(cfg.get("b2_rule", "constant"), stated_hp.b2, k),
      ema_decay=scaled_decay_rate(cfg.get("ema_rule", "constant"), stated_hp.ema_decay, k),
      trust_coefficient=stated_hp.trust_coefficient, reference=stated_hp)


def fallback_lr_ratio(cfg, hp: Hyperparameters) -> float:
  """Muon's fallback rate over its matrices' rate: `optim.muon.fallback_lr` / the stated
  `learning_rate` (1 when fallback_lr is 0, the shared rate). Both are stated at the reference
  batch and moved by the same `lr_rule` factor, so the ratio holds at every batch; times the
  schedule (same shape) and muP's / CompleteP's per-group multipliers."""
  fallback_lr = float(cfg.muon.get("fallback_lr", 0.0))
  return fallback_lr / (hp.reference or hp).learning_rate if fallback_lr > 0 else 1.0


def describe(cfg, hp: Hyperparameters) -> str:
  """One line: what the rules made of the stated values at this batch."""
  ref = hp.reference or hp
  head = (f"{cfg.name} hyperparameters at batch {hp.batch_size} (reference "
          f"{hp.reference_batch_size}, x{hp.ratio:.4g}):")
  source = stated(cfg)

  def item(name, rule, a, b, key=None):
    text = f"{name} {a:.4g}" if a == b else f"{name} {a:.4g} -> {b:.4g} ({rule})"
    if key is not None and source[key][1] == "default":
      text += f" [{_default_source(cfg, key)} default]"
    return text

  parts = [item("lr", cfg.get("lr_rule", "none"), ref.learning_rate, hp.learning_rate,
                "learning_rate"),
           item("weight_decay", cfg.get("weight_decay_rule", "constant"), ref.weight_decay,
                hp.weight_decay, "weight_decay")]
  owner = b2_owner(cfg)
  if owner in B2_OPTIMIZERS or owner == "lion":
    parts.append(item("b2", cfg.get("b2_rule", "constant"), ref.b2, hp.b2, "b2"))
  if cfg.name == "muon" and float(cfg.muon.get("fallback_lr", 0.0)) > 0:  # a rate of its own
    ratio = fallback_lr_ratio(cfg, hp)
    parts.append(item("fallback_lr", cfg.get("lr_rule", "none"), ratio * ref.learning_rate,
                      ratio * hp.learning_rate))
  if cfg.name in ("lamb", "lars"):
    parts.append(item("trust_coefficient", "", hp.trust_coefficient, hp.trust_coefficient,
                      "trust_coefficient"))
  if owner in B2_OPTIMIZERS:
    if hp.b2 < float(cfg.b1) ** 2:
      # |m / sqrt(v)| <= (1 - b1) / sqrt(1 - b2) * sum_k (b1 / sqrt(b2))^k: finite iff b1^2 < b2
      parts.append(f"WARNING b2 < b1^2 = {float(cfg.b1) ** 2:.4g}: Adam's per-step update "
                   "m / sqrt(v) is then unbounded; state a larger b2 at the reference batch")
  if hp.ema_decay:
    parts.append(item("ema_decay", cfg.get("ema_rule", "constant"), ref.ema_decay,
                      hp.ema_decay))
  return head + " " + ", ".join(parts)

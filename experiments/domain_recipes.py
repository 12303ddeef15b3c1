"""The recipes of issue 51's original-domains comparison: each optimizer as the paper that made it
runs it, stated at a reference batch and moved to the run's batch by its rule (optim/scaling.py).

vision (configs/mnist1d_resnet.py, label smoothing 0.1 on every arm, warmup in epochs):
  lars   MLPerf's ResNet: LARS (trust ratio and decay on the kernels only: optim/factory.py's
         masks), momentum 0.9, poly-2 decay to 0, rate linear in the batch
  sgd    Goyal et al. 2017: SGD + Nesterov momentum 0.9, L2 1e-4, rate 0.1 x B / 256, cosine
  adamw  AdamW, decay 0.05, rate sqrt in the batch, cosine
mlm (configs/mlm_tiny.py, warmup a fraction of the token budget):
  lamb   You et al. 2019: LAMB (Adam's bias-corrected moments, per-layer trust ratio over the
         scanned stack, norms and biases outside it), decay 0.01, linear (poly-1) decay to 0
  adamw  AdamW, decay 0.01, the same schedule
"""
from __future__ import annotations

import dataclasses


@dataclasses.dataclass(frozen=True)
class Task:
  config: str  # the base config
  metric: str  # the eval metric compared (higher better)
  optimizers: tuple[str, ...]
  baseline: str  # the arm every other is compared with, seed by seed
  batches: tuple[int, ...]
  reference_batch: int  # where the recipes state their rates


TASKS = {
    "vision": Task("configs/mnist1d_resnet.py", "eval_accuracy", ("lars", "sgd", "adamw"), "sgd",
                   (32, 128, 512, 1024, 2048, 4096), 256),
    "mlm": Task("configs/mlm_tiny.py", "eval_masked_accuracy", ("lamb", "adamw"), "adamw",
                (16, 64, 256, 1024), 32),
}

# (task, optimizer): (the optim keys at the reference batch, the lr rule). 0 / -1: the
# optimizer's own default (optim/scaling.py: lars 2.0 / 5e-4 / trust 1e-3, lamb 3e-2 / 0.01 /
# b2 0.999 / trust 1).
RECIPES = {
    ("vision", "lars"): (dict(name="lars", learning_rate=0.0, weight_decay=-1.0,
                              trust_coefficient=0.0, momentum=0.9, nesterov=False,
                              schedule="poly", poly_power=2.0), "linear"),
    ("vision", "sgd"): (dict(name="sgd", learning_rate=0.1, weight_decay=1e-4, momentum=0.9,
                             nesterov=True, schedule="cosine"), "linear"),
    ("vision", "adamw"): (dict(name="adamw", learning_rate=3e-3, weight_decay=0.05, b2=0.99,
                               schedule="cosine"), "sqrt"),
    ("mlm", "lamb"): (dict(name="lamb", learning_rate=0.0, weight_decay=-1.0, b2=0.0,
                           trust_coefficient=0.0, schedule="poly", poly_power=1.0), "sqrt"),
    ("mlm", "adamw"): (dict(name="adamw", learning_rate=3e-3, weight_decay=0.01, b2=0.99,
                            schedule="poly", poly_power=1.0), "sqrt"),
}
B2_TUNED = ("adamw",)  # b2 bracketed beside the rate (the others keep their recipe's)
LABEL_SMOOTHING = 0.1  # MLPerf's ResNet; on every vision arm, so the arms differ in optimizer


def apply(cfg, task: str, name: str, reference_batch: int, warmup_examples: int,
          b2="rule") -> None:
  """Set `cfg.optim` (and the vision label smoothing) to the recipe of `name` for `task`: its
  keys stated at `reference_batch`, its lr rule, warmup `warmup_examples` and a horizon of the
  run's examples (`cfg.steps` x batch, in examples), b2 fixed to `b2` unless 'rule'."""
  keys, rule = RECIPES[task, name]
  examples = cfg.steps * cfg.data.global_batch_size
  cfg.optim.update(**keys, reference_batch_size=reference_batch, lr_rule=rule,
                   b2_rule="constant", weight_decay_rule="constant", ema_decay=0.0,
                   min_lr_ratio=0.0, schedule_unit="examples", warmup_steps=0, warmup_tokens=0,
                   decay_steps=0, decay_tokens=0, warmup_examples=warmup_examples,
                   decay_examples=examples)
  if b2 != "rule":
    cfg.optim.b2 = float(b2)
  if task == "vision":
    cfg.model.resnet.label_smoothing = LABEL_SMOOTHING

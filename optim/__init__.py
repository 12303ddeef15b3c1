"""Optimizers (optax), schedules and batch-size-aware hyperparameter rules."""
from optim.factory import OPTIMIZERS, build_optimizer, masks
from optim.schedules import SCHEDULES, WSD_SHAPES, build_schedule

__all__ = ["OPTIMIZERS", "SCHEDULES", "WSD_SHAPES", "build_optimizer", "build_schedule", "masks"]

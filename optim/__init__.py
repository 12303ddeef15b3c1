"""Optimizers (optax), schedules, batch-size-aware hyperparameter rules, the batch-size ramp,
the gradient noise scale and the parameter EMA."""
from optim.factory import OPTIMIZERS, BatchSchedule, build_optimizer, masks
from optim.ramp import UNITS, BatchRamp, parse_ramp
from optim.scaling import B2_RULES, EMA_RULES, LR_RULES, WEIGHT_DECAY_RULES, derive
from optim.schedules import SCHEDULES, WSD_SHAPES, build_schedule

__all__ = ["B2_RULES", "EMA_RULES", "LR_RULES", "OPTIMIZERS", "SCHEDULES", "UNITS",
           "WEIGHT_DECAY_RULES", "WSD_SHAPES", "BatchRamp", "BatchSchedule", "build_optimizer",
           "build_schedule", "derive", "masks", "parse_ramp"]

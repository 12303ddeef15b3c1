"""A small 1-D ResNet with ghost batch norm: the vision workload's classifier (docs/vision.md).

  signal [B, L] -> stem conv -> `blocks` residual blocks (conv, BN, relu, conv, BN, + x, relu)
    -> global average pool over L -> linear head -> logits [B, classes]

Ghost batch norm (`GhostBatchNorm`, Hoffer et al. 2017): in training, statistics come from
fixed groups of `bn_group` examples, so the batch (and the micro-batch) never changes what an
example is normalised with. The running statistics are flax's `nnx.BatchStat` state, updated
with flax's momentum rule from the mean of the groups' statistics; the train step averages the
state each micro-batch leaves over the micro-batches (the rule is affine in the statistics, so
the result is one update over the whole step's groups). Evaluation uses the running statistics.
Parameters carry logical axis names (sharding/rules.py): channels as `embed` / `mlp`.
"""
from __future__ import annotations

import dataclasses

import jax
import jax.numpy as jnp
import numpy as np
import optax
from flax import nnx
from flax.nnx.nn.normalization import _compute_stats, _normalize

from models.conv import conv_general_dilated
from models.config import ModelConfig, ResNetOptions
from models.moe import MoEConfig

SIGNAL_LEN, CLASSES = 40, 10  # mnist1d's signals and digits


@dataclasses.dataclass(frozen=True)
class ResNetConfig(ResNetOptions):
  """The options of `model.resnet` (models/config.py) and what the trainer reads of every
  model's config: no MoE, width or depth scaling, or fp8."""
  classes: int = CLASSES
  moe: MoEConfig = MoEConfig()
  width_multiplier: float = 1.0
  depth_scaling: tuple | None = None
  fp8: bool = False
  num_layers: int = 1

  @classmethod
  def from_config(cls, m) -> "ResNetConfig":
    """From the `model` block of a run config."""
    return cls(**dataclasses.asdict(ModelConfig.from_config(m).resnet))


def row_group(cfg) -> int:
  """The rows a step keeps together when it splits a micro-batch (the noise meter's parts): a
  vision run's ghost batch-norm group (`model.resnet.bn_group`), else 1 (any row)."""
  return int(cfg.model.resnet.bn_group) if cfg.model.kind == "resnet1d" else 1


def batch_layout(seq_len: int) -> dict[str, tuple[int, type]]:
  """{key: (width, dtype)} of one example's row in a batch [M, B, width]."""
  del seq_len
  return {"inputs": (SIGNAL_LEN, np.float32), "targets": (1, np.int32), "loss_mask": (1, np.bool_)}


class GhostBatchNorm(nnx.BatchNorm):
  """nnx.BatchNorm over [B, L, C] whose training statistics are those of groups of `group`
  examples (B a multiple of it); eval (`use_running_average`) is flax's own."""

  def __init__(self, features: int, group: int, momentum: float, *, rngs: nnx.Rngs):
    super().__init__(features, momentum=momentum, rngs=rngs,
                     scale_init=_named(nnx.initializers.ones, ("norm",)),
                     bias_init=_named(nnx.initializers.zeros, ("norm",)))
    self.group = group

  def __call__(self, x_BLC, use_running_average: bool | None = None, *, mask=None):
    if use_running_average:
      return super().__call__(x_BLC, use_running_average=True)
    x_GgLC = x_BLC.reshape(-1, self.group, *x_BLC.shape[1:])
    mean_GC, var_GC = _compute_stats(x_GgLC, (1, 2), dtype=self.dtype,
                                     use_fast_variance=self.use_fast_variance)
    m = self.momentum
    self.mean[...] = jax.lax.stop_gradient(m * self.mean[...] + (1 - m) * mean_GC.mean(0))
    self.var[...] = jax.lax.stop_gradient(m * self.var[...] + (1 - m) * var_GC.mean(0))
    y = _normalize(x_GgLC, mean_GC, var_GC, self.scale[...], self.bias[...], (1, 2), (3,),
                   self.dtype, self.epsilon)
    return y.reshape(x_BLC.shape)


def _named(init, names):
  """`init` with logical axis names (sharding is applied by the trainer, as models/params.py)."""
  return nnx.with_partitioning(init, names, eager_sharding=False)


def _conv(cin: int, cout: int, kernel: int, names, rngs: nnx.Rngs) -> nnx.Conv:
  init = _named(nnx.initializers.kaiming_normal(), (None, *names))
  return nnx.Conv(cin, cout, (kernel,), padding="SAME", use_bias=False, kernel_init=init,
                  conv_general_dilated=conv_general_dilated, rngs=rngs)


class Block(nnx.Module):

  def __init__(self, c: int, cfg: ResNetConfig, rngs: nnx.Rngs):
    self.conv1 = _conv(c, c, cfg.kernel, ("embed", "mlp"), rngs)
    self.bn1 = GhostBatchNorm(c, cfg.bn_group, cfg.bn_momentum, rngs=rngs)
    self.conv2 = _conv(c, c, cfg.kernel, ("mlp", "embed"), rngs)
    self.bn2 = GhostBatchNorm(c, cfg.bn_group, cfg.bn_momentum, rngs=rngs)

  def __call__(self, x_BLC, train: bool):
    y = jax.nn.relu(self.bn1(self.conv1(x_BLC), use_running_average=not train))
    return jax.nn.relu(x_BLC + self.bn2(self.conv2(y), use_running_average=not train))


class ResNet1D(nnx.Module):

  def __init__(self, cfg: ResNetConfig, *, rngs: nnx.Rngs):
    self.cfg = cfg
    c = cfg.channels
    self.stem = _conv(1, c, cfg.kernel, (None, "embed"), rngs)
    self.stem_bn = GhostBatchNorm(c, cfg.bn_group, cfg.bn_momentum, rngs=rngs)
    self.blocks = nnx.List([Block(c, cfg, rngs) for _ in range(cfg.blocks)])
    self.head = nnx.Linear(c, cfg.classes, rngs=rngs, kernel_init=_named(
        nnx.initializers.lecun_normal(), ("embed", None)),
        bias_init=_named(nnx.initializers.zeros, (None,)))

  def __call__(self, signal_BL, *, train: bool):
    x = jax.nn.relu(self.stem_bn(self.stem(signal_BL[..., None]), use_running_average=not train))
    for block in self.blocks:
      x = block(x, train)
    return self.head(x.mean(axis=1))  # logits [B, classes]

  def sums(self, batch, *, train: bool):
    """(sum of the examples' cross-entropies, examples, examples classified right) over the
    real rows of `batch` (inputs [B, L], targets [B, 1], loss_mask [B, 1])."""
    logits = self(batch["inputs"], train=train).astype(jnp.float32)
    labels, real = batch["targets"][:, 0], batch["loss_mask"][:, 0]
    smooth = self.cfg.label_smoothing
    target = optax.smooth_labels(jax.nn.one_hot(labels, self.cfg.classes), smooth) \
        if smooth else jax.nn.one_hot(labels, self.cfg.classes)
    loss = optax.softmax_cross_entropy(logits, target)
    right = (jnp.argmax(logits, -1) == labels) & real
    return (jnp.sum(jnp.where(real, loss, 0.0)), jnp.sum(real.astype(jnp.float32)),
            jnp.sum(right.astype(jnp.float32)))


def flops_per_token(cfg: ResNetConfig) -> dict[str, float]:
  """Training FLOPs (forward + backward = 3 x the forward's 2 x multiply-adds) per "token", one
  of an example's SIGNAL_LEN samples: the loop counts data.seq_len = SIGNAL_LEN per example."""
  c, k, L = cfg.channels, cfg.kernel, SIGNAL_LEN
  forward = 2 * L * (k * c + 2 * cfg.blocks * k * c * c) + 2 * c * cfg.classes
  return {"total": 3.0 * forward / L}


def param_count(cfg: ResNetConfig) -> int:
  c, k = cfg.channels, cfg.kernel
  return k * c + 2 * c + cfg.blocks * 2 * (k * c * c + 2 * c) + c * cfg.classes + cfg.classes

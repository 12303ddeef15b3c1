"""The model's config (`ModelConfig`, the `model` block of a run config) and which of its fields
change the function a set of weights computes.

`FUNCTIONAL` and `NOT_FUNCTIONAL` classify every field (nested ones as `rope_scaling.factor`,
`moe.top_k`): a checkpoint resumed (trainer/checkpoint/persistent.py), warm-started from or evaluated
(trainer/checkpoint/model_dirs.py) under another value of a functional field would load -- the shapes may
agree -- and silently compute something else, so both refuse it, reading this one table. A
field that is in neither list fails tests/test_checkpoint.py: a new model key must be classified
when it is added.

Parametrization ("sp" / "mup", `base_width`; `depth_parametrization`, `base_depth`):
models/llama.py's module docstring.
"""
from __future__ import annotations

import dataclasses
from typing import Any

from models.moe import MoEConfig
from models.rope import RopeScaling

PARAMETRIZATIONS = ("sp", "mup")
# depth parametrization -> alpha, the exponent of the residual branches' (L_base / L)^alpha
# (Bordelon et al. 2023 and Yang et al. 2023: 1/2; CompleteP, Dey et al. 2025: 1)
DEPTH_PARAMETRIZATIONS = {"standard": None, "depth_mup": 0.5, "completep": 1.0}


@dataclasses.dataclass(frozen=True)
class ResNetOptions:
  """`model.resnet`: the vision workload's 1-D ResNet (models/resnet.py, docs/vision.md)."""
  channels: int = 32
  blocks: int = 3
  kernel: int = 5
  bn_group: int = 16  # examples per ghost batch-norm group
  bn_momentum: float = 0.9
  label_smoothing: float = 0.0  # MLPerf's ResNet: 0.1


@dataclasses.dataclass(frozen=True)
class ModelConfig:
  vocab_size: int = 512
  d_model: int = 128
  num_layers: int = 2
  num_heads: int = 4
  num_kv_heads: int = 2
  head_dim: int = 0  # 0: d_model // num_heads
  mlp_dim: int = 384
  rope_theta: float = 10_000.0
  norm_eps: float = 1e-5
  tie_embeddings: bool = False
  param_dtype: str = "float32"
  dtype: str = "float32"  # compute dtype of matmuls; norms, softmax and logits stay fp32
  fp8: bool = False  # the blocks' dense projections through fp8 (models/fp8.py)
  remat: str = "none"
  scan_unroll: int = 1  # layers per iteration of the layer scan (num_layers: fully unrolled)
  attention: str = "xla"
  causal: bool = True  # False: bidirectional attention (the masked-LM encoder, docs/mlm.md)
  ring_head_chunks: int = 1  # ring attention: one ring per chunk of kv heads (less in flight)
  logits_chunk: int = 0  # loss over this many positions at a time (0: the whole [B, S, V])
  init_std: float = 0.02
  parametrization: str = "sp"  # "sp" or "mup" (models/llama.py's module docstring)
  base_width: int = 0  # muP's base d_model (0: d_model itself, m = 1)
  depth_parametrization: str = "standard"  # "standard", "depth_mup" or "completep"
  base_depth: int = 0  # their base num_layers (0: num_layers itself, L / L_base = 1)
  rope_scaling: RopeScaling = RopeScaling()
  moe: MoEConfig = MoEConfig()  # mixture of experts (models/moe.py); num_experts 0 = dense
  kind: str = "transformer"  # or "resnet1d": the vision workload, of `resnet`'s options
  resnet: ResNetOptions = ResNetOptions()

  @classmethod
  def from_config(cls, cfg: Any) -> "ModelConfig":
    """From the `model` block of a run config (a ConfigDict or mapping; keys this version does
    not know, as in a config saved by another version, are left out)."""
    return _from_mapping(cls, cfg)

  def to_dict(self) -> dict:
    """The `model` block of a run config (plain JSON types)."""
    return dataclasses.asdict(self)

  @property
  def dim_per_head(self) -> int:
    return self.head_dim or self.d_model // self.num_heads

  @property
  def width_multiplier(self) -> float:
    """muP's m = d_model / base_width; 1.0 under SP (the optimizer divides the learning rate
    of hidden matrices by it, optim/factory.py)."""
    if self.parametrization != "mup" or not self.base_width:
      return 1.0
    return self.d_model / self.base_width

  @property
  def hidden_init_std(self) -> float:
    """Init std of hidden matrices: init_std, divided by sqrt(m) under muP."""
    m = self.width_multiplier
    return self.init_std if m == 1.0 else self.init_std / m ** 0.5

  @property
  def depth_scaling(self) -> tuple[float, float] | None:
    """(L / L_base, alpha) under a depth parametrization ("depth_mup", "completep"), None
    under "standard" (the optimizer's per-group rules, optim/factory.py)."""
    alpha = DEPTH_PARAMETRIZATIONS[self.depth_parametrization]
    if alpha is None:
      return None
    return (self.num_layers / self.base_depth if self.base_depth else 1.0), alpha

  @property
  def residual_multiplier(self) -> float:
    """Each residual branch's factor (L_base / L)^alpha; 1.0 under "standard" and at L_base."""
    scaling = self.depth_scaling
    if scaling is None or scaling[0] == 1.0:
      return 1.0
    return scaling[0] ** -scaling[1]

  @property
  def out_init_std(self) -> float:
    """Init std of the residual-output projections (wo, w_down): hidden_init_std /
    sqrt(2 L), with L the base depth under a depth parametrization (its init does not depend
    on depth: the branch multiplier does)."""
    depth = self.base_depth if self.depth_scaling and self.base_depth else self.num_layers
    return self.hidden_init_std / (2 * depth) ** 0.5

  @property
  def query_multiplier(self) -> float:
    """Factor on the queries turning the kernels' 1/sqrt(D) into muP's sqrt(D_base)/D."""
    if self.width_multiplier == 1.0 or self.head_dim:
      return 1.0
    base_head_dim = self.base_width / self.num_heads
    return (base_head_dim / self.dim_per_head) ** 0.5


def _from_mapping(cls, values: Any):
  """`cls` (a dataclass) from a mapping, nested dataclass fields from nested mappings."""
  values, out = dict(values), {}
  for f in dataclasses.fields(cls):
    if f.name not in values:
      continue
    value = values[f.name]
    if dataclasses.is_dataclass(f.default) and not isinstance(value, type(f.default)):
      value = _from_mapping(type(f.default), value)
    out[f.name] = value
  return cls(**out)


# ----------------------------------------------------------------------------------------------
# Which fields change what a set of weights computes (the module docstring).

FUNCTIONAL = (
    # the shapes, and what the weights mean
    "vocab_size", "d_model", "num_layers", "num_heads", "num_kv_heads", "head_dim", "mlp_dim",
    "tie_embeddings", "norm_eps",
    # which keys a query sees (a causal decoder or a bidirectional encoder)
    "causal",
    # positions: RoPE frequencies
    "rope_theta", "rope_scaling.type", "rope_scaling.factor", "rope_scaling.low_freq_factor",
    "rope_scaling.high_freq_factor", "rope_scaling.original_max_position_embeddings",
    # muP multiplies the LM head by 1/m and the queries by sqrt(D_base / D) (and sets the
    # learning rates of a resumed run's optimizer)
    "parametrization", "base_width",
    # the residual branches' (L_base / L)^alpha
    "depth_parametrization", "base_depth",
    # the experts and how tokens are routed to them
    "moe.num_experts", "moe.top_k", "moe.mlp_dim", "moe.every", "moe.shared_expert",
    # the vision workload's network (models/resnet.py)
    "kind", "resnet.channels", "resnet.blocks", "resnet.kernel",
)

NOT_FUNCTIONAL = {
    "param_dtype": "the precision the weights are stored in (a warm start casts them; a resume "
                   "still requires it, for the optimizer state: trainer/checkpoint/persistent.py)",
    "dtype": "the precision of the matmuls, not what they compute",
    "fp8": "the precision of the blocks' projections (fp8 with per-tensor scales), not what "
           "they compute",
    "remat": "what the backward pass recomputes instead of storing",
    "scan_unroll": "how the layer loop is compiled",
    "attention": "which implementation computes the same attention",
    "ring_head_chunks": "how ring attention splits its work",
    "logits_chunk": "how many positions the LM head and loss take at a time",
    "init_std": "the initialisation, which loaded weights replace",
    "moe.capacity_factor": "how many assignments a training step may drop (0: none, the "
                           "routed function itself)",
    "moe.router_z_loss": "a training loss coefficient",
    "moe.load_balance_loss": "a training loss coefficient",
    "moe.balance_scope": "over which tokens the balance loss is taken",
    "moe.impl": "which grouped matmul computes the same experts",
    "resnet.bn_group": "how many examples a training step's batch norm averages over (evaluation "
                       "uses the running statistics)",
    "resnet.bn_momentum": "how fast the running statistics follow the training batches",
    "resnet.label_smoothing": "a training objective's coefficient",
}


def field_names(cls=ModelConfig, prefix: str = "") -> list[str]:
  """Every field of `cls`, nested dataclasses' as dotted names (`moe.top_k`)."""
  out = []
  for f in dataclasses.fields(cls):
    default = f.default if f.default is not dataclasses.MISSING else None
    if dataclasses.is_dataclass(default):
      out += field_names(type(default), prefix + f.name + ".")
    else:
      out.append(prefix + f.name)
  return out


def _value(cfg: ModelConfig, dotted: str):
  for part in dotted.split("."):
    cfg = getattr(cfg, part)
  return cfg


def functional_values(cfg: ModelConfig) -> dict[str, Any]:
  """The FUNCTIONAL fields as the weights see them: with their defaults resolved (head_dim 0 =
  d_model / num_heads, moe.mlp_dim 0 = mlp_dim), and without those the others switch off (RoPE
  scaling parameters under type "none", expert fields of a dense model, muP at m = 1, which is
  SP bit for bit), so two configs of the same function give the same values."""
  values = {key: _value(cfg, key) for key in FUNCTIONAL}
  values["head_dim"] = cfg.dim_per_head
  if cfg.width_multiplier == 1.0:
    values.update(parametrization="sp", base_width=None)
  if cfg.residual_multiplier == 1.0:
    values.update(depth_parametrization="standard", base_depth=None)
  if cfg.rope_scaling.type == "none":
    values.update({k: None for k in values if k.startswith("rope_scaling.") and
                   k != "rope_scaling.type"})
  if cfg.moe.enabled:
    values["moe.mlp_dim"] = cfg.moe.expert_dim(cfg.mlp_dim)
  else:
    values.update({k: None for k in values if k.startswith("moe.") and k != "moe.num_experts"})
  return values


def functional_differences(saved: ModelConfig, config: ModelConfig) -> list[tuple[str, Any, Any]]:
  """[(field, saved value, config value)] of the FUNCTIONAL fields where two model configs
  compute different functions, in FUNCTIONAL's order (values as in `functional_values`)."""
  a, b = functional_values(saved), functional_values(config)
  out = [(key, a[key], b[key]) for key in FUNCTIONAL if a[key] != b[key]]
  if not out and saved.query_multiplier != config.query_multiplier:
    # muP off its base width: head_dim 0 scales the queries by sqrt(D_base / D), the same
    # head_dim stated explicitly does not (`ModelConfig.query_multiplier`)
    out.append(("head_dim", saved.head_dim, config.head_dim))
  return out


def overrides_to_match(differences: list[tuple[str, Any, Any]]) -> str:
  """The `--config.model.KEY=VALUE` overrides that give a config the saved side's values."""
  return " ".join(f"--config.model.{key}={saved}" for key, saved, _ in differences
                  if saved is not None)

"""Mixture-of-experts feed-forward layer: a fp32 top-k router and SwiGLU experts.

  router (fp32)  p = softmax(x W_r) [N]; the top-k experts e_j, weighted p_e / sum_j p_{e_j}
  experts        y = sum_j w_j SwiGLU_{e_j}(x), width `model.moe.mlp_dim`; tokens sorted by
                 expert, dropless or with a capacity (models/moe_dispatch.py)

Per layer it returns router statistics summed over its tokens (counts, prob_sum, z_sum,
entropy_sum, dropped, tokens); `aux_losses` turns them into the z-loss (mean of
logsumexp(logits)^2) and the balance loss N sum_i f_i P_i (1 when balanced), over the global
batch or per micro-batch (`balance_scope`). Why and details: docs/moe.md#auxiliary-losses
"""
from __future__ import annotations

import dataclasses
import math

import jax
import jax.numpy as jnp
from flax import nnx

from models.moe_dispatch import capacity_keep, expert_ffn, top_k_experts
from models.params import DTYPES, param
from sharding.rules import constrain

BALANCE_SCOPES = ("global", "micro_batch")
STAT_KEYS = ("counts", "prob_sum", "z_sum", "entropy_sum", "dropped", "tokens")


@dataclasses.dataclass(frozen=True)
class MoEConfig:
  """`model.moe.*` (documented in trainer/config/defaults.py, validated in trainer/config/parallel_checks.py)."""
  num_experts: int = 0  # 0: a dense model
  top_k: int = 2
  mlp_dim: int = 0  # width of each expert; 0: model.mlp_dim
  every: int = 1  # every n-th layer is MoE (layers n-1, 2n-1, ...); 1: all
  shared_expert: int = 0  # width of a dense SwiGLU beside the experts (every token's); 0: none
  capacity_factor: float = 0.0  # 0: dropless
  router_z_loss: float = 1e-3  # coefficient
  load_balance_loss: float = 1e-2  # coefficient
  balance_scope: str = "global"  # or "micro_batch"
  impl: str = "ragged_dot"  # dropless grouped matmul: "ragged_dot" or "megablox" (TPU kernel)

  @property
  def enabled(self) -> bool:
    return self.num_experts > 0

  def expert_dim(self, dense_mlp_dim: int) -> int:
    return self.mlp_dim or dense_mlp_dim

  def capacity(self, seq_len: int) -> int:
    """Assignments each expert takes per sequence (0: dropless)."""
    if not self.capacity_factor:
      return 0
    return max(1, math.ceil(self.capacity_factor * seq_len * self.top_k / self.num_experts))


class MoE(nnx.Module):
  """The routed experts of one layer (the shared expert, if any, is the block's `shared_mlp`).

  `cfg` is the model's `ModelConfig` (models/llama.py); its `moe` field configures this layer.
  Weights: router W_r [E, N] (fp32 always), experts w_gate/w_up [N, E, F], w_down [N, F, E]
  with logical axes ("experts", "embed", "expert_mlp"), mapped by `sharding/rules.py`.
  """

  def __init__(self, cfg, *, rngs: nnx.Rngs):
    self.cfg = cfg
    m = cfg.moe
    E, N, F = cfg.d_model, m.num_experts, m.expert_dim(cfg.mlp_dim)
    pdt = DTYPES[cfg.param_dtype]
    self.compute_dtype = DTYPES[cfg.dtype]
    init = nnx.initializers.normal(cfg.hidden_init_std)
    out_init = nnx.initializers.normal(cfg.out_init_std)
    self.w_router_EN = param(rngs, init, (E, N), ("embed", None), jnp.float32)
    self.w_gate_NEF = param(rngs, init, (N, E, F), ("experts", "embed", "expert_mlp"), pdt)
    self.w_up_NEF = param(rngs, init, (N, E, F), ("experts", "embed", "expert_mlp"), pdt)
    self.w_down_NFE = param(rngs, out_init, (N, F, E), ("experts", "expert_mlp", "embed"), pdt)

  def route(self, x_BSE):
    """(expert ids [B, S, k], combine weights [B, S, k] fp32, statistics) of the router."""
    m = self.cfg.moe
    N, K = m.num_experts, m.top_k
    logits_BSN = jnp.einsum("bse,en->bsn", x_BSE.astype(jnp.float32),
                            self.w_router_EN[...].astype(jnp.float32),
                            precision=jax.lax.Precision.HIGHEST)
    # pinned batch-sharded: unconstrained, XLA's partitioner gathers top_k's input everywhere
    logits_BSN = constrain(logits_BSN, ("act_batch", "act_seq", None))
    probs_BSN = jax.nn.softmax(logits_BSN, axis=-1)
    # The choice has no gradient; the chosen probabilities do, read by a one-hot product.
    experts_BSK = top_k_experts(probs_BSN, K)
    top_p_BSK = jnp.einsum("bsn,bskn->bsk", probs_BSN,
                           jax.nn.one_hot(experts_BSK, N, dtype=probs_BSN.dtype),
                           precision=jax.lax.Precision.HIGHEST)
    weights_BSK = top_p_BSK / jnp.sum(top_p_BSK, axis=-1, keepdims=True)
    B, S = x_BSE.shape[:2]
    counts_N = jnp.sum(jax.nn.one_hot(experts_BSK, N, dtype=jnp.float32), axis=(0, 1, 2))
    capacity = m.capacity(S)
    if capacity:
      keep_BSK = capacity_keep(experts_BSK, N, capacity)
      experts_BSK = jnp.where(keep_BSK, experts_BSK, N)  # N: dropped (routed nowhere)
      weights_BSK = jnp.where(keep_BSK, weights_BSK, 0.0)
      dropped = jnp.sum(~keep_BSK).astype(jnp.float32)
    else:
      dropped = jnp.zeros((), jnp.float32)
    lse_BS = jax.nn.logsumexp(logits_BSN, axis=-1)
    sg_probs = jax.lax.stop_gradient(probs_BSN)
    stats = {
        "counts": counts_N,
        "prob_sum": jnp.sum(probs_BSN, axis=(0, 1)),
        "z_sum": jnp.sum(lse_BS * lse_BS),
        "entropy_sum": -jnp.sum(sg_probs * jnp.log(jnp.maximum(sg_probs, 1e-30))),
        "dropped": dropped,
        "tokens": jnp.asarray(B * S, jnp.float32),
    }
    return experts_BSK, weights_BSK, stats

  def __call__(self, x_BSE):
    """x [B, S, E] -> (y [B, S, E] in the compute dtype, statistics)."""
    experts_BSK, weights_BSK, stats = self.route(x_BSE)
    dt = self.compute_dtype
    y_BSE = expert_ffn(x_BSE.astype(dt), experts_BSK, weights_BSK,
                       self.w_gate_NEF[...].astype(dt), self.w_up_NEF[...].astype(dt),
                       self.w_down_NFE[...].astype(dt),
                       capacity=self.cfg.moe.capacity(x_BSE.shape[1]), impl=self.cfg.moe.impl)
    return y_BSE, stats


def aux_losses(stats, moe: MoEConfig, *, num_micro: int = 1, fraction=None):
  """This micro-batch's share of the auxiliary losses: {"balance", "z"}, each a scalar whose sum
  over the step's `num_micro` equal micro-batches is the step's loss (averaged over MoE layers).

  `stats`: this micro-batch's statistics, each with a leading MoE-layer axis [G, ...].
  `fraction` [G, N]: f of the global batch (no gradient), needed for `balance_scope="global"`
  with num_micro > 1 (the trainer's pre-pass); with num_micro = 1 the micro-batch is the global
  batch and f comes from `stats` itself.
  """
  N, K = moe.num_experts, moe.top_k
  tokens = stats["tokens"]  # [G], equal across layers
  all_tokens = tokens * num_micro
  z = jnp.mean(stats["z_sum"] / all_tokens)
  own_f = stats["counts"] / (K * tokens[:, None])
  if moe.balance_scope == "micro_batch" or num_micro == 1:
    per_layer = N * jnp.sum(own_f * stats["prob_sum"] / tokens[:, None], axis=-1)
    balance = jnp.mean(per_layer) / num_micro
  else:
    if fraction is None:
      raise ValueError("balance_scope='global' with accumulation needs the global fraction")
    per_layer = N * jnp.sum(jax.lax.stop_gradient(fraction) * stats["prob_sum"], axis=-1)
    balance = jnp.mean(per_layer / all_tokens)
  return {"balance": balance, "z": z}


def zero_sums(moe: MoEConfig, num_layers: int) -> dict:
  """Zeros shaped like the {"stats", "aux"} a step sums over its micro-batches."""
  z = jnp.zeros((num_layers,), jnp.float32)
  zn = jnp.zeros((num_layers, moe.num_experts), jnp.float32)
  stats = {k: zn if k in ("counts", "prob_sum") else z for k in STAT_KEYS}
  return {"stats": stats, "aux": {"balance": jnp.zeros(()), "z": jnp.zeros(())}}


def aux_objective(aux, moe: MoEConfig):
  """The weighted sum of the auxiliary losses that is added to the (mean) training loss."""
  return moe.load_balance_loss * aux["balance"] + moe.router_z_loss * aux["z"]


def metrics(stats, aux, moe: MoEConfig, *, layer_ids) -> dict:
  """Scalars for metrics.jsonl from the step's summed statistics [G, ...] and aux losses.

  moe/aux_loss: what the auxiliary losses add to the objective (weighted by their coefficients);
  moe/balance_loss, moe/z_loss: the step's auxiliary losses (unweighted);
  moe/load_max: max over MoE layers of (largest expert's share / mean share), 1 = balanced;
  moe/dropped: fraction of assignments dropped by the capacity, all layers;
  moe/entropy: mean router entropy in nats (log N = uniform);
  per MoE layer l (model layer index): moe/L{l}/load_max, moe/L{l}/load_min (share / mean),
  moe/L{l}/dropped, moe/L{l}/entropy, and moe/L{l}/load/E{i}, expert i's share of assignments.
  """
  N, K = moe.num_experts, moe.top_k
  tokens = stats["tokens"]
  share = stats["counts"] / jnp.maximum(K * tokens[:, None], 1.0)  # [G, N], rows sum to 1
  rel = share * N
  dropped = stats["dropped"] / jnp.maximum(K * tokens, 1.0)
  entropy = stats["entropy_sum"] / jnp.maximum(tokens, 1.0)
  out = {"moe/aux_loss": aux_objective(aux, moe),
         "moe/balance_loss": aux["balance"], "moe/z_loss": aux["z"],
         "moe/load_max": jnp.max(rel), "moe/dropped": jnp.mean(dropped),
         "moe/entropy": jnp.mean(entropy)}
  for g, layer in enumerate(layer_ids):
    out[f"moe/L{layer}/load_max"] = jnp.max(rel[g])
    out[f"moe/L{layer}/load_min"] = jnp.min(rel[g])
    out[f"moe/L{layer}/dropped"] = dropped[g]
    out[f"moe/L{layer}/entropy"] = entropy[g]
    for i in range(N):
      out[f"moe/L{layer}/load/E{i}"] = share[g, i]
  return out

"""Parameter counts and training FLOPs per token of a `ModelConfig`: the model's own count, which
MFU, the roofline of `tools.aot` and the run's start-up report read (a ResNet's per signal
sample: models/resnet.py)."""
from __future__ import annotations

from models import resnet
from models.llama import ModelConfig, moe_layer_ids


def _ffn_params(cfg: ModelConfig) -> tuple[int, int]:
  """(feed-forward parameters of all layers, of them those one token uses): the dense MLPs, and
  of each MoE layer the router, the shared expert and all experts (active: top_k of them)."""
  E, F, L, moe = cfg.d_model, cfg.mlp_dim, cfg.num_layers, cfg.moe
  if not moe.enabled:
    return L * 3 * E * F, L * 3 * E * F
  n_moe = len(moe_layer_ids(cfg))
  dense = (L - n_moe) * 3 * E * F
  common = E * moe.num_experts + 3 * E * moe.shared_expert  # router, shared expert
  expert = 3 * E * moe.expert_dim(F)
  return (dense + n_moe * (common + moe.num_experts * expert),
          dense + n_moe * (common + moe.top_k * expert))


def param_counts(cfg: ModelConfig) -> dict[str, int]:
  """Parameter counts: total, embedding (input table), non-embedding, and active (what one token
  uses: an MoE layer's top_k experts of num_experts; = total for a dense model)."""
  if isinstance(cfg, resnet.ResNetConfig):  # the vision workload: a "token" is an example
    n = resnet.param_count(cfg)
    return {"total": n, "embedding": 0, "non_embedding": n, "active": n}
  E, H, K, D, V, L = (cfg.d_model, cfg.num_heads, cfg.num_kv_heads, cfg.dim_per_head,
                      cfg.vocab_size, cfg.num_layers)
  ffn, ffn_active = _ffn_params(cfg)
  per_layer = E * H * D + 2 * E * K * D + H * D * E + 2 * E
  head = 0 if cfg.tie_embeddings else E * V
  embedding = V * E
  total = embedding + L * per_layer + ffn + E + head
  return {"total": total, "embedding": embedding, "non_embedding": total - embedding,
          "active": total - ffn + ffn_active}


def flops_per_token(cfg: ModelConfig, seq_len: int, *, causal: bool = True) -> dict[str, float]:
  """Training FLOPs per token (forward + backward = 3x forward), by part.

  - matmuls: 6 x (parameters that take part in a matmul): q, k, v, o, the three MLP matrices and
    the logits projection (the input embedding is a gather, not counted); of an MoE layer the
    router, the shared expert and top_k experts (the active parameters, `param_counts`);
  - attention: QK^T and AV, each 2 x S x H x D per token forward; times 3 for training. With
    `causal=True` we count only the unmasked half (the work a causal kernel needs), so
    6 x L x S x H x D; `causal=False` gives the full 12 x L x S x H x D (PaLM's convention).
  Rematerialisation is *not* counted: this is model FLOPs, so MFU stays comparable across remat
  policies.
  """
  if isinstance(cfg, resnet.ResNetConfig):
    return resnet.flops_per_token(cfg)
  E, H, K, D, V, L = (cfg.d_model, cfg.num_heads, cfg.num_kv_heads, cfg.dim_per_head,
                      cfg.vocab_size, cfg.num_layers)
  matmul_params = L * (E * H * D + 2 * E * K * D + H * D * E) + _ffn_params(cfg)[1] + E * V
  matmuls = 6.0 * matmul_params
  attn = 12.0 * L * seq_len * H * D * (0.5 if causal else 1.0)
  return {"matmuls": matmuls, "attention": attn, "total": matmuls + attn}

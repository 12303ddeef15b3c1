"""Flax NNX models. Every parameter carries logical axis names (see sharding/rules.py)."""
from models.llama import ATTENTION_IMPLS, REMAT_POLICIES, ModelConfig, Transformer
from models.sizes import flops_per_token, param_counts

__all__ = ["ATTENTION_IMPLS", "REMAT_POLICIES", "ModelConfig", "Transformer", "flops_per_token",
           "param_counts"]

"""Autoregressive decoding with a KV cache: one compiled prefill, one compiled decode step.

The cache holds every layer's keys and values, [L, B, S_max, K, D] each, laid out by the same
rule table as training activations (batch over the batch axes when it divides, kv heads over
`tensor`). Prompts of different lengths are right-padded: row b's prompt fills cache slots
0..len_b-1 and its n-th new token goes to slot len_b + n, so every row decodes at its own
position. A query at position p attends the slots <= p; padding slots past a prompt are
overwritten by that row's new tokens before anything attends them.

`forward_with_cache` is the model run over [B, T] new tokens at given positions: it writes
their keys/values into the cache and attends over the whole cache (prefill: T = prompt length,
decode: T = 1). It reuses the model's own modules (norms, MLP, q/k/v projections with RoPE,
output projection, LM head), so generation and training cannot drift apart.
"""
from __future__ import annotations

import functools
import math

import jax
import jax.numpy as jnp
import numpy as np
from flax import nnx
from jax.sharding import NamedSharding
from jax.sharding import PartitionSpec as P

from models.llama import DTYPES, ModelConfig, Transformer, branch
from sharding.rules import BATCH_AXES


def cache_sharding(mesh, batch: int, num_kv_heads: int) -> NamedSharding:
  """[L, B, S, K, D]: batch over the mesh's batch axes if they divide it, kv heads over
  `tensor` if it divides them; replicated otherwise."""
  batch_axes = tuple(a for a in BATCH_AXES if mesh.shape.get(a, 1) > 1)
  n = math.prod(mesh.shape[a] for a in batch_axes)
  b = (batch_axes if len(batch_axes) > 1 else batch_axes[0]) if batch_axes and batch % n == 0 \
      else None
  t = mesh.shape.get("tensor", 1)
  k = "tensor" if t > 1 and num_kv_heads % t == 0 else None
  return NamedSharding(mesh, P(None, b, None, k, None))


def init_cache(cfg: ModelConfig, batch: int, max_len: int) -> dict[str, jax.Array]:
  shape = (cfg.num_layers, batch, max_len, cfg.num_kv_heads, cfg.dim_per_head)
  dt = DTYPES[cfg.dtype]
  return {"k": jnp.zeros(shape, dt), "v": jnp.zeros(shape, dt)}


def forward_with_cache(model: Transformer, tokens_BT, positions_BT, cache):
  """(fp32 logits [B, T, V], updated cache) for new tokens at `positions_BT` (= cache slots)."""
  if model.cfg.moe.enabled:
    raise ValueError(f"KV-cache decoding supports dense models only; this model has "
                     f"model.moe.num_experts={model.cfg.moe.num_experts}")
  B, T = tokens_BT.shape
  S = cache["k"].shape[2]
  rows_B1 = jnp.arange(B)[:, None]
  mask_B1TS = (jnp.arange(S)[None, None, :] <= positions_BT[:, :, None])[:, None]
  graphdef, block_state = nnx.split(model.blocks)

  def layer(x_BTE, xs):
    state, k_BSKD, v_BSKD = xs
    block = nnx.merge(graphdef, state)
    q_BTHD, k_BTKD, v_BTKD = block.attn.qkv(block.attn_norm(x_BTE), positions_BT)
    k_BSKD = k_BSKD.at[rows_B1, positions_BT].set(k_BTKD.astype(k_BSKD.dtype))
    v_BSKD = v_BSKD.at[rows_B1, positions_BT].set(v_BTKD.astype(v_BSKD.dtype))
    out_BTHD = jax.nn.dot_product_attention(q_BTHD, k_BSKD.astype(q_BTHD.dtype),
                                            v_BSKD.astype(q_BTHD.dtype), mask=mask_B1TS,
                                            implementation="xla")
    x_BTE = x_BTE + branch(model.cfg, block.attn.out(out_BTHD))
    x_BTE = x_BTE + branch(model.cfg, block.mlp(block.mlp_norm(x_BTE)))
    return x_BTE, (k_BSKD, v_BSKD)

  x_BTE = model.embed(tokens_BT)
  x_BTE, (k, v) = jax.lax.scan(layer, x_BTE, (block_state, cache["k"], cache["v"]))
  return model.logits(model.final_norm(x_BTE)), {"k": k, "v": v}


def sample(logits_BV, key, *, temperature: float, top_k: int = 0, top_p: float = 1.0):
  """Next tokens [B]: greedy at temperature 0, else sampled from softmax(logits / T) restricted
  to the top_k tokens (0 = all) and to the smallest set whose probability reaches top_p."""
  if temperature == 0:
    return jnp.argmax(logits_BV, axis=-1).astype(jnp.int32)
  logits_BV = logits_BV.astype(jnp.float32) / temperature
  if top_k > 0:
    kth_B1 = jax.lax.top_k(logits_BV, top_k)[0][:, -1:]
    logits_BV = jnp.where(logits_BV < kth_B1, -jnp.inf, logits_BV)
  if top_p < 1.0:
    sorted_BV = jnp.sort(logits_BV, axis=-1)[:, ::-1]
    probs_BV = jax.nn.softmax(sorted_BV, axis=-1)
    before_BV = jnp.cumsum(probs_BV, axis=-1) - probs_BV  # mass of the more likely tokens
    cutoff_B1 = jnp.min(jnp.where(before_BV < top_p, sorted_BV, jnp.inf), axis=-1,
                        keepdims=True)
    logits_BV = jnp.where(logits_BV < cutoff_B1, -jnp.inf, logits_BV)
  return jax.random.categorical(key, logits_BV, axis=-1).astype(jnp.int32)


class Generator:
  """Compiled prefill + decode step for one model on one mesh; `generate` runs a batch."""

  def __init__(self, spec, params, *, temperature: float = 0.0, top_k: int = 0,
               top_p: float = 1.0):
    if not spec.cfg.causal:
      raise ValueError("model.causal=False: a bidirectional (masked-LM) encoder does not "
                       "generate text token by token")
    self.spec, self.params, self.mesh = spec, params, spec.mesh
    sampler = functools.partial(sample, temperature=temperature, top_k=top_k, top_p=top_p)

    def prefill(params, cache, tokens_BP, lengths_B, key):
      positions_BP = jnp.broadcast_to(jnp.arange(tokens_BP.shape[1]), tokens_BP.shape)
      logits_BPV, cache = forward_with_cache(spec.model(params), tokens_BP, positions_BP, cache)
      last_BV = jnp.take_along_axis(logits_BPV, (lengths_B - 1)[:, None, None], axis=1)[:, 0]
      return cache, sampler(last_BV, key)

    def decode(params, cache, tokens_B, positions_B, key):
      logits_B1V, cache = forward_with_cache(spec.model(params), tokens_B[:, None],
                                             positions_B[:, None], cache)
      return cache, sampler(logits_B1V[:, 0], key)

    self._prefill = jax.jit(prefill, donate_argnums=1)
    self._decode = jax.jit(decode, donate_argnums=1)

  def generate(self, prompts: list[list[int]], max_new_tokens: int, *, seed: int = 0,
               eos_id: int | None = None) -> list[list[int]]:
    """New token ids for each prompt (up to max_new_tokens; a row ends after eos_id)."""
    if not prompts or any(len(p) == 0 for p in prompts):
      raise ValueError("every prompt needs at least one token")
    B, P_len = len(prompts), max(len(p) for p in prompts)
    tokens_BP = np.zeros((B, P_len), np.int32)
    for b, p in enumerate(prompts):
      tokens_BP[b, :len(p)] = p
    lengths_B = np.array([len(p) for p in prompts], np.int32)
    cfg = self.spec.cfg
    sharding = cache_sharding(self.mesh, B, cfg.num_kv_heads)
    key = jax.random.key(seed)
    with jax.set_mesh(self.mesh):
      cache = jax.jit(lambda: init_cache(cfg, B, P_len + max_new_tokens),
                      out_shardings={"k": sharding, "v": sharding})()
      cache, tok_B = self._prefill(self.params, cache, tokens_BP, lengths_B,
                                   jax.random.fold_in(key, 0))
      out, done = [[] for _ in range(B)], np.zeros(B, bool)
      for n in range(max_new_tokens):
        host_B = np.asarray(jax.device_get(tok_B))
        for b in range(B):
          if not done[b]:
            out[b].append(int(host_B[b]))
            done[b] = eos_id is not None and host_B[b] == eos_id
        if done.all() or n + 1 == max_new_tokens:
          break
        cache, tok_B = self._decode(self.params, cache, tok_B, jnp.asarray(lengths_B + n),
                                    jax.random.fold_in(key, n + 1))
    return out

"""A Llama-style decoder-only transformer in Flax NNX.

  tokens -> embed -> L x [x + attention(RMSNorm(x)), then x + SwiGLU(RMSNorm(x))] -> RMSNorm
         -> head -> logits (or the chunked loss, models/cross_entropy.py)

Attention is grouped-query with RoPE. The layers are created stacked (`nnx.vmap`) and run with
`nnx.scan`, so compile time does not grow with depth; with MoE the scan repeats groups of
`moe.every` layers (`MoEGroup`: dense blocks, then an `MoEBlock`). Parameters carry logical axis
names (sharding/rules.py); activations are constrained at block boundaries. Shape suffixes:
B batch, S sequence, E embed (d_model), H query heads, K kv heads, D head dim, F mlp width,
V vocab, L layers.
Parametrization: "sp" (wo, w_down N(0, init_std^2 / 2L), the rest N(0, init_std^2)) or "mup"
(m = d_model / base_width: hidden init / sqrt(m), Adam lr / m, head x 1/m, attention 1/D); depth
("depth_mup", "completep"): each residual branch x (base_depth / L)^alpha (`branch`), wo / w_down
at the base depth's init. At the base sizes both are SP bit for bit. Details: docs/mup.md
"""
from __future__ import annotations

import dataclasses
import math

import jax
import jax.numpy as jnp
import optax
from flax import nnx

from models import weight_grad
from models.attention import IMPLS, attention, layer_segments, sequence_layout
from models.config import ModelConfig
from models.cross_entropy import chunked_cross_entropy
from models.fp8 import fp8_matmul
from models.moe import MoE
from models.params import DTYPES, param
from models.rope import apply_rope, rope_tables
from sharding.mesh import mesh_platform
from sharding.rules import constrain
from sharding.zigzag import zigzag

REMAT_POLICIES = {
    "none": None,  # no rematerialisation: keep every activation
    "full": jax.checkpoint_policies.nothing_saveable,  # recompute the whole block
    "dots": jax.checkpoint_policies.checkpoint_dots,  # keep matmul outputs
    "dots_no_batch": jax.checkpoint_policies.checkpoint_dots_with_no_batch_dims,
}
ATTENTION_IMPLS = IMPLS  # xla, flash, splash, ring, auto: see models/attention.py


class RMSNorm(nnx.Module):

  def __init__(self, dim: int, cfg: ModelConfig, *, rngs: nnx.Rngs):
    self.eps = cfg.norm_eps
    self.scale = param(rngs, nnx.initializers.ones, (dim,), ("norm",), DTYPES[cfg.param_dtype])

  def __call__(self, x):
    x32 = x.astype(jnp.float32)
    x32 = x32 * jax.lax.rsqrt(jnp.mean(x32 * x32, axis=-1, keepdims=True) + self.eps)
    return (x32 * self.scale[...].astype(jnp.float32)).astype(x.dtype)


def dense(x, w, contract: int, fp8: bool = False):
  """x [B, S, *in] times w [*in, *out] (w's first `contract` axes against x's last ones) ->
  [B, S, *out], as one 2-D matmul [B*S, prod(in)] x [prod(in), prod(out)]: the einsum's
  product, but the weight gradient then contracts one token axis, not two (b, s), which XLA's
  CPU backend compiled with extra transposes (SwiGLU MLP forward + backward 1.45x faster).
  The reshapes merge adjacent axes only: free, and the parameters keep their layout.
  fp8: the matmul through fp8 with per-tensor scales (`model.fp8`, models/fp8.py)."""
  lead, ins, outs = x.shape[:-contract], w.shape[:contract], w.shape[contract:]
  n_in = math.prod(ins)
  matmul = fp8_matmul if fp8 else jnp.dot
  y = weight_grad.matmul(matmul, x.reshape(-1, n_in), w.reshape(n_in, -1), x)
  return y.reshape(*lead, *outs)


class Attention(nnx.Module):

  def __init__(self, cfg: ModelConfig, *, rngs: nnx.Rngs):
    self.cfg = cfg
    E, H, K, D = cfg.d_model, cfg.num_heads, cfg.num_kv_heads, cfg.dim_per_head
    pdt = DTYPES[cfg.param_dtype]
    init = nnx.initializers.normal(cfg.hidden_init_std)
    out_init = nnx.initializers.normal(cfg.out_init_std)
    self.wq_EHD = param(rngs, init, (E, H, D), ("embed", "heads", "head_dim"), pdt)
    self.wk_EKD = param(rngs, init, (E, K, D), ("embed", "kv_heads", "head_dim"), pdt)
    self.wv_EKD = param(rngs, init, (E, K, D), ("embed", "kv_heads", "head_dim"), pdt)
    self.wo_HDE = param(rngs, out_init, (H, D, E), ("heads", "head_dim", "embed"), pdt)

  def qkv(self, x_BSE, positions_BS):
    """Queries, keys (both rotated) and values of x; positions [B, S] or their `rope_tables`.
    Also used by decoding (models/decode.py)."""
    cfg = self.cfg
    dt = DTYPES[cfg.dtype]
    x_BSE = x_BSE.astype(dt)
    q_BSHD = dense(x_BSE, self.wq_EHD[...].astype(dt), 1, cfg.fp8)
    if cfg.query_multiplier != 1.0:  # muP's 1/D attention (module docstring)
      q_BSHD = q_BSHD * jnp.asarray(cfg.query_multiplier, dt)
    k_BSKD = dense(x_BSE, self.wk_EKD[...].astype(dt), 1, cfg.fp8)
    v_BSKD = dense(x_BSE, self.wv_EKD[...].astype(dt), 1, cfg.fp8)
    q_BSHD = constrain(apply_rope(q_BSHD, positions_BS, cfg.rope_theta, cfg.rope_scaling),
                       ("act_batch", "act_seq", "act_heads", "act_head_dim"))
    k_BSKD = constrain(apply_rope(k_BSKD, positions_BS, cfg.rope_theta, cfg.rope_scaling),
                       ("act_batch", "act_seq", "act_kv_heads", "act_head_dim"))
    v_BSKD = constrain(v_BSKD, ("act_batch", "act_seq", "act_kv_heads", "act_head_dim"))
    return q_BSHD, k_BSKD, v_BSKD

  def out(self, out_BSHD):
    dt = DTYPES[self.cfg.dtype]
    return dense(out_BSHD, self.wo_HDE[...].astype(dt), 2, self.cfg.fp8)

  def __call__(self, x_BSE, positions_BS, segment_ids_BS):
    cfg = self.cfg
    q_BSHD, k_BSKD, v_BSKD = self.qkv(x_BSE, positions_BS)
    out_BSHD = attention(q_BSHD, k_BSKD, v_BSKD, segment_ids=segment_ids_BS, causal=cfg.causal,
                         impl=cfg.attention,
                         layout=sequence_layout(cfg.attention, causal=cfg.causal),
                         ring_head_chunks=cfg.ring_head_chunks)
    return self.out(out_BSHD)


class MLP(nnx.Module):
  """SwiGLU feed-forward (Shazeer 2020)."""

  def __init__(self, cfg: ModelConfig, *, rngs: nnx.Rngs):
    self.cfg = cfg
    E, F = cfg.d_model, cfg.mlp_dim
    pdt = DTYPES[cfg.param_dtype]
    init = nnx.initializers.normal(cfg.hidden_init_std)
    out_init = nnx.initializers.normal(cfg.out_init_std)
    self.w_gate_EF = param(rngs, init, (E, F), ("embed", "mlp"), pdt)
    self.w_up_EF = param(rngs, init, (E, F), ("embed", "mlp"), pdt)
    self.w_down_FE = param(rngs, out_init, (F, E), ("mlp", "embed"), pdt)

  def __call__(self, x_BSE):
    dt, fp8 = DTYPES[self.cfg.dtype], self.cfg.fp8
    x_BSE = x_BSE.astype(dt)
    gate_BSF = dense(x_BSE, self.w_gate_EF[...].astype(dt), 1, fp8)
    up_BSF = dense(x_BSE, self.w_up_EF[...].astype(dt), 1, fp8)
    h_BSF = constrain(jax.nn.silu(gate_BSF) * up_BSF, ("act_batch", "act_seq", "act_mlp"))
    return dense(h_BSF, self.w_down_FE[...].astype(dt), 1, fp8)


def branch(cfg: ModelConfig, y_BSE):
  """A residual branch's output as added to the stream: times the depth parametrization's
  (L_base / L)^alpha (`ModelConfig.residual_multiplier`), untouched when that is 1."""
  r = cfg.residual_multiplier
  return y_BSE if r == 1.0 else y_BSE * jnp.asarray(r, y_BSE.dtype)


class Block(nnx.Module):

  def __init__(self, cfg: ModelConfig, *, rngs: nnx.Rngs):
    self.cfg = cfg
    self.attn_norm = RMSNorm(cfg.d_model, cfg, rngs=rngs)
    self.attn = Attention(cfg, rngs=rngs)
    self.mlp_norm = RMSNorm(cfg.d_model, cfg, rngs=rngs)
    self.mlp = MLP(cfg, rngs=rngs)

  def __call__(self, x_BSE, positions_BS, segment_ids_BS):
    cfg = self.cfg
    x_BSE = x_BSE + branch(cfg, self.attn(self.attn_norm(x_BSE), positions_BS, segment_ids_BS))
    x_BSE = x_BSE + branch(cfg, self.mlp(self.mlp_norm(x_BSE)))
    return constrain(x_BSE, ("act_batch", "act_seq", "act_embed"))


class MoEBlock(nnx.Module):
  """A block whose MLP is a mixture of experts (models/moe.py), plus an optional shared expert
  (a dense SwiGLU every token goes through). Returns (x, router statistics)."""

  def __init__(self, cfg: ModelConfig, *, rngs: nnx.Rngs):
    self.cfg = cfg
    self.attn_norm = RMSNorm(cfg.d_model, cfg, rngs=rngs)
    self.attn = Attention(cfg, rngs=rngs)
    self.mlp_norm = RMSNorm(cfg.d_model, cfg, rngs=rngs)
    self.moe = MoE(cfg, rngs=rngs)
    shared = cfg.moe.shared_expert
    self.shared_mlp = MLP(dataclasses.replace(cfg, mlp_dim=shared), rngs=rngs) if shared else None

  def __call__(self, x_BSE, positions_BS, segment_ids_BS):
    x_BSE = x_BSE + branch(self.cfg, self.attn(self.attn_norm(x_BSE), positions_BS,
                                               segment_ids_BS))
    h_BSE = self.mlp_norm(x_BSE)
    y_BSE, stats = self.moe(h_BSE)
    if self.shared_mlp is not None:
      y_BSE = y_BSE + self.shared_mlp(h_BSE)
    x_BSE = x_BSE + branch(self.cfg, y_BSE)
    return constrain(x_BSE, ("act_batch", "act_seq", "act_embed")), stats


class MoEGroup(nnx.Module):
  """`model.moe.every` consecutive layers, the unit the layer scan repeats: every - 1 dense
  blocks (`dense0`, ...) then one MoE block (`moe`), so model layer i is MoE when
  (i + 1) % every == 0. Returns (x, the MoE block's statistics)."""

  def __init__(self, cfg: ModelConfig, *, rngs: nnx.Rngs):
    self.num_dense = cfg.moe.every - 1
    for i in range(self.num_dense):
      setattr(self, f"dense{i}", Block(cfg, rngs=rngs))
    self.moe = MoEBlock(cfg, rngs=rngs)

  def __call__(self, x_BSE, positions_BS, segment_ids_BS):
    for i in range(self.num_dense):
      x_BSE = getattr(self, f"dense{i}")(x_BSE, positions_BS, segment_ids_BS)
    return self.moe(x_BSE, positions_BS, segment_ids_BS)


def moe_layer_ids(cfg: ModelConfig) -> list[int]:
  """Model layer indices of the MoE layers (the order of the statistics' leading axis)."""
  every = cfg.moe.every
  return [i for i in range(cfg.num_layers) if cfg.moe.enabled and (i + 1) % every == 0]


class Transformer(nnx.Module):
  """tokens [B, S] (+ positions, segment ids for packed documents) -> fp32 logits [B, S, V]."""

  def __init__(self, cfg: ModelConfig, *, rngs: nnx.Rngs):
    self.cfg = cfg
    pdt = DTYPES[cfg.param_dtype]
    self.embed_VE = param(rngs, nnx.initializers.normal(cfg.init_std),
                           (cfg.vocab_size, cfg.d_model), ("vocab", "embed"), pdt)

    # A dense model stacks Blocks; an MoE model stacks groups of `moe.every` layers.
    unit, repeats = ((MoEGroup, cfg.num_layers // cfg.moe.every) if cfg.moe.enabled
                     else (Block, cfg.num_layers))

    @nnx.split_rngs(splits=repeats)
    @nnx.vmap(in_axes=(0,), out_axes=0, transform_metadata={nnx.PARTITION_NAME: "layers"})
    def make_blocks(rngs):
      return unit(cfg, rngs=rngs)

    self.blocks = make_blocks(rngs)
    self.final_norm = RMSNorm(cfg.d_model, cfg, rngs=rngs)
    if not cfg.tie_embeddings:
      self.lm_head_EV = param(rngs, nnx.initializers.normal(cfg.init_std),
                               (cfg.d_model, cfg.vocab_size), ("embed", "vocab"), pdt)

  def __call__(self, tokens_BS, positions_BS=None, segment_ids_BS=None):
    return self.logits(self.hidden(tokens_BS, positions_BS, segment_ids_BS))

  def hidden(self, tokens_BS, positions_BS=None, segment_ids_BS=None, *, with_stats=False):
    """tokens -> final-normed hidden states [B, S, E] in the input's token order (what the LM
    head reads: `logits`, or the chunked loss of `models/cross_entropy.py`). `with_stats`:
    also the MoE layers' router statistics, each with a leading MoE-layer axis ({} if dense)."""
    cfg = self.cfg
    if positions_BS is None:
      positions_BS = jnp.broadcast_to(jnp.arange(tokens_BS.shape[1]), tokens_BS.shape)
    # Ring attention balances causal work with the sequence in zig-zag order: reorder the
    # inputs once here and the hidden states back once below, not q/k/v in every layer.
    reorder = sequence_layout(cfg.attention, causal=cfg.causal) == "zigzag"
    if reorder:
      tokens_BS, positions_BS = zigzag(tokens_BS), zigzag(positions_BS)
      segment_ids_BS = None if segment_ids_BS is None else zigzag(segment_ids_BS)
    x_BSE = self.embed(tokens_BS)
    rope, segments = layer_inputs(cfg, positions_BS, segment_ids_BS)
    x_BSE, stats = run_layers(cfg, x_BSE, self.blocks, rope, segments)

    x_BSE = self.final_norm(x_BSE)
    if reorder:
      x_BSE = zigzag(x_BSE, inverse=True)
    return (x_BSE, stats) if with_stats else x_BSE

  def embed(self, tokens_BS):
    # Gather from a table that FSDP has all-gathered (like every weight before use) and that is
    # only vocab-parallel: a masked local lookup plus an all-reduce over `tensor` (Megatron's
    # vocab-parallel embedding). Gathering straight from the fsdp-sharded table makes XLA's
    # partitioner replicate it ("involuntary full rematerialization").
    table_VE = constrain(self.embed_VE[...], ("vocab", None))
    x_BSE = jnp.take(table_VE, tokens_BS, axis=0).astype(DTYPES[self.cfg.dtype])
    return constrain(x_BSE, ("act_batch", "act_seq", "act_embed"))

  def head(self):
    """The LM head [E, V]: the transposed embedding when tied, else its own matrix; under muP
    times 1/m (the output multiplier; read by `logits` and by the chunked loss)."""
    w_EV = self.embed_VE[...].T if self.cfg.tie_embeddings else self.lm_head_EV[...]
    m = self.cfg.width_multiplier
    return w_EV if m == 1.0 else w_EV * jnp.asarray(1.0 / m, w_EV.dtype)

  def logits(self, x_BSE):
    """Final-normed hidden states -> fp32 logits [B, S, V]."""
    dt = DTYPES[self.cfg.dtype]
    logits_BSV = jnp.einsum("bse,ev->bsv", x_BSE.astype(dt), self.head().astype(dt),
                            preferred_element_type=jnp.float32)
    return constrain(logits_BSV, ("act_batch", "act_seq", "act_vocab"))

  def loss_sums(self, tokens_BS, positions_BS, segment_ids_BS, targets_BS, mask_BS):
    """(sum of token cross-entropies where `mask_BS`, number of such tokens), fp32. With
    `logits_chunk` the head and the loss run that many positions at a time and the [B, S, V]
    logits never exist (`models/cross_entropy.py`); the same sum to fp32 rounding."""
    return self.loss_and_stats(tokens_BS, positions_BS, segment_ids_BS, targets_BS, mask_BS)[:2]

  def loss_and_stats(self, tokens_BS, positions_BS, segment_ids_BS, targets_BS, mask_BS):
    """`loss_sums` and the MoE router statistics (`hidden(with_stats=True)`)."""
    x_BSE, stats = self.hidden(tokens_BS, positions_BS, segment_ids_BS, with_stats=True)
    total = self.loss_from_hidden(x_BSE, targets_BS, mask_BS)
    return total, jnp.sum(mask_BS.astype(jnp.float32)), stats

  def masked_sums(self, tokens_BS, positions_BS, segment_ids_BS, targets_BS, mask_BS):
    """(loss sum, number of tokens, number of them predicted right) where `mask_BS`, fp32: the
    evaluation of a masked LM (docs/mlm.md); right = the most likely token is the target. The
    whole [B, S, V] logits, computed once for both, also with `logits_chunk` (evaluation has no
    backward whose memory the chunks would save)."""
    x_BSE = self.hidden(tokens_BS, positions_BS, segment_ids_BS)
    mask_BS = mask_BS.astype(jnp.float32)
    logits_BSV = self.logits(x_BSE)
    hit_BS = jnp.argmax(logits_BSV, axis=-1) == targets_BS
    losses_BS = optax.softmax_cross_entropy_with_integer_labels(logits_BSV, targets_BS)
    return jnp.sum(losses_BS * mask_BS), jnp.sum(mask_BS), jnp.sum(hit_BS * mask_BS)

  def loss_from_hidden(self, x_BSE, targets_BS, mask_BS):
    """The sum of token cross-entropies where `mask_BS` (fp32) from final-normed hidden states:
    the full logits, or `logits_chunk` positions at a time."""
    mask_BS = mask_BS.astype(jnp.float32)
    if self.cfg.logits_chunk:
      return chunked_cross_entropy(x_BSE, self.head(), targets_BS, mask_BS,
                                   chunk=self.cfg.logits_chunk, dtype=DTYPES[self.cfg.dtype])
    losses_BS = optax.softmax_cross_entropy_with_integer_labels(self.logits(x_BSE), targets_BS)
    return jnp.sum(losses_BS * mask_BS)


def layer_inputs(cfg: ModelConfig, positions_BS, segment_ids_BS):
  """(RoPE tables, document masks): what every layer reads, made once for all of them. RoPE
  tables as buffers on CPU; TPU and GPU programs recompute them inside the rotations' fusions,
  which XLA's TPU cost analysis counts as fewer bytes (docs/performance.md). The masks only for
  xla attention (`layer_segments`)."""
  rope = rope_tables(positions_BS, cfg.dim_per_head, cfg.rope_theta, cfg.rope_scaling,
                     buffer=mesh_platform(jax.sharding.get_abstract_mesh()) == "cpu")
  segments = layer_segments(segment_ids_BS, cfg.attention, dtype=DTYPES[cfg.dtype],
                            head_dim=cfg.dim_per_head, causal=cfg.causal)
  return rope, segments


def run_layers(cfg: ModelConfig, x_BSE, blocks, rope, segments, tape=None):
  """x [B, S, E] through the stacked layers `blocks` (a Transformer's, or one pipeline stage's
  share of them, models/pipeline.py), each under `model.remat`'s policy: (x, the MoE groups'
  statistics stacked, {} if dense). With `tape` = (make, data): each layer runs under the tape
  `make(its slice of data)` (models/weight_grad.py) and what the tapes return, stacked, comes
  third."""

  def layer(x_BSE, block):  # every layer reads the same RoPE tables and masks
    out = block(x_BSE, rope, segments)
    return out if isinstance(out, tuple) else (out, {})  # MoE groups add their statistics

  if tape is not None:
    plain = layer

    def layer(x_BSE, block, data):
      with weight_grad.active(tape[0](data)) as tape_:
        y_BSE, stats = tape_.passed(plain(x_BSE, block))
      return y_BSE, (stats, tape_.result())

  if cfg.remat != "none":
    layer = nnx.remat(layer, policy=REMAT_POLICIES[cfg.remat], prevent_cse=False)
  depth = jax.tree.leaves(nnx.state(blocks))[0].shape[0]
  # Unrolled (`scan_unroll`), the layers' residuals for the backward pass are separate buffers
  # instead of slices of stacked [L, ...] arrays: no copies into and out of the stacks, for a
  # program that grows with the number of layers unrolled.
  in_axes = (nnx.Carry, 0) if tape is None else (nnx.Carry, 0, 0)
  run = nnx.scan(layer, in_axes=in_axes, out_axes=(nnx.Carry, 0),
                 unroll=min(cfg.scan_unroll, depth),
                 transform_metadata={nnx.PARTITION_NAME: "layers"})
  if tape is None:
    return run(x_BSE, blocks)
  x_BSE, (stats, results) = run(x_BSE, blocks, tape[1])
  return x_BSE, stats, results

"""Attention dispatch: one entry point (`attention`), several implementations (`model.attention`).

  xla           plain XLA ops held to jax.nn.dot_product_attention: the reference; O(S^2) memory
  flash         our Pallas kernel: Mosaic GPU on Hopper (kernels/flash_mosaic.py), else Triton
                (kernels/flash_attention.py), interpreted off GPU; on TPU it means splash
  flash_triton  the Triton kernel by name
  splash        jax's TPU splash attention (kernels/splash.py); interpreted off-TPU
  ring          ring attention over the mesh's `sequence` axis (sharding/ring_attention.py)
  cudnn         cuDNN's fused attention on GPU (packed documents as a [B, 1, S, S] bias); else xla
  auto          ring when mesh.sequence > 1; else splash on TPU, xla on CPU, and on GPU
                flash_triton for packed documents, else cudnn where it applies, else xla

Packed documents: a query attends only to keys of its own segment (and, causal, to no later
token by index). Under a mesh the kernels run in `shard_map` over batch and heads. `choose_impl`
is the one place the choice is made. Why and details: docs/attention.md#implementations
"""
from __future__ import annotations

from typing import NamedTuple

import jax
import jax.numpy as jnp
from jax.sharding import PartitionSpec as P

from kernels import flash_attention, flash_mosaic
from kernels.splash import splash_attention
from sharding.mesh import mesh_platform
from sharding.ring_attention import ring_attention
from sharding.zigzag import split_axes
from sharding.rules import BATCH_AXES

IMPLS = ("xla", "flash", "flash_triton", "splash", "ring", "cudnn", "auto")
CUDNN_DTYPES = ("float16", "bfloat16")
CUDNN_MAX_HEAD_DIM = 128  # 256 on Hopper+, but jax checks that on the local GPU (docs/attention.md)
FLASH_MAX_HEAD_DIM = 128  # the largest head dim `auto` gives our kernel (checked on a GPU)


def segment_mask(segment_ids_q, segment_ids_kv=None):
  """Boolean mask [B, 1, Tq, Tk]: True where query and key belong to the same document."""
  if segment_ids_kv is None:
    segment_ids_kv = segment_ids_q
  return (segment_ids_q[:, None, :, None] == segment_ids_kv[:, None, None, :])


CAUSAL_BLOCK = 128  # xla attention's query block when causal (see `xla_attention`)


def _query_blocks(S: int, T: int, causal: bool) -> tuple[int, int]:
  """(number of query blocks, rows per block) of `xla_attention` for S queries and T keys."""
  blocks = S // CAUSAL_BLOCK if causal and S == T and S % CAUSAL_BLOCK == 0 else 1
  return blocks, S // blocks


class XlaMasks(NamedTuple):
  """`xla_attention`'s masks for self-attention over [B, S] tokens, built once per forward pass
  (`xla_masks`) and read by every layer: for query block i, bool [B, c, (i + 1) c] (all keys
  when there is one block), True where the query may attend (causal and same document). Built
  inside each layer instead, the segment comparison is redone in every layer's softmax and its
  backward; made once, a layer reads the [B, c, T] booleans (1 byte per score)."""
  blocks: tuple[jax.Array, ...]


def _block_mask(i: int, c: int, ends: int, causal: bool, segment_ids):
  """The mask of query block i (rows [i c, (i + 1) c) against keys [0, ends)), or None."""
  mask_BqT = None
  if causal:
    mask_BqT = (jnp.arange(i * c, (i + 1) * c)[:, None] >= jnp.arange(ends)[None, :])[None]
  if segment_ids is not None:
    same = segment_ids[:, i * c:(i + 1) * c, None] == segment_ids[:, None, :ends]
    mask_BqT = same if mask_BqT is None else mask_BqT & same
  return mask_BqT


def xla_masks(segment_ids_BS, *, causal: bool = True) -> XlaMasks:
  """The `XlaMasks` of self-attention over packed documents with these segment ids [B, S]."""
  S = segment_ids_BS.shape[1]
  blocks, c = _query_blocks(S, S, causal)
  ends = lambda i: (i + 1) * c if blocks > 1 else S
  return XlaMasks(tuple(_block_mask(i, c, ends(i), causal, segment_ids_BS)
                        for i in range(blocks)))


def xla_attention(q_BSHD, k_BSKD, v_BSKD, *, segment_ids=None, causal=True):
  """Softmax attention as plain XLA ops: fp32 scores, masked (causal by token index, and by
  segment), `jax.nn.softmax`, then the weighted sum of the values. `segment_ids`: [B, S], or
  the `XlaMasks` made from them once for all layers (`xla_masks`; the model passes those).
  Causal: query blocks of CAUSAL_BLOCK rows, none above the diagonal (docs/attention.md)."""
  S, T = q_BSHD.shape[1], k_BSKD.shape[1]
  q_BSHD = q_BSHD * jnp.asarray(q_BSHD.shape[3] ** -0.5, q_BSHD.dtype)
  blocks, c = _query_blocks(S, T, causal)
  if isinstance(segment_ids, XlaMasks) and len(segment_ids.blocks) != blocks:
    raise ValueError(f"XlaMasks of {len(segment_ids.blocks)} query blocks for attention of "
                     f"{blocks} blocks (S={S}, T={T}, causal={causal})")
  outs = []
  for i in range(blocks):
    q, ends = q_BSHD[:, i * c:(i + 1) * c], (i + 1) * c if blocks > 1 else T
    if isinstance(segment_ids, XlaMasks):
      mask_BqT = segment_ids.blocks[i]
    else:
      mask_BqT = _block_mask(i, c, ends, causal, segment_ids)
    outs.append(_attend(q, k_BSKD[:, :ends], v_BSKD[:, :ends], mask_BqT))
  return outs[0] if blocks == 1 else jnp.concatenate(outs, axis=1)


def _attend(q_BSHD, k_BTKD, v_BTKD, mask_BST):
  """softmax(q k^T [+ mask]) v for (pre-scaled) queries against these keys."""
  B, S, H, D = q_BSHD.shape
  K = k_BTKD.shape[2]

  def softmax(scores, mask):
    if mask is not None:
      scores = jnp.where(mask, scores, jnp.finfo(jnp.float32).min)
    return jax.nn.softmax(scores, axis=-1).astype(v_BTKD.dtype)

  if K == H:
    scores_BHST = jnp.einsum("bshd,bthd->bhst", q_BSHD, k_BTKD,
                             preferred_element_type=jnp.float32)
    probs_BHST = softmax(scores_BHST, None if mask_BST is None else mask_BST[:, None])
    return jnp.einsum("bhst,bthd->bshd", probs_BHST, v_BTKD)
  q_BSKGD = q_BSHD.reshape(B, S, K, H // K, D)  # query head h uses kv head h // (H / K)
  scores_BKGST = jnp.einsum("bskgd,btkd->bkgst", q_BSKGD, k_BTKD,
                            preferred_element_type=jnp.float32)
  probs_BKGST = softmax(scores_BKGST, None if mask_BST is None else mask_BST[:, None, None])
  return jnp.einsum("bkgst,btkd->bskgd", probs_BKGST, v_BTKD).reshape(B, S, H, D)


def cudnn_applies(dtype, head_dim: int, seq_len: int | None = None) -> bool:
  """Whether cuDNN's fused attention (through `jax.nn.dot_product_attention`) accepts q/k/v of
  `dtype` with this head dim and sequence length, with a segment mask, in training."""
  return (jnp.dtype(dtype).name in CUDNN_DTYPES and head_dim % 8 == 0
          and head_dim <= CUDNN_MAX_HEAD_DIM and (seq_len is None or seq_len % 2 == 0))


def choose_impl(impl: str, *, platform: str, sequence: int = 1, dtype=None,
                head_dim: int | None = None, seq_len: int | None = None,
                gpu_capability: float | None = None, segments: bool = False) -> str:
  """The implementation `impl` stands for on `platform` ("cpu", "gpu", "tpu") with a mesh
  `sequence` axis of that size, for q/k/v of `dtype` and `head_dim`, with (`segments`) or
  without packed documents' segment ids (the one place the choice is made; docs/attention.md
  says why GPU's default is flash for packed documents, else cudnn or xla).
  gpu_capability: the GPU's compute capability when known (None: an ahead-of-time target,
  assumed recent); cuDNN's flash attention and our kernel's `auto` need >= 8.0. Without
  dtype and head_dim (not known yet), `auto` on GPU is "cudnn" when the caller cannot tell:
  `attention` decides again with the real arrays."""
  if impl not in IMPLS:
    raise ValueError(f"unknown attention implementation {impl!r}; choose one of "
                     f"{', '.join(IMPLS)}")
  if impl == "auto" or (impl == "ring" and sequence == 1):
    if sequence > 1:
      return "ring"
    if platform == "gpu":
      if gpu_capability is not None and gpu_capability < 8.0:
        return "xla"
      if dtype is None or head_dim is None:
        return "cudnn"
      if segments and head_dim <= FLASH_MAX_HEAD_DIM:
        return "flash_triton"
      return "cudnn" if cudnn_applies(dtype, head_dim, seq_len) else "xla"
    return {"tpu": "splash"}.get(platform, "xla")
  if impl in ("flash", "flash_triton") and platform == "tpu":
    return "splash"
  if impl == "flash":
    hopper = platform == "gpu" and (gpu_capability is None or gpu_capability >= 9.0)
    fits = dtype is None or head_dim is None or flash_mosaic.supports(head_dim, dtype)
    return "flash_mosaic" if hopper and fits else "flash_triton"
  if impl == "cudnn" and platform != "gpu":
    return "xla"
  return impl


def resolve_impl(impl: str, mesh=None, *, dtype=None, head_dim: int | None = None,
                 seq_len: int | None = None, segments: bool = False) -> str:
  """The implementation `impl` stands for under `mesh` (default: the current mesh), with or
  without packed documents' segment ids (`segments`; training batches carry them)."""
  mesh = jax.sharding.get_abstract_mesh() if mesh is None else mesh
  sequence = 1 if mesh.empty else mesh.shape.get("sequence", 1)
  platform = mesh_platform(mesh)
  return choose_impl(impl, platform=platform, sequence=sequence, dtype=dtype,
                     head_dim=head_dim, seq_len=seq_len, segments=segments,
                     gpu_capability=_gpu_capability(mesh) if platform == "gpu" else None)


def _gpu_capability(mesh) -> float | None:
  """The compute capability of the GPUs a program is for: the local GPU's, or None for an
  ahead-of-time target (its abstract device does not say)."""
  if not mesh.empty and getattr(mesh, "abstract_device", None) is not None:
    return None
  capability = getattr(jax.devices()[0], "compute_capability", None)
  return float(capability) if capability else None


def sequence_layout(impl: str, mesh=None, *, causal: bool = True) -> str:
  """"zigzag" when `impl` runs as causal ring attention (the model then keeps its sequence in
  zig-zag order between input and output; it balances causal work only), else "contiguous"."""
  return "zigzag" if causal and resolve_impl(impl, mesh) == "ring" else "contiguous"


def _shard_over_batch_and_heads(fn, mesh, q_BSHD, k_BSKD):
  """Run a kernel per device: batch over the data-parallel axes, heads over `tensor`."""
  if mesh.empty or mesh.size == 1:
    return fn
  qkv = P(split_axes(mesh, BATCH_AXES, q_BSHD.shape[0]), None,
          split_axes(mesh, ("tensor",), k_BSKD.shape[2]))
  seg = P(qkv[0], None)
  # check_vma off: Pallas calls do not track varying mesh axes (see sharding/ring_attention.py).
  return jax.shard_map(fn, mesh=mesh, in_specs=(qkv, qkv, qkv, seg), out_specs=qkv,
                       check_vma=False)


def cudnn_attention(q_BSHD, k_BSKD, v_BSKD, *, segment_ids=None, causal=True):
  """cuDNN's fused flash attention; packed documents as a mask (cuDNN adds it as a bias)."""
  mask = None if segment_ids is None else segment_mask(segment_ids)
  return jax.nn.dot_product_attention(q_BSHD, k_BSKD, v_BSKD, mask=mask, is_causal=causal,
                                      implementation="cudnn")


def layer_segments(segment_ids_BS, impl: str, *, dtype, head_dim: int, causal: bool = True):
  """What every layer's `attention` reads for packed documents with these segment ids [B, S]
  (None: one document per row): under the xla implementation their `XlaMasks`, made here once
  for all layers; the kernels (flash, splash, cuDNN, ring) take the ids themselves."""
  if segment_ids_BS is None:
    return None
  impl = resolve_impl(impl, dtype=dtype, head_dim=head_dim, seq_len=segment_ids_BS.shape[1],
                      segments=True)
  return xla_masks(segment_ids_BS, causal=causal) if impl == "xla" else segment_ids_BS


def attention(q_BSHD, k_BSKD, v_BSKD, *, segment_ids=None, causal=True, impl="xla",
              layout="contiguous", ring_head_chunks=1):
  """q [B, S, H, D], k/v [B, S, K, D] with H a multiple of K -> [B, S, H, D].

  segment_ids: [B, S] document ids of packed rows, or None; the xla implementation also takes
  their `XlaMasks` (`layer_segments` gives each implementation what it reads). layout: the
  token order of the sequence axis; "zigzag" only for ring attention (see `sequence_layout`);
  every other implementation needs natural order. ring_head_chunks: ring attention's
  `head_chunks` (ignored by the others)."""
  mesh = jax.sharding.get_abstract_mesh()
  impl = resolve_impl(impl, mesh, dtype=q_BSHD.dtype, head_dim=q_BSHD.shape[3],
                      seq_len=q_BSHD.shape[1], segments=segment_ids is not None)
  if layout != "contiguous" and not (impl == "ring" and causal):
    raise ValueError(f"attention layout {layout!r} is only meaningful for causal ring "
                     f"attention, not {impl!r}")
  if isinstance(segment_ids, XlaMasks) and impl != "xla":
    raise ValueError(f"attention masks made for the xla implementation given to {impl!r}; "
                     "pass segment ids (models.attention.layer_segments)")
  if impl == "xla":
    return xla_attention(q_BSHD, k_BSKD, v_BSKD, segment_ids=segment_ids, causal=causal)
  if impl == "ring":
    return ring_attention(q_BSHD, k_BSKD, v_BSKD, mesh=mesh, causal=causal,
                          segment_ids=segment_ids, layout=layout, head_chunks=ring_head_chunks)
  if impl == "cudnn":
    def kernel(q, k, v, seg):
      return cudnn_attention(q, k, v, segment_ids=seg, causal=causal)
  elif impl == "flash_triton":
    interpret = mesh_platform(mesh) != "gpu"  # the target's platform, also when compiling AOT

    def kernel(q, k, v, seg):
      return flash_attention(q, k, v, causal=causal, segment_ids=seg, interpret=interpret)
  elif impl == "flash_mosaic":
    def kernel(q, k, v, seg):
      return flash_mosaic.flash_attention_mosaic(q, k, v, causal=causal, segment_ids=seg)
  else:
    interpret = mesh_platform(mesh) != "tpu"

    def kernel(q, k, v, seg):
      return splash_attention(q, k, v, causal=causal, segment_ids=seg, interpret=interpret)

  fn = _shard_over_batch_and_heads(kernel, mesh, q_BSHD, k_BSKD)
  return fn(q_BSHD, k_BSKD, v_BSKD, segment_ids)

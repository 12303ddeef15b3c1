"""Attention dispatch: one entry point, several implementations.

  xla     `jax.nn.dot_product_attention`: the reference every other implementation is tested
          against; materialises the [S, S] scores (XLA may fuse, but memory is O(S^2)).
  flash   our Pallas flash-attention kernel (kernels/flash_attention.py); on TPU jax's splash
          attention instead (the kernel is written for the GPU/Triton lowering; elsewhere it
          runs interpreted, exact but slow).
  splash  jax's TPU splash attention (kernels/splash.py); interpreted off-TPU.
  ring    ring attention over the mesh's `sequence` axis (sharding/ring_attention.py), O(S/N)
          memory per device; with no sequence axis (> 1) to ring over it falls back to `auto`.
  auto    ring when mesh.sequence > 1, else flash on GPU, splash on TPU, xla on CPU.

Packed documents are kept apart by segment ids: a query attends only to keys of its own segment
(and, when causal, not to later tokens; causality is by token index, not by position).

Under a mesh (`jax.set_mesh`), the kernels run inside `shard_map` over the batch and head axes:
a Pallas call is opaque to XLA's partitioner, which would otherwise gather it onto every device.
The sequence axis is not split for flash/splash (ring is the implementation that does that).

Ring attention's causal load balance wants the sequence in zig-zag order; `sequence_layout`
says when, and the model (models/llama.py) reorders tokens once at its input and its hidden
states back once at the output, so no layer pays for a permutation.
"""
from __future__ import annotations

import jax
from jax.sharding import PartitionSpec as P

from kernels import flash_attention
from kernels.splash import splash_attention
from sharding.mesh import mesh_platform
from sharding.ring_attention import ring_attention, split_axes
from sharding.rules import BATCH_AXES

IMPLS = ("xla", "flash", "splash", "ring", "auto")


def segment_mask(segment_ids_q, segment_ids_kv=None):
  """Boolean mask [B, 1, Tq, Tk]: True where query and key belong to the same document."""
  if segment_ids_kv is None:
    segment_ids_kv = segment_ids_q
  return (segment_ids_q[:, None, :, None] == segment_ids_kv[:, None, None, :])


def xla_attention(q_BSHD, k_BSKD, v_BSKD, *, segment_ids=None, causal=True):
  mask = None if segment_ids is None else segment_mask(segment_ids)
  return jax.nn.dot_product_attention(q_BSHD, k_BSKD, v_BSKD, mask=mask, is_causal=causal,
                                      implementation="xla")


def resolve_impl(impl: str, mesh=None) -> str:
  """The implementation `impl` stands for under `mesh` (default: the current mesh)."""
  if impl not in IMPLS:
    raise ValueError(f"unknown attention implementation {impl!r}; choose one of "
                     f"{', '.join(IMPLS)}")
  mesh = jax.sharding.get_abstract_mesh() if mesh is None else mesh
  sequence = 1 if mesh.empty else mesh.shape.get("sequence", 1)
  platform = mesh_platform(mesh)
  if impl == "auto" or (impl == "ring" and sequence == 1):
    if sequence > 1:
      return "ring"
    return {"gpu": "flash", "tpu": "splash"}.get(platform, "xla")
  if impl == "flash" and platform == "tpu":
    return "splash"
  return impl


def sequence_layout(impl: str, mesh=None) -> str:
  """"zigzag" when `impl` runs as ring attention (the model then keeps its sequence in zig-zag
  order between input and output), else "contiguous"."""
  return "zigzag" if resolve_impl(impl, mesh) == "ring" else "contiguous"


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


def attention(q_BSHD, k_BSKD, v_BSKD, *, segment_ids=None, causal=True, impl="xla",
              layout="contiguous", ring_head_chunks=1):
  """q [B, S, H, D], k/v [B, S, K, D] with H a multiple of K -> [B, S, H, D].

  layout: the token order of the sequence axis; "zigzag" only for ring attention (see
  `sequence_layout`); every other implementation needs natural order. ring_head_chunks: ring
  attention's `head_chunks` (ignored by the others)."""
  mesh = jax.sharding.get_abstract_mesh()
  impl = resolve_impl(impl, mesh)
  if layout != "contiguous" and not (impl == "ring" and causal):
    raise ValueError(f"attention layout {layout!r} is only meaningful for causal ring "
                     f"attention, not {impl!r}")
  if impl == "xla":
    return xla_attention(q_BSHD, k_BSKD, v_BSKD, segment_ids=segment_ids, causal=causal)
  if impl == "ring":
    return ring_attention(q_BSHD, k_BSKD, v_BSKD, mesh=mesh, causal=causal,
                          segment_ids=segment_ids, layout=layout, head_chunks=ring_head_chunks)
  if impl == "flash":
    interpret = mesh_platform(mesh) != "gpu"  # the target's platform, also when compiling AOT

    def kernel(q, k, v, seg):
      return flash_attention(q, k, v, causal=causal, segment_ids=seg, interpret=interpret)
  else:
    interpret = mesh_platform(mesh) != "tpu"

    def kernel(q, k, v, seg):
      return splash_attention(q, k, v, causal=causal, segment_ids=seg, interpret=interpret)

  fn = _shard_over_batch_and_heads(kernel, mesh, q_BSHD, k_BSKD)
  return fn(q_BSHD, k_BSKD, v_BSKD, segment_ids)

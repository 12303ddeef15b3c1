"""Ring attention over a mesh axis: exact attention with O(S/N) memory per device.

Each of the N devices of `axis` keeps its query block while key/value blocks go round the ring
(`ppermute`), merged exactly by their log-sum-exps; backward is a ring too, dK/dV travelling
with their block. Causal work is balanced by the zig-zag layout (device i holds chunks i and
2N-1-i of 2N); at ring step s device i holds the keys of device j = (i - s) mod N:

  s = 0   its own block, causal on the local order    q x kv
  j < i   an earlier device's: its first chunk only   q x kv[:half]
  j > i   a later device's: our second chunk only     q[half:] x kv

`layout="zigzag"`: the caller's arrays are in zig-zag order already (models/llama.py permutes
once at its input); "contiguous" reorders on every call. Blocks: jnp by default, the flash kernel
by name (`impl="flash"`, updating the ring's state in place); `head_chunks` rings over a slice
of the kv heads at a time. Why and details: docs/attention.md#ring-attention
"""
from __future__ import annotations

import dataclasses
import functools

import jax
import jax.numpy as jnp
import numpy as np
from jax import lax
from jax.sharding import PartitionSpec as P

from kernels.flash_attention import BlockSizes
from kernels.flash_attention import _setup as _flash_setup
from kernels.flash_attention import backward as flash_backward
from kernels.flash_attention import forward as flash_forward
from kernels.flash_kernels import _update_tiles
from sharding.mesh import mesh_platform
from sharding.ring_blocks import (block_backward, block_forward, merge, seq_slice, then_zeros,
                                  zeros_then)
from sharding.rules import BATCH_AXES
from sharding.zigzag import current_mesh, split_axes, zigzag_local, zigzag_order

LAYOUTS = ("contiguous", "zigzag")
BLOCK_IMPLS = ("auto", "flash", "jnp")


# ----------------------------------------------------------------------------------------------
# One block pair: flash kernel or jnp, same contract (fp32 out, natural-log lse [B, H, S]).


@dataclasses.dataclass(frozen=True)
class _RingConfig:
  axis: str
  n: int
  causal: bool
  scale: float
  impl: str  # "flash" or "jnp"
  block_sizes: BlockSizes | None  # flash tiles
  interpret: bool | None
  kv_chunk: int  # jnp: keys per scan step (scores are [S/N, kv_chunk] at a time)
  head_chunks: int = 1  # the ring runs once per chunk of kv heads (see `ring_attention`)


# ----------------------------------------------------------------------------------------------
# The ring (runs inside shard_map on local blocks).


def _send(tree, cfg: _RingConfig):
  """To the next device on the ring."""
  n = cfg.n
  return lax.ppermute(tree, cfg.axis, [(j, (j + 1) % n) for j in range(n)])


def _visible(cfg: _RingConfig, i, s, length: int, layout: str = "zigzag"):
  """Ring step s on device i as (q_start, kv_stop, causal), for both block implementations and
  `ring_work`: our queries from q_start on see the held keys before kv_stop, causally at step 0
  (the module docstring's cases; non-causal: everything). layout="contiguous" is only
  `ring_work`'s comparison (the ring runs zig-zag): earlier devices' blocks whole, later none."""
  if not cfg.causal:
    return 0, length, False
  own = s == 0
  earlier = (i - s) % cfg.n < i
  later = jnp.logical_not(jnp.logical_or(own, earlier))
  if layout == "contiguous":
    return jnp.where(later, length, 0), length, own
  half = length // 2  # zig-zag: an earlier device's first chunk; only our second sees later ones
  return jnp.where(later, half, 0), jnp.where(earlier, half, length), own


def _head_chunks(cfg: _RingConfig, q, k):
  """(query-head range, kv-head slice) of each chunk of heads the ring runs over in turn."""
  H, K, c = q.shape[2], k.shape[2], cfg.head_chunks
  return [((j * H // c, H // c), slice(j * K // c, (j + 1) * K // c)) for j in range(c)]


def _after(done, *xs):
  """`xs`, but only once `done` is computed: the next chunk's k/v slices are not taken (and
  held) while an earlier chunk is still going round the ring."""
  if done is None:
    return xs
  return lax.optimization_barrier((done, xs))[1]


def _flash_ring_fwd(cfg: _RingConfig, q, k, v, seg):
  """Every step is one kernel call folding the held keys into the running (o, lse) in place; with
  head chunks, one ring per chunk of kv heads (what it holds: docs/attention.md#ring-attention)."""
  i = lax.axis_index(cfg.axis)
  B, L, H, _ = q.shape

  def ring(state, kv, heads):
    def body(s, carry):
      o, lse, kv = carry
      kv_next = _send(kv, cfg)  # in flight while this step computes
      k, v, seg_k = kv
      q_start, kv_stop, causal = _visible(cfg, i, s, L)
      o, lse = flash_forward(q, k, v, seg, seg_k, state=(o, lse), bounds=(q_start, kv_stop),
                             heads=heads, causal=causal, scale=cfg.scale,
                             block_sizes=cfg.block_sizes, interpret=cfg.interpret)
      return o, lse, kv_next

    o, lse, _ = lax.fori_loop(0, cfg.n, body, (*state, kv))
    return o, lse

  state = (jnp.zeros(q.shape, jnp.float32), jnp.full((B, H, L), -jnp.inf, jnp.float32))
  if cfg.head_chunks == 1:
    return ring(state, (k, v, seg), None)
  for heads, kv_heads in _head_chunks(cfg, q, k):
    k, v = _after(state, k, v)
    state = ring(state, (k[:, :, kv_heads], v[:, :, kv_heads], seg), heads)
  return state


def _flash_ring_bwd(cfg: _RingConfig, q, k, v, seg, o, lse, do):
  """dQ accumulates in place here, dK/dV in the buffer that travels with their block (received,
  updated, sent on while the dQ kernel runs); with head chunks, one ring per chunk into one dQ."""
  i = lax.axis_index(cfg.axis)
  L = q.shape[1]
  delta = jnp.einsum("bshd,bshd->bhs", o.astype(jnp.float32), do.astype(jnp.float32))

  def ring(dq, kv, heads):
    def body(s, carry):
      dq, kv, dkv = carry
      kv_next = _send(kv, cfg)
      k, v, seg_k = kv
      q_start, kv_stop, causal = _visible(cfg, i, s, L)
      dq, *dkv = flash_backward(q, k, v, seg, seg_k, do, lse, delta, grads=(dq, *dkv),
                                bounds=(q_start, kv_stop), heads=heads, causal=causal,
                                scale=cfg.scale, block_sizes=cfg.block_sizes,
                                interpret=cfg.interpret)
      return dq, kv_next, _send(tuple(dkv), cfg)  # after the last step: the hop home

    zeros_kv = jnp.zeros(kv[0].shape, jnp.float32)
    dq, _, dkv = lax.fori_loop(0, cfg.n, body, (dq, kv, (zeros_kv, zeros_kv)))
    return dq, dkv

  dq = jnp.zeros(q.shape, jnp.float32)
  if cfg.head_chunks == 1:
    dq, (dk, dv) = ring(dq, (k, v, seg), None)
    return dq, dk, dv
  dks, dvs = [], []
  for heads, kv_heads in _head_chunks(cfg, q, k):
    k, v = _after(dq, k, v)
    dq, (dk, dv) = ring(dq, (k[:, :, kv_heads], v[:, :, kv_heads], seg), heads)
    dks.append(dk)
    dvs.append(dv)
  return dq, jnp.concatenate(dks, axis=2), jnp.concatenate(dvs, axis=2)


def _jnp_block_fwd(cfg: _RingConfig, q, k, v, seg_q, seg_k, causal):
  return block_forward(q, k, v, seg_q, seg_k, causal, cfg.scale, cfg.kv_chunk)


def _jnp_block_bwd(cfg: _RingConfig, q, k, v, seg_q, seg_k, do, lse, delta, causal):
  return block_backward(q, k, v, seg_q, seg_k, do, lse, delta, causal, cfg.scale, cfg.kv_chunk)


def _jnp_ring_fwd(cfg: _RingConfig, q, k, v, seg):
  """Static shapes: each causal step is one of two half-block pairs, chosen by lax.cond, and
  its (block output, lse) is merged into the running (o, lse)."""
  n = cfg.n
  i = lax.axis_index(cfg.axis)
  half = q.shape[1] // 2
  lo, hi = slice(0, half), slice(half, None)

  def step(s, o, lse, kv):
    k, v, seg_k = kv
    if not cfg.causal:
      return merge(o, lse, *_jnp_block_fwd(cfg, q, k, v, seg, seg_k, False))

    def kv_first_half():  # keys of an earlier device: only its first chunk is visible
      return _jnp_block_fwd(cfg, q, k[:, lo], v[:, lo], seg, seq_slice(seg_k, lo), False)

    def q_second_half():  # keys of a later device: only our second chunk sees them
      ob, lseb = _jnp_block_fwd(cfg, q[:, hi], k, v, seq_slice(seg, hi), seg_k, False)
      return zeros_then(ob), jnp.concatenate([jnp.full_like(lseb, -jnp.inf), lseb], axis=2)

    # The merge stays outside the branches, so it updates the accumulator in place.
    first_half_of_keys = _visible(cfg, i, s, 2 * half)[1] == half
    return merge(o, lse, *lax.cond(first_half_of_keys, kv_first_half, q_second_half))

  kv = (k, v, seg)
  o, lse = _jnp_block_fwd(cfg, q, k, v, seg, seg, cfg.causal)  # step 0: our own keys
  if n > 1:
    kv = _send(kv, cfg)

    def body(s, carry):
      o, lse, kv = carry
      kv_next = _send(kv, cfg)  # in flight while this step computes
      return (*step(s, o, lse, kv), kv_next)

    o, lse, kv = lax.fori_loop(1, n - 1, body, (o, lse, kv))
    o, lse = step(n - 1, o, lse, kv)
  return o, lse


def _jnp_ring_bwd(cfg: _RingConfig, q, k, v, seg, o, lse, do):
  n = cfg.n
  i = lax.axis_index(cfg.axis)
  half = q.shape[1] // 2
  lo, hi = slice(0, half), slice(half, None)
  delta = jnp.einsum("bshd,bshd->bhs", o.astype(jnp.float32), do.astype(jnp.float32))

  def grads(s, kv):
    """This step's block gradients: dq for our queries, (dk, dv) for the keys we hold."""
    k, v, seg_k = kv
    if not cfg.causal:
      return _jnp_block_bwd(cfg, q, k, v, seg, seg_k, do, lse, delta, False)

    def kv_first_half():
      dq, dk, dv = _jnp_block_bwd(cfg, q, k[:, lo], v[:, lo], seg, seq_slice(seg_k, lo), do, lse,
                                  delta, False)
      return dq, then_zeros(dk), then_zeros(dv)

    def q_second_half():
      dq, dk, dv = _jnp_block_bwd(cfg, q[:, hi], k, v, seq_slice(seg, hi), seg_k, do[:, hi],
                                  lse[:, :, hi], delta[:, :, hi], False)
      return zeros_then(dq), dk, dv

    return lax.cond(_visible(cfg, i, s, 2 * half)[1] == half, kv_first_half, q_second_half)

  kv = (k, v, seg)
  dq, dk, dv = _jnp_block_bwd(cfg, q, k, v, seg, seg, do, lse, delta, cfg.causal)  # step 0
  dkv = (dk, dv)  # the accumulator of the block we hold; it travels with the block
  if n > 1:
    kv = _send(kv, cfg)

    def body(s, carry):
      dq, kv, dkv = carry
      kv_next = _send(kv, cfg)
      dkv_in = _send(dkv, cfg)  # the previous holder's sum for this block, arriving meanwhile
      dq_b, dk_b, dv_b = grads(s, kv)
      return dq + dq_b, kv_next, (dkv_in[0] + dk_b, dkv_in[1] + dv_b)

    dq, kv, dkv = lax.fori_loop(1, n - 1, body, (dq, kv, dkv))
    dkv_in = _send(dkv, cfg)
    dq_b, dk_b, dv_b = grads(n - 1, kv)
    dq = dq + dq_b
    dkv = _send((dkv_in[0] + dk_b, dkv_in[1] + dv_b), cfg)  # the last hop brings dK/dV home
  return dq, dkv[0], dkv[1]


def _jnp_by_head_chunks(ring, cfg: _RingConfig, q, k, v, seg, *per_query_head):
  """Run a jnp ring pass once per chunk of heads on sliced operands and join the results.
  `per_query_head`: further [B, L, H, ...] operands (o, do) and lse [B, H, L], sliced alike."""
  if cfg.head_chunks == 1:
    return ring(cfg, q, k, v, seg, *per_query_head)
  parts, done = [], None
  for (first, count), kv_heads in _head_chunks(cfg, q, k):
    q_heads = slice(first, first + count)
    k, v = _after(done, k, v)
    extra = [x[:, q_heads] if x.ndim == 3 else x[:, :, q_heads] for x in per_query_head]
    done = ring(cfg, q[:, :, q_heads], k[:, :, kv_heads], v[:, :, kv_heads], seg, *extra)
    parts.append(done)
  # Outputs: [B, L, heads, D] arrays join on axis 2, lse [B, heads, L] on axis 1.
  return tuple(jnp.concatenate(xs, axis=1 if xs[0].ndim == 3 else 2) for xs in zip(*parts))


def _ring_fwd_pass(cfg: _RingConfig, q, k, v, seg):
  """-> (o [B, L, H, D] fp32, lse [B, H, L]) of the local queries over the whole sequence."""
  if cfg.impl == "flash":
    return _flash_ring_fwd(cfg, q, k, v, seg)
  return _jnp_by_head_chunks(_jnp_ring_fwd, cfg, q, k, v, seg)


def _ring_bwd_pass(cfg: _RingConfig, q, k, v, seg, o, lse, do):
  """-> (dq, dk, dv) fp32 of the local blocks."""
  if cfg.impl == "flash":
    return _flash_ring_bwd(cfg, q, k, v, seg, o, lse, do)
  return _jnp_by_head_chunks(_jnp_ring_bwd, cfg, q, k, v, seg, o, lse, do)


@functools.partial(jax.custom_vjp, nondiff_argnums=(4,))
def _ring(q, k, v, seg, cfg: _RingConfig):
  return _ring_fwd_pass(cfg, q, k, v, seg)[0].astype(q.dtype)


def _ring_vjp_fwd(q, k, v, seg, cfg):
  o, lse = _ring_fwd_pass(cfg, q, k, v, seg)
  o = o.astype(q.dtype)
  return o, (q, k, v, seg, o, lse)


def _ring_vjp_bwd(cfg, residuals, do):
  q, k, v, seg, o, lse = residuals
  dq, dk, dv = _ring_bwd_pass(cfg, q, k, v, seg, o, lse, do)
  return dq.astype(q.dtype), dk.astype(k.dtype), dv.astype(v.dtype), None


_ring.defvjp(_ring_vjp_fwd, _ring_vjp_bwd)


def _block_impl(impl: str) -> str:
  if impl not in BLOCK_IMPLS:
    raise ValueError(f"ring attention: impl={impl!r}; choose one of {', '.join(BLOCK_IMPLS)}")
  return "jnp" if impl == "auto" else impl


def ring_attention(q_BSHD, k_BSKD, v_BSKD, *, mesh=None, axis: str = "sequence",
                   causal: bool = False, segment_ids=None, layout: str = "contiguous",
                   impl: str = "auto", scale: float | None = None,
                   block_sizes: BlockSizes | None = None, interpret: bool | None = None,
                   kv_chunk: int = 512, head_chunks: int = 1, batch_axes=BATCH_AXES,
                   head_axis: str = "tensor"):
  """Exact attention of global arrays whose sequence axis is sharded over `axis` of `mesh`.

  q [B, S, H, D], k/v [B, S, K, D] (H a multiple of K), segment_ids [B, S] -> [B, S, H, D].
  mesh: a Mesh or AbstractMesh, default the current one; batch and heads are split over
  `batch_axes` and `head_axis` where the mesh has them (and they divide). layout: "contiguous"
  or "zigzag" (already in `zigzag` order; matters only when causal). impl: "flash" (Pallas,
  `block_sizes` tiles), "jnp" (keys in chunks of `kv_chunk`, or the largest common divisor with
  the block length) or "auto" (jnp). head_chunks: c rings, each over 1/c of the device's kv
  heads (after the `head_axis` split, which c must divide) and their query heads."""
  mesh = current_mesh(mesh)
  if layout not in LAYOUTS:
    raise ValueError(f"ring attention: layout={layout!r}; choose one of {', '.join(LAYOUTS)}")
  B, S, H, D = q_BSHD.shape
  n = mesh.shape[axis]
  if causal:
    zigzag_order(S, n)  # the balanced causal layout needs 2N equal chunks
  elif S % n:
    raise ValueError(f"ring attention: sequence length {S} is not a multiple of the {n} "
                     f"devices of mesh axis {axis!r}")
  batch = split_axes(mesh, batch_axes, B)
  heads = split_axes(mesh, (head_axis,), k_BSKD.shape[2])
  local_kv_heads = k_BSKD.shape[2] // (1 if heads is None else mesh.shape[head_axis])
  if head_chunks < 1 or local_kv_heads % head_chunks:
    raise ValueError(f"ring attention: head_chunks={head_chunks} does not divide the "
                     f"{local_kv_heads} kv heads each device holds")
  cfg = _RingConfig(axis=axis, n=n, causal=bool(causal),
                    scale=float(D ** -0.5 if scale is None else scale),
                    impl=_block_impl(impl), block_sizes=block_sizes,
                    interpret=mesh_platform(mesh) != "gpu" if interpret is None else interpret,
                    kv_chunk=int(kv_chunk), head_chunks=int(head_chunks))
  reorder = causal and layout == "contiguous" and n > 1
  qkv_spec, seg_spec = P(batch, axis, heads), P(batch, axis)

  def local(q, k, v, seg):
    if reorder:
      q, k, v, seg = (None if x is None else zigzag_local(x, axis, n) for x in (q, k, v, seg))
    out = _ring(q, k, v, seg, cfg)
    return zigzag_local(out, axis, n, inverse=True) if reorder else out

  # Pallas calls do not track varying mesh axes yet (the interpreter's grid loop rejects them),
  # so the type check is on for the jnp blocks only.
  return jax.shard_map(local, mesh=mesh, in_specs=(qkv_spec, qkv_spec, qkv_spec, seg_spec),
                       out_specs=qkv_spec, check_vma=cfg.impl != "flash")(
                           q_BSHD, k_BSKD, v_BSKD, segment_ids)


# ----------------------------------------------------------------------------------------------
# Work per device (for the load-balance benchmark).


def ring_work(seq_len: int, n: int, *, layout: str = "zigzag", impl: str = "jnp",
              block_sizes: BlockSizes | None = None) -> dict[str, np.ndarray]:
  """Causal attention work per device over one forward pass of the ring, as (query, key) pairs:
  `needed` (the pairs the causal mask allows) and `computed` (those the ring's blocks visit, from
  the bounds the ring passes them, `_visible`, and for impl="flash" the kernel's tile loop,
  `_update_tiles`). layout="contiguous": the same schedule on contiguous blocks, to compare.
  How each is counted: docs/attention.md#balance-of-the-causal-work."""
  if layout not in LAYOUTS:
    raise ValueError(f"layout={layout!r}; choose one of {', '.join(LAYOUTS)}")
  if impl not in ("jnp", "flash"):
    raise ValueError(f"impl={impl!r}; choose jnp or flash")
  L = seq_len // n
  order = zigzag_order(seq_len, n) if layout == "zigzag" else np.arange(seq_len)
  needed = np.array([np.sum(order[d * L:(d + 1) * L] + 1) for d in range(n)], dtype=np.int64)
  cfg = _RingConfig(axis="", n=n, causal=True, scale=1.0, impl=impl, block_sizes=block_sizes,
                    interpret=True, kv_chunk=L)
  device, step = np.arange(n)[:, None], np.arange(n)[None, :]
  q_start, kv_stop, causal = (np.broadcast_to(np.asarray(x), (n, n))
                              for x in _visible(cfg, device, step, L, layout))
  if impl == "jnp":
    computed = ((L - q_start) * kv_stop).sum(axis=1)
  else:
    sds = jax.ShapeDtypeStruct((1, L, 1, 16), jnp.float32)
    tiles, s_pad, t_pad, _ = _flash_setup(sds, sds, sds, None, None, causal=False, scale=None,
                                          block_sizes=block_sizes, interpret=True)
    bq, bk = tiles.block_q, tiles.block_k
    query_tile = np.arange(s_pad // bq)[None, None, :]
    bounds = (q_start[..., None], kv_stop[..., None], causal[..., None])
    visits = np.asarray(_update_tiles(t_pad // bk, query_tile, bq, bk, bounds))
    computed = visits.sum(axis=(1, 2)) * bq * bk
  return {"needed": needed, "computed": np.asarray(computed, dtype=np.int64)}

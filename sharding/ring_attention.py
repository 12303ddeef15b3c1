"""Ring attention over a mesh axis: exact attention with O(S/N) memory per device.

Ring Self-Attention (Li et al. 2021, "Sequence Parallelism: Long Sequence Training from System
Perspective", arXiv:2105.13120; Liu et al. 2023, "Ring Attention with Blockwise Transformers",
arXiv:2310.01889). The sequence is split over the N devices of `axis`. Each device keeps its
query block and passes its key/value block around the ring with `ppermute`; after N steps every
query block has seen every key block. Partial results are merged exactly with their
log-sum-exps (the online softmax of flash attention, across devices instead of tiles). A step
sends the block it is computing on, so the transfer can overlap the compute.

Backward is a ring too (custom_vjp): q, dq, the output and its lse stay put, while k and v go
round again with their gradient accumulators dK/dV travelling alongside, each device adding its
contribution (from the *global* lse, so the block probabilities are exact); one last hop brings
dK/dV home. Nothing O(S) is ever held by one device, forward or backward.

Causal load balance: zig-zag layout (as in Megatron's context parallelism and
zhuzilin/ring-flash-attention). Cut the sequence into 2N chunks; device i holds chunks i and
2N-1-i, in that order, so its local tokens are still in increasing global order. At ring step s
device i holds the keys of device j = (i - s) mod N and:
  s = 0   its own block: ordinary causal attention on the local order (local causal = global);
  j < i   all its queries see the first key chunk (chunk j), none the second: q x kv[:half];
  j > i   only its second query chunk (2N-1-i) sees keys, all of them: q[half:] x kv.
Every step is the same amount of work on every device (half a block pair after step 0), so no
device waits: max/min attention work per device is 1.000, where contiguous blocks on the same
schedule give 2-15x at N = 2-8 (`ring_work` counts the pairs from the bounds each step passes
to its blocks and the flash kernel's tile loop; tests/test_ring_attention.py checks both).

Where the token reordering happens. A permutation of the sequence axis is communication, so it
should not be paid per layer: `layout="zigzag"` says the caller's arrays are already in zig-zag
order (the model permutes tokens, positions and segment ids once at its input with `zigzag` and
un-permutes the final hidden states once, models/llama.py), and everything in between (RoPE by
positions, segment masks, MLPs) is order-agnostic. `layout="contiguous"` (the default) accepts
natural order and reorders inside, with ppermutes, O(S/N) memory, on every call.

The per-block computation is plain jnp (XLA) by default on every platform, or the Pallas flash
kernel (kernels/flash_attention.py) by name (`impl="flash"`: compiled on GPU, interpreted
elsewhere). `auto` does not pick the kernel on GPU because it has only been compiled for GPUs,
never run on one (models/attention.py says the same for the unsharded default). Non-causal
attention needs no balancing: every step is a full block pair.

With the flash kernel a step is one kernel call per pass that carries the ring's state: the
forward folds the held keys into the running (o, lse) in place (`forward(state=...)`, the
online softmax resumed from the state), the backward adds into dQ and into the dK/dV that
travel with the block (`backward(grads=...)`); the step's half-block pair is given to the
kernel as dynamic bounds (q_start, kv_stop) and the diagonal step as a dynamic causal flag, so
nothing is sliced, zero-padded or merged outside the kernel. Per device that holds, beyond the
local q, k, v (and o, lse, dO as backward residuals): forward, the fp32 state and the next k/v
block in flight; backward, the fp32 dQ, the next k/v block in flight, and two dK/dV fp32 sets
(the one just updated going out while the dQ kernel runs, the next one coming in).

Why the next k/v block is a second buffer: its transfer overlaps the step's compute only if it
has somewhere to land while the current block is read. Landing it half a block at a time (send
each half on once it is consumed) would hold 1.5 blocks instead of 2, but a zig-zag step on an
earlier device's keys computes on their first half only, so the other half's transfer has no
compute to hide behind, and every step would take two kernel calls and two transfers. So we
keep the double buffer, and it sets the memory floor: compiled for GPUs
(`bench/attention_memory.py --target h100:8`), a device holds exactly the caller's q, k, v, o
plus two k/v blocks, 2.0x the unsharded kernel's total / N with as many kv heads as query heads
and 1.4x with 4 query heads per kv head (the blocks are K/H the size of q).

Head chunks lower that floor (`head_chunks=c`): the ring runs c times, each time over one chunk
of the device's kv heads and their query heads, so what travels (the k/v block, the one in
flight, and backward the dK/dV pair) is 1/c of the heads. The flash kernel computes a chunk's
heads in place within the full q, o, lse and dQ (`heads=` in kernels/flash_attention.py), so
only the chunk's k/v are sliced; an optimization barrier keeps the next chunk's slice from
being taken before the previous ring is done. Compiled for H100s with 8 kv heads, forward /
forward+backward total x N: 2.00 / 1.99 at c = 1, 1.50 / 1.57 at 2, 1.25 / 1.43 at 4, 1.13 /
1.36 at 8. The price is c rings of N steps with 1/c of the payload each: the same bytes in
c x more messages, and kernel grids 1/c as wide. (The jnp blocks run on sliced q, k, v per
chunk, which also cuts their per-chunk score buffers by c.)

Every step, the diagonal one included, is the same call in one loop; the last step therefore
also sends its k/v block on (back home, unused): one transfer per pass more than needed, hidden
behind the last step's compute. Peeling the last step off would avoid it, and a compiled kernel
makes no copies of its operands, so on a GPU that should cost no memory; but the CPU
interpreter (what bench/attention_memory.py measures) holds private copies of every operand per
call site: peeled, the benchmark's ratio measured 1.49 instead of 1.33 x N
forward and 1.60-1.73 instead of 0.94 x N forward+backward (S = 4096, when this was built). In
the backward, dK/dV are sent after their kernel, so their hops are exactly N, the last one
bringing them home.

The jnp block (the default) keeps static shapes: each causal step is one of two half
block pairs chosen by `lax.cond`, merged into (o, lse) with their log-sum-exps. It scans over
chunks of keys with the same online softmax, so its scores are [S/N, chunk], not [S/N, S/N],
and memory stays O(S/N) there too.
"""
from __future__ import annotations

import dataclasses
import functools

import jax
import jax.numpy as jnp
import numpy as np
from jax import lax
from jax.sharding import PartitionSpec as P

from kernels.flash_attention import BlockSizes, _update_tiles
from kernels.flash_attention import _setup as _flash_setup
from kernels.flash_attention import backward as flash_backward
from kernels.flash_attention import forward as flash_forward
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
  """The block pair of ring step s on device i as (q_start, kv_stop, causal): our queries from
  q_start on see the held keys before kv_stop, causally at step 0 (the zig-zag cases of the
  module docstring; non-causal: everything). Both block implementations take their step from
  here, and so does `ring_work`. layout="contiguous" is only for `ring_work`'s comparison (the
  ring itself always runs zig-zag when causal): earlier devices' blocks whole, later ones not
  at all."""
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
  """Every step, the diagonal one included, is the same kernel call folding the held keys into
  the running (o, lse) in place; see the module docstring for the buffers this holds. With
  head chunks, one ring per chunk of kv heads updates its query heads of the same state."""
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
  """dQ accumulates in place here; dK/dV accumulate in place in the buffer that travels with
  their block: received, updated by the dK/dV kernel, sent on while the dQ kernel runs. With
  head chunks, one ring per chunk of kv heads, all adding into the one dQ."""
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
  mesh: a Mesh or AbstractMesh; default the current one (`jax.set_mesh`). The batch is split
  over `batch_axes` and the heads over `head_axis` where the mesh has them (and they divide),
  like the model's activations. layout: "contiguous" = natural token order; "zigzag" = the
  arrays are in `zigzag` order already (see the module docstring; only matters when causal).
  impl: block computation, "flash" (Pallas kernel with `block_sizes` tiles), "jnp" (keys in
  chunks of `kv_chunk`, or the largest common divisor with the block length), or "auto" (jnp
  on every platform until the kernel has been checked on a GPU; see the module docstring).
  head_chunks: run the ring once per chunk of a device's kv heads (with their query heads), so
  the k/v block in flight, the one computed on and, backward, the travelling dK/dV hold 1/c of
  the heads: per-device memory falls from q, k, v, o + 2 k/v blocks towards q, k, v, o (see
  the module docstring) for c x more, smaller ring messages. The device's kv heads (after the
  `head_axis` split) must divide by it.
  """
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
  """Causal attention work per device over one forward pass of the ring, as (query, key) pairs.

  `needed`: pairs the causal mask allows (key index <= query index), counted from the layout's
  token order. `computed`: pairs the ring's block computations visit, counted from the same
  per-step bounds the ring passes to them (`_visible`: q_start, kv_stop, causal flag) and, for
  impl="flash", the kernel's own tile loop bounds (`_update_tiles`, with the tiles `forward`
  would use for `block_sizes`): whole [block_q, block_k] tiles, masked pairs in a visited tile
  included; impl="jnp": the rows from q_start times the keys before kv_stop (the jnp block
  computes whole sub-blocks, its step-0 square included). layout="contiguous" counts the same
  schedule on contiguous blocks (what the ring would do without zig-zag), for comparison.
  FLOPs are about 4 x D x H x pairs forward (the backward visits the same pairs)."""
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

"""Flash attention on Pallas Mosaic GPU (Hopper): forward and backward, layout `[B, S, H, D]`,
causal, grouped-query heads and packed documents' segment ids.

FlashAttention-2 as in kernels/flash_attention.py (Triton), on the backend jax keeps: tiles move
by TMA (`plgpu.emit_pipeline`), every product is a wgmma into an fp32 accumulator; tiles 64 x 64,
head dims multiples of 64, q/k/v 16-bit (`supports`). Three kernels:

  forward   a query tile against its key tiles  -> out, lse
  dQ        a query tile against its key tiles  -> dq
  dK, dV    a key tile against its query tiles  -> per query head, summed per kv head's group

A query sees a key of its own segment (padding's ids match nothing) and, causal, not a later
one; tiles above the diagonal are skipped. Written to run in Pallas' Mosaic GPU interpreter
too (the tests' CPU check). Why and details: docs/attention.md#the-mosaic-gpu-kernel
"""
from __future__ import annotations

import functools
import math

import jax
import jax.numpy as jnp
from jax import lax
from jax.experimental import pallas as pl
from jax.experimental.pallas import mosaic_gpu as plgpu

LOG2E = math.log2(math.e)
LN2 = math.log(2.0)
BLOCK = 64  # query and key tile: one warpgroup's wgmma rows
MASKED = -1e30  # a masked score (finite: exp2 of it is 0, and max() of it stays finite)
PAD_Q, PAD_KV = -2, -1  # segment ids of padding (they match nothing, not even each other)


def _mgpu():
  """Pallas' Mosaic GPU module (imported lazily: importing it on a machine without CUDA
  libraries is fine, using it to lower needs jax's CUDA plugin)."""
  return plgpu


def supports(head_dim: int, dtype) -> bool:
  """Whether this kernel takes q/k/v of this head dim and dtype (16-bit, D a multiple of 64)."""
  return head_dim % 64 == 0 and jnp.dtype(dtype).name in ("bfloat16", "float16")


def _interpret(interpret: bool):
  if not interpret:
    return None
  from jax._src.pallas.mosaic_gpu.interpret.params import InterpretGPUParams  # noqa: PLC0415  version
  return InterpretGPUParams()


def _transforms():
  plgpu = _mgpu()
  return (plgpu.TilingTransform((8, 64)), plgpu.SwizzleTransform(128))


def _smem(shape, dtype, tiled=True):
  plgpu = _mgpu()
  return plgpu.SMEM(shape, dtype, transforms=_transforms() if tiled else ())


def _caster(interpret: bool):
  """`plgpu.layout_cast`, the register layout an array is to have (an identity on its values);
  nothing in the interpreter, which does not know the primitive."""
  plgpu = _mgpu()
  return (lambda x, layout: x) if interpret else plgpu.layout_cast


def _zeros(shape, cast):
  plgpu = _mgpu()
  return cast(jnp.zeros(shape, jnp.float32), plgpu.Layout.WGMMA)


def _vector(value, n: int, axis: int, cast):
  """A length-n fp32 vector in the layout of a [n, .] (axis 1) or [., n] (axis 0) WGMMA tile's
  reduction over `axis`."""
  plgpu = _mgpu()
  return cast(jnp.full((n,), value, jnp.float32), plgpu.Layout.WGMMA.reduce(axis))


def _matmul(a_smem, b_smem, rows: int, cols: int):
  """a [rows, k] @ b [k, cols], both in shared memory, fp32: one wgmma into a zeroed
  accumulator."""
  plgpu = _mgpu()

  def run(acc_ref):
    plgpu.wgmma(acc_ref, a_smem, b_smem)
    return acc_ref[...]

  return pl.run_scoped(run, plgpu.ACC((rows, cols), jnp.float32))


def _mask(seg_rows, seg_cols, row0, col0, causal: bool, rows_are_queries: bool, cast):
  """[rows, cols] allowed pairs of a tile: same segment, and (causal) key <= query."""
  plgpu = _mgpu()
  shape = (seg_rows.shape[0], seg_cols.shape[0])
  allowed = (lax.broadcast_in_dim(seg_rows, shape, [0])
             == lax.broadcast_in_dim(seg_cols, shape, [1]))
  if causal:
    r = cast(lax.broadcasted_iota(jnp.int32, shape, 0), plgpu.Layout.WGMMA) + row0
    c = cast(lax.broadcasted_iota(jnp.int32, shape, 1), plgpu.Layout.WGMMA) + col0
    allowed = allowed & ((r >= c) if rows_are_queries else (c >= r))
  return allowed


def _load_vector(ref, axis: int, cast):
  """A [BLOCK] vector from shared memory in the layout of a WGMMA tile's reduction over
  `axis` (a read and a layout cast: the Mosaic GPU interpreter has no `plgpu.load`)."""
  plgpu = _mgpu()
  return cast(ref[...], plgpu.Layout.WGMMA.reduce(axis))


def _copy_in(pairs, barrier):
  """TMA copies of (global, shared) pairs on one barrier each, then wait for all."""
  plgpu = _mgpu()
  for i, (src, dst) in enumerate(pairs):
    plgpu.copy_gmem_to_smem(src, dst, barrier.at[i])
  for i in range(len(pairs)):
    plgpu.barrier_wait(barrier.at[i])


def _copy_out(pairs):
  plgpu = _mgpu()
  plgpu.commit_smem()
  for src, dst in pairs:
    plgpu.copy_smem_to_gmem(src, dst)
  plgpu.wait_smem_to_gmem(0)


# ----------------------------------------------------------------------------------------------
# Forward


def _forward(q, kT, v, seg_q, seg_kv, *, causal: bool, scale: float, groups: int,
             interpret: bool):
  """o [B, S, H, D] (q's dtype) and lse [B, H, S] (natural log) of padded, tile-aligned
  inputs; kT [B, K, D, T]."""
  plgpu = _mgpu()
  B, S, H, D = q.shape
  T = v.shape[1]
  dtype = q.dtype
  c = scale * LOG2E
  cast = _caster(interpret)

  def kernel(q_ref, kT_ref, v_ref, segq_ref, segkv_ref, o_ref, lse_ref,
             q_smem, p_smem, segq_smem, o_smem, lse_smem, barrier):
    h, i, b = lax.axis_index("heads"), lax.axis_index("q"), lax.axis_index("batch")
    kvh = lax.div(h, jnp.array(groups, h.dtype))
    q0 = i * BLOCK
    rows = (b, pl.ds(q0, BLOCK), h)
    _copy_in([(q_ref.at[rows], q_smem), (segq_ref.at[b, pl.ds(q0, BLOCK)], segq_smem)], barrier)
    seg_q = _load_vector(segq_smem, 1, cast)

    def step(idx, kT_smem, v_smem, segkv_smem, carry):
      acc, m, l = carry
      k0 = idx[0] * BLOCK
      s = _matmul(q_smem, kT_smem, BLOCK, BLOCK) * c
      seg_k = _load_vector(segkv_smem, 0, cast)
      allowed = _mask(seg_q, seg_k, q0, k0, causal, rows_are_queries=True, cast=cast)
      s = jnp.where(allowed, s, MASKED)
      m_new = jnp.maximum(m, s.max(axis=1))
      alpha = jnp.exp2(m - m_new)
      p = jnp.where(allowed, jnp.exp2(s - lax.broadcast_in_dim(m_new, s.shape, [0])), 0.0)
      l = l * alpha + p.sum(axis=1)
      p_smem[...] = p.astype(dtype)
      plgpu.commit_smem()  # the stores reach the async proxy before the wgmma reads them
      pv = _matmul(p_smem, v_smem, BLOCK, D)
      acc = acc * lax.broadcast_in_dim(alpha, acc.shape, [0]) + pv
      return acc, m_new, l

    steps = pl.cdiv(q0 + BLOCK, BLOCK) if causal else T // BLOCK
    pipeline = plgpu.emit_pipeline(
        step, grid=(steps,), max_concurrent_steps=2,
        in_specs=[plgpu.BlockSpec((D, BLOCK), lambda j: (0, j), transforms=_transforms()),
                  plgpu.BlockSpec((BLOCK, D), lambda j: (j, 0), transforms=_transforms()),
                  plgpu.BlockSpec((BLOCK,), lambda j: (j,))],
        init_carry=(_zeros((BLOCK, D), cast), _vector(MASKED, BLOCK, 1, cast),
                    _vector(0.0, BLOCK, 1, cast)))
    acc, m, l = pipeline(kT_ref.at[b, kvh], v_ref.at[b, :, kvh], segkv_ref.at[b])
    safe = jnp.where(l > 0, l, 1.0)  # a padding row has no allowed key
    o_smem[...] = (acc / lax.broadcast_in_dim(safe, acc.shape, [0])).astype(dtype)
    lse_smem[...] = (m + jnp.log2(safe)) * LN2
    _copy_out([(o_smem, o_ref.at[rows]), (lse_smem, lse_ref.at[b, h, pl.ds(q0, BLOCK)])])

  return plgpu.kernel(
      kernel,
      out_type=(jax.ShapeDtypeStruct(q.shape, dtype),
                jax.ShapeDtypeStruct((B, H, S), jnp.float32)),
      scratch_types=[_smem((BLOCK, D), dtype), _smem((BLOCK, BLOCK), dtype),
                     plgpu.SMEM((BLOCK,), jnp.int32), _smem((BLOCK, D), dtype),
                     plgpu.SMEM((BLOCK,), jnp.float32), plgpu.Barrier(num_barriers=2)],
      grid=(H, S // BLOCK, B), grid_names=("heads", "q", "batch"),
      interpret=_interpret(interpret))(q, kT, v, seg_q, seg_kv)


# ----------------------------------------------------------------------------------------------
# Backward: dQ, then dK and dV


def _backward_dq(q, kT, vT, k, do, lse, delta, seg_q, seg_kv, *, causal, scale, groups,
                 interpret):
  plgpu = _mgpu()
  B, S, H, D = q.shape
  T = k.shape[1]
  dtype = q.dtype
  c = scale * LOG2E
  cast = _caster(interpret)

  def kernel(q_ref, kT_ref, vT_ref, k_ref, do_ref, lse_ref, delta_ref, segq_ref, segkv_ref,
             dq_ref, q_smem, do_smem, ds_smem, lse_smem, delta_smem, segq_smem, dq_smem,
             barrier):
    h, i, b = lax.axis_index("heads"), lax.axis_index("q"), lax.axis_index("batch")
    kvh = lax.div(h, jnp.array(groups, h.dtype))
    q0 = i * BLOCK
    rows = (b, pl.ds(q0, BLOCK), h)
    vec = (b, h, pl.ds(q0, BLOCK))
    _copy_in([(q_ref.at[rows], q_smem), (do_ref.at[rows], do_smem),
              (lse_ref.at[vec], lse_smem), (delta_ref.at[vec], delta_smem),
              (segq_ref.at[b, pl.ds(q0, BLOCK)], segq_smem)], barrier)
    lse = _load_vector(lse_smem, 1, cast) * LOG2E
    delta = _load_vector(delta_smem, 1, cast)
    seg_q = _load_vector(segq_smem, 1, cast)

    def step(idx, kT_smem, vT_smem, k_smem, segkv_smem, dq):
      k0 = idx[0] * BLOCK
      s = _matmul(q_smem, kT_smem, BLOCK, BLOCK) * c
      seg_k = _load_vector(segkv_smem, 0, cast)
      allowed = _mask(seg_q, seg_k, q0, k0, causal, rows_are_queries=True, cast=cast)
      p = jnp.where(allowed, jnp.exp2(s - lax.broadcast_in_dim(lse, s.shape, [0])), 0.0)
      dp = _matmul(do_smem, vT_smem, BLOCK, BLOCK)
      ds = p * (dp - lax.broadcast_in_dim(delta, dp.shape, [0]))
      ds_smem[...] = ds.astype(dtype)
      plgpu.commit_smem()
      return dq + _matmul(ds_smem, k_smem, BLOCK, D)

    steps = pl.cdiv(q0 + BLOCK, BLOCK) if causal else T // BLOCK
    pipeline = plgpu.emit_pipeline(
        step, grid=(steps,), max_concurrent_steps=2,
        in_specs=[plgpu.BlockSpec((D, BLOCK), lambda j: (0, j), transforms=_transforms()),
                  plgpu.BlockSpec((D, BLOCK), lambda j: (0, j), transforms=_transforms()),
                  plgpu.BlockSpec((BLOCK, D), lambda j: (j, 0), transforms=_transforms()),
                  plgpu.BlockSpec((BLOCK,), lambda j: (j,))],
        init_carry=_zeros((BLOCK, D), cast))
    dq = pipeline(kT_ref.at[b, kvh], vT_ref.at[b, kvh], k_ref.at[b, :, kvh], segkv_ref.at[b])
    dq_smem[...] = (dq * scale).astype(dtype)
    _copy_out([(dq_smem, dq_ref.at[rows])])

  return plgpu.kernel(
      kernel, out_type=jax.ShapeDtypeStruct(q.shape, dtype),
      scratch_types=[_smem((BLOCK, D), dtype), _smem((BLOCK, D), dtype),
                     _smem((BLOCK, BLOCK), dtype), plgpu.SMEM((BLOCK,), jnp.float32),
                     plgpu.SMEM((BLOCK,), jnp.float32), plgpu.SMEM((BLOCK,), jnp.int32),
                     _smem((BLOCK, D), dtype), plgpu.Barrier(num_barriers=5)],
      grid=(H, S // BLOCK, B), grid_names=("heads", "q", "batch"),
      interpret=_interpret(interpret))(q, kT, vT, k, do, lse, delta, seg_q, seg_kv)


def _backward_dkv(k, v, qT, q, doT, do, lse, delta, seg_q, seg_kv, *, causal, scale, groups,
                  interpret):
  """dK and dV per query head: [B, T, H, D] each (summed over each group by the caller)."""
  plgpu = _mgpu()
  B, T, _, D = k.shape
  H, S = q.shape[2], q.shape[1]
  dtype = k.dtype
  c = scale * LOG2E
  cast = _caster(interpret)

  def kernel(k_ref, v_ref, qT_ref, q_ref, doT_ref, do_ref, lse_ref, delta_ref, segq_ref,
             segkv_ref, dk_ref, dv_ref, k_smem, v_smem, p_smem, ds_smem, segkv_smem, dk_smem,
             dv_smem, barrier):
    h, j, b = lax.axis_index("heads"), lax.axis_index("kv"), lax.axis_index("batch")
    kvh = lax.div(h, jnp.array(groups, h.dtype))
    k0 = j * BLOCK
    keys = (b, pl.ds(k0, BLOCK), kvh)
    _copy_in([(k_ref.at[keys], k_smem), (v_ref.at[keys], v_smem),
              (segkv_ref.at[b, pl.ds(k0, BLOCK)], segkv_smem)], barrier)
    seg_k = _load_vector(segkv_smem, 1, cast)
    first = j if causal else 0  # the first query tile that sees these keys

    def step(idx, qT_smem, q_smem, doT_smem, do_smem, lse_smem, delta_smem, segq_smem, carry):
      dk, dv = carry
      q0 = (first + idx[0]) * BLOCK
      sT = _matmul(k_smem, qT_smem, BLOCK, BLOCK) * c  # [keys, queries]
      lse = _load_vector(lse_smem, 0, cast) * LOG2E
      seg_q = _load_vector(segq_smem, 0, cast)
      allowed = _mask(seg_k, seg_q, k0, q0, causal, rows_are_queries=False, cast=cast)
      pT = jnp.where(allowed, jnp.exp2(sT - lax.broadcast_in_dim(lse, sT.shape, [1])), 0.0)
      p_smem[...] = pT.astype(dtype)
      dpT = _matmul(v_smem, doT_smem, BLOCK, BLOCK)
      delta = _load_vector(delta_smem, 0, cast)
      dsT = pT * (dpT - lax.broadcast_in_dim(delta, dpT.shape, [1]))
      ds_smem[...] = dsT.astype(dtype)
      plgpu.commit_smem()
      dv = dv + _matmul(p_smem, do_smem, BLOCK, D)
      dk = dk + _matmul(ds_smem, q_smem, BLOCK, D)
      return dk, dv

    tiled = lambda shape, index: plgpu.BlockSpec(shape, index, transforms=_transforms())
    vector = plgpu.BlockSpec((BLOCK,), lambda i: (first + i,))
    pipeline = plgpu.emit_pipeline(
        step, grid=(S // BLOCK - first,), max_concurrent_steps=2,
        in_specs=[tiled((D, BLOCK), lambda i: (0, first + i)),
                  tiled((BLOCK, D), lambda i: (first + i, 0)),
                  tiled((D, BLOCK), lambda i: (0, first + i)),
                  tiled((BLOCK, D), lambda i: (first + i, 0)), vector, vector, vector],
        init_carry=(_zeros((BLOCK, D), cast), _zeros((BLOCK, D), cast)))
    dk, dv = pipeline(qT_ref.at[b, h], q_ref.at[b, :, h], doT_ref.at[b, h], do_ref.at[b, :, h],
                      lse_ref.at[b, h], delta_ref.at[b, h], segq_ref.at[b])
    out = (b, pl.ds(k0, BLOCK), h)
    dk_smem[...] = (dk * scale).astype(dtype)
    dv_smem[...] = dv.astype(dtype)
    _copy_out([(dk_smem, dk_ref.at[out]), (dv_smem, dv_ref.at[out])])

  per_head = jax.ShapeDtypeStruct((B, T, H, D), dtype)
  return plgpu.kernel(
      kernel, out_type=(per_head, per_head),
      scratch_types=[_smem((BLOCK, D), dtype), _smem((BLOCK, D), dtype),
                     _smem((BLOCK, BLOCK), dtype), _smem((BLOCK, BLOCK), dtype),
                     plgpu.SMEM((BLOCK,), jnp.int32), _smem((BLOCK, D), dtype),
                     _smem((BLOCK, D), dtype), plgpu.Barrier(num_barriers=3)],
      grid=(H, T // BLOCK, B), grid_names=("heads", "kv", "batch"),
      interpret=_interpret(interpret))(k, v, qT, q, doT, do, lse, delta, seg_q, seg_kv)


# ----------------------------------------------------------------------------------------------
# The differentiable entry point


def _pad(x, length: int, value=0):
  extra = length - x.shape[1]
  if not extra:
    return x
  widths = [(0, 0)] * x.ndim
  widths[1] = (0, extra)
  return jnp.pad(x, widths, constant_values=value)


def flash_attention_mosaic(q, k, v, *, causal: bool = True, segment_ids=None,
                           interpret: bool = False):
  """q [B, S, H, D], k/v [B, T, K, D] (16-bit, D a multiple of 64, H a multiple of K),
  segment ids [B, S] (S == T) or None -> [B, S, H, D]. Differentiable (`jax.custom_vjp`).
  `interpret`: run the kernels in Pallas' Mosaic GPU interpreter (on a CPU: exact, slow)."""
  B, S, H, D = q.shape
  T, K = k.shape[1], k.shape[2]
  if not supports(D, q.dtype) or H % K or k.shape != v.shape or q.dtype != k.dtype:
    raise ValueError(f"flash_attention_mosaic: q {q.dtype}{q.shape}, k/v {k.dtype}{k.shape}: "
                     "needs 16-bit q/k/v of one dtype, head dim a multiple of 64, and query "
                     "heads a multiple of the kv heads")
  if segment_ids is not None and (S != T or segment_ids.shape != (B, S)):
    raise ValueError(f"flash_attention_mosaic: segment ids {segment_ids.shape} for q of "
                     f"length {S} and k of length {T}: give [B, S] ids for self-attention")
  return _attention(q, k, v, segment_ids, causal, D ** -0.5, interpret)


def _prepare(q, k, v, segment_ids):
  """Padded q, k, v (lengths a multiple of BLOCK) and segment ids with padding marked."""
  B, S = q.shape[:2]
  T = k.shape[1]
  Sp, Tp = -(-S // BLOCK) * BLOCK, -(-T // BLOCK) * BLOCK
  seg = jnp.zeros((B, S), jnp.int32) if segment_ids is None else segment_ids.astype(jnp.int32)
  seg_kv = jnp.zeros((B, T), jnp.int32) if segment_ids is None else seg
  return (_pad(q, Sp), _pad(k, Tp), _pad(v, Tp), _pad(seg, Sp, PAD_Q),
          _pad(seg_kv, Tp, PAD_KV))


@functools.partial(jax.custom_vjp, nondiff_argnums=(4, 5, 6))
def _attention(q, k, v, segment_ids, causal, scale, interpret):
  return _attention_fwd(q, k, v, segment_ids, causal, scale, interpret)[0]


def _attention_fwd(q, k, v, segment_ids, causal, scale, interpret):
  S = q.shape[1]
  qp, kp, vp, seg_q, seg_kv = _prepare(q, k, v, segment_ids)
  o, lse = _forward(qp, kp.transpose(0, 2, 3, 1), vp, seg_q, seg_kv, causal=causal,
                    scale=scale, groups=q.shape[2] // k.shape[2], interpret=interpret)
  return o[:, :S], (q, k, v, segment_ids, o, lse)


def _attention_bwd(causal, scale, interpret, residuals, do):
  q, k, v, segment_ids, o, lse = residuals
  B, S, H, D = q.shape
  T, K = k.shape[1], k.shape[2]
  qp, kp, vp, seg_q, seg_kv = _prepare(q, k, v, segment_ids)
  dop = _pad(do.astype(q.dtype), qp.shape[1])
  delta = jnp.einsum("bshd,bshd->bhs", o.astype(jnp.float32), dop.astype(jnp.float32))
  to_heads_d_len = lambda x: x.transpose(0, 2, 3, 1)  # [B, L, N, D] -> [B, N, D, L]
  kwargs = dict(causal=causal, scale=scale, groups=H // K, interpret=interpret)
  dq = _backward_dq(qp, to_heads_d_len(kp), to_heads_d_len(vp), kp, dop, lse, delta, seg_q,
                    seg_kv, **kwargs)
  dk, dv = _backward_dkv(kp, vp, to_heads_d_len(qp), qp, to_heads_d_len(dop), dop, lse, delta,
                         seg_q, seg_kv, **kwargs)
  group_sum = lambda x: x[:, :T].reshape(B, T, K, H // K, D).astype(jnp.float32).sum(
      axis=3).astype(k.dtype)
  return dq[:, :S], group_sum(dk), group_sum(dv), None


_attention.defvjp(_attention_fwd, _attention_bwd)

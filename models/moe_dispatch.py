"""Token dispatch of the MoE layer: sort by expert, grouped SwiGLU, all-to-all across devices.

`expert_ffn` runs the routed experts on [B, S, E] given each token's k expert ids and combine
weights. Per device (inside `shard_map` over the whole mesh when one is set):

  1. the T = B_local x S_local tokens are repeated k times and sorted by expert (dropped last);
  2. expert parallelism (experts split over ep > 1 devices): rows are packed per destination
     device and exchanged with `all_to_all`, computed there, and sent back the same way;
  3. grouped SwiGLU: `jax.lax.ragged_dot` or megablox's `gmm` (dropless), or a static
     [n, rows, E] buffer per expert with batched einsums (with a capacity);
  4. the outputs are unsorted, weighted and summed over the k choices in fp32.

Why and details: docs/moe.md#dispatch-and-expert-parallelism
"""
from __future__ import annotations

import functools
import math

import jax
import jax.numpy as jnp
from jax.experimental.pallas.ops.tpu.megablox import ops

from sharding.mesh import mesh_platform
from sharding.rules import logical_to_spec, spec_axes


def capacity_keep(experts_BSK, num_experts: int, capacity: int):
  """[B, S, k] bool: whether each assignment fits its expert's capacity in its sequence.
  Priority: all first choices in sequence order, then all second choices, and so on."""
  B, S, K = experts_BSK.shape
  flat_BA = experts_BSK.transpose(0, 2, 1).reshape(B, K * S)  # k-major
  onehot_BAN = jax.nn.one_hot(flat_BA, num_experts, dtype=jnp.int32)
  position_BA = jnp.sum((jnp.cumsum(onehot_BAN, axis=1) - 1) * onehot_BAN, axis=-1)
  return (position_BA < capacity).reshape(B, K, S).transpose(0, 2, 1)


def top_k_experts(probs_BSN, k: int):
  """Indices [B, S, k] of the k largest entries of the last axis (no gradient). Under a mesh
  each device takes its own tokens' (`shard_map`): XLA's partitioner would gather the whole
  batch onto every device for a top_k."""
  probs_BSN = jax.lax.stop_gradient(probs_BSN)
  mesh = jax.sharding.get_abstract_mesh()
  if mesh.empty:
    return jax.lax.top_k(probs_BSN, k)[1]
  spec = logical_to_spec(("act_batch", "act_seq", None))
  return jax.shard_map(lambda p: jax.lax.top_k(p, k)[1], mesh=mesh, in_specs=spec,
                       out_specs=spec)(probs_BSN)


def _group_sizes(expert_R, n: int):
  return jnp.sum(jax.nn.one_hot(expert_R, n, dtype=jnp.int32), axis=0)


IMPLS = ("ragged_dot", "megablox")
MEGABLOX_TILE = (512, 1024, 1024)  # (rows, contracted, output) tile of megablox's gmm on TPU


def _megablox(x_RE, w_nEF, sizes_n, valid_R):
  """megablox `gmm` on the rows of the groups. Rows past the groups come out of the kernel
  (and its backward pass) undefined, so they are zeroed on the way in and out: `where` passes
  no gradient to its unselected side."""
  R, E = x_RE.shape
  tm, tk, tn = MEGABLOX_TILE
  tm = min(tm, -(-R // 8) * 8)
  pad = -R % tm
  x = jnp.where(valid_R[:, None], x_RE, 0)
  x = jnp.pad(x, ((0, pad), (0, 0)))
  interpret = mesh_platform(jax.sharding.get_abstract_mesh()) != "tpu"
  y = ops.gmm(x, w_nEF, sizes_n, x_RE.dtype, (tm, min(tk, E), min(tn, w_nEF.shape[2])), None,
              None, False, interpret)
  return jnp.where(valid_R[:, None], y[:R], 0)


def grouped_swiglu(x_RE, expert_R, n: int, w_gate_nEF, w_up_nEF, w_down_nFE, rows: int,
                   impl: str = "ragged_dot"):
  """SwiGLU of rows sorted by expert (`expert_R` ascending; id n = no expert, output 0).
  `rows` = 0: grouped matmuls (`impl`) over the groups; > 0: each expert's rows in a
  [n, rows, E] buffer."""
  sizes_n = _group_sizes(expert_R, n)
  if not rows:
    if impl == "megablox":
      valid_R = expert_R < n
      mm = lambda x, w: _megablox(x, w, sizes_n, valid_R)
    else:
      mm = lambda x, w: jax.lax.ragged_dot(x, w, sizes_n)
    return mm(jax.nn.silu(mm(x_RE, w_gate_nEF)) * mm(x_RE, w_up_nEF), w_down_nFE)
  R, E = x_RE.shape
  starts_n = jnp.cumsum(sizes_n) - sizes_n
  rank_R = jnp.arange(R) - starts_n[jnp.minimum(expert_R, n - 1)]
  slot_R = jnp.where(expert_R < n, expert_R * rows + rank_R, n * rows)  # n * rows: no slot
  buf_nCE = jnp.zeros((n * rows, E), x_RE.dtype).at[slot_R].set(x_RE, mode="drop")
  buf_nCE = buf_nCE.reshape(n, rows, E)
  gate = jnp.einsum("nce,nef->ncf", buf_nCE, w_gate_nEF)
  up = jnp.einsum("nce,nef->ncf", buf_nCE, w_up_nEF)
  out_nCE = jnp.einsum("ncf,nfe->nce", jax.nn.silu(gate) * up, w_down_nFE)
  return out_nCE.reshape(n * rows, E).at[slot_R].get(mode="fill", fill_value=0)


def _exchange(x_AE, expert_A, w_gate, w_up, w_down, *, num_experts, rows, axes, ep, impl):
  """Step 2 of the module docstring: rows to the devices of their experts and back."""
  A, E = x_AE.shape
  n_local = num_experts // ep
  R = n_local * rows if rows else A  # room per destination
  dest_A = expert_A // n_local  # ep for dropped assignments
  counts = jnp.sum(jax.nn.one_hot(dest_A, ep, dtype=jnp.int32), axis=0)
  starts = jnp.cumsum(counts) - counts
  slot_A = jnp.where(dest_A < ep, dest_A * R + jnp.arange(A) - starts[jnp.minimum(dest_A, ep - 1)],
                     ep * R)
  send_x = jnp.zeros((ep * R, E), x_AE.dtype).at[slot_A].set(x_AE, mode="drop")
  send_e = jnp.full((ep * R,), n_local, jnp.int32).at[slot_A].set(
      (expert_A % n_local).astype(jnp.int32), mode="drop")
  recv_x = jax.lax.all_to_all(send_x, axes, 0, 0, tiled=True)
  recv_e = jax.lax.all_to_all(send_e, axes, 0, 0, tiled=True)
  order = jnp.argsort(recv_e, stable=True)
  y = grouped_swiglu(recv_x[order], recv_e[order], n_local, w_gate, w_up, w_down, rows * ep,
                     impl)
  y_back = jax.lax.all_to_all(y[jnp.argsort(order)], axes, 0, 0, tiled=True)
  return y_back.at[slot_A].get(mode="fill", fill_value=0)


def _local_ffn(x_BSE, experts_BSK, weights_BSK, w_gate, w_up, w_down, *, num_experts, capacity,
               expert_axes, ep, tensor_axes, impl):
  B, S, E = x_BSE.shape
  K = experts_BSK.shape[-1]
  T = B * S
  expert_A = experts_BSK.reshape(T * K)
  order_A = jnp.argsort(expert_A, stable=True)
  x_AE = x_BSE.reshape(T, E)[order_A // K]
  rows = capacity * B  # per-sequence capacity bounds a device's rows per expert
  if ep == 1:
    y_AE = grouped_swiglu(x_AE, expert_A[order_A], num_experts, w_gate, w_up, w_down, rows,
                          impl)
  else:
    y_AE = _exchange(x_AE, expert_A[order_A], w_gate, w_up, w_down, num_experts=num_experts,
                     rows=rows, axes=expert_axes, ep=ep, impl=impl)
  y_TKE = y_AE[jnp.argsort(order_A)].reshape(T, K, E).astype(jnp.float32)
  y_TE = jnp.einsum("tke,tk->te", y_TKE, weights_BSK.reshape(T, K).astype(jnp.float32))
  if tensor_axes:
    y_TE = jax.lax.psum(y_TE, tensor_axes)
  return y_TE.astype(x_BSE.dtype).reshape(B, S, E)


def expert_ffn(x_BSE, experts_BSK, weights_BSK, w_gate_NEF, w_up_NEF, w_down_NFE, *,
               capacity: int = 0, impl: str = "ragged_dot"):
  """The routed experts' output [B, S, E] (module docstring). `experts_BSK` = N marks a dropped
  assignment; `capacity` (per expert and sequence) > 0 selects the static-buffer path, else
  `impl` the grouped matmul."""
  num_experts = w_gate_NEF.shape[0]
  mesh = jax.sharding.get_abstract_mesh()
  kw = dict(num_experts=num_experts, capacity=capacity, impl=impl)
  if mesh.empty:
    return _local_ffn(x_BSE, experts_BSK, weights_BSK, w_gate_NEF, w_up_NEF, w_down_NFE,
                      expert_axes=(), ep=1, tensor_axes=(), **kw)
  tokens = logical_to_spec(("act_batch", "act_seq", None))
  w_in = logical_to_spec(("experts", None, "expert_mlp"))
  w_out = logical_to_spec(("experts", "expert_mlp", None))
  expert_axes = tuple(a for a in spec_axes(w_in[0]) if mesh.shape[a] > 1)
  tensor_axes = spec_axes(w_in[2])  # psum even over a size-1 axis: the output is then invariant
  fn = functools.partial(_local_ffn, expert_axes=expert_axes,
                         ep=math.prod(mesh.shape[a] for a in expert_axes),
                         tensor_axes=tensor_axes, **kw)
  # Pallas calls carry no varying-manual-axes types, so megablox runs unchecked (check_vma).
  return jax.shard_map(fn, mesh=mesh, in_specs=(tokens, tokens, tokens, w_in, w_in, w_out),
                       out_specs=tokens, check_vma=impl != "megablox")(x_BSE, experts_BSK, weights_BSK, w_gate_NEF, w_up_NEF,
                                         w_down_NFE)

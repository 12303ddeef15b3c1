"""The one table of logical axis names -> mesh axes.

Every parameter and every constrained activation in `models/` names its dimensions with the
logical names below; this table is the only place that says how they map onto the device mesh
(`stage, data, fsdp, tensor, sequence, expert`). Change a strategy by editing one row.

Parameters
  vocab     token vocabulary                      -> tensor (vocab-parallel embedding / logits)
  embed     model width d_model                   -> fsdp   (ZeRO-3: params + optimizer state)
  heads     query heads                           -> tensor (Megatron attention split)
  kv_heads  key/value heads (GQA)                 -> tensor
  head_dim  per-head width                        -> replicated
  mlp       feed-forward width                    -> tensor (Megatron MLP split)
  norm      RMSNorm scales                        -> replicated
  layers    the stacked (scanned) layer axis      -> stage  (pipeline stages; replicated at
                                                            mesh.stage=1, the default)
  experts   the experts of an MoE layer           -> expert (expert parallelism)
  expert_mlp  an expert's feed-forward width      -> tensor
The `expert` axis also splits the batch (BATCH_AXES), so expert parallelism is folded over
data parallelism: attention and dense layers see it as data parallel, the MoE layers exchange
tokens over it with all-to-all (models/moe_dispatch.py). Expert weights are also sharded over
`fsdp` on their embed dimension (ZeRO-3 like every weight).
Activations (prefixed `act_`): batch over every data-parallel axis, sequence over `sequence`,
heads / mlp / vocab over `tensor` so that they line up with the weights above.

Pipeline parallelism (`mesh.stage` S > 1, sharding/pipeline.py): the layer stack's `layers`
dimension is split over `stage`, so each stage's devices hold a contiguous block of L / S layers
of the stored stack (a circular schedule stores it in the order its stages use it, see
sharding/pipeline.py), and every other rule applies inside a stage unchanged. `act_stage` is the
leading [S] dimension of the pipeline's activation buffers, and the micro-batch dimension of its
inputs and outputs (each stage embeds and scores M / S of the micro-batches). Everything else
(embedding, head, norms' scales outside the stack) is replicated over `stage`.

DiLoCo (`optim.diloco.replicas` M, trainer/step/diloco.py) adds one more mesh axis, `replica`
(REPLICA_AXIS), outermost, that no logical name maps to: the replica-local train state carries a
leading [M] dimension over it, and the inner step runs once per replica (`jax.vmap` with
`spmd_axis_name`), so every rule above applies inside a replica unchanged.
"""
from __future__ import annotations

from collections.abc import Sequence

import jax
from jax.sharding import PartitionSpec as P

# `stage` first (outermost): pipeline stages exchange only activations, so they are the axis
# that may sit on the slowest links (mesh.dcn_stage: stages on different slices).
MESH_AXES = ("stage", "data", "fsdp", "tensor", "sequence", "expert")
STAGE_AXIS = "stage"
# DiLoCo's replicas (only in a DiLoCo run's mesh, before MESH_AXES): see the module docstring.
REPLICA_AXIS = "replica"
# Axes the batch is split over. `expert` joins data parallelism for dense models (as in MaxText),
# so no device idles when a dense model runs on a mesh that has an expert axis.
BATCH_AXES = ("data", "fsdp", "expert")

LOGICAL_RULES: tuple[tuple[str, str | tuple[str, ...] | None], ...] = (
    # parameters
    ("vocab", "tensor"),
    ("embed", "fsdp"),
    ("heads", "tensor"),
    ("kv_heads", "tensor"),
    ("head_dim", None),
    ("mlp", "tensor"),
    ("norm", None),
    ("layers", STAGE_AXIS),
    ("experts", "expert"),
    ("expert_mlp", "tensor"),
    # activations
    ("act_stage", STAGE_AXIS),
    ("act_batch", BATCH_AXES),
    ("act_seq", "sequence"),
    ("act_embed", None),
    ("act_heads", "tensor"),
    ("act_kv_heads", "tensor"),
    ("act_head_dim", None),
    ("act_mlp", "tensor"),
    ("act_vocab", "tensor"),
)
_RULES = dict(LOGICAL_RULES)


def logical_to_spec(names: Sequence[str | None]) -> P:
  """PartitionSpec for an array whose dimensions carry these logical names."""
  out = []
  for name in names:
    if name is not None and name not in _RULES:
      raise KeyError(f"logical axis {name!r} is not in sharding.rules.LOGICAL_RULES")
    out.append(None if name is None else _RULES[name])
  return P(*out)


def constrain(x: jax.Array, names: Sequence[str | None]) -> jax.Array:
  """`with_sharding_constraint` by logical names; a no-op outside a mesh context.

  Models call this at block boundaries. Under `jax.set_mesh(mesh)` (what the trainer does) the
  constraint pins the activation layout; in a plain single-device call it does nothing, so the
  same model code runs in unit tests without a mesh.
  """
  mesh = jax.sharding.get_abstract_mesh()
  if mesh.empty:
    return x
  spec = logical_to_spec(names)
  # Drop mesh axes of size 1 so the constraint never forces a pointless relayout.
  spec = P(*(_live_axes(entry, mesh) for entry in spec))
  return jax.lax.with_sharding_constraint(x, spec)


def spec_axes(entry) -> tuple[str, ...]:
  """The mesh axes of one PartitionSpec entry (None, a name, or a tuple of names) as a tuple."""
  if entry is None:
    return ()
  return (entry,) if isinstance(entry, str) else tuple(entry)


def _live_axes(entry, mesh):
  axes = tuple(a for a in spec_axes(entry) if mesh.shape.get(a, 1) > 1)
  if not axes:
    return None
  return axes[0] if len(axes) == 1 else axes

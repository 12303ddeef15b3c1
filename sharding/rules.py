"""The one table of logical axis names -> mesh axes (`stage, data, fsdp, tensor, sequence, expert`).

  vocab, heads, kv_heads, mlp, expert_mlp  -> tensor   (Megatron; vocab-parallel embedding)
  embed                                    -> fsdp     (ZeRO-3: params + optimizer state)
  layers                                   -> stage    (pipeline; replicated at mesh.stage=1)
  experts                                  -> expert   (expert parallelism)
  head_dim, norm                           -> replicated
  act_*   activations: batch over every data-parallel axis (BATCH_AXES, `expert` included),
          sequence over `sequence`, heads / mlp / vocab over `tensor`, act_stage over `stage`

Every parameter and constrained activation in `models/` names its dimensions with these names;
change a strategy by editing one row. DiLoCo's mesh axis `replica` (REPLICA_AXIS) is no rule's:
every rule applies inside a replica. Why and details: docs/sharding.md#the-rule-table
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

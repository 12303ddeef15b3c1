"""Device meshes, the logical->mesh rule table, and ring attention over the sequence axis
(its zig-zag layout and jnp blocks in sharding/zigzag.py and sharding/ring_blocks.py)."""
from sharding.batch import assemble, process_rows
from sharding.mesh import (DCN_AXES, MeshError, batch_sharding, data_parallel_size, make_mesh,
                           num_slices, replicated, resolve_mesh, resolve_mesh_shape)
from sharding.ring_attention import ring_attention, ring_work
from sharding.zigzag import zigzag, zigzag_order
from sharding.rules import BATCH_AXES, LOGICAL_RULES, MESH_AXES, constrain, logical_to_spec

__all__ = [
    "BATCH_AXES", "DCN_AXES", "LOGICAL_RULES", "MESH_AXES", "MeshError", "assemble",
    "batch_sharding", "constrain", "process_rows",
    "data_parallel_size", "logical_to_spec", "make_mesh", "num_slices", "replicated",
    "resolve_mesh", "resolve_mesh_shape",
    "ring_attention", "ring_work", "zigzag", "zigzag_order",
]

"""Device meshes, the logical->mesh rule table, and (later) ring attention."""
from sharding.mesh import (MeshError, batch_sharding, data_parallel_size, make_mesh, replicated,
                           resolve_mesh_shape)
from sharding.rules import BATCH_AXES, LOGICAL_RULES, MESH_AXES, constrain, logical_to_spec

__all__ = [
    "BATCH_AXES", "LOGICAL_RULES", "MESH_AXES", "MeshError", "batch_sharding", "constrain",
    "data_parallel_size", "logical_to_spec", "make_mesh", "replicated", "resolve_mesh_shape",
]

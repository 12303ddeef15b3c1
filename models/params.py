"""What every model module builds its weights with: the dtype names of the config and a
parameter annotated with logical axis names (the trainer applies the sharding)."""
from __future__ import annotations

import jax.numpy as jnp
from flax import nnx

DTYPES = {"float32": jnp.float32, "bfloat16": jnp.bfloat16, "float16": jnp.float16}


def param(rngs: nnx.Rngs, init, shape, names, dtype) -> nnx.Param:
  """A parameter annotated with logical axis names (sharding is applied by the trainer)."""
  return nnx.Param(init(rngs.params(), shape, dtype), out_sharding=names, eager_sharding=False)

"""The train state and how it is created directly sharded on the mesh.

The state is a plain pytree: the step, the parameters as a nested dict of arrays (NNX's pure
dict, so paths read like `blocks/attn/wq_EHD`), and the optax state. The model's structure
(`graphdef`) stays outside; `nnx.merge(graphdef, params)` rebuilds the module inside the step.
Randomness: the parameters are initialised from `seed` and the data order is shuffled from
`seed` (data/pipeline.py); a train step draws no random numbers (no dropout), so the state
holds no RNG key and resuming needs none.

Creation never materialises the model on one device: the abstract model gives every
parameter's logical names, `sharding/rules.py` turns them into NamedShardings, and the
initialiser is jitted with those as `out_shardings`, so each device computes only its shard.
"""
from __future__ import annotations

import itertools
from typing import Any

import flax
import jax
import jax.numpy as jnp
import optax
from flax import nnx
from jax.sharding import Mesh, NamedSharding
from jax.sharding import PartitionSpec as P

from models.llama import ModelConfig, Transformer
from sharding.rules import LOGICAL_RULES


@flax.struct.dataclass
class TrainState:
  step: jax.Array  # int32 scalar: optimizer updates applied so far
  params: Any  # nested dict of arrays
  opt_state: Any
  guard: Any  # counters of the non-finite / loss-spike guard (trainer/step/train_step.py)


def _logical_names(abstract_state) -> Any:
  """Pure-dict tree of each parameter's logical axis names."""
  return nnx.to_pure_dict(jax.tree.map(
      lambda v: tuple(v.get_metadata().get("out_sharding") or (None,) * v.ndim),
      abstract_state, is_leaf=lambda x: isinstance(x, nnx.Variable)))


def init_guard() -> dict[str, jax.Array]:
  """Counters of the non-finite / loss-spike guard (see trainer/step/train_step.py)."""
  return {"skipped": jnp.zeros((), jnp.int32), "good_steps": jnp.zeros((), jnp.int32),
          "loss_mean": jnp.zeros((), jnp.float32), "loss_var": jnp.zeros((), jnp.float32)}


class ModelSpec:
  """Everything about the model the trainer needs, computed once without allocating it."""

  def __init__(self, model_cfg: ModelConfig, mesh: Mesh, seed: int, pipeline=None):
    self.cfg = model_cfg
    self.mesh = mesh
    self.seed = seed
    # A `sharding.pipeline.Pipeline` when the layers run in stages over `mesh.stage` (the train
    # and eval steps then go through trainer/step/pipelined.py); None: the plain layer scan.
    self.pipeline = pipeline
    make = lambda: Transformer(model_cfg, rngs=nnx.Rngs(params=seed))
    with nnx.logical_axis_rules(LOGICAL_RULES):
      abstract_model = nnx.eval_shape(make)
      self.graphdef, abstract_state = nnx.split(abstract_model)
      specs = nnx.to_pure_dict(nnx.get_partition_spec(abstract_state))
    self.logical_names = _logical_names(abstract_state)
    self.param_shardings = jax.tree.map(lambda s: NamedSharding(mesh, s), specs)
    self.abstract_params = jax.tree.map(
        lambda v, s: jax.ShapeDtypeStruct(v.shape, v.dtype, sharding=s),
        nnx.to_pure_dict(abstract_state), self.param_shardings)
    self.make_model = make  # builds a fresh (concrete) Transformer; call under jit

  def model(self, params) -> Transformer:
    return nnx.merge(self.graphdef, params)


def state_shardings(spec: ModelSpec, tx: optax.GradientTransformation) -> TrainState:
  """NamedShardings of the whole TrainState, the optimizer state's from `optimizer_shardings`."""
  replicated = NamedSharding(spec.mesh, P())
  guard = jax.tree.map(lambda _: replicated, init_guard())
  return TrainState(step=replicated, params=spec.param_shardings,
                    opt_state=optimizer_shardings(spec, tx), guard=guard)


def optimizer_shardings(spec: ModelSpec, tx: optax.GradientTransformation) -> Any:
  """NamedShardings of `tx`'s state for the model's parameters, derived from its own shapes.

  Each optimizer-state leaf that lives under a parameter's path (Adam's moments, Adafactor's
  factored statistics, the parameter EMA, ...) is matched to that parameter: a leaf of the
  parameter's shape takes its sharding (under FSDP, moments are sharded like the weights); a
  leaf that keeps some of the parameter's dimensions (Adafactor's row and column statistics of a
  [layers, E, F] matrix are [layers, E] and [layers, F]) is sharded along the dimensions it keeps,
  as the parameter is along them. Everything else (counts, scalars, Adafactor's placeholder
  [1] leaves of unfactored parameters) is replicated.
  """
  replicated = NamedSharding(spec.mesh, P())
  abstract_opt = jax.eval_shape(tx.init, spec.abstract_params)
  params = {tuple(path): (leaf.shape, sharding.spec) for (path, leaf), sharding in zip(
      jax.tree_util.tree_leaves_with_path(spec.abstract_params),
      jax.tree.leaves(spec.param_shardings))}

  def shard(path, leaf):
    trail = len(path)
    while trail and isinstance(path[trail - 1], jax.tree_util.DictKey):
      trail -= 1
    match = params.get(tuple(path[trail:]))
    if match is None or not leaf.shape:
      return replicated
    spec_ = _kept_dims_spec(leaf.shape, *match)
    return replicated if spec_ is None else NamedSharding(spec.mesh, spec_)

  return jax.tree_util.tree_map_with_path(shard, abstract_opt)


def _kept_dims_spec(shape, param_shape, param_spec) -> P | None:
  """The PartitionSpec of an array whose dimensions are some of a parameter's, in order (the
  parameter's spec on those dimensions); None when no such choice exists or two choices give
  different specs (e.g. a square matrix's row and column statistics)."""
  entries = tuple(param_spec) + (None,) * (len(param_shape) - len(tuple(param_spec)))
  if tuple(shape) == tuple(param_shape):
    return P(*entries)
  found = set()
  for kept in itertools.combinations(range(len(param_shape)), len(shape)):
    if all(param_shape[k] == n for k, n in zip(kept, shape)):
      found.add(tuple(entries[k] for k in kept))
  return P(*found.pop()) if len(found) == 1 else None


def fresh_state(tx: optax.GradientTransformation, params) -> TrainState:
  """Step 0 at `params`: a fresh optimizer state and guard (traceable: `init_sharded` and
  `jax.eval_shape` call it; a DiLoCo state builds each replica's part from it)."""
  return TrainState(step=jnp.zeros((), jnp.int32), params=params, opt_state=tx.init(params),
                    guard=init_guard())


def with_shardings(shapes, shardings):
  """`shapes` (ShapeDtypeStructs, e.g. `jax.eval_shape`'s) carrying `shardings` (a tree of the
  same structure): the abstract state a checkpoint is restored into."""
  return jax.tree.map(lambda a, s: jax.ShapeDtypeStruct(a.shape, a.dtype, sharding=s),
                      shapes, shardings)


def init_sharded(spec: ModelSpec, build, shardings, params=None):
  """`build(params)`, a state made from the model's parameters, jitted straight into
  `shardings`: from `params` (laid out as `spec.param_shardings`), or from the model initialised
  from the seed inside the same program, so each device computes only its shards."""
  if params is not None:
    return jax.jit(build, in_shardings=(spec.param_shardings,), out_shardings=shardings)(params)
  init = lambda: build(nnx.to_pure_dict(nnx.state(spec.make_model(), nnx.Param)))
  return jax.jit(init, out_shardings=shardings)()


def abstract_state(spec: ModelSpec, tx: optax.GradientTransformation) -> TrainState:
  """ShapeDtypeStructs (with target shardings) of the TrainState, for restoring checkpoints."""
  return with_shardings(jax.eval_shape(lambda p: fresh_state(tx, p), spec.abstract_params),
                        state_shardings(spec, tx))


def init_state(spec: ModelSpec, tx: optax.GradientTransformation, params=None) -> TrainState:
  """A fresh state; with `params` (e.g. from another run) only the optimizer state is new."""
  return init_sharded(spec, lambda p: fresh_state(tx, p), state_shardings(spec, tx), params)

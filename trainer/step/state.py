"""The train state and how it is created directly sharded on the mesh.

The state is a plain pytree: the step, the parameters as a nested dict of arrays (NNX's pure
dict, so paths read like `blocks/attn/wq_EHD`), and the optax state; a model with batch
statistics (models/resnet.py) adds them (`StatefulTrainState`). The model's structure
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
import numpy as np
import optax
from flax import nnx
from jax.sharding import Mesh, NamedSharding
from jax.sharding import PartitionSpec as P

from data.pipeline import BATCH_KEYS
from models.llama import ModelConfig, Transformer
from models.resnet import ResNet1D, ResNetConfig
from models.resnet import batch_layout as resnet_batch_layout
from sharding.rules import LOGICAL_RULES


@flax.struct.dataclass
class TrainState:
  step: jax.Array  # int32 scalar: optimizer updates applied so far
  params: Any  # nested dict of arrays
  opt_state: Any
  guard: Any  # counters of the non-finite / loss-spike guard (trainer/step/train_step.py)


@flax.struct.dataclass
class StatefulTrainState(TrainState):
  """The state of a model with non-parameter state (models/resnet.py: batch-norm running
  statistics, NNX `BatchStat`s as a pure dict), which the train step carries and checkpoints
  hold; the LM's TrainState (and its checkpoints) stay as they are."""
  model_state: Any = None


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
    cls = ResNet1D if isinstance(model_cfg, ResNetConfig) else Transformer
    make = lambda: cls(model_cfg, rngs=nnx.Rngs(params=seed))
    with nnx.logical_axis_rules(LOGICAL_RULES):
      abstract_model = nnx.eval_shape(make)
      self.graphdef, abstract_state, _ = nnx.split(abstract_model, nnx.Param, ...)
      specs = nnx.to_pure_dict(nnx.get_partition_spec(abstract_state))
    self.logical_names = _logical_names(abstract_state)
    self.param_shardings = jax.tree.map(lambda s: NamedSharding(mesh, s), specs)
    self.abstract_params = jax.tree.map(
        lambda v, s: jax.ShapeDtypeStruct(v.shape, v.dtype, sharding=s),
        nnx.to_pure_dict(abstract_state), self.param_shardings)
    # The non-parameter state (batch-norm statistics; None: the LM has none), replicated.
    rest = nnx.to_pure_dict(nnx.state(abstract_model, nnx.BatchStat)) or None
    self.model_state_shardings = jax.tree.map(lambda _: NamedSharding(mesh, P()), rest)
    self.abstract_model_state = jax.tree.map(
        lambda v, s: jax.ShapeDtypeStruct(v.shape, v.dtype, sharding=s), rest,
        self.model_state_shardings)
    self.make_model = make  # builds a fresh (concrete) model; call under jit

  def model(self, params, model_state=None) -> Transformer | ResNet1D:
    return nnx.merge(self.graphdef, params, *([model_state] if model_state is not None else []))

  def batch_layout(self, seq_len: int) -> dict[str, tuple[int, type]]:
    """{key: (width, dtype)} of the rows of a batch [M, B, width] the model trains on."""
    if isinstance(self.cfg, ResNetConfig):
      return resnet_batch_layout(seq_len)
    return {k: (seq_len, np.bool_ if k == "loss_mask" else np.int32) for k in BATCH_KEYS}


def state_shardings(spec: ModelSpec, tx: optax.GradientTransformation) -> TrainState:
  """NamedShardings of the whole TrainState, the optimizer state's from `optimizer_shardings`."""
  replicated = NamedSharding(spec.mesh, P())
  guard = jax.tree.map(lambda _: replicated, init_guard())
  state = TrainState(step=replicated, params=spec.param_shardings,
                     opt_state=optimizer_shardings(spec, tx), guard=guard)
  return _with_model_state(state, spec.model_state_shardings)


def _with_model_state(state: TrainState, model_state) -> TrainState:
  """`state` carrying `model_state` (a StatefulTrainState), or as it is when that is None."""
  if model_state is None:
    return state
  return StatefulTrainState(**{f: getattr(state, f) for f in ("step", "params", "opt_state",
                                                              "guard")}, model_state=model_state)


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


def fresh_state(tx: optax.GradientTransformation, params, model_state=None) -> TrainState:
  """Step 0 at `params` (and `model_state`, a model's non-parameter state): a fresh optimizer
  state and guard (traceable: `init_sharded` and `jax.eval_shape` call it; a DiLoCo state
  builds each replica's part from it)."""
  return _with_model_state(TrainState(step=jnp.zeros((), jnp.int32), params=params,
                                      opt_state=tx.init(params), guard=init_guard()),
                           model_state)


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
  return with_shardings(jax.eval_shape(lambda p, s: fresh_state(tx, p, s), spec.abstract_params,
                                      spec.abstract_model_state), state_shardings(spec, tx))


def init_state(spec: ModelSpec, tx: optax.GradientTransformation, params=None) -> TrainState:
  """A fresh state; with `params` (e.g. from another run) only the optimizer state is new."""
  if spec.abstract_model_state is not None and params is None:  # with the model's own state

    def build():
      model = spec.make_model()
      pure = lambda kind: nnx.to_pure_dict(nnx.state(model, kind))
      return fresh_state(tx, pure(nnx.Param), pure(nnx.BatchStat))

    return jax.jit(build, out_shardings=state_shardings(spec, tx))()
  return init_sharded(spec, lambda p: fresh_state(tx, p), state_shardings(spec, tx), params)

"""Muon: orthogonalised momentum for the matrices, a fallback optimizer for everything else.

Each matrix keeps a Nesterov momentum M of its gradient and steps along its orthogonalisation
(five quintic Newton-Schulz iterations on M / ||M||_F, optax's), times `optim.muon.rms` x
sqrt(max(fan_in, fan_out)) (rms 0: Jordan's sqrt(max(1, fan_out / fan_in))); under muP
`mup_shape_scale`. Matrices and their input and output axes come from the logical axis names:

  [layers|experts, ..., core axes]   stack axes: each slice its own matrix (vmapped)
  [embed, *out] reads the residual stream, [*in, embed] writes it, no embed: [in, out]
  a `vocab` axis or < 2 core axes    the fallback (`optim.muon.fallback`, AdamW)

Newton-Schulz runs in a layout of its own (`ns_path`): each matrix whole on a device, the
mesh axes of its matrix dimensions moved onto the stack axes one all-to-all at a time.
Why and details: docs/muon.md#how-it-works-optimmuonpy, docs/muon.md#hyperparameters,
docs/muon.md#sharding-and-what-it-communicates.
"""
from __future__ import annotations

import math
from typing import Any

import jax
import jax.numpy as jnp
import optax
from jax.sharding import PartitionSpec as P
from optax.contrib import MuonDimensionNumbers, MuonState
# optax's, not re-exported by optax.contrib (optax 0.2.8)
from optax.contrib._muon import orthogonalize_via_newton_schulz, scale_by_shape
from optax.transforms import MaskedNode

from sharding.rules import constrain, logical_to_spec, spec_axes

STACK_AXES = ("layers", "experts")  # batch axes: every slice is its own matrix
NS_COEFFS = (3.4445, -4.7750, 2.0315)  # Jordan's quintic (optax's default)


def _is_names(x) -> bool:
  return isinstance(x, tuple) and all(isinstance(n, (str, type(None))) for n in x)


def dimension_numbers(names: tuple) -> MuonDimensionNumbers | None:
  """The matrix a parameter with these logical axis names is, for Muon (input axes
  `reduction_axis`, output axes `output_axis`, every other axis a stack axis), or None when the
  fallback optimizer takes it (module docstring)."""
  core = [i for i, n in enumerate(names) if n not in STACK_AXES]
  if len(core) < 2 or "vocab" in names:
    return None
  if names[core[0]] == "embed":
    inputs, outputs = core[:1], core[1:]
  elif names[core[-1]] == "embed":
    inputs, outputs = core[:-1], core[-1:]
  elif len(core) == 2:
    inputs, outputs = core[:1], core[1:]
  else:
    raise ValueError(f"Muon cannot tell the input from the output axes of a weight named "
                     f"{names}: name an `embed` axis, or make it [in, out]")
  return MuonDimensionNumbers(reduction_axis=tuple(inputs), output_axis=tuple(outputs))


def labels(param_names: Any) -> Any:
  """'muon' or 'fallback' per parameter (the params' structure)."""
  return jax.tree.map(lambda n: "fallback" if dimension_numbers(n) is None else "muon",
                      param_names, is_leaf=_is_names)


def fan_in_out(shape, dims: MuonDimensionNumbers) -> tuple[int, int]:
  """(fan_in, fan_out) of one matrix slice of a parameter of this shape."""
  return (math.prod(shape[a] for a in dims.reduction_axis),
          math.prod(shape[a] for a in dims.output_axis))


def base_scale(fan_in: float, fan_out: float, rms: float) -> float:
  """The shape factor of an orthogonalised update: rms x sqrt(max(fan_in, fan_out)) (its RMS
  is then `rms`, AdamW's), or for rms 0 Jordan's sqrt(max(1, fan_out / fan_in)) (optax's
  `scale_by_shape`)."""
  return rms * math.sqrt(max(fan_in, fan_out)) if rms > 0 else math.sqrt(max(1.0, fan_out / fan_in))


def mup_shape_scale(names: tuple, dims: MuonDimensionNumbers, shape, rms: float,
                    width_multiplier: float) -> float:
  """muP's factor for Muon (the spectral condition of Yang, Simon and Bernstein 2023, as
  Megatron-LM #3715 and MaxText's `muon_consistent_rms`): the orthogonalised update (spectral
  norm 1) times sqrt(fan_out / fan_in), so the step's spectral norm keeps its ratio to the
  weight's at every width; the constant is the one that gives `base_scale` at the base width,
  where every fan-in or fan-out that has an axis other than `experts` or an unnamed one (the
  router's expert axis) is 1/m of this one. A hidden matrix whose both sides scale with width
  keeps its base-width factor: rms x sqrt(max) / sqrt(m) against its SP step."""
  fan_in, fan_out = fan_in_out(shape, dims)
  scales = lambda axes: any(names[a] not in (None, "experts") for a in axes)
  base_in = fan_in / width_multiplier if scales(dims.reduction_axis) else fan_in
  base_out = fan_out / width_multiplier if scales(dims.output_axis) else fan_out
  return base_scale(base_in, base_out, rms) * math.sqrt((fan_out / fan_in) / (base_out / base_in))


def ns_path(names: tuple, dims: MuonDimensionNumbers, shape, mesh) -> list[P]:
  """The layouts a parameter's momentum passes through on its way to the one it is
  orthogonalised in (the last; module docstring), one mesh axis moved per layout. The mesh axes
  on the matrix dimensions move: each to a stack dimension that it divides together with the
  axes already there (a stack dimension keeps its own axes: an `experts` dimension on `expert`
  stays there), largest first; the ones that divide no stack dimension are gathered last. One
  axis per step, because the partitioner turns a move of two axes at once into a gather of the
  whole array."""
  live = lambda e: tuple(a for a in spec_axes(e) if mesh.shape.get(a, 1) > 1)
  spec = [live(e) for e in logical_to_spec(names)] + [()] * (len(shape) - len(names))
  matrix = set(dims.reduction_axis) | set(dims.output_axis)
  axes = sorted((a for d in sorted(matrix) for a in spec[d]), key=lambda a: -mesh.shape[a])
  moves = []  # (mesh axis, the stack dimension it goes to, or None: gathered)
  for d in (d for d in range(len(shape)) if d not in matrix):
    size = math.prod(mesh.shape[a] for a in spec[d])  # what already shards it
    for a in list(axes):
      if shape[d] % (size * mesh.shape[a]) == 0:
        size *= mesh.shape[a]
        moves.append((a, d))
        axes.remove(a)
  moves += [(a, None) for a in axes]
  path = []
  for a, to in moves:
    spec = [tuple(x for x in e if x != a) for e in spec]
    if to is not None:
      spec[to] = spec[to] + (a,)
    path.append(P(*(None if not e else e[0] if len(e) == 1 else e for e in spec)))
  return path


def ns_spec(names: tuple, dims: MuonDimensionNumbers, shape, mesh) -> P:
  """The layout a parameter's momentum is orthogonalised in (the end of `ns_path`)."""
  path = ns_path(names, dims, shape, mesh)
  return path[-1] if path else P(*logical_to_spec(names))


def scale_by_muon(param_names: Any, *, beta: float = 0.95, ns_steps: int = 5,
                  nesterov: bool = True, rms: float = 0.2, eps: float = 1e-8,
                  width_multiplier: float = 1.0) -> optax.GradientTransformation:
  """Muon's direction for the matrices of `param_names` (a tree of logical axis names): momentum,
  Newton-Schulz in its own layout (`ns_path`), the shape scaling (muP's, `mup_shape_scale`,
  when `width_multiplier` != 1); no learning rate. The other
  parameters must be masked out (`muon` below does so with `optax.partition`, which leaves a
  `MaskedNode` where they were).

  optax's `scale_by_muon` with the layout added: the same momentum and Nesterov combination, the
  same state (optax's MuonState), optax's `orthogonalize_via_newton_schulz` and `scale_by_shape`
  (consistent RMS when rms > 0)."""
  masked = lambda x: isinstance(x, MaskedNode)
  dims = jax.tree.map(lambda n: dimension_numbers(n) or MaskedNode(), param_names,
                      is_leaf=_is_names)

  def orthogonalize(x, names, dim, coeffs):
    mesh = jax.sharding.get_abstract_mesh()
    path = [] if mesh.empty else ns_path(names, dim, x.shape, mesh)
    for spec in path:  # there, one mesh axis at a time
      x = jax.lax.with_sharding_constraint(x, spec)
    x = orthogonalize_via_newton_schulz(x, coeffs, ns_steps, eps=eps, dimension_numbers=dim)
    # Back the same way. Its first step pins the output too: left free, the partitioner carries
    # the parameter's layout back into the iterations (and all-reduces a partial X X^T in each).
    for spec in path[::-1]:
      x = jax.lax.with_sharding_constraint(x, spec)
    return constrain(x, names)  # the parameter's layout

  def init(params):
    return MuonState(count=jnp.zeros([], jnp.int32), mu=optax.tree.zeros_like(params),
                     ns_coeffs=jnp.asarray(NS_COEFFS))

  def update(updates, state, params=None):
    del params
    mu = optax.tree.update_moment(updates, state.mu, beta, 1)
    count = optax.safe_increment(state.count)
    if nesterov:
      mu_hat = jax.tree.map(
          lambda m, g: beta * m + (1 - beta) * g,
          optax.tree.bias_correction(mu, beta, optax.safe_increment(count)),
          optax.tree.bias_correction(updates, beta, count))
    else:
      mu_hat = optax.tree.bias_correction(mu, beta, count)
    out = jax.tree.map(
        lambda d, x, n: x if masked(d) else orthogonalize(x, n, d, state.ns_coeffs), dims,
        mu_hat, param_names, is_leaf=lambda x: isinstance(x, (MuonDimensionNumbers, MaskedNode)))
    return out, MuonState(count=count, mu=mu, ns_coeffs=state.ns_coeffs)

  if width_multiplier == 1.0:
    shape_scaling = scale_by_shape(weight_dimension_numbers=dims,
                                   consistent_rms=rms if rms > 0 else None)
  else:
    def mup_update(updates, state, params=None):
      del params
      scale = lambda d, x, n: x if masked(d) else x * jnp.asarray(
          mup_shape_scale(n, d, x.shape, rms, width_multiplier), x.dtype)
      return jax.tree.map(scale, dims, updates, param_names, is_leaf=lambda x: isinstance(
          x, (MuonDimensionNumbers, MaskedNode))), state

    shape_scaling = optax.GradientTransformation(optax.init_empty_state, mup_update)
  return optax.chain(optax.GradientTransformation(init, update), shape_scaling)


def muon(param_names: Any, fallback: optax.GradientTransformation, **muon_args
         ) -> optax.GradientTransformationExtraArgs:
  """Muon's direction on the matrices, `fallback`'s (a direction, no learning rate) elsewhere;
  the caller adds weight decay and the learning rate after it, as for every optimizer
  (optim/factory.py). The state is optax's: a PartitionState with a MuonState (count, mu shaped
  like the matrices, ns_coeffs) and the fallback's state."""
  return optax.partition({"muon": scale_by_muon(param_names, **muon_args),
                          "fallback": fallback}, labels(param_names))

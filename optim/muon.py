"""Muon: orthogonalised momentum for the matrices, a fallback optimizer for everything else.

Muon (Jordan et al. 2024, "Muon: An optimizer for hidden layers in neural networks"; Liu et al.
2025, "Muon is Scalable for LLM Training") keeps a Nesterov momentum M of each weight matrix's
gradient and steps along its orthogonalisation, the polar factor U V^T of M = U S V^T,
approximated by five quintic Newton-Schulz iterations on M / ||M||_F (optax's
`orthogonalize_via_newton_schulz`, coefficients (3.4445, -4.7750, 2.0315); its singular values
come out in ~[0.7, 1.2], not exactly 1, which the paper shows does not hurt). Parameters that are
not matrices (norm scales, biases) and the embedding table and LM head go to a fallback
optimizer (`optim.muon.fallback`, AdamW by default), as in both papers.

Which weights are matrices, and which of their axes are the matrix's input and output, is read
from the logical axis names the model annotates and `sharding/rules.py` maps (no reshaping of
the parameters, no per-model table):

  * stack axes, `layers` (the scanned layer stack) and `experts` (an MoE layer's experts), are
    batch axes: each slice is its own matrix (optax vmaps over them), so a scanned [layers, ...]
    stack gets exactly the update its layers would get one by one in an unrolled model;
  * of the remaining (core) axes, a weight lays out its input axes first and its output axes
    last (`models/llama.py:dense`), and every matrix of the model reads from or writes to the
    residual stream: [embed, *out] reads it (wq [embed, heads, head_dim]: one embed x
    (heads*head_dim) matrix, heads folded into the output dimension; w_gate, w_up, the router
    [embed, experts]), [*in, embed] writes it (wo [heads, head_dim, embed], w_down
    [mlp, embed]); a weight without an embed axis and exactly two core axes is [in, out];
  * a weight with a `vocab` axis (the embedding table, the LM head) and anything with fewer than
    two core axes goes to the fallback.

The model keeps q, k, v and gate, up as separate weights, so each projection is orthogonalised on
its own, never their concatenation (Muon on a fused [E, 3HD] qkv weight would couple the three).

Update size (`optim.muon.rms`). With rms = r > 0 the orthogonalised update of a fan_in x fan_out
matrix is multiplied by r sqrt(max(fan_in, fan_out)) (Liu et al. 2025, eq. 4: an orthogonal
matrix's RMS is 1/sqrt(max(...)), so the update's RMS becomes r; r = 0.2 matches AdamW's typical
update RMS of 0.2-0.4), so an AdamW config's learning rate and weight decay carry over
unchanged, also to the fallback parameters, which share the one learning rate. rms = 0 is
Jordan's original scaling, sqrt(max(1, fan_out / fan_in)), with which Muon needs its own,
larger learning rate (0.02 in modded-nanogpt). Weight decay is the factory's for every
optimizer: w -= lr * (update + wd * w), Liu et al.'s decoupled decay.

Sharding. Nothing here knows about the mesh: each matrix is orthogonalised as the array it is,
and XLA's SPMD partitioner runs the Newton-Schulz matmuls on the sharded operands (X X^T
contracts the fsdp-sharded embed axis: a partial product per device and an all-reduce of the
small Gram matrix; see docs/muon.md for what a compiled step communicates, counted).
"""
from __future__ import annotations

import math
from typing import Any

import jax
import optax
from optax.contrib import MuonDimensionNumbers
from optax.contrib import scale_by_muon as optax_scale_by_muon
from optax.contrib._muon import scale_by_shape  # optax's, not re-exported (optax 0.2.8)
from optax.transforms import MaskedNode

STACK_AXES = ("layers", "experts")  # batch axes: every slice is its own matrix
FALLBACKS = ("adamw", "adafactor", "lion")  # optimizers whose step does not scale with the grad


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


def scale_by_muon(param_names: Any, *, beta: float = 0.95, ns_steps: int = 5,
                  nesterov: bool = True, rms: float = 0.2, eps: float = 1e-8
                  ) -> optax.GradientTransformation:
  """Muon's direction for the matrices of `param_names` (a tree of logical axis names): momentum,
  Newton-Schulz, the shape scaling; the other parameters must be masked out (`muon` below does
  so with `optax.partition`, which leaves a `MaskedNode` where they were). No learning rate."""
  dims = jax.tree.map(lambda n: dimension_numbers(n) or MaskedNode(), param_names,
                      is_leaf=_is_names)
  return optax.chain(
      optax_scale_by_muon(beta=beta, ns_steps=ns_steps, nesterov=nesterov, eps=eps,
                          weight_dimension_numbers=dims),
      scale_by_shape(weight_dimension_numbers=dims, consistent_rms=rms if rms > 0 else None))


def muon(param_names: Any, fallback: optax.GradientTransformation, **muon_args
         ) -> optax.GradientTransformationExtraArgs:
  """Muon's direction on the matrices, `fallback`'s (a direction, no learning rate) elsewhere;
  the caller adds weight decay and the learning rate after it, as for every optimizer
  (optim/factory.py). The state is optax's: a PartitionState with a MuonState (count, mu shaped
  like the matrices, ns_coeffs) and the fallback's state."""
  return optax.partition({"muon": scale_by_muon(param_names, **muon_args),
                          "fallback": fallback}, labels(param_names))

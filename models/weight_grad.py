"""The backward of a layer split in two for the zero-bubble pipeline (sharding/pipeline_vjp.py):
B, the input gradient, now, and W, the weight gradient, later. The split is at the layer's
`dense` matmuls (models/llama.py), through a tape active while the layer is traced:

  shapes  record each matmul's input X and output Y (their shapes, for the buffers)
  B       each matmul's weight enters without gradient and a zero "tap" is added to its output:
          the VJP with respect to (layer input, taps) gives dX of the layer and, per matmul,
          dY; the tape also returns the matmuls' inputs X (one per distinct input: q, k, v
          share theirs). Weights outside matmuls (norm scales, MoE routers and experts) get
          their gradient here.
  W       the layer traced again with every matmul on its recorded input: the gradient of
          sum_i <X_i W_i, dY_i> with respect to the weights is each matmul's X_i^T dY_i
          (the rest of the layer does not reach the objective and is left out by XLA)

Why and details: docs/pipeline.md#zero-bubble-the-backward-split-in-two
"""
from __future__ import annotations

import contextlib

import jax
import jax.numpy as jnp

_ACTIVE: list["Tape"] = []


class Tape:
  """One layer's tape: mode "shapes", "B" (`taps`: a zero per matmul output) or "W"
  (`inputs`: the recorded inputs, `cotangents`: dY per matmul)."""

  def __init__(self, mode: str, taps=None, inputs=None, cotangents=None, index=None):
    self.mode, self.taps, self.given, self.cotangents = mode, taps, inputs, cotangents
    self.index = [] if index is None else index  # matmul i reads recorded input index[i]
    self.inputs, self.outputs, self.objective = [], [], jnp.zeros((), jnp.float32)
    self._seen, self._calls = {}, 0

  def matmul(self, fn, x, w, key):
    i = self._calls
    self._calls += 1
    if self.mode == "W":
      y = fn(self.given[self.index[i]], w)
      self.objective = self.objective + jnp.sum(
          y.astype(jnp.float32) * self.cotangents[i].astype(jnp.float32))
      return y
    if id(key) not in self._seen:  # `key`: the tensor the input was reshaped from
      self._seen[id(key)] = (len(self.inputs), key)
      self.inputs.append(x)
    if self.mode == "shapes":
      self.index.append(self._seen[id(key)][0])
    y = fn(x, jax.lax.stop_gradient(w))
    self.outputs.append(y)
    return y + self.taps[i] if self.mode == "B" else y

  def passed(self, out):
    """The layer's outputs as the next layer gets them: in W without gradient, so that the
    layer loop's transpose carries no (zero) cotangent through the layers."""
    return jax.lax.stop_gradient(out) if self.mode == "W" else out

  def result(self):
    """What the layer returns besides its output: the inputs (B), the objective (W), the
    inputs and outputs (shapes)."""
    return {"B": lambda: self.inputs, "W": lambda: self.objective,
            "shapes": lambda: (self.inputs, self.outputs)}[self.mode]()


@contextlib.contextmanager
def active(tape: Tape | None):
  """`tape` records the matmuls traced inside (none if None)."""
  if tape is None:
    yield None
    return
  _ACTIVE.append(tape)
  try:
    yield tape
  finally:
    _ACTIVE.pop()


def matmul(fn, x, w, key):
  """`fn(x, w)`, through the active tape if a layer is being split (module docstring)."""
  return fn(x, w) if not _ACTIVE else _ACTIVE[-1].matmul(fn, x, w, key)

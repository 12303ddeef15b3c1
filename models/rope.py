"""Rotary position embedding (Su et al. 2021) in the rotate-half layout of Hugging Face Llama
checkpoints, with Llama 3.1's frequency scaling: the frequencies, the sin/cos tables the model
makes once per forward pass for all layers, and the rotation."""
from __future__ import annotations

import dataclasses
from typing import NamedTuple

import jax
import jax.numpy as jnp

ROPE_SCALING_TYPES = ("none", "llama3")


@dataclasses.dataclass(frozen=True)
class RopeScaling:
  """RoPE frequency scaling. "llama3" is Llama 3.1's context extension: wavelengths longer than
  original_max_position_embeddings / low_freq_factor are slowed by `factor`, shorter than
  .../high_freq_factor kept, and the band between interpolated smoothly."""
  type: str = "none"
  factor: float = 8.0
  low_freq_factor: float = 1.0
  high_freq_factor: float = 4.0
  original_max_position_embeddings: int = 8192


def rope_inv_freq(d: int, theta: float, scaling: RopeScaling = RopeScaling()):
  """The d/2 rotation frequencies, with Llama 3 scaling applied when configured (the same
  formula as Meta's reference and transformers' `_compute_llama3_parameters`)."""
  inv_freq = 1.0 / (theta ** (jnp.arange(0, d, 2, dtype=jnp.float32) / d))
  if scaling.type == "none":
    return inv_freq
  if scaling.type != "llama3":
    raise ValueError(f"model.rope_scaling.type={scaling.type!r}: use one of {ROPE_SCALING_TYPES}")
  old_len, lo, hi = (scaling.original_max_position_embeddings, scaling.low_freq_factor,
                     scaling.high_freq_factor)
  wavelen = 2 * jnp.pi / inv_freq
  scaled = jnp.where(wavelen > old_len / lo, inv_freq / scaling.factor, inv_freq)
  smooth = (old_len / wavelen - lo) / (hi - lo)
  smoothed = (1 - smooth) * scaled / scaling.factor + smooth * scaled
  medium = (wavelen >= old_len / hi) & (wavelen <= old_len / lo)
  return jnp.where(medium, smoothed, scaled)


class RopeTables(NamedTuple):
  """sin and cos of the RoPE angles [B, S, 1, D/2], fp32, made once per forward pass by
  `Transformer.hidden` for all layers (`rope_tables`; XLA does not hoist them out of the layer
  scan)."""
  sin: jax.Array
  cos: jax.Array


def _sin_cos(positions, inv_freq_d):
  angles = positions[..., None].astype(jnp.float32) * inv_freq_d
  return jnp.sin(angles), jnp.cos(angles)


def rope_tables(positions_BS, d: int, theta: float, scaling: RopeScaling = RopeScaling(), *,
                buffer: bool = False) -> RopeTables:
  """The tables for `positions_BS`. Computed in place, XLA fuses sin and cos into every layer's
  rotation (forward and backward) and evaluates them again there for every head. With `buffer`
  they are made once as buffers instead (what CPU programs want; tests/test_model.py counts the
  sine ops): when every position lies in [0, S) (the training rows: positions restart at 0 in
  each document) looked up in one [S, d/2] table, else computed for each position, both inside
  a `lax.cond`, whose results are buffers."""
  S = positions_BS.shape[1]
  inv_freq = rope_inv_freq(d, theta, scaling)
  if not buffer:
    sin, cos = _sin_cos(positions_BS, inv_freq)
    return RopeTables(sin[:, :, None, :], cos[:, :, None, :])

  def looked_up(p):
    sin_Sd, cos_Sd = _sin_cos(jnp.arange(S), inv_freq)
    return sin_Sd[p], cos_Sd[p]

  inside = jnp.all((positions_BS >= 0) & (positions_BS < S))
  sin, cos = jax.lax.cond(inside, looked_up, lambda p: _sin_cos(p, inv_freq), positions_BS)
  return RopeTables(sin[:, :, None, :], cos[:, :, None, :])


def apply_rope(x_BSHD, positions_BS, theta: float, scaling: RopeScaling = RopeScaling()):
  """Rotary position embedding (Su et al. 2021), rotate-half form (the layout of Hugging Face
  Llama checkpoints: dims i and i + D/2 rotate together), computed in fp32. `positions_BS`:
  the positions [B, S], or their `rope_tables`."""
  # Given positions (e.g. one decoded token per row), the tables are computed in place: they are
  # as small as what they rotate.
  tables = positions_BS if isinstance(positions_BS, RopeTables) else rope_tables(
      positions_BS, x_BSHD.shape[-1], theta, scaling)
  sin, cos = tables.sin, tables.cos
  x1, x2 = jnp.split(x_BSHD.astype(jnp.float32), 2, axis=-1)
  out = jnp.concatenate([x1 * cos - x2 * sin, x2 * cos + x1 * sin], axis=-1)
  return out.astype(x_BSHD.dtype)

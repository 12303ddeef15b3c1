"""The coordinate check across depth (`python -m tools.coord_check --axis depth`): how much the
residual stream moves in a few steps, against the number of layers L, under each depth
parametrization (models/llama.py: "standard", "depth_mup" alpha 1/2, "completep" alpha 1).

Per depth parametrization and L, the same-width Llama model (same seed, same batches) trains
`steps` AdamW steps at one rate, and after every step the mean absolute change since init of
every block's output (the residual stream after it) and of the logits is recorded on one fixed
batch. The summary rows are the stream at relative depths 1/4, 1/2 and 1 (`x(L)`, the final
residual stream, which the final norm and head read) and the logits; their slope against log L
at the last step is ~0 when the updates' effect does not grow with depth (CompleteP: each of
the L branches moves by ~1/L), clearly positive under "standard" (each moves by ~1, the sum
grows). Setup and results: docs/mup.md#depth-completep-and-depth-mup
"""
from __future__ import annotations

import numpy as np

from tools import figures
from tools.sweeps import Setup, batches, model_config, slope, train

DEPTH_PARAMETRIZATIONS = ("standard", "depth_mup", "completep")
SUMMARY = ("x(L/4)", "x(L/2)", "x(L)", "logits")


def block_outputs(model, batch):
  """(every block's output stacked [L, B, S, E], logits [B, S, V]) of `batch`, through the
  model's own layer scan inputs (RoPE tables, masks) and blocks."""
  from flax import nnx  # noqa: PLC0415  start-up
  from models.llama import layer_inputs  # noqa: PLC0415  start-up
  rope, segments = layer_inputs(model.cfg, batch["positions"], batch["segment_ids"])

  def layer(x_BSE, block):
    y_BSE = block(x_BSE, rope, segments)
    return y_BSE, y_BSE

  run = nnx.scan(layer, in_axes=(nnx.Carry, 0), out_axes=(nnx.Carry, 0),
                 transform_metadata={nnx.PARTITION_NAME: "layers"})
  x_BSE, ys_LBSE = run(model.embed(batch["inputs"]), model.blocks)
  return ys_LBSE, model.logits(model.final_norm(x_BSE))


def summary_block(name: str, depth: int) -> int:
  """The block index whose output a SUMMARY row of a depth-L model reads (x(L/2): block
  round(L / 2) - 1)."""
  frac = {"x(L/4)": 0.25, "x(L/2)": 0.5, "x(L)": 1.0}[name]
  return max(1, round(frac * depth)) - 1


def changes(model0, model, batch) -> dict:
  """Mean |change since init| of every block's output (`block{i}`), of the SUMMARY rows and of
  the logits, on `batch`."""
  import jax.numpy as jnp  # noqa: PLC0415  start-up
  ys0, logits0 = block_outputs(model0, batch)
  ys, logits = block_outputs(model, batch)
  per_block = jnp.mean(jnp.abs(ys - ys0), axis=(1, 2, 3))
  depth = ys.shape[0]
  out = {f"block{i}": per_block[i] for i in range(depth)}
  out.update({k: per_block[summary_block(k, depth)] for k in SUMMARY[:3]})
  out["logits"] = jnp.mean(jnp.abs(logits - logits0))
  return out


def depth_check(setup: Setup, width: int, depths, steps: int, lr: float,
                parametrizations=DEPTH_PARAMETRIZATIONS) -> list[dict]:
  """Rows {depth_parametrization, depth, step, layer, value} (step 0 = at init, all zero),
  relative to `setup.base_depth`."""
  data = batches(setup, steps)
  rows = []
  for par in parametrizations:
    for depth in depths:
      mcfg = model_config(setup, width, "sp", layers=depth, depth_parametrization=par)
      result, = train(setup, mcfg, [lr], data, probe=changes)
      for t, acts in enumerate(result["acts"]):
        rows.extend({"depth_parametrization": par, "depth": depth, "step": t, "layer": k,
                     "value": v} for k, v in acts.items())
  return rows


def depth_slopes(rows: list[dict], step: int | None = None) -> dict[tuple[str, str], float]:
  """{(depth parametrization, SUMMARY row): slope of log(change) against log(L)} at `step`
  (default: the last)."""
  step = max(r["step"] for r in rows) if step is None else step
  out = {}
  for par in dict.fromkeys(r["depth_parametrization"] for r in rows):
    for layer in SUMMARY:
      pts = sorted((r["depth"], r["value"]) for r in rows if r["depth_parametrization"] == par
                   and r["layer"] == layer and r["step"] == step)
      if pts:
        out[(par, layer)] = slope([d for d, _ in pts], [v for _, v in pts])
  return out


def plot_depth(path: str, rows: list[dict], title: str) -> bool:
  plt = figures.pyplot()
  if plt is None:
    return False
  last = max(r["step"] for r in rows)
  pars = list(dict.fromkeys(r["depth_parametrization"] for r in rows))
  fig, axes = plt.subplots(1, len(pars), figsize=(5.0 * len(pars), 4.2), sharey=True)
  axes = np.atleast_1d(axes)
  s = depth_slopes(rows)
  for ax, par in zip(axes, pars):
    for layer in SUMMARY:
      pts = sorted((r["depth"], r["value"]) for r in rows if r["depth_parametrization"] == par
                   and r["layer"] == layer and r["step"] == last)
      ax.plot([d for d, _ in pts], [v for _, v in pts], "o-",
              label=f"{layer} (slope {s[(par, layer)]:+.2f})")
    ax.set_xscale("log", base=2)
    ax.set_yscale("log")
    ax.set_xlabel("depth L (layers)")
    ax.set_title(f"{par}: after {last} Adam steps")
    ax.grid(alpha=0.3, which="both")
    ax.legend(fontsize=8)
  axes[0].set_ylabel("mean |change since init|")
  figures.save(fig, path, title)
  return True

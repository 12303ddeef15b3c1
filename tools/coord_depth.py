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


from tools.sweeps import Setup, batches, model_config, plot_panels, slopes_over, train

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
  return slopes_over(rows, "depth", "depth_parametrization", SUMMARY, step)


def plot_depth(path: str, rows: list[dict], title: str) -> bool:
  return plot_panels(path, rows, "depth", "depth_parametrization",
                     list(dict.fromkeys(r["depth_parametrization"] for r in rows)), SUMMARY,
                     xlabel="depth L (layers)", ylabel="mean |change since init|", title=title,
                     panel_width=5.0, panel_title=lambda par, last: f"{par}: after {last} Adam steps")

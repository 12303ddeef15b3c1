"""What every sweep of tools.coord_check, tools.coord_depth and tools.lr_transfer shares: the
setting (`Setup`), its batches, its model and optimizer configs, and the training loop that runs
one model at several learning rates through one compiled step (`train`)."""
from __future__ import annotations

import dataclasses

import numpy as np

from tools import figures
from data.prepare import ensure_default_corpus
from data.tokenizer import VOCAB_SIZE
from trainer.config import default_config


@dataclasses.dataclass(frozen=True)
class Setup:
  """The shared setting of every run of a width sweep."""
  base_width: int = 32
  base_depth: int = 2  # the depth parametrizations' L_base (--axis depth)
  num_layers: int = 2
  num_heads: int = 4
  seq_len: int = 64
  batch_size: int = 16
  init_std: float = 0.02
  seed: int = 0
  b2: float = 0.99


def batches(setup: Setup, steps: int) -> dict[str, np.ndarray]:
  """[steps + 1, B, S] batches of the embedded corpus as a training run reads it (the data order
  of data/pipeline.py with the setup's seed, byte tokens; nothing downloaded): one per training
  step, then the fixed probe batch."""
  from data import pipeline  # noqa: PLC0415  start-up
  it = iter(pipeline.dataset(pipeline.StreamSpec(
      ensure_default_corpus(), "train", setup.seq_len, setup.batch_size, seed=setup.seed)))
  drawn = [next(it) for _ in range(steps + 1)]
  return {k: np.stack([b[k] for b in drawn]) for k in pipeline.BATCH_KEYS}


def model_config(setup: Setup, width: int, parametrization: str, layers: int | None = None,
                 depth_parametrization: str = "standard"):
  from models.llama import ModelConfig  # noqa: PLC0415  start-up
  return ModelConfig(vocab_size=VOCAB_SIZE, d_model=width,
                     num_layers=layers or setup.num_layers, num_heads=setup.num_heads,
                     num_kv_heads=setup.num_heads, mlp_dim=3 * width, init_std=setup.init_std,
                     parametrization=parametrization, base_width=setup.base_width,
                     depth_parametrization=depth_parametrization, base_depth=setup.base_depth)


def optim_config(setup: Setup, lr: float, name: str = "adamw", fallback_lr: float = 0.0):
  """AdamW (or Muon, with its AdamW fallback, at `fallback_lr` when > 0) at rate `lr`,
  constant, no decay or clipping."""
  o = default_config().optim
  o.update(name=name, learning_rate=lr, b2=setup.b2, schedule="constant", warmup_steps=0,
           weight_decay=0.0, clip_norm=0.0)
  o.muon.fallback_lr = fallback_lr
  return o


def train(setup: Setup, mcfg, lrs, data: dict[str, np.ndarray], *, probe=None,
          optim: str = "adamw", fallback_lr: float = 0.0, muon_lr: float = 0.0) -> list[dict]:
  """Trains one model of config `mcfg` per learning rate in `lrs` on the batches of `data` but
  its last (one batch per step, [steps + 1, B, S] arrays) and returns per rate {"loss": [per
  step], "acts": [at init, then after every step: probe(model at init, model now, the probe
  batch, the last), a dict of scalars]} (acts empty without `probe`; `activations` measures
  each layer's mean |x|).

  The optimizer is the project's (`build_optimizer` with muP's width multiplier and the depth
  parametrization's rules), AdamW or Muon (`optim`), built once at learning rate 1 with a
  constant schedule and no weight decay; each run multiplies its update by its rate, which is
  exactly the optimizer at that rate in this setting and lets all rates share one compiled
  step. Muon's `fallback_lr` > 0 holds its fallback at that rate: the optimizer is built with
  it (learning rate 1) and the rate multiplies only Muon's matrices; `muon_lr` > 0 holds the
  matrices there instead (built at it, fallback_lr 1) and `lrs` are the fallback's."""
  import jax  # noqa: PLC0415  start-up
  import jax.numpy as jnp  # noqa: PLC0415  start-up
  from flax import nnx  # noqa: PLC0415  start-up
  from models.llama import Transformer  # noqa: PLC0415  start-up
  from optim import build_optimizer  # noqa: PLC0415  start-up
  from trainer.step.state import _logical_names  # noqa: PLC0415  start-up

  graphdef, state = nnx.split(Transformer(mcfg, rngs=nnx.Rngs(setup.seed)))
  from optim.muon import labels  # noqa: PLC0415  start-up

  names = _logical_names(state)
  held = "" if optim != "muon" else "muon" if muon_lr > 0 else "fallback" if fallback_lr > 0 \
      else ""  # the group whose rate is in the update already
  built = (muon_lr, 1.0) if held == "muon" else (1.0, fallback_lr)
  tx, _ = build_optimizer(optim_config(setup, built[0], optim, built[1]), names,
                          len(data["inputs"]) - 1, width_multiplier=mcfg.width_multiplier,
                          depth=mcfg.depth_scaling)
  swept = jax.tree.map(lambda label: label != held, labels(names))

  def loss_fn(params, batch):
    m = nnx.merge(graphdef, params)
    total, count = m.loss_sums(batch["inputs"], batch["positions"], batch["segment_ids"],
                               batch["targets"], batch["loss_mask"])
    return total / count

  @jax.jit
  def step(params, opt_state, batch, n, lr):
    loss, grads = jax.value_and_grad(loss_fn)(params, batch)
    updates, opt_state = tx.update(grads, opt_state, params, step=n)
    return jax.tree.map(lambda p, u, k: p + lr * u if k else p + u, params, updates,
                        swept), opt_state, loss

  @jax.jit
  def measure(params0, params, batch):
    return probe(nnx.merge(graphdef, params0), nnx.merge(graphdef, params), batch)

  steps = len(data["inputs"]) - 1
  at = lambda n: {k: v[n] for k, v in data.items()}
  results = []
  for lr in lrs:
    params0 = params = nnx.to_pure_dict(state)
    opt_state = tx.init(params)
    losses, acts = [], []
    if probe:
      acts.append({k: float(v) for k, v in measure(params0, params, at(steps)).items()})
    for n in range(steps):
      params, opt_state, loss = step(params, opt_state, at(n), jnp.int32(n), jnp.float32(lr))
      losses.append(float(loss))
      if probe:
        acts.append({k: float(v) for k, v in measure(params0, params, at(steps)).items()})
    results.append({"loss": losses, "acts": acts})
  return results


def slope(widths, values) -> float:
  """Least-squares slope of log(value) against log(width): 0 is flat, 1 is linear growth."""
  return float(np.polyfit(np.log(widths), np.log(values), 1)[0])


def curve(rows: list[dict], x: str, by: str, par: str, layer: str, step: int):
  """[(x, value)] of one parametrization's `layer` at `step`, sorted by x (`by`: the rows' key
  naming the parametrization, `x`: the swept size, width or depth)."""
  return sorted((r[x], r["value"]) for r in rows
                if r[by] == par and r["layer"] == layer and r["step"] == step)


def slopes_over(rows: list[dict], x: str, by: str, layers, step: int | None = None
                ) -> dict[tuple[str, str], float]:
  """{(parametrization, layer): `slope` of the value over the swept size x} at `step` (default:
  the last)."""
  step = max(r["step"] for r in rows) if step is None else step
  out = {}
  for par in dict.fromkeys(r[by] for r in rows):
    for layer in layers:
      pts = curve(rows, x, by, par, layer, step)
      if pts:
        out[(par, layer)] = slope([a for a, _ in pts], [v for _, v in pts])
  return out


def plot_panels(path: str, rows: list[dict], x: str, by: str, pars, layers, *, xlabel: str,
                ylabel: str, panel_title, title: str, panel_width: float) -> bool:
  """One log-log panel per parametrization: each layer's value at the last step against the swept
  size, labelled with its slope; False without matplotlib."""
  plt = figures.pyplot()
  if plt is None:
    return False
  last = max(r["step"] for r in rows)
  fig, axes = plt.subplots(1, len(pars), figsize=(panel_width * len(pars), 4.2), sharey=True)
  axes = np.atleast_1d(axes)
  s = slopes_over(rows, x, by, layers, last)
  for ax, par in zip(axes, pars):
    for layer in layers:
      pts = curve(rows, x, by, par, layer, last)
      ax.plot([a for a, _ in pts], [v for _, v in pts], "o-",
              label=f"{layer} (slope {s[(par, layer)]:+.2f})")
    ax.set_xscale("log", base=2)
    ax.set_yscale("log")
    ax.set_xlabel(xlabel)
    ax.set_title(panel_title(par, last))
    ax.grid(alpha=0.3, which="both")
    ax.legend(fontsize=8)
  axes[0].set_ylabel(ylabel)
  figures.save(fig, path, title)
  return True

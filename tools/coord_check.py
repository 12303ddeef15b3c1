"""muP coordinate check (Tensor Programs V, Sec. 5 / Fig. 5): activation size per layer after a
few Adam (or Muon) steps, across widths, under SP and muP; or across depth (`--axis depth`,
tools/coord_depth.py) under the depth parametrizations.

    python -m tools.coord_check [--widths 32,64,128,256] [--base_width 32] [--steps 8] \\
        [--lr 0.01] [--optim adamw|muon] [--out runs/coord_check]
    python -m tools.coord_check --axis depth [--depths 2,4,8,16,32] [--base_depth 2] \\
        [--width 64] [--steps 10] [--lr 0.01]

Per parametrization and width d_model, the same Llama model (same seed, same batches) trains
`--steps` AdamW steps, and after every step the mean absolute coordinate of each layer's output
(embedding, every block's residual stream, logits) on one fixed batch is recorded; the slope
of log(activation) against log(width) at the last step is printed. Outputs in `--out`:
`coord_check.csv`, `coord_check.png` (needs matplotlib, the `tools` extra). Deterministic.
Setup and results: docs/mup.md#coordinate-check-and-learning-rate-transfer
"""
from __future__ import annotations

import os
import sys
import time


from tools import coord_depth, figures
from tools.sweeps import Setup, batches, model_config, plot_panels, slopes_over, train
from trainer.config import ConfigError
from trainer.config.cli import CliParser
from trainer.multihost import platforms


def activations(model, batch) -> dict[str, "jax.Array"]:  # noqa: F821
  """Mean |x| of the embedding, of each block's output (residual stream) and of the logits."""
  import jax  # noqa: PLC0415  start-up
  import jax.numpy as jnp  # noqa: PLC0415  start-up
  from flax import nnx  # noqa: PLC0415  start-up
  from models.llama import Block  # noqa: PLC0415  start-up
  cfg = model.cfg
  positions_BS, segments_BS = batch["positions"], batch["segment_ids"]
  x_BSE = model.embed(batch["inputs"])
  out = {"embed": jnp.mean(jnp.abs(x_BSE))}
  one_block = nnx.graphdef(nnx.eval_shape(lambda: Block(cfg, rngs=nnx.Rngs(0))))
  stacked = nnx.state(model.blocks)
  for i in range(cfg.num_layers):
    block = nnx.merge(one_block, jax.tree.map(lambda a, i=i: a[i], stacked))
    x_BSE = block(x_BSE, positions_BS, segments_BS)
    out[f"block{i}"] = jnp.mean(jnp.abs(x_BSE))
  out["logits"] = jnp.mean(jnp.abs(model.logits(model.final_norm(x_BSE))))
  return out


def coord_check(setup: Setup, widths, steps: int, lr: float,
                parametrizations=("sp", "mup"), optim: str = "adamw") -> list[dict]:
  """Rows {parametrization, width, step, layer, value} (step 0 = at init)."""
  data = batches(setup, steps)
  rows = []
  for par in parametrizations:
    for width in widths:
      result, = train(setup, model_config(setup, width, par), [lr], data,
                      probe=lambda m0, m, b: activations(m, b), optim=optim)
      for t, acts in enumerate(result["acts"]):
        rows.extend({"parametrization": par, "width": width, "step": t, "layer": k, "value": v}
                    for k, v in acts.items())
  return rows


def slopes(rows: list[dict], step: int | None = None) -> dict[tuple[str, str], float]:
  """{(parametrization, layer): slope over widths} at `step` (default: the last)."""
  return slopes_over(rows, "width", "parametrization", dict.fromkeys(r["layer"] for r in rows),
                     step)


def plot(path: str, rows: list[dict], title: str) -> bool:
  return plot_panels(path, rows, "width", "parametrization",
                     sorted({r["parametrization"] for r in rows}, reverse=True),  # sp, mup
                     list(dict.fromkeys(r["layer"] for r in rows)), xlabel="width d_model",
                     ylabel="mean |activation|", title=title, panel_width=5.5,
                     panel_title=lambda par, last: f"{par.upper()}: after {last} steps")


def sweep_parser(prog: str, doc: str, *, steps: int, out: str):
  """The options of every sweep (this tool and tools.lr_transfer)."""
  p = CliParser(prog, doc, config=False)
  p.add_argument("--axis", default="width", choices=("width", "depth"),
                 help="width: --widths at --layers; depth: --depths at --width")
  p.add_argument("--widths", default="32,64,128,256")
  p.add_argument("--base_width", type=int, default=32)
  p.add_argument("--depths", default="2,4,8,16,32")
  p.add_argument("--base_depth", type=int, default=2)
  p.add_argument("--width", type=int, default=64, help="d_model of --axis depth")
  p.add_argument("--optim", default="adamw", choices=("adamw", "muon"),
                 help="muon: --axis width only (CompleteP's rules are Adam's)")
  p.add_argument("--steps", type=int, default=steps)
  p.add_argument("--layers", type=int, default=2)
  p.add_argument("--out", default=out)
  return p


def _ints(p, flag: str, text: str) -> list[int]:
  try:
    return sorted({int(w) for w in text.split(",") if w})
  except ValueError:
    p.error(f"{flag} takes comma-separated integers, not {text!r}")


def parse_sweep_args(p, argv):
  """Parse; --widths becomes a sorted list of at least two multiples of num_heads=4 (and
  --base_width and --width one), --depths a sorted list of at least two depths >= 1 (and
  --base_depth one), --steps >= 1, and no --config.* overrides. A mistake is one ConfigError."""
  args, overrides = p.parse(argv)
  if overrides:
    p.error("this tool takes no --config.* overrides")
  args.widths = _ints(p, "--widths", args.widths)
  args.depths = _ints(p, "--depths", args.depths)
  bad = [w for w in args.widths + [args.base_width, args.width] if w < 4 or w % 4]
  if bad or args.steps < 1 or len(args.widths) < 2:
    p.error("--widths needs at least two multiples of num_heads=4 (and --base_width and "
            "--width one), --steps >= 1")
  if len(args.depths) < 2 or min(args.depths + [args.base_depth]) < 1:
    p.error("--depths needs at least two depths >= 1 (and --base_depth >= 1)")
  if args.axis == "depth" and args.optim != "adamw":
    p.error(f"--axis depth --optim {args.optim}: the depth parametrizations' rules are "
            "CompleteP's for Adam; use --optim adamw")
  return args


def start(parse_args, argv):
  """(args, Setup, start time) of a sweep, its --out created; None after printing a
  command-line mistake in one line (the caller exits with 2)."""
  platforms.choose()
  try:
    args = parse_args(argv)
  except ConfigError as e:
    print(f"error: {e}", file=sys.stderr)
    return None
  os.makedirs(args.out, exist_ok=True)
  return args, Setup(base_width=args.base_width, base_depth=args.base_depth,
                     num_layers=args.layers), time.perf_counter()


def build_parser():
  p = sweep_parser("-m tools.coord_check", __doc__, steps=8,
                   out=os.path.join("runs", "coord_check"))
  p.add_argument("--lr", type=float, default=0.01)
  return p


def parse_args(argv):
  return parse_sweep_args(build_parser(), argv)


def main_depth(args, setup: Setup, t0: float) -> int:
  rows = coord_depth.depth_check(setup, args.width, args.depths, args.steps, args.lr)
  figures.write_csv(os.path.join(args.out, "coord_check_depth.csv"), rows)
  png = os.path.join(args.out, "coord_check_depth.png")
  plotted = coord_depth.plot_depth(
      png, rows, f"depth coordinate check: AdamW lr {args.lr:g}, width {args.width}, base "
      f"depth {args.base_depth}, batch {setup.batch_size}x{setup.seq_len} tokens")
  s = coord_depth.depth_slopes(rows)
  pars = coord_depth.DEPTH_PARAMETRIZATIONS
  print(f"[coord_check] mean |change| slope vs depth (log-log) after {args.steps} steps:")
  print(f"[coord_check] {'row':8s} " + " ".join(f"{p:>10s}" for p in pars))
  for layer in coord_depth.SUMMARY:
    print(f"[coord_check] {layer:8s} " + " ".join(f"{s[(p, layer)]:+10.2f}" for p in pars))
  print(f"[coord_check] {time.perf_counter() - t0:.0f}s; wrote {args.out}/coord_check_depth.csv"
        + (f", {png}" if plotted else figures.NO_PLOT))
  return 0


def main(argv: list[str]) -> int:
  started = start(parse_args, argv)
  if started is None:
    return 2
  args, setup, t0 = started
  if args.axis == "depth":
    return main_depth(args, setup, t0)
  rows = coord_check(setup, args.widths, args.steps, args.lr, optim=args.optim)
  name = "coord_check" if args.optim == "adamw" else f"coord_check_{args.optim}"
  figures.write_csv(os.path.join(args.out, f"{name}.csv"), rows)
  png = os.path.join(args.out, f"{name}.png")
  plotted = plot(png, rows, f"coordinate check: {args.optim} lr {args.lr:g}, base width "
                 f"{args.base_width}, {args.layers} layers, batch {setup.batch_size}x"
                 f"{setup.seq_len} tokens of the embedded corpus")
  print(f"[coord_check] mean |x| slope vs width (log-log) after {args.steps} {args.optim} "
        "steps:")
  print(f"[coord_check] {'layer':8s} {'sp':>7s} {'mup':>7s}")
  s = slopes(rows)
  for layer in dict.fromkeys(r["layer"] for r in rows):
    print(f"[coord_check] {layer:8s} {s[('sp', layer)]:+7.2f} {s[('mup', layer)]:+7.2f}")
  print(f"[coord_check] {time.perf_counter() - t0:.0f}s; wrote {args.out}/{name}.csv"
        + (f", {png}" if plotted else figures.NO_PLOT))
  return 0


if __name__ == "__main__":
  sys.exit(main(sys.argv[1:]))

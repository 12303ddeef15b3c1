"""The gradient noise scale a run logged, against the truth at the same parameters.

    python -m tools.noise_check --workdir RUN --steps 100,300 [--sequences 3072]

At each step (a checkpoint of the run) the truth is B_simple = tr(Sigma) / |G|^2 in sequences,
from the per-sequence gradients (of each sequence's mean token loss) of `--sequences`
independent windows of the run's training data, drawn by an order with a seed of its own, with
its jackknife standard error over `--groups` groups; for an Adam-family run also the
preconditioned tr(P Sigma) / G^T P G, P = 1 / (sqrt(v_hat) + eps) from the checkpoint's second
moments (the gradients times sqrt(P)); with `--window F`, also the plain truth over the meter's
window (the checkpoints after (1 - F) of the examples read). Beside them: what the run logged at
that step (or the nearest row before it, `noise_scale` and `noise_scale_precond`), and
logged / truth.
Why and how it is used: docs/batch_size.md#gradient-noise-scale.
"""
from __future__ import annotations

import dataclasses
import json
import math
import os
import sys

import numpy as np

from trainer.config import ConfigError
from trainer.config.cli import CliParser, floats, from_dict, ints
from trainer.multihost import platforms
from trainer.run.inprocess import load_run
from trainer.tracking.record import ramp_from_rows, read_rows


@dataclasses.dataclass(frozen=True)
class Truth:
  """B_simple in sequences from per-sequence gradients, its jackknife standard error, the
  estimates it is the ratio of (per-sequence tr(Sigma) and |G|^2), and the sequences used."""
  b_simple: float
  se: float
  trace: float
  g_sq: float
  sequences: int


def _ratio(sums):
  """Unbiased tr(Sigma) / |G|^2 from [groups, dim + 2] sums (gradient sum, sum of squared norms,
  count), |G|^2 estimated as |mean|^2 - tr(Sigma) / n."""
  total = sums.sum(0)
  n, mean = total[-1], total[:-2] / total[-1]
  trace = (total[-2] - n * mean @ mean) / (n - 1)
  g_sq = mean @ mean - trace / n
  return trace / g_sq, trace, g_sq


def truth_meter(spec, stream_spec, *, sequences: int = 2048, groups: int = 16,
                chunk: int = 128):
  """(params, precondition=None, batch=1) -> `Truth` at those parameters (module docstring),
  compiled once for a model: `stream_spec` gives the data, the sequence length and the order's
  seed (its `rows` is replaced by `chunk`); every call reads the same `sequences` windows. With
  `precondition` (E[g_B^2] per parameter, flat -> P, flat) -> (plain `Truth`, preconditioned
  `Truth`): P from the expected squared gradient of a batch of `batch` sequences, the latter
  of the per-sequence gradients times sqrt(P)."""
  import jax  # noqa: PLC0415  start-up
  import jax.numpy as jnp  # noqa: PLC0415  start-up

  from data import pipeline  # noqa: PLC0415  start-up
  from trainer.step.train_step import loss_sums  # noqa: PLC0415  start-up

  chunk = math.gcd(chunk, sequences // groups)  # a group is whole chunks
  flat = lambda tree: jnp.concatenate([x.ravel().astype(jnp.float32) for x in
                                       jax.tree.leaves(tree)])
  mean_loss = lambda p, row: (lambda s, n: s / jnp.maximum(n, 1.0))(*loss_sums(
      spec, p, jax.tree.map(lambda x: x[None], row)))

  @jax.jit
  def chunk_sums(p, rows):
    """Of the chunk's per-sequence gradients g (reduced on the device, not copied out at
    [chunk, parameters] in float64): the sum of g and the sum of g^2, per parameter."""
    g = jax.vmap(lambda r: flat(jax.grad(mean_loss)(p, r)))(rows)
    return g.sum(0), (g * g).sum(0)

  it = iter(pipeline.dataset(dataclasses.replace(stream_spec, rows=chunk, row_ids=None,
                                                  prefetch=0)))
  batches = [next(it) for _ in range(sequences // groups // chunk * groups)]
  per_group = len(batches) // groups

  def truth(sums) -> Truth:
    b_simple, trace, g_sq = _ratio(sums)
    leave_out = np.array([_ratio(np.delete(sums, k, axis=0))[0] for k in range(groups)])
    se = float(np.sqrt((groups - 1) / groups * np.sum((leave_out - leave_out.mean()) ** 2)))
    return Truth(float(b_simple), se, float(trace), float(g_sq), int(sums[:, -1].sum()))

  def measure(params, precondition=None, batch: int = 1):
    sums, squares = [], []  # per group: [gradient sum, sum of squared norms, count]; sum of g^2
    for k in range(groups):
      g_sum = sq = n = 0.0
      g2_sum = 0.0
      for b in batches[k * per_group:(k + 1) * per_group]:
        g, g2 = (np.asarray(x, np.float64) for x in chunk_sums(params, b))
        g_sum, sq, n, g2_sum = g_sum + g, sq + g2.sum(), n + chunk, g2_sum + g2
      sums.append(np.concatenate([g_sum, [sq, n]]))
      squares.append(g2_sum)
    sums = np.array(sums)
    if precondition is None:
      return truth(sums)
    n, g_sum, g2_sum = sums[:, -1].sum(), sums[:, :-2].sum(0), np.sum(squares, 0)
    mean = g_sum / n
    var = (g2_sum / n - mean * mean) * n / (n - 1)
    p = np.asarray(precondition(mean * mean + var / batch), np.float64)
    scaled = np.concatenate([sums[:, :-2] * np.sqrt(p), (np.array(squares) @ p)[:, None],
                             sums[:, -1:]], axis=1)
    return truth(sums), truth(scaled)

  return measure


def preconditioner_at(step_dir: str, config: dict, mesh):
  """E[g^2] (flat, the parameters' leaf order) -> P (flat) of a checkpoint: the Adam
  preconditioner its next update would divide by were its squared gradient E[g^2]
  (`optim.noise_scale.preconditioner`; no clipping), or None when its optimizer keeps no
  Adam-family second moments or its meter predates them."""
  import jax  # noqa: PLC0415  start-up
  import jax.numpy as jnp  # noqa: PLC0415  start-up
  import orbax.checkpoint as ocp  # noqa: PLC0415  start-up

  from optim import noise_scale  # noqa: PLC0415  start-up
  from trainer.step.program import Program  # noqa: PLC0415  start-up

  cfg = from_dict(config, step_dir)
  if cfg.optim.name not in noise_scale.PRECONDITIONED or not cfg.optim.noise_scale_every:
    return None
  abstract = Program(cfg, mesh).abstract_state()
  try:
    with ocp.StandardCheckpointer() as checkpointer:
      # orbax wants an absolute path (a relative one raises ValueError, read below as "no
      # second moments", which dropped the preconditioned truth of every relative --workdir)
      state = checkpointer.restore(os.path.abspath(os.path.join(step_dir, "state")), abstract)
  except (ValueError, KeyError, FileNotFoundError):  # an earlier version's meter state
    return None
  leaves, tree = jax.tree.flatten(state.params)
  cuts = np.cumsum([x.size for x in leaves])[:-1]

  def precondition(grad_sq):
    parts = [jnp.asarray(x.reshape(leaf.shape), jnp.float32)
             for x, leaf in zip(np.split(np.asarray(grad_sq), cuts), leaves)]
    p = noise_scale.preconditioner(state.opt_state, grad_sq=jax.tree.unflatten(tree, parts))
    return np.concatenate([np.asarray(x).ravel() for x in jax.tree.leaves(p)])

  return precondition


def logged_at(rows: list[dict], step: int, key: str = "noise_scale") -> tuple[int, float] | None:
  """(step, value) of the last row at or before `step` that logged `key`, or None."""
  found = [(r["step"], r[key]) for r in rows if key in r and r["step"] <= step]
  return found[-1] if found else None


def checkpoints(workdir: str) -> list[int]:
  """The steps of a run's checkpoints, oldest first."""
  directory = os.path.join(workdir, "checkpoints")
  return sorted(int(n) for n in os.listdir(directory) if n.isdigit()) \
      if os.path.isdir(directory) else []


def check_run(workdir: str, steps: list[int], *, sequences: int, groups: int, seed: int,
              window: float = 0.0, key: str = "noise_scale",
              recency: tuple[float, ...] = ()) -> list[dict]:
  """One row per step: the truth at its checkpoint's parameters, the logged value, the ratio;
  with `window` also the truth over that window ending at the step (`windowed`); with
  `recency` also what the meter would have logged at each of those recencies (`replay`)."""
  import jax  # noqa: PLC0415  start-up

  from data import pipeline  # noqa: PLC0415  start-up
  from optim.seesaw import planned_ramp  # noqa: PLC0415  start-up
  from sharding.mesh import make_mesh  # noqa: PLC0415  start-up
  from trainer.checkpoint.model_dirs import restore_params  # noqa: PLC0415  start-up
  from trainer.run.feed import sources  # noqa: PLC0415  start-up

  rows = read_rows(workdir)
  mesh = make_mesh({"data": 1}, jax.devices()[:1])
  cfg = load_run(workdir, steps[0])
  ramp = planned_ramp(cfg.data, cfg.optim, cfg.steps) if cfg.data.batch_ramp != "auto" else \
      ramp_from_rows(rows, cfg.data.global_batch_size, cfg.data.seq_len)
  data = sources(cfg)
  stream = pipeline.StreamSpec(data[0].dir, "train", cfg.data.seq_len, 1, seed=seed,
                               mixture=data if cfg.data.mixture else ())
  measure, cache = None, {}

  def at(step: int, precond: bool = False) -> tuple[Truth, Truth | None]:
    """(plain truth, preconditioned truth or None) at a checkpoint."""
    nonlocal measure
    if (step, True) in cache:  # that one holds the plain truth too
      return cache[step, True]
    if (step, precond) not in cache:
      step_dir = os.path.join(workdir, "checkpoints", str(step))
      spec, params, config, _ = restore_params(step_dir, mesh)
      measure = measure or truth_meter(spec, stream, sequences=sequences, groups=groups)
      with jax.set_mesh(mesh):
        p = preconditioner_at(step_dir, config, mesh) if precond else None
        got = measure(params, p, ramp.batch_at(step))
      cache[step, precond] = got if p is not None else (got, None)
    return cache[step, precond]

  have, out = checkpoints(workdir), []
  replayed = {r: replay(rows, cfg, ramp, r) for r in recency}
  for step in steps:
    t, tp = at(step, precond=True)
    logged = logged_at(rows, step, key)
    row = {"step": step, "truth": t.b_simple, "truth_se": t.se, "sequences": t.sequences,
           "truth_trace": t.trace, "truth_g_sq": t.g_sq,
           "logged_step": logged and logged[0], "logged": logged and logged[1],
           "logged_over_truth": logged and logged[1] / t.b_simple}
    if tp is not None:
      logged_p = logged_at(rows, step, "noise_scale_precond")
      row.update(truth_precond=tp.b_simple, truth_precond_se=tp.se,
                 truth_precond_trace=tp.trace, truth_precond_g_sq=tp.g_sq,
                 logged_precond=logged_p and logged_p[1],
                 logged_precond_over_truth=logged_p and logged_p[1] / tp.b_simple)
    if window:
      inside = [s for s in have if s <= step and
                ramp.examples_before(s) > (1 - window) * ramp.examples_before(step)]
      truth_w = windowed([at(s)[0] for s in inside])
      row.update(window_truth=truth_w, window_checkpoints=len(inside),
                 logged_over_window_truth=logged and logged[1] / truth_w)
    if recency:
      row.update(replayed={r: replayed[r].get(step) for r in recency},
                 replayed_over_truth={r: replayed[r].get(step) and replayed[r][step] / t.b_simple
                                      for r in recency})
    out.append(row)
  return out


def replay(rows: list[dict], cfg, ramp, recency: float) -> dict[int, float]:
  """{step: B_simple in sequences} that the meter of `cfg` (its window, minimum of measurements
  and clock) with `recency` would have logged, from the per-step estimates the run logged
  (`noise_g_sq_step`, `noise_trace_step`: a run that logged every measuring step)."""
  from optim import noise_scale  # noqa: PLC0415  start-up

  o = cfg.optim
  measured = [r for r in rows if "noise_g_sq_step" in r]
  if not measured or len(measured) < max(r["step"] for r in rows) // max(o.noise_scale_every, 1):
    raise ConfigError(f"--recency replays the meter's per-step estimates, which the run logged "
                      f"at {len(measured)} of its measuring steps; train it with "
                      "--config.log_every=1 (or a multiple of optim.noise_scale_every)")
  tx = noise_scale.meter(float(o.noise_scale_window),
                         lambda step: float(ramp.examples_before(step + 1)), recency=recency,
                         min_measurements=int(o.noise_scale_min_measurements),
                         max_rse=float(o.get("noise_scale_max_rse", 0)))
  state, out = tx.init(None), {}
  for r in measured:  # a Sample whose estimates are the logged ones exactly (b = 1, B = 2)
    g, trace = r["noise_g_sq_step"], r["noise_trace_step"]
    sample = noise_scale.Sample(*(np.float32(x) for x in (g + trace, g + trace / 2, 1, 2)))
    _, state = tx.update({}, state, noise_sample=sample, step=r["step"] - 1)
    out[r["step"]] = float(noise_scale.readout(state)["b_simple"]) * \
        ramp.batch_at(r["step"] - 1) / max(r["target_tokens"], 1.0)
  return out


def windowed(truths: list[Truth]) -> float:
  """The truth over a window: the ratio of the sums of its checkpoints' tr(Sigma) and |G|^2, as
  the meter takes the ratio of its measurements' sums."""
  return sum(t.trace for t in truths) / sum(t.g_sq for t in truths)


def build_parser():
  parser = CliParser("-m tools.noise_check", __doc__, config=False, overrides=False)
  parser.add_argument("--workdir", required=True, help="a run with checkpoints at --steps")
  parser.add_argument("--steps", type=ints, required=True, help="checkpoint steps, e.g. 100,300")
  parser.add_argument("--sequences", type=int, default=3072,
                      help="independent windows whose per-sequence gradients make the truth")
  parser.add_argument("--groups", type=int, default=16, help="jackknife groups")
  parser.add_argument("--seed", type=int, default=12345,
                      help="the seed of the truth's data order (not the run's)")
  parser.add_argument("--window", type=float, default=0.0,
                      help="also the truth over the meter's window ending at each step (e.g. "
                           "0.25: the checkpoints after 75%% of the examples read then)")
  parser.add_argument("--key", default="noise_scale", help="the logged metric to compare")
  parser.add_argument("--recency", type=floats, default=(),
                      help="also what the meter with these optim.noise_scale_recency values "
                           "would have logged (a run logged every step), e.g. 0,0.05,0.1")
  parser.add_argument("--json", action="store_true", help="print the rows as JSON")
  return parser


def main(argv: list[str]) -> int:
  platforms.choose()
  from trainer.checkpoint.saved import CheckpointError  # noqa: PLC0415  start-up
  try:
    args, _ = build_parser().parse(argv)
    if not os.path.isdir(args.workdir):
      raise ConfigError(f"--workdir {args.workdir}: no such directory")
    have = checkpoints(args.workdir)
    missing = [s for s in args.steps if s not in have]
    if missing:
      raise ConfigError(f"--steps: {args.workdir} has no checkpoint at step {missing[0]} (it has "
                        f"{', '.join(map(str, have)) or 'none'}); train with "
                        "--config.checkpoint.every_steps dividing the steps to check")
    if not 0 <= args.window <= 1:
      raise ConfigError(f"--window {args.window}: a fraction in (0, 1], or 0 for none")
    rows = check_run(args.workdir, args.steps, sequences=args.sequences, groups=args.groups,
                     seed=args.seed, window=args.window, key=args.key,
                     recency=tuple(args.recency))
  except (ConfigError, CheckpointError) as e:
    print(f"error: {e}", file=sys.stderr)
    return 2
  if args.json:
    print(json.dumps(rows, indent=1))
    return 0
  fmt = lambda x: "" if x is None else f"{x:.2f}"
  precond = any("truth_precond" in r for r in rows)
  print("step  truth (s.e.)     logged (at step)   logged / truth"
        + ("   preconditioned: truth (s.e.)  logged  logged / truth" if precond else "")
        + ("   truth over the window (checkpoints)  logged / it" if args.window else ""))
  for r in rows:
    logged = "none" if r["logged"] is None else f"{r['logged']:.2f} ({r['logged_step']})"
    line = (f"{r['step']:5d} {r['truth']:7.2f} ({r['truth_se']:.2f})  {logged:>17s}   "
            f"{fmt(r['logged_over_truth']):>14s}")
    if precond:
      line += (f"   {r['truth_precond']:22.2f} ({r['truth_precond_se']:.2f})  "
               f"{fmt(r['logged_precond']):>6s}  {fmt(r['logged_precond_over_truth']):>14s}"
               if "truth_precond" in r else "")
    if args.window:
      line += (f"   {r['window_truth']:7.2f} ({r['window_checkpoints']})"
               f"{fmt(r['logged_over_window_truth']):>29s}")
    if args.recency:
      line += "   replayed / truth: " + ", ".join(
          f"recency {k:g} {fmt(v)}" for k, v in r["replayed_over_truth"].items())
    print(line)
  return 0


if __name__ == "__main__":
  sys.exit(main(sys.argv[1:]))

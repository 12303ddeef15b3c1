"""The noisy quadratic model (NQM; Zhang G. et al. 2019, arXiv 1907.04164), its closed forms,
and the thin harness that trains it with the stack's optimizer factory, meter and autopilot.

  per example  l(theta) = 1/2 sum_i h_i (theta_i - x_i)^2,  x_i ~ N(0, c_i / h_i^2)
  gradient     mean G_i = h_i theta_i, covariance diag(c)
  loss         L(theta) = 1/2 sum_i h_i theta_i^2 (the expected loss less 1/2 sum_i c_i / h_i)

Under heavy-ball SGD (mu = 0: plain) at batch B the moments (E theta^2, E theta v, E v^2) of
each coordinate follow an exact linear recursion (`step_moments`); a fixed diagonal
preconditioner p is h -> p h, c -> p^2 c (`Problem.preconditioned`: the same problem in
theta / sqrt(p)). From it: the expected loss (`curves`), steps to a target (`steps_to`), the
best rate (`best_rate`), S(B) (`tradeoff`), S_min and E_min (`limits`), B_crit
(`critical_batch`); `crossing` reads stochastic runs as the sweep does. Derivation and results:
docs/noisy_quadratic.md
"""
from __future__ import annotations

import dataclasses
import functools
import math
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np
import optax

from optim import noise_scale
from optim.autopilot import AutoConfig, Autopilot
from optim.factory import build_optimizer
from optim.ramp import BatchRamp
from tools.batch_sweep import fit_tradeoff
from trainer.tracking.record import to_target


@dataclasses.dataclass(frozen=True, eq=False)
class Problem:
  """Curvatures h, per-example gradient variances c, the start theta0 (numpy float arrays)."""
  h: np.ndarray
  c: np.ndarray
  theta0: np.ndarray

  @classmethod
  def power_law(cls, dim: int = 1000, power: float = 1.0, noise: float = 1.0,
                init: float = 1.0) -> "Problem":
    """h_i = i^-power (i = 1..dim), c = noise x h, theta0_i = init."""
    h = np.arange(1, dim + 1, dtype=np.float64) ** -power
    return cls(h, noise * h, np.full(dim, float(init)))

  @property
  def dim(self) -> int:
    return len(self.h)

  def preconditioned(self, p) -> "Problem":
    """The problem in phi = theta / sqrt(p): plain SGD on it is SGD with the fixed diagonal
    preconditioner p on this one, at the same loss (curvature p h, noise p c)."""
    p = np.broadcast_to(np.asarray(p, np.float64), self.h.shape)
    return Problem(p * self.h, p * self.c, self.theta0 / np.sqrt(p))

  def loss(self, tt):
    """1/2 sum h E theta^2 from the second moments `tt` [..., dim]."""
    return 0.5 * (tt * self.h).sum(-1)

  def b_simple(self, tt):
    """tr(C) / E|G|^2, E|G|^2 = sum h^2 E theta^2: McCandlish's B_simple at the expected state."""
    return self.c.sum() / (tt * self.h ** 2).sum(-1)

  def b_noise(self, tt):
    """tr(H C) / E[G^T H G]: McCandlish's B_noise at the expected state."""
    return (self.h * self.c).sum() / (tt * self.h ** 3).sum(-1)


def stable_rate(problem: Problem, momentum: float = 0.0, precond=None) -> float:
  """The largest stable rate: a max(p h) < 2 (1 + mu) (the mean's recursion at its edge)."""
  p = 1.0 if precond is None else np.asarray(precond)
  return 2.0 * (1.0 + momentum) / float(np.max(p * problem.h))


def step_moments(h, c, m, rate, batch, momentum):
  """One step of (E theta^2, E theta v, E v^2) per coordinate, m = (tt, tv, vv), under
  v' = mu v + g, theta' = theta - a v', g = h theta + xi, E xi^2 = c / B (docs: the derivation;
  a preconditioner p: h -> p h, c -> p^2 c). Works on numpy or jax arrays broadcast together;
  batch = inf: no noise."""
  tt, tv, vv = m
  q = c / batch  # the step's gradient noise variance
  u = 1.0 - rate * h
  mu = momentum
  tt2 = u * u * tt - 2 * u * rate * mu * tv + rate * rate * mu * mu * vv + rate * rate * q
  tv2 = u * h * tt + mu * (u - rate * h) * tv - rate * mu * mu * vv - rate * q
  vv2 = h * h * tt + 2 * h * mu * tv + mu * mu * vv + q
  return tt2, tv2, vv2


@functools.partial(jax.jit, static_argnames=("steps", "every"))
def _scan(h, c, p, tt0, rates, batches, momentum, steps: int, every: int):
  """Expected loss, B_simple, B_noise, B_precond every `every` steps (from step 0) of runs [n]
  under the preconditioner p: rates [steps, n], batches likewise."""
  zero = jnp.zeros((rates.shape[1], h.shape[0]), jnp.float32)
  m0 = (jnp.broadcast_to(tt0, zero.shape), zero, zero)

  def observe(m):
    tt = m[0]
    return (0.5 * tt @ h, c.sum() / (tt @ (h * h)), (h * c).sum() / (tt @ h ** 3),
            (p * c).sum() / (tt @ (p * h * h)))

  def block(m, xs):
    def one(m, x):
      a, b = x
      return step_moments(p * h, p * p * c, m, a[:, None], b[:, None], momentum), None
    m, _ = jax.lax.scan(one, m, xs)
    return m, observe(m)

  xs = (rates.reshape(steps // every, every, -1), batches.reshape(steps // every, every, -1))
  _, out = jax.lax.scan(block, m0, xs)
  first = observe(m0)
  return tuple(jnp.concatenate([f[None], o]) for f, o in zip(first, out))


def curves(problem: Problem, rates, batches, steps: int, momentum: float = 0.0, every: int = 1,
           precond=None) -> dict[str, np.ndarray]:
  """{loss, b_simple, b_noise, b_precond} at the expected state, each [steps / every + 1, n]
  (step 0, every, 2 every, ...), of n runs with the fixed preconditioner `precond` (None: 1):
  `rates` and `batches` either [n] (constant) or [steps, n] (per step, e.g. an autopilot's).
  B_simple and B_noise are the raw gradient's, B_precond = tr(P C) / E[G^T P G]. Float32."""
  want = -(-int(steps) // every) * every
  steps = every * 2 ** math.ceil(math.log2(max(want // every, 1)))  # few shapes to compile
  rates, batches = (np.asarray(x, np.float32) for x in (rates, batches))
  if rates.ndim == 1:
    rates, batches = (np.broadcast_to(x, (steps, len(x))) for x in (rates, batches))
  if rates.shape[0] < steps:  # a per-step schedule: its last row held
    rates, batches = (np.concatenate([x, np.repeat(x[-1:], steps - x.shape[0], 0)])
                      for x in (rates, batches))
  f32 = lambda x: jnp.asarray(x, jnp.float32)
  p = np.ones_like(problem.h) if precond is None else np.broadcast_to(precond, problem.h.shape)
  out = _scan(f32(problem.h), f32(problem.c), f32(p), f32(problem.theta0 ** 2),
              f32(rates[:steps]), f32(batches[:steps]), float(momentum), steps, every)
  return {k: np.asarray(o, np.float64)[:want // every + 1]
          for k, o in zip(("loss", "b_simple", "b_noise", "b_precond"), out)}


def steps_to(losses, target: float, every: int = 1):
  """First crossing of `target` of each column of `losses` [T, n] (rows `every` steps apart),
  linear between rows; inf where never (or not finite before)."""
  losses = np.asarray(losses, np.float64)
  out = np.full(losses.shape[1], np.inf)
  for j in range(losses.shape[1]):
    y = losses[:, j]
    below = np.nonzero(y <= target)[0]
    if not len(below) or not np.all(np.isfinite(y[:below[0] + 1])):
      continue
    k = below[0]
    if k == 0:
      out[j] = 0.0
      continue
    out[j] = every * (k - 1 + (y[k - 1] - target) / (y[k - 1] - y[k]))
  return out


EVAL_EXAMPLES, SMOOTH_EXAMPLES = 256, 1024  # tools.batch_sweep's defaults


def crossing(losses, batch: int, target: float) -> float:
  """Steps to `target` as tools.batch_sweep reads them: the mean loss over the seeds of
  `losses` [steps, seeds] (row t: after step t + 1) every EVAL_EXAMPLES examples, averaged
  over SMOOTH_EXAMPLES (`trainer.tracking.record.to_target`); inf: not reached."""
  every = max(1, round(EVAL_EXAMPLES / batch))
  mean = losses.mean(1)
  curve = [((t + 1) * batch, float(mean[t])) for t in range(every - 1, len(mean), every)]
  hit = to_target(curve, BatchRamp.constant(batch, 1), target, SMOOTH_EXAMPLES)
  return math.inf if hit is None else hit.steps


def best_rate(problem: Problem, batch: float, target: float, *, momentum: float = 0.0,
              precond=None, max_steps: int = 32768, grid: int = 32, lowest: float = 1e-4):
  """(rate, steps): the rate in (lowest x the stable rate, the stable rate) that reaches
  `target` in the fewest expected steps at `batch` (inf: none does within `max_steps`): a
  geometric grid, then a finer one around its winner (whose neighbours bound it). Each pass
  runs only as long as its winner needs (horizons doubling from 256 steps)."""
  top = stable_rate(problem, momentum, precond) * 0.999
  rates = np.geomspace(top * lowest, top, grid)
  horizon = min(256, max_steps)  # powers of 2: few shapes to compile
  best = (math.nan, math.inf)
  for _ in range(2):
    while True:
      s = steps_to(curves(problem, rates, np.full(len(rates), batch), horizon, momentum,
                          precond=precond)["loss"], target)
      if np.isfinite(s).any() or horizon >= max_steps:
        break
      horizon = min(2 * horizon, max_steps)
    k = int(np.argmin(s))
    if not np.isfinite(s[k]):
      return best
    best = (float(rates[k]), float(s[k]))
    horizon = min(max_steps, 2 ** math.ceil(math.log2(s[k] + 2)))  # few shapes to compile
    rates = np.geomspace(rates[max(k - 1, 0)], rates[min(k + 1, len(rates) - 1)], grid)
  return best


def tradeoff(problem: Problem, batches, target: float, *, momentum: float = 0.0,
             precond=None, max_steps: int = 32768) -> list[tuple[float, float, float]]:
  """[(batch, best rate, expected steps to target)]: the exact S(B)."""
  return [(float(b), *best_rate(problem, b, target, momentum=momentum, precond=precond,
                                max_steps=max_steps)) for b in batches]


def critical_batch(problem: Problem, batches, target: float, *, momentum: float = 0.0,
                   precond=None) -> dict:
  """The exact S(B) over `batches` (best rates, steps), McCandlish's fit to it
  (`tools.batch_sweep.fit_tradeoff`, as a sweep fits its measurements: b_crit_fit, s_min_fit,
  e_min_fit) and the limits (s_min, e_min, b_crit_limits = e_min / s_min)."""
  s = tradeoff(problem, batches, target, momentum=momentum, precond=precond)
  fit = fit_tradeoff([b for b, _, _ in s], [x for _, _, x in s])
  s_min, e_min = limits(problem, target, momentum=momentum, precond=precond)
  return {"batches": [b for b, _, _ in s], "rates": [a for _, a, _ in s],
          "steps": [x for _, _, x in s], "b_crit_fit": fit.b_crit, "s_min_fit": fit.s_min,
          "e_min_fit": fit.e_min, "s_min": s_min, "e_min": e_min, "b_crit_limits": e_min / s_min}


def limits(problem: Problem, target: float, *, momentum: float = 0.0, precond=None,
           max_steps: int = 32768) -> tuple[float, float]:
  """(S_min, E_min): steps at an infinite batch (noise-free, best rate) and examples at a
  vanishing batch. The latter from the limit B -> 0 at a rate kappa B (kappa (1 - mu)
  with momentum): E theta^2 after e examples = m_inf + (theta0^2 - m_inf) exp(-2 kappa p h e),
  m_inf = kappa p c / (2 h), minimised over kappa."""
  s_min = best_rate(problem, math.inf, target, momentum=momentum, precond=precond,
                    max_steps=max_steps)[1]
  p = 1.0 if precond is None else np.asarray(precond)
  h, c, t0 = problem.h, problem.c, problem.theta0 ** 2

  def examples(kappa):
    m_inf = kappa * p * c / (2 * h)
    if problem.loss(m_inf) >= target:
      return math.inf
    loss = lambda e: problem.loss(m_inf + (t0 - m_inf) * np.exp(-2 * kappa * p * h * e))
    hi = 1.0
    while loss(hi) > target:
      hi *= 2
    lo = 0.0
    for _ in range(60):
      mid = 0.5 * (lo + hi)
      lo, hi = (mid, hi) if loss(mid) > target else (lo, mid)
    return hi

  kappas = np.geomspace(1e-6, 1e2, 161)
  e = np.array([examples(k) for k in kappas])
  k = int(np.argmin(e))
  fine = np.geomspace(kappas[max(k - 1, 0)], kappas[min(k + 1, len(kappas) - 1)], 41)
  return s_min, float(min(examples(k) for k in fine))


# ------------------------------------------------------------------------------------------------
# The harness: the stack's optimizer (optim.factory), meter (optim.noise_scale) and autopilot
# (optim.autopilot) on sampled NQM gradients. A "micro-batch" of MICRO examples is the meter's
# small batch, as a sweep's runs measure it (micro-batches of the smallest batch).

PARAM_NAMES = {"theta": ("embed",)}  # a vector: no weight decay, no trust ratio (optim.factory)
MICRO = 8


def run_config(base, name: str, rate: float, batch: int, *, momentum: float = 0.0,
               lr_rule: str = "none", reference_batch: int = 0, ramp: str = ""):
  """A copy of the run config `base` (its meter settings stay) for an NQM run: `name` sgd
  (heavy-ball `momentum`) or adamw, `rate` stated at `reference_batch` (default `batch`) and
  moved by `lr_rule`, a constant schedule, no clipping, decay or EMA, the meter measuring every
  step; one example is one target token (seq_len 1); `ramp`: data.batch_ramp."""
  cfg = base.copy_and_resolve_references()
  cfg.data.update(global_batch_size=int(batch), seq_len=1, batch_ramp=ramp,
                  micro_batch_size=MICRO if batch > MICRO or ramp else 0)
  cfg.optim.update(name=name, learning_rate=float(rate), schedule="constant", warmup_steps=0,
                   warmup_examples=0, warmup_tokens=0, clip_norm=0.0, weight_decay=0.0,
                   momentum=float(momentum), nesterov=False, lr_rule=lr_rule,
                   reference_batch_size=int(reference_batch or batch), noise_scale_every=1,
                   ema_decay=0.0)
  return cfg


def build(cfg, steps: int, ramp=None):
  """(tx, schedule) from `optim.factory.build_optimizer`, as the trainer builds them."""
  return build_optimizer(cfg.optim, PARAM_NAMES, steps, cfg.data, ramp=ramp)


def pieces_of(batch: int) -> int:
  """The meter's small batches in a step of `batch`: its micro-batches of MICRO, or
  `noise_scale.splits` parts of a single one (as trainer/step/train_step.py splits it)."""
  if batch > MICRO:
    return batch // MICRO
  return noise_scale.splits(1, 2, batch)


def make_step(problem: Problem, tx, batch: int, exact_meter: bool = False):
  """step((params, opt_state, count), key) -> (state, row): one optimizer step at `batch` on
  sampled gradients, the meter fed as trainer/step/train_step.py feeds it (mean of the pieces'
  |mean gradient|^2, |whole batch's mean gradient|^2, their sizes; with the optimizer's
  preconditioner P the same of sqrt(P) g) and read by `noise_scale.readout`. The row: the loss
  and B_simple at the new iterate (the truth there: tr(C) / |G|^2), the meter's readout
  (noise_scale: B_simple in examples; noise_<key>: the others); the sample the meter was fed
  (meter_sq_small, meter_sq_big) and the |G|^2 it estimates, at the iterate the step's gradient
  was taken at (g_sq_true, before the update; for `nqm_meter.replay`); with P,
  noise_scale_precond and the truth tr(P C) / G^T P G at the step's iterate with the step's P.
  `exact_meter`: the meter is fed the squared norms' expectations |G|^2 + tr(C) / b instead
  (its estimates exact; the update still takes the sampled gradient)."""
  h, c = jnp.asarray(problem.h, jnp.float32), jnp.asarray(problem.c, jnp.float32)
  pieces = pieces_of(batch)
  small = batch / pieces
  meter = noise_scale.find_state(jax.eval_shape(tx.init, {"theta": h}))
  has_precond = hasattr(noise_scale, "has_preconditioner") and \
      noise_scale.has_preconditioner(meter)

  def step(state, key):
    params, opt_state, count = state
    # each piece's mean gradient: h theta + N(0, c / small) exactly (x drawn per example)
    g_pieces = h * params["theta"] + jax.random.normal(key, (pieces, len(problem.h))) * \
        jnp.sqrt(c / small)
    grads = {"theta": g_pieces.mean(0)}
    grad_norm = optax.tree.norm(grads)
    precond, row = {}, {}
    if has_precond:  # P as this update's (optim/noise_scale.py), as train_step.py takes it
      precondition = noise_scale.preconditioner(opt_state, grads)
      squares = {"theta": jnp.sum(g_pieces ** 2, 0)}
      precond = dict(sq_norm_small_precond=noise_scale.weighted_sq_norm(
                         squares, precondition, squared=True) / pieces,
                     sq_norm_big_precond=noise_scale.weighted_sq_norm(grads, precondition))
      p = precondition["theta"]
      row["b_precond_true"] = jnp.sum(p * c) / jnp.sum(p * (h * params["theta"]) ** 2)
    sample = noise_scale.Sample(sq_norm_small=jnp.mean(jnp.sum(g_pieces ** 2, -1)),
                                sq_norm_big=grad_norm * grad_norm, b_small=jnp.float32(small),
                                b_big=jnp.float32(batch), **precond)
    g_sq = jnp.sum((h * params["theta"]) ** 2)
    if exact_meter:
      sample = sample._replace(sq_norm_small=g_sq + jnp.sum(c) / small,
                               sq_norm_big=g_sq + jnp.sum(c) / batch)
    row.update(meter_sq_small=sample.sq_norm_small, meter_sq_big=sample.sq_norm_big,
               g_sq_true=g_sq)
    updates, opt_state = tx.update(grads, opt_state, params, batch_size=batch, step=count,
                                   noise_sample=sample)
    params = optax.apply_updates(params, updates)
    theta = params["theta"]
    noise = noise_scale.readout(noise_scale.find_state(opt_state))
    row.update(loss=0.5 * jnp.sum(h * theta ** 2),
               b_simple_true=jnp.sum(c) / jnp.sum((h * theta) ** 2),
               noise_scale=noise["b_simple"])
    if has_precond:
      row["noise_scale_precond"] = noise["b_simple_precond"]
    row.update({f"noise_{k}": v for k, v in noise.items() if k != "b_simple"})
    return (params, opt_state, count + 1), row

  return step


def init_state(problem: Problem, tx):
  params = {"theta": jnp.asarray(problem.theta0, jnp.float32)}
  return params, tx.init(params), jnp.zeros((), jnp.int32)


def run(problem: Problem, cfg, steps: int, seeds: int, seed: int = 0, state=None):
  """`seeds` runs of `cfg` for `steps` steps (`run_many` of one)."""
  return run_many(problem, [(cfg, steps, seeds, seed, state)])[0]


def run_many(problem: Problem, jobs) -> list[tuple[dict, Any]]:
  """Each job (cfg, steps, seeds, seed[, state]): `seeds` independent runs of `cfg` (its
  batch, a constant ramp or its own) for `steps` steps from `state` (one state for all of them;
  None or left out: the start), vmapped over the seeds, every job in one compiled program (a
  program per run would spend its time compiling). Step n's randomness is fold_in(key(seed),
  n): a longer job repeats a shorter one's steps. Per job: (every step's row, each [steps,
  seeds] (row t: after step t + 1), the final states (leaves [seeds, ...]))."""
  parts = []
  for cfg, steps, seeds, seed, *rest in jobs:
    state = rest[0] if rest else None
    tx, _ = build(cfg, steps + (int(state[2]) if state is not None else 0))
    step = make_step(problem, tx, int(cfg.data.global_batch_size))
    start = init_state(problem, tx) if state is None else state
    keys = jax.vmap(lambda k, n=steps: jax.vmap(lambda i: jax.random.fold_in(k, i))(
        jnp.arange(n)))(jax.random.split(jax.random.key(seed), seeds))
    parts.append((step, start, keys))

  @jax.jit
  def go(all_keys):
    return [jax.vmap(lambda k, step=step, start=start: jax.lax.scan(step, start, k),
                     out_axes=(0, 1))(keys) for (step, start, _), keys in zip(parts, all_keys)]

  return [({k: np.asarray(v, np.float64) for k, v in rows.items()}, final)
          for final, rows in go([keys for _, _, keys in parts])]


def autopilot_run(problem: Problem, cfg, steps: int, seed: int = 0, stop_loss: float = 0.0):
  """One run under the batch autopilot (`cfg.data.batch_ramp = "auto"`: its AutoConfig and a
  growing BatchRamp, the optimizer's clock on it), each step's row fed to `Autopilot.observe`
  as trainer/run/readback.py feeds it (every row of a measuring step). Stops after `steps` or
  at `stop_loss`. Returns (rows: list of dicts with the step's `batch` and `rate`, autopilot)."""
  ramp = BatchRamp.constant(int(cfg.data.global_batch_size), 1)
  pilot = Autopilot(AutoConfig.from_config(cfg.data), ramp)
  tx, schedule = build(cfg, steps, ramp=ramp)
  state, compiled, rows = init_state(problem, tx), {}, []
  keys = jax.random.split(jax.random.key(seed), steps)
  for n in range(1, steps + 1):
    batch = ramp.batch_at(n - 1)
    if batch not in compiled:  # once its stage exists (the clock reads the ramp when traced)
      compiled[batch] = jax.jit(make_step(problem, tx, batch))
    state, row = compiled[batch](state, keys[n - 1])
    row = {k: float(v) for k, v in jax.device_get(row).items()}
    row.update(step=n, batch=batch, rate=float(schedule.at(batch)(n - 1)), skipped=0)
    rows.append(row)
    pilot.observe(n, row)
    if row["loss"] <= stop_loss:
      break
  return rows, pilot

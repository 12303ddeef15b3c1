"""Evaluation during training of the vision workload (models/resnet.py, data/mnist1d.py).

Every `eval_every` steps the first `eval_sequences` examples of mnist1d's fixed test set (the
same in every run) are scored with the batch-norm running statistics: `eval_loss` (the mean
cross-entropy, label smoothing included when the run trains with it) and `eval_accuracy`, and of
the parameters' EMA `eval_loss_ema` / `eval_accuracy_ema`. Rows are placed as the train stream's
(this process reads its own rows), so the scores do not depend on micro-batches or devices.
"""
from __future__ import annotations

import math

import jax

from data import mixture, mnist1d
from optim.ema import find_ema
from sharding.batch import assemble
from sharding.mesh import replicated
from trainer.step.program import Program


def make_evaluator(program: Program, source: mixture.Source, local_rows):
  """`evaluate(state) -> row` for the run `program` compiles, this process reading `local_rows`
  of each micro-batch of the test set."""
  mesh, rows = program.mesh, program.micro_rows
  flat = jax.sharding.NamedSharding(mesh, jax.sharding.PartitionSpec(
      *program.batch_sharding.spec[1:]))
  spec = program.spec
  fn = jax.jit(lambda p, s, b: spec.model(p, s).sums(b, train=False),
               in_shardings=(program.model_param_shardings(), spec.model_state_shardings, flat),
               out_shardings=replicated(mesh))
  host = mnist1d.test_batches(source.dir, program.cfg.eval_sequences, rows, local_rows)

  def score(params, model_state) -> tuple[float, float]:
    sums = [0.0, 0.0, 0.0]  # loss, examples, right
    with jax.set_mesh(mesh):
      for mb in host:
        batch = {k: assemble(v, local_rows, flat, (rows, v.shape[1])) for k, v in mb.items()}
        sums = [a + float(b) for a, b in zip(sums, jax.device_get(fn(params, model_state,
                                                                      batch)))]
    n = sums[1]
    return (sums[0] / n, sums[2] / n) if n else (math.nan, math.nan)

  def evaluate(state) -> dict[str, float]:
    row = dict(zip(("eval_loss", "eval_accuracy"), score(state.params, state.model_state)))
    ema = find_ema(state.opt_state, like=state.params)
    if ema is not None:
      row.update(zip(("eval_loss_ema", "eval_accuracy_ema"), score(ema, state.model_state)))
    return row

  return evaluate

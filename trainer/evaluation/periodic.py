"""The evaluation a training run does every `eval_every` steps (`make_evaluator`).

The validation set is fixed: the first `eval_sequences` windows of each source's validation split
in a fixed order (a uniform sample of its windows; data/pipeline.py `validation_batches`), read
once and scored the same way every time, whatever the run's seed, micro-batch size, devices or
processes. Windows are packed as training sequences, so `eval_loss` is the training loss's
counterpart on unseen text, not a whole-split score (that is trainer/evaluation/split.py).
Scores: `eval_loss` and `eval_bpb`, per source too with a mixture (`eval_loss/NAME`), of the EMA
parameters too (`eval_loss_ema`); a DiLoCo run scores its anchor. Why and details:
docs/tracking.md#evaluation-during-training.
"""
from __future__ import annotations

import math
from collections.abc import Callable, Sequence

import jax

from data import mixture, pipeline
from data.prepare import read_meta
from optim.ema import find_ema
from sharding.batch import assemble
from sharding.mesh import replicated
from trainer.step.program import Program


def jitted_eval_step(program: Program):
  """(the jitted eval step `(params, micro-batch) -> (loss sum, tokens)` of the run `program`
  compiles, the sharding of one micro-batch [B, S])."""
  flat = jax.sharding.NamedSharding(program.mesh, jax.sharding.PartitionSpec(
      *program.batch_sharding.spec[1:]))
  fn = jax.jit(program.eval_step(), in_shardings=(program.model_param_shardings(), flat),
               out_shardings=replicated(program.mesh))
  return fn, flat


def make_evaluator(program: Program, sources: Sequence[mixture.Source],
                   local_rows: Sequence[int]) -> Callable[..., dict[str, float]]:
  """`evaluate(state) -> row` for the run `program` compiles, on `sources` (one, or a mixture's),
  this process reading the batch rows `local_rows`."""
  mesh, micro_rows, cfg = program.mesh, program.micro_rows, program.cfg
  fn, flat = jitted_eval_step(program)
  hosts = [pipeline.validation_batches(src, cfg.data.seq_len, cfg.eval_sequences, micro_rows,
                                       local_rows) for src in sources]
  # Bits per byte = nats per predicted token / ln 2 x predicted tokens / UTF-8 bytes of the
  # validation split (counted at preparation): comparable across tokenizers.
  bits = [(lambda v: v["targets"] / v["bytes"] / math.log(2))(
      read_meta(src.dir)["splits"]["validation"]) for src in sources]

  def score(params) -> dict[str, float]:
    """eval_loss and eval_bpb (token-weighted over mixture sources), and per source
    eval_loss/NAME and eval_bpb/NAME when there are several."""
    row, total, total_bpb = {}, 0.0, 0.0
    with jax.set_mesh(mesh):
      for src, host, to_bits in zip(sources, hosts, bits):
        loss_sum, tokens = 0.0, 0.0
        for mb in host:
          batch = {k: assemble(mb[k], local_rows, flat, (micro_rows, mb[k].shape[1]))
                   for k in pipeline.BATCH_KEYS}
          s, n = jax.device_get(fn(params, batch))
          loss_sum, tokens = loss_sum + float(s), tokens + float(n)
        loss = loss_sum / tokens if tokens else math.nan  # nothing scored: no score, not 0
        if len(sources) > 1:
          row[f"eval_loss/{src.name}"], row[f"eval_bpb/{src.name}"] = loss, loss * to_bits
        total, total_bpb = total + src.weight * loss, total_bpb + src.weight * loss * to_bits
    return {"eval_loss": total, "eval_bpb": total_bpb, **row}

  def evaluate(state) -> dict[str, float]:
    """The row of one evaluation: `score` of the parameters, and eval_loss_ema of their EMA."""
    row = score(program.model_params(state))  # a DiLoCo run's anchor
    ema = find_ema(state.opt_state, like=state.params)
    if ema is not None:
      row["eval_loss_ema"] = score(ema)["eval_loss"]
    return row

  return evaluate

"""The evaluation a training run does every `eval_every` steps (`make_evaluator`).

The validation set is fixed: the first `eval_sequences` windows of each source's validation split
in a fixed order (a uniform sample of its windows; data/pipeline.py `validation_batches`), read
once and scored the same way every time, whatever the run's seed, micro-batch size, devices or
processes. Windows are packed as training sequences, so `eval_loss` is the training loss's
counterpart on unseen text, not a whole-split score (that is trainer/evaluation/split.py).
Scores: `eval_loss` and `eval_bpb`, per source too with a mixture (`eval_loss/NAME`), of the EMA
parameters too (`eval_loss_ema`); a DiLoCo run scores its anchor. A masked LM (`data.mask_rate`,
data/masking.py) scores its fixed masked positions: `eval_loss` and `eval_masked_accuracy`, beside
`eval_unigram_accuracy`, the same set's accuracy of always predicting its most frequent masked
token (no bits per byte: the targets are not the text's next tokens). Why and details:
docs/tracking.md#evaluation-during-training, docs/mlm.md.
"""
from __future__ import annotations

import math
from collections.abc import Callable, Sequence

import jax
import numpy as np

from data import mixture, pipeline
from data.masking import Masking
from data.prepare import read_meta
from optim.ema import find_ema
from sharding.batch import assemble
from sharding.mesh import replicated
from trainer.evaluation import classifier
from trainer.step.program import Program


def jitted_eval_step(program: Program, *, masked: bool = False):
  """(the jitted eval step `(params, micro-batch) -> (loss sum, tokens)` of the run `program`
  compiles, the sharding of one micro-batch [B, S]). `masked`: the masked LM's, `(loss sum,
  tokens, tokens predicted right)` (`Transformer.masked_sums`)."""
  flat = jax.sharding.NamedSharding(program.mesh, jax.sharding.PartitionSpec(
      *program.batch_sharding.spec[1:]))
  step = program.eval_step()
  if masked:
    step = lambda params, b: program.spec.model(params).masked_sums(
        b["inputs"], b["positions"], b["segment_ids"], b["targets"], b["loss_mask"])
  fn = jax.jit(step, in_shardings=(program.model_param_shardings(), flat),
               out_shardings=replicated(program.mesh))
  return fn, flat


def unigram_accuracy(batches) -> float:
  """The accuracy of always predicting the most frequent target at the masked positions of
  `batches` (all rows of a validation set): the masked LM's unigram baseline on that set."""
  targets = np.concatenate([b["targets"][b["loss_mask"]] for b in batches])
  return float(np.bincount(targets).max() / len(targets)) if len(targets) else math.nan


def make_evaluator(program: Program, sources: Sequence[mixture.Source],
                   local_rows: Sequence[int]) -> Callable[..., dict[str, float]]:
  """`evaluate(state) -> row` for the run `program` compiles, on `sources` (one, or a mixture's),
  this process reading the batch rows `local_rows`."""
  if program.spec.abstract_model_state is not None:  # the vision workload's classifier
    return classifier.make_evaluator(program, sources[0], local_rows)
  mesh, micro_rows, cfg = program.mesh, program.micro_rows, program.cfg
  masking = Masking.of(cfg.data.mask_rate, read_meta(sources[0].dir))
  fn, flat = jitted_eval_step(program, masked=masking is not None)
  read = lambda src, rows: pipeline.validation_batches(
      src, cfg.data.seq_len, cfg.eval_sequences, micro_rows, rows, masking=masking)
  hosts = [read(src, local_rows) for src in sources]
  # every process the same baseline, from all rows of the set (one process holds them all)
  whole = sorted(local_rows) == list(range(micro_rows))
  unigram = [unigram_accuracy(host if whole else read(src, None))
             for src, host in zip(sources, hosts)] if masking else None
  # Bits per byte = nats per predicted token / ln 2 x predicted tokens / UTF-8 bytes of the
  # validation split (counted at preparation): comparable across tokenizers.
  bits = [(lambda v: v["targets"] / v["bytes"] / math.log(2))(
      read_meta(src.dir)["splits"]["validation"]) for src in sources]

  def score(params) -> dict[str, float]:
    """eval_loss and eval_bpb (masked LM: eval_masked_accuracy and eval_unigram_accuracy),
    weighted over mixture sources, and per source eval_loss/NAME and eval_bpb/NAME (or
    eval_masked_accuracy/NAME) when there are several."""
    row, total, total_bpb, total_acc = {}, 0.0, 0.0, 0.0
    with jax.set_mesh(mesh):
      for src, host, to_bits in zip(sources, hosts, bits):
        sums = [0.0] * (3 if masking else 2)  # loss, tokens (, right: the masked LM's)
        for mb in host:
          batch = {k: assemble(mb[k], local_rows, flat, (micro_rows, mb[k].shape[1]))
                   for k in pipeline.BATCH_KEYS}
          sums = [a + float(b) for a, b in zip(sums, jax.device_get(fn(params, batch)))]
        tokens = sums[1]  # nothing scored: no score, not 0
        loss = sums[0] / tokens if tokens else math.nan
        acc = sums[2] / tokens if masking and tokens else math.nan
        if len(sources) > 1:
          row[f"eval_loss/{src.name}"] = loss
          row[f"eval_masked_accuracy/{src.name}" if masking else f"eval_bpb/{src.name}"] = (
              acc if masking else loss * to_bits)
        total, total_bpb = total + src.weight * loss, total_bpb + src.weight * loss * to_bits
        total_acc += src.weight * acc
    if masking:
      return {"eval_loss": total, "eval_masked_accuracy": total_acc,
              "eval_unigram_accuracy": sum(s.weight * u for s, u in zip(sources, unigram)), **row}
    return {"eval_loss": total, "eval_bpb": total_bpb, **row}

  def evaluate(state) -> dict[str, float]:
    """The row of one evaluation: `score` of the parameters, and eval_loss_ema of their EMA."""
    row = score(program.model_params(state))  # a DiLoCo run's anchor
    ema = find_ema(state.opt_state, like=state.params)
    if ema is not None:
      row["eval_loss_ema"] = score(ema)["eval_loss"]
    return row

  return evaluate

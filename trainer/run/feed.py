"""What a run feeds its train step: the data sources (`data.dir`, a weighted `data.mixture`, or
the embedded default corpus), the train stream of this process's rows, and global [M, B, S]
batches assembled from this process's micro-batches (`Feed`)."""
from __future__ import annotations

import jax
import numpy as np

from data import mixture, mnist1d, pipeline
from data.masking import Masking
from data.prepare import ensure_default_corpus, read_meta
from sharding.batch import assemble, process_rows


def sources(cfg) -> tuple[mixture.Source, ...]:
  """The run's data sources: `data.mixture`'s, or the one of `data.dir` (the default corpus,
  prepared on first use, when it is empty)."""
  d = cfg.data
  if cfg.model.kind == "resnet1d":  # the vision workload's generated, cached arrays
    return (mixture.Source("mnist1d", d.dir or mnist1d.prepare(d.mnist1d.train_examples,
                                                               d.mnist1d.seed)),)
  return mixture.parse(d.mixture) if d.mixture else (
      mixture.Source("data", d.dir or ensure_default_corpus()),)


class Feed:
  """The train stream of one run on its program's mesh (`program`: trainer/step/program.py)."""

  def __init__(self, cfg, program, data_sources: tuple[mixture.Source, ...]):
    d = cfg.data
    self.sources, self.micro_rows = data_sources, program.micro_rows
    self.batch_sharding = program.batch_sharding
    self.dir = data_sources[0].dir
    vision = cfg.model.kind == "resnet1d"
    self.meta = mnist1d.read_meta(self.dir) if vision else read_meta(self.dir)
    # This process reads the rows its devices hold (any mesh device order works).
    self.local_rows = process_rows(self.batch_sharding, (1, self.micro_rows, d.seq_len), 1)
    if vision:
      self.spec = mnist1d.ExampleSpec(self.dir, self.micro_rows, seed=cfg.seed,
                                      row_ids=self.local_rows, prefetch=d.prefetch)
      return
    self.spec = pipeline.StreamSpec(
        self.dir, "train", d.seq_len, self.micro_rows, seed=cfg.seed, row_ids=self.local_rows,
        prefetch=d.prefetch, mixture=data_sources if d.mixture else (),
        masking=Masking.of(d.mask_rate, self.meta))

  def iterator(self):
    """A fresh iterator over this process's micro-batches, from the start of the data order."""
    return iter(pipeline.dataset(self.spec))

  def global_batch(self, micro_batches: list[dict[str, np.ndarray]]) -> dict[str, jax.Array]:
    """Stack this process's micro-batches and assemble the global [M, B, S] arrays."""
    out = {}
    for key in micro_batches[0]:
      local = np.stack([mb[key] for mb in micro_batches])
      global_shape = (local.shape[0], self.micro_rows, local.shape[2])
      out[key] = assemble(local, self.local_rows, self.batch_sharding, global_shape, row_axis=1)
    return out

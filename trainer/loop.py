"""The training loop: build everything from the config, resume if the workdir has a checkpoint,
run the jitted step, log, evaluate, checkpoint.

The loop keeps the device busy: a step is dispatched before the metrics of the previous logged
step are read back (`jax.device_get` on step N's metrics happens while step N+1 runs), and the
data pipeline prepares micro-batches in a background thread.
"""
from __future__ import annotations

import json
import os
import time

import jax
import ml_collections
import numpy as np

from data import pipeline
from data.prepare import ensure_default_corpus, read_meta
from models.llama import ModelConfig, flops_per_token, param_counts
from optim import build_optimizer
from sharding.mesh import batch_sharding, make_mesh, replicated
from trainer.checkpoint import Checkpointer
from trainer.metrics import MetricsWriter, machine_peak_flops
from trainer.state import ModelSpec, abstract_state, init_state, state_shardings
from trainer.step import make_eval_step, make_train_step


def setup_compilation_cache(path: str) -> str | None:
  """Turn on JAX's persistent compilation cache (keyed by the program, so always safe)."""
  if path == "off":
    return None
  if not path:
    base = os.environ.get("SCALETRAIN_CACHE") or os.path.join(
        os.environ.get("XDG_CACHE_HOME") or os.path.expanduser("~/.cache"), "scaletrain")
    path = os.path.join(base, "jax")
  jax.config.update("jax_compilation_cache_dir", path)
  jax.config.update("jax_persistent_cache_min_compile_time_secs", 1.0)
  jax.config.update("jax_persistent_cache_min_entry_size_bytes", 0)
  return path


class Run:
  """One training run in one workdir. `Run(cfg, workdir).train()`."""

  def __init__(self, cfg: ml_collections.ConfigDict, workdir: str):
    self.cfg = cfg
    self.workdir = os.path.abspath(workdir)
    self.is_lead = jax.process_index() == 0
    d = cfg.data
    self.micro_rows = d.micro_batch_size or d.global_batch_size
    self.num_micro = d.global_batch_size // self.micro_rows

    setup_compilation_cache(cfg.trainer.compile_cache_dir)
    self.mesh = make_mesh(cfg.mesh)
    self.model_cfg = ModelConfig.from_config(cfg.model)
    self.spec = ModelSpec(self.model_cfg, self.mesh, cfg.seed)
    self.tx, self.schedule = build_optimizer(cfg.optim, self.spec.logical_names, cfg.steps)
    self.shardings = state_shardings(self.spec, self.tx)
    self.batch_sharding = batch_sharding(self.mesh, microbatched=True)

    self.data_dir = d.dir or ensure_default_corpus()
    self.data_meta = read_meta(self.data_dir)
    self.train_spec = pipeline.StreamSpec(
        self.data_dir, "train", d.seq_len, self.micro_rows, seed=cfg.seed,
        process_index=jax.process_index(), process_count=jax.process_count(),
        prefetch=d.prefetch)
    self.checkpointer = Checkpointer(os.path.join(self.workdir, "checkpoints"),
                                     keep=cfg.checkpoint.keep,
                                     async_save=cfg.checkpoint.async_save)

  # --------------------------------------------------------------------------------------------

  def global_batch(self, micro_batches: list[dict[str, np.ndarray]]) -> dict[str, jax.Array]:
    """Stack this process's micro-batches and assemble the global [M, B, S] arrays."""
    out = {}
    for key in pipeline.BATCH_KEYS:
      local = np.stack([mb[key] for mb in micro_batches])
      global_shape = (local.shape[0], self.micro_rows, local.shape[2])
      out[key] = jax.make_array_from_process_local_data(self.batch_sharding, local, global_shape)
    return out

  def _abstract_batch(self) -> dict[str, jax.ShapeDtypeStruct]:
    shape = (self.num_micro, self.micro_rows, self.cfg.data.seq_len)
    dtypes = {"loss_mask": np.bool_}
    return {k: jax.ShapeDtypeStruct(shape, dtypes.get(k, np.int32), sharding=self.batch_sharding)
            for k in pipeline.BATCH_KEYS}

  def compile(self, abstract):
    """AOT-compile the train step for the state/batch shapes (no data needed)."""
    step = jax.jit(make_train_step(self.spec, self.tx, self.schedule),
                   in_shardings=(self.shardings, self.batch_sharding),
                   out_shardings=(self.shardings, replicated(self.mesh)),
                   donate_argnums=0)
    with jax.set_mesh(self.mesh):
      return step.lower(abstract, self._abstract_batch()).compile()

  def _eval_fn(self):
    micro = self.batch_sharding
    flat = jax.sharding.NamedSharding(self.mesh, jax.sharding.PartitionSpec(*micro.spec[1:]))
    fn = jax.jit(make_eval_step(self.spec), in_shardings=(self.shardings.params, flat),
                 out_shardings=replicated(self.mesh))
    host = pipeline.take(
        pipeline.StreamSpec(self.data_dir, "validation", self.cfg.data.seq_len, self.micro_rows,
                            shuffle=False, process_index=jax.process_index(),
                            process_count=jax.process_count()),
        self.cfg.eval_steps)

    def evaluate(params) -> float:
      loss_sum, tokens = 0.0, 0.0
      with jax.set_mesh(self.mesh):
        for mb in host:
          batch = {k: jax.make_array_from_process_local_data(
              flat, mb[k], (self.micro_rows, mb[k].shape[1])) for k in pipeline.BATCH_KEYS}
          s, n = jax.device_get(fn(params, batch))
          loss_sum, tokens = loss_sum + float(s), tokens + float(n)
      return loss_sum / max(tokens, 1.0)

    return evaluate

  # --------------------------------------------------------------------------------------------

  def train(self) -> dict:
    cfg = self.cfg
    os.makedirs(self.workdir, exist_ok=True)
    writer = MetricsWriter(self.workdir, enabled=self.is_lead, progress_total=cfg.steps,
                           progress_bar=cfg.trainer.progress_bar)
    if self.is_lead:
      with open(os.path.join(self.workdir, "config.json"), "w") as f:
        json.dump(cfg.to_dict(), f, indent=1)
    counts = param_counts(self.model_cfg)
    src = self.data_meta["source"]
    writer.log(f"devices: {jax.device_count()} x {jax.devices()[0].device_kind} "
               f"({jax.process_count()} process(es)); mesh "
               + " ".join(f"{k}={v}" for k, v in self.mesh.shape.items()))
    writer.log(f"model: {counts['total'] / 1e6:.2f}M params "
               f"({counts['non_embedding'] / 1e6:.2f}M non-embedding); "
               f"data: {src.get('name')} fingerprint {src.get('fingerprint')} "
               f"({self.data_meta['splits']['train']['tokens']:,} train tokens) from "
               f"{self.data_dir}")

    train_iter = iter(pipeline.dataset(self.train_spec))
    abstract = abstract_state(self.spec, self.tx)
    latest = self.checkpointer.latest_step()
    if latest is not None:
      state = self.checkpointer.restore(latest, abstract, train_iter)
      writer.log(f"resumed from {self.checkpointer.directory}/{latest}")
    else:
      state = init_state(self.spec, self.tx)
    start = int(jax.device_get(state.step))

    t0 = time.perf_counter()
    train_step = self.compile(abstract)
    compile_seconds = time.perf_counter() - t0
    evaluate = self._eval_fn() if cfg.eval_every else None

    tokens_per_step = cfg.data.global_batch_size * cfg.data.seq_len
    flops_token = flops_per_token(self.model_cfg, cfg.data.seq_len)["total"]
    peak, peak_source = machine_peak_flops(cfg.trainer.peak_flops_per_device)
    writer.log(f"compiled train step in {compile_seconds:.1f}s; {flops_token / 1e6:.2f} MFLOPs "
               f"per token; peak {peak / 1e12:.3g} TFLOP/s ({peak_source})")

    last = {}
    if start >= cfg.steps:
      writer.log(f"already at step {start} >= steps={cfg.steps}; nothing to do")
    pending = None  # (step, device metrics) of the last logged step, read after the next dispatch
    window_start, window_steps, excluded = time.perf_counter(), 0, 0.0

    def flush(pending):
      nonlocal window_start, window_steps, excluded
      step, metrics = pending
      host = {k: float(v) for k, v in jax.device_get(metrics).items()}
      now = time.perf_counter()
      seconds = max(now - window_start - excluded, 1e-9) / max(window_steps, 1)
      host["step_time"] = seconds
      host["tokens_per_sec"] = tokens_per_step / seconds
      host["mfu"] = host["tokens_per_sec"] * flops_token / peak
      window_start, window_steps, excluded = now, 0, 0.0
      writer.write(step, host)
      writer.advance(0, loss=host["loss"])
      return host

    with jax.set_mesh(self.mesh):
      for step in range(start, cfg.steps):
        batch = self.global_batch([next(train_iter) for _ in range(self.num_micro)])
        state, metrics = train_step(state, batch)
        done = step + 1
        window_steps += 1
        writer.advance(1)
        if pending is not None:
          last = flush(pending)
          pending = None
        if done % cfg.log_every == 0 or done == cfg.steps:
          pending = (done, metrics)
        if (cfg.checkpoint.every_steps and done % cfg.checkpoint.every_steps == 0) or \
            done == cfg.steps:
          if pending is not None:  # read the metrics first, so the save is not timed as a step
            last = flush(pending)
            pending = None
          t = time.perf_counter()
          self.checkpointer.save(done, state, train_iter, cfg.to_dict())
          excluded += time.perf_counter() - t
        if evaluate is not None and (done % cfg.eval_every == 0 or done == cfg.steps):
          if pending is not None:
            last = flush(pending)
            pending = None
          t = time.perf_counter()
          eval_loss = evaluate(state.params)
          writer.write(done, {"eval_loss": eval_loss})
          last["eval_loss"] = eval_loss
          excluded += time.perf_counter() - t
      if pending is not None:
        last = flush(pending)
    self.checkpointer.wait()
    self.checkpointer.close()
    writer.close()
    return last

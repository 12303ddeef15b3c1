"""The compiled program of a run: model, optimizer, shardings and the jitted train step.

Everything here depends only on the config and a mesh, not on data or devices being real, so
the same object serves training (`trainer/run/loop.py`), benchmarks, and ahead-of-time compilation
for hardware this machine does not have (a mesh over a TPU topology's devices).

A DiLoCo run (`optim.diloco.replicas` >= 1, `run_mesh` adds the `replica` axis) has the same
interface: its state is a `trainer.step.diloco.DiLoCoState`, its train step the replicas' inner step,
and it has one more program, the outer step (`jitted_outer`, run every `inner_steps` steps).
"""
from __future__ import annotations

import os

import jax
import ml_collections
from jax.sharding import Mesh

from models import pipeline as model_pipeline
from models.llama import ModelConfig
from models.resnet import ResNetConfig, row_group
from optim import build_optimizer
from optim.autopilot import with_defaults
from optim.diloco import DiLoCoConfig, outer_optimizer
from optim.seesaw import planned_ramp, seesaw_defaults
from sharding.mesh import batch_sharding, make_mesh, mesh_platform, replicated
from sharding.pipeline import Pipeline
from trainer.step import diloco
from trainer.step.pipelined import Layout
from trainer.step.state import (ModelSpec, abstract_state, fresh_state, init_sharded, init_state,
                           state_shardings)
from trainer.step.train_step import GuardConfig, make_eval_step, make_train_step


# XLA options the train step is compiled with, by platform. CPU: copy insertion with region
# analysis. Without it XLA copies the whole donated state (parameters, Adam's moments) at every
# step: the guard keeps the old state of a skipped step (`jnp.where(bad, old, new)`, trainer/
# step.py), so the old values have a second reader besides the in-place update, and the default
# analysis cannot order the two (tests/test_train_step.py counts the copies; the TPU compiler
# makes none). XLA's own host-offloading programs compile with this option on.
COMPILER_OPTIONS = {"cpu": {"xla_cpu_copy_insertion_use_region_analysis": True}}
# With `model.fp8` on a GPU: cuBLAS for the step's GEMMs instead of XLA's Triton GEMM fusions,
# so that the forward, dX and dW products of models/fp8.py are cuBLASLt fp8 GEMMs
# (`__cublas$lt$matmul$f8`). With Triton GEMMs enabled an ahead-of-time compile makes all three
# Triton kernels, and the GPU run of issue 25 (autotuned) made one of the three cuBLASLt fp8
# (tests/test_fp8.py reads the H100 program). The bf16 GEMMs of the step go to cuBLAS too.
FP8_GPU_OPTIONS = {"xla_gpu_enable_triton_gemm": False}


def compiler_options(platform: str, model_cfg) -> dict | None:
  """The XLA options a step for `platform` compiles with: the fp8 rule, then the platform's own
  (COMPILER_OPTIONS, which bench/variants.py's --xla A/Bs set, win)."""
  options = dict(FP8_GPU_OPTIONS) if platform == "gpu" and model_cfg.fp8 else {}
  options.update(COMPILER_OPTIONS.get(platform, {}))
  return options or None


def run_mesh(cfg: ml_collections.ConfigDict, devices=None) -> Mesh:
  """The mesh a run of `cfg` trains on (`sharding.make_mesh`, with DiLoCo's `replica` axis when
  `optim.diloco.replicas` asks for one)."""
  return make_mesh(cfg.mesh, devices, replicas=cfg.optim.diloco.replicas)


class Program:

  def __init__(self, cfg: ml_collections.ConfigDict, mesh: Mesh):
    # The batch autopilot's or Seesaw's defaults filled in (a copy; `defaults_filled`: one line
    # each, which the run prints), so every part of the program reads the values the run uses.
    cfg, auto = with_defaults(cfg)
    self.cfg, seesaw = seesaw_defaults(cfg)
    self.defaults_filled = [f"batch autopilot default: {line}" for line in auto] + \
        [f"Seesaw: {line}" for line in seesaw]
    cfg = self.cfg
    self.mesh = mesh
    d = cfg.data
    self.micro_rows = d.micro_batch_size or d.global_batch_size
    self.num_micro = d.global_batch_size // self.micro_rows
    self.model_cfg = (ResNetConfig if cfg.model.kind == "resnet1d" else ModelConfig).from_config(
        cfg.model)
    # Pipeline stages over `mesh.stage` (trainer/step/pipelined.py), or None.
    self.pipeline = Pipeline.from_config(cfg, dict(mesh.shape))
    self.spec = ModelSpec(self.model_cfg, mesh, cfg.seed, self.pipeline)
    # One ramp per run, shared by the schedules and the loop (the batch autopilot grows it).
    self.ramp = planned_ramp(d, cfg.optim, cfg.steps)
    self.tx, self.schedule = build_optimizer(
        cfg.optim, self.spec.logical_names, cfg.steps, cfg.data,
        width_multiplier=self.model_cfg.width_multiplier, depth=self.model_cfg.depth_scaling,
        ramp=self.ramp)
    self.diloco = DiLoCoConfig.from_config(cfg.optim)
    if self.diloco is None:
      self.shardings = state_shardings(self.spec, self.tx)
    else:
      self.outer_tx = outer_optimizer(self.diloco)
      self.shardings = diloco.state_shardings(self.spec, self.tx, self.outer_tx)
    self.batch_sharding = batch_sharding(mesh, microbatched=True)
    # The layer order of the train state against the checkpoints' plain stack (trainer/step/pipelined.py)
    self.layout = Layout(self.pipeline, self.model_cfg, self.shardings)
    self._slot_flops = None

  def slot_flops(self) -> dict:
    """The FLOPs of one stage's F, B and W on a micro-batch (models/pipeline.py `slot_flops`):
    what the schedule table's bubble weighs its slots by; traced once."""
    if self._slot_flops is None:
      with jax.set_mesh(self.mesh):
        self._slot_flops = model_pipeline.slot_flops(
            self.spec.graphdef, self.spec.abstract_params, self.pipeline, self.micro_rows,
            self.cfg.data.seq_len)
    return self._slot_flops

  def abstract_state(self):
    if self.diloco is None:
      return abstract_state(self.spec, self.tx)
    return diloco.abstract_state(self.spec, self.tx, self.outer_tx, self.diloco.replicas)

  def init_state(self, params=None):
    """A fresh train state (from the seed, or with `params` (the plain layer stack) and a fresh
    optimizer state)."""
    if self.layout.reordered:  # a circular pipeline's state: from the plain stack, reordered
      if params is None:
        params = init_sharded(self.spec, lambda p: p, self.spec.param_shardings)
      build = lambda p: fresh_state(self.tx, self.layout.stored(p, self.spec.param_shardings))
      return init_sharded(self.spec, build, self.shardings, params)
    if self.diloco is None:
      return init_state(self.spec, self.tx, params)
    return diloco.init_state(self.spec, self.tx, self.outer_tx, self.diloco.replicas, params)

  def model_params(self, state):
    """The parameters of the model the run has trained so far: a DiLoCo run's anchor."""
    return state.params if self.diloco is None else state.anchor

  def model_param_shardings(self):
    return self.shardings.params if self.diloco is None else self.shardings.anchor

  def eval_step(self):
    """eval(model params, batch[B, S]) -> (loss sum, target tokens), not jitted."""
    if self.diloco is None:
      return make_eval_step(self.spec)
    return diloco.make_eval_step(self.spec, self.diloco.replicas)

  def abstract_batch(self, num_micro: int | None = None) -> dict[str, jax.ShapeDtypeStruct]:
    rows = (num_micro or self.num_micro, self.micro_rows)
    return {k: jax.ShapeDtypeStruct((*rows, width), dtype, sharding=self.batch_sharding)
            for k, (width, dtype) in self.spec.batch_layout(self.cfg.data.seq_len).items()}

  def computes_norms(self, logs: bool) -> bool:
    """Whether the step computes param_norm and update_norm (`trainer.norm_metrics`): on the
    steps that log ("log_steps"), on every step, or never."""
    mode = self.cfg.trainer.norm_metrics
    return mode == "every_step" or (mode == "log_steps" and logs)

  def jitted_step(self, *, measure_noise: bool = False, logs: bool = False):
    """The jitted train step; with `measure_noise` the variant that measures the gradient noise
    scale (trainer/step/train_step.py), else the plain step (the meter's state passes through). `logs`:
    the variant for the steps whose metrics row is written (with the norm metrics under
    `trainer.norm_metrics="log_steps"`); the default is the step every other step runs."""
    guard = GuardConfig.from_config(self.cfg.trainer)
    if self.diloco is None:
      step = make_train_step(self.spec, self.tx, self.schedule, guard,
                             measure_noise=measure_noise,
                             noise_pieces=int(self.cfg.optim.noise_scale_pieces),
                             norm_metrics=self.computes_norms(logs),
                             row_group=row_group(self.cfg))
      metrics = replicated(self.mesh)
    else:
      if measure_noise:
        raise ValueError("the noise-scale meter does not run under DiLoCo (config checks say so)")
      step = diloco.make_inner_step(self.spec, self.tx, self.schedule, guard,
                                    self.diloco.replicas, norm_metrics=self.computes_norms(logs))
      metrics = diloco.metrics_sharding(self.mesh)
    return jax.jit(step, in_shardings=(self.shardings, self.batch_sharding),
                   out_shardings=(self.shardings, metrics), donate_argnums=0,
                   compiler_options=compiler_options(mesh_platform(self.mesh), self.model_cfg))

  def jitted_outer(self):
    """A DiLoCo run's outer step, jitted: state -> (state, metrics) (trainer/step/diloco.py)."""
    return jax.jit(diloco.make_outer_step(self.outer_tx, self.diloco.replicas),
                   in_shardings=(self.shardings,),
                   out_shardings=(self.shardings, replicated(self.mesh)), donate_argnums=0,
                   compiler_options=compiler_options(mesh_platform(self.mesh), self.model_cfg))

  def compile_outer(self):
    """AOT-compile a DiLoCo run's outer step."""
    state = self.abstract_state()
    with jax.set_mesh(self.mesh):
      return self.jitted_outer().lower(state).compile()

  def lower(self, num_micro: int | None = None, *, measure_noise: bool = False,
            logs: bool = False):
    # The abstract arguments are built outside the mesh context: `abstract_state` traces the
    # optimizer's init, which must not try to place anything on the (possibly compile-only,
    # e.g. TPU topology) devices of the mesh.
    args = self.abstract_state(), self.abstract_batch(num_micro)
    with jax.set_mesh(self.mesh):
      return self.jitted_step(measure_noise=measure_noise, logs=logs).lower(*args)

  def compile(self, num_micro: int | None = None, *, measure_noise: bool = False,
              logs: bool = False):
    """AOT-compile the train step for the state/batch shapes (no data needed): the plain step,
    or with `measure_noise` the one that measures the gradient noise scale (the loop runs it
    on the steps that log it); `logs` as in `jitted_step`."""
    return self.lower(num_micro, measure_noise=measure_noise, logs=logs).compile()


def setup_compilation_cache(path: str) -> str | None:
  """Turn on JAX's persistent compilation cache (keyed by the program, so always safe)."""
  if path == "off":
    return None
  if not path:
    base = os.environ.get("SCALETRAIN_CACHE") or os.path.join(
        os.environ.get("XDG_CACHE_HOME") or os.path.expanduser("~/.cache"), "scaletrain")
    path = os.path.join(base, "jax")
  jax.config.update("jax_compilation_cache_dir", path)
  # Every program that took 0.1 s: the evaluation and initialisation programs beside the step
  # take 0.1-1 s each on CPU (JAX's default, 1 s, left them to recompile at every start: a
  # restart of the tests' tiny run took 7.0 s, now 6.6 s).
  jax.config.update("jax_persistent_cache_min_compile_time_secs", 0.1)
  jax.config.update("jax_persistent_cache_min_entry_size_bytes", 0)
  return path

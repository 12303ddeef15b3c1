"""Validation of a run config: everything a user can get wrong, checked before any device work.

`validate(cfg, devices)` checks the whole config (`trainer/config/defaults.py` holds the keys and their
defaults) against itself and the devices the run will use: the range or choices of every key, the
mesh against the device count and slices, model sizes that split over the mesh, batch and
sequence sizes that divide, the batch-size rules, ramp and autopilot, mixture of experts, the
data's vocabulary against the model's (`model.vocab_size=0` is filled in from the data here),
logging and checkpoint settings. `check_distributed` checks the `distributed` block on its own
(`trainer/multihost/launch.py` calls it before jax.distributed starts). Each problem is one
`ConfigError` line naming the key, the value and what would work; train.py prints it and exits
with code 2. The parallel layouts' checks (mixture of experts, DiLoCo, pipeline stages) are
trainer/config/parallel_checks.py's.
"""
from __future__ import annotations

import math
import os
import sys

import ml_collections

from data import meta, mixture, pipeline, tokenizer
from models.config import DEPTH_PARAMETRIZATIONS, PARAMETRIZATIONS
from models.llama import ATTENTION_IMPLS, DTYPES, REMAT_POLICIES
from models.rope import ROPE_SCALING_TYPES
from optim import OPTIMIZERS, SCHEDULES, WSD_SHAPES
from optim.factory import MUP_OPTIMIZERS
from optim.scaling import SCALE_INVARIANT_OPTIMIZERS
from sharding.mesh import MeshError, data_parallel_size, num_slices, resolve_mesh_shape
from trainer.config.batch_checks import check_batch_science, check_muon, resolved
from trainer.config.defaults import (NORM_METRICS, RESIZE_MODES, ConfigError, parse_fault,
                                     parse_window)
from trainer.config.defaults import choice as _choice, need as _need
from trainer.config.parallel_checks import check_diloco, check_moe, check_pipeline
from trainer.config.vision_checks import check_vision


def _check_local_tier(cfg: ml_collections.ConfigDict) -> None:
  """checkpoint.local_* (trainer/checkpoint/local_tier.py) and data.on_resize (trainer/checkpoint/elastic.py)."""
  ck, d = cfg.checkpoint, cfg.data
  _need(ck.local_every_steps >= 0,
        f"checkpoint.local_every_steps={ck.local_every_steps}: must be >= 0 (0 = no local tier)")
  _need(ck.local_keep >= 1, f"checkpoint.local_keep={ck.local_keep}: must be >= 1")
  _need(bool(ck.local_dir) == bool(ck.local_every_steps),
        f"checkpoint.local_every_steps={ck.local_every_steps} needs checkpoint.local_dir (a "
        "node-local directory, e.g. /dev/shm/<run>)" if ck.local_every_steps else
        f"checkpoint.local_dir={ck.local_dir!r} needs checkpoint.local_every_steps (how often "
        "to save there)")
  _need(not ck.local_dir or "://" not in ck.local_dir,
        f"checkpoint.local_dir={ck.local_dir!r}: must be a filesystem path on this node")
  _choice(cfg, "data.on_resize", RESIZE_MODES)
  _need(d.on_resize == "keep" or not d.batch_ramp,
        f"data.on_resize='rescale' with data.batch_ramp={d.batch_ramp!r}: the ramp (or the "
        "autopilot) decides the batch; use data.on_resize='keep'")


def _check_faults(t: ml_collections.ConfigDict, devices) -> None:
  """trainer.straggler_factor, hang_timeout_s and fault (its process one of the run's)."""
  _need(t.straggler_factor == 0 or t.straggler_factor > 1,
        f"trainer.straggler_factor={t.straggler_factor}: must be > 1 (0 = no straggler report)")
  _need(t.hang_timeout_s >= 0 or t.hang_timeout_s == -1,
        f"trainer.hang_timeout_s={t.hang_timeout_s}: seconds > 0, 0 = automatic, -1 = off")
  try:
    fault = parse_fault(t.fault)
  except ValueError as e:
    raise ConfigError(str(e)) from None
  processes = 1 if isinstance(devices, int) else len({getattr(d, "process_index", 0)
                                                      for d in devices})
  _need(fault is None or fault[1] < processes,
        f"trainer.fault={t.fault!r}: process {fault and fault[1]} is not one of this run's "
        f"{processes} process(es) (0..{processes - 1})")


def _data_vocab(cfg: ml_collections.ConfigDict) -> tuple[int, str]:
  """(vocabulary size, description) of the run's data: data.dir's or data.mixture's meta.json
  (all mixture sources share a tokenizer), or the byte tokenizer of the default corpus. The
  files of data.dir or data.mixture are checked here (`data.pipeline.check`), so missing,
  truncated or too little data is one line before anything is compiled."""
  d = cfg.data
  _need(not (d.dir and d.mixture), f"data.dir={d.dir!r} and data.mixture={d.mixture!r} are "
        "both set; give one")
  if not (d.dir or d.mixture):
    return tokenizer.VOCAB_SIZE, "the default corpus (byte tokenizer)"
  try:
    sources = mixture.parse(d.mixture) if d.mixture else ()
    if d.mixture:
      t = mixture.read_metas(sources)[0]["tokenizer"]
      vocab = t["vocab_size"], f"data.mixture's {t['kind']} tokenizer"
    else:
      t = meta.read_meta(d.dir)["tokenizer"]
      vocab = t["vocab_size"], f"data.dir={d.dir!r} ({t['kind']} tokenizer)"
    if d.seq_len >= 1:
      pipeline.check(pipeline.StreamSpec(d.dir, "train", d.seq_len, 1, mixture=sources),
                     evaluation=bool(cfg.eval_every))
  except (meta.DataError, mixture.MixtureError) as e:
    raise ConfigError(str(e)) from None
  return vocab


def _check_masking(cfg: ml_collections.ConfigDict, sizes: dict, data_vocab: int) -> None:
  """data.mask_rate and model.causal: the masked LM (data/masking.py) and its encoder."""
  rate, causal = cfg.data.mask_rate, cfg.model.causal
  _need(0 <= rate < 1, f"data.mask_rate={rate}: must be in [0, 1) (BERT: 0.15; 0 = the causal "
        "LM)")
  _need(not (rate and causal), f"data.mask_rate={rate} with model.causal=True: a masked LM "
        "predicts tokens from both sides; use model.causal=False")
  _need(rate or causal, "model.causal=False with data.mask_rate=0: a bidirectional model sees "
        "its next-token targets; use data.mask_rate=0.15 (the masked LM) or model.causal=True")
  if rate:
    _need(cfg.model.vocab_size > data_vocab,
          f"model.vocab_size={cfg.model.vocab_size} leaves no id for [MASK] past the data's "
          f"{data_vocab} token ids; use model.vocab_size={data_vocab + 1} or more")
    _need(sizes["stage"] == 1, f"data.mask_rate={rate} with mesh.stage={sizes['stage']}: the "
          "masked LM's evaluation does not run through pipeline stages; use mesh.stage=1")


def _check_logging(cfg: ml_collections.ConfigDict) -> None:
  """trainer.wandb (the package installed when a project is named) and trainer.profile_steps."""
  trainer = cfg.trainer
  _choice(cfg, "trainer.wandb.mode", ("online", "offline", "disabled"))
  _choice(cfg, "trainer.norm_metrics", NORM_METRICS)
  if trainer.wandb.project:
    try:
      import wandb  # noqa: F401, PLC0415  optional
    except ImportError:
      raise ConfigError(f"trainer.wandb.project={trainer.wandb.project!r} needs the wandb "
                        "package: pip install 'scaletrain[wandb]' (or leave the project empty)"
                        ) from None
  try:
    parse_window(trainer.profile_steps)
  except ValueError as e:
    raise ConfigError(str(e)) from None


# A GPU matmul width (per device, after `mesh.tensor` splits it) that is not a multiple of this
# runs slower: issue 25 measured an MLP of width 5461 35% slower than one of 5632 under XLA on
# an H200 (cuBLAS under torch barely noticed). Warned about, not refused: the run is correct.
GPU_MATMUL_MULTIPLE = 64


def matmul_width_warnings(cfg: ml_collections.ConfigDict, sizes: dict) -> list[str]:
  """One line per matmul width of the model (MLP, attention heads x head dim, vocabulary,
  d_model, experts' MLP) that a device multiplies at a width that is not a multiple of
  GPU_MATMUL_MULTIPLE, naming the nearest good values."""
  m, tensor = cfg.model, sizes["tensor"]
  head_dim = m.head_dim or m.d_model // m.num_heads
  widths = {"model.mlp_dim": (m.mlp_dim, tensor),
            "model.num_heads x head dim": (m.num_heads * head_dim, tensor),
            "model.num_kv_heads x head dim": (m.num_kv_heads * head_dim, tensor),
            "model.vocab_size": (m.vocab_size, tensor), "model.d_model": (m.d_model, 1)}
  if m.moe.num_experts:
    widths["model.moe.mlp_dim"] = (m.moe.mlp_dim or m.mlp_dim, tensor)
    if m.moe.shared_expert:
      widths["model.moe.shared_expert"] = (m.moe.shared_expert, tensor)
  out = []
  for key, (width, split) in widths.items():
    step = GPU_MATMUL_MULTIPLE * split
    if width % step:
      low, high = width // step * step, (width // step + 1) * step
      per_device = f" ({width // split} per device over mesh.tensor={split})" if split > 1 else ""
      nearest = f"{low} or {high}" if low else f"{high}"
      out.append(f"{key}={width}{per_device} is not a multiple of {GPU_MATMUL_MULTIPLE}: GPU "
                 f"matmuls of that width run slower (35% for an MLP of 5461 vs 5632 on an H200); "
                 f"the nearest good values are {nearest}")
  return out


def _device_hint(mesh: ml_collections.ConfigDict, num_devices: int, replicas: int,
                 devices) -> str:
  """What to add to a mesh error whose fixed axis sizes ask for more devices than there are:
  how many this process sees and, on CPU, how to get more."""
  wanted = math.prod(v for v in mesh.values() if isinstance(v, int) and v > 0) * max(replicas, 1)
  if wanted <= num_devices:
    return ""
  platform = getattr(devices[0], "platform", None) if not isinstance(devices, int) else None
  return (f" (the fixed sizes ask for {wanted} devices; this process sees {num_devices}"
          + (f" {platform}" if platform else "") + " device(s): run where there are "
          f"{wanted}" + (", or on CPU set XLA_FLAGS=--xla_force_host_platform_device_count="
                         f"{wanted} before starting" if platform in (None, "cpu") else "") + ")")


def validate(cfg: ml_collections.ConfigDict, devices) -> dict:
  """Check the whole config against itself and the devices the run will use (a list: their
  count and slices; or a count, one slice). Returns every mesh axis's size over all devices."""

  _need(cfg.steps >= 1, f"steps={cfg.steps}: must be at least 1")
  for key, value in (("eval_every", cfg.eval_every), ("eval_sequences", cfg.eval_sequences),
                     ("checkpoint.every_steps", cfg.checkpoint.every_steps)):
    _need(value >= 0, f"{key}={value}: must be >= 0")
  _need(cfg.eval_sequences >= 1 or not cfg.eval_every,
        f"eval_sequences={cfg.eval_sequences} with eval_every={cfg.eval_every}: an evaluation "
        "scores eval_sequences validation sequences, so give at least 1 (or eval_every=0: no "
        "evaluation; "
        "python -m tools.evaluate scores a whole split)")
  _need(cfg.log_every >= 1, f"log_every={cfg.log_every}: must be at least 1")
  _need(cfg.checkpoint.keep >= 1, f"checkpoint.keep={cfg.checkpoint.keep}: keep at least 1")

  replicas = cfg.optim.diloco.replicas
  _need(replicas >= 0, f"optim.diloco.replicas={replicas}: must be >= 0 (0 = off, plain data "
        "parallelism; M >= 1 replicas)")
  try:
    if isinstance(devices, int):
      num_devices, slices = devices, 1
    else:
      num_devices, slices = len(devices), num_slices(devices)
    sizes = resolve_mesh_shape(cfg.mesh, num_devices, slices, replicas)
  except MeshError as e:
    raise ConfigError(str(e) + _device_hint(cfg.mesh, num_devices, replicas, devices)) from None

  m = cfg.model
  _choice(cfg, "model.param_dtype", DTYPES)
  _choice(cfg, "model.dtype", DTYPES)
  _choice(cfg, "model.remat", REMAT_POLICIES)
  _choice(cfg, "model.attention", ATTENTION_IMPLS)
  _choice(cfg, "model.rope_scaling.type", ROPE_SCALING_TYPES)
  _choice(cfg, "model.parametrization", PARAMETRIZATIONS)
  _need(m.base_width >= 0, f"model.base_width={m.base_width}: must be >= 0 (0 = d_model)")
  if m.parametrization == "mup" and m.base_width:
    _need(m.head_dim or m.base_width % m.num_heads == 0,
          f"model.base_width={m.base_width} is not divisible by model.num_heads={m.num_heads} "
          "(muP's base head dim); use a multiple of it or set model.head_dim")
    _need(m.base_width == m.d_model or cfg.optim.name in MUP_OPTIMIZERS,
          f"model.parametrization='mup' sets learning rates for "
          f"{', '.join(MUP_OPTIMIZERS)}, not optim.name={cfg.optim.name!r}; "
          "use one of them or model.parametrization='sp'")
  _choice(cfg, "model.depth_parametrization", DEPTH_PARAMETRIZATIONS)
  _need(m.base_depth >= 0, f"model.base_depth={m.base_depth}: must be >= 0 (0 = num_layers)")
  if m.depth_parametrization != "standard":
    base_size = m.base_depth in (0, m.num_layers) and (
        m.parametrization != "mup" or m.base_width in (0, m.d_model))
    _need(base_size or cfg.optim.name in SCALE_INVARIANT_OPTIMIZERS,
          f"model.depth_parametrization={m.depth_parametrization!r} sets CompleteP's rules for "
          f"{', '.join(SCALE_INVARIANT_OPTIMIZERS)}, not optim.name={cfg.optim.name!r}; use "
          "one of them or model.depth_parametrization='standard'")
  check_vision(cfg, sizes)  # model.kind; a vision run has no token data
  data_vocab, data_name = _data_vocab(cfg) if m.kind == "transformer" else (0, "")
  if m.vocab_size == 0:  # from the data, padded to a multiple of 128 (splits over any tensor axis)
    m.vocab_size = -(-(data_vocab + bool(cfg.data.mask_rate)) // 128) * 128  # (+ [MASK])
  for key in ("vocab_size", "d_model", "num_layers", "num_heads", "num_kv_heads", "mlp_dim",
              "scan_unroll"):
    _need(m[key] >= 1, f"model.{key}={m[key]}: must be positive")
  _need(m.num_heads % m.num_kv_heads == 0,
        f"model.num_kv_heads={m.num_kv_heads} must divide model.num_heads={m.num_heads}")
  head_dim = m.head_dim or m.d_model // m.num_heads
  _need(m.head_dim or m.d_model % m.num_heads == 0,
        f"model.d_model={m.d_model} is not divisible by model.num_heads={m.num_heads}; "
        "set model.head_dim")
  _need(head_dim % 2 == 0, f"model head dim {head_dim} must be even for RoPE")
  _need(m.vocab_size >= data_vocab,
        f"model.vocab_size={m.vocab_size} is smaller than the {data_vocab} token ids of "
        f"{data_name}; use model.vocab_size=0 to take the vocabulary from the data")
  _check_masking(cfg, sizes, data_vocab)

  tensor, fsdp = sizes["tensor"], sizes["fsdp"]
  for key in ("num_heads", "num_kv_heads", "mlp_dim", "vocab_size"):
    _need(m[key] % tensor == 0,
          f"model.{key}={m[key]} does not split over mesh.tensor={tensor}; "
          f"use a mesh.tensor that divides {m[key]}")
  _need(m.d_model % fsdp == 0,
        f"model.d_model={m.d_model} does not split over mesh.fsdp={fsdp}; "
        f"use a mesh.fsdp that divides {m.d_model}")

  d = cfg.data
  dp = data_parallel_size(sizes)
  gbs = d.global_batch_size
  _need(gbs >= 1, f"data.global_batch_size={gbs}: must be positive")
  micro = d.micro_batch_size or gbs
  _need(gbs % micro == 0,
        f"data.micro_batch_size={micro} must divide data.global_batch_size={gbs}")
  splits = dp * max(replicas, 1)  # a DiLoCo replica takes 1/M of every micro-batch's rows
  _need(micro % splits == 0,
        f"data.{'micro_batch_size' if d.micro_batch_size else 'global_batch_size'}={micro} is "
        f"not divisible by the data-parallel size {splits} (mesh.data x mesh.fsdp x mesh.expert"
        + (" x optim.diloco.replicas" if replicas else "") + f"); use a multiple of {splits}")
  _need(d.seq_len >= 1, f"data.seq_len={d.seq_len}: must be positive")
  _need(d.seq_len % sizes["sequence"] == 0,
        f"data.seq_len={d.seq_len} is not divisible by mesh.sequence={sizes['sequence']}; "
        f"use a multiple of {sizes['sequence']}")
  _need(m.ring_head_chunks >= 1, f"model.ring_head_chunks={m.ring_head_chunks}: must be >= 1")
  if sizes["sequence"] > 1 and m.attention in ("ring", "auto"):
    chunks = 2 * sizes["sequence"]
    _need(d.seq_len % chunks == 0,
          f"data.seq_len={d.seq_len} does not split into 2 x mesh.sequence = {chunks} chunks, "
          f"which ring attention's load-balanced (zig-zag) layout needs; use a multiple of "
          f"{chunks}")
    local_kv_heads = m.num_kv_heads // tensor
    _need(local_kv_heads % m.ring_head_chunks == 0,
          f"model.ring_head_chunks={m.ring_head_chunks} does not divide the {local_kv_heads} kv "
          f"heads per device (model.num_kv_heads={m.num_kv_heads} / mesh.tensor={tensor}); use "
          f"a divisor of {local_kv_heads}")
  if m.logits_chunk:
    seq_shards = sizes["sequence"]
    _need(m.logits_chunk > 0 and d.seq_len % m.logits_chunk == 0
          and m.logits_chunk % seq_shards == 0,
          f"model.logits_chunk={m.logits_chunk} must divide data.seq_len={d.seq_len} and be a "
          f"multiple of mesh.sequence={seq_shards} (0 = no chunking)")
  _need(d.prefetch >= 0, f"data.prefetch={d.prefetch}: must be >= 0")
  check_moe(cfg, sizes)
  _need(not (m.fp8 and m.moe.num_experts),
        f"model.fp8=True with model.moe.num_experts={m.moe.num_experts}: fp8 covers the dense "
        "layers' projections and the experts' grouped matmul has no fp8 path; use "
        "model.fp8=False for a mixture of experts")

  o = cfg.optim
  _choice(cfg, "optim.name", OPTIMIZERS)
  _choice(cfg, "optim.schedule", SCHEDULES)
  _choice(cfg, "optim.wsd_decay_shape", WSD_SHAPES)
  _need(o.learning_rate >= 0,
        f"optim.learning_rate={o.learning_rate}: must be positive (0 = the optimizer's default)")
  _need(o.warmup_steps >= 0, f"optim.warmup_steps={o.warmup_steps}: must be >= 0")
  _need(0 <= o.min_lr_ratio <= 1, f"optim.min_lr_ratio={o.min_lr_ratio}: must be in [0, 1]")
  _need(o.poly_power > 0, f"optim.poly_power={o.poly_power}: must be positive (MLPerf: 2)")
  _need(0 < o.wsd_decay_fraction <= 1,
        f"optim.wsd_decay_fraction={o.wsd_decay_fraction}: must be in (0, 1]")
  for key in ("b1", "b2", "momentum"):
    _need(0 <= o[key] < 1, f"optim.{key}={o[key]}: must be in [0, 1)")
  _need(o.weight_decay >= 0 or o.weight_decay == -1,
        f"optim.weight_decay={o.weight_decay}: must be >= 0 (-1 = the optimizer's default)")
  _need(o.trust_coefficient >= 0,
        f"optim.trust_coefficient={o.trust_coefficient}: must be > 0 (0 = the optimizer's "
        "default)")
  _need(o.clip_norm >= 0, f"optim.clip_norm={o.clip_norm}: must be >= 0 (0 = off)")
  check_muon(cfg)
  # the batch autopilot's defaults (micro-batch, noise scale, schedule unit) and Seesaw's
  # (micro-batch, lr rule, horizon, steps) as the run fills them in (trainer/step/program.py)
  filled = resolved(cfg)
  batches = check_batch_science(filled, dp, sizes["stage"])
  check_pipeline(filled, sizes, batches)
  if replicas:
    check_diloco(cfg, sizes)


  ck, t = cfg.checkpoint, cfg.trainer
  _need(ck.every_seconds >= 0, f"checkpoint.every_seconds={ck.every_seconds}: must be >= 0")
  _check_local_tier(cfg)
  _choice(cfg, "checkpoint.on_error", ("stop", "continue"))
  _choice(cfg, "trainer.nonfinite_policy", ("skip", "stop"))
  _choice(cfg, "trainer.spike_policy", ("off", "skip", "stop"))
  _check_logging(cfg)
  _need(t.spike_zscore > 0, f"trainer.spike_zscore={t.spike_zscore}: must be positive")
  _need(t.spike_window >= 1, f"trainer.spike_window={t.spike_window}: must be at least 1")
  _check_faults(t, devices)
  if ck.init_from:
    _need(os.path.exists(ck.init_from),
          f"checkpoint.init_from={ck.init_from!r}: no such path")
  if not isinstance(devices, int) and devices and getattr(devices[0], "platform", "") == "gpu":
    for line in matmul_width_warnings(cfg, sizes):  # on GPUs (also an ahead-of-time target)
      print(f"warning: {line}", file=sys.stderr)
  return sizes

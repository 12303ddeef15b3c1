"""Validation of a run config: everything a user can get wrong, checked before any device work.

`validate(cfg, devices)` checks the whole config (`trainer/config.py` holds the keys and their
defaults) against itself and the devices the run will use: the range or choices of every key, the
mesh against the device count and slices, model sizes that split over the mesh, batch and
sequence sizes that divide, the batch-size rules, ramp and autopilot, mixture of experts, the
data's vocabulary against the model's (`model.vocab_size=0` is filled in from the data here),
logging and checkpoint settings. `check_distributed` checks the `distributed` block on its own
(`trainer/distributed.py` calls it before jax.distributed starts). Each problem is one
`ConfigError` line naming the key, the value and what would work; train.py prints it and exits
with code 2. The parallel layouts' checks (mixture of experts, DiLoCo, pipeline stages) are
trainer/parallel_checks.py's.
"""
from __future__ import annotations

import os
import sys

import ml_collections

from sharding.mesh import MeshError, data_parallel_size, num_slices, resolve_mesh_shape
from trainer.config import NORM_METRICS, ConfigError
from trainer.config import choice as _choice, need as _need
from trainer.parallel_checks import check_diloco, check_moe, check_pipeline


def check_distributed(dist: ml_collections.ConfigDict) -> None:
  """The `distributed` block on its own (checked before jax.distributed starts)."""
  _need(dist.mode in ("auto", "on", "off"),
        f"distributed.mode={dist.mode!r}: choose one of auto, on, off")
  _need(dist.num_processes >= 0,
        f"distributed.num_processes={dist.num_processes}: must be >= 1 (0 = from the environment)")
  _need(dist.process_id >= -1,
        f"distributed.process_id={dist.process_id}: must be >= 0 (-1 = from the environment)")
  _need(not dist.num_processes or dist.process_id < dist.num_processes,
        f"distributed.process_id={dist.process_id} must be below "
        f"distributed.num_processes={dist.num_processes}")
  address = dist.coordinator_address
  host, _, port = address.rpartition(":")
  _need(not address or (host and port.isdigit() and 0 < int(port) < 65536),
        f"distributed.coordinator_address={address!r}: expected host:port, e.g. 10.0.0.1:1234")
  _need(dist.initialization_timeout >= 1,
        f"distributed.initialization_timeout={dist.initialization_timeout}: must be >= 1 second")


def _check_batch_science(cfg: ml_collections.ConfigDict, dp: int, num_stages: int
                         ) -> list[int]:
  """The batch-size rules, schedule units, batch ramp, EMA and noise-scale keys; returns every
  global batch the run may use (the ramp's stages, the autopilot's sizes)."""
  from optim import B2_RULES, EMA_RULES, LR_RULES, UNITS, WEIGHT_DECAY_RULES  # noqa: PLC0415
  from optim.ramp import parse_ramp  # noqa: PLC0415
  from optim.scaling import B2_OPTIMIZERS, TIMESCALE_OPTIMIZERS, b2_owner  # noqa: PLC0415
  o, d = cfg.optim, cfg.data
  for key, choices in (("lr_rule", LR_RULES), ("weight_decay_rule", WEIGHT_DECAY_RULES),
                       ("b2_rule", B2_RULES), ("ema_rule", EMA_RULES),
                       ("schedule_unit", UNITS)):
    _choice(cfg, f"optim.{key}", choices)
  _need(o.reference_batch_size >= 0,
        f"optim.reference_batch_size={o.reference_batch_size}: must be >= 0 "
        "(0 = data.global_batch_size)")
  _need(o.weight_decay_rule == "constant" or o.name in TIMESCALE_OPTIMIZERS,
        f"optim.weight_decay_rule='timescale' needs a decay multiplied by the learning rate "
        f"({', '.join(TIMESCALE_OPTIMIZERS)}), not optim.name={o.name!r}; use 'constant'")
  owner = b2_owner(o)
  which = (f"optim.name={o.name!r}" if owner == o.name else
           f"optim.name='muon' with optim.muon.fallback={owner!r} (Muon's b2 is its fallback's)")
  _need(o.b2_rule == "constant" or owner in B2_OPTIMIZERS,
        f"optim.b2_rule={o.b2_rule!r} scales Adam's second moment, which {which} does not have "
        f"({', '.join(B2_OPTIMIZERS)} do); use 'constant'")
  _need(0 <= o.ema_decay < 1, f"optim.ema_decay={o.ema_decay}: must be in [0, 1) (0 = off)")
  for what in ("warmup", "decay"):
    keys = [f"{what}_{u}" for u in UNITS]
    for key in keys:
      _need(o[key] >= 0, f"optim.{key}={o[key]}: must be >= 0")
    given = [f"optim.{k}={o[k]}" for k in keys if o[k] > 0]
    _need(len(given) <= 1, f"{' and '.join(given)} both set the {what}; set one of them and "
          "the other to 0")
  if o.schedule == "power":
    _need(o.lr_rule == "none", f"optim.schedule='power' scales the learning rate with the batch "
          f"itself; set optim.lr_rule='none' (not {o.lr_rule!r})")
    _need(o.power_a > 0 and o.power_b < 0,
          f"optim.power_a={o.power_a}, optim.power_b={o.power_b}: need a > 0 and b < 0")
  if o.schedule == "rsqrt":
    _need(any(o[f"warmup_{u}"] > 0 for u in UNITS),
          "optim.schedule='rsqrt' needs a warmup (its timescale): set optim.warmup_steps, "
          "warmup_examples or warmup_tokens")
  _need(o.noise_scale_every >= 0,
        f"optim.noise_scale_every={o.noise_scale_every}: must be >= 0 (0 = off)")
  _need(0 < o.noise_scale_ema < 1, f"optim.noise_scale_ema={o.noise_scale_ema}: must be in (0, 1)")
  micro = d.micro_batch_size or d.global_batch_size
  batches = [d.global_batch_size]
  _need(d.max_batch == 0 or d.batch_ramp == "seesaw", f"data.max_batch={d.max_batch} is "
        f"Seesaw's largest batch, but data.batch_ramp={d.batch_ramp!r}; set "
        "data.batch_ramp='seesaw' or leave data.max_batch at 0")
  if d.batch_ramp == "seesaw":
    batches = _check_seesaw(cfg, micro)
  elif d.batch_ramp and d.batch_ramp != "auto":
    try:
      stages = parse_ramp(d.batch_ramp)
    except ValueError as e:
      raise ConfigError(f"data.batch_ramp={d.batch_ramp!r}: {e}") from None
    _need(d.micro_batch_size > 0,
          "data.batch_ramp needs data.micro_batch_size: every stage is a number of "
          "micro-batches of that fixed shape")
    bad = [b for b, _ in stages if b % micro]
    _need(not bad, f"data.batch_ramp stage of {bad[0] if bad else 0} sequences is not a "
          f"multiple of data.micro_batch_size={micro}")
    _need(stages[-1][0] == d.global_batch_size,
          f"data.batch_ramp ends at {stages[-1][0]} sequences but data.global_batch_size="
          f"{d.global_batch_size}; the last stage is the global batch")
    batches = [b for b, _ in stages]
  if d.batch_ramp == "auto":
    batches = _check_autopilot(cfg, micro)
  if o.noise_scale_every and (micro in batches or num_stages > 1):
    split = (f"optim.noise_scale_every on a step without accumulation splits its {micro} rows "
             "into " if num_stages == 1 else
             f"optim.noise_scale_every with mesh.stage={num_stages} runs the pipeline on two "
             f"halves of every micro-batch's {micro} rows (trainer/stages.py), ")
    _need(micro % (2 * dp) == 0,
          split + f"two halves, which must divide over the data-parallel size {dp}; use a "
          f"multiple of {2 * dp} rows"
          + (", or accumulate (data.micro_batch_size below the batch)" if num_stages == 1 else "")
          + ("; data.micro_batch_size and optim.noise_scale_every are the autopilot's default "
             "here, set them to choose" if d.batch_ramp == "auto" else ""))
  return batches


def _check_seesaw(cfg: ml_collections.ConfigDict, micro: int) -> list[int]:
  """data.batch_ramp='seesaw' (optim/ramp.py), on the config with its defaults filled in
  (`seesaw_defaults`, which refuses impossible settings); returns its batches."""
  from optim.ramp import Seesaw  # noqa: PLC0415
  d = cfg.data
  _need(d.global_batch_size % micro == 0,
        f"data.global_batch_size={d.global_batch_size} is not a multiple of "
        f"data.micro_batch_size={micro}")
  return list(Seesaw.from_config(cfg.optim, d, cfg.steps).ramp().batches)


def resolved(cfg: ml_collections.ConfigDict) -> ml_collections.ConfigDict:
  """The config with the batch autopilot's or Seesaw's defaults filled in, as the run fills
  them in (trainer/program.py); an impossible Seesaw setting is a ConfigError."""
  from optim.autopilot import with_defaults  # noqa: PLC0415
  from optim.ramp import seesaw_defaults  # noqa: PLC0415
  try:
    return seesaw_defaults(with_defaults(cfg)[0])[0]
  except ValueError as e:
    raise ConfigError(str(e)) from None



def _check_muon(cfg: ml_collections.ConfigDict) -> None:
  """optim.muon.* (optim/muon.py)."""
  from optim.scaling import SCALE_INVARIANT_OPTIMIZERS  # noqa: PLC0415
  mc = cfg.optim.muon
  _choice(cfg, "optim.muon.fallback", SCALE_INVARIANT_OPTIMIZERS)
  _need(0 <= mc.beta < 1, f"optim.muon.beta={mc.beta}: must be in [0, 1)")
  _need(mc.ns_steps >= 1, f"optim.muon.ns_steps={mc.ns_steps}: must be at least 1 (5 is usual)")
  _need(mc.rms >= 0, f"optim.muon.rms={mc.rms}: must be >= 0 (0.2 = AdamW's update RMS, 0 = "
        "Jordan's scaling)")


def _check_autopilot(cfg: ml_collections.ConfigDict, micro: int) -> list[int]:
  """data.batch_auto.* (optim/autopilot.py), on the config with the autopilot's defaults filled
  in (`with_defaults`); returns the batches it may choose."""
  from optim.autopilot import AutoConfig, check, schedule_lengths  # noqa: PLC0415
  o, d = cfg.optim, cfg.data
  reason = check(d, micro)
  _need(reason is None, reason or "")
  # Lengths in another unit than the schedule's are converted through the ramp when the
  # optimizer is built, before the autopilot has decided anything: refuse them.
  unit = o.schedule_unit
  other = [(w, u, v) for w, u, v in schedule_lengths(o) if (u == "steps") != (unit == "steps")]
  _need(not any(v is None for *_, v in other),
        f"data.batch_ramp='auto' with optim.schedule_unit={unit!r}: set the horizon as "
        f"optim.decay_{unit} (unset, it is `steps` steps, whose {unit} depend on the batches "
        "still to be chosen)")
  _need(not other, f"data.batch_ramp='auto' with optim.schedule_unit={unit!r}: "
        + (f"optim.{other[0][0]}_{other[0][1]}={other[0][2]}" if other else "")
        + " would be converted through batches not yet chosen; give every length of the "
        "schedule in steps, or every one in examples or tokens (the schedule then runs in "
        "tokens and keeps its shape in tokens as the batch grows)")
  _need(o.schedule != "power" or unit != "steps", "data.batch_ramp='auto' with "
        "optim.schedule='power': set optim.schedule_unit='tokens' (the power law reads tokens)")
  return AutoConfig.from_config(d).sizes()


def _check_local_tier(cfg: ml_collections.ConfigDict) -> None:
  """checkpoint.local_* (trainer/local_tier.py) and data.on_resize (trainer/elastic.py)."""
  from trainer.elastic import RESIZE_MODES  # noqa: PLC0415
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


def _data_vocab(cfg: ml_collections.ConfigDict) -> tuple[int, str]:
  """(vocabulary size, description) of the run's data: data.dir's or data.mixture's meta.json
  (all mixture sources share a tokenizer), or the byte tokenizer of the default corpus. The
  files of data.dir or data.mixture are checked here (`data.pipeline.check`), so missing,
  truncated or too little data is one line before anything is compiled."""
  from data import meta, mixture, pipeline, tokenizer  # noqa: PLC0415
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


def _check_logging(cfg: ml_collections.ConfigDict) -> None:
  """trainer.wandb (the package installed when a project is named) and trainer.profile_steps."""
  from trainer.profiling import parse_window  # noqa: PLC0415
  trainer = cfg.trainer
  _choice(cfg, "trainer.wandb.mode", ("online", "offline", "disabled"))
  _choice(cfg, "trainer.norm_metrics", NORM_METRICS)
  if trainer.wandb.project:
    try:
      import wandb  # noqa: F401, PLC0415
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


def validate(cfg: ml_collections.ConfigDict, devices) -> dict:
  """Check the whole config against itself and the devices the run will use (a list: their
  count and slices; or a count, one slice). Returns every mesh axis's size over all devices."""
  from models.config import PARAMETRIZATIONS  # noqa: PLC0415
  from models.llama import ATTENTION_IMPLS, DTYPES, REMAT_POLICIES  # noqa: PLC0415
  from models.rope import ROPE_SCALING_TYPES  # noqa: PLC0415
  from optim import OPTIMIZERS, SCHEDULES, WSD_SHAPES  # noqa: PLC0415
  from optim.scaling import SCALE_INVARIANT_OPTIMIZERS  # noqa: PLC0415

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
    raise ConfigError(str(e)) from None

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
    _need(m.base_width == m.d_model or cfg.optim.name != "muon",
          "model.parametrization='mup' with optim.name='muon': refused, Muon's shape scaling "
          "already sets each matrix's spectral step (optim/factory.py), so muP's 1/m Adam rule "
          "would be wrong and its replacement is untested; use model.parametrization='sp'")
    _need(m.base_width == m.d_model or cfg.optim.name in SCALE_INVARIANT_OPTIMIZERS,
          f"model.parametrization='mup' sets learning rates for Adam-type optimizers "
          f"({', '.join(SCALE_INVARIANT_OPTIMIZERS)}), not optim.name={cfg.optim.name!r}; "
          "use one of them or model.parametrization='sp'")
  data_vocab, data_name = _data_vocab(cfg)
  if m.vocab_size == 0:  # from the data, padded to a multiple of 128 (splits over any tensor axis)
    m.vocab_size = -(-data_vocab // 128) * 128
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
  _check_muon(cfg)
  # the batch autopilot's defaults (micro-batch, noise scale, schedule unit) and Seesaw's
  # (micro-batch, lr rule, horizon, steps) as the run fills them in (trainer/program.py)
  filled = resolved(cfg)
  batches = _check_batch_science(filled, dp, sizes["stage"])
  check_pipeline(filled, sizes, batches)
  if replicas:
    check_diloco(cfg, sizes)

  check_distributed(cfg.distributed)

  ck, t = cfg.checkpoint, cfg.trainer
  _need(ck.every_seconds >= 0, f"checkpoint.every_seconds={ck.every_seconds}: must be >= 0")
  _check_local_tier(cfg)
  _choice(cfg, "checkpoint.on_error", ("stop", "continue"))
  _choice(cfg, "trainer.nonfinite_policy", ("skip", "stop"))
  _choice(cfg, "trainer.spike_policy", ("off", "skip", "stop"))
  _check_logging(cfg)
  _need(t.spike_zscore > 0, f"trainer.spike_zscore={t.spike_zscore}: must be positive")
  _need(t.spike_window >= 1, f"trainer.spike_window={t.spike_window}: must be at least 1")
  if ck.init_from:
    _need(os.path.exists(ck.init_from),
          f"checkpoint.init_from={ck.init_from!r}: no such path")
  if not isinstance(devices, int) and devices and getattr(devices[0], "platform", "") == "gpu":
    for line in matmul_width_warnings(cfg, sizes):  # on GPUs (also an ahead-of-time target)
      print(f"warning: {line}", file=sys.stderr)
  return sizes

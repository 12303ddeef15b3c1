"""The run config's keys and their defaults (`default_config`), and `ConfigError`, the error a
user's mistake in a config raises.

Every key a run understands is in `default_config()` with its type and what it means; a config
file states only what differs (`configs/*.py`, each with `get_config()`). Reading config files
and command lines, where unknown keys and wrong types are caught: `trainer/config/cli.py`. Checking the
values against each other and the devices, before any device work: `trainer/config/checks.py`.
"""
from __future__ import annotations

import ml_collections

# trainer.norm_metrics: when the step computes param_norm and update_norm (trainer/step/program.py)
NORM_METRICS = ("log_steps", "every_step", "off")
RESIZE_MODES = ("keep", "rescale")  # data.on_resize (trainer/checkpoint/elastic.py)


class ConfigError(ValueError):
  """A user error in the config; train.py prints it as one line and exits with code 2."""


def need(cond: bool, message: str) -> None:
  """Raise ConfigError(message) unless `cond` (the config checks' one way to refuse)."""
  if not cond:
    raise ConfigError(message)


def choice(cfg, key: str, choices) -> None:
  """Refuse the dotted `key` of `cfg` unless its value is one of `choices`."""
  node = cfg
  for part in key.split("."):
    node = node[part]
  need(node in choices, f"{key}={node!r}: choose one of {', '.join(map(str, choices))}")


def default_config() -> ml_collections.ConfigDict:
  c = ml_collections.ConfigDict()
  c.steps = 300  # optimizer steps to run to (a resumed run continues up to this)
  c.seed = 0  # model init and data order
  c.log_every = 10
  c.eval_every = 100  # 0: never
  # validation sequences per evaluation: a fixed sample of the validation split's windows, the
  # same every time and whatever the seed, micro-batch size or devices (trainer/evaluation/periodic.py)
  c.eval_sequences = 64

  # Devices per axis inside one slice (one axis may be -1 = fill), and across slices: the
  # dcn_* sizes multiply to the number of slices (TPU multi-slice, multi-node GPU), 1 = one.
  # `stage`: pipeline stages (the layers split into stage x pipeline.repeats groups; below).
  c.mesh = ml_collections.ConfigDict(dict(
      stage=1, data=-1, fsdp=1, tensor=1, sequence=1, expert=1,
      dcn_stage=1, dcn_data=1, dcn_fsdp=1, dcn_tensor=1, dcn_sequence=1, dcn_expert=1))
  # Pipeline parallelism over mesh.stage S (x mesh.dcn_stage) > 1 (sharding/pipeline.py): the
  # micro-batches are the accumulation micro-batches (M = global / micro batch, a multiple of
  # S). "gpipe": each stage runs L / S consecutive layers; "circular" with `repeats` R: each
  # stage runs R groups of L / (S R) layers, the micro-batches going round the stages R times
  # (bubble (S - 1) / (M R + S - 1) instead of (S - 1) / (M + S - 1)). Both run every forward
  # before the first backward, so they hold all M R stage inputs. "1f1b" (R > 1: interleaved
  # 1F1B) starts each micro-batch's backward as soon as its forward has left the last stage,
  # holding at most (R - 1) S + 2 S - 1 stage inputs on a stage whatever M is; "zero_bubble"
  # (ZB-H1) also splits the backward in input and weight gradient and runs the weight
  # gradients where every stage has one: a smaller bubble (sharding/schedule.py prints both).
  # remat_stage: keep only each tick's stage input for the backward pass and recompute the
  # stage's layers from it (GPipe's re-materialization: the activations of M R + S - 1 stage
  # inputs instead of what model.remat keeps of every layer at every tick, for one more forward
  # of the layers); model.remat applies per layer inside the stages either way. 1f1b without
  # it keeps each forward's VJP residuals (what model.remat leaves) until its backward instead;
  # zero_bubble always recomputes (it needs remat_stage=True).
  c.pipeline = ml_collections.ConfigDict(dict(schedule="gpipe", repeats=1, remat_stage=True))

  c.model = ml_collections.ConfigDict(dict(
      vocab_size=512, d_model=128, num_layers=2, num_heads=4, num_kv_heads=2, head_dim=0,
      mlp_dim=384, rope_theta=10_000.0, norm_eps=1e-5, tie_embeddings=False,
      param_dtype="float32", dtype="float32", remat="none", attention="xla", init_std=0.02,
      # False: bidirectional attention, the masked-LM encoder (needs data.mask_rate; docs/mlm.md)
      causal=True,
      # "resnet1d": the vision workload instead, the 1-D ResNet of `resnet` on data.mnist1d
      # (models/resnet.py, docs/vision.md); the transformer keys above then do not apply
      kind="transformer",
      # bn_group: examples per ghost batch-norm group (batches and micro-batches are multiples)
      resnet=ml_collections.ConfigDict(dict(channels=32, blocks=3, kernel=5, bn_group=16,
                                            bn_momentum=0.9, label_smoothing=0.0)),
      # ring attention: one ring per chunk of a device's kv heads, for less memory in flight
      # (sharding/ring_attention.py); must divide num_kv_heads / mesh.tensor
      ring_head_chunks=1,
      # layers per iteration of the layer scan; num_layers unrolls it fully (faster steps for
      # few layers, longer compiles; docs/performance.md)
      scan_unroll=1,
      # the LM head and loss over this many sequence positions at a time, so the [B, S, V]
      # logits never exist (models/cross_entropy.py; for large vocabularies); 0 = all at once
      logits_chunk=0,
      # the blocks' dense projections (q, k, v, o and the MLP) as fp8 matmuls: e4m3 operands,
      # e5m2 gradients, one scale per tensor from its own amax each step (models/fp8.py;
      # stateless, so checkpoints do not change); fast on GPUs with fp8 tensor cores (Hopper,
      # Ada), emulated (same numbers, no faster) elsewhere
      fp8=False,
      # "sp" (standard) or "mup" (Maximal Update Parametrization for Adam-type optimizers:
      # init, multipliers and per-parameter learning rates relative to base_width, the d_model
      # at which muP equals SP; 0 = d_model itself; models/llama.py)
      parametrization="sp", base_width=0,
      # depth transfer: "standard", "depth_mup" or "completep" (each residual branch times
      # (base_depth / num_layers)^alpha, alpha 1/2 or 1, with CompleteP's per-group learning
      # rates, Adam epsilons and weight decay; composes with parametrization="mup"; docs/mup.md)
      depth_parametrization="standard",
      # the num_layers at which a depth parametrization is "standard" exactly; 0 = num_layers
      base_depth=0,
      # RoPE frequency scaling: "none" or "llama3" (Llama 3.1 context extension; the other
      # fields are its parameters, as in a Hugging Face config's `rope_scaling`)
      rope_scaling=ml_collections.ConfigDict(dict(
          type="none", factor=8.0, low_freq_factor=1.0, high_freq_factor=4.0,
          original_max_position_embeddings=8192)),
      # mixture of experts (models/moe.py): num_experts experts of width mlp_dim (0 = the
      # model's mlp_dim), top_k per token, in every `every`-th layer (1 = all); shared_expert:
      # the width of a dense SwiGLU every token also goes through (0 = none); capacity per expert
      # and sequence ceil(capacity_factor * seq_len * top_k / num_experts), assignments beyond
      # it dropped (0 = dropless); coefficients of the router z-loss and the load-balancing
      # loss, whose statistics are over the "global" batch (all micro-batches and devices) or
      # each "micro_batch"; num_experts 0 = a dense model
      moe=ml_collections.ConfigDict(dict(
          num_experts=0, top_k=2, mlp_dim=0, every=1, shared_expert=0, capacity_factor=0.0,
          router_z_loss=1e-3, load_balance_loss=1e-2, balance_scope="global",
          # the dropless grouped matmul: "ragged_dot" (XLA's, any platform) or "megablox"
          # (jax's Pallas TPU kernel; interpret mode, slow, elsewhere)
          impl="ragged_dot"))))

  c.data = ml_collections.ConfigDict(dict(
      dir="",  # prepared dir (python -m data.prepare); "" = the embedded corpus, prepared on first use
      # weighted mixture of prepared dirs instead of `dir`: "NAME=DIR:WEIGHT,..." (weights are
      # token fractions; data/mixture.py); evaluation reports eval_loss/NAME per source
      mixture="",
      global_batch_size=16,  # sequences per optimizer step
      micro_batch_size=0,  # sequences per accumulation micro-batch; 0 = no accumulation
      seq_len=128,
      # the masked LM (data/masking.py, docs/mlm.md): the fraction of tokens selected for
      # prediction (BERT: 0.15; 80% shown as [MASK], 10% a random token, 10% unchanged) in rows
      # whose targets are the original tokens at the selected positions; needs
      # model.causal=False. 0 = the causal LM's next-token rows
      mask_rate=0.0,
      # model.kind="resnet1d"'s data (data/mnist1d.py): train_examples generated with `seed`
      # by the mnist1d package and cached; the fixed test set is the same in every run
      mnist1d=ml_collections.ConfigDict(dict(train_examples=20_000, seed=1)),
      prefetch=2,  # micro-batches prepared ahead in a background thread
      # Batch-size ramp: "BATCH:START_TOKENS,..." e.g. "64:0,256:2000000,1024:8000000"; the last
      # stage is global_batch_size; needs micro_batch_size (optim/ramp.py). "" = no ramp.
      # "auto": the batch autopilot (optim/autopilot.py) grows the batch from global_batch_size
      # by `factor` up to `max` when the measured noise scale says so (needs
      # optim.noise_scale_every, and schedule lengths in the schedule's own unit).
      # "seesaw": Seesaw (optim/ramp.py): where the decaying schedule halves, the batch doubles
      # from global_batch_size up to `max_batch` and the rate is cut by the optimizer's rule
      # instead (x 1/sqrt(2) Adam-type, x 1 SGD-type); `steps` is derived: the horizon's tokens.
      batch_ramp="",
      max_batch=0,  # batch_ramp="seesaw": the largest batch, global_batch_size x 2^k
      batch_auto=ml_collections.ConfigDict(dict(
          max=0,  # the largest batch: global_batch_size x factor^k
          factor=2,
          trigger="noise_scale",  # noise_scale: B_simple > margin x batch | norm_test (eta)
          # which B_simple the noise_scale trigger reads: noise_scale (tr(Sigma) / |G|^2) |
          # noise_scale_precond (tr(P Sigma) / G^T P G, Adam's P; adamw and lamb only)
          signal="noise_scale",
          margin=2.0, eta=0.8,
          patience=2,  # logged rows in a row the trigger must hold
      )),
      # Restarting on more or fewer data-parallel devices (trainer/checkpoint/elastic.py): "keep" the
      # global batch (more or fewer micro-batches) or "rescale" it with the devices (rows per
      # device kept, hyperparameters re-derived by the batch rules)
      on_resize="keep",
  ))

  c.optim = ml_collections.ConfigDict(dict(
      # adamw | lamb | lars | sgd | adafactor | lion | muon (optim/factory.py). Keys marked (*) left
      # at their "unset" value take the named optimizer's own default (OPTIMIZER_DEFAULTS in
      # optim/scaling.py; printed in the "hyperparameters at batch" line at start).
      name="adamw", schedule="cosine", warmup_steps=20,
      learning_rate=0.0,  # (*) 0 = default: adamw 3e-3, lamb 3e-2, lars 2, sgd 0.1,
      #                     adafactor 3e-3, lion 1e-3, muon 3e-3
      weight_decay=-1.0,  # (*) -1 = default: adamw 0.1, lamb 0.01, lars 5e-4, sgd 1e-4,
      #                     adafactor 0.1, lion 0.3, muon 0.1. Always w -= lr * (update + wd * w).
      b2=0.0,  # (*) 0 = default: adamw 0.95, lamb 0.999, lion 0.99, muon 0.95 (its fallback's)
      trust_coefficient=0.0,  # (*) 0 = default: lars 0.001, lamb 1
      decay_steps=0,  # schedule horizon; 0 = `steps`
      min_lr_ratio=0.1, wsd_decay_fraction=0.2, wsd_decay_shape="sqrt",
      poly_power=2.0,  # schedule="poly": (1 - t/T)^power to min_lr_ratio (MLPerf LARS: 2)
      b1=0.9, eps=1e-8, decay_embeddings=False, clip_norm=1.0,
      momentum=0.9, nesterov=False,
      # Batch-size-aware hyperparameters (optim/scaling.py): the values above are stated at
      # reference_batch_size sequences (0 = data.global_batch_size) and moved to the run's batch
      # by these rules.
      reference_batch_size=0,
      lr_rule="none",  # none | linear (Goyal et al. 2017) | sqrt (Adam-type)
      weight_decay_rule="constant",  # constant | timescale (Power Lines: B/(lr wd D) fixed)
      b2_rule="constant",  # constant | half_life (b2 ** (B/B_ref), Marek et al. 2025)
      ema_decay=0.0,  # parameter EMA, evaluated beside the raw model (eval_loss_ema); 0 = off
      ema_rule="constant",  # constant | half_life (rho ** (B/B_ref), Busbridge et al. 2023)
      # Schedules (optim/schedules.py): what the schedule is a function of, and lengths in any
      # unit (one of each triple; warmup_steps / decay_steps above are the steps ones).
      schedule_unit="steps",  # steps | examples | tokens
      warmup_examples=0, warmup_tokens=0, decay_examples=0, decay_tokens=0,
      power_a=4.6, power_b=-0.51,  # schedule="power": lr = min(lr, batch * a * tokens^b)
      # Gradient noise scale (optim/noise_scale.py): measured and logged every N steps (0 = off;
      # the other steps are the plain step) on `noise_scale_pieces` small batches of the step's
      # batch (at least 2: the accumulation micro-batches, split further where there are fewer),
      # averaged over the last `noise_scale_window` of the tokens trained so far (in (0, 1]):
      # tr(Sigma) evenly, |G|^2 weighted by exp(-age / (r x the tokens so far)), r the shortest
      # of noise_scale_recency x 1, 2, 4, 8, 16, then evenly, whose mean the per-step estimates
      # pin down to a relative standard error of 0.4 (noise_scale.MEMORY_RSE; recency 0 = always
      # evenly); no value until the window holds `noise_scale_min_measurements`, nor while the
      # relative standard error of its even |G|^2 mean is above `noise_scale_max_rse` (0 = no
      # bound). Why these defaults: docs/noisy_quadratic.md#the-memory.
      noise_scale_every=0, noise_scale_window=0.35, noise_scale_pieces=2,
      noise_scale_recency=0.05, noise_scale_min_measurements=8, noise_scale_max_rse=1.0,
      # DiLoCo (optim/diloco.py, trainer/step/diloco.py): `replicas` M >= 1 replicas train apart,
      # each on its B/M rows of the global batch with the optimizer above (the inner optimizer)
      # and no communication between replicas (a mesh axis of their own, `replica`, outermost;
      # the mesh.* sizes split one replica); after every `inner_steps` H steps the outer step
      # averages their parameter changes and applies Nesterov SGD (outer_lr, outer_momentum;
      # 0 = plain SGD) to the shared parameters. 0 = off (plain data parallelism).
      diloco=ml_collections.ConfigDict(dict(
          replicas=0, inner_steps=32, outer_lr=0.7, outer_momentum=0.9)),
      # optim.name="muon" (optim/muon.py): Nesterov momentum `beta`, `ns_steps` Newton-Schulz
      # iterations, the update's RMS per matrix relative to the learning rate it shares with the
      # fallback (0.2: AdamW's, so its lr and weight_decay carry over; larger steps the matrices
      # further than the fallback; 0: Jordan's sqrt(max(1, fan_out/fan_in)), a much smaller
      # step), and the optimizer of the embeddings, head and norms: adamw | adafactor | lion;
      # `fallback_lr` its own rate (> 0: stated at the reference batch like learning_rate, moved
      # by the same lr_rule, on the same schedule shape, times muP's multipliers; its decay
      # lr x wd its own), so Muon's rate can be swept with it held; 0 = the shared rate
      muon=ml_collections.ConfigDict(dict(beta=0.95, ns_steps=5, nesterov=True, rms=0.2,
                                          fallback="adamw", fallback_lr=0.0))))

  c.checkpoint = ml_collections.ConfigDict(dict(
      every_steps=100,  # save every N steps (0: not by steps); always at the end
      every_seconds=0.0,  # also save when this much wall time passed since the last save (0: off)
      keep=3,  # newest checkpoints kept on disk
      async_save=True,
      on_error="stop",  # a failed save: "stop" (exit 4) or "continue" (retry at the next save)
      allow_fresh_start=False,  # if no checkpoint in the workdir is readable: start over
      init_from="",  # another run's workdir / checkpoint: load its parameters (fresh runs only)
      # The local tier (trainer/checkpoint/local_tier.py): a node-local directory (local SSD, /dev/shm;
      # its name may differ between nodes) saved every local_every_steps steps, each process's
      # shards plus a copy of its peer's; keeps local_keep steps per process. A restart takes
      # the newest complete step of either tier.
      local_dir="", local_every_steps=0, local_keep=2,
  ))

  # Several processes (hosts) in one run: see trainer/multihost/launch.py for where the values come
  # from when left unset (JAX_* variables, SLURM, Open MPI, Cloud TPU).
  c.distributed = ml_collections.ConfigDict(dict(
      mode="auto",  # "auto": start jax.distributed when several processes are named; "on", "off"
      coordinator_address="",  # "host:port" of process 0; "" = from the environment
      num_processes=0,  # 0 = from the environment (one process if nothing names more)
      process_id=-1,  # -1 = from the environment
      initialization_timeout=300,  # seconds to wait for every process (to join, and to agree)
  ))

  c.trainer = ml_collections.ConfigDict(dict(
      peak_flops_per_device=0.0,  # for MFU; 0 = known accelerator table, or a CPU matmul probe
      progress_bar=True,
      # JAX persistent compilation cache: a restart skips recompiling. "" = the default
      # (~/.cache/scaletrain/jax, or $SCALETRAIN_CACHE/jax), "off" = no cache.
      compile_cache_dir="",
      nonfinite_policy="skip",  # non-finite loss/grad norm: "skip" the update or "stop" (exit 3)
      spike_policy="off",  # loss spikes: "off", "skip" or "stop"
      spike_zscore=6.0,  # a spike: loss > EMA mean + zscore * EMA std
      spike_window=200,  # EMA time constant in steps; detection starts after one window
      debug_nan_at_step=0,  # testing aid: make this step's loss NaN (0: never)
      # param_norm and update_norm, one more pass over the parameters and the updates (6% of the
      # bytes a compiled TPU step moves at 25M parameters, docs/performance.md):
      # "log_steps" = in the rows of the steps that log (those run a second compiled step, the
      # others leave the norms out), "every_step" = one step that always computes them, "off"
      norm_metrics="log_steps",
      # Weights & Biases beside TensorBoard and metrics.jsonl (the `wandb` extra): project "" =
      # off; mode "offline" logs under <workdir>/wandb with no account or network
      wandb=ml_collections.ConfigDict(dict(project="", mode="online", name="")),
      profile_steps="",  # "A:B": a jax.profiler trace of steps A..B under <workdir>/profile
      # Faults that do not crash (docs/reliability.md#slow-and-hung-processes). A process whose
      # median seconds per step of a part (compute, data, save) over the last log rows exceed
      # straggler_factor x the other processes' is named (0 = no report). The watchdog ends a
      # run (exit 5) when no step completes for hang_timeout_s seconds, compiles, saves and
      # evaluations not counted (0 = 20 x the median step time, at least 60 s; 600 s until a
      # step is measured; -1 = off). fault (drills, tests): "slow:PROCESS:FACTOR" makes that
      # process's steps FACTOR x slower, "hang:PROCESS:STEP" blocks it before step STEP.
      straggler_factor=1.3, hang_timeout_s=0.0, fault="",
  ))
  return c


FAULTS = {"slow": float, "hang": int}  # trainer.fault: kind -> the type of its third field


def parse_fault(spec: str) -> tuple[str, int, float] | None:
  """"slow:PROCESS:FACTOR" / "hang:PROCESS:STEP" -> (kind, process, factor or step); "" -> None.
  Raises ValueError naming what works."""
  if not spec:
    return None
  kind, _, rest = spec.partition(":")
  process, _, value = rest.partition(":")
  try:
    parsed = (kind, int(process), FAULTS[kind](value))
  except (KeyError, ValueError):
    parsed = None
  if parsed is None or parsed[1] < 0 or (kind == "slow" and not parsed[2] > 1) or (
      kind == "hang" and parsed[2] < 1):
    raise ValueError(f"trainer.fault={spec!r}: use 'slow:PROCESS:FACTOR' (FACTOR > 1) or "
                     "'hang:PROCESS:STEP' (STEP >= 1), e.g. 'slow:1:2'; '' = none")
  return parsed


def parse_window(spec: str) -> tuple[int, int] | None:
  """"A:B" -> (A, B) with 1 <= A <= B; "" -> None. Raises ValueError naming what works."""
  if not spec:
    return None
  first, sep, last = spec.partition(":")
  try:
    a, b = int(first), int(last)
  except ValueError:
    a = b = 0
  if not sep or not 1 <= a <= b:
    raise ValueError(f"trainer.profile_steps={spec!r}: use 'A:B' with 1 <= A <= B (steps A..B "
                     "are traced), e.g. '20:25'; '' = off")
  return a, b


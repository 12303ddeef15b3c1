"""The config checks of the parallel layouts (part of `trainer.config.checks.validate`, which
resolves the mesh first and calls these with its sizes): mixture of experts over `expert` and
`tensor`, DiLoCo's replicas, and pipeline stages over `stage`. Each problem is one
`ConfigError` line naming the key, the value and what would work."""
from __future__ import annotations

import ml_collections

from trainer.config.defaults import choice, need


def check_moe(cfg: ml_collections.ConfigDict, sizes: dict) -> None:
  """model.moe.*: ranges, and that the experts and their width split over the mesh."""
  from models.moe import BALANCE_SCOPES  # noqa: PLC0415  start-up
  from models.moe_dispatch import IMPLS  # noqa: PLC0415  start-up
  m, moe = cfg.model, cfg.model.moe
  need(moe.num_experts >= 0, f"model.moe.num_experts={moe.num_experts}: must be >= 0 (0 = dense)")
  if not moe.num_experts:
    return
  need(1 <= moe.top_k <= moe.num_experts, f"model.moe.top_k={moe.top_k}: must be between 1 "
       f"and model.moe.num_experts={moe.num_experts}")
  need(moe.every >= 1 and m.num_layers % moe.every == 0,
       f"model.moe.every={moe.every} must be >= 1 and divide model.num_layers={m.num_layers} "
       "(the layer scan repeats groups of `every` layers)")
  for key in ("mlp_dim", "shared_expert", "capacity_factor", "router_z_loss",
              "load_balance_loss"):
    need(moe[key] >= 0, f"model.moe.{key}={moe[key]}: must be >= 0")
  choice(cfg, "model.moe.balance_scope", BALANCE_SCOPES)
  choice(cfg, "model.moe.impl", IMPLS)
  expert, tensor = sizes["expert"], sizes["tensor"]
  need(moe.num_experts % expert == 0,
       f"model.moe.num_experts={moe.num_experts} does not split over mesh.expert={expert}; "
       f"use a mesh.expert that divides {moe.num_experts}")
  widths = {"model.moe.mlp_dim": moe.mlp_dim or m.mlp_dim,
            "model.moe.shared_expert": moe.shared_expert}
  for key, width in widths.items():
    need(width % tensor == 0, f"{key}: width {width} does not split over mesh.tensor={tensor}; "
         f"use a multiple of {tensor}")


def check_diloco(cfg: ml_collections.ConfigDict, sizes: dict) -> None:
  """optim.diloco.* of a DiLoCo run (replicas >= 1; the mesh and batch splits are checked with
  the mesh): ranges, the settings whose meaning the replicas would change, and ring attention
  (jax 0.10 cannot vmap its shard_map over the replicas: a varying-axes type error)."""
  o, dl = cfg.optim, cfg.optim.diloco
  need(sizes["sequence"] == 1 or cfg.model.attention not in ("ring", "auto"),
       f"model.attention={cfg.model.attention!r} runs ring attention over mesh.sequence="
       f"{sizes['sequence']}, which does not run inside DiLoCo's replicas yet; use "
       "model.attention='xla' (XLA splits the sequence itself) or mesh.sequence=1")
  need(cfg.data.batch_ramp != "seesaw", f"data.batch_ramp='seesaw' with "
       f"optim.diloco.replicas={dl.replicas}: Seesaw derives its steps, which need not end on "
       "an outer step; give DiLoCo a fixed batch or an explicit ramp")
  h = dl.inner_steps
  need(h >= 1, f"optim.diloco.inner_steps={h}: must be >= 1 (the inner steps between outer "
       "steps)")
  need(dl.outer_lr > 0, f"optim.diloco.outer_lr={dl.outer_lr}: must be positive (the paper's "
       "0.7; 1 without momentum replaces the anchor by the replicas' mean)")
  need(0 <= dl.outer_momentum < 1,
       f"optim.diloco.outer_momentum={dl.outer_momentum}: must be in [0, 1) (Nesterov; 0 = "
       "plain SGD)")
  need(cfg.steps % h == 0, f"steps={cfg.steps} is not a multiple of optim.diloco.inner_steps="
       f"{h}: a DiLoCo run ends on an outer step (the replicas' agreed model); use a multiple "
       f"of {h}")
  need(cfg.eval_every % h == 0, f"eval_every={cfg.eval_every} is not a multiple of "
       f"optim.diloco.inner_steps={h}: evaluations score the outer model, which exists after "
       f"outer steps only; use a multiple of {h} (or 0)")
  refused = (("optim.noise_scale_every", o.noise_scale_every, "the noise-scale meter"),
             ("data.batch_ramp", cfg.data.batch_ramp == "auto" and "'auto'", "the batch autopilot"),
             ("optim.ema_decay", o.ema_decay, "the parameter EMA"))
  for key, value, what in refused:
    need(not value, f"{key}={value} with optim.diloco.replicas={dl.replicas}: {what} would "
         "measure each replica apart, not the run; turn it off for DiLoCo runs")


def check_pipeline(cfg: ml_collections.ConfigDict, sizes: dict, batches: list[int]) -> None:
  """pipeline.* and what pipeline stages (mesh.stage > 1) need of the model, the batches and the
  other features (sharding/pipeline.py): layers that split into stages x repeats groups, a
  number of micro-batches that is a multiple of the stages at every batch the run may use."""
  from sharding.pipeline import SCHEDULES  # noqa: PLC0415  start-up
  p, m, d = cfg.pipeline, cfg.model, cfg.data
  choice(cfg, "pipeline.schedule", SCHEDULES)
  need(p.repeats >= 1, f"pipeline.repeats={p.repeats}: must be >= 1")
  need(p.repeats == 1 or p.schedule != "gpipe",
       f"pipeline.repeats={p.repeats} with pipeline.schedule='gpipe': a stage's repeats are the "
       "circular and interleaved schedules'; set pipeline.schedule='circular', '1f1b' or "
       "'zero_bubble' (or pipeline.repeats=1)")
  need(p.remat_stage or p.schedule != "zero_bubble",
       "pipeline.remat_stage=False with pipeline.schedule='zero_bubble': its split backward "
       "recomputes each stage from its input; set pipeline.remat_stage=True (the default), or "
       "use 1f1b, gpipe or circular")
  stages = sizes["stage"]
  if stages == 1:  # a schedule without stages would be ignored: refused like repeats are
    defaults = {"schedule": "gpipe", "repeats": 1, "remat_stage": True}
    for key, default in defaults.items():
      need(p[key] == default, f"pipeline.{key}={p[key]!r} with mesh.stage=1: pipeline settings "
           "apply to pipeline stages only and would be ignored; set mesh.stage > 1 (layers "
           f"split over that many devices) or leave pipeline.{key}={default!r}")
    return
  repeats = p.repeats if p.schedule != "gpipe" else 1
  every = m.moe.every if m.moe.num_experts else 1
  groups = m.num_layers // every
  need(groups % (stages * repeats) == 0,
       f"model.num_layers={m.num_layers}"
       + (f" (in {groups} groups of model.moe.every={every})" if every > 1 else "")
       + f" does not split over mesh.stage={stages} x pipeline.repeats={repeats} = "
       f"{stages * repeats} stage groups; use a number of layers that is a multiple of "
       f"{stages * repeats * every}, or other stages / repeats")
  micro = d.micro_batch_size or d.global_batch_size
  for batch in dict.fromkeys(batches):
    n = batch // micro
    what = (f"data.global_batch_size={batch}" if batch == d.global_batch_size else
            f"the batch of {batch} sequences (data.batch_ramp)")
    need(n >= stages, f"{what} in micro-batches of data.micro_batch_size={micro} is {n} "
         f"micro-batch(es), fewer than the mesh.stage={stages} pipeline stages (M < S: some "
         f"stage would have none); use data.micro_batch_size <= {batch // stages}, dividing "
         "the batch into a multiple of the stages")
    need(n % stages == 0, f"{what} in micro-batches of data.micro_batch_size={micro} is {n} "
         f"micro-batches, not a multiple of mesh.stage={stages} (each stage embeds and scores "
         f"M / S of them); use a data.micro_batch_size that makes M a multiple of {stages}")
  need(not cfg.optim.diloco.replicas,
       f"mesh.stage={stages} with optim.diloco.replicas={cfg.optim.diloco.replicas}: pipeline "
       "stages do not run inside DiLoCo's replicas; use one or the other")
  need(sizes["sequence"] == 1 or m.attention not in ("ring", "auto"),
       f"model.attention={m.attention!r} runs ring attention over mesh.sequence="
       f"{sizes['sequence']}, which does not run inside pipeline stages (jax cannot vmap its "
       "shard_map over the stages); use model.attention='xla' (XLA splits the sequence "
       "itself) or mesh.sequence=1")

"""A ~1.2B-parameter mixture-of-experts Llama (8 experts, top-2; 0.3B active) for a TPU slice.

    python train.py --config configs/moe_1b.py --workdir /gcs/bucket/runs/moe_1b \
        --config.data.dir=/path/to/prepared

16 layers of d_model 1024 (GQA 16/8 heads), every layer's MLP 8 SwiGLU experts of width 2816
routed top-2, dropless, with the global-batch load-balancing loss (1e-2) and router z-loss
(1e-3). Expert parallelism over mesh.expert=8 (one expert per chip; folded with fsdp=2: the
expert axis also splits the batch, and each expert's weights are halved over fsdp), bf16
compute, fp32 master weights and Adam moments, full rematerialisation. Documented fit:
`python -m tools.aot --config configs/moe_1b.py --topology v5e:4x4` (docs/moe.md).
"""
from trainer.config import default_config


def get_config():
  c = default_config()
  c.steps = 50_000
  c.mesh.update(data=1, fsdp=-1, expert=8)
  c.model.update(vocab_size=512, d_model=1024, num_layers=16, num_heads=16, num_kv_heads=8,
                 mlp_dim=2816, dtype="bfloat16", param_dtype="float32", remat="full",
                 rope_theta=500_000.0, attention="auto")
  c.model.moe.update(num_experts=8, top_k=2, mlp_dim=2816, every=1, capacity_factor=0.0,
                     router_z_loss=1e-3, load_balance_loss=1e-2, balance_scope="global")
  c.data.update(global_batch_size=256, micro_batch_size=64, seq_len=2048, prefetch=4)
  c.optim.update(name="adamw", learning_rate=3e-4, warmup_steps=2000, decay_steps=50_000,
                 schedule="cosine", b2=0.95, weight_decay=0.1)
  c.log_every = 50
  c.eval_every = 2000
  c.eval_sequences = 1280
  c.checkpoint.update(every_steps=1000, keep=3)
  return c

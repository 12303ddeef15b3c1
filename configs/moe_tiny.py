"""Tiny mixture-of-experts Llama on the embedded stdlib corpus (CPU, about three minutes).

    python train.py --config configs/moe_tiny.py --workdir runs/moe_tiny

lm_tiny's shape with every layer's MLP replaced by 8 SwiGLU experts of width 192, top-2 routed
(each token uses 2 x 192 = 384, lm_tiny's MLP width: the same active size), dropless, with the
global-batch load-balancing loss and the router z-loss; 1.41M parameters of which 0.53M
active. 200 steps reach eval loss 2.90 in 2 min 55 s on 2 shared CPU cores; on CPU the dropless
ragged_dot does every expert's work for every row (jax's CPU lowering), 2.2x a dense step of the
same active size, while `--config.model.moe.capacity_factor=1.25` runs at 1.1x
(`python bench/moe_step_time.py`).
Runs on 1 device and on 8-device meshes with mesh.expert in {2, 4, 8} (folded with data/fsdp).
Metrics: `moe/...` in metrics.jsonl and TensorBoard (docs/moe.md).
"""
from trainer.config import default_config


def get_config():
  c = default_config()
  c.steps = 200
  c.model.update(vocab_size=512, d_model=128, num_layers=2, num_heads=4, num_kv_heads=2,
                 mlp_dim=384)
  c.model.moe.update(num_experts=8, top_k=2, mlp_dim=192, every=1, capacity_factor=0.0,
                     router_z_loss=1e-3, load_balance_loss=1e-2, balance_scope="global")
  c.data.update(global_batch_size=16, seq_len=128)
  c.optim.update(name="adamw", warmup_steps=20, decay_steps=200)
  c.log_every = 10
  c.eval_every = 100
  c.checkpoint.every_steps = 100
  return c

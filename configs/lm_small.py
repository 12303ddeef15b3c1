"""A small Llama for CPU benchmarks and quick experiments: 9.8M parameters, seq 256.

    python train.py --config configs/lm_small.py --workdir runs/small

About 10x the compute per token of lm_tiny; still trains on a laptop CPU (slowly).
"""
from trainer.config import default_config


def get_config():
  c = default_config()
  c.steps = 2000
  c.model.update(vocab_size=512, d_model=384, num_layers=6, num_heads=6, num_kv_heads=2,
                 mlp_dim=1024)
  c.data.update(global_batch_size=16, seq_len=256)
  c.optim.update(learning_rate=2e-3, warmup_steps=100, decay_steps=2000)
  c.log_every = 20
  c.eval_every = 500
  c.checkpoint.every_steps = 500
  return c

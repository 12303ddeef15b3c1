"""Tiny Llama on the embedded stdlib corpus: the default run (its time and losses: README,
"Measured numbers").

    python train.py --config configs/lm_tiny.py --workdir runs/tiny

0.5M parameters, fp32, byte-level tokens; runs on 1 device and on every 8-device mesh with
data x fsdp x tensor (tensor <= 2, fsdp <= 4). The schedule's horizon is fixed at 300 steps, so
a run can be stopped and resumed with any `--config.steps`.
"""
from trainer.config import default_config


def get_config():
  c = default_config()
  c.steps = 300
  c.model.update(vocab_size=512, d_model=128, num_layers=2, num_heads=4, num_kv_heads=2,
                 mlp_dim=384)
  c.data.update(global_batch_size=16, seq_len=128)
  c.optim.update(name="adamw", warmup_steps=20, decay_steps=300)  # lr etc.: adamw defaults
  c.log_every = 10
  c.eval_every = 100
  c.checkpoint.every_steps = 100
  return c

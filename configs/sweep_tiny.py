"""Critical-batch sweep on the embedded corpus: a tiny LM at several batch sizes (minutes on CPU).

    python -m tools.batch_sweep --config configs/sweep_tiny.py --batch_sizes 8,16,32,64,128 \
        --lr_grid 0.5,1 --target_loss 2.7

As a plain run at batch 16, and under the batch autopilot from 16 up to 128:

    python train.py --config configs/sweep_tiny.py --workdir runs/sweep_tiny
    python train.py --config configs/sweep_tiny.py --workdir runs/sweep_auto \
        --config.data.batch_ramp=auto

0.16M parameters, sequences of 64 bytes; AdamW stated at a reference batch of 16 and moved to
each batch by the batch-size rules; a warmup in examples, then a constant rate; every run
measures the gradient noise scale on every step (free: the accumulation micro-batches are its
small batches). Why and details: docs/configs.md#the-shipped-configs.
"""
from trainer.config import default_config


def get_config():
  c = default_config()
  c.steps = 1000
  c.model.update(vocab_size=512, d_model=64, num_layers=2, num_heads=4, num_kv_heads=2,
                 mlp_dim=192)
  c.data.update(global_batch_size=16, micro_batch_size=8, seq_len=64)
  c.optim.update(name="adamw", learning_rate=3e-3, b2=0.99, schedule="constant",
                 reference_batch_size=16, lr_rule="sqrt", b2_rule="half_life",
                 warmup_steps=0, warmup_examples=256, noise_scale_every=1)
  c.log_every = 10
  c.eval_every = 50
  c.checkpoint.every_steps = 0
  return c

"""Long context: the 1B Llama of lm_1b.py on 32k-token sequences, split over the `sequence`
mesh axis with ring attention.

    python train.py --config configs/lm_1b_32k.py --workdir /gcs/bucket/runs/1b-32k \
        --config.data.dir=/path/to/prepared
    python -m tools.aot --config configs/lm_1b_32k.py --topology v5e:4x4

Fits a v5e slice of 16 chips (`v5e:4x4`, 4 hosts) at 14.6 GiB per chip with Llama 3's 128,256-id
vocabulary (`--config.model.vocab_size=0` takes the prepared data's), by the chunked loss
(`model.logits_chunk`) and a ring per quarter of a chip's kv heads (`model.ring_head_chunks`).
1M tokens per step (32 x 32768) in micro-batches of 8, full rematerialisation, RoPE base 1e6.
Why and details: docs/configs.md#the-shipped-configs.
"""
from trainer.config import default_config


def get_config():
  c = default_config()
  c.steps = 20_000
  c.mesh.update(data=1, fsdp=-1, sequence=4)
  c.model.update(vocab_size=128_256, d_model=2048, num_layers=16, num_heads=16, num_kv_heads=8,
                 mlp_dim=8192, dtype="bfloat16", param_dtype="float32", remat="full",
                 rope_theta=1_000_000.0, attention="auto", ring_head_chunks=4,
                 logits_chunk=2048)
  c.data.update(global_batch_size=32, micro_batch_size=8, seq_len=32768, prefetch=2)
  c.optim.update(name="adamw", learning_rate=3e-4, warmup_steps=1000, decay_steps=20_000,
                 schedule="cosine", b2=0.95, weight_decay=0.1)
  c.log_every = 10
  c.eval_every = 1000
  c.eval_sequences = 32
  c.checkpoint.update(every_steps=500, keep=3)
  return c

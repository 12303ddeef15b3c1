"""A Llama with 1.0B parameters in its blocks (16 layers, d_model 2048, GQA 16/8 heads; 1.5B with
the embedding and head of Llama 3's vocabulary) for a GPU node or TPU slice.

    python train.py --config configs/lm_1b.py --workdir /gcs/bucket/runs/1b \
        --config.data.dir=/path/to/prepared

Llama 3's vocabulary (128,256 ids, as Llama 3.2 1B; `--config.model.vocab_size=0` takes the
vocabulary from the prepared data instead), the loss run 256 positions at a time
(`model.logits_chunk`: 11.1 GiB per v5e chip; 16.1 GiB with chunks of 512, and without chunks
the compiler asks for 27 GiB of temporaries).
bf16 compute, fp32 master weights and Adam moments sharded by FSDP (16 bytes/param -> 24 GB
in total, divided over the devices), full rematerialisation of each block, micro-batches of 256
sequences (16 per chip at a time on 16 chips). Documented fit: a v5e slice of 16 chips
(`python -m tools.aot --config configs/lm_1b.py --topology v5e:4x4`, docs/aot.md).
"""
from trainer.config import default_config


def get_config():
  c = default_config()
  c.steps = 50_000
  c.mesh.update(data=1, fsdp=-1)
  c.model.update(vocab_size=128_256, d_model=2048, num_layers=16, num_heads=16, num_kv_heads=8,
                 mlp_dim=8192, dtype="bfloat16", param_dtype="float32", remat="full",
                 rope_theta=500_000.0, attention="auto", logits_chunk=256)
  c.data.update(global_batch_size=512, micro_batch_size=256, seq_len=2048, prefetch=4)
  c.optim.update(name="adamw", learning_rate=3e-4, warmup_steps=2000, decay_steps=50_000,
                 schedule="cosine", b2=0.95, weight_decay=0.1)
  c.log_every = 50
  c.eval_every = 2000
  c.eval_sequences = 5120
  c.checkpoint.update(every_steps=1000, keep=3)
  return c

"""An ~8B Llama (Llama 3 8B's layers: 32 x d_model 4096, GQA 32/8 heads, SwiGLU 14336) for a
TPU slice or a multi-node GPU cluster.

    python train.py --config configs/lm_8b.py --workdir /gcs/bucket/runs/8b \
        --config.data.dir=/path/to/prepared
    python -m tools.aot --config configs/lm_8b.py --topology v5:2x2x4   # fits? before you pay

Llama 3's vocabulary (128,256 ids: data prepared with its tokenizer; `--config.model.vocab_size=0`
takes the vocabulary from the prepared data instead): 8.0B parameters, 1.05B of them the
embedding and the head. The loss runs the head 1024 positions at a time (`model.logits_chunk`,
models/cross_entropy.py): the compiled step needs 53 GiB per v5p chip instead of 88 GiB with the
full fp32 logits of 8 sequences per chip. fp32 master weights and Adam moments (12 bytes/param,
96 GB) sharded by FSDP over every device, bf16 compute, full rematerialisation, 1M tokens per
step (128 x 8192). Documented fit: a v5p slice of 16 chips (`v5:2x2x4`), see
docs/aot.md.
"""
from trainer.config import default_config


def get_config():
  c = default_config()
  c.steps = 100_000
  c.mesh.update(data=1, fsdp=-1)
  c.model.update(vocab_size=128_256, d_model=4096, num_layers=32, num_heads=32, num_kv_heads=8,
                 mlp_dim=14336, dtype="bfloat16", param_dtype="float32", remat="full",
                 rope_theta=500_000.0, attention="auto", logits_chunk=1024)
  c.data.update(global_batch_size=128, seq_len=8192, prefetch=4)
  c.optim.update(name="adamw", learning_rate=3e-4, warmup_steps=2000, decay_steps=100_000,
                 schedule="cosine", b2=0.95, weight_decay=0.1)
  c.log_every = 50
  c.eval_every = 2000
  c.eval_sequences = 2560
  c.checkpoint.update(every_steps=1000, keep=3)
  return c

"""GPT-2-small-shaped Llama with GQA (104M parameters in its blocks, 181M with the embedding and
head of GPT-2's vocabulary) for one GPU or a small TPU slice.

    python train.py --config configs/lm_125m.py --workdir runs/125m \
        --config.data.dir=/path/to/prepared   # python -m data.prepare --out ... your files

GPT-2's vocabulary (50,257 ids, padded to 50,304 = 393 x 128; `--config.model.vocab_size=0` takes
the vocabulary from the prepared data instead), the loss run 512 positions at a time
(`model.logits_chunk`: 12.5 GiB per v5e chip; 21.1 GiB, more than its 16, without it).
bf16 compute with fp32 parameters and optimizer state, FSDP over every device, 0.5M tokens per
step (256 x 2048) in micro-batches of 64 sequences (activations of 16 sequences per chip at a
time on 4 chips). Documented fit: a v5e slice of 4 chips (`python -m tools.aot --config
configs/lm_125m.py --topology v5e:2x2`, docs/aot.md). On CPU it runs too, but
only for a smoke test (shrink the batch).
"""
from trainer.config import default_config


def get_config():
  c = default_config()
  c.steps = 20_000
  c.seed = 0
  c.mesh.update(data=1, fsdp=-1)
  c.model.update(vocab_size=50_304, d_model=768, num_layers=12, num_heads=12, num_kv_heads=4,
                 mlp_dim=3072, dtype="bfloat16", param_dtype="float32", remat="dots",
                 attention="auto", logits_chunk=512)
  c.data.update(global_batch_size=256, micro_batch_size=64, seq_len=2048, prefetch=4)
  c.optim.update(name="adamw", learning_rate=6e-4, warmup_steps=1000, decay_steps=20_000,
                 schedule="cosine", b2=0.95, weight_decay=0.1)
  c.log_every = 50
  c.eval_every = 1000
  c.eval_sequences = 1280
  c.checkpoint.update(every_steps=1000, keep=3)
  return c

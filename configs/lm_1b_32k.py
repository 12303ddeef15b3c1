"""Long context: the 1B Llama of lm_1b.py on 32k-token sequences, split over the `sequence`
mesh axis with ring attention.

    python train.py --config configs/lm_1b_32k.py --workdir /gcs/bucket/runs/1b-32k \
        --config.data.dir=/path/to/prepared
    python -m tools.aot --config configs/lm_1b_32k.py --topology v5e:4x4

Llama 3's vocabulary (128,256 ids; `--config.model.vocab_size=0` takes the vocabulary from the
prepared data instead), the loss run 2048 positions at a time (`model.logits_chunk`; on each
device a quarter of them, its own part of the sequence): 14.6 GiB per v5e chip; without it the
compiler asks for 17.3 GiB of temporaries alone.
mesh.sequence=4: every device holds 8k tokens of each sequence and ring attention passes keys
and values around the 4 devices (O(S/4) memory for keys and values, causal work balanced by the
zig-zag layout); FSDP over the remaining devices. 1M tokens per step (32 x 32768) in
micro-batches of 8 sequences; full rematerialisation; RoPE base 1e6 for the long range.
model.ring_head_chunks=4: the ring runs once per 2 of a chip's 8 kv heads, so the blocks in
flight and the blockwise scores are a quarter of the size (on TPU the ring computes its block
pairs with plain XLA): 11.9 GiB per chip instead of 29.3 GiB with one ring over all heads
(both measured with a 512-id vocabulary).
Documented fit: a v5e slice of 16 chips (`v5e:4x4`, 4 hosts), see docs/aot.md.
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

"""The tiny model on the embedded corpus tokenized by a 4k byte-level BPE trained on it.

    python -m data.prepare --train_tokenizer bpe:4096 --out data/bpe4k
    python train.py --config configs/lm_tiny_bpe.py --workdir runs/tiny_bpe

Everything but the data is configs/lm_tiny.py; the vocabulary comes from the data
(model.vocab_size=0: 4,096 ids). Compare runs across tokenizers by `eval_bpb` (bits per byte).
"""
from configs import lm_tiny


def get_config():
  c = lm_tiny.get_config()
  c.data.dir = "data/bpe4k"
  c.model.vocab_size = 0
  return c

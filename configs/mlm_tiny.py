"""Tiny masked-LM encoder on the embedded stdlib corpus: lm_tiny's model with bidirectional
attention, trained on BERT's masking (its time and masked accuracy: README, "Measured numbers";
how the masking works and what is measured: docs/mlm.md).

    python train.py --config configs/mlm_tiny.py --workdir runs/mlm_tiny

15% of the tokens selected (80% shown as [MASK], 10% a random token, 10% unchanged); the loss
and eval_masked_accuracy on the selected ones, beside eval_unigram_accuracy (always the most
frequent masked token of the validation set). A masked LM learns from ~15% of the positions a
causal LM does, so it takes 600 steps of 32 sequences (lm_tiny: 300 of 16), and evaluates on
256 sequences (4,968 masked positions).
"""
from configs import lm_tiny


def get_config():
  c = lm_tiny.get_config()
  c.steps = 600
  c.model.causal = False
  c.data.update(mask_rate=0.15, global_batch_size=32)
  c.optim.update(warmup_steps=50, decay_steps=600)
  c.eval_every = 200
  c.eval_sequences = 256
  c.checkpoint.every_steps = 200
  return c

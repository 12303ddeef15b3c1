"""Tiny masked-LM encoder on the embedded stdlib corpus: lm_tiny's model with bidirectional
attention, trained on BERT's masking (its time and masked accuracy: README, "Measured numbers";
how the masking works: docs/mlm.md).

    python train.py --config configs/mlm_tiny.py --workdir runs/mlm_tiny

15% of the tokens selected (80% shown as [MASK], 10% a random token, 10% unchanged), the loss
and eval_masked_accuracy on the selected ones; eval_unigram_accuracy beside it is the accuracy
of always predicting the most frequent masked token of the validation set.
"""
from configs import lm_tiny


def get_config():
  c = lm_tiny.get_config()
  c.model.causal = False
  c.data.mask_rate = 0.15
  return c

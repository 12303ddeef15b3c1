"""The vision workload: a 1-D ResNet with ghost batch norm on mnist1d (models/resnet.py,
data/mnist1d.py; the measured accuracy and time: docs/vision.md).

    python train.py --config configs/mnist1d_resnet.py --workdir runs/mnist1d_resnet

20,000 generated training examples (cached after the first run), the fixed test set of 4,000
scored every 250 steps (eval_accuracy, eval_loss); batch 128 in ghost batch-norm groups of 16;
AdamW with cosine decay, label smoothing off (MLPerf's ResNet: model.resnet.label_smoothing=0.1).
"""
from trainer.config import default_config


def get_config():
  c = default_config()
  c.steps = 1_500
  c.model.kind = "resnet1d"
  c.model.resnet.update(channels=48, blocks=3, kernel=5, bn_group=16)
  c.data.update(global_batch_size=128, seq_len=40)
  c.data.mnist1d.update(train_examples=20_000, seed=1)
  c.optim.update(name="adamw", learning_rate=3e-3, warmup_steps=50, decay_steps=1_500,
                 weight_decay=0.05)
  c.log_every = 50
  c.eval_every = 250
  c.eval_sequences = 4_000  # test examples scored
  c.checkpoint.every_steps = 500
  return c

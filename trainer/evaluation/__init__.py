"""Evaluation: the fixed validation sample a training run scores every `eval_every` steps
(periodic.py), and loss, perplexity and bits per byte over a whole split for a saved model
(split.py). It may import trainer.errors, trainer.config, trainer.multihost, trainer.step and the
packages below trainer; not checkpoint or tracking."""

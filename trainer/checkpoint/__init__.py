"""Checkpoints: the persistent Orbax tier (persistent.py), the local tier with peer copies
(local_tier.py; its shard geometry local_layout.py), the loop's saves to both (saver.py), what a
checkpoint says and whether it fits the run (saved.py), the data position item (data_state.py),
its checksums and the finiteness check (integrity.py), the run's identity (identity.py),
restarts on other devices (elastic.py), the schedule's horizon kept across restarts (horizon.py),
and models read or written outside training (model_dirs.py). It may import trainer.errors,
trainer.config, trainer.multihost, trainer.step and the packages below trainer; not tracking or
evaluation."""

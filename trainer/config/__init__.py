"""What a run is told: the config's keys and defaults and `ConfigError` (defaults.py), config
files and `--config.KEY=VALUE` overrides (cli.py), validation against itself and the devices
(checks.py, with batch_checks.py for batch-size science and parallel_checks.py for the parallel
layouts), and the cheap memory lower bound train.py checks before compiling (memory_bound.py).
It may import trainer.errors and the packages below trainer (kernels, data, sharding, optim,
models), no other room. Config files import `default_config` and `ConfigError` from here."""
from trainer.config.defaults import ConfigError, default_config  # noqa: F401  (configs' API)

"""TODO."""
from trainer.config.defaults import ConfigError, default_config  # noqa: F401  (configs' API)

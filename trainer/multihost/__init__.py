"""Several processes, one run: which JAX platforms to probe before JAX starts (platforms.py),
`jax.distributed` start-up from the config, the environment or a cluster manager (launch.py), and
what every process must agree on, with the collectives that agree (agreement.py). It may import
trainer.errors, trainer.config and the packages below trainer (kernels, data, sharding, optim,
models)."""

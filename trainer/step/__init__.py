"""What runs on the devices: the train state, created sharded on the mesh (state.py), the jitted
train and eval steps (train_step.py) with their pipelined (pipelined.py) and DiLoCo (diloco.py)
variants, the Program that builds and compiles them for a mesh (program.py), and what XLA says a
compiled program costs (costs.py). It may import trainer.errors, trainer.config,
trainer.multihost and the packages below trainer (kernels, data, sharding, optim, models)."""

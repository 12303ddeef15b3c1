"""The training run, in rooms: packages that each hold one part of it, lowest first.

  errors.py    one-line reports of exceptions
  config/      what a run is told: keys and defaults, config files and overrides, validation
  multihost/   several processes: JAX platforms, jax.distributed start-up, agreement
  step/        what runs on the devices: the train state, the jitted steps, the compiled Program
  checkpoint/  both checkpoint tiers, the saver, elastic restarts, model directories
  tracking/    metric rows, device peaks and MFU, the start-up report, goodput, the profiler
  evaluation/  the evaluation every eval_every steps, and over a whole split
  run/         the loop and what it decides, feeds and reads back; in-process runs

A room imports only the rooms above it in this list (checkpoint, tracking and evaluation not
each other), and trainer/ only kernels, data, sharding, optim and models below it: README.md,
section Layout (checked by tools/layout.py).
"""

"""What a run records about itself: metric rows to metrics.jsonl, TensorBoard, wandb and the
console (metrics.py), device peaks for MFU and the roofline (peaks.py), the start-up report
(report.py), step timing and goodput events (goodput.py), the profiler window (profiling.py),
what crosses DiLoCo's replicas (communication.py), and a run's record read back (record.py). It
may import trainer.errors, trainer.config, trainer.multihost, trainer.step and the packages below
trainer; not checkpoint or evaluation."""

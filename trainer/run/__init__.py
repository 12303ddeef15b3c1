"""The run: the training loop (loop.py, `Run`), when it logs, evaluates, saves and stops
(decisions.py), its metrics read back and the policies that follow (readback.py), the data it
feeds its step (feed.py), its compiled steps, one per variant (steps.py), and in-process runs for
the tools and experiments (inprocess.py). The top room: it may import every other room of
trainer/ and the packages below trainer; train.py, tools, experiments and bench import it."""

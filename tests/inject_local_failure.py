"""train.py with a failed local write on one process, for tests/test_local_tier.py.

  SCALETRAIN_TEST_LOCAL_FAILURE=<process>:<step> python tests/inject_local_failure.py ARGS

That process's local Orbax manager reports, at the main thread's next check after saving local
step <step> (`check_for_errors` or `wait_until_finished`), that the background write of that step
failed, as Orbax reports an error of a write it finished in the background (its own finalize
thread's checks are left alone). Everything else is train.py.
"""
import os
import sys
import threading

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

import orbax.checkpoint as ocp  # noqa: E402

import train  # noqa: E402


def inject(process: int, step: int) -> None:
  manager = ocp.CheckpointManager
  save, pending = manager.save, {}

  def saving(self, at, *args, **kwargs):
    out = save(self, at, *args, **kwargs)
    if at == step and os.path.basename(str(self.directory)) == f"process_{process}":
      pending[id(self)] = OSError(5, f"injected: the background write of local step {step} "
                                     "failed")
    return out

  def reporting(original):
    def report(self, *args, **kwargs):
      main = threading.current_thread() is threading.main_thread()
      error = pending.pop(id(self), None) if main else None
      if error is not None:
        raise error
      return original(self, *args, **kwargs)
    return report

  manager.save = saving
  manager.check_for_errors = reporting(manager.check_for_errors)
  manager.wait_until_finished = reporting(manager.wait_until_finished)


if __name__ == "__main__":
  process, step = map(int, os.environ["SCALETRAIN_TEST_LOCAL_FAILURE"].split(":"))
  if int(os.environ.get("JAX_PROCESS_ID", "0")) == process:
    inject(process, step)
  sys.exit(train.main(sys.argv[1:]))

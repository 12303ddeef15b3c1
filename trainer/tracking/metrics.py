"""The metric rows of a run: `metrics.jsonl` (one JSON object per row, appended), TensorBoard,
Weights & Biases, and the console line with its progress bar (`MetricsWriter`). MFU's peak is
trainer/tracking/peaks.py's.
"""
from __future__ import annotations

import json
import os
import re
import sys
import uuid

import numpy as np
from tqdm import tqdm


# Per-layer MoE router metrics (`moe/L3/load/E5`, models/moe.py `metrics`): written to
# metrics.jsonl, TensorBoard and wandb, but not to the console line, which keeps the summaries.
_NOT_ON_CONSOLE = re.compile(r"^moe/L\d+/")


def _summary_writer_class():
  """tensorboardX's SummaryWriter. Its writer module imports torch where torch is installed
  (the `hf` and `test` extras install it) only to accept torch tensors; we write floats, and
  torch costs every run's start 1.5-2 s, so unless torch is already loaded it is imported with
  torch hidden (`sys.modules["torch"] = None` makes `import torch` raise ImportError, which
  tensorboardX handles; torch stays importable afterwards)."""
  if "torch" in sys.modules:
    from tensorboardX import SummaryWriter  # noqa: PLC0415  start-up
    return SummaryWriter
  sys.modules["torch"] = None
  try:
    from tensorboardX import SummaryWriter  # noqa: PLC0415  start-up
  finally:
    del sys.modules["torch"]
  return SummaryWriter


def _jsonable(value):
  if isinstance(value, (np.generic, np.ndarray)):
    return value.item()
  return value


class MetricsWriter:
  """Writes on process 0 only: metrics.jsonl, TensorBoard event files, console lines, and
  Weights & Biases when `wandb` names a project (`trainer.wandb`: project, mode, name; mode
  "offline" writes under `<workdir>/wandb` and needs no account or network)."""

  def __init__(self, workdir: str, *, enabled: bool = True, progress_total: int = 0,
               progress_start: int = 0, progress_bar: bool = True, wandb=None,
               run_config: dict | None = None):
    self.enabled = enabled
    self._jsonl = None
    self._tb = None
    self._bar = None
    self._wandb = None
    if not enabled:
      return
    if wandb is not None and wandb.get("project"):
      self._wandb = _start_wandb(workdir, wandb, run_config)
    os.makedirs(workdir, exist_ok=True)
    self._jsonl = open(os.path.join(workdir, "metrics.jsonl"), "a", buffering=1)
    try:
      self._tb = _summary_writer_class()(os.path.join(workdir, "tensorboard"))
    except ImportError:  # TensorBoard output is optional
      self._tb = None
    if progress_bar and sys.stderr.isatty():
      self._bar = tqdm(total=progress_total, initial=progress_start, unit="step",
                       dynamic_ncols=True)

  def write(self, step: int, metrics: dict, *, console: bool = True) -> None:
    if not self.enabled:
      return
    row = {"step": int(step), **{k: _jsonable(v) for k, v in metrics.items()}}
    self._jsonl.write(json.dumps(row) + "\n")
    if self._tb is not None:
      for key, value in row.items():
        if key != "step" and isinstance(value, (int, float)):
          self._tb.add_scalar(key, value, int(step))
    if self._wandb is not None:
      self._wandb.log({k: v for k, v in row.items()
                       if k != "step" and isinstance(v, (int, float))}, step=int(step))
    if console:
      text = " ".join(f"{k}={_fmt(v)}" for k, v in row.items()
                      if k != "step" and not _NOT_ON_CONSOLE.match(k))
      self.log(f"step {step}: {text}")

  def advance(self, steps: int = 1, **postfix) -> None:
    if self._bar is not None:
      self._bar.update(steps)
      if postfix:
        self._bar.set_postfix({k: _fmt(v) for k, v in postfix.items()}, refresh=False)

  def log(self, message: str, *, stderr: bool = False) -> None:
    """Print a line (to stderr with `stderr`: a failure), above the progress bar if any."""
    if not self.enabled:
      return
    out = sys.stderr if stderr else sys.stdout
    if self._bar is not None:
      self._bar.write(message, file=out)
    else:
      print(message, flush=True, file=out)

  def close(self) -> None:
    if self._bar is not None:
      self._bar.close()
    if self._wandb is not None:
      self._wandb.finish()
      self._wandb = None
    if self._tb is not None:
      self._tb.close()
    if self._jsonl is not None:
      self._jsonl.close()


def _start_wandb(workdir: str, cfg, run_config: dict | None):
  """A wandb run for this workdir; resumed (same id) when the workdir is restarted."""
  import wandb  # noqa: PLC0415  (an optional extra; trainer/config/checks.py checks it is installed)
  os.makedirs(workdir, exist_ok=True)
  id_path = os.path.join(workdir, "wandb_run_id")
  if os.path.exists(id_path):
    with open(id_path) as f:
      run_id = f.read().strip()
  else:
    run_id = uuid.uuid4().hex[:12]
    with open(id_path, "w") as f:
      f.write(run_id)
  return wandb.init(project=cfg["project"], name=cfg.get("name") or None,
                    mode=cfg.get("mode") or "online", dir=workdir, id=run_id, resume="allow",
                    config=run_config, settings=wandb.Settings(console="off"))


def _fmt(v) -> str:
  if isinstance(v, float):
    return f"{v:.4g}"
  return str(v)

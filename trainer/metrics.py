"""Metrics: `metrics.jsonl`, TensorBoard, the console, and MFU against the device's peak.

MFU = achieved model FLOP/s / peak FLOP/s of all devices, with the model's own FLOP count
(`models.llama.flops_per_token`). Peaks of known accelerators are in `PEAK_FLOPS` (dense bf16,
per chip, from the vendors' spec sheets). A CPU has no spec-sheet number that means anything
for XLA, so its peak is *measured*: the best FLOP/s of a large fp32 matmul in this process.
"""
from __future__ import annotations

import json
import math
import os
import sys
import time
import uuid

import jax
import jax.numpy as jnp
import numpy as np

# Dense bf16 peak FLOP/s per chip (per device as JAX sees it). Matched by substring of
# `device.device_kind`, most specific first.
PEAK_FLOPS = (
    ("TPU v6", 918e12),  # Trillium / v6e
    ("TPU v5p", 459e12),
    ("TPU v5 lite", 197e12),  # v5e
    ("TPU v5e", 197e12),
    ("TPU v5", 459e12),
    ("TPU v4", 275e12),
    ("TPU v3", 123e12),
    ("TPU v2", 45e12),
    ("H200", 989e12),
    ("H100", 989e12),  # SXM; PCIe is 756e12
    ("A100", 312e12),
    ("L40S", 362e12),
    ("L4", 121e12),
    ("A10G", 70e12),
    ("V100", 125e12),
    ("T4", 65e12),
)


GiB = 1 << 30
# High-bandwidth memory per device as JAX sees it (a chip; v4 and v5p run as one megacore
# device per chip), from the same spec sheets. `tools/aot.py` compares compiled programs with it.
HBM_BYTES = (
    ("TPU v6", 32 * GiB),
    ("TPU v5p", 95 * GiB),
    ("TPU v5 lite", 16 * GiB),
    ("TPU v5e", 16 * GiB),
    ("TPU v5", 95 * GiB),
    ("TPU v4", 32 * GiB),
    ("TPU v3", 16 * GiB),  # per core (a v3 device is one core)
    ("TPU v2", 8 * GiB),
    ("H200", 141e9),
    ("H100", 80 * GiB),
    ("A100-SXM4-40GB", 40 * GiB),
    ("A100-PCIE-40GB", 40 * GiB),
    ("A100", 80 * GiB),
    ("L40S", 48 * GiB),
    ("L4", 24 * GiB),
    ("A10G", 24 * GiB),
    ("V100", 16 * GiB),
    ("T4", 16 * GiB),
)


def _lookup(table, device_kind: str):
  for key, value in table:
    if key.lower() in device_kind.lower():
      return value
  return None


def known_peak_flops(device_kind: str) -> float | None:
  return _lookup(PEAK_FLOPS, device_kind)


def known_hbm_bytes(device_kind: str) -> float | None:
  return _lookup(HBM_BYTES, device_kind)


def measure_matmul_peak(n: int = 1024, repeats: int = 5, dtype=jnp.float32) -> float:
  """Best observed FLOP/s of an n x n x n matmul on the default device (all its threads).

  On a CPU with several *fake* XLA devices, those devices share the same cores, so this one
  number is the whole machine's peak.
  """
  x = jax.random.normal(jax.random.key(0), (n, n), dtype)
  f = jax.jit(lambda a: a @ a)
  f(x).block_until_ready()
  best = math.inf
  for _ in range(repeats):
    t0 = time.perf_counter()
    f(x).block_until_ready()
    best = min(best, time.perf_counter() - t0)
  return 2.0 * n ** 3 / best


def machine_peak_flops(configured_per_device: float = 0.0) -> tuple[float, str]:
  """(peak FLOP/s of all devices together, where the number came from)."""
  devices = jax.devices()
  if configured_per_device > 0:
    return configured_per_device * len(devices), "config"
  kind = devices[0].device_kind
  per_chip = known_peak_flops(kind)
  if per_chip is not None:
    return per_chip * len(devices), f"table ({kind})"
  return measure_matmul_peak(), "measured fp32 matmul"


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
      from tensorboardX import SummaryWriter  # noqa: PLC0415
      self._tb = SummaryWriter(os.path.join(workdir, "tensorboard"))
    except ImportError:  # TensorBoard output is optional
      self._tb = None
    if progress_bar and sys.stderr.isatty():
      from tqdm import tqdm  # noqa: PLC0415
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
      text = " ".join(f"{k}={_fmt(v)}" for k, v in row.items() if k != "step")
      self.log(f"step {step}: {text}")

  def advance(self, steps: int = 1, **postfix) -> None:
    if self._bar is not None:
      self._bar.update(steps)
      if postfix:
        self._bar.set_postfix({k: _fmt(v) for k, v in postfix.items()}, refresh=False)

  def log(self, message: str) -> None:
    if not self.enabled:
      return
    if self._bar is not None:
      self._bar.write(message)
    else:
      print(message, flush=True)

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
  import wandb  # noqa: PLC0415  (an optional extra; trainer/config.py checks it is installed)
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

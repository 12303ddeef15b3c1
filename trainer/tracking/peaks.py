"""What a device can do: peak FLOP/s by arithmetic (for MFU), HBM bytes and bandwidth (for the
AOT roofline), matched by device kind or measured on a CPU.

  PEAK_FLOPS           known accelerators' dense peaks per device (vendors' spec sheets)
  match_device_kind    a device kind matched word by word ("L4" is not "L40S")
  matmul_peak          the peak of the arithmetic the matmuls run in, which follows model.dtype
                       and JAX's matmul precision (fp32: TF32 on NVIDIA Ampere and later, one
                       bf16 pass on TPUs, by default)
  measure_matmul_peak  a CPU's peak: the best FLOP/s of a large matmul in the model's dtype

MFU = achieved model FLOP/s (`models.sizes.flops_per_token`) / the peak of all devices. Why and
details: docs/tracking.md#mfu-and-device-peaks.
"""
from __future__ import annotations

import dataclasses
import math
import re
import time

import jax
import jax.numpy as jnp


@dataclasses.dataclass(frozen=True)
class Peak:
  """Dense peak FLOP/s of one device by the arithmetic its matmuls run in."""
  bf16: float
  fp16: float | None = None  # None: as bf16
  tf32: float | None = None  # NVIDIA Ampere and later; None: no TF32 tensor cores
  fp32: float | None = None  # None (TPU): fp32 matmuls run as bf16 passes on the MXU


TPU_PASSES = {"high": 3, "bfloat16_3x": 3, "highest": 6, "float32": 6}  # bf16 passes per fp32 dot


# Per device as JAX sees it: a chip for TPU v4 and later (megacore) and for GPUs, a TensorCore
# (half a chip) for TPU v2 and v3.
PEAK_FLOPS = (
    ("TPU v6", Peak(bf16=918e12)),  # Trillium / v6e ("TPU v6 lite")
    ("TPU v5p", Peak(bf16=459e12)),
    ("TPU v5", Peak(bf16=459e12)),  # what JAX calls v5p
    ("TPU v5 lite", Peak(bf16=197e12)),  # v5e
    ("TPU v5e", Peak(bf16=197e12)),
    ("TPU v4", Peak(bf16=275e12)),
    ("TPU v3", Peak(bf16=61.5e12)),  # 123 per chip of 2 cores
    ("TPU v2", Peak(bf16=22.5e12)),  # 45 per chip of 2 cores
    ("H200", Peak(bf16=989e12, tf32=495e12, fp32=67e12)),
    ("H100", Peak(bf16=989e12, tf32=495e12, fp32=67e12)),  # SXM ("H100 80GB HBM3")
    ("H100 PCIe", Peak(bf16=756e12, tf32=378e12, fp32=51e12)),
    ("H100 NVL", Peak(bf16=835e12, tf32=418e12, fp32=60e12)),
    ("A100", Peak(bf16=312e12, tf32=156e12, fp32=19.5e12)),
    ("L40S", Peak(bf16=362e12, tf32=183e12, fp32=91.6e12)),
    ("L40", Peak(bf16=181e12, tf32=90.5e12, fp32=90.5e12)),
    ("L4", Peak(bf16=121e12, tf32=60e12, fp32=30.3e12)),
    ("A10G", Peak(bf16=70e12, tf32=35e12, fp32=31.2e12)),  # AWS's A10 variant; no public sheet
    ("A10", Peak(bf16=125e12, tf32=62.5e12, fp32=31.2e12)),
    ("V100", Peak(bf16=15.7e12, fp16=125e12, fp32=15.7e12)),  # no bf16 or TF32 tensor cores
    ("T4", Peak(bf16=8.1e12, fp16=65e12, fp32=8.1e12)),
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
    ("L40", 48 * GiB),
    ("L4", 24 * GiB),
    ("A10G", 24 * GiB),
    ("A10", 24 * GiB),
    ("V100", 16 * GiB),
    ("T4", 16 * GiB),
)


# HBM bandwidth per device as JAX sees it, bytes/s, from the vendors' spec sheets (Google Cloud's
# TPU system-architecture pages; NVIDIA's product data sheets, SXM parts unless named). The
# roofline in `tools/aot.py` divides a step's memory traffic by it.
HBM_BANDWIDTH = (
    ("TPU v6", 1640e9),  # Trillium / v6e
    ("TPU v5p", 2765e9),
    ("TPU v5 lite", 819e9),  # v5e
    ("TPU v5e", 819e9),
    ("TPU v5", 2765e9),  # what JAX calls v5p
    ("TPU v4", 1200e9),
    ("TPU v3", 450e9),  # 900 per chip of 2 cores
    ("TPU v2", 350e9),  # 700 per chip of 2 cores
    ("H200", 4.8e12),
    ("H100", 3.35e12),  # SXM ("H100 80GB HBM3")
    ("H100 PCIe", 2.0e12),
    ("H100 NVL", 3.9e12),
    ("A100-SXM4-40GB", 1.555e12),
    ("A100-PCIE-40GB", 1.555e12),
    ("A100", 2.039e12),  # 80 GB SXM
    ("L40S", 864e9),
    ("L40", 864e9),
    ("L4", 300e9),
    ("A10G", 600e9),
    ("A10", 600e9),
    ("V100", 900e9),
    ("T4", 320e9),
)


def _words(text: str) -> tuple[str, ...]:
  return tuple(re.findall(r"[a-z0-9]+", text.lower()))


def match_device_kind(table, device_kind: str):
  """The value of the entry whose name appears in `device_kind` as whole consecutive words
  ("L4" in "NVIDIA L4", not in "NVIDIA L40S"); the entry with the most words wins ("TPU v5
  lite" over "TPU v5", "H100 PCIe" over "H100"). None when nothing matches."""
  kind = _words(device_kind)
  best, best_len = None, 0
  for key, value in table:
    words = _words(key)
    n = len(words)
    if n > best_len and any(kind[i:i + n] == words for i in range(len(kind) - n + 1)):
      best, best_len = value, n
  return best


def matmul_peak(peak: Peak, dtype, precision: str | None = None) -> float:
  """Peak FLOP/s for matmuls in `dtype` under JAX's matmul `precision` (default: the
  `jax_default_matmul_precision` setting); docs/tracking.md#mfu-and-device-peaks."""
  name = jnp.dtype(dtype).name
  if name == "bfloat16":
    return peak.bf16
  if name == "float16":
    return peak.fp16 or peak.bf16
  if name != "float32":
    raise ValueError(f"no peak FLOP/s for matmuls in {name}")
  if precision is None:
    precision = jax.config.jax_default_matmul_precision
  precision = str(precision or "default").lower()
  if peak.fp32 is None:  # TPU: bf16 passes
    return peak.bf16 / TPU_PASSES.get(precision, 1)
  if precision in ("highest", "float32") or peak.tf32 is None:
    return peak.fp32
  return peak.tf32


def known_peak_flops(device_kind: str, dtype="bfloat16",
                     precision: str | None = None) -> float | None:
  peak = match_device_kind(PEAK_FLOPS, device_kind)
  return None if peak is None else matmul_peak(peak, dtype, precision)


def known_hbm_bytes(device_kind: str) -> float | None:
  return match_device_kind(HBM_BYTES, device_kind)


def known_hbm_bandwidth(device_kind: str) -> float | None:
  """HBM bytes/s of one device (`HBM_BANDWIDTH`); None when the kind is not in the table."""
  return match_device_kind(HBM_BANDWIDTH, device_kind)


def matmul_probe_size(platform: str) -> int:
  """The n of `measure_matmul_peak`'s n x n x n product on `platform`: 1024 on a CPU (a fraction
  of a second, at its best FLOP/s already); 8192 on an accelerator, where a 1024^3 product takes
  microseconds and the launch would dominate (an 8192^3 bf16 product keeps an H100 busy for
  ~1.4 ms, all of its SMs)."""
  return 1024 if platform == "cpu" else 8192


def measure_matmul_peak(n: int | None = None, repeats: int = 5, dtype=jnp.float32) -> float:
  """Best observed FLOP/s of an n x n x n matmul in `dtype` (random operands) on the default
  device, all its threads; n defaults to `matmul_probe_size` of the platform. On an accelerator
  each timing covers 10 products launched back to back (so launch gaps do not count).

  On a CPU with several *fake* XLA devices, those devices share the same cores, so this one
  number is the whole machine's peak.
  """
  platform = jax.default_backend()
  n = n or matmul_probe_size(platform)
  calls = 1 if platform == "cpu" else 10
  ka, kb = jax.random.split(jax.random.key(0))
  a = jax.random.normal(ka, (n, n), jnp.float32).astype(dtype)
  b = jax.random.normal(kb, (n, n), jnp.float32).astype(dtype)
  f = jax.jit(lambda x, y: x @ y)
  f(a, b).block_until_ready()
  best = math.inf
  for _ in range(repeats):
    t0 = time.perf_counter()
    for _ in range(calls):
      out = f(a, b)
    out.block_until_ready()
    best = min(best, (time.perf_counter() - t0) / calls)
  return 2.0 * n ** 3 / best


def machine_peak_flops(configured_per_device: float = 0.0,
                       dtype="float32") -> tuple[float, str]:
  """(peak FLOP/s of all devices together for matmuls in `dtype` (the model's compute dtype),
  where the number came from)."""
  devices = jax.devices()
  if configured_per_device > 0:
    return configured_per_device * len(devices), "config"
  kind = devices[0].device_kind
  name = jnp.dtype(dtype).name
  per_chip = known_peak_flops(kind, name)
  if per_chip is not None:
    return per_chip * len(devices), f"table ({kind}, {name} matmuls)"
  return measure_matmul_peak(dtype=name), f"measured {name} matmul"

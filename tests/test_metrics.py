"""MFU's denominator: the accelerator table matched by whole words of the device kind, and the
peak of the arithmetic the matmuls run in (model.dtype, JAX's matmul precision)."""
import jax
import jax.numpy as jnp
import pytest

from trainer.tracking import peaks
from trainer.tracking.peaks import known_hbm_bytes, known_peak_flops, machine_peak_flops

# Device kinds as JAX reports them -> the bf16 peak expected.
KINDS = {
    "NVIDIA L4": 121e12,
    "NVIDIA L40S": 362e12,
    "NVIDIA L40": 181e12,
    "NVIDIA A10G": 70e12,
    "NVIDIA A10": 125e12,
    "NVIDIA A100-SXM4-80GB": 312e12,
    "NVIDIA A100-PCIE-40GB": 312e12,
    "NVIDIA H100 80GB HBM3": 989e12,
    "NVIDIA H100 PCIe": 756e12,
    "NVIDIA H200": 989e12,
    "TPU v5 lite": 197e12,
    "TPU v5": 459e12,
    "TPU v5p": 459e12,
    "TPU v6 lite": 918e12,
    "TPU v4": 275e12,
    "TPU v3": 61.5e12,
}


@pytest.mark.parametrize("kind", list(KINDS))
def test_device_kind_matching_is_by_whole_words(kind):
  assert known_peak_flops(kind, "bfloat16") == KINDS[kind]


def test_unknown_kinds_and_memory():
  for kind in ("cpu", "NVIDIA L4000", "TPU v55", "Tesla T40", "TPU7x"):
    assert known_peak_flops(kind) is None, kind
  assert known_hbm_bytes("NVIDIA L40S") == 48 * 2**30 and known_hbm_bytes("NVIDIA L4") == 24 * 2**30
  assert known_hbm_bytes("TPU v5 lite") == 16 * 2**30 and known_hbm_bytes("TPU v5") == 95 * 2**30
  assert known_hbm_bytes("NVIDIA A100-SXM4-40GB") == 40 * 2**30
  assert known_hbm_bytes("NVIDIA A100-SXM4-80GB") == 80 * 2**30


def test_peak_follows_the_matmul_dtype_and_precision():
  a100 = "NVIDIA A100-SXM4-80GB"
  assert known_peak_flops(a100, jnp.bfloat16) == 312e12
  assert known_peak_flops(a100, "float16") == 312e12
  assert known_peak_flops(a100, "float32") == 156e12  # JAX's default: TF32 tensor cores
  assert known_peak_flops(a100, "float32", precision="highest") == 19.5e12  # CUDA cores
  with jax.default_matmul_precision("float32"):
    assert known_peak_flops(a100, "float32") == 19.5e12
  v100 = "Tesla V100-SXM2-16GB"  # no TF32, no bf16 units
  assert known_peak_flops(v100, "float32") == 15.7e12
  assert known_peak_flops(v100, "float16") == 125e12
  assert known_peak_flops(v100, "bfloat16") == 15.7e12
  assert known_peak_flops("TPU v4", "float32") == 275e12  # one bf16 pass by default
  assert known_peak_flops("TPU v4", "float32", precision="highest") == 275e12 / 6
  assert known_peak_flops("TPU v4", "float32", precision="bfloat16_3x") == 275e12 / 3
  with pytest.raises(ValueError, match="int8"):
    known_peak_flops(a100, "int8")


def test_machine_peak_uses_the_model_dtype(monkeypatch):
  class Device:
    device_kind = "NVIDIA A100-SXM4-80GB"

  monkeypatch.setattr(jax, "devices", lambda: [Device()] * 8)
  assert machine_peak_flops(0.0, "bfloat16") == (8 * 312e12, "table (NVIDIA A100-SXM4-80GB, "
                                                             "bfloat16 matmuls)")
  assert machine_peak_flops(0.0, "float32")[0] == 8 * 156e12
  assert machine_peak_flops(1e12, "bfloat16") == (8e12, "config")
  Device.device_kind = "cpu"
  measured = []
  monkeypatch.setattr(peaks, "measure_matmul_peak",
                      lambda dtype: measured.append(dtype) or 1e11)
  assert machine_peak_flops(0.0, "bfloat16") == (1e11, "measured bfloat16 matmul")
  assert measured == ["bfloat16"]


@pytest.mark.parametrize("platform,n,calls", [("cpu", 1024, 1), ("gpu", 64, 10)])
def test_matmul_peak_probe_in_the_dtype_at_the_platforms_size(monkeypatch, platform, n, calls):
  """The peak is measured in the asked dtype on the platform's probe size (1024 on CPU, a
  product that fills an accelerator elsewhere, here shrunk), accelerators timing 10 products
  launched back to back per measurement."""
  seen = []
  real_jit = jax.jit

  def recording_jit(fn):
    compiled = real_jit(fn)

    def call(a, b):
      seen.append((a.shape, str(a.dtype), str(b.dtype)))
      return compiled(a, b)
    return call

  monkeypatch.setattr(jax, "default_backend", lambda: platform)
  monkeypatch.setattr(jax, "jit", recording_jit)
  assert peaks.matmul_probe_size("gpu") == peaks.matmul_probe_size("tpu") == 8192
  if platform != "cpu":  # 8192^3 would take minutes here
    monkeypatch.setattr(peaks, "matmul_probe_size", lambda p: n)
  flops = peaks.measure_matmul_peak(repeats=2, dtype="bfloat16")
  assert flops > 0
  assert len(seen) == 1 + 2 * calls  # a warm-up call, then `calls` per timed repeat
  assert set(seen) == {((n, n), "bfloat16", "bfloat16")}

"""bench/compiled.py: our train step and the plain jit + optax step (with and without the
segment ids ours is fed) compiled ahead of time for one TPU chip, with XLA's costs, memory,
roofline, the ratios between them and the kernel diffs; and for an H100 (jax's CUDA plugin),
with the costs counted from the HLO.

Needs libtpu (as tests/test_aot.py); without it the module is skipped with the reason. The
default test compiles a small model (~20 s); the matched 3m model takes minutes (slow).
"""
import re

import pytest

from conftest import bench_module
from tools import aot

tpu = pytest.mark.skipif(not aot.libtpu_available(), reason=(
    "libtpu is not installed, so nothing can be compiled for TPU here (pip install -e "
    "\".[tpu]\"; its wheels exist for Linux x86-64 only)"))

# Ours adds its metrics and guards (a few norms and reductions over the state) to the same model
# and loss as the plain step: their FLOPs agree to this fraction, a model dimension does not.
FLOPS_TOLERANCE = 0.02
ROW = re.compile(r"^  \| (ours \(\w+\)|plain\+docs \(\w+\)|plain \(\w+\)|nanodo) \| (.+) \|$",
                 re.M)


def _bench():
  return bench_module("compiled")


def _rows(out: str) -> dict[str, list[str]]:
  return {name: cells.split(" | ") for name, cells in ROW.findall(out)}


def _check(bench, out: str, names: list[str]) -> dict[str, list[str]]:
  """The table has one well-formed row per step, nothing left in a loop, and ours/plain FLOPs
  agree; returns the rows."""
  rows = _rows(out)
  assert list(rows) == names, out
  for name, cells in rows.items():
    assert len(cells) == len(bench.HEADER) - 1, cells
    flops, nbytes, args, _, temp, loops, launches, bound, kind, mfu = cells
    assert float(flops.replace(",", "")) > 0 and float(nbytes.replace(",", "")) > 0
    assert float(args) > 0 and float(temp) >= 0 and float(bound.replace(",", "")) > 0
    assert loops == "0" and int(launches) > 0, cells
    assert kind in ("memory", "compute") and mfu.endswith("%"), cells
  ratio = float(re.search(r"ours \(xla\)/plain \(xla\): FLOPs ([\d.]+)", out).group(1))
  flops = {name: float(rows[name][0].replace(",", "")) for name in ("ours (xla)", "plain (xla)")}
  assert abs(ratio - flops["ours (xla)"] / flops["plain (xla)"]) < 2e-3 * ratio  # 4 digits
  assert abs(ratio - 1) < FLOPS_TOLERANCE, (ratio, out)
  # the kernel diffs: what ours adds to plain+docs, what the documents add to plain
  assert "ours (xla) vs plain+docs (xla): what our step adds" in out
  assert "plain+docs (xla) vs plain (xla): what keeping packed documents apart costs" in out
  assert re.search(r"only in ours \(xla\): \d+ launches, [\d,.]+ MB", out), out
  assert re.search(r"net: ours \(xla\) [+-]\d+ launches, [+-][\d,.]+ MB", out), out
  return rows


@tpu
def test_small_model_ours_vs_plain_for_one_v5e_chip(capsys):
  bench = _bench()
  assert bench.main(["--size", "none", "--dtypes", "bfloat16", "--attention", "xla",
                     "--config.data.seq_len=64", "--config.data.global_batch_size=4"]) == 0
  out = capsys.readouterr().out
  assert "v5e:1x1: 1 x TPU v5 lite" in out and "model.dtype=bfloat16" in out
  assert "nanodo: skipped (no --nanodo_dir given)" in out
  _check(bench, out, ["ours (xla)", "plain+docs (xla)", "plain (xla)"])


@tpu
@pytest.mark.slow
def test_matched_3m_model_with_splash_attention(capsys):
  bench = _bench()
  assert bench.main(["--size", "3m", "--dtypes", "bfloat16", "--attention", "xla,auto"]) == 0
  out = capsys.readouterr().out
  rows = _check(bench, out, ["ours (xla)", "plain+docs (xla)", "plain (xla)", "ours (splash)",
                             "plain+docs (splash)", "plain (splash)"])
  # splash attention is a Pallas kernel: XLA does not count its FLOPs
  assert float(rows["ours (splash)"][0]) < float(rows["ours (xla)"][0])
  assert re.search(r"ours \(splash\): \d+ Pallas kernel calls", out)


@tpu
def test_one_chip_of_any_topology():
  bench = _bench()
  assert [len(bench.one_chip(t).devices) for t in ("v5e:1x1", "v5e:2x2")] == [1, 1]
  assert bench.one_chip("v5e:2x2").name == "1 chip of v5e:2x2"


def test_tiny_model_for_one_h100(capsys):
  """The GPU programs (jax's CUDA plugin; skipped without it): costs counted from the HLO,
  `auto` attention as a GPU run resolves it (our Triton flash kernel with segment ids, cuDNN
  without),
  the three steps' FLOPs equal but for the attention kernels, the kernel diffs printed."""
  try:
    aot.gpu_target("h100:1")
    from jax._src.lib import cuda_versions  # the plain row's cuDNN attention is traced
    cuda_versions.cudnn_get_version()  # against the local cuDNN (nvidia-cudnn-cu12)
  except (aot.AotError, AttributeError, RuntimeError) as e:
    pytest.skip(f"no H100 target with cuDNN here: {e}")
  assert _bench().main(["--topology", "h100:1", "--size", "tiny", "--attention", "auto"]) == 0
  out = capsys.readouterr().out
  assert "compile only (jax's CUDA plugin)" in out and "counted from the optimized HLO" in out
  rows = _rows(out)
  ours, docs = "ours (flash_triton)", "plain+docs (flash_triton)"
  assert list(rows) == [ours, docs, "plain (cudnn)"], out
  flops = {name: float(cells[0].replace(",", "")) for name, cells in rows.items()}
  assert flops[ours] == flops[docs] < flops["plain (cudnn)"]
  assert "ours (flash_triton) vs plain+docs (flash_triton): what our step adds" in out
  assert re.search(r"only in plain \(cudnn\): \d+ launches", out), out


@pytest.mark.parametrize("args, needle", [
    (["--dtypes", "float8"], "--dtypes 'float8': use a comma-separated list of"),
    (["--topology", "v5e:3"], "--topology 'v5e:3': expected CHIP:AxB"),
    (["--size", "7m"], "--size '7m': use a comma-separated list of 3m, 25m, d768-s1024"),
])
@tpu
def test_user_errors_are_one_line_exit_2(args, needle, capsys):
  assert _bench().main(args) == 2
  err = capsys.readouterr().err
  assert err.count("\n") == 1 and needle in err, err

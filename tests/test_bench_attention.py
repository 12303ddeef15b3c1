"""bench/attention.py on CPU: one tiny case (the flash kernel interpreted, a tile variant, XLA;
cuDNN and a variant that does not compile skipped with their reasons), each output checked
against the fp32 reference (computed at the highest matmul precision) before it is timed; the
packed-document ids it draws; a bad option is one line."""
import re

import numpy as np
import pytest

from conftest import bench_module


def test_attention_bench_tiny_case_on_cpu(capsys):
  assert bench_module("attention").main([
      "--seq", "128", "--head-dim", "16", "--heads", "2", "--kv-heads", "1", "--packed", "docs",
      "--tokens", "128", "--reps", "1", "--flash-tiles", "32x32/32x32,8x8/8x8"]) == 0
  out = capsys.readouterr().out
  row = next(line for line in out.splitlines() if line.startswith("S128 D16 GQA 2/1 packed"))
  times = [float(x) for x in re.findall(r"([\d.]+) ms", row)]
  # flash (the Triton kernel off Hopper), flash_triton, its 32x32 tiles, xla: fwd and f+b each
  assert len(times) == 8 and all(t > 0 for t in times), row
  assert row.count("skip") == 4, row  # cuDNN and the 8x8 tiles, both passes
  assert float(row.split()[-1]) < 2e-2, row  # bf16 outputs against the fp32 reference
  assert "cudnn: skipped (cuDNN attention needs a GPU)" in out
  # a variant that does not compile is reported, and the others are still timed
  assert ("flash_triton 8x8/8x8: skipped (failed: BlockSizes.block_q=8: tiles must be powers"
          in out)
  winner = out.split("the table for choose_impl's GPU rule):")[1].split()
  assert winner[:6] == ["S128", "D16", "GQA", "2/1", "packed", winner[5]]
  assert winner[5] in ("flash", "flash_triton", "xla") or winner[5:7] == [
      "flash_triton", "32x32/32x32"], winner


def test_reference_is_traced_at_highest_matmul_precision(monkeypatch):
  """The fp32 reference's dots run at full precision (not TF32 / bf16 passes on an
  accelerator): the precision in force when it is traced."""
  import jax
  import jax.numpy as jnp
  attention = bench_module("attention")
  seen = []

  def reference(q, k, v, seg, rows):
    seen.append(jax.config.jax_default_matmul_precision)
    return q

  monkeypatch.setattr(attention, "attend_rows", reference)
  q = jnp.ones((1, 8, 1, 4), jnp.float32)
  attention.fp32_reference(q, q, q, None)
  assert seen == ["highest"], seen


@pytest.mark.parametrize("packed", [False, True])
def test_reference_on_the_last_rows_is_the_whole_attention_s(packed):
  """The reference on a slice (the last CHECK_ROWS queries of the first sequence, against every
  key before them) equals those rows of XLA's attention over the whole sequences, with GQA and
  packed documents: checking each case costs a [H, 256, S] block, not [B, H, S, S]."""
  import jax
  import jax.numpy as jnp

  from models.attention import xla_attention
  attention = bench_module("attention")
  B, S, H, K, D = 2, 384, 4, 2, 16
  ks = jax.random.split(jax.random.key(0), 3)
  q = jax.random.normal(ks[0], (B, S, H, D))
  k, v = (jax.random.normal(x, (B, S, K, D)) for x in ks[1:])
  seg = jnp.asarray(attention.segment_ids(B, S, seed=1)) if packed else None
  rows = attention.check_rows(S)
  assert (rows.start, rows.stop) == (S - attention.CHECK_ROWS, S)
  with jax.default_matmul_precision("highest"):
    whole = xla_attention(q, k, v, segment_ids=seg, causal=True)
  np.testing.assert_allclose(attention.fp32_reference(q, k, v, seg), whole[:1, rows],
                             rtol=1e-5, atol=1e-6)


def test_packed_documents_are_at_least_64_tokens():
  ids = bench_module("attention").segment_ids(3, 512, seed=0)
  for row in ids:
    assert row[0] == 1 and np.all(np.diff(row) >= 0)
    lengths = np.bincount(row)[1:]
    assert len(lengths) == 4 and lengths.min() >= 64 and lengths.sum() == 512


@pytest.mark.parametrize("argv,message", [
    (["--impls", "flash,triton"], "unknown or invalid ['triton']"),
    (["--flash-tiles", "128"], "--flash-tiles '128': expected BQxBK/BQBxBKB"),
    (["--seq", "2k"], "argument --seq: invalid ints value: '2k'"),
])
def test_attention_bench_bad_options_are_one_line(argv, message, capsys):
  assert bench_module("attention").main(argv) == 2
  err = capsys.readouterr().err.strip()
  assert message in err and len(err.splitlines()) == 1, err

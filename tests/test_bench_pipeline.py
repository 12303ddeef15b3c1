"""bench/pipeline.py: the input pipeline's tokens/s against the train step's, on the tiny config."""
import os
import re

from conftest import ROOT, bench_module

TINY = os.path.join(ROOT, "configs", "lm_tiny.py")


def _bench():
  return bench_module("pipeline")


def _value(out: str, name: str) -> float:
  return float(re.search(rf"^{name}\s+([\d,.]+)", out, re.M).group(1).replace(",", ""))


def test_pipeline_rate_against_a_measured_train_step(capsys):
  """The step is measured (compiled as train.py does) at the smallest batch the mesh allows;
  the ratio is the pipeline's rate over the step's, judged against the 20x target."""
  bench = _bench()
  assert bench.main(["--config", TINY, "--steps", "3", "--config.data.global_batch_size=16",
                     "--config.data.micro_batch_size=8"]) == 0
  out = capsys.readouterr().out
  assert "16 x 128 tokens = 2 micro-batches of 8 rows (8 rows read by this process)" in out
  pipe, step = _value(out, "pipeline tokens/s"), _value(out, "train step tok/s")
  assert "measured: " in out and "for a step of 8 x 128 tokens" in out
  ratio = _value(out, "ratio")
  assert abs(ratio - pipe / step) <= 0.05 * ratio + 0.1
  assert ("(target >= 20x: met)" in out) == (ratio >= 20)


def test_synthetic_short_documents_and_a_given_step_rate(capsys):
  bench = _bench()
  assert bench.main(["--config", TINY, "--steps", "2", "--doc-tokens", "40",
                     "--step-tokens-per-s", "1e12"]) == 0
  out = capsys.readouterr().out
  assert "train step tok/s  1,000,000,000,000 (given)" in out
  assert "(target >= 20x: NOT met)" in out  # nothing feeds a petatoken step
  # 40-token documents: several pieces per window of 129 tokens, read as exactly those tokens
  # (2 bytes each, 129 for 128 trained), from at most one or two 4 KiB pages per piece
  reads = re.search(r"^reads\s+([\d.]+) document pieces per window.*: ([\d.]+) bytes read per "
                    r"trained token, ([\d,]+) bytes of 4 KiB pages", out, re.M)
  pieces, read, paged = (float(x.replace(",", "")) for x in reads.groups())
  assert pieces > 3 and read == round(129 * 2 / 128, 2) and read < paged < 2 * pieces * 4096 / 128


def test_bad_override_is_one_line_exit_2(capsys):
  assert _bench().main(["--config", TINY, "--config.data.seq_len=x"]) == 2
  err = capsys.readouterr().err.strip()
  assert err.startswith("error: --config.data.seq_len='x'") and len(err.splitlines()) == 1

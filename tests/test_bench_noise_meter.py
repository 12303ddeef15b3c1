"""bench/noise_meter.py: the meter's cost, plain and preconditioned, alternated (slow: three
compiled steps), and its refusal of an optimizer without a preconditioned meter (one line)."""
import os
import re

import pytest

from conftest import ROOT, bench_module

TINY = os.path.join(ROOT, "configs", "lm_tiny.py")


def test_refuses_an_optimizer_without_second_moments(capsys):
  assert bench_module("noise_meter").main(["--config", TINY, "--config.optim.name=sgd"]) == 2
  assert "no preconditioned meter" in capsys.readouterr().err


@pytest.mark.slow
def test_times_the_three_steps_and_prints_the_ratios(capsys):
  assert bench_module("noise_meter").main(["--config", TINY, "--steps", "1", "--rounds", "3"]) \
      == 0
  out = capsys.readouterr().out
  assert len(re.findall(r"^\| (off|plain|precond) \| [\d.]+ \| [\d.]+ \|$", out, re.M)) == 3
  assert re.search(r"precond / plain: [\d.]+", out)

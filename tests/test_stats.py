"""Paired statistics over seeds (tools/stats.py) against textbook t intervals and p-values."""
import csv
import math

import pytest

from tools import stats


def test_t_interval_of_one_to_five():
  """mean 3, s = sqrt(2.5), se = 0.7071, t(0.975, 4) = 2.7764: 3 -+ 1.9632."""
  i = stats.t_interval([1, 2, 3, 4, 5])
  assert (i.mean, i.n) == (3.0, 5)
  assert i.se == pytest.approx(0.70711, abs=1e-5)
  assert (i.lo, i.hi) == pytest.approx((1.03676, 4.96324), abs=1e-5)
  assert (stats.t_interval([1, 2, 3, 4, 5], level=0.9).hi - 3) == pytest.approx(
      2.13185 * 0.70711, abs=1e-4)  # t(0.95, 4) = 2.1318
  one = stats.t_interval([2.0, None, math.nan])
  assert one.n == 1 and math.isnan(one.lo)


def test_paired_difference_with_three_seeds():
  """d = (0.5, 1.0, 2.5): mean 4/3, s = 1.0408, se = 0.6009, t(0.975, 2) = 4.3027, t = 2.2188,
  p = 0.157: the same sign on 3 of 3 seeds and still no difference at 95%."""
  r = stats.paired({0: 1.0, 1: 2.0, 2: 3.5, 3: 9.0}, {0: 0.5, 1: 1.0, 2: 1.0, 4: 0.0})
  assert r.seeds == [0, 1, 2] and r.positive == 3
  assert r.diff.mean == pytest.approx(4 / 3)
  assert (r.diff.lo, r.diff.hi) == pytest.approx((-1.25224, 3.91891), abs=1e-4)
  assert r.p == pytest.approx(0.15673, abs=1e-4)
  assert not r.significant and "no difference" in r.verdict("x", "y")
  big = stats.paired({0: 1.0, 1: 1.1, 2: 1.2}, {0: 0.0, 1: 0.05, 2: 0.1})  # d = 1, 1.05, 1.1
  assert big.significant and big.p < 0.001 and "x higher than y" in big.verdict("x", "y")
  same = stats.paired({0: 1.0, 1: 2.0}, {0: 1.0, 1: 2.0})
  assert same.p == 1.0 and not same.significant


def test_correlation_with_its_fisher_interval():
  """x = 1..5, y = (2, 1, 4, 3, 5): r = 0.8; z = atanh(0.8) = 1.0986 -+ 1.95996 / sqrt(2):
  [-0.2796, 0.9863]; t = 0.8 sqrt(3 / 0.36) = 2.3094 on 3 degrees of freedom: p = 0.1041."""
  c = stats.correlation([1, 2, 3, 4, 5, None], [2, 1, 4, 3, 5, 7])
  assert c.n == 5 and c.r == pytest.approx(0.8)
  assert (c.lo, c.hi) == pytest.approx((-0.27959, 0.98625), abs=1e-4)
  assert c.p == pytest.approx(0.10408, abs=1e-4)
  assert "[-0.28, 0.99]" in c.text()
  three = stats.correlation([1, 2, 3], [1, 3, 2])
  assert three.r == pytest.approx(0.5) and math.isnan(three.lo) and "no interval" in three.text()


def test_the_command_pairs_rows_of_a_csv(tmp_path, capsys):
  path = tmp_path / "seeds.csv"
  with open(path, "w", newline="") as f:
    w = csv.writer(f)
    w.writerow(["seed", "rule", "batch", "loss"])
    for seed, a, b in ((0, 1.0, 0.5), (1, 2.0, 1.0), (2, 3.5, 1.0)):
      w.writerow([seed, "linear", 16, a])
      w.writerow([seed, "sqrt", 16, b])
      w.writerow([seed, "sqrt", 32, 99.0])
  assert stats.main([str(path), "--metric", "loss", "--arm", "rule", "--a", "linear", "--b",
                     "sqrt", "--match", "batch=16"]) == 0
  out = capsys.readouterr().out
  assert "linear - sqrt = 1.333 [-1.252, 3.919] over 3 paired seeds (p = 0.16" in out
  assert stats.main([str(path), "--metric", "loss", "--arm", "rule", "--a", "linear", "--b",
                     "sqrt"]) == 2  # batch 32 and 16 both under sqrt: ambiguous
  assert "two rows for seed=0" in capsys.readouterr().err
  assert stats.main([str(path), "--metric", "nope", "--arm", "rule", "--a", "x", "--b", "y"]) == 2
  capsys.readouterr()
  assert stats.main([str(path), "--metric", "loss", "--arm", "rule", "--a", "linear", "--b",
                     "sqrt", "--config.seed=1"]) == 2  # nothing to override: said, not ignored
  assert "seed: python -m tools.stats takes no config overrides" in capsys.readouterr().err
  # seeds 3 and 4 in a CSV of their own (a later run): read together, five pairs
  more = tmp_path / "seeds34.csv"
  with open(more, "w", newline="") as f:
    w = csv.writer(f)
    w.writerow(["seed", "rule", "batch", "loss"])
    for seed in (3, 4):
      w.writerows([[seed, "linear", 16, 2.0], [seed, "sqrt", 16, 1.0]])
  assert stats.main([str(path), str(more), "--metric", "loss", "--arm", "rule", "--a", "linear",
                     "--b", "sqrt", "--match", "batch=16"]) == 0
  assert "over 5 paired seeds" in capsys.readouterr().out
  assert stats.main([str(tmp_path / "missing.csv"), "--metric", "loss", "--arm", "rule",
                     "--a", "x", "--b", "y"]) == 2

"""experiments/scaling_meter.py: which cells its correlation with B_crit reads, and the numbers."""
import math

import pytest

from experiments import scaling_meter


def cell(b_crit, truth, *, refused=None, transient=False):
  return dict(width=32, budget=1024, b_crit=b_crit, refused=refused, transient=transient,
              truth=truth, truth_precond=2 * truth, logged=None, logged_precond=None,
              crossing=truth, crossing_precond=None)


def test_only_fitted_cells_enter_the_correlation():
  """Four fitted cells with truth = B_crit / 2 exactly (r = 1, ratio 0.5); a refused and a
  transient cell whose truth would break both are left out; an estimate with no values is
  absent."""
  rows = [cell(b, b / 2) for b in (4.0, 8.0, 16.0, 40.0)]
  rows += [cell(10.0, 1000.0, refused="batch 4: seed 0 at the edge"),
           cell(10.0, 0.01, transient=True), cell(None, 3.0)]
  out = scaling_meter.summarize(rows)
  assert (out["cells"], out["of"]) == (4, 7)
  assert out["truth"]["r"] == pytest.approx(1.0)
  assert out["truth"]["ratio_median"] == pytest.approx(0.5)
  assert (out["truth"]["ratio_min"], out["truth"]["ratio_max"]) == pytest.approx((0.5, 0.5))
  assert out["truth_precond"]["ratio_median"] == pytest.approx(1.0)
  assert "logged" not in out and "crossing_precond" not in out
  noisy = scaling_meter.summarize([cell(b, t) for b, t in ((4, 3), (8, 2), (16, 9), (40, 5))])
  assert -1 < noisy["truth"]["r_lo"] < noisy["truth"]["r"] < noisy["truth"]["r_hi"] < 1
  assert not math.isnan(noisy["truth"]["p"])

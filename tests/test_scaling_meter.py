"""experiments/scaling_meter.py: which cells its correlation with B_crit reads, and the numbers."""
import json
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


def test_from_meter_pools_the_cells_of_several_files(tmp_path):
  """One file per width (the lab runs a width per command): --from_meter reads both, keeps the
  refused and transient cells out as the lab marked them, and summarises all the fitted ones."""
  from experiments.critical_batch_scaling import compact  # noqa: PLC0415
  from tools import figures  # noqa: PLC0415
  files = []
  for w, rows in ((16, [cell(b, b / 2) for b in (4.0, 8.0)]),
                  (32, [cell(b, b / 2) for b in (16.0, 40.0)]
                   + [cell(10.0, 1000.0, refused="batch 4: seed 0 at the edge"),
                      cell(10.0, 0.01, transient=True)])):
    path = str(tmp_path / f"d{w}_meter.csv")
    figures.write_csv(path, [compact({**r, "width": w}) for r in rows])
    files.append(path)
  out = str(tmp_path / "pooled")
  assert scaling_meter.main(["--from_meter", *files, "--out", out]) == 0
  got = json.load(open(out + "_meter.json"))
  assert (got["cells"], got["of"]) == (4, 6)
  assert got["truth"]["r"] == pytest.approx(1.0) and got["truth"]["n"] == 4
  assert got["truth"]["ratio_median"] == pytest.approx(0.5)
  assert [int(r["width"]) for r in figures.read_csv(out + "_meter.csv")] == [16, 16] + [32] * 4
  assert scaling_meter.main(["--from_meter", str(tmp_path / "none.csv"), "--out", out]) == 2

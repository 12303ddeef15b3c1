"""tools.scaling_compare: the ratio of two labs' estimates per (N, D) with a paired bootstrap
interval (known ratios on synthetic labs), no interval where the replicates are not paired."""
import json

from tools import figures, scaling_compare


def write_lab(path, b_crit: dict, reps: dict, seeds: int = 3) -> str:
  """A lab's CSV {(params, tokens): b_crit} and its _boot.csv {(params, tokens): [values]}."""
  figures.write_csv(str(path) + ".csv", [dict(params=p, tokens=t, b_crit=v, seeds=seeds)
                                         for (p, t), v in b_crit.items()])
  figures.write_csv(str(path) + "_boot.csv", [dict(params=p, tokens=t, replicate=k, b_crit=v)
                                              for (p, t), vs in reps.items()
                                              for k, v in enumerate(vs)])
  return str(path) + ".csv"


def test_paired_ratios_and_their_intervals(tmp_path, capsys):
  cells = [(100, 1000), (100, 2000), (200, 1000)]
  base = {c: [8.0 + k % 5 for k in range(40)] for c in cells}
  b = write_lab(tmp_path / "b", {c: 10.0 for c in cells}, base)
  # twice B in every replicate at D 1,000; the same at D 2,000; one cell only in B
  a = write_lab(tmp_path / "a", {(100, 1000): 20.0, (100, 2000): 10.0},
                {(100, 1000): [2 * v for v in base[(100, 1000)]],
                 (100, 2000): [v * (1 + 0.1 * (k % 3 - 1)) for k, v in
                               enumerate(base[(100, 2000)])]})
  rows = scaling_compare.compare(a, b, ["b_crit"])
  assert [(r["tokens"], r["ratio"]) for r in rows] == [(1000, 2.0), (2000, 1.0)]
  assert rows[0]["lo"] == rows[0]["hi"] == 2.0 and rows[0]["changed"] is True
  assert rows[1]["lo"] < 1 < rows[1]["hi"] and rows[1]["changed"] is False
  assert scaling_compare.main([a, b, "--quantities", "b_crit", "--json",
                               str(tmp_path / "c.json")]) == 0
  out = capsys.readouterr().out
  assert "b_crit N 100 D 1,000: 20 / 10 = 2.00 [2.00, 2.00]: changed" in out
  assert "D 2,000: 10 / 10 = 1.00 [" in out and "no change detected" in out
  assert len(json.load(open(tmp_path / "c.json"))) == 2
  # other seed counts: the replicates do not hold the same seeds, so no interval
  c = write_lab(tmp_path / "c", {(100, 1000): 20.0}, {(100, 1000): base[(100, 1000)]}, seeds=5)
  row, = scaling_compare.compare(c, b, ["b_crit"])
  assert row["ratio"] == 2.0 and row["lo"] is None and row["paired"] is False


def test_a_missing_column_is_one_line(tmp_path, capsys):
  figures.write_csv(str(tmp_path / "x.csv"), [dict(params=1, tokens=2)])
  assert scaling_compare.main([str(tmp_path / "x.csv"), str(tmp_path / "x.csv")]) == 2
  assert "no column 'b_crit'" in capsys.readouterr().err

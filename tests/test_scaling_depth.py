"""The scaling lab's grid over depth (`--depths`): sizes keyed by (width, depth), configs under the
depth parametrization, the same refusal rules as a width's cells; width-only runs read as before."""
import csv
import os

from test_scaling_lab import fake_train_job, lab_args

from experiments import critical_batch_scaling as lab
from experiments import scaling_runs
from tools import figures


def test_a_depth_grid_builds_each_depth_and_keeps_the_cell_rules(tmp_path, monkeypatch, capsys):
  """--depths 1,3 (the config is one layer): every run's config is at its depth under CompleteP
  with base depth 1, in its own workdir (d16_L3/...; a width-only run keeps d16/...); N is the
  real count, larger at depth 3; the cells carry the depth, are fitted where the rates are
  bracketed and refused, naming the size, where they are not. A runs CSV without a depth column
  is read at the config's depth, one with it per (width, depth)."""
  seen = {}
  train = fake_train_job(best=4.0)

  def spy(j):
    m = j["config"]["model"]
    seen[os.path.relpath(j["workdir"], tmp_path / "runs")] = (
        m["num_layers"], m["depth_parametrization"], m["base_depth"], m["parametrization"])
    return train(j)

  monkeypatch.setattr(scaling_runs, "train_job", spy)
  monkeypatch.setattr(figures, "pyplot", lambda: None)  # the lab's figure: not what this checks
  argv = lab_args(tmp_path, "--lr_grid", "0.5,1,2", "--max_extensions", "3", "--depths", "1,3",
                  "--b2_grid", "")
  assert lab.main(argv) == 0
  out = capsys.readouterr().out
  assert seen["d16_L1/b16_lr1_s0"] == (1, "completep", 1, "sp")
  assert seen["d16_L3/b32_lr4_s1"] == (3, "completep", 1, "sp")
  assert {v[0] for k, v in seen.items() if k.startswith("d16_L3/")} == {3} and len(seen) == 40
  assert "d16 b16 +x4" not in out and "d16 L3 b16 +x4" in out and "refused" not in out
  cells = list(csv.DictReader(open(tmp_path / "out" / "lab.csv")))
  assert [(c["width"], c["depth"], c["budget"]) for c in cells] == [
      ("16", "1", "96"), ("16", "1", "128"), ("16", "3", "96"), ("16", "3", "128")]
  n1, n3 = int(cells[0]["non_embedding"]), int(cells[2]["non_embedding"])
  # two more layers of 2,336 (attention 3 x 16 x 16 + 2 x 16 x 8, MLP 3 x 16 x 32, 2 norms)
  assert n3 - n1 == 2 * 2336 and all(float(c["b_crit"]) > 0 and c["refused"] == "" for c in cells)
  # the same rule refuses a depth's cell: rates still at the edge after one extension
  monkeypatch.setattr(scaling_runs, "train_job", fake_train_job(best=16.0))
  (tmp_path / "capped").mkdir()
  assert lab.main(lab_args(tmp_path / "capped", "--lr_grid", "0.5,1,2", "--max_extensions", "1",
                           "--depths", "1,3", "--b2_grid", "")) == 0
  assert "cell d16 L3 D 96: refused (batch 16: seed 0's fastest rate is at the edge" in \
      capsys.readouterr().out
  # reanalysis: with a depth column per (width, depth); without one at the config's depth
  runs = tmp_path / "out" / "lab_runs.csv"
  assert lab.main(lab_args(tmp_path, "--from_runs", str(runs), "--out",
                           str(tmp_path / "re" / "lab"))) == 0
  assert "widths [16], depths [1, 3]" in capsys.readouterr().out
  assert keys(csv.DictReader(open(tmp_path / "re" / "lab.csv"))) == keys(cells)
  rows = list(csv.DictReader(open(runs)))
  flat = tmp_path / "flat_runs.csv"
  with open(flat, "w", newline="") as f:
    w = csv.DictWriter(f, [k for k in rows[0] if k != "depth"], extrasaction="ignore")
    w.writeheader()
    w.writerows(r for r in rows if r["depth"] == "1")
  assert lab.main(lab_args(tmp_path, "--from_runs", str(flat), "--out",
                           str(tmp_path / "flat" / "lab"))) == 0
  flat_cells = list(csv.DictReader(open(tmp_path / "flat" / "lab.csv")))
  assert "depth" not in flat_cells[0] and int(flat_cells[0]["non_embedding"]) == n1
  assert keys(flat_cells) == [{k: v for k, v in c.items() if k != "depth"} for c in keys(cells[:2])]
  # rows of two warmups (a lab of other budgets joined without matching its warmup): refused
  mixed = tmp_path / "mixed_runs.csv"
  with open(mixed, "w", newline="") as f:
    w = csv.DictWriter(f, list(rows[0]))
    w.writeheader()
    w.writerows({**r, "warmup": int(r["warmup"]) * (16 if i == 0 else 1)}
                for i, r in enumerate(rows))
  capsys.readouterr()
  assert lab.main(lab_args(tmp_path, "--from_runs", str(mixed), "--out",
                           str(tmp_path / "mixed" / "lab"))) == 2
  assert "trained with warmups of [" in capsys.readouterr().err


def keys(cells) -> list[dict]:
  return [{k: c[k] for k in ("width", "depth", "params", "non_embedding", "budget", "target",
                             "refused") if k in c} for c in cells]

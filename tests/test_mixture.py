"""Weighted mixtures (data.mixture): parsing, observed token weights, determinism, exact resume on
another process count, per-source evaluation and bits per byte in a real run."""
import dataclasses
import json

import jax
import numpy as np
import pytest

from conftest import tiny_config
from data import mixture, pipeline, prepare
from trainer.config import ConfigError
from trainer.config.checks import validate

A_LEN, B_LEN = 60, 400  # mean document lengths (bytes) of the two sources


@pytest.fixture(scope="module")
def sources(tmp_path_factory):
  """Two byte-level sources whose documents start with 'A' / 'B' and differ in length."""
  root = tmp_path_factory.mktemp("mix")
  rng = np.random.default_rng(0)
  dirs = {}
  for name, mean in (("a", A_LEN), ("b", B_LEN)):
    with open(root / f"{name}.jsonl", "w") as f:
      for i in range(300):
        n = int(rng.integers(mean // 2, 3 * mean // 2))
        f.write(json.dumps({"text": name.upper() * n}) + "\n")
    dirs[name] = prepare.prepare_files(str(root / name), [str(root / f"{name}.jsonl")],
                                       validation_fraction=0.05)
  return dirs


def _spec(sources, weights=(0.7, 0.3), **kw):
  text = ",".join(f"{n}={d}:{w}" for (n, d), w in zip(sorted(sources.items()), weights))
  base = dict(data_dir="", split="train", seq_len=64, rows=4, seed=3,
              mixture=mixture.parse(text))
  base.update(kw)
  return pipeline.StreamSpec(**base)


@pytest.fixture(scope="module")
def extreme(tmp_path_factory):
  """Two byte-level sources whose document lengths differ 10^4-fold: 'a' documents of ~30
  tokens, 'b' documents of ~300,000."""
  root = tmp_path_factory.mktemp("extreme")
  rng = np.random.default_rng(1)
  dirs = {}
  for name, mean, count in (("a", 28, 400), ("b", 300_000, 6)):
    with open(root / f"{name}.jsonl", "w") as f:
      for _ in range(count):
        f.write(json.dumps({"text": name * int(rng.integers(mean // 2, 3 * mean // 2))}) + "\n")
    dirs[name] = prepare.prepare_files(str(root / name), [str(root / f"{name}.jsonl")],
                                       validation_fraction=0.2)
  return dirs


def _token_counts(batches) -> np.ndarray:
  """Tokens of 'a', of 'b' and of neither in the batches' input rows. Each piece of a document
  (segment) is counted whole for the source whose letter it holds, its BOS and EOS included; a
  piece of special tokens alone (a BOS or EOS cut off at a sequence's edge) is neither."""
  counts = np.zeros(3)
  for batch in batches:
    x, seg = batch["inputs"], batch["segment_ids"]
    key = (seg + (seg.max() + 1) * np.arange(len(seg))[:, None]).ravel()  # row and piece
    size = np.bincount(key)
    has = [np.bincount(key, weights=(x == ord(c)).ravel(), minlength=len(size)) > 0
           for c in "ab"]
    assert not (has[0] & has[1]).any()
    counts += [size[has[0]].sum(), size[has[1]].sum(), size[~has[0] & ~has[1]].sum()]
  return counts


def test_parse():
  got = mixture.parse("code=data/a:3, prose=/x/b:1")
  assert got == (mixture.Source("code", "data/a", 0.75), mixture.Source("prose", "/x/b", 0.25))
  for bad in ("data/a:1", "a=data/a", "a=data/a:0", "a=d:1,a=e:1", "a=d:x", "", "a=d:inf"):
    with pytest.raises(mixture.MixtureError, match="data.mixture"):
      mixture.parse(bad)
  # A weight the selection cannot resolve would never be read: refused, not dropped.
  with pytest.raises(mixture.MixtureError, match="'rare' has weight 1e-15 .* never be read"):
    mixture.parse("big=d:1,rare=e:1e-15")
  assert mixture.parse("big=d:1,rare=e:1e-12")[1].weight == pytest.approx(1e-12)


@pytest.mark.parametrize("weights", [(0.9, 0.1), (0.5, 0.5)])
def test_token_shares_are_the_weights_at_extreme_length_ratios(extreme, weights):
  """The tokens that reach the packed rows come from each source in its weight's share, over a
  few thousand sequences, with documents 10^4 times longer in one source than in the other
  (weights of documents rounded per block gave 1.0/0.0 and 0.88/0.12 here)."""
  spec = pipeline.StreamSpec("", "train", 128, 8, seed=1, mixture=mixture.parse(
      f"a={extreme['a']}:{weights[0]},b={extreme['b']}:{weights[1]}"))
  it = iter(pipeline.dataset(spec))
  batches = [next(it) for _ in range(400)]  # 3,200 sequences
  for window in (batches[:125], batches):  # the first 1,000 sequences, and all
    a, b, neither = _token_counts(window)
    total = a + b + neither
    assert neither / total < 0.005
    # Wherever the specials cut off alone belong, a's share is its weight.
    assert weights[0] - 0.01 < a / total and (a + neither) / total < weights[0] + 0.01, \
        (a / total, neither / total)


def test_selection_is_exact_and_a_pure_function_of_the_index():
  """Source counts among the first x sequences are within S - 1 of weight x x at every x (a
  weight of 1e-4 gets its 1 in 10,000 sequences though a block holds 256), each block holds them
  exactly so, and the source of sequence g does not depend on what was asked before."""
  weights = np.array([0.6, 0.3999, 1e-4])
  sel = mixture.MixtureSelection(weights, seed=7)
  xs = np.arange(0, 3_000_000, 997)
  counts = np.array([sel.counts(int(x)) for x in xs])
  assert (counts.sum(1) == xs).all() and (np.diff(counts, axis=0) >= 0).all()
  assert np.abs(counts - xs[:, None] * weights).max() < 2
  assert counts[-1, 2] == pytest.approx(300, abs=2)
  g = np.arange(40 * mixture.BLOCK)
  got = sel(g)
  np.testing.assert_array_equal(np.bincount(got, minlength=3),
                                np.array(sel.counts(len(g))))
  per_block = np.stack([np.bincount(b, minlength=3) for b in got.reshape(40, -1)])
  assert np.abs(per_block - mixture.BLOCK * weights).max() < 2
  shuffled = np.random.default_rng(0).permutation(g)
  np.testing.assert_array_equal(mixture.MixtureSelection(weights, seed=7)(shuffled), got[shuffled])
  assert (mixture.MixtureSelection(weights, seed=8)(g) != got).any()
  halves = mixture.MixtureSelection([0.5, 0.5], seed=7)(g).reshape(40, -1)  # 128 + 128 a block
  assert (halves.sum(1) == 128).all() and len({tuple(b) for b in halves}) == 40  # placed anew
  far = 10**15 + np.arange(mixture.BLOCK)  # far into a run: exact integers, same counts
  assert np.abs(np.bincount(sel(far), minlength=3) - mixture.BLOCK * weights).max() < 2


def test_a_different_seed_gives_a_different_order(sources):
  a = next(iter(pipeline.dataset(_spec(sources))))
  b = next(iter(pipeline.dataset(_spec(sources, seed=4))))
  assert not np.array_equal(a["inputs"], b["inputs"])


def test_every_row_sees_both_sources(sources):
  """The sources are placed by a seeded permutation per block: each row is a mixture."""
  spec = _spec(sources, weights=(0.5, 0.5), rows=10, seq_len=256)
  batches = [b for b, _ in zip(pipeline.dataset(spec),
                               range(20))]
  for r in range(10):
    row = np.concatenate([b["inputs"][r] for b in batches])
    assert (row == ord("A")).any() and (row == ord("B")).any()


@pytest.mark.parametrize("saved_by,restored_by", [(2, 1), (1, 4)])
def test_mixture_resumes_exactly_on_another_process_count(sources, saved_by, restored_by):
  def spec(p, n):
    return _spec(sources, row_ids=tuple(range(p * 4 // n, (p + 1) * 4 // n)))

  saved = []
  for p in range(saved_by):
    it = iter(pipeline.dataset(spec(p, saved_by)))
    for _ in range(9):
      next(it)
    saved.append(json.loads(json.dumps(pipeline.saved_state(it.get_state(), spec(p, saved_by)))))
  whole = iter(pipeline.dataset(spec(0, 1)))
  for _ in range(9):
    next(whole)
  want = [next(whole) for _ in range(2)]
  parts = []
  for p in range(restored_by):
    it = iter(pipeline.dataset(spec(p, restored_by)))
    state, note = pipeline.restored_state(saved, spec(p, restored_by))
    assert note is None
    it.set_state(state)
    parts.append([next(it) for _ in range(2)])
  for step in range(2):
    for key in pipeline.BATCH_KEYS:
      np.testing.assert_array_equal(np.concatenate([p[step][key] for p in parts]),
                                    want[step][key])


def test_each_source_is_read_in_its_own_window_order(sources):
  """Global window g of a mixture is window rank(g) of its source's own order (shuffled with a
  seed of its own): each source's windows are read in sequence, 0, 1, 2, ..., whatever the
  other sources read in between."""
  spec = _spec(sources, weights=(0.5, 0.5), rows=3, seq_len=40, row_ids=(2, 0))
  batches = [b for b, _ in zip(pipeline.dataset(spec), range(30))]
  windows = pipeline.Windows(spec)
  g = np.arange(30)[:, None] * spec.rows + np.asarray(spec.local_rows)[None, :]
  source, rank = windows.selection.rank(g.ravel())
  assert set(source) == {0, 1}
  everything = windows.selection.rank(np.arange(30 * spec.rows))
  for s in (0, 1):  # all of a source's global windows, in order, are its ranks 0, 1, 2, ...
    np.testing.assert_array_equal(everything[1][everything[0] == s],
                                  np.arange(np.sum(everything[0] == s)))
  alone = [pipeline.Windows(dataclasses.replace(spec, data_dir=src.dir, mixture=()))
           for src in spec.mixture]
  for s in (0, 1):  # a source's order in the mixture: its own order, seeded its own way
    assert alone[s].orders[0].seed != windows.orders[s].seed
  for (i, j), s, r in zip(np.ndindex(*g.shape), source, rank):
    order, store = windows.orders[s], windows.tokens[s]
    tokens = np.concatenate([store.read(d, a, b) for d, a, b in order.pieces([r])[0]])
    np.testing.assert_array_equal(batches[i]["inputs"][j], tokens[:-1])


def test_a_changed_mixture_continues_with_one_line(sources):
  spec = _spec(sources)
  saved = pipeline.saved_state({"windows": 12}, spec)
  assert pipeline.restored_state([saved], spec) == ({"windows": 12}, None)
  one = _spec(sources, mixture=mixture.parse(f"a={sources['a']}:1"))
  state, note = pipeline.restored_state([saved], one)
  assert state == {"windows": 12} and "weight 0.7), b (" in note and "-> a (" in note
  swapped = _spec(sources, mixture=mixture.parse(f"b={sources['b']}:0.4,a={sources['a']}:0.6"))
  assert "the data order changes from window 12" in pipeline.restored_state([saved], swapped)[1]


def test_a_missing_source_is_named_by_its_entry(sources, tmp_path):
  spec = _spec(sources, mixture=mixture.parse(f"a={sources['a']}:1,gone={tmp_path}:1"))
  with pytest.raises(mixture.MixtureError,
                     match=f"^data.mixture entry gone={tmp_path} has no meta.json; prepare it "
                           f"with `python -m data.prepare --out {tmp_path} FILES...`$"):
    pipeline.dataset(spec)


def test_mixture_config_errors(sources, tmp_path):
  def check(**kw):
    validate(tiny_config(**kw), 8)

  with pytest.raises(ConfigError, match="both set"):
    check(**{"data.dir": sources["a"], "data.mixture": f"a={sources['a']}:1"})
  with pytest.raises(ConfigError, match=f"data.mixture entry b={tmp_path} has no meta.json"):
    check(**{"data.mixture": f"a={sources['a']}:1,b={tmp_path}:1"})
  with pytest.raises(ConfigError, match="model.vocab_size=100 is smaller than the 259"):
    check(**{"data.dir": sources["a"], "model.vocab_size": 100})
  cfg = tiny_config(**{"data.mixture": f"a={sources['a']}:1", "model.vocab_size": 0})
  validate(cfg, 8)
  assert cfg.model.vocab_size == 384  # 259 byte ids padded to a multiple of 128


def test_run_on_a_mixture_reports_each_source(sources, tmp_path):
  """A real run with model.vocab_size=0 on a mixture logs eval_loss/NAME and bits per byte."""
  from trainer.run.loop import Run  # noqa: PLC0415
  cfg = tiny_config(**{"data.mixture": f"a={sources['a']}:0.5,b={sources['b']}:0.5",
                       "model.vocab_size": 0, "steps": 2, "eval_every": 2, "eval_sequences": 4})
  validate(cfg, jax.devices())
  Run(cfg, str(tmp_path / "run")).train()
  rows = [json.loads(line) for line in open(tmp_path / "run" / "metrics.jsonl")]
  ev = [r for r in rows if "eval_loss" in r][-1]
  for key in ("eval_loss/a", "eval_loss/b", "eval_bpb/a", "eval_bpb/b", "eval_bpb"):
    assert np.isfinite(ev[key]), key
  assert ev["eval_loss"] == pytest.approx(0.5 * ev["eval_loss/a"] + 0.5 * ev["eval_loss/b"])
  for name in ("a", "b"):  # bits per byte: nats / ln 2 x predicted tokens per byte
    v = prepare.read_meta(sources[name])["splits"]["validation"]
    assert ev[f"eval_bpb/{name}"] == pytest.approx(
        ev[f"eval_loss/{name}"] / np.log(2) * v["targets"] / v["bytes"])


@pytest.mark.slow
def test_mixture_run_resumes_exactly_from_two_processes_on_one(sources, tmp_path):
  """Real processes: a mixture run saved by 2 processes x 4 devices continues on 1 process x 8
  devices with the same losses as an uninterrupted single-process run."""
  from conftest import losses  # noqa: PLC0415
  from test_multihost import MODEL_ARGS, launch_beside_reference, run_single  # noqa: PLC0415

  args = MODEL_ARGS + [f"--config.data.mixture=a={sources['a']}:0.6,b={sources['b']}:0.4",
                       "--config.model.vocab_size=0"]
  multi, single = tmp_path / "multi", tmp_path / "single"
  launch_beside_reference(multi, single, args + ["--config.steps=2"], args + ["--config.steps=4"])
  alone = run_single(multi, args + ["--config.steps=4"])
  assert "checkpoints/2" in alone.stdout
  got, want = losses(multi), losses(single)
  assert sorted(got) == sorted(want) == [1, 2, 3, 4]
  np.testing.assert_allclose([got[s] for s in range(1, 5)], [want[s] for s in range(1, 5)],
                             rtol=1e-5)

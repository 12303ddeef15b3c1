"""Weighted mixtures (data.mixture): parsing, observed token weights, determinism, exact resume on
another process count, per-source evaluation and bits per byte in a real run."""
import json

import jax
import numpy as np
import pytest

from conftest import tiny_config
from data import mixture, pipeline, prepare
from trainer.config import ConfigError
from trainer.config_checks import validate

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


def test_parse():
  got = mixture.parse("code=data/a:3, prose=/x/b:1")
  assert got == (mixture.Source("code", "data/a", 0.75), mixture.Source("prose", "/x/b", 0.25))
  for bad in ("data/a:1", "a=data/a", "a=data/a:0", "a=d:1,a=e:1", "a=d:x", ""):
    with pytest.raises(mixture.MixtureError, match="data.mixture"):
      mixture.parse(bad)


def test_token_weights_are_observed_within_sampling_error(sources):
  """Over many documents, the fraction of *tokens* from each source is its weight (documents
  of b are ~7x longer, so b's document share is much smaller than its token share)."""
  docs = pipeline._mixed(_spec(sources))
  tokens = {"A": 0, "B": 0}
  n_docs = {"A": 0, "B": 0}
  for i in range(20_000):
    ids = docs[i]
    src = chr(ids[1])
    tokens[src] += len(ids)
    n_docs[src] += 1
  frac = tokens["A"] / (tokens["A"] + tokens["B"])
  assert abs(frac - 0.7) < 0.02, (frac, tokens)
  assert n_docs["A"] / 20_000 > 0.9  # the document share is far from the token share
  # A single source has the whole stream; a different seed a different order.
  other = pipeline._mixed(_spec(sources, seed=4))
  assert any(not np.array_equal(docs[i], other[i]) for i in range(50))


def test_every_row_sees_both_sources(sources):
  """Rows read strided elements; the seeded permutation keeps each row a mixture."""
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

  shards = []
  for p in range(saved_by):
    it = iter(pipeline.dataset(spec(p, saved_by)))
    for _ in range(9):
      next(it)
    shards.append(json.loads(json.dumps(pipeline.shard_state(it.get_state(), spec(p, saved_by)))))
  whole = iter(pipeline.dataset(spec(0, 1)))
  for _ in range(9):
    next(whole)
  want = [next(whole) for _ in range(2)]
  parts = []
  for p in range(restored_by):
    it = iter(pipeline.dataset(spec(p, restored_by)))
    it.set_state(pipeline.state_from_shards(shards, spec(p, restored_by)))
    parts.append([next(it) for _ in range(2)])
  for step in range(2):
    for key in pipeline.BATCH_KEYS:
      np.testing.assert_array_equal(np.concatenate([p[step][key] for p in parts]),
                                    want[step][key])


def test_mixture_config_errors(sources, tmp_path):
  def check(**kw):
    validate(tiny_config(**kw), 8)

  with pytest.raises(ConfigError, match="both set"):
    check(**{"data.dir": sources["a"], "data.mixture": f"a={sources['a']}:1"})
  with pytest.raises(ConfigError, match="no meta.json"):
    check(**{"data.mixture": f"a={sources['a']}:1,b={tmp_path}:1"})
  with pytest.raises(ConfigError, match="model.vocab_size=100 is smaller than the 259"):
    check(**{"data.dir": sources["a"], "model.vocab_size": 100})
  cfg = tiny_config(**{"data.mixture": f"a={sources['a']}:1", "model.vocab_size": 0})
  validate(cfg, 8)
  assert cfg.model.vocab_size == 384  # 259 byte ids padded to a multiple of 128


def test_run_on_a_mixture_reports_each_source(sources, tmp_path):
  """A real run with model.vocab_size=0 on a mixture logs eval_loss/NAME and bits per byte."""
  from trainer.loop import Run  # noqa: PLC0415
  cfg = tiny_config(**{"data.mixture": f"a={sources['a']}:0.5,b={sources['b']}:0.5",
                       "model.vocab_size": 0, "steps": 2, "eval_every": 2, "eval_steps": 1})
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

"""The data pipeline: determinism, document isolation, exact resume, process sharding."""
import json
import os

import numpy as np
import pytest

from data import corpus, pipeline, prepare, tokenizer


def _spec(data_dir, **kw):
  base = dict(data_dir=data_dir, split="train", seq_len=64, rows=4, seed=3)
  base.update(kw)
  return pipeline.StreamSpec(**base)


def _take(it, n):
  return [next(it) for _ in range(n)]


def _equal(a, b):
  return all(np.array_equal(x[k], y[k]) for x, y in zip(a, b) for k in pipeline.BATCH_KEYS)


def test_tokenizer_round_trip():
  text = "def f(x):\n    return 'héllo ✓'\n"
  ids = tokenizer.encode(text)
  assert ids[0] == tokenizer.BOS_ID and ids[-1] == tokenizer.EOS_ID
  assert tokenizer.decode(ids) == text
  assert ids.max() < tokenizer.VOCAB_SIZE


def test_corpus_is_stdlib_without_tests(data_dir):
  files = corpus.stdlib_files()
  assert files == sorted(files) and len(files) > 100
  assert not any(part in ("test", "tests", "site-packages")
                 for f in files for part in f.split(os.sep))
  splits = {corpus.split_of(f) for f in files}
  assert splits == {"train", "validation"}
  meta = prepare.read_meta(data_dir)
  assert meta["source"]["fingerprint"] == corpus.describe()["fingerprint"]
  assert meta["splits"]["validation"]["documents"] > 0


def test_deterministic_for_a_seed(data_dir):
  a = _take(iter(pipeline.dataset(_spec(data_dir))), 5)
  b = _take(iter(pipeline.dataset(_spec(data_dir))), 5)
  c = _take(iter(pipeline.dataset(_spec(data_dir, seed=4))), 5)
  assert _equal(a, b)
  assert not _equal(a, c)


def test_batches_are_shifted_and_packed(data_dir):
  batch = next(iter(pipeline.dataset(_spec(data_dir))))
  for key in pipeline.BATCH_KEYS:
    assert batch[key].shape == (4, 64)
  # targets are the inputs shifted by one inside each row
  np.testing.assert_array_equal(batch["targets"][:, :-1], batch["inputs"][:, 1:])


def test_documents_never_mix(data_dir):
  """Positions restart at each new segment; no target crosses a document boundary."""
  it = iter(pipeline.dataset(_spec(data_dir, seq_len=256)))
  saw_boundary = False
  for _ in range(20):
    b = next(it)
    seg, pos, mask = b["segment_ids"], b["positions"], b["loss_mask"]
    for r in range(seg.shape[0]):
      starts = np.nonzero(np.diff(seg[r]))[0] + 1
      for s in starts:
        saw_boundary = True
        if seg[r, s] > 0:
          assert pos[r, s] == 0, "positions must restart in a new document"
        assert not mask[r, s - 1], "the token before a boundary must not predict across it"
      # inside a segment, positions count up by one
      same = seg[r, 1:] == seg[r, :-1]
      assert np.all(np.diff(pos[r])[same] == 1)
    assert not np.any(mask & (seg == 0))
    bos_targets = b["targets"] == tokenizer.BOS_ID
    assert not np.any(mask & bos_targets), "a BOS target belongs to the next document"
  assert saw_boundary


def test_rows_are_their_documents_back_to_back(tmp_path):
  """Row r packs the shuffled documents r, r + rows, r + 2 rows, ... back to back into sequences
  of seq_len + 1 tokens (the packer's numpy path against a plain per-token reference): segment
  ids count the pieces of a sequence from 1, positions restart at 0 in each piece."""
  rng = np.random.default_rng(1)
  with open(tmp_path / "d.jsonl", "w") as f:
    for _ in range(300):  # short and long documents: several per row, and some split twice
      f.write(json.dumps({"text": "b" * int(rng.choice([3, 3, 20, 150]))}) + "\n")
  out = prepare.prepare_files(str(tmp_path / "p"), [str(tmp_path / "d.jsonl")])
  spec = pipeline.StreamSpec(out, "train", 48, 3, seed=5, row_ids=(2, 0))
  docs = pipeline._shuffled(out, "train", 5, True)
  got = _take(iter(pipeline.dataset(spec)), 6)
  for j, r in enumerate(spec.local_rows):
    stream = []  # (token, which document, position in the document), documents back to back
    k = 0
    while len(stream) < 6 * 49:
      stream += [(t, k, p) for p, t in enumerate(docs[r + k * spec.rows])]
      k += 1
    tokens, segments, positions = [], [], []
    for n in range(6):
      seq = stream[n * 49:(n + 1) * 49]
      doc_ids = sorted({d for _, d, _ in seq})
      start = {d: min(p for _, e, p in seq if e == d) for d in doc_ids}
      tokens += [t for t, _, _ in seq]
      segments += [doc_ids.index(d) + 1 for _, d, _ in seq]
      positions += [p - start[d] for _, d, p in seq]
    seqs = lambda xs: np.asarray(xs[:6 * 49]).reshape(6, 49)
    tok, seg, pos = seqs(tokens), seqs(segments), seqs(positions)
    for step, batch in enumerate(got):
      np.testing.assert_array_equal(batch["inputs"][j], tok[step, :-1])
      np.testing.assert_array_equal(batch["targets"][j], tok[step, 1:])
      np.testing.assert_array_equal(batch["segment_ids"][j], seg[step, :-1])
      np.testing.assert_array_equal(batch["positions"][j], pos[step, :-1])
      np.testing.assert_array_equal(batch["loss_mask"][j], seg[step, 1:] == seg[step, :-1])
  assert max(b["segment_ids"].max() for b in got) > 2  # several documents in a sequence


def test_a_state_of_the_earlier_packer_is_refused_in_one_line(data_dir):
  spec = _spec(data_dir)
  old = {"rows": [0, 1, 2, 3], "total_rows": 4, "row_states": [
      {"parent_state": {"next_index": 3}, "remainder_slices": {"tokens": [-1, -1]},
       "elements_from_buffer_after_checkpoint": 0}] * 4}
  with pytest.raises(prepare.DataError, match="earlier per-row grain packer"):
    pipeline.state_from_shards([old], spec)


def test_resume_from_iterator_state_gives_the_next_batch(data_dir):
  spec = _spec(data_dir, prefetch=2)
  it = iter(pipeline.dataset(spec))
  _take(it, 37)
  state = json.loads(json.dumps(it.get_state()))  # what the checkpoint stores: plain JSON
  want = _take(it, 3)
  it2 = iter(pipeline.dataset(spec))
  it2.set_state(state)
  assert _equal(_take(it2, 3), want)


def test_process_shards_reassemble_the_global_batch(data_dir):
  """Two processes' rows, stacked, are exactly the single-process global batch."""
  whole = _take(iter(pipeline.dataset(_spec(data_dir))), 3)
  parts = [_take(iter(pipeline.dataset(_spec(data_dir, row_ids=rows))), 3)
           for rows in ((0, 1), (2, 3))]
  for step in range(3):
    for key in pipeline.BATCH_KEYS:
      np.testing.assert_array_equal(
          np.concatenate([parts[0][step][key], parts[1][step][key]]), whole[step][key])


@pytest.mark.parametrize("saved_by,restored_by", [(2, 1), (1, 4), (4, 2)])
def test_iterator_state_moves_between_process_counts(data_dir, saved_by, restored_by):
  """States saved by N processes restore on M processes at exactly the next global batch."""
  def spec(p, n):  # process p of n reads a contiguous block of the 4 rows
    return _spec(data_dir, rows=4, row_ids=tuple(range(p * 4 // n, (p + 1) * 4 // n)))

  shards = []
  for p in range(saved_by):
    it = iter(pipeline.dataset(spec(p, saved_by)))
    _take(it, 7)
    shards.append(json.loads(json.dumps(pipeline.shard_state(it.get_state(), spec(p, saved_by)))))
  whole = iter(pipeline.dataset(spec(0, 1)))
  _take(whole, 7)
  want = next(whole)
  parts = []
  for p in range(restored_by):
    it = iter(pipeline.dataset(spec(p, restored_by)))
    it.set_state(pipeline.state_from_shards(shards, spec(p, restored_by)))
    parts.append(next(it))
  for key in pipeline.BATCH_KEYS:
    np.testing.assert_array_equal(np.concatenate([b[key] for b in parts]), want[key])


def test_prepare_user_files(tmp_path):
  (tmp_path / "a.txt").write_text("alpha " * 50)
  with open(tmp_path / "b.jsonl", "w") as f:
    for i in range(40):
      f.write(json.dumps({"text": f"document number {i} " * 5}) + "\n")
  out = prepare.prepare_files(str(tmp_path / "prepared"), [str(tmp_path)],
                              validation_fraction=0.1)
  meta = prepare.read_meta(out)
  assert meta["splits"]["train"]["documents"] + meta["splits"]["validation"]["documents"] == 41
  batch = next(iter(pipeline.dataset(pipeline.StreamSpec(out, "train", 16, 2))))
  assert batch["inputs"].shape == (2, 16)


def test_missing_data_dir_is_a_clear_error(tmp_path):
  with pytest.raises(prepare.DataError, match="no meta.json"):
    pipeline.dataset(pipeline.StreamSpec(str(tmp_path), "train", 16, 2))


def test_rows_follow_the_sharding_in_any_device_order(data_dir, devices):
  """A process reads the rows its devices hold, whatever the mesh's device order: with the
  devices shuffled, `process_rows` and `assemble` still give the single-process batch."""
  import jax  # noqa: PLC0415
  from jax.sharding import Mesh, NamedSharding  # noqa: PLC0415
  from jax.sharding import PartitionSpec as P  # noqa: PLC0415

  from sharding import assemble, process_rows  # noqa: PLC0415
  from sharding.batch import _assemble_per_device  # noqa: PLC0415

  order = np.random.default_rng(0).permutation(8)
  mesh = Mesh(np.array(jax.devices())[order].reshape(4, 2), ("data", "tensor"))
  sharding = NamedSharding(mesh, P("data", None))
  shape = (8, 64)
  rows = process_rows(sharding, shape)
  assert rows == tuple(range(8))  # one process holds every row
  batch = next(iter(pipeline.dataset(_spec(data_dir, rows=8))))
  # Feed the rows in reverse: `assemble` places each row by its global index.
  reverse = tuple(reversed(rows))
  got = assemble(batch["inputs"][list(reverse)], reverse, sharding, shape)
  # The device-by-device path (for shardings jax.make_array_from_process_local_data refuses).
  by_device = _assemble_per_device(batch["inputs"][list(reverse)], reverse, sharding, shape, 0)
  for array in (got, by_device):
    np.testing.assert_array_equal(np.asarray(array), batch["inputs"])
    for device, index in sharding.addressable_devices_indices_map(shape).items():
      shard = next(s for s in array.addressable_shards if s.device == device)
      np.testing.assert_array_equal(np.asarray(shard.data), batch["inputs"][index])
  with pytest.raises(ValueError, match="one process holds every row"):
    assemble(batch["inputs"][:4], rows[:4], sharding, shape)


def test_resume_at_an_exact_document_boundary(tmp_path):
  """A checkpoint taken where a document ended exactly at a sequence boundary (the row's offset
  is 0 in its next document, which it has not read yet) restores the next batch exactly."""
  rng = np.random.default_rng(0)
  with open(tmp_path / "d.jsonl", "w") as f:
    for _ in range(600):
      f.write(json.dumps({"text": "A" * int(rng.integers(30, 90))}) + "\n")
  out = prepare.prepare_files(str(tmp_path / "p"), [str(tmp_path / "d.jsonl")])
  found = 0
  for seed in range(40):
    spec = pipeline.StreamSpec(out, "train", 64, 4, seed=seed)
    it = iter(pipeline.dataset(spec))
    _take(it, 9)
    shard = json.loads(json.dumps(pipeline.shard_state(it.get_state(), spec)))
    if not any(s["offset"] == 0 for s in shard["row_states"]):
      continue
    found += 1
    want = _take(it, 2)
    it2 = iter(pipeline.dataset(spec))
    it2.set_state(pipeline.state_from_shards([shard], spec))
    assert _equal(_take(it2, 2), want), seed
  assert found >= 2  # the data has such boundaries

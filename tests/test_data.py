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


def test_windows_are_the_epochs_packed_documents_permuted(tmp_path):
  """Epoch e packs the documents in its shuffled order back to back and cuts the stream into
  windows of seq_len + 1 tokens; the epoch's K global indices read each window exactly once (a
  permutation), and the batches are those windows (a plain per-token reference): segment ids
  count the pieces of a window from 1, positions restart at 0 in each piece."""
  rng = np.random.default_rng(1)
  with open(tmp_path / "d.jsonl", "w") as f:
    for _ in range(300):  # short and long documents: several per window, and some split twice
      f.write(json.dumps({"text": "b" * int(rng.choice([3, 3, 20, 150]))}) + "\n")
  out = prepare.prepare_files(str(tmp_path / "p"), [str(tmp_path / "d.jsonl")])
  seq_len, rows = 48, 3
  spec = pipeline.StreamSpec(out, "train", seq_len, rows, seed=5, row_ids=(2, 0))
  windows = pipeline.Windows(spec)
  order, store = windows.orders[0], windows.tokens[0]
  k = order.per_epoch
  assert k == int(store.lengths.sum()) // (seq_len + 1)
  streams = []
  for epoch in range(2):
    docs, _ = order.epoch(epoch)
    assert sorted(docs) == list(range(len(store)))  # every document once per epoch
    streams.append([(t, d, p) for d in docs for p, t in enumerate(store.document(d))])
    read = sorted(order.window_of(g)[1] for g in range(epoch * k, (epoch + 1) * k))
    assert read == list(range(k))  # a permutation of the epoch's windows
  assert order.epoch(0)[0].tolist() != order.epoch(1)[0].tolist()  # reshuffled per epoch
  steps = k // rows + 2  # into the second epoch
  got = _take(iter(pipeline.dataset(spec)), steps)
  for step, batch in enumerate(got):
    for j, r in enumerate(spec.local_rows):
      e, w = order.window_of(step * rows + r)
      seq = streams[e][w * (seq_len + 1):(w + 1) * (seq_len + 1)]
      doc_ids = list(dict.fromkeys(d for _, d, _ in seq))
      start = {d: min(p for _, e_, p in seq if e_ == d) for d in doc_ids}
      tok = np.array([t for t, _, _ in seq])
      seg = np.array([doc_ids.index(d) + 1 for _, d, _ in seq])
      pos = np.array([p - start[d] for _, d, p in seq])
      np.testing.assert_array_equal(batch["inputs"][j], tok[:-1])
      np.testing.assert_array_equal(batch["targets"][j], tok[1:])
      np.testing.assert_array_equal(batch["segment_ids"][j], seg[:-1])
      np.testing.assert_array_equal(batch["positions"][j], pos[:-1])
      np.testing.assert_array_equal(batch["loss_mask"][j], seg[1:] == seg[:-1])
  assert max(b["segment_ids"].max() for b in got) > 2  # several documents in a sequence


@pytest.mark.parametrize("micro", [1, 4, 8])
def test_micro_batches_only_split_the_windows_of_a_step(data_dir, micro):
  """A step of 16 sequences holds the same windows in the same order whatever the micro-batch:
  consecutive micro-batches of `micro` rows are the rows of one 16-row micro-batch."""
  whole = _take(iter(pipeline.dataset(_spec(data_dir, rows=16))), 3)
  parts = _take(iter(pipeline.dataset(_spec(data_dir, rows=micro))), 3 * 16 // micro)
  for step in range(3):
    for key in pipeline.BATCH_KEYS:
      got = np.concatenate([b[key] for b in parts[step * 16 // micro:(step + 1) * 16 // micro]])
      np.testing.assert_array_equal(got, whole[step][key])


def _documents_per_step(order, batch: int, steps: int) -> list[set[int]]:
  return [{doc for row in order.pieces(range(t * batch, (t + 1) * batch)) for doc, _, _ in row}
          for t in range(steps)]


@pytest.mark.parametrize("batch", [8, 32, 128])
def test_a_step_holds_as_many_documents_as_independent_draws(data_dir, batch):
  """On the embedded corpus (701 documents of very unequal length) the distinct documents of a
  step of B windows match B independent uniform draws of a window: the sum over documents of
  1 - (1 - p_d)^B, p_d the chance a window touches document d. (The per-row streams read 8.0,
  8.2 and 8.7 documents here at batches 8, 32 and 128: the next chunks of the same documents.)"""
  order = pipeline.Windows(_spec(data_dir, seq_len=64, seed=0)).orders[0]
  steps = 3000 // batch
  counts = np.array([len(s) for s in _documents_per_step(order, batch, steps)])
  p = np.minimum((order.lengths + order.width - 1) / order.tokens, 1.0)
  expected = float(np.sum(1 - (1 - p) ** batch))
  error = counts.std() / np.sqrt(steps)
  assert abs(counts.mean() - expected) < 4 * error + 0.02 * expected, (counts.mean(), expected)


def test_windows_of_a_step_are_no_more_alike_than_windows_of_two_steps(data_dir):
  """Two windows of the same step share a document no more often than a window of step t and
  one of step t + 1 (the per-row streams: many times more often)."""
  order = pipeline.Windows(_spec(data_dir, seq_len=64, seed=2)).orders[0]
  batch, steps = 16, 150
  docs = [[{d for d, _, _ in row} for row in order.pieces(range(t * batch, (t + 1) * batch))]
          for t in range(steps)]
  within = [bool(a & b) for t in range(steps) for i, a in enumerate(docs[t])
            for b in docs[t][i + 1:]]
  across = [bool(a & b) for t in range(steps - 1) for a in docs[t] for b in docs[t + 1]]
  p_within, p_across = np.mean(within), np.mean(across)
  sigma = np.sqrt(p_across * (1 - p_across) / len(within))
  assert p_within < p_across + 4 * sigma, (p_within, p_across)


def test_a_state_of_the_earlier_row_streams_continues_with_one_line(data_dir):
  spec = _spec(data_dir)
  old = {"rows": [0, 1, 2, 3], "total_rows": 4, "row_states": [{"doc": 3, "offset": 5}] * 4}
  with pytest.raises(prepare.DataError, match="earlier per-row reader"):
    pipeline.restored_state([old], spec)
  state, note = pipeline.restored_state([old], spec, windows_before=96)
  assert state == {"windows": 96} and "continuing at window 96" in note


def test_resume_from_iterator_state_gives_the_next_batch(data_dir):
  spec = _spec(data_dir, prefetch=2)
  it = iter(pipeline.dataset(spec))
  _take(it, 37)
  saved = json.loads(json.dumps(pipeline.saved_state(it.get_state(), spec)))  # plain JSON
  assert saved["windows"] == 37 * 4
  want = _take(it, 3)
  it2 = iter(pipeline.dataset(spec))
  state, note = pipeline.restored_state([saved], spec)
  assert note is None
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


@pytest.mark.parametrize("saved_by,restored_by,rows", [(2, 1, 4), (1, 4, 4), (4, 2, 8),
                                                        (2, 2, 2)])
def test_iterator_state_moves_between_processes_and_micro_batches(data_dir, saved_by,
                                                                  restored_by, rows):
  """A state saved by N processes reading micro-batches of 4 rows restores on M processes
  reading micro-batches of `rows` at exactly the next windows."""
  def spec(p, n, r):  # process p of n reads a contiguous block of the r rows
    return _spec(data_dir, rows=r, row_ids=tuple(range(p * r // n, (p + 1) * r // n)))

  saved = []
  for p in range(saved_by):
    it = iter(pipeline.dataset(spec(p, saved_by, 4)))
    _take(it, 8)
    saved.append(json.loads(json.dumps(
        pipeline.saved_state(it.get_state(), spec(p, saved_by, 4)))))
  whole = iter(pipeline.dataset(spec(0, 1, 8)))
  _take(whole, 4)
  want = next(whole)  # windows 32 .. 39
  got = []  # micro-batch m, process p -> its rows
  for m in range(8 // rows):
    for p in range(restored_by):
      it = iter(pipeline.dataset(spec(p, restored_by, rows)))
      it.set_state(pipeline.restored_state(saved, spec(p, restored_by, rows))[0])
      got.append(_take(it, m + 1)[-1])
  for key in pipeline.BATCH_KEYS:
    np.testing.assert_array_equal(np.concatenate([b[key] for b in got]), want[key])


def test_resume_on_other_data_or_seed(tmp_path, data_dir):
  """Another tokenizer is refused in one line; another seed or dataset continues from the same
  position with one line saying what changed."""
  spec = _spec(data_dir)
  saved = pipeline.saved_state({"windows": 40}, spec)
  state, note = pipeline.restored_state([saved], _spec(data_dir, seed=9))
  assert state == {"windows": 40} and "seed 3 -> 9" in note
  (tmp_path / "a.txt").write_text("some other text " * 400)
  other = prepare.prepare_files(str(tmp_path / "other"), [str(tmp_path / "a.txt")])
  state, note = pipeline.restored_state([saved], _spec(other))
  assert state == {"windows": 40} and "from window 40" in note and "1 documents" in note
  bpe = prepare.prepare_files(str(tmp_path / "bpe"), [str(tmp_path / "a.txt")],
                              tokenizer="bpe:300")
  with pytest.raises(prepare.DataError, match="tokenized by byte/-/vocab 259; this run's data "
                     "uses hf/"):
    pipeline.restored_state([saved], _spec(bpe))


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


@pytest.mark.parametrize("n", [1, 2, 3, 7, 64, 1000, 4097])
def test_the_window_permutation_is_a_seeded_bijection(n):
  """`permute` maps [0, n) onto itself one to one, index by index or all at once, and another
  seed gives another order (a Feistel network walked back into range)."""
  from data.windows import permute  # noqa: PLC0415
  whole = permute(np.arange(n), n, seed=11)
  assert sorted(whole.tolist()) == list(range(n))
  assert [int(permute([i], n, seed=11)[0]) for i in range(min(n, 50))] == whole[:50].tolist()
  if n >= 64:
    other = permute(np.arange(n), n, seed=12)
    assert np.mean(other == whole) < 0.05
    assert abs(np.corrcoef(np.arange(n - 1), np.diff(whole))[0, 1]) < 0.2  # no drift

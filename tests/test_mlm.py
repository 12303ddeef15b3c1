"""The masked-LM workload (docs/mlm.md): BERT's masking in the data path (rate, 80/10/10 split,
draws keyed by the order's seed and each sequence's global index), the encoder's bidirectional
attention, and runs whose losses do not depend on micro-batches or devices, reporting
eval_masked_accuracy."""
import dataclasses
import functools
import subprocess
import sys
import types

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from flax import nnx
from test_data_order import ARGS, _rows, _run, _same
from test_multihost import ROOT, child_env

import train
from data.masking import Masking
from models.config import ModelConfig
from models.decode import Generator
from models.hf import ConvertError, hf_config_from_model
from models.llama import Transformer
from sharding import make_mesh
from trainer.evaluation.periodic import unigram_accuracy

MASKING = Masking(rate=0.15, mask_id=259, vocab=259)
MLM = {"model.causal": False, "data.mask_rate": 0.15}


def _train_py(workdir, devices: int, *args, config="configs/mlm_tiny.py", rc=0):
  """train.py on `config` with the test model's sizes (test_data_order's ARGS) in a process of
  `devices` CPU devices; the finished process."""
  proc = subprocess.run([sys.executable, "train.py", "--config", config, "--workdir",
                         str(workdir), *ARGS, *args], cwd=ROOT, env=child_env(devices),
                        capture_output=True, text=True, timeout=600)
  assert proc.returncode == rc, proc.stdout[-2000:] + proc.stderr[-2000:]
  return proc


def _rows_of(indices, seed: int, length: int = 128, masking: Masking = MASKING) -> dict:
  """Masked rows of the sequences at global `indices`: documents of random tokens below [MASK]
  drawn from their index (each row one document, the last quarter of every row padding)."""
  tokens = np.stack([np.random.default_rng(abs(g)).integers(0, masking.vocab, length)
                     for g in indices]).astype(np.int32)
  segments = np.ones_like(tokens)
  segments[:, 3 * length // 4:] = 0
  batch = {"inputs": tokens, "targets": np.roll(tokens, -1, 1), "positions": tokens * 0,
           "segment_ids": segments, "loss_mask": segments > 0}
  return masking.apply(batch, indices, seed)


def test_masking_rate_and_replacement_split():
  out = _rows_of(np.arange(2000), seed=0)
  real = out["segment_ids"] > 0
  selected = out["loss_mask"]
  assert not np.any(selected & ~real)  # padding is never selected
  assert abs(selected.sum() / real.sum() - 0.15) < 0.003  # 192k real tokens: sd 0.0008
  shown, original = out["inputs"][selected], out["targets"][selected]
  np.testing.assert_array_equal(out["inputs"][~selected], out["targets"][~selected])
  as_mask = np.mean(shown == MASKING.mask_id)
  unchanged = np.mean(shown == original)  # includes random draws that hit the original
  assert abs(as_mask - 0.8) < 0.01
  assert abs(unchanged - (0.1 + 0.1 / MASKING.vocab)) < 0.01
  assert abs(1 - as_mask - unchanged - 0.1 * (1 - 1 / MASKING.vocab)) < 0.01
  assert np.all(shown < MASKING.vocab + 1) and np.all(out["targets"] < MASKING.vocab)


def test_the_unigram_baseline_is_the_most_frequent_masked_target():
  batches = [{"targets": np.array([[5, 5, 7, 9]]), "loss_mask": np.array([[1, 0, 1, 1]], bool)},
             {"targets": np.array([[7, 1, 1, 1]]), "loss_mask": np.array([[1, 1, 0, 0]], bool)}]
  assert unigram_accuracy(batches) == 2 / 5  # 7 twice among 5, 5 and 1 once each


def test_masks_are_keyed_by_seed_and_global_index_only():
  a = _rows_of([5, 6, 7], seed=3)
  # the same sequence read in another row of another micro-batch: the same mask
  b = _rows_of([40, 7], seed=3)
  np.testing.assert_array_equal(a["loss_mask"][2], b["loss_mask"][1])
  np.testing.assert_array_equal(a["inputs"][2], b["inputs"][1])
  for key in ("inputs", "loss_mask"):
    np.testing.assert_array_equal(_rows_of([5, 6, 7], seed=3)[key], a[key])
  assert not np.array_equal(_rows_of([5, 6, 7], seed=4)["loss_mask"], a["loss_mask"])
  assert not np.array_equal(a["loss_mask"][0], a["loss_mask"][1])  # another index
  padding = _rows_of([-1, 5], seed=3)
  assert not padding["loss_mask"][0].any()
  np.testing.assert_array_equal(padding["loss_mask"][1], a["loss_mask"][0])


def test_the_encoder_sees_the_future_and_the_decoder_does_not():
  """Changing the last token changes the first position's logits only without causality; the
  encoder's masked sums (loss, tokens, right) are those of its logits at the masked positions."""
  cfg = ModelConfig(vocab_size=64, d_model=32, num_layers=1, num_heads=2, num_kv_heads=1,
                    mlp_dim=32)
  tokens = jnp.arange(16, dtype=jnp.int32)[None] % 64
  both = jnp.concatenate([tokens, tokens.at[0, -1].set(63)])  # the last token changed
  mask = (jnp.arange(16) % 3 == 0)[None].repeat(2, 0)
  positions, segments = jnp.broadcast_to(jnp.arange(16), both.shape), jnp.ones_like(both)

  @functools.partial(jax.jit, static_argnums=2)
  def run(t, targets, c):
    model = Transformer(c, rngs=nnx.Rngs(0))
    return model(t), model.masked_sums(t, positions, segments, targets, mask)

  for causal in (True, False):
    c = dataclasses.replace(cfg, causal=causal)
    logits, sums = run(both, both, c)
    moved = float(jnp.max(jnp.abs(logits[0, 0] - logits[1, 0])))
    assert (moved > 1e-4) == (not causal), (causal, moved)
  # targets the model predicts at even positions and misses at odd ones
  best = np.asarray(logits).argmax(-1)
  targets = np.where(np.arange(16) % 2 == 0, best, (best + 1) % 64)
  logits, sums = (np.asarray(x) for x in run(both, targets, c))
  mask = np.asarray(mask)
  logp = logits - np.log(np.exp(logits).sum(-1, keepdims=True))
  nll = -np.take_along_axis(logp, targets[..., None], -1)[..., 0]
  right = (logits.argmax(-1) == targets) & mask
  assert 0 < right.sum() < mask.sum()
  np.testing.assert_allclose(sums, [nll[mask].sum(), mask.sum(), right.sum()], rtol=1e-5)


def test_masked_lm_losses_do_not_depend_on_micro_batches_or_devices(tmp_path):
  """Global batch 32 in micro-batches of 8 on 8 devices and of 4 on 4 devices x tensor 2: the
  same masked-LM loss, gradient norm and evaluation (eval_masked_accuracy) to float summation
  order (one layer, one step: the default run's budget)."""
  one_layer = {**MLM, "model.num_layers": 1}
  want = _run(tmp_path / "m8", 8, {"data": 8}, steps=1, **one_layer)
  assert sorted(want) == [1] and 0 <= want[1]["eval_masked_accuracy"] <= 1
  assert 0 < want[1]["eval_unigram_accuracy"] < 1 and "eval_bpb" not in want[1]
  assert 0.1 < want[1]["target_tokens"] / (32 * 32) < 0.2  # the masked positions, ~15%
  got = _run(tmp_path / "m4", 4, {"data": 4, "tensor": 2}, steps=1, **one_layer)
  _same(got, want, keys=("loss", "grad_norm", "eval_loss", "eval_masked_accuracy",
                         "eval_unigram_accuracy"), rtol=1e-6)


@pytest.mark.slow  # two train.py processes (~40 s on busy cores); the default run keeps the above
def test_train_py_mlm_tiny_on_one_and_eight_devices(tmp_path):
  """configs/mlm_tiny.py through train.py (the test's small sizes), on 1 device in micro-batches
  of 4 and on 8: the same losses, and eval_masked_accuracy reported."""
  args = ("--config.steps=3", "--config.eval_every=3")
  one = _train_py(tmp_path / "one", 1, *args, "--config.data.micro_batch_size=4",
                  "--config.mesh.data=1")
  assert "eval_masked_accuracy=" in one.stdout and "eval_unigram_accuracy=" in one.stdout
  _train_py(tmp_path / "eight", 8, *args)
  _same(_rows(tmp_path / "one"), _rows(tmp_path / "eight"),
        keys=("loss", "grad_norm", "eval_loss", "eval_masked_accuracy"), rtol=1e-6)


@pytest.mark.parametrize("args, says", [
    (["--config.data.mask_rate=0.15"], "data.mask_rate=0.15 with model.causal=True: a masked LM"),
    (["--config.model.causal=false"], "model.causal=False with data.mask_rate=0: a bidirectional"),
    (["--config.data.mask_rate=1.5", "--config.model.causal=false"], "must be in [0, 1)"),
    (["--config.data.mask_rate=0.15", "--config.model.causal=false",
      "--config.model.vocab_size=259"], "leaves no id for [MASK] past the data's 259 token ids"),
    (["--config.data.mask_rate=0.15", "--config.model.causal=false", "--config.mesh.stage=2",
      "--config.data.micro_batch_size=4", "--config.model.num_layers=2"],
     "data.mask_rate=0.15 with mesh.stage=2"),
])
def test_masked_lm_config_mistakes_are_one_line_exit_2(tmp_path, capsys, args, says):
  code = train.main(["--config", "configs/lm_tiny.py", "--workdir", str(tmp_path / "w"), *args])
  err = capsys.readouterr().err
  assert code == 2 and says in err and len(err.strip().splitlines()) == 1, err


@pytest.mark.slow  # four meshes' compiles (~15 s)
def test_every_attention_implementation_computes_the_same_encoder():
  """The encoder's forward over two packed documents under each implementation this CPU runs
  (flash and splash interpreted, ring over mesh.sequence = 4; cudnn stands for xla off GPU)
  equals xla's: non-causal everywhere, documents still apart."""
  cfg = ModelConfig(vocab_size=64, d_model=64, num_layers=1, num_heads=4, num_kv_heads=2,
                    mlp_dim=64, causal=False)
  tokens = jax.random.randint(jax.random.key(0), (2, 128), 0, 64)
  segments = jnp.where(jnp.arange(128) < 70, 1, 2)[None].repeat(2, 0)
  positions = jnp.where(jnp.arange(128) < 70, jnp.arange(128), jnp.arange(128) - 70)[None]

  def forward(impl, mesh):
    c = dataclasses.replace(cfg, attention=impl)
    devices = jax.devices()[:int(np.prod(list(mesh.values())))]
    with jax.set_mesh(make_mesh(mesh, devices)):
      return np.asarray(jax.jit(lambda t: Transformer(c, rngs=nnx.Rngs(0))(
          t, positions.repeat(2, 0), segments))(tokens))

  want = forward("xla", {"data": 1})
  for impl, mesh in (("flash_triton", {"data": 2}), ("splash", {"data": 2}),
                     ("ring", {"data": 2, "sequence": 4}), ("cudnn", {"data": 1})):
    np.testing.assert_allclose(forward(impl, mesh), want, atol=1e-5, err_msg=impl)


def test_an_encoder_is_neither_exported_as_llama_nor_decoded():
  encoder = ModelConfig(causal=False)
  with pytest.raises(ConvertError, match="bidirectional encoder"):
    hf_config_from_model(encoder, dtype="float32", max_position_embeddings=128)
  with pytest.raises(ValueError, match="does not generate"):
    Generator(types.SimpleNamespace(cfg=encoder), None)


@pytest.mark.slow  # two runs' compiles (~20 s on busy cores)
def test_a_diloco_masked_lm_scores_its_anchor_as_the_plain_run_scores_its_parameters(tmp_path):
  """DiLoCo with one replica and one inner step per outer step is the plain run (Nesterov SGD at
  rate 1 and momentum 0 copies the replica): the masked evaluation of its anchor equals it."""
  diloco = {"optim.diloco.replicas": 1, "optim.diloco.inner_steps": 1,
            "optim.diloco.outer_lr": 1.0, "optim.diloco.outer_momentum": 0.0}
  want = _run(tmp_path / "plain", 8, {"data": 8}, steps=2, **MLM)
  got = _run(tmp_path / "diloco", 8, {"data": 8}, steps=2, **MLM, **diloco)
  _same(got, want, keys=("loss", "eval_loss", "eval_masked_accuracy"), rtol=1e-5)


def test_a_changed_mask_rate_is_refused_on_resume():
  """The mask rate is the masked LM's objective: a checkpoint written at one rate does not
  resume at another (one line naming both); a checkpoint from before the key resumes."""
  from trainer.checkpoint.saved import describe_mismatch  # noqa: PLC0415
  saved = {"data": {"seq_len": 32, "mask_rate": 0.15}, "optim": {"name": "adamw"}}
  assert describe_mismatch(saved, saved, None, None) is None
  other = {**saved, "data": {"seq_len": 32, "mask_rate": 0.3}}
  assert describe_mismatch(saved, other, None, None) == \
      "it was written with data.mask_rate=0.15, the config has 0.3"
  old = {**saved, "data": {"seq_len": 32}}
  assert describe_mismatch(old, {**saved, "data": {"seq_len": 32, "mask_rate": 0.0}}, None,
                           None) is None

"""Hugging Face Llama <-> our checkpoints: logits parity with transformers in both directions.

Reference models are built locally from a small random `LlamaConfig` (no download). Needs the
`hf` test extra (transformers + torch); skipped with the reason otherwise.
"""
import json
import os

import jax
import numpy as np
import pytest

torch = pytest.importorskip("torch", reason="parity tests need the `hf` extra (torch)")
transformers = pytest.importorskip("transformers",
                                   reason="parity tests need the `hf` extra (transformers)")

from models.hf import ConvertError, SafetensorsDir, model_config_from_hf  # noqa: E402
from sharding.mesh import make_mesh  # noqa: E402
from tools import convert  # noqa: E402
from trainer.checkpoint.saved import CheckpointError  # noqa: E402
from trainer.checkpoint.model_dirs import load_params  # noqa: E402
from trainer.checkpoint.model_dirs import restore_params  # noqa: E402
from trainer.step.state import ModelSpec  # noqa: E402

LLAMA3_SCALING = {"rope_type": "llama3", "factor": 8.0, "low_freq_factor": 1.0,
                  "high_freq_factor": 4.0, "original_max_position_embeddings": 16}
# GQA (4 query heads on 2 kv heads), untied, Llama 3 rope scaling with a short original context
# so that all three frequency bands occur; and plain MHA with tied embeddings.
CASES = {
    "gqa_llama3_untied": dict(num_attention_heads=4, num_key_value_heads=2,
                              tie_word_embeddings=False, rope_theta=500_000.0,
                              rope_scaling=LLAMA3_SCALING),
    "mha_tied": dict(num_attention_heads=4, num_key_value_heads=4, tie_word_embeddings=True,
                     rope_theta=10_000.0, rope_scaling=None),
}


def make_hf_model(path, case, seed=0):
  """A small random LlamaForCausalLM saved (safetensors) in `path`."""
  torch.manual_seed(seed)
  cfg = transformers.LlamaConfig(vocab_size=96, hidden_size=32, intermediate_size=72,
                                 num_hidden_layers=3, max_position_embeddings=64,
                                 rms_norm_eps=1e-5, bos_token_id=1, eos_token_id=2,
                                 **CASES[case])
  model = transformers.LlamaForCausalLM(cfg).eval()
  with torch.no_grad():  # non-trivial norm scales, so a swapped norm mapping shows
    for name, p in model.named_parameters():
      if "norm" in name:
        p.copy_(1.0 + 0.5 * torch.randn_like(p))
  model.save_pretrained(path)
  return model


def hf_logits(model, ids):
  with torch.no_grad():
    return model(torch.tensor(ids)).logits.float().numpy()


def our_logits(src, ids, mesh):
  spec, params, _, _ = restore_params(src, mesh)
  with jax.set_mesh(mesh):
    return np.asarray(jax.jit(lambda p, t: spec.model(p)(t))(params, np.asarray(ids)))


IDS = np.random.default_rng(0).integers(0, 96, size=(2, 40)).tolist()  # past 16 positions


@pytest.fixture(scope="module")
def mesh():
  # Heads split over `tensor`, embed over `fsdp`: every tensor is sharded on load.
  return make_mesh({"data": 2, "fsdp": 2, "tensor": 2, "sequence": 1, "expert": 1})


@pytest.mark.parametrize("case", sorted(CASES))
def test_from_hf_then_to_hf_logits_match_transformers(tmp_path, case, mesh):
  hf_dir, ours, back = tmp_path / "hf", tmp_path / "ours", tmp_path / "back"
  model = make_hf_model(hf_dir, case)
  ref = hf_logits(model, IDS)

  cfg = convert.from_hf(str(hf_dir), str(ours), mesh=mesh)
  assert cfg["rope_scaling"]["type"] == ("llama3" if CASES[case]["rope_scaling"] else "none")
  mine = our_logits(str(ours), IDS, mesh)
  np.testing.assert_allclose(mine, ref, atol=1e-4, rtol=0)

  convert.to_hf(str(ours), str(back), mesh=mesh)
  reloaded = transformers.LlamaForCausalLM.from_pretrained(back).eval()
  np.testing.assert_allclose(hf_logits(reloaded, IDS), mine, atol=1e-4, rtol=0)
  with open(back / "config.json") as f:
    assert json.load(f)["tie_word_embeddings"] == CASES[case]["tie_word_embeddings"]


def test_sharded_safetensors_round_trip(tmp_path, mesh):
  """Sharded export (index + several files) reads back tensor for tensor, and transformers
  loads it."""
  make_hf_model(tmp_path / "hf", "gqa_llama3_untied")
  convert.from_hf(str(tmp_path / "hf"), str(tmp_path / "ours"), mesh=mesh)
  files = convert.to_hf(str(tmp_path / "ours"), str(tmp_path / "sharded"),
                        max_shard_bytes=20_000, mesh=mesh)
  assert "model.safetensors.index.json" in files and len(files) > 4
  a, b = SafetensorsDir(str(tmp_path / "hf")), SafetensorsDir(str(tmp_path / "sharded"))
  assert a.names() == b.names()
  for name in a.names():
    np.testing.assert_array_equal(a.get(name), b.get(name))
  transformers.LlamaForCausalLM.from_pretrained(tmp_path / "sharded")


def test_converted_dir_is_an_init_from_source(tmp_path, mesh):
  """checkpoint.init_from reads a converted dir; a model of other dims fails in one line."""
  make_hf_model(tmp_path / "hf", "mha_tied")
  cfg = convert.from_hf(str(tmp_path / "hf"), str(tmp_path / "ours"), mesh=mesh)
  from models.llama import ModelConfig
  spec = ModelSpec(ModelConfig.from_config(cfg), mesh, seed=0)
  params, _ = load_params(str(tmp_path / "ours"), spec.abstract_params)
  assert params["embed_VE"].shape == (96, 32)
  other = ModelSpec(ModelConfig.from_config({**cfg, "mlp_dim": 64}), mesh, seed=0)
  with pytest.raises(CheckpointError, match="does not fit this model: .*w_down_FE"):
    load_params(str(tmp_path / "ours"), other.abstract_params)


def test_unsupported_configs_are_refused_in_one_line():
  base = dict(vocab_size=8, hidden_size=8, intermediate_size=8, num_hidden_layers=1,
              num_attention_heads=2)
  with pytest.raises(ConvertError, match="attention_bias"):
    model_config_from_hf({**base, "attention_bias": True})
  with pytest.raises(ConvertError, match="rope type 'yarn'"):
    model_config_from_hf({**base, "rope_scaling": {"rope_type": "yarn", "factor": 2.0}})
  with pytest.raises(ConvertError, match="model_type='gpt2'"):
    model_config_from_hf({**base, "model_type": "gpt2"})


def test_cli_from_hf_reports_missing_config(tmp_path, capsys):
  assert convert.main(["from-hf", str(tmp_path), "--out", str(tmp_path / "o")]) == 2
  assert "no config.json" in capsys.readouterr().err


def test_rope_scaling_config_key():
  """model.rope_scaling reaches the model through the run config, and is validated."""
  from models.llama import ModelConfig
  from models.rope import rope_inv_freq
  from tests.conftest import tiny_config
  from trainer.config import ConfigError
  from trainer.config.checks import validate
  cfg = tiny_config()
  cfg.model.rope_scaling.update(type="llama3", factor=4.0, original_max_position_embeddings=64)
  validate(cfg, 8)
  model_cfg = ModelConfig.from_config(cfg.model)
  plain = rope_inv_freq(8, 10_000.0)
  scaled = rope_inv_freq(8, 10_000.0, model_cfg.rope_scaling)
  assert scaled[0] == plain[0] and np.isclose(scaled[-1], plain[-1] / 4.0)
  cfg.model.rope_scaling.type = "yarn"
  with pytest.raises(ConfigError, match="model.rope_scaling.type='yarn'"):
    validate(cfg, 8)


def test_init_from_mismatch_names_the_override(tmp_path, mesh):
  """A converted model's rope_theta / rope scaling differ from the run config: shapes agree,
  so the check must come from the saved model config."""
  import dataclasses
  from models.llama import ModelConfig
  from models.rope import RopeScaling
  from trainer.checkpoint.model_dirs import init_from_mismatch
  make_hf_model(tmp_path / "hf", "gqa_llama3_untied")
  cfg = ModelConfig.from_config(convert.from_hf(str(tmp_path / "hf"), str(tmp_path / "o"),
                                                mesh=mesh))
  src = str(tmp_path / "o")
  assert init_from_mismatch(src, cfg) is None
  msg = init_from_mismatch(src, dataclasses.replace(cfg, rope_theta=10_000.0))
  assert "model.rope_theta=500000.0" in msg and "--config.model.rope_theta=500000.0" in msg
  msg = init_from_mismatch(src, dataclasses.replace(cfg, rope_scaling=RopeScaling()))
  assert "--config.model.rope_scaling.type=llama3" in msg

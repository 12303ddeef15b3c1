"""KV-cache generation: greedy decoding equals transformers' greedy `generate` on the same
converted model; a batch of different-length prompts equals the prompts one at a time; the
sampling filters; the CLI."""
import numpy as np
import pytest

import jax

from models.decode import Generator, sample
from sharding.mesh import make_mesh
from trainer.checkpoint.model_dirs import restore_params

torch = pytest.importorskip("torch", reason="generation parity needs the `hf` extra (torch)")
transformers = pytest.importorskip("transformers", reason="needs the `hf` extra (transformers)")

from tests.test_convert import make_hf_model  # noqa: E402
from tools import convert  # noqa: E402
from tools import generate as generate_cli  # noqa: E402

PROMPTS = [[5, 17, 33, 2, 9, 60, 11], [40, 3], [7, 7, 7, 8, 91]]
NEW = 12


WORDS = ["<pad>", "<s>", "</s>"] + [f"w{i}" for i in range(3, 96)]


def write_word_tokenizer(hf_dir):
  """A word-level tokenizer.json over the model's 96 ids (w3 .. w95), with special tokens named
  in tokenizer_config.json, as a Hugging Face model dir has them."""
  tokenizers = pytest.importorskip("tokenizers")
  tok = tokenizers.Tokenizer(tokenizers.models.WordLevel(
      {w: i for i, w in enumerate(WORDS)}, unk_token="<pad>"))
  tok.pre_tokenizer = tokenizers.pre_tokenizers.WhitespaceSplit()
  tok.decoder = tokenizers.decoders.WordPiece(prefix="##")  # joins words with spaces
  tok.save(str(hf_dir / "tokenizer.json"))
  (hf_dir / "tokenizer_config.json").write_text(
      '{"bos_token": "<s>", "eos_token": "</s>", "pad_token": "<pad>"}')


@pytest.fixture(scope="module")
def converted(tmp_path_factory):
  root = tmp_path_factory.mktemp("gen")
  model = make_hf_model(root / "hf", "gqa_llama3_untied", seed=1)
  write_word_tokenizer(root / "hf")
  mesh = make_mesh({"data": 1, "fsdp": 2, "tensor": 2, "sequence": 1, "expert": 2})
  convert.from_hf(str(root / "hf"), str(root / "ours"), mesh=mesh)
  return model, str(root / "ours"), mesh


@pytest.fixture(scope="module")
def greedy(converted):
  _, src, mesh = converted
  spec, params, _, _ = restore_params(src, mesh)
  return Generator(spec, params, temperature=0.0)


def hf_greedy(model, prompt, n):
  out = model.generate(torch.tensor([prompt]), max_new_tokens=n, min_new_tokens=n,
                       do_sample=False, eos_token_id=None, pad_token_id=0)
  return out[0, len(prompt):].tolist()


def test_greedy_matches_transformers_and_batch_matches_single(converted, greedy):
  model = converted[0]
  batch = greedy.generate(PROMPTS, NEW)
  for prompt, got in zip(PROMPTS, batch):
    assert got == hf_greedy(model, prompt, NEW)
  assert greedy.generate([PROMPTS[1]], NEW) == [batch[1]]


def test_eos_ends_a_row(greedy):
  full = greedy.generate([PROMPTS[0]], NEW)[0]
  eos = full[3]
  cut = greedy.generate([PROMPTS[0]], NEW, eos_id=eos)[0]
  assert cut == full[:full.index(eos) + 1]


def test_sampling_filters():
  logits = jax.numpy.log(jax.numpy.array([[0.5, 0.3, 0.15, 0.05]] * 2000))
  keys = jax.random.key(0)
  top1 = sample(logits, keys, temperature=1.0, top_k=1)
  assert (np.asarray(top1) == 0).all()
  drawn = np.asarray(sample(logits, keys, temperature=1.0, top_p=0.7))  # keeps {0, 1}
  assert set(drawn.tolist()) == {0, 1} and abs((drawn == 0).mean() - 0.5 / 0.8) < 0.05
  drawn = np.asarray(sample(logits, keys, temperature=1.0, top_k=3))
  assert set(drawn.tolist()) == {0, 1, 2}


def test_cli_prompt_ids_prints_generated_ids(converted, greedy, capsys):
  _, src, _ = converted
  code = generate_cli.main(["--checkpoint", src, "--prompt_ids", "5,17,33,2,9,60,11",
                            "--max_new_tokens", str(NEW), "--temperature", "0",
                            "--config.mesh.fsdp=2", "--config.mesh.tensor=2",
                            "--config.mesh.expert=2", "--config.mesh.data=1"])
  assert code == 0
  lines = capsys.readouterr().out.strip().splitlines()
  expected = greedy.generate([PROMPTS[0]], NEW)[0]
  assert lines[-1] == ",".join(map(str, expected))


def test_cli_text_prompt_uses_the_converted_tokenizer_and_to_hf_copies_it(converted, greedy,
                                                                          capsys, tmp_path):
  _, src, mesh = converted
  assert generate_cli.main(["--checkpoint", src, "--prompt", "w5 w17 w33", "--max_new_tokens",
                            "6", "--temperature", "0"]) == 0
  line = capsys.readouterr().out.strip().splitlines()[-1]
  ids = greedy.generate([[1, 5, 17, 33]], 6, eos_id=2)[0]  # <s> w5 w17 w33
  text = " ".join(WORDS[i] for i in ids if i > 2)
  assert line == f"'w5 w17 w33' -> {text!r}"
  files = convert.to_hf(src, str(tmp_path / "back"), mesh=mesh)
  assert "tokenizer.json" in files and (tmp_path / "back" / "tokenizer.json").exists()


@pytest.mark.parametrize("tool", ["generate", "evaluate"])
def test_next_token_tools_refuse_an_encoder_in_one_line(monkeypatch, capsys, tool):
  """A masked-LM checkpoint (model.causal=False) is refused by tools.generate and
  tools.evaluate before anything is restored or compiled, in one line with exit code 2
  (generation was a traceback from the Generator; evaluation scored next tokens the encoder
  sees)."""
  import importlib  # noqa: PLC0415
  from trainer.checkpoint import model_dirs  # noqa: PLC0415
  monkeypatch.setattr(model_dirs, "source_config",
                      lambda src, flag="--checkpoint": ("step", {"model": {"causal": False}}))
  monkeypatch.setattr(model_dirs, "restore_params",
                      lambda *a, **k: pytest.fail("restored an encoder"))
  args = {"generate": ["--prompt_ids", "1,2"], "evaluate": []}[tool]
  assert importlib.import_module(f"tools.{tool}").main(["--checkpoint", "runs/mlm", *args]) == 2
  err = capsys.readouterr().err.strip().splitlines()
  assert len(err) == 1 and "model.causal=False" in err[0] and "next token" in err[0], err

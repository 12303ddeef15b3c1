"""The accelerator configs carry their models' real vocabularies and a chunked loss that fits.

The compiled fits are `tests/test_aot.py` (slow, needs libtpu); this checks, in milliseconds,
that the shipped configs still state the vocabulary and `model.logits_chunk` docs/aot.md's
table was measured with, and that the chunk passes validation on a mesh like theirs."""
import os

import jax
import pytest

from conftest import ROOT
from trainer.config.checks import validate
from trainer.config.cli import load

# config -> (vocabulary, logits_chunk) of the tables in docs/aot.md
REAL_VOCAB = {"lm_125m": (50_304, 512), "lm_1b": (128_256, 256), "lm_1b_32k": (128_256, 2048),
              "lm_8b": (128_256, 1024)}


@pytest.mark.parametrize("name", sorted(REAL_VOCAB))
def test_real_vocabulary_and_chunked_loss(name):
  cfg = load(os.path.join(ROOT, "configs", f"{name}.py"), [])
  vocab, chunk = REAL_VOCAB[name]
  assert (cfg.model.vocab_size, cfg.model.logits_chunk) == (vocab, chunk)
  assert cfg.model.vocab_size % 128 == 0  # splits over any tensor axis
  validate(cfg, jax.devices())  # the chunk divides the sequence and every sequence shard

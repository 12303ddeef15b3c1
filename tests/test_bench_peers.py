"""bench/peers.py, issue 25's table: our step, the plain jit + optax step and the PyTorch peer
(Hugging Face Llama, fused AdamW) at one shape on CPU, in seconds; the peer's model has our
parameter count at every shape of the table; bad runner lists are one-line errors."""
import math
import os
import re

import pytest

from conftest import ROOT, bench_module

pytest.importorskip("torch", reason="the PyTorch peer needs the hf extra")
pytest.importorskip("transformers", reason="the PyTorch peer needs the hf extra")


def test_peers_table_on_cpu(capsys):
  peers = bench_module("peers")
  assert peers.main(["--size", "tiny", "--torch-compile", "off", "--rounds", "1",
                     "--steps", "1", "--runners", "plain,plain-docs,ours,torch"]) == 0
  out = capsys.readouterr().out
  losses = dict(re.findall(r"^  (plain|plain-docs|ours|torch) .* loss ([\d.]+)", out, re.M))
  assert sorted(losses) == ["ours", "plain", "plain-docs", "torch"], out
  # one document per row: the plain step's loss is the same with and without its segment ids
  assert float(losses["plain-docs"]) == pytest.approx(float(losses["plain"]), rel=1e-4)
  for name, loss in losses.items():  # three steps on random tokens of 512 ids: near ln 512
    assert abs(float(loss) - math.log(512)) < 1.0, (name, out)
  fpt = float(re.search(r"([\d.]+) MFLOPs/token", out).group(1)) * 1e6
  peak = float(re.search(r"MFU against ([\d.e+]+) TFLOP/s", out).group(1)) * 1e12
  for name, tps, mfu in re.findall(
      r"^  (plain|plain-docs|ours|torch) .* ([\d,]+) tokens/s  MFU +([\d.]+)%", out,
      re.M):  # MFU = tokens/s x FLOPs per token / peak
    assert float(mfu) / 100 == pytest.approx(float(tps.replace(",", "")) * fpt / peak,
                                             rel=0.01, abs=5.1e-4), (name, out)
  header, rule, row = out.strip().splitlines()[-3:]
  assert header == ("| model, seq x batch | plain | plain-docs | ours | torch | ours/plain | "
                    "ours/plain-docs | ours/torch |")
  cells = [c.strip() for c in row.strip("|").split("|")]
  assert cells[0] == "tiny (64 x 4)"
  assert all(re.fullmatch(r"[\d,.]+k \([\d.]+%\)", c) for c in cells[1:5]), row
  assert all(float(c) > 0 for c in cells[5:]), row


def test_torch_peer_has_our_parameter_count_at_every_shape():
  import torch

  from models.llama import ModelConfig
  from models.sizes import param_counts
  from trainer.config.cli import load_from_cli
  peers, torch_peer = bench_module("peers"), bench_module("torch_peer")
  for name in peers.baseline.SHAPES:
    cfg = load_from_cli(os.path.join(ROOT, "configs", "lm_tiny.py"),
                        peers.baseline.size_overrides(name, peers.baseline.SHAPES))
    model_cfg = ModelConfig.from_config(cfg.model)
    with torch.device("meta"):  # shapes only, no memory
      model = torch_peer.hf_llama(model_cfg, cfg.data.seq_len)
    assert sum(p.numel() for p in model.parameters()) == param_counts(model_cfg)["total"], name


@pytest.mark.parametrize("argv,message", [
    (["--runners", "ours,jax"], "--runners 'ours,jax': use a comma-separated list of nanodo, "
     "plain, plain-docs, ours, torch"),
    (["--runners", "nanodo"], "the nanodo runner needs --nanodo_dir"),
])
def test_peers_bad_runners_are_one_line_errors(argv, message, capsys):
  assert bench_module("peers").main(["--size", "tiny", *argv]) == 2
  err = capsys.readouterr().err.strip()
  assert message in err and len(err.splitlines()) == 1, err

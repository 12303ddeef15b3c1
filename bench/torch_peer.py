"""The PyTorch peer of our train step: Hugging Face's LlamaForCausalLM trained the way a PyTorch
user would, on the same model, optimizer settings and tokens (bench/peers.py times it).

`Torch(cfg, model_cfg)` builds `transformers.LlamaForCausalLM` from our model config (the same
widths, so the same parameter count and FLOPs per token) with SDPA attention and fp32
parameters, and trains it with bf16 autocast (when `model.dtype` is bfloat16), forward + loss
under `torch.compile` (`--torch-compile`), `clip_grad_norm_` and fused AdamW at our derived
settings, at a constant learning rate. Needs the `hf` extra (`pip install -e ".[hf]"`).
Details: docs/performance.md#against-the-peers-on-a-gpu
"""
from __future__ import annotations

import time

COMPILE_MODES = ("default", "max-autotune-no-cudagraphs", "off")


def torch_available() -> str | None:
  """None when torch and transformers import; else why not (one line)."""
  try:
    import torch  # noqa: F401, PLC0415  optional
    import transformers  # noqa: F401, PLC0415  optional
  except ImportError as e:
    return f"the PyTorch peer needs the hf extra (pip install -e \".[hf]\"): {e}"
  return None


def hf_llama(model_cfg, seq_len: int):
  """transformers' LlamaForCausalLM of our model config (fp32, SDPA attention), on torch's
  current default device."""
  import transformers  # noqa: PLC0415  optional

  from models.hf import hf_config_from_model  # noqa: PLC0415  start-up
  hf = transformers.LlamaConfig.from_dict(hf_config_from_model(
      model_cfg, dtype="float32", max_position_embeddings=seq_len))
  hf._attn_implementation = "sdpa"
  return transformers.LlamaForCausalLM(hf)


class Torch:
  """Hugging Face Llama + torch.compile + fused AdamW on one device (module docstring), trained
  on `tokens` [B, S + 1] (inputs and next-token targets); called with n, runs n steps and
  returns the seconds per step (bench/baseline.py's runner protocol)."""

  def __init__(self, cfg, model_cfg, tokens, *, compile_mode: str = "default"):
    import torch  # noqa: PLC0415  optional
    import torch.nn.functional as F  # noqa: N812, PLC0415  optional

    from optim import derive  # noqa: PLC0415  start-up
    self.torch = torch
    self.device = torch.device("cuda" if torch.cuda.is_available() else "cpu")
    torch.manual_seed(cfg.seed)
    torch.set_float32_matmul_precision("high")  # TF32 on Ampere+, as JAX's default precision
    self.model = model = hf_llama(model_cfg, cfg.data.seq_len).to(self.device)
    self.params = sum(p.numel() for p in model.parameters())  # tied: counted once
    hp = derive(cfg.optim, cfg.data.global_batch_size, cfg.data.global_batch_size)
    named = list(model.named_parameters())
    decay = [p for n, p in named if p.ndim >= 2 and "embed" not in n]
    rest = [p for n, p in named if not (p.ndim >= 2 and "embed" not in n)]
    self.opt = torch.optim.AdamW(
        [{"params": decay, "weight_decay": hp.weight_decay},
         {"params": rest, "weight_decay": 0.0}],
        lr=hp.learning_rate, betas=(cfg.optim.b1, hp.b2), eps=cfg.optim.eps, fused=True)
    self.clip = cfg.optim.clip_norm
    bf16 = model_cfg.dtype == "bfloat16"
    vocab = model_cfg.vocab_size

    def loss_fn(inputs, targets):
      with torch.autocast(self.device.type, dtype=torch.bfloat16, enabled=bf16):
        logits = model(input_ids=inputs, use_cache=False).logits
      return F.cross_entropy(logits.float().reshape(-1, vocab), targets.reshape(-1))

    self.compile_mode = compile_mode
    self.loss_fn = loss_fn if compile_mode == "off" else torch.compile(
        loss_fn, mode=None if compile_mode == "default" else compile_mode)
    tokens = torch.as_tensor(tokens, dtype=torch.long)
    self.inputs = tokens[:, :-1].contiguous().to(self.device)
    self.targets = tokens[:, 1:].contiguous().to(self.device)
    self.loss = None

  def _sync(self):
    if self.device.type == "cuda":
      self.torch.cuda.synchronize()

  def __call__(self, n: int) -> float:
    torch = self.torch
    self._sync()
    t = time.perf_counter()
    for _ in range(n):
      loss = self.loss_fn(self.inputs, self.targets)
      loss.backward()
      torch.nn.utils.clip_grad_norm_(self.model.parameters(), self.clip)
      self.opt.step()
      self.opt.zero_grad(set_to_none=True)
    self.loss = float(loss.detach())  # waits for the last step
    return (time.perf_counter() - t) / n

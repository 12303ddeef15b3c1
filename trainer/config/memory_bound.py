"""A cheap lower bound of the memory one device needs for a train step (`check`), checked by
train.py before compiling, on the devices the run trains on (`validate` also serves stand-in
devices, so the bound is not part of it).

  bound = the parameters (model.param_dtype, split over fsdp x tensor x expert)
        + the larger of one layer's attention scores (xla attention: rows x heads x seq_len^2,
          model.dtype) and the logits (rows x seq_len or logits_chunk x vocab, float32)

with rows the micro-batch's rows on one device. A bound above the device's memory refuses the
config in one line; a bound below it proves nothing (`tools.memory_check` says whether a run
fits). Why and details: docs/configs.md#a-step-that-cannot-fit-a-device.
"""
from __future__ import annotations

import os

BYTES = {"float32": 4, "bfloat16": 2, "float16": 2}


def device_memory(devices) -> int | None:
  """Bytes of memory one device of `devices` may use, or None if unknown."""
  device = devices[0]
  try:
    stats = device.memory_stats()
  except Exception:  # noqa: BLE001  (an ahead-of-time target's devices have no memory to ask)
    stats = None
  if stats and stats.get("bytes_limit"):
    return int(stats["bytes_limit"])
  if getattr(device, "platform", "") == "cpu":  # the host's memory (its devices share it)
    try:
      return os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES")
    except (ValueError, OSError, AttributeError):
      return None
  return None


def step_bound(cfg, sizes: dict, attention: str) -> tuple[int, str]:
  """(a lower bound of one device's bytes for a train step, what it is made of)."""
  from models.config import ModelConfig  # noqa: PLC0415  start-up
  from models.sizes import param_counts  # noqa: PLC0415  start-up
  m, d = cfg.model, cfg.data
  rows = (d.micro_batch_size or d.global_batch_size) // max(
      sizes.get("data", 1) * sizes.get("fsdp", 1) * sizes.get("expert", 1)
      * max(cfg.optim.diloco.replicas, 1), 1)
  rows = max(rows, 1)
  seq = d.seq_len // sizes.get("sequence", 1)
  heads = m.num_heads // sizes.get("tensor", 1)
  param_shards = sizes.get("fsdp", 1) * sizes.get("tensor", 1) * sizes.get("expert", 1)
  state = param_counts(ModelConfig.from_config(m))["total"] * BYTES.get(m.param_dtype, 4) \
      // param_shards
  parts = {"the parameters": state}
  if attention == "xla":
    parts["one layer's attention scores"] = rows * heads * seq * d.seq_len * BYTES.get(m.dtype, 4)
  chunk = m.logits_chunk or d.seq_len
  parts["the logits"] = rows * min(chunk, seq) * (m.vocab_size // sizes.get("tensor", 1)) * 4
  largest = max((k for k in parts if k != "the parameters"), key=parts.get)
  return state + parts[largest], f"{largest} {_gib(parts[largest])} + the parameters {_gib(state)}"


def _gib(n: float) -> str:
  return f"{n / 2**30:,.1f} GiB" if n >= 2**30 else f"{n / 2**20:,.1f} MiB"


def check(cfg, sizes: dict, devices) -> str | None:
  """One line saying why the config cannot fit one device, or None."""
  from models.attention import choose_impl  # noqa: PLC0415  start-up
  memory = device_memory(devices)
  if memory is None:
    return None
  platform = getattr(devices[0], "platform", "cpu")
  attention = choose_impl(cfg.model.attention, platform=platform,
                          sequence=sizes.get("sequence", 1))
  bound, what = step_bound(cfg, sizes, attention)
  if bound <= memory:
    return None
  return (f"data.seq_len={cfg.data.seq_len}: a train step needs at least {_gib(bound)} per "
          f"device ({what}; trainer/config/memory_bound.py), the device has {_gib(memory)}; use a "
          "shorter data.seq_len or a smaller data.micro_batch_size"
          + (", or model.attention='flash' (no seq_len x seq_len scores)"
             if attention == "xla" and platform != "cpu" else "")
          + "; python -m tools.memory_check predicts what a config needs")

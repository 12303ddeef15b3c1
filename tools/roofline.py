"""Roofline of a compiled train step: the lower bound on its time and the MFU that bound allows.

`tools.aot` compiles the step for a target (TPU topology or GPU) and fills a `Roofline` from the
compiled program and the target chip; this module is the arithmetic and the report lines:

  * step time at 100% MFU: the model's FLOPs at the chips' bf16 peak;
  * compute: the FLOPs the step executes (remat and idle pipeline ticks included) at that peak;
  * memory: XLA's bytes accessed per chip at the HBM bandwidth, a floor (loop bodies once);
  * the bound max(compute, memory), the MFU it allows, and beside it an estimate (not a bound)
    with the bytes scaled by XLA's FLOP undercount.

Why each term is what it is: docs/aot.md#roofline
"""
from __future__ import annotations

import dataclasses

from models.sizes import flops_per_token


@dataclasses.dataclass(frozen=True)
class Roofline:
  device_kind: str
  chips: int
  model_flops: float  # per optimizer step, all chips (models.sizes.flops_per_token)
  tokens_per_step: int
  remat_mfu_bound: float  # model FLOPs / executed FLOPs (`remat_mfu_bound`)
  peak_flops: float | None  # per chip, bf16
  hbm_bandwidth: float | None  # per chip, bytes/s
  xla_flops: float | None = None  # per chip, as cost_analysis() counts them
  xla_bytes: float | None = None  # per chip, cost_analysis()'s "bytes accessed" (loop bodies once)
  kernel_flops: float = 0.0  # per step, all chips: model FLOPs inside compiled kernels
  idle_flops: float = 0.0  # per step, all chips: what pipeline stages execute in idle ticks

  @property
  def step_seconds(self) -> float | None:
    """Step time at 100% MFU: a lower bound."""
    if not self.peak_flops:
      return None
    return self.model_flops / (self.chips * self.peak_flops)

  @property
  def compute_seconds(self) -> float | None:
    """Executed FLOPs (model + recomputation + a pipeline's idle ticks) at the bf16 peak of
    every chip."""
    step = self.step_seconds
    if not step:
      return None
    return step / self.remat_mfu_bound + self.idle_flops / (self.chips * self.peak_flops)

  @property
  def memory_seconds(self) -> float | None:
    """A chip's HBM traffic at its bandwidth; a floor (XLA counts loop bodies once)."""
    if not self.hbm_bandwidth or not self.xla_bytes:
      return None
    return self.xla_bytes / self.hbm_bandwidth

  @property
  def seconds(self) -> float | None:
    """The roofline lower bound on the step time: max(compute, memory)."""
    if not self.compute_seconds:
      return None
    return max(self.compute_seconds, self.memory_seconds or 0.0)

  @property
  def mfu(self) -> float | None:
    """The highest MFU the step can reach: model FLOPs over the bound at the chips' peak."""
    bound = self.seconds
    return self.model_flops / (bound * self.chips * self.peak_flops) if bound else None

  @property
  def estimated_bytes(self) -> float | None:
    """XLA's bytes accessed scaled by its FLOP undercount (see the module docstring)."""
    if not self.xla_bytes or not self.xla_flops:
      return None
    visible = (self.model_flops / self.remat_mfu_bound + self.idle_flops
               - self.kernel_flops) / self.chips
    return self.xla_bytes * max(visible / self.xla_flops, 1.0)

  def step_line(self) -> str | None:
    if not self.step_seconds:
      return None
    idle = (f" and the pipeline's idle ticks add {self.idle_flops / self.model_flops:.0%} of the "
            "model FLOPs" if self.idle_flops else "")
    return (f"  step time at 100% MFU ({self.peak_flops / 1e12:.0f} TFLOP/s bf16 per chip): "
            f"{self.step_seconds * 1e3:,.1f} ms, {self.tokens_per_step / self.step_seconds:,.0f} "
            f"tokens/s; rematerialisation caps MFU at {self.remat_mfu_bound:.0%}{idle}, so expect "
            f">= {self.compute_seconds * 1e3:,.1f} ms")

  def line(self) -> str:
    if not self.seconds:
      return f"  roofline: no peak FLOP/s known for {self.device_kind}"
    ms = lambda t: f"{t * 1e3:,.1f} ms"
    if self.memory_seconds:
      memory = (f"memory {ms(self.memory_seconds)} ({self.xla_bytes / 1e9:,.1f} GB per chip at "
                f"{self.hbm_bandwidth / 1e9:,.0f} GB/s; XLA's bytes accessed, loop bodies once: "
                "a floor)")
    else:
      memory = (f"memory unknown (no HBM bandwidth known for {self.device_kind})"
                if self.xla_bytes else "memory unknown (XLA reported no bytes accessed)")
    bound = "memory" if self.seconds > self.compute_seconds else "compute"
    return (f"  roofline: compute {ms(self.compute_seconds)} (executed FLOPs at "
            f"{self.peak_flops / 1e12:.0f} TFLOP/s bf16 per chip), {memory} -> step >= "
            f"{ms(self.seconds)} ({bound}-bound), MFU <= {self.mfu:.0%}, "
            f"<= {self.tokens_per_step / self.seconds:,.0f} tokens/s")

  def estimate_line(self) -> str | None:
    if not self.estimated_bytes or not self.hbm_bandwidth or not self.compute_seconds:
      return None
    memory = self.estimated_bytes / self.hbm_bandwidth
    step = max(memory, self.compute_seconds)
    mfu = self.model_flops / (step * self.chips * self.peak_flops)
    return (f"  estimate with loop bodies scaled ({self.estimated_bytes / self.xla_bytes:.1f}x, "
            f"XLA's FLOP undercount): memory {memory * 1e3:,.1f} ms "
            f"({self.estimated_bytes / 1e9:,.0f} GB per chip) -> step ~{step * 1e3:,.1f} ms, "
            f"MFU ~{mfu:.0%} (not a bound)")

  def lines(self) -> list[str]:
    return [x for x in (self.step_line(), self.line(), self.estimate_line()) if x]

  def to_json(self) -> dict:
    return {"step_seconds": self.step_seconds, "compute_seconds": self.compute_seconds,
            "memory_seconds": self.memory_seconds, "roofline_seconds": self.seconds,
            "roofline_mfu": self.mfu, "estimated_bytes": self.estimated_bytes}


def remat_mfu_bound(model_cfg, seq_len: int, stage_remat: bool = False) -> float:
  """Model FLOPs / FLOPs executed when the remat policy recomputes part of the forward pass.

  `full` recomputes each block's forward (matmuls and attention) in the backward pass;
  `dots_no_batch` recomputes the attention matmuls (they have a batch dimension); `dots` and
  `none` recompute no matmul. `stage_remat` (pipeline stages, `pipeline.remat_stage`): the
  backward pass also recomputes every stage's forward from its input, one more forward of the
  blocks. Kernels recompute inside themselves too (flash attention's backward), which this does
  not count: it is a ceiling, not a prediction."""
  parts = flops_per_token(model_cfg, seq_len)
  head = 6.0 * model_cfg.d_model * model_cfg.vocab_size
  block_forward = (parts["matmuls"] - head) / 3 + parts["attention"] / 3
  extra = {"full": block_forward, "dots_no_batch": parts["attention"] / 3}.get(
      model_cfg.remat, 0.0) + (block_forward if stage_remat else 0.0)
  return parts["total"] / (parts["total"] + extra)


def kernel_flops(model_cfg, seq_len: int, tokens: int, kernel_calls: int) -> float:
  """Attention FLOPs (forward, backward and what `full` remat recomputes) that run inside a
  compiled kernel when the program has one: XLA's cost analysis does not see them."""
  if not kernel_calls:
    return 0.0
  recompute = 4 / 3 if model_cfg.remat in ("full", "dots_no_batch") else 1
  return flops_per_token(model_cfg, seq_len)["attention"] * tokens * recompute


def idle_flops(model_cfg, seq_len: int, tokens: int, idle: int, busy: int,
               stage_remat: bool = False) -> float:
  """FLOPs per step (all chips) that pipeline stages execute in their idle ticks: every stage
  runs its layers every tick (SPMD), so each busy tick's layer FLOPs (model + recomputation,
  without the embedding and head, which run outside the tick loop) recur `idle / busy` times
  over."""
  parts = flops_per_token(model_cfg, seq_len)
  layers = parts["total"] - 6.0 * model_cfg.d_model * model_cfg.vocab_size
  layers += parts["total"] * (1 / remat_mfu_bound(model_cfg, seq_len, stage_remat) - 1)
  return layers * tokens * idle / busy

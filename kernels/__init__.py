"""Pallas kernels: flash attention (forward + backward) through Triton and through Mosaic GPU
(Hopper), and the adapter to jax's TPU splash attention."""
from kernels.flash_attention import BlockSizes, flash_attention
from kernels.flash_mosaic import flash_attention_mosaic

__all__ = ["BlockSizes", "flash_attention", "flash_attention_mosaic"]

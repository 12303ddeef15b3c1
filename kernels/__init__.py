"""Pallas kernels: flash attention (forward + backward), and the adapter to jax's TPU splash."""
from kernels.flash_attention import BlockSizes, flash_attention

__all__ = ["BlockSizes", "flash_attention"]

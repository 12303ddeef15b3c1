"""Which JAX platforms to probe, decided before JAX starts.

With no `JAX_PLATFORMS` set, JAX initialises every backend it has a plugin for. libtpu (pulled
in by the `[tpu]` and `[test]` extras, for ahead-of-time TPU compiles) then prints half a dozen
lines of start-up warnings on every machine without TPU chips, burying one-line error messages.
So when the user has not chosen, and the PCI bus shows no Google TPU, we leave TPU out: CUDA
and CPU where an NVIDIA device is present, else CPU alone. Anything we cannot tell (no PCI
listing, an AMD GPU) is left to JAX. Set `JAX_PLATFORMS` yourself to override.
"""
from __future__ import annotations

import glob
import os
from collections.abc import MutableMapping

GOOGLE, NVIDIA, AMD = "0x1ae0", "0x10de", "0x1002"


def pci_vendors(root: str = "/sys/bus/pci/devices") -> set[str]:
  vendors = set()
  for path in glob.glob(os.path.join(root, "*", "vendor")):
    try:
      with open(path) as f:
        vendors.add(f.read().strip().lower())
    except OSError:
      pass
  return vendors


def choose(environ: MutableMapping[str, str] = os.environ, vendors: set[str] | None = None):
  """Set `JAX_PLATFORMS` in `environ` when the hardware makes the answer clear."""
  if "JAX_PLATFORMS" in environ:
    return
  vendors = pci_vendors() if vendors is None else vendors
  if not vendors or GOOGLE in vendors or AMD in vendors:
    return
  environ["JAX_PLATFORMS"] = "cuda,cpu" if NVIDIA in vendors else "cpu"

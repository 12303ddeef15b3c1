"""The embedded default corpus: the Python standard library's own source files.

Found at run time through `sysconfig` (nothing to download); tests and site-packages are left
out; paths are sorted; each file goes to train or validation by a hash of its relative path, so
the split is the same on every machine that has the same Python version. The fingerprint of the
file list (paths and sizes) is logged so two runs can tell whether they saw the same corpus.
"""
from __future__ import annotations

import hashlib
import os
import sys
import sysconfig

EXCLUDED_DIRS = {"test", "tests", "idle_test", "site-packages", "dist-packages", "__pycache__"}
VALIDATION_EVERY = 20  # about 1 file in 20 goes to validation


def stdlib_root() -> str:
  return sysconfig.get_paths()["stdlib"]


def stdlib_files(root: str | None = None) -> list[str]:
  """Sorted relative paths of the standard library's .py files, tests excluded."""
  root = root or stdlib_root()
  found = []
  for dirpath, dirnames, filenames in os.walk(root):
    dirnames[:] = sorted(d for d in dirnames if d not in EXCLUDED_DIRS)
    rel = os.path.relpath(dirpath, root)
    found.extend(os.path.normpath(os.path.join(rel, f)) for f in filenames if f.endswith(".py"))
  return sorted(found)


def split_of(relpath: str) -> str:
  """'train' or 'validation', decided by the file's path alone."""
  digest = int(hashlib.sha1(relpath.encode()).hexdigest(), 16)
  return "validation" if digest % VALIDATION_EVERY == 0 else "train"


def fingerprint(root: str, relpaths: list[str]) -> str:
  """Short hash of (path, size) for every file: changes when the corpus changes."""
  h = hashlib.sha256()
  for rel in relpaths:
    h.update(f"{rel}\t{os.path.getsize(os.path.join(root, rel))}\n".encode())
  return h.hexdigest()[:16]


def describe() -> dict:
  root = stdlib_root()
  files = stdlib_files(root)
  return {
      "name": "stdlib",
      "python": f"{sys.version_info.major}.{sys.version_info.minor}",
      "root": root,
      "files": len(files),
      "fingerprint": fingerprint(root, files),
  }

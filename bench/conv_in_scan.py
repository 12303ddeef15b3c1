"""What a micro-batch loop costs the ResNet's gradient on XLA:CPU, with lax's convolution and with
models/conv.py's, timed alternately.

    python bench/conv_in_scan.py [--batch 2048] [--micro 1024] [--rounds 5] [--channels 48]

The vision workload's ResNet (channels, 3 blocks, kernel 5, ghost groups of 16) at `--batch`
examples: its loss gradient in one call (`whole`), and accumulated over `--batch / --micro`
micro-batches by a `lax.scan` (`scan`, what the train step runs under accumulation or while the
noise meter measures), each with lax's convolution (`lax`) and ours (`ours`). Every variant is
compiled and warmed up; then `--rounds` rounds time one gradient of each in turn. Prints each
variant's median seconds and the ratios scan / whole per convolution and lax / ours in the scan.
"""
from __future__ import annotations

import argparse
import os
import statistics
import sys
import time
from unittest import mock

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
import jax  # noqa: E402
import jax.numpy as jnp  # noqa: E402
import numpy as np  # noqa: E402
from flax import nnx  # noqa: E402

from models import resnet  # noqa: E402


def gradient(conv, channels: int, batch: int, micro: int):
  """(jitted gradient, its arguments) of the ResNet's loss sum over `batch` examples in
  micro-batches of `micro` (one call where micro == batch)."""
  with mock.patch.object(resnet, "conv_general_dilated", conv):
    model = resnet.ResNet1D(resnet.ResNetConfig(channels=channels), rngs=nnx.Rngs(0))
  graph, params, rest = nnx.split(model, nnx.Param, ...)
  params, rest = nnx.to_pure_dict(params), nnx.to_pure_dict(rest)  # as the train step holds them
  rng = np.random.default_rng(0)
  data = {"inputs": jnp.asarray(rng.normal(size=(batch // micro, micro, resnet.SIGNAL_LEN)),
                                jnp.float32),
          "targets": jnp.asarray(rng.integers(0, 10, (batch // micro, micro, 1)), jnp.int32),
          "loss_mask": jnp.ones((batch // micro, micro, 1), bool)}

  def loss(p, state, mb):  # the batch statistics it leaves are dropped (the train step keeps them)
    return nnx.merge(graph, p, state).sums(mb, train=True)[0]

  def scanned(p, state, data):
    grad = jax.grad(loss)
    if batch == micro:
      return grad(p, state, jax.tree.map(lambda x: x[0], data))
    zero = jax.tree.map(jnp.zeros_like, p)
    return jax.lax.scan(lambda acc, mb: (jax.tree.map(jnp.add, acc, grad(p, state, mb)), None),
                        zero, data)[0]

  return jax.jit(scanned), (params, rest, data)


def build_parser():
  parser = argparse.ArgumentParser("bench/conv_in_scan.py", description=__doc__.splitlines()[0])
  parser.add_argument("--batch", type=int, default=2048)
  parser.add_argument("--micro", type=int, default=1024)
  parser.add_argument("--channels", type=int, default=48)
  parser.add_argument("--rounds", type=int, default=5)
  return parser


def main(argv=None):
  parser = build_parser()
  args = parser.parse_args(argv)
  if args.batch % args.micro or args.micro % 16 or args.micro >= args.batch:
    parser.error(f"--micro {args.micro} must be a multiple of 16 below --batch {args.batch} "
                 "that divides it")
  convs = {"lax": jax.lax.conv_general_dilated, "ours": resnet.conv_general_dilated}
  variants = {(c, how): gradient(fn, args.channels, args.batch,
                                 args.batch if how == "whole" else args.micro)
              for c, fn in convs.items() for how in ("whole", "scan")}
  for f, a in variants.values():  # compile and warm up
    jax.block_until_ready(f(*a))
  times = {k: [] for k in variants}
  for r in range(args.rounds):
    order = list(variants)[r % len(variants):] + list(variants)[:r % len(variants)]
    for k in order:
      f, a = variants[k]
      t = time.perf_counter()
      jax.block_until_ready(f(*a))
      times[k].append(time.perf_counter() - t)
  med = {k: statistics.median(v) for k, v in times.items()}
  print(f"ResNet gradient, batch {args.batch}, {args.batch // args.micro} micro-batches of "
        f"{args.micro} in the scan, {args.channels} channels, {jax.devices()[0].platform}, "
        f"median of {args.rounds} rounds:")
  for (c, how), t in med.items():
    print(f"  {c:4s} {how:5s} {t:8.3f} s")
  for c in convs:
    print(f"  {c}: scan / whole = {med[(c, 'scan')] / med[(c, 'whole')]:.2f}")
  print(f"  in the scan, lax / ours = {med[('lax', 'scan')] / med[('ours', 'scan')]:.1f}")


if __name__ == "__main__":
  main()

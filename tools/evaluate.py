"""Loss, perplexity and bits per byte of a model over a whole data split (trainer/evaluation/split.py).

    python -m tools.evaluate --checkpoint SRC --data DIR [--split validation] \
        [--seq_len 128] [--stride 64] [--batch_size 16] [--config.mesh.AXIS=N ...]

SRC is a training workdir (newest checkpoint), a step dir, or a converted dir. --data defaults
to the training run's data dir and --seq_len to its sequence length. Every token of every
document but its first is scored exactly once, in windows of seq_len inputs that start a fresh
context: with --stride equal to seq_len (the default) the windows are disjoint and a token sees
only the tokens since its window's start (from 1 to seq_len); with a smaller --stride (the
sliding-window perplexity of Hugging Face's guide) each token sees at least seq_len - stride + 1
tokens, at seq_len / stride times the compute. When the checkpoint kept a parameter EMA
(optim.ema_decay > 0), the EMA weights are evaluated too, in the same pass. Prints one line per
weight set and writes them as JSON with --json PATH.
"""
from __future__ import annotations

import json
import sys

from data.prepare import DataError, read_meta
from tools.convert import mesh_from_overrides
from trainer.config import ConfigError
from trainer.config.cli import CliParser, quiet_library_logs
from trainer.multihost import platforms


def build_parser():
  parser = CliParser("-m tools.evaluate", __doc__, config=False)
  parser.add_argument("--checkpoint", required=True)
  parser.add_argument("--data", default="", help="prepared data dir (default: the run's)")
  parser.add_argument("--split", default="validation")
  parser.add_argument("--seq_len", type=int, default=0, help="0: the run's data.seq_len")
  parser.add_argument("--stride", type=int, default=0,
                      help="tokens between window starts, 1..seq_len; 0: seq_len (disjoint)")
  parser.add_argument("--batch_size", type=int, default=0,
                      help="rows per batch; 0: 4 per data-parallel device")
  parser.add_argument("--json", default="", help="also write the results to this file")
  return parser


def main(argv: list[str]) -> int:
  platforms.choose()
  from sharding.mesh import MeshError  # noqa: PLC0415  start-up
  parser = build_parser()
  try:
    args, overrides = parser.parse(argv)
    quiet_library_logs()
  except ConfigError as e:
    print(f"error: {e}", file=sys.stderr)
    return 2

  from sharding.mesh import data_parallel_size  # noqa: PLC0415  start-up
  from trainer.checkpoint.saved import CheckpointError  # noqa: PLC0415  start-up
  from trainer.evaluation.split import evaluate_split  # noqa: PLC0415  start-up
  from trainer.checkpoint.model_dirs import (  # noqa: PLC0415  start-up
      causal_source, data_tokenizer, restore_with_ema, run_data_dir)

  try:
    mesh = mesh_from_overrides(overrides)
    _, config = causal_source(args.checkpoint)
    run_data = config.get("data", {})
    if not args.data and "data" not in config:
      parser.error(f"{args.checkpoint} is not a training run: give --data DIR")
    data_dir = args.data or run_data_dir(run_data)
    meta = read_meta(data_dir)
    if args.split not in meta["splits"]:
      parser.error(f"--split {args.split}: {data_dir} has {', '.join(meta['splits'])}")
    seq_len = args.seq_len or run_data.get("seq_len") or 0
    if seq_len <= 0:
      parser.error("--seq_len: give the sequence length (the checkpoint does not name one)")
    stride = args.stride or seq_len
    if not 1 <= stride <= seq_len:
      parser.error(f"--stride {args.stride}: give 1 to seq_len={seq_len} (0 = seq_len)")
    dp = data_parallel_size(dict(mesh.shape))
    rows = args.batch_size or 4 * dp
    if rows % dp:
      parser.error(f"--batch_size {rows}: must divide over the {dp} data-parallel devices")
    spec, weights, config = restore_with_ema(args.checkpoint, mesh)
    if meta.get("vocab_size", 0) > spec.cfg.vocab_size:
      parser.error(f"{data_dir} has vocab_size {meta['vocab_size']}, more than the model's "
                   f"{spec.cfg.vocab_size}: it was tokenized for another model")
  except (CheckpointError, DataError, ConfigError, MeshError) as e:
    print(f"error: {e}", file=sys.stderr)
    return 2
  tok = data_tokenizer(data_dir)
  results = evaluate_split(spec, weights, data_dir, args.split, seq_len=seq_len,
                           batch_rows=rows, decode=tok.decode, stride=stride, log=print)
  for name, r in results.items():
    print(f"{args.split} [{name}]: loss={r['loss']:.4f} perplexity={r['perplexity']:.3f} "
          f"bits_per_byte={r['bits_per_byte']:.4f} tokens={r['tokens']} bytes={r['bytes']} "
          f"(seq_len={seq_len} stride={stride})")
  if args.json:
    with open(args.json, "w") as f:
      json.dump({"checkpoint": args.checkpoint, "data": data_dir, "split": args.split,
                 "seq_len": seq_len, "stride": stride, **results}, f, indent=1)
  return 0


if __name__ == "__main__":
  sys.exit(main(sys.argv[1:]))

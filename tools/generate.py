"""Sample from a model with a KV cache (models/decode.py): one compiled prefill, one compiled
decode step, a batch of prompts, on a mesh.

    python -m tools.generate --checkpoint SRC --prompt "Once upon" [--prompt "..."] \
        --max_new_tokens 64 --temperature 0.8 [--top_k 50 --top_p 0.95 --seed 0]
    python -m tools.generate --checkpoint SRC --prompt_ids 1,2,3 [--prompt_ids 4,5] \
        --max_new_tokens 16 --temperature 0

SRC is a training workdir (newest checkpoint), a step dir, or a converted dir
(`tools.convert from-hf`). Text prompts are encoded with the source's tokenizer (the training
data's, or the tokenizer files a converted model came with). For each prompt it prints the
generated text, and with --prompt_ids one more line: the generated ids, comma-separated.
--temperature 0 is greedy. `--ema` uses the parameter EMA when the checkpoint has one; the
mesh is all devices on `data` unless `--config.mesh.AXIS=N` says otherwise.
"""
from __future__ import annotations

import sys

from tools.convert import mesh_from_overrides
from trainer.config import ConfigError
from trainer.config.cli import CliParser, quiet_library_logs
from trainer.multihost import platforms


def build_parser():
  parser = CliParser("-m tools.generate", __doc__, config=False)
  parser.add_argument("--checkpoint", required=True)
  parser.add_argument("--prompt", action="append", default=[])
  parser.add_argument("--prompt_ids", action="append", default=[])
  parser.add_argument("--max_new_tokens", type=int, default=64)
  parser.add_argument("--temperature", type=float, default=0.8)
  parser.add_argument("--top_k", type=int, default=0)
  parser.add_argument("--top_p", type=float, default=1.0)
  parser.add_argument("--seed", type=int, default=0)
  parser.add_argument("--ema", action="store_true")
  return parser


def main(argv: list[str]) -> int:
  platforms.choose()
  from sharding.mesh import MeshError  # noqa: PLC0415  start-up
  parser = build_parser()
  try:
    args, overrides = parser.parse(argv)
    quiet_library_logs()
    if bool(args.prompt) == bool(args.prompt_ids):
      parser.error("give --prompt TEXT or --prompt_ids 1,2,3 (either may repeat), not both")
    if args.max_new_tokens < 1 or args.temperature < 0 or not 0 < args.top_p <= 1 \
        or args.top_k < 0:
      parser.error("need --max_new_tokens >= 1, --temperature >= 0, 0 < --top_p <= 1, "
                   "--top_k >= 0")
  except ConfigError as e:
    print(f"error: {e}", file=sys.stderr)
    return 2

  from models.decode import Generator  # noqa: PLC0415  start-up
  from trainer.checkpoint.saved import CheckpointError  # noqa: PLC0415  start-up
  from trainer.checkpoint.model_dirs import causal_source, restore_params, source_tokenizer  # noqa: PLC0415  start-up

  try:
    mesh = mesh_from_overrides(overrides)
    step_dir, config = causal_source(args.checkpoint)
    tok = source_tokenizer(step_dir, config)
    if args.prompt_ids:
      try:
        prompts = [[int(t) for t in p.split(",") if t.strip()] for p in args.prompt_ids]
      except ValueError:
        parser.error(f"--prompt_ids {args.prompt_ids}: comma-separated integers, e.g. 1,2,3")
    else:
      if tok is None:
        raise CheckpointError(f"{args.checkpoint} has no tokenizer to encode --prompt; use "
                              "--prompt_ids")
      prompts = [tok.encode(p, bos=True, eos=False).tolist() for p in args.prompt]
    spec, params, _, which = restore_params(args.checkpoint, mesh, ema=args.ema)
    vocab = spec.cfg.vocab_size
    if any(not 0 <= t < vocab for p in prompts for t in p):
      parser.error(f"prompt ids must be in [0, {vocab}) (model.vocab_size)")
  except (CheckpointError, ConfigError, MeshError) as e:
    print(f"error: {e}", file=sys.stderr)
    return 2
  eos = tok.eos_id if tok is not None else config.get("hf", {}).get("eos_token_id")
  eos = eos[0] if isinstance(eos, list) else eos
  gen = Generator(spec, params, temperature=args.temperature, top_k=args.top_k,
                  top_p=args.top_p)
  outputs = gen.generate(prompts, args.max_new_tokens, seed=args.seed, eos_id=eos)
  for prompt, ids in zip(prompts, outputs):
    if tok is not None:
      print(repr(tok.decode(prompt)) + " -> " + repr(tok.decode(ids)))
    if args.prompt_ids:
      print(",".join(map(str, ids)))
  return 0


if __name__ == "__main__":
  sys.exit(main(sys.argv[1:]))

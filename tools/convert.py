"""Hugging Face Llama checkpoints in and out.

    python -m tools.convert from-hf HF_DIR --out DIR [--param_dtype float32|bfloat16]
    python -m tools.convert to-hf SRC --out HF_DIR [--dtype bfloat16] [--max_shard_gb 5]

`from-hf` reads a Llama / Llama-3 style directory (config.json + model.safetensors or sharded
model-*.safetensors with an index) into a converted dir (trainer/checkpoint/model_dirs.py) that
`checkpoint.init_from`, `tools.generate` and `tools.evaluate` accept, each tensor straight from
the memory-mapped file to its shards on the mesh (`--config.mesh.fsdp=-1` style overrides; by
default all devices on `data`). `to-hf` writes config.json + safetensors (+ the tokenizer files
the source has) from a training workdir, a step dir or a converted dir, for
`transformers.LlamaForCausalLM.from_pretrained(HF_DIR)`. Mapping: models/hf.py.
What is supported and tested: docs/models_io.md#hugging-face-llama-in-and-out
"""
from __future__ import annotations

import json
import os
import sys

from trainer.config import ConfigError, default_config
from trainer.config.cli import CliParser, apply_override, quiet_library_logs
from trainer.multihost import platforms


def mesh_from_overrides(overrides: list[tuple[str, str]]):
  """The mesh given by `--config.mesh.KEY=VALUE` overrides: the run config's mesh keys, parsed
  and checked by the same code as train.py's (`trainer.config.cli`); other keys are refused."""
  from sharding.mesh import make_mesh  # noqa: PLC0415  start-up
  cfg = default_config()
  for key, text in overrides:
    if not key.startswith("mesh."):
      raise ConfigError(f"--config.{key}: this tool takes only --config.mesh.* overrides")
    apply_override(cfg, key, text)
  return make_mesh(cfg.mesh)


def from_hf(hf_dir: str, out_dir: str, *, param_dtype: str | None = None, mesh=None) -> dict:
  """Convert; returns the converted dir's model config (as a dict)."""
  import jax  # noqa: PLC0415  start-up

  from models.hf import ConvertError, load_hf_params, model_config_from_hf  # noqa: PLC0415  start-up
  from trainer.checkpoint.model_dirs import write_converted  # noqa: PLC0415  start-up
  from trainer.step.state import ModelSpec  # noqa: PLC0415  start-up

  path = os.path.join(hf_dir, "config.json")
  if not os.path.isfile(path):
    raise ConvertError(f"{hf_dir}: no config.json (expected a Hugging Face model directory)")
  with open(path) as f:
    hf_cfg = json.load(f)
  cfg = model_config_from_hf(hf_cfg, param_dtype=param_dtype)
  mesh = mesh or mesh_from_overrides([])
  spec = ModelSpec(cfg, mesh, seed=0)
  with jax.set_mesh(mesh):
    params = load_hf_params(hf_dir, cfg, spec.abstract_params)
  special = {k: hf_cfg.get(k) for k in ("bos_token_id", "eos_token_id", "pad_token_id")}
  write_converted(out_dir, params, cfg, source=os.path.abspath(hf_dir), tokenizer_dir=hf_dir,
                  extra={"hf": {"max_position_embeddings": hf_cfg.get("max_position_embeddings"),
                                **special}})
  return cfg.to_dict()


def to_hf(src: str, out_dir: str, *, dtype: str | None = None, max_shard_bytes: int = 5 << 30,
          mesh=None) -> list[str]:
  """Export; returns the files written."""
  from models.hf import save_hf  # noqa: PLC0415  start-up
  from trainer.checkpoint.model_dirs import resolve_step_dir  # noqa: PLC0415  start-up
  from trainer.checkpoint.model_dirs import copy_tokenizer, restore_params, tokenizer_dir  # noqa: PLC0415  start-up

  from models.hf import ConvertError  # noqa: PLC0415  start-up
  step_dir = resolve_step_dir(src, "to-hf SRC")
  if _holds_a_run(out_dir, step_dir):
    raise ConvertError(f"--out {out_dir}: is the source's own directory or holds a run or "
                       "checkpoint (writing config.json and the weights there would overwrite "
                       f"its files); give a new directory, e.g. --out {os.path.join(src, 'hf')}")
  mesh = mesh or mesh_from_overrides([])
  spec, params, config, _ = restore_params(src, mesh, flag="to-hf SRC")
  if spec.cfg.width_multiplier != 1.0:
    # Hugging Face's Llama has no output or query multipliers to carry muP's 1/m and 1/D.
    raise ConvertError(f"{src}: a muP model at width multiplier {spec.cfg.width_multiplier:g} "
                       "(model.parametrization='mup', d_model != base_width) cannot be exported "
                       "to the Hugging Face Llama layout; export a model at its base width")
  if spec.cfg.residual_multiplier != 1.0:  # nor a residual-branch multiplier
    raise ConvertError(f"{src}: a model with residual branches x {spec.cfg.residual_multiplier:g}"
                       f" (model.depth_parametrization={spec.cfg.depth_parametrization!r}, "
                       "num_layers != base_depth) cannot be exported to the Hugging Face Llama "
                       "layout; export a model at its base depth")
  hf_meta = config.get("hf", {})
  special = {"bos_id": hf_meta.get("bos_token_id"), "eos_id": hf_meta.get("eos_token_id"),
             "pad_id": hf_meta.get("pad_token_id")}
  tok_dir = tokenizer_dir(step_dir, config)
  if "data" in config:  # a training run: its data dir names the tokenizer
    special, tok_dir = _training_tokenizer(config, special)
  max_pos = hf_meta.get("max_position_embeddings") or config.get("data", {}).get("seq_len", 2048)
  files = save_hf(params, spec.cfg, out_dir, dtype=dtype or spec.cfg.param_dtype,
                  max_shard_bytes=max_shard_bytes, max_position_embeddings=max_pos,
                  special_ids=special)
  return files + copy_tokenizer(tok_dir, out_dir)


def _holds_a_run(out_dir: str, step_dir: str) -> bool:
  """Whether `out_dir` is the checkpoint `step_dir`, its checkpoints dir or workdir, or any
  directory holding a training run or a checkpoint (what to-hf must never write into)."""
  out = os.path.realpath(out_dir)
  own = {os.path.realpath(step_dir)}
  parent = os.path.dirname(os.path.realpath(step_dir))
  if os.path.basename(parent) == "checkpoints":
    own |= {parent, os.path.dirname(parent)}
  return out in own or any(os.path.exists(os.path.join(out, name))
                           for name in ("checkpoints", "state", "metrics.jsonl"))


def _training_tokenizer(config: dict, special: dict) -> tuple[dict, str | None]:
  """Special ids and tokenizer-file dir of a training run's data (byte tokenizer: no files)."""
  from trainer.checkpoint.model_dirs import data_tokenizer, run_data_dir  # noqa: PLC0415  start-up
  tok = data_tokenizer(run_data_dir(config["data"]))
  files = tok.files()
  return ({"bos_id": tok.bos_id, "eos_id": tok.eos_id, "pad_id": tok.pad_id},
          os.path.dirname(files[0]) if files else None)


def build_parser():
  parser = CliParser("-m tools.convert", __doc__, config=False)
  sub = parser.add_subparsers(dest="cmd", required=True)
  a = sub.add_parser("from-hf", help="Hugging Face Llama dir -> converted dir", config=False)
  a.add_argument("hf_dir")
  a.add_argument("--out", required=True)
  a.add_argument("--param_dtype", choices=("float32", "bfloat16"), default=None,
                 help="dtype of the converted parameters (default: the checkpoint's)")
  b = sub.add_parser("to-hf", help="workdir / converted dir -> Hugging Face Llama dir",
                     config=False)
  b.add_argument("src")
  b.add_argument("--out", required=True)
  b.add_argument("--dtype", choices=("float32", "bfloat16", "float16"), default=None,
                 help="dtype of the written tensors (default: the parameters')")
  b.add_argument("--max_shard_gb", type=float, default=5.0)
  return parser


def main(argv: list[str]) -> int:
  platforms.choose()
  from models.hf import ConvertError  # noqa: PLC0415  start-up
  from sharding.mesh import MeshError  # noqa: PLC0415  start-up
  from trainer.checkpoint.saved import CheckpointError  # noqa: PLC0415  start-up
  try:
    args, overrides = build_parser().parse(argv)
    quiet_library_logs()
    mesh = mesh_from_overrides(overrides)
    if args.cmd == "from-hf":
      cfg = from_hf(args.hf_dir, args.out, param_dtype=args.param_dtype, mesh=mesh)
      print(f"converted {args.hf_dir} -> {args.out}")
      print("model: " + " ".join(f"{k}={v}" for k, v in cfg.items()))
    else:
      files = to_hf(args.src, args.out, dtype=args.dtype,
                    max_shard_bytes=int(args.max_shard_gb * (1 << 30)), mesh=mesh)
      print(f"wrote {args.out}: {', '.join(files)}")
  except (ConfigError, MeshError, ConvertError, CheckpointError) as e:
    print(f"error: {e}", file=sys.stderr)
    return 2
  return 0


if __name__ == "__main__":
  sys.exit(main(sys.argv[1:]))

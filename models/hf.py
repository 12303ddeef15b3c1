"""Hugging Face Llama checkpoints <-> this model's parameters.

The layouts agree except for orientation: Hugging Face stores `nn.Linear` weights as
[out, in] and one tensor per layer; we store [in, out] split by heads ([E, H, D] for q) and
stack the layers on a leading axis (scanned). RoPE needs no permutation: `apply_rope` uses the
rotate-half form that Hugging Face Llama checkpoints are laid out for. `PARAM_MAP` is the whole
mapping, one row per tensor, used in both directions.

Safetensors files are read and written here with numpy (the format is an 8-byte header length,
a JSON header and raw little-endian arrays): files are memory-mapped, so reading a tensor
touches only its bytes, bfloat16 works through `ml_dtypes`, and neither torch nor the
`safetensors` package is needed. Loading builds each parameter with
`jax.make_array_from_callback`: every device's shard is read from the mapped file for just the
layers and slices it holds, so the host never holds the model, and on a mesh each tensor goes
straight to its sharding.
"""
from __future__ import annotations

import json
import math
import os
import struct
from collections.abc import Callable

import jax
import ml_dtypes
import numpy as np

from models.llama import ModelConfig
from models.rope import RopeScaling

_ST_DTYPES = {"F32": np.float32, "F16": np.float16, "BF16": ml_dtypes.bfloat16,
              "F64": np.float64, "I64": np.int64, "I32": np.int32}
_ST_NAMES = {np.dtype(v): k for k, v in _ST_DTYPES.items()}
HF_DTYPES = {"float32": "float32", "bfloat16": "bfloat16", "float16": "float16"}


class ConvertError(ValueError):
  """A checkpoint this converter cannot read (one line for the user)."""


# ----------------------------------------------------------------------------------------------
# The mapping. Each row: our parameter path, the HF tensor name ({i} = layer), and the
# transform HF -> ours of one layer's tensor (the inverse is derived from the shapes).


def _rows(cfg: ModelConfig) -> list[tuple[str, str, str]]:
  """(our path, HF name, kind). kinds: 'copy' (same array), 'linear' ([out,in] -> [in,out]),
  'q'/'kv' ([H*D, E] -> [E, H, D]), 'o' ([E, H*D] -> [H, D, E])."""
  if cfg.moe.enabled:
    raise ValueError(f"Hugging Face conversion maps dense Llama models only; this model has "
                     f"model.moe.num_experts={cfg.moe.num_experts} (no MoE mapping)")
  rows = [("embed_VE", "model.embed_tokens.weight", "copy"),
          ("final_norm/scale", "model.norm.weight", "copy")]
  if not cfg.tie_embeddings:
    rows.append(("lm_head_EV", "lm_head.weight", "linear"))
  layer = "model.layers.{i}."
  rows += [
      ("blocks/attn_norm/scale", layer + "input_layernorm.weight", "copy"),
      ("blocks/mlp_norm/scale", layer + "post_attention_layernorm.weight", "copy"),
      ("blocks/attn/wq_EHD", layer + "self_attn.q_proj.weight", "heads"),
      ("blocks/attn/wk_EKD", layer + "self_attn.k_proj.weight", "heads"),
      ("blocks/attn/wv_EKD", layer + "self_attn.v_proj.weight", "heads"),
      ("blocks/attn/wo_HDE", layer + "self_attn.o_proj.weight", "o"),
      ("blocks/mlp/w_gate_EF", layer + "mlp.gate_proj.weight", "linear"),
      ("blocks/mlp/w_up_EF", layer + "mlp.up_proj.weight", "linear"),
      ("blocks/mlp/w_down_FE", layer + "mlp.down_proj.weight", "linear"),
  ]
  return rows


def _to_ours(kind: str, x: np.ndarray, shape: tuple[int, ...]) -> np.ndarray:
  if kind == "copy":
    return x
  if kind in ("linear", "heads"):
    return x.T.reshape(shape)
  if kind == "o":  # [E, H*D] -> [H*D, E] -> [H, D, E]
    return x.T.reshape(shape)
  raise AssertionError(kind)


def _to_hf(kind: str, x: np.ndarray) -> np.ndarray:
  if kind == "copy":
    return x
  if kind == "linear":
    return np.ascontiguousarray(x.T)
  if kind == "heads":  # [E, H, D] -> [H*D, E]
    return np.ascontiguousarray(x.reshape(x.shape[0], -1).T)
  if kind == "o":  # [H, D, E] -> [E, H*D]
    return np.ascontiguousarray(x.reshape(-1, x.shape[-1]).T)
  raise AssertionError(kind)


def _get(tree: dict, path: str):
  for part in path.split("/"):
    tree = tree[part]
  return tree


def _set(tree: dict, path: str, value) -> None:
  *parents, last = path.split("/")
  for part in parents:
    tree = tree.setdefault(part, {})
  tree[last] = value


# ----------------------------------------------------------------------------------------------
# Configs


def model_config_from_hf(hf: dict, *, param_dtype: str | None = None) -> ModelConfig:
  """Our ModelConfig from a Hugging Face Llama `config.json` (transformers 4.x or 5.x keys)."""
  if hf.get("model_type", "llama") != "llama":
    raise ConvertError(f"config.json has model_type={hf.get('model_type')!r}; only Llama-style "
                       "checkpoints (model_type 'llama') are supported")
  for key in ("attention_bias", "mlp_bias"):
    if hf.get(key):
      raise ConvertError(f"config.json has {key}=true; this model has no biases")
  if hf.get("hidden_act", "silu") != "silu":
    raise ConvertError(f"config.json has hidden_act={hf['hidden_act']!r}; only silu is supported")
  rope = dict(hf.get("rope_parameters") or {})  # transformers 5 puts rope_theta in here
  legacy = hf.get("rope_scaling") or {}
  rope = {**legacy, **rope}
  theta = rope.get("rope_theta", hf.get("rope_theta", 10_000.0))
  kind = rope.get("rope_type", rope.get("type", "default"))
  if kind == "default":
    scaling = RopeScaling()
  elif kind == "llama3":
    scaling = RopeScaling("llama3", float(rope["factor"]), float(rope["low_freq_factor"]),
                          float(rope["high_freq_factor"]),
                          int(rope["original_max_position_embeddings"]))
  else:
    raise ConvertError(f"config.json has rope type {kind!r}; supported: default, llama3")
  heads = hf["num_attention_heads"]
  head_dim = hf.get("head_dim") or hf["hidden_size"] // heads
  dtype = param_dtype or HF_DTYPES.get(str(hf.get("torch_dtype") or hf.get("dtype")), "float32")
  return ModelConfig(
      vocab_size=hf["vocab_size"], d_model=hf["hidden_size"], num_layers=hf["num_hidden_layers"],
      num_heads=heads, num_kv_heads=hf.get("num_key_value_heads") or heads,
      head_dim=0 if head_dim == hf["hidden_size"] // heads else head_dim,
      mlp_dim=hf["intermediate_size"], rope_theta=float(theta),
      norm_eps=float(hf.get("rms_norm_eps", 1e-6)),
      tie_embeddings=bool(hf.get("tie_word_embeddings", False)), param_dtype=dtype,
      dtype=dtype, rope_scaling=scaling)


def hf_config_from_model(cfg: ModelConfig, *, dtype: str, max_position_embeddings: int,
                         bos_id: int | None = None, eos_id: int | None = None,
                         pad_id: int | None = None) -> dict:
  """A `config.json` that transformers' LlamaForCausalLM loads (legacy keys, read by 4.x and
  5.x alike)."""
  if not cfg.causal:
    raise ConvertError("a bidirectional encoder (model.causal=False, the masked LM) has no "
                       "Llama form: LlamaForCausalLM would run it causally")
  scaling = None
  if cfg.rope_scaling.type == "llama3":
    s = cfg.rope_scaling
    scaling = {"rope_type": "llama3", "factor": s.factor, "low_freq_factor": s.low_freq_factor,
               "high_freq_factor": s.high_freq_factor,
               "original_max_position_embeddings": s.original_max_position_embeddings}
  return {
      "architectures": ["LlamaForCausalLM"], "model_type": "llama",
      "vocab_size": cfg.vocab_size, "hidden_size": cfg.d_model,
      "intermediate_size": cfg.mlp_dim, "num_hidden_layers": cfg.num_layers,
      "num_attention_heads": cfg.num_heads, "num_key_value_heads": cfg.num_kv_heads,
      "head_dim": cfg.dim_per_head, "hidden_act": "silu", "rms_norm_eps": cfg.norm_eps,
      "rope_theta": cfg.rope_theta, "rope_scaling": scaling,
      "max_position_embeddings": max_position_embeddings,
      "tie_word_embeddings": cfg.tie_embeddings, "attention_bias": False, "mlp_bias": False,
      "bos_token_id": bos_id, "eos_token_id": eos_id, "pad_token_id": pad_id,
      "torch_dtype": dtype, "use_cache": True,
  }


# ----------------------------------------------------------------------------------------------
# Safetensors with numpy


class SafetensorsDir:
  """The tensors of an HF model directory (one model.safetensors or an index of shards),
  memory-mapped: `get(name)` reads only that tensor's bytes."""

  def __init__(self, hf_dir: str):
    index = os.path.join(hf_dir, "model.safetensors.index.json")
    if os.path.exists(index):
      with open(index) as f:
        weight_map = json.load(f)["weight_map"]
    elif os.path.exists(os.path.join(hf_dir, "model.safetensors")):
      weight_map = None
    else:
      raise ConvertError(f"{hf_dir}: no model.safetensors or model.safetensors.index.json "
                         "(only safetensors checkpoints are read)")
    self._where: dict[str, tuple[str, dict]] = {}
    files = sorted(set(weight_map.values())) if weight_map else ["model.safetensors"]
    self._maps: dict[str, np.memmap] = {}
    for name in files:
      path = os.path.join(hf_dir, name)
      with open(path, "rb") as f:
        (n,) = struct.unpack("<Q", f.read(8))
        header = json.loads(f.read(n))
      header.pop("__metadata__", None)
      self._maps[path] = np.memmap(path, dtype=np.uint8, mode="r", offset=8 + n)
      for tensor, info in header.items():
        self._where[tensor] = (path, info)

  def names(self) -> set[str]:
    return set(self._where)

  def get(self, name: str) -> np.ndarray:
    if name not in self._where:
      raise ConvertError(f"the checkpoint has no tensor {name!r}")
    path, info = self._where[name]
    if info["dtype"] not in _ST_DTYPES:
      raise ConvertError(f"tensor {name!r} has dtype {info['dtype']}, not a float type")
    start, end = info["data_offsets"]
    return self._maps[path][start:end].view(_ST_DTYPES[info["dtype"]]).reshape(info["shape"])


def write_safetensors(path: str, tensors: dict[str, np.ndarray]) -> None:
  header, offset = {"__metadata__": {"format": "pt"}}, 0
  for name, x in tensors.items():
    header[name] = {"dtype": _ST_NAMES[x.dtype], "shape": list(x.shape),
                    "data_offsets": [offset, offset + x.nbytes]}
    offset += x.nbytes
  blob = json.dumps(header, separators=(",", ":")).encode()
  blob += b" " * (-len(blob) % 8)  # the data starts 8-byte aligned
  with open(path, "wb") as f:
    f.write(struct.pack("<Q", len(blob)))
    f.write(blob)
    for x in tensors.values():
      f.write(np.ascontiguousarray(x).astype(x.dtype.newbyteorder("<")).tobytes())


# ----------------------------------------------------------------------------------------------
# HF -> ours


def load_hf_params(hf_dir: str, cfg: ModelConfig, abstract_params) -> dict:
  """Parameters in our layout, each created straight into the sharding of its entry in
  `abstract_params` (ShapeDtypeStructs with shardings, e.g. `ModelSpec.abstract_params`)."""
  source = SafetensorsDir(hf_dir)
  out: dict = {}
  for path, name, kind in _rows(cfg):
    target = _get(abstract_params, path)
    stacked = "{i}" in name
    layer_shape = target.shape[1:] if stacked else target.shape

    def read(i: int | None, name=name, kind=kind, layer_shape=layer_shape, target=target):
      x = source.get(name.format(i=i) if i is not None else name)
      if int(np.prod(x.shape)) != math.prod(layer_shape):
        raise ConvertError(f"tensor {name.format(i=i)!r} has shape {tuple(x.shape)}, the config "
                           f"implies {layer_shape} for {target.shape}")
      return _to_ours(kind, x, layer_shape).astype(target.dtype)

    def shard(index, read=read, stacked=stacked, target=target):
      if not stacked:
        return np.ascontiguousarray(read(None)[index])
      layers = range(target.shape[0])[index[0]]
      return np.ascontiguousarray(np.stack([read(i)[index[1:]] for i in layers]))

    _set(out, path, jax.make_array_from_callback(target.shape, target.sharding, shard))
  return out


# ----------------------------------------------------------------------------------------------
# Ours -> HF


def export_hf_tensors(params: dict, cfg: ModelConfig, dtype) -> Callable:
  """A generator of (HF name, numpy array in `dtype`), one tensor at a time (a stacked
  parameter is fetched from the devices one layer at a time)."""

  def tensors():
    for path, name, kind in _rows(cfg):
      x = _get(params, path)
      if "{i}" in name:
        for i in range(cfg.num_layers):
          yield name.format(i=i), _to_hf(kind, np.asarray(jax.device_get(x[i]))).astype(dtype)
      else:
        yield name, _to_hf(kind, np.asarray(jax.device_get(x))).astype(dtype)

  return tensors


def save_hf(params: dict, cfg: ModelConfig, out_dir: str, *, dtype: str = "float32",
            max_shard_bytes: int = 5 << 30, max_position_embeddings: int = 2048,
            special_ids: dict | None = None) -> list[str]:
  """Write config.json + safetensors (sharded with an index past `max_shard_bytes`) that
  `transformers.LlamaForCausalLM.from_pretrained(out_dir)` loads. Returns the files written."""
  os.makedirs(out_dir, exist_ok=True)
  np_dtype = np.dtype(ml_dtypes.bfloat16) if dtype == "bfloat16" else np.dtype(dtype)
  # One shard in memory at a time: full shards are written under a provisional name and
  # renamed once their count is known.
  written: list[tuple[str, list[str]]] = []
  shard: dict[str, np.ndarray] = {}

  def flush():
    tmp = f"model-{len(written) + 1:05d}.safetensors.partial"
    write_safetensors(os.path.join(out_dir, tmp), shard)
    written.append((tmp, list(shard)))
    shard.clear()

  for name, x in export_hf_tensors(params, cfg, np_dtype)():
    if shard and sum(v.nbytes for v in shard.values()) + x.nbytes > max_shard_bytes:
      flush()
    shard[name] = x
  flush()
  files, weight_map = [], {}
  for k, (tmp, names) in enumerate(written):
    final = ("model.safetensors" if len(written) == 1
             else f"model-{k + 1:05d}-of-{len(written):05d}.safetensors")
    os.replace(os.path.join(out_dir, tmp), os.path.join(out_dir, final))
    weight_map.update({n: final for n in names})
    files.append(final)
  if len(written) > 1:
    total = sum(_get(params, p).size for p, _, _ in _rows(cfg)) * np_dtype.itemsize
    with open(os.path.join(out_dir, "model.safetensors.index.json"), "w") as f:
      json.dump({"metadata": {"total_size": int(total)}, "weight_map": weight_map}, f, indent=1)
    files.append("model.safetensors.index.json")
  hf = hf_config_from_model(cfg, dtype=dtype, max_position_embeddings=max_position_embeddings,
                            **(special_ids or {}))
  with open(os.path.join(out_dir, "config.json"), "w") as f:
    json.dump(hf, f, indent=1)
  files.append("config.json")
  return files

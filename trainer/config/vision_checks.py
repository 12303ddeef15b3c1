"""The vision workload's config (`model.kind="resnet1d"`, models/resnet.py, data/mnist1d.py):
its own keys, and the options of the LM it does not support, each one line before compiling."""
from __future__ import annotations

import ml_collections

from models.resnet import SIGNAL_LEN
from trainer.config.defaults import need as _need

MODEL_KINDS = ("transformer", "resnet1d")


def check_vision(cfg: ml_collections.ConfigDict, sizes: dict) -> None:
  """Raise ConfigError (one line: the key, its value, what would work) for a vision run that
  cannot run as configured."""
  m, d, r = cfg.model, cfg.data, cfg.model.resnet
  _need(m.kind in MODEL_KINDS, f"model.kind={m.kind!r}: must be one of {', '.join(MODEL_KINDS)}")
  if m.kind != "resnet1d":
    return
  for key in ("channels", "blocks", "kernel", "bn_group"):
    _need(r[key] >= 1, f"model.resnet.{key}={r[key]}: must be positive")
  _need(0 <= r.bn_momentum < 1, f"model.resnet.bn_momentum={r.bn_momentum}: must be in [0, 1)")
  _need(0 <= r.label_smoothing < 1,
        f"model.resnet.label_smoothing={r.label_smoothing}: must be in [0, 1) (MLPerf: 0.1)")
  _need(d.mnist1d.train_examples >= 10, f"data.mnist1d.train_examples="
        f"{d.mnist1d.train_examples}: must be at least 10 (one per digit); the issue's range "
        "is 20,000-100,000")
  _need(d.seq_len == SIGNAL_LEN, f"data.seq_len={d.seq_len} with model.kind='resnet1d': "
        f"mnist1d's signals have {SIGNAL_LEN} samples (the loop counts them as an example's "
        f"tokens); use data.seq_len={SIGNAL_LEN}")
  g = r.bn_group
  for key in ("global_batch_size", "micro_batch_size"):
    _need(d[key] % g == 0, f"data.{key}={d[key]} is not a multiple of model.resnet.bn_group={g} "
          f"(ghost batch norm normalises over groups of {g} examples); use a multiple of {g}, "
          f"e.g. {max(g, d[key] // g * g)}")
  unsupported = (
      ("mesh.stage", sizes["stage"], 1), ("mesh.sequence", sizes["sequence"], 1),
      ("optim.diloco.replicas", cfg.optim.diloco.replicas, 0),
      ("data.batch_ramp", d.batch_ramp, ""), ("data.mixture", d.mixture, ""),
      ("data.mask_rate", d.mask_rate, 0.0), ("checkpoint.init_from", cfg.checkpoint.init_from, ""))
  for key, value, works in unsupported:
    _need(value == works, f"{key}={value!r} with model.kind='resnet1d': the vision workload "
          f"does not support it; use {key}={works!r}")

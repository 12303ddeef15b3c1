"""lm-evaluation-harness adapter: any checkpoint of this stack as an `lm_eval` model.

    from tools.lm_eval_adapter import ScaletrainLM
    import lm_eval
    lm = ScaletrainLM("runs/tiny")            # a workdir, step dir or converted dir
    lm_eval.simple_evaluate(model=lm, tasks=["hellaswag"], ...)

or from the harness's CLI, which finds the class by its registered name:

    python -m tools.lm_eval_adapter --model_args checkpoint=runs/tiny --tasks lambada_openai

It implements the harness's `LM` interface (lm-eval 0.4): `loglikelihood`,
`loglikelihood_rolling` and `generate_until` (KV-cache generation), scoring with one compiled
forward of [batch_size, max_length]. Needs the `lm-eval` extra.
Each method's contract: docs/models_io.md#lm-evaluation-harness
"""
from __future__ import annotations

import sys

import jax
import jax.numpy as jnp
import numpy as np
from lm_eval.api.model import LM
from lm_eval.api.registry import register_model

from models.decode import Generator
from tools.convert import mesh_from_overrides
from trainer.checkpoint.model_dirs import causal_source, restore_params, source_tokenizer
from trainer.evaluation.split import windows


@register_model("scaletrain")
class ScaletrainLM(LM):

  def __init__(self, checkpoint: str, batch_size: int | str = 8, max_length: int | str = 0,
               ema: bool | str = False, mesh=None, **_):
    super().__init__()
    self.checkpoint = checkpoint
    step_dir, config = causal_source(checkpoint)
    self.tok = source_tokenizer(step_dir, config)
    if self.tok is None:
      raise ValueError(f"{checkpoint} has no tokenizer; lm-eval requests are text")
    self.mesh = mesh or mesh_from_overrides([])
    self.spec, self.params, _, _ = restore_params(checkpoint, self.mesh,
                                                  ema=str(ema).lower() in ("1", "true"))
    self.batch_size = int(batch_size)
    self.max_length = int(max_length) or int(
        config.get("data", {}).get("seq_len") or config.get("hf", {}).get(
            "max_position_embeddings") or 2048)
    spec = self.spec

    def score(params, inputs_BS, targets_BS):
      logits_BSV = spec.model(params)(inputs_BS)
      logp_BSV = jax.nn.log_softmax(logits_BSV, axis=-1)
      logp_BS = jnp.take_along_axis(logp_BSV, targets_BS[..., None], axis=-1)[..., 0]
      return logp_BS, jnp.argmax(logits_BSV, axis=-1) == targets_BS

    self._score = jax.jit(score)
    self._generators: dict = {}

  # ------------------------------------------------------------------------------------------

  def _encode(self, text: str, bos: bool = True) -> list[int]:
    return [int(t) for t in self.tok.encode(text, bos=bos, eos=False)]

  def _score_rows(self, rows: list[tuple[list[int], int]]) -> list[tuple[float, bool]]:
    """rows: (tokens, n) -> (sum of log p of the last n tokens given the ones before, greedy)."""
    S, out = self.max_length, []
    for start in range(0, len(rows), self.batch_size):
      chunk = rows[start:start + self.batch_size]
      inputs = np.zeros((self.batch_size, S), np.int32)
      targets = np.zeros((self.batch_size, S), np.int32)
      for b, (tokens, _) in enumerate(chunk):
        tokens = tokens[-(S + 1):]
        inputs[b, :len(tokens) - 1] = tokens[:-1]
        targets[b, :len(tokens) - 1] = tokens[1:]
      with jax.set_mesh(self.mesh):
        logp, greedy = jax.device_get(self._score(self.params, inputs, targets))
      for b, (tokens, n) in enumerate(chunk):
        end = min(len(tokens), S + 1) - 1
        out.append((float(logp[b, end - n:end].sum()), bool(greedy[b, end - n:end].all())))
    return out

  def loglikelihood(self, requests) -> list[tuple[float, bool]]:
    rows = []
    for req in requests:
      context, continuation = req.args
      ctx = self._encode(context)
      whole = self._encode(context + continuation)
      if whole[:len(ctx)] != ctx or len(whole) <= len(ctx):  # a merge across the boundary
        whole = ctx + self._encode(continuation, bos=False)
      n = len(whole) - len(ctx)
      rows.append((whole, min(n, self.max_length)))
    return self._score_rows(rows)

  def loglikelihood_rolling(self, requests) -> list[float]:
    out = []
    for req in requests:
      tokens = np.asarray(self._encode(req.args[0]))
      rows = [(list(w), n) for w, n in windows(tokens, self.max_length)]
      out.append(sum(lp for lp, _ in self._score_rows(rows)) if rows else 0.0)
    return out

  def generate_until(self, requests) -> list[str]:
    out = []
    for req in requests:
      context, kwargs = req.args
      kwargs = dict(kwargs or {})
      until = kwargs.get("until") or []
      until = [until] if isinstance(until, str) else list(until)
      temperature = float(kwargs.get("temperature", 0.0)) if kwargs.get("do_sample") else 0.0
      key = (temperature, int(kwargs.get("top_k", 0) or 0), float(kwargs.get("top_p", 1.0)))
      if key not in self._generators:
        self._generators[key] = Generator(self.spec, self.params, temperature=key[0],
                                          top_k=key[1], top_p=key[2])
      prompt = self._encode(context)
      budget = int(kwargs.get("max_gen_toks", 256))
      prompt = prompt[-max(self.max_length - budget, 1):]
      ids = self._generators[key].generate([prompt], budget, eos_id=self.tok.eos_id)[0]
      text = self.tok.decode(ids)
      for stop in until:
        if stop and stop in text:
          text = text[:text.index(stop)]
      out.append(text)
    return out


def main(argv: list[str]) -> int:
  """The harness's own CLI, with this module's model registered."""
  from lm_eval.__main__ import cli_evaluate  # noqa: PLC0415  optional
  sys.argv = ["lm_eval", "--model", "scaletrain", *argv]
  cli_evaluate()
  return 0


if __name__ == "__main__":
  sys.exit(main(sys.argv[1:]))

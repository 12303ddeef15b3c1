"""The GPU tier (`JAX_PLATFORMS=cuda,cpu python -m pytest -m gpu`; skipped without a GPU, and
left out of the default run): what only a GPU can check.

  * the Pallas flash kernel compiled through Triton (not interpreted): output and all three
    gradients against an fp32 reference computed on the CPU at highest precision, for bf16 and
    fp32, MHA and GQA, packed segments, ragged lengths, head dims 64/80/128 -- at least as
    close as XLA's attention on the GPU in the same dtype (within 1.5x, or a floor); and the
    Mosaic GPU kernel (kernels/flash_mosaic.py, Hopper) the same way, bf16/fp16;
  * fp8 dense layers compiled to cuBLASLt fp8 GEMMs, equal to the CPU emulation;
  * a short bf16 training run with the flash kernel in the model, resumed from its checkpoint
    (the same curve), and cuDNN's attention (`model.attention=cudnn`) on the same data;
  * greedy generation with the KV cache equal to greedy decoding by full forward passes (up to
    bf16 ties between the top two logits), on a model trained enough to decide most steps;
  * tools.memory_check's prediction of a run's peak memory against the measured
    `peak_bytes_in_use` (issue 25's goal: within 10%).
"""
import os
import re
import subprocess
import sys

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from conftest import losses, tiny_config
from kernels import flash_attention
from models.attention import segment_mask

pytestmark = pytest.mark.gpu
ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))

CASES = {
    # name: (dtype, B, S, H, K, D, causal, segments)
    "bf16_mha_causal_d64": (jnp.bfloat16, 2, 1024, 8, 8, 64, True, False),
    "bf16_gqa_segments_ragged_d128": (jnp.bfloat16, 2, 1000, 12, 4, 128, True, True),
    "bf16_noncausal_segments_ragged_d80": (jnp.bfloat16, 1, 777, 4, 2, 80, False, True),
    "fp32_gqa_segments_d64": (jnp.float32, 2, 512, 8, 2, 64, True, True),
    "fp32_ragged_d80": (jnp.float32, 1, 1000, 4, 4, 80, True, False),
}
FLOOR = {jnp.bfloat16: 4e-3, jnp.float32: 1e-3}  # bf16 rounding; TF32 (~3e-4) for fp32


def _inputs(B, S, H, K, D, segments, seed):
  ks = jax.random.split(jax.random.key(seed), 4)
  q = jax.random.normal(ks[0], (B, S, H, D), jnp.float32)
  k = jax.random.normal(ks[1], (B, S, K, D), jnp.float32)
  v = jax.random.normal(ks[2], (B, S, K, D), jnp.float32)
  do = jax.random.normal(ks[3], (B, S, H, D), jnp.float32)
  seg = None
  if segments:  # packed documents of random lengths, then a padding segment (0)
    seg = np.sort(np.random.RandomState(seed).randint(1, 6, (B, S)), axis=1)
    seg[:, -7:] = 0
  return q, k, v, do, seg


def _fwd_and_grads(fn, q, k, v, do, seg):
  out, vjp = jax.vjp(lambda q, k, v: fn(q, k, v, seg), q, k, v)
  return (out, *vjp(do))


def _reference(q, k, v, seg, causal):
  mask = None if seg is None else segment_mask(seg)
  return jax.nn.dot_product_attention(q, k, v, mask=mask, is_causal=causal, implementation="xla")


def _case(case, seed):
  """(the fp32 reference's output and gradients on the CPU, the GPU's inputs in the case's dtype,
  the GPU's segment ids or None) of one attention case."""
  dtype, B, S, H, K, D, causal, segments = case
  q, k, v, do, seg = _inputs(B, S, H, K, D, segments, seed=seed)
  cpu = jax.devices("cpu")[0]
  with jax.default_device(cpu), jax.default_matmul_precision("highest"):
    ref = _fwd_and_grads(lambda *a: _reference(*a, causal), q, k, v, do,
                         None if seg is None else jnp.asarray(seg))
    ref = [np.asarray(x, np.float64) for x in ref]
  gpu = jax.devices("gpu")[0]
  gpu_args = [jax.device_put(x.astype(dtype), gpu) for x in (q, k, v, do)]
  return ref, gpu_args, None if seg is None else jax.device_put(jnp.asarray(seg), gpu)


def _as_close_as_xla(ours, xla, ref, floor):
  """Each of out, dq, dk, dv at least as close to the fp32 reference as XLA's attention in the
  same dtype (within 1.5x), or within `floor`."""
  for part, o, x, r in zip(("out", "dq", "dk", "dv"), ours, xla, ref):
    o, x = np.asarray(o, np.float64), np.asarray(x, np.float64)
    assert np.all(np.isfinite(o)), part
    e_ours = np.linalg.norm(o - r) / np.linalg.norm(r)
    e_xla = np.linalg.norm(x - r) / np.linalg.norm(r)
    assert e_ours <= max(1.5 * e_xla, floor), (part, e_ours, e_xla)


@pytest.mark.parametrize("name", list(CASES))
def test_compiled_flash_kernel_matches_fp32_reference(name):
  dtype, causal = CASES[name][0], CASES[name][6]
  ref, gpu_args, seg_gpu = _case(CASES[name], seed=len(name))
  flash = lambda q, k, v, s: flash_attention(q, k, v, causal=causal, segment_ids=s,
                                             interpret=False)
  grads = jax.jit(lambda *a: _fwd_and_grads(flash, *a))
  assert "__gpu$xla.gpu.triton" in grads.lower(*gpu_args, seg_gpu).as_text()  # compiled kernel
  ours = grads(*gpu_args, seg_gpu)
  xla = jax.jit(lambda *a: _fwd_and_grads(lambda q, k, v, s: _reference(q, k, v, s, causal),
                                          *a))(*gpu_args, seg_gpu)
  _as_close_as_xla(ours, xla, ref, FLOOR[dtype])


MOSAIC_CASES = {  # the Mosaic GPU kernel (Hopper): 16-bit q/k/v, head dims a multiple of 64
    "bf16_mha_causal_d64": (jnp.bfloat16, 2, 1024, 8, 8, 64, True, False),
    "bf16_gqa_segments_ragged_d128": (jnp.bfloat16, 2, 1000, 12, 4, 128, True, True),
    "fp16_noncausal_segments_ragged_d64": (jnp.float16, 1, 777, 4, 2, 64, False, True),
}


@pytest.mark.parametrize("name", list(MOSAIC_CASES))
def test_compiled_mosaic_kernel_matches_fp32_reference(name):
  """kernels/flash_mosaic.py compiled (Mosaic GPU: wgmma, TMA) on a Hopper GPU, checked as the
  Triton kernel is: output and gradients at least as close to the fp32 reference as XLA's
  attention in the same dtype (within 1.5x, or bf16's floor)."""
  from kernels.flash_mosaic import flash_attention_mosaic
  if float(getattr(jax.devices("gpu")[0], "compute_capability", "0")) < 9.0:
    pytest.skip("the Mosaic GPU kernel needs a Hopper GPU (wgmma)")
  causal = MOSAIC_CASES[name][6]
  ref, gpu_args, seg_gpu = _case(MOSAIC_CASES[name], seed=len(name))
  mosaic = lambda q, k, v, s: flash_attention_mosaic(q, k, v, causal=causal, segment_ids=s)
  grads = jax.jit(lambda *a: _fwd_and_grads(mosaic, *a))
  assert grads.lower(*gpu_args, seg_gpu).as_text().count("mosaic_gpu") >= 3  # compiled kernels
  ours = grads(*gpu_args, seg_gpu)
  xla = jax.jit(lambda *a: _fwd_and_grads(lambda q, k, v, s: _reference(q, k, v, s, causal),
                                          *a))(*gpu_args, seg_gpu)
  _as_close_as_xla(ours, xla, ref, FLOOR[jnp.bfloat16])


def test_fp8_matmul_compiles_to_cublaslt_fp8_and_equals_the_emulation():
  from models.fp8 import fp8_matmul
  k1, k2, k3 = jax.random.split(jax.random.key(0), 3)
  x = jax.random.normal(k1, (512, 768), jnp.float32).astype(jnp.bfloat16)
  w = (jax.random.normal(k2, (768, 1024), jnp.float32) * 0.02).astype(jnp.bfloat16)
  g = (jax.random.normal(k3, (512, 1024), jnp.float32) * 1e-3).astype(jnp.bfloat16)

  def fwd_bwd(x, w, g):
    y, vjp = jax.vjp(fp8_matmul, x, w)
    return (y, *vjp(g))

  from trainer.step.program import FP8_GPU_OPTIONS  # what an fp8 train step compiles with
  gpu = jax.jit(fwd_bwd).lower(x, w, g).compile(compiler_options=FP8_GPU_OPTIONS)
  text = gpu.as_text()
  # forward, dX and dW: three fp8 GEMMs, not fp8 operands converted up for a bf16 dot nor
  # Triton GEMMs (issue 25's run, autotuned with Triton GEMMs on, made one of the three)
  assert text.count('custom_call_target="__cublas$lt$matmul$f8"') == 3, text[:3000]
  on_gpu = gpu(x, w, g)
  with jax.default_device(jax.devices("cpu")[0]):
    emulated = jax.jit(fwd_bwd)(*(jax.device_put(a, jax.devices("cpu")[0]) for a in (x, w, g)))
  for a, b in zip(on_gpu, emulated):  # the same fp8 operands: differences are summation order
    a, b = np.asarray(a, np.float32), np.asarray(b, np.float32)
    assert np.linalg.norm(a - b) / np.linalg.norm(b) < 1e-2


@pytest.fixture(scope="module")
def trained(tmp_path_factory):
  """bf16 tiny runs with the compiled flash kernel in the model: straight to step 6, and to 3
  then resumed to 6; and cuDNN's attention (by name: `auto` picks our kernel for the packed
  documents training feeds) to step 1."""
  root = tmp_path_factory.mktemp("gpu_runs")
  from trainer.run.loop import Run
  base = {"model.d_model": 64, "model.mlp_dim": 128, "model.dtype": "bfloat16",
          "model.attention": "flash", "checkpoint.every_steps": 3, "steps": 6}
  Run(tiny_config(**base), str(root / "straight")).train()
  Run(tiny_config(**{**base, "steps": 3}), str(root / "resumed")).train()
  Run(tiny_config(**base), str(root / "resumed")).train()
  Run(tiny_config(**{**base, "steps": 1, "model.attention": "cudnn"}), str(root / "auto")).train()
  return root


def test_train_and_resume_on_gpu(trained):
  a, b = losses(trained / "straight"), losses(trained / "resumed")
  assert sorted(a) == sorted(b) == list(range(1, 7))
  assert all(np.isfinite(list(a.values()))) and a[6] < a[1]
  # Resumed from step 3's checkpoint, the same curve (up to GPU reduction order in bf16).
  np.testing.assert_allclose([b[s] for s in range(4, 7)], [a[s] for s in range(4, 7)],
                             rtol=2e-3)
  auto = losses(trained / "auto")
  np.testing.assert_allclose(auto[1], a[1], rtol=1e-2)  # cuDNN vs our kernel, same data


# Two logits closer than this, relative to the step's largest |logit|, are a tie in bf16: 4 bf16
# steps (2^-8 each) at that magnitude. The cached path (jax.nn.dot_product_attention over the KV
# cache) and the full forward (the flash kernel) round bf16 activations differently; on this
# tiny model (CPU, the kernel interpreted) their logits differ by up to 0.015 at |logits| <= 3,
# and top-2 gaps of 0.013 and 0.018 occur, so an exact argmax match would fail on rounding.
TIE = 4 * 2.0**-8


def greedy_mismatches(generated, logits_NV, tie=TIE) -> tuple[list[str], int]:
  """(the steps where greedy token `generated[i]` is not the argmax of reference logits
  `logits_NV[i]` up to a bf16 tie, how many steps were decided: a top-2 gap over the tie)."""
  bad, decided = [], 0
  for i, (token, row) in enumerate(zip(generated, np.asarray(logits_NV, np.float64))):
    margin = tie * np.abs(row).max()
    top2 = np.sort(row)[-2:]
    decided += top2[1] - top2[0] > margin
    if row.max() - row[token] > margin:  # exact where decided; a near-top token in a tie
      bad.append(f"step {i}: token {token} at {row[token]:.4f}, argmax {int(row.argmax())} at "
                 f"{row.max():.4f} (tie margin {margin:.4f})")
  return bad, decided


@pytest.fixture(scope="module")
def peaked(tmp_path_factory):
  """The tiny bf16 model with the compiled flash kernel trained 200 steps (seconds on a GPU):
  peaked enough for greedy decoding to be decided at most steps. Issue 25's GPU run decided 2
  of 16 steps with the 6-step model of `trained`; on CPU (xla attention) this recipe decides 9
  and 16 of 16 for a text prompt and for the control-character one."""
  from trainer.run.loop import Run
  root = tmp_path_factory.mktemp("gpu_peaked")
  Run(tiny_config(**{"model.d_model": 64, "model.mlp_dim": 128, "model.dtype": "bfloat16",
                     "model.attention": "flash", "steps": 200, "log_every": 50,
                     "optim.decay_steps": 200}), str(root)).train()
  return root


def test_greedy_generation_on_gpu_equals_full_forward_argmax(peaked):
  """Greedy decoding with the KV cache against the full forward pass over the same tokens (the
  prompt and what was generated, one causal pass: the logits every step saw, so after a tie the
  rest is still compared on the cached path's own context). Where the reference's top two
  logits are closer than a bf16 tie (TIE), either token is greedy; elsewhere the generated
  token must be the argmax. It still fails on a cache bug (a wrong position, a stale or
  missing entry gives tokens far below the top; at least one step in 3 must be decided, or the
  model is too flat for the check to mean anything: hence the trained `peaked` model and a
  prompt of the corpus's kind, Python source bytes after BOS)."""
  from data.tokenizer import BOS_ID
  from models.decode import Generator
  from sharding import make_mesh
  from trainer.checkpoint.model_dirs import restore_params
  mesh = make_mesh({"data": 1, "fsdp": 1, "tensor": 1, "sequence": 1, "expert": 1},
                   jax.devices()[:1])
  spec, params, _, _ = restore_params(str(peaked), mesh)
  prompt, n = [BOS_ID, *b"import os\nimport "], 16
  generated = Generator(spec, params, temperature=0.0).generate([prompt], n)[0]
  assert len(generated) == n
  tokens = prompt + generated
  with jax.set_mesh(mesh):  # no cache: logits at every position of the whole sequence
    logits = spec.model(params)(jnp.asarray([tokens], jnp.int32))[0]
  bad, decided = greedy_mismatches(generated, logits[len(prompt) - 1:-1])
  assert not bad, bad
  assert decided >= n // 3, (decided, n)


def test_memory_prediction_within_ten_percent_of_the_measured_peak():
  kind = jax.devices("gpu")[0].device_kind
  topology = "h100:1" if "H100" in kind else "local"
  env = {**os.environ, "JAX_PLATFORMS": "cuda,cpu"}
  proc = subprocess.run(
      [sys.executable, "-m", "tools.memory_check", "--config", "configs/lm_125m.py",
       "--topology", topology, "--measure", "--config.data.global_batch_size=16",
       "--config.data.micro_batch_size=8", "--config.eval_sequences=16"],
      cwd=ROOT, env=env, capture_output=True, text=True, timeout=900)
  assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
  line = next(x for x in proc.stdout.splitlines() if x.startswith("measured"))
  ratio = float(re.search(r"= ([\d.]+) x predicted", line).group(1))
  assert abs(ratio - 1) <= 0.10, proc.stdout

"""The Pallas flash-attention kernel (interpreted on CPU) equals jax.nn.dot_product_attention:
forward, all three gradients and the log-sum-exp, for causal/non-causal, packed segments, GQA,
ragged lengths, non-power-of-two head dims, fp32 (tight) and bf16 (loose); the carried-state
calls ring attention makes (fold a key block into a running (o, lse), accumulate gradients in
place, within dynamic bounds) equal attention over the union of the blocks; the kernels go
through the GPU (Triton) lowering, the carried-state ones too. The model's dispatcher runs the
kernel, and the TPU splash adapter (interpreted), per device under a data x tensor mesh, and
both equal the reference."""
import jax
import jax.numpy as jnp
import numpy as np
import pytest

import models.attention as attention_module
from kernels import BlockSizes, flash_attention
from kernels.flash_attention import _setup
from kernels.flash_attention import backward as block_backward
from kernels.flash_attention import forward as block_forward
from kernels.splash import splash_attention
from models.attention import attention, choose_impl, resolve_impl, segment_mask
from sharding import make_mesh

SMALL = BlockSizes(block_q=16, block_k=16, block_q_bwd=16, block_k_bwd=32)


def _inputs(B, S, H, K, D, dtype, seed=0, segments=False):
  ks = jax.random.split(jax.random.key(seed), 4)
  q = jax.random.normal(ks[0], (B, S, H, D), jnp.float32).astype(dtype)
  k = jax.random.normal(ks[1], (B, S, K, D), jnp.float32).astype(dtype)
  v = jax.random.normal(ks[2], (B, S, K, D), jnp.float32).astype(dtype)
  do = jax.random.normal(ks[3], (B, S, H, D), jnp.float32).astype(dtype)
  seg = None
  if segments:  # packed documents 1, 2, ... of random lengths, then padding (0)
    rng = np.random.RandomState(seed)
    seg = np.sort(rng.randint(1, 5, (B, S)), axis=1)
    seg[:, -3:] = 0
    seg = jnp.asarray(seg, jnp.int32)
  return q, k, v, do, seg


def _reference(q, k, v, seg, causal):
  mask = None if seg is None else segment_mask(seg)
  return jax.nn.dot_product_attention(q, k, v, mask=mask, is_causal=causal)


def _fwd_and_grads(fn, q, k, v, do):
  out, vjp = jax.vjp(fn, q, k, v)
  return (out, *vjp(do))


CASES = {
    # name: (B, S, H, K, D, causal, segments)
    "causal_segments_gqa": (2, 64, 4, 1, 16, True, True),
    "segments_ragged": (1, 50, 2, 2, 16, False, True),
    "causal_ragged_dim24": (1, 40, 2, 2, 24, True, False),
}


@pytest.mark.parametrize("name", list(CASES))
def test_fp32_matches_reference(name):
  B, S, H, K, D, causal, segments = CASES[name]
  q, k, v, do, seg = _inputs(B, S, H, K, D, jnp.float32, segments=segments)
  got = _fwd_and_grads(jax.jit(lambda q, k, v: flash_attention(
      q, k, v, causal=causal, segment_ids=seg, block_sizes=SMALL)), q, k, v, do)
  want = _fwd_and_grads(lambda q, k, v: _reference(q, k, v, seg, causal), q, k, v, do)
  for what, g, w in zip(("out", "dq", "dk", "dv"), got, want):
    assert g.shape == w.shape and g.dtype == w.dtype, what
    np.testing.assert_allclose(g, w, atol=2e-5, rtol=1e-5, err_msg=what)


def test_default_tiles_match_reference():
  """The tiles users get (BlockSizes() defaults: 128 x 64 forward, 64 x 64 backward) on a
  sequence of several of them, not a multiple of the largest (padded), causal, packed, GQA."""
  q, k, v, do, seg = _inputs(1, 320, 4, 2, 32, jnp.float32, seed=8, segments=True)
  cfg = _setup(q, k, v, seg, seg, causal=True, scale=None, block_sizes=None, interpret=True)[0]
  defaults = BlockSizes()
  assert (cfg.block_q, cfg.block_k, cfg.block_q_bwd, cfg.block_k_bwd) == (
      defaults.block_q, defaults.block_k, defaults.block_q_bwd, defaults.block_k_bwd)
  assert 320 > 2 * max(cfg.block_q, cfg.block_k)  # several tiles each way, last one padded
  got = _fwd_and_grads(jax.jit(lambda q, k, v: flash_attention(
      q, k, v, causal=True, segment_ids=seg)), q, k, v, do)
  want = _fwd_and_grads(lambda q, k, v: _reference(q, k, v, seg, True), q, k, v, do)
  for what, g, w in zip(("out", "dq", "dk", "dv"), got, want):
    np.testing.assert_allclose(g, w, atol=2e-5, rtol=1e-5, err_msg=what)


def test_bf16_matches_reference_loosely():
  q, k, v, do, seg = _inputs(2, 64, 4, 2, 32, jnp.bfloat16, seed=1, segments=True)
  got = _fwd_and_grads(jax.jit(lambda q, k, v: flash_attention(
      q, k, v, causal=True, segment_ids=seg, block_sizes=SMALL)), q, k, v, do)
  # The reference in fp32 on the same bf16 inputs: what bf16 attention should approximate.
  f32 = lambda x: x.astype(jnp.float32)
  want = _fwd_and_grads(lambda q, k, v: _reference(q, k, v, seg, True),
                        f32(q), f32(k), f32(v), f32(do))
  for what, g, w in zip(("out", "dq", "dk", "dv"), got, want):
    assert g.dtype == jnp.bfloat16, what
    np.testing.assert_allclose(f32(g), w, atol=6e-2, rtol=6e-2, err_msg=what)


def test_lse_and_its_gradient():
  """lse = logsumexp of the masked, scaled scores; gradients flow through it as well."""
  q, k, v, _, seg = _inputs(1, 48, 2, 1, 16, jnp.float32, seed=2, segments=True)
  scale = 16 ** -0.5

  def ref_lse(q, k):
    s = jnp.einsum("bshd,btd->bhst", q, k[:, :, 0]) * scale
    mask = segment_mask(seg) & jnp.tril(jnp.ones((48, 48), bool))
    return jax.nn.logsumexp(jnp.where(mask, s, -jnp.inf), axis=-1)

  def lse_and_grads(fn):
    def loss(q, k, v):
      out, lse = fn(q, k, v)
      return jnp.sum(out ** 2) + jnp.sum(jnp.sin(lse)), lse
    grads, lse = jax.grad(loss, argnums=(0, 1, 2), has_aux=True)(q, k, v)
    return (lse, *grads)

  flash = lambda q, k, v: flash_attention(q, k, v, causal=True, segment_ids=seg,
                                          return_lse=True, block_sizes=SMALL)
  ref = lambda q, k, v: (_reference(q, k, v, seg, True), ref_lse(q, k))
  got = jax.jit(lambda: lse_and_grads(flash))()
  want = jax.jit(lambda: lse_and_grads(ref))()
  for what, g, w in zip(("lse", "dq", "dk", "dv"), got, want):
    np.testing.assert_allclose(g, w, atol=2e-5, rtol=1e-5, err_msg=what)


def test_cross_attention_lengths_and_kv_segments():
  """Queries and keys of different lengths (what ring attention's half blocks are)."""
  q, _, _, do, _ = _inputs(1, 32, 2, 2, 16, jnp.float32, seed=3)
  _, k, v, _, _ = _inputs(1, 48, 2, 2, 16, jnp.float32, seed=4)
  seg_q = jnp.asarray(np.repeat([[1, 2]], 16, axis=1), jnp.int32)
  seg_k = jnp.asarray(np.repeat([[1, 2, 3]], 16, axis=1), jnp.int32)
  got = _fwd_and_grads(lambda q, k, v: flash_attention(
      q, k, v, segment_ids=seg_q, kv_segment_ids=seg_k, block_sizes=SMALL), q, k, v, do)
  mask = segment_mask(seg_q, seg_k)
  want = _fwd_and_grads(lambda q, k, v: jax.nn.dot_product_attention(q, k, v, mask=mask),
                        q, k, v, do)
  for what, g, w in zip(("out", "dq", "dk", "dv"), got, want):
    np.testing.assert_allclose(g, w, atol=2e-5, rtol=1e-5, err_msg=what)


# Carried state: keys in two blocks, the second folded into the first's (o, lse) within
# (q_start, kv_stop), causal or not (the cases of one ring step), against one attention over both.
BOUNDS = {  # name: (q_start, kv_stop, causal), for queries [0, 40) and second-block keys [0, 36)
    "diagonal": (0, 36, True),
    "first_half_of_keys": (0, 18, False),
    "second_half_of_queries": (20, 36, False),
    "unaligned": (17, 21, True),
}


@pytest.fixture(scope="module")
def two_blocks():
  """Queries [1, 40, 4 heads], keys in blocks of 24 and 36 (2 kv heads), packed segments, and
  one jitted kernel pipeline whose bounds and causal flag are traced (one compile for all)."""
  q, k1, v1, do, _ = _inputs(1, 40, 4, 2, 16, jnp.float32, seed=6)
  _, k2, v2, _, _ = _inputs(1, 36, 4, 2, 16, jnp.float32, seed=7)
  k1, v1 = k1[:, :24], v1[:, :24]
  seg_q = jnp.asarray(np.repeat([[1, 2]], 20, axis=1), jnp.int32)
  seg_1 = jnp.asarray(np.repeat([[1, 2]], 12, axis=1), jnp.int32)
  seg_2 = jnp.asarray(np.repeat([[1, 2, 3]], 12, axis=1), jnp.int32)

  @jax.jit
  def kernels(bounds, causal):
    o1, lse1 = block_forward(q, k1, v1, seg_q, seg_1, block_sizes=SMALL)
    o, lse = block_forward(q, k2, v2, seg_q, seg_2, state=(o1, lse1), bounds=bounds,
                           causal=causal, block_sizes=SMALL)
    delta = jnp.einsum("bshd,bshd->bhs", o, do)
    dq, dk1, dv1 = block_backward(q, k1, v1, seg_q, seg_1, do, lse, delta, block_sizes=SMALL)
    zeros = jnp.zeros_like(k2)
    dq, dk2, dv2 = block_backward(q, k2, v2, seg_q, seg_2, do, lse, delta,
                                  grads=(dq, zeros, zeros), bounds=bounds, causal=causal,
                                  block_sizes=SMALL)
    return (o1, lse1), (o, lse, dq, dk1, dv1, dk2, dv2)

  return (q, k1, v1, k2, v2, do, seg_q, seg_1, seg_2), kernels


@pytest.mark.parametrize("name", list(BOUNDS))
def test_carried_state_and_gradients_match_reference(two_blocks, name):
  """The carried-state forward equals attention over both key blocks (second block within the
  bounds), rows outside the bounds keep their state bit for bit, and the in-place gradient
  accumulation gives the reference dq and every key block's dk, dv."""
  (q, k1, v1, k2, v2, do, seg_q, seg_1, seg_2), kernels = two_blocks
  q_start, kv_stop, causal = BOUNDS[name]
  (o1, lse1), got = kernels(jnp.array([q_start, kv_stop]), jnp.array(causal))
  rows, cols = np.arange(40)[:, None], np.arange(36)[None, :]
  in_bounds = (rows >= q_start) & (cols < kv_stop) & ((rows >= cols) | (not causal))
  mask = jnp.concatenate([segment_mask(seg_q, seg_1),
                          segment_mask(seg_q, seg_2) & in_bounds], axis=-1)
  k, v = jnp.concatenate([k1, k2], axis=1), jnp.concatenate([v1, v2], axis=1)
  out, vjp = jax.vjp(lambda q, k, v: jax.nn.dot_product_attention(q, k, v, mask=mask), q, k, v)
  scores = jnp.einsum("bshd,bthd->bhst", q, jnp.repeat(k, 2, axis=2)) * 16 ** -0.5
  want = (out, jax.nn.logsumexp(jnp.where(mask, scores, -jnp.inf), axis=-1), *vjp(do))
  o, lse, dq, dk1, dv1, dk2, dv2 = got
  have = (o, lse, dq, jnp.concatenate([dk1, dk2], axis=1), jnp.concatenate([dv1, dv2], axis=1))
  for what, g, w in zip(("out", "lse", "dq", "dk", "dv"), have, want):
    np.testing.assert_allclose(g, w, atol=2e-5, rtol=1e-5, err_msg=what)
  np.testing.assert_array_equal(o[:, :q_start], o1[:, :q_start])  # kept rows: bit for bit
  np.testing.assert_array_equal(lse[:, :, :q_start], lse1[:, :, :q_start])


def _for_gpu():
  """Lower for an abstract H100: newer jax reads the GPU's compute capability from the mesh's
  abstract device when the machine has no GPU (this one)."""
  h100 = jax.sharding.AbstractDevice(device_kind="NVIDIA H100 80GB HBM3", num_cores=132,
                                     platform="gpu")
  return jax.sharding.use_abstract_mesh(
      jax.sharding.AbstractMesh((1,), ("x",), abstract_device=h100))


def test_lowers_for_gpu_triton():
  """All three kernels (forward, dQ, dK/dV) go through Pallas' Triton lowering: tile shapes
  and ops are ones Triton accepts (compiling to PTX needs a GPU, not available here)."""
  sds = jax.ShapeDtypeStruct
  q, k = sds((2, 200, 8, 64), jnp.bfloat16), sds((2, 200, 2, 64), jnp.bfloat16)
  seg = sds((2, 200), jnp.int32)

  def loss(q, k, v, seg):
    out, lse = flash_attention(q, k, v, causal=True, segment_ids=seg, return_lse=True,
                               interpret=False)
    return out.astype(jnp.float32).sum() + lse.sum()

  with _for_gpu():
    lowered = jax.jit(jax.grad(loss, argnums=(0, 1, 2))).trace(q, k, k, seg).lower(
        lowering_platforms=("cuda",))
  assert lowered.as_text().count("__gpu$xla.gpu.triton") == 3


@pytest.mark.parametrize("heads", [None, (4, 4)], ids=["all_heads", "head_range"])
def test_carried_state_lowers_for_gpu_triton(heads):
  """The carried-state calls (traced bounds and causal flag, state and gradient accumulators
  aliased to the outputs) go through the Triton lowering as well, on a length that is not a
  power of two; also on a range of the heads (k/v of one kv head, offset query-side blocks)."""
  sds = jax.ShapeDtypeStruct
  kv_heads = 2 if heads is None else 1
  q, k = sds((2, 320, 8, 64), jnp.bfloat16), sds((2, 320, kv_heads, 64), jnp.bfloat16)
  o, lse = sds((2, 320, 8, 64), jnp.float32), sds((2, 8, 320), jnp.float32)
  dkv, seg = sds((2, 320, kv_heads, 64), jnp.float32), sds((2, 320), jnp.int32)
  index = sds((), jnp.int32)

  def step(q, k, v, seg, o, lse, dq, dk, dv, q_start, kv_stop, causal):
    bounds = (q_start, kv_stop)
    o, lse = block_forward(q, k, v, seg, seg, state=(o, lse), bounds=bounds, heads=heads,
                           causal=causal, interpret=False)
    delta = jnp.sum(o, axis=-1).swapaxes(1, 2)
    return block_backward(q, k, v, seg, seg, o.astype(q.dtype), lse, delta, grads=(dq, dk, dv),
                          bounds=bounds, heads=heads, causal=causal, interpret=False)

  with _for_gpu():
    lowered = jax.jit(step).trace(q, k, k, seg, o, lse, o, dkv, dkv, index, index,
                                  sds((), jnp.bool_)).lower(lowering_platforms=("cuda",))
  text = lowered.as_text()
  assert text.count("__gpu$xla.gpu.triton") == 3
  assert text.count("output_operand_alias<") == 5  # (o, lse), dq, (dk, dv): updated in place


def test_rejects_bad_arguments():
  q, k, v, _, _ = _inputs(1, 32, 3, 2, 16, jnp.float32)
  with pytest.raises(ValueError, match="not a multiple"):
    flash_attention(q, k, v)
  q, k, v, _, _ = _inputs(1, 32, 2, 2, 16, jnp.float32)
  with pytest.raises(ValueError, match="powers of two"):
    flash_attention(q, k, v, block_sizes=BlockSizes(block_q=24))
  with pytest.raises(ValueError, match="kv_segment_ids"):
    flash_attention(q, k[:, :16], v[:, :16], segment_ids=jnp.ones((1, 32), jnp.int32))
  with pytest.raises(ValueError, match="need state"):
    block_forward(q, k, v, bounds=(0, 16))
  state = (jnp.zeros(q.shape), jnp.zeros((1, 2, 32)))
  with pytest.raises(ValueError, match="not a range of the 2 query heads"):
    block_forward(q, k, v, state=state, heads=(1, 2))
  q4 = jnp.concatenate([q, q], axis=2)  # 4 query heads; heads (1, 2) over one kv head: G = 2
  state = (jnp.zeros(q4.shape), jnp.zeros((1, 4, 32)))
  with pytest.raises(ValueError, match="does not start at a kv head"):
    block_forward(q4, k[:, :, :1], v[:, :, :1], state=state, heads=(1, 2))


@pytest.mark.parametrize("impl", ["flash", "flash_triton", "splash", "cudnn"])
def test_dispatch_under_mesh_matches_reference(impl, devices):
  """models.attention runs the kernel per device (shard_map over batch and heads) under the
  trainer's mesh; "splash" is the TPU path (jax's splash attention, interpreted here); "cudnn"
  is XLA's attention off a GPU."""
  causal, segments = (False, False) if impl.startswith("flash") else (True, True)
  q, k, v, do, seg = _inputs(2, 128, 4, 2, 32, jnp.float32, seed=5, segments=segments)
  mesh = make_mesh({"data": 2, "tensor": 2}, jax.devices()[:4])
  fn = jax.jit(lambda q, k, v: attention(q, k, v, segment_ids=seg, causal=causal, impl=impl))
  with jax.set_mesh(mesh):
    got = _fwd_and_grads(fn, q, k, v, do)
  want = _fwd_and_grads(lambda q, k, v: _reference(q, k, v, seg, causal), q, k, v, do)
  for what, g, w in zip(("out", "dq", "dk", "dv"), got, want):
    np.testing.assert_allclose(g, w, atol=2e-5, rtol=1e-5, err_msg=what)


def test_splash_lowers_for_tpu():
  """The splash path lowers to Mosaic TPU custom calls (compiling needs a TPU)."""
  sds = jax.ShapeDtypeStruct
  q, k = sds((2, 1024, 8, 128), jnp.bfloat16), sds((2, 1024, 2, 128), jnp.bfloat16)

  def loss(q, k, v, seg):
    return splash_attention(q, k, v, causal=True, segment_ids=seg).astype(jnp.float32).sum()

  lowered = jax.jit(jax.grad(loss, argnums=(0, 1, 2))).trace(
      q, k, k, sds((2, 1024), jnp.int32)).lower(lowering_platforms=("tpu",))
  assert lowered.as_text().count("tpu_custom_call") == 3


def test_auto_attention_choice():
  """`auto` on GPU: with packed documents' segment ids our Triton flash kernel (head dims up to
  128, Ampere or newer); without them cuDNN's fused attention where its constraints hold
  (Ampere or newer, fp16/bf16, head dim a multiple of 8 up to 128, even length with a segment
  mask), else xla. `flash` by name: the Mosaic GPU kernel on Hopper (and an ahead-of-time
  target) for 16-bit q/k/v with head dims a multiple of 64, else the Triton one."""
  gpu = dict(platform="gpu", seq_len=2048)
  docs = dict(gpu, segments=True)
  assert choose_impl("auto", dtype=jnp.bfloat16, head_dim=64, **docs) == "flash_triton"
  assert choose_impl("auto", dtype=jnp.float32, head_dim=128, **docs) == "flash_triton"
  assert choose_impl("flash", dtype=jnp.bfloat16, head_dim=128, **docs) == "flash_mosaic"
  assert choose_impl("flash", dtype=jnp.bfloat16, head_dim=64, gpu_capability=9.0,
                     **gpu) == "flash_mosaic"
  assert choose_impl("flash", dtype=jnp.bfloat16, head_dim=64, gpu_capability=8.0,
                     **gpu) == "flash_triton"  # Ampere: no wgmma
  assert choose_impl("flash", dtype=jnp.float32, head_dim=64, **gpu) == "flash_triton"
  assert choose_impl("flash", dtype=jnp.bfloat16, head_dim=80, **gpu) == "flash_triton"
  assert choose_impl("flash_triton", dtype=jnp.bfloat16, head_dim=64, **gpu) == "flash_triton"
  assert choose_impl("flash", platform="cpu") == "flash_triton"  # interpreted
  assert choose_impl("flash_triton", platform="tpu") == "splash"
  assert choose_impl("auto", dtype=jnp.bfloat16, head_dim=256, **docs) == "xla"
  assert choose_impl("auto", dtype=jnp.bfloat16, head_dim=64, gpu_capability=7.5,
                     **docs) == "xla"
  assert choose_impl("auto", dtype=jnp.bfloat16, head_dim=64, sequence=4, **docs) == "ring"
  assert choose_impl("auto", platform="cpu", dtype=jnp.bfloat16, head_dim=64,
                     segments=True) == "xla"
  assert choose_impl("auto", dtype=jnp.bfloat16, head_dim=128, **gpu) == "cudnn"
  assert choose_impl("auto", dtype=jnp.float16, head_dim=64, **gpu) == "cudnn"
  assert choose_impl("auto", dtype=jnp.float32, head_dim=64, **gpu) == "xla"
  assert choose_impl("auto", dtype=jnp.bfloat16, head_dim=256, **gpu) == "xla"
  assert choose_impl("auto", dtype=jnp.bfloat16, head_dim=36, **gpu) == "xla"
  assert choose_impl("auto", platform="gpu", dtype=jnp.bfloat16, head_dim=64,
                     seq_len=2047) == "xla"
  assert choose_impl("auto", dtype=jnp.float16, head_dim=64, gpu_capability=7.5, **gpu) == "xla"
  assert choose_impl("auto", dtype=jnp.bfloat16, head_dim=64, gpu_capability=9.0,
                     **gpu) == "cudnn"
  assert choose_impl("auto", dtype=jnp.bfloat16, head_dim=64, sequence=4, **gpu) == "ring"
  assert choose_impl("ring", dtype=jnp.bfloat16, head_dim=64, **gpu) == "cudnn"  # nothing to ring
  assert choose_impl("flash", dtype=jnp.bfloat16, head_dim=64, **gpu) == "flash_mosaic"
  assert choose_impl("flash", platform="tpu") == "splash"
  assert choose_impl("cudnn", dtype=jnp.bfloat16, head_dim=64, **docs) == "cudnn"  # by name
  assert choose_impl("cudnn", platform="cpu") == choose_impl("cudnn", platform="tpu") == "xla"
  assert choose_impl("auto", platform="tpu") == "splash"
  assert choose_impl("auto", platform="cpu", dtype=jnp.bfloat16, head_dim=64) == "xla"
  with _for_gpu():  # the platform comes from the mesh's devices (ahead-of-time compiles)
    assert resolve_impl("auto", dtype=jnp.bfloat16, head_dim=64, seq_len=128) == "cudnn"
    assert resolve_impl("auto", dtype=jnp.float32, head_dim=64, seq_len=128) == "xla"
    assert resolve_impl("auto", dtype=jnp.bfloat16, head_dim=64, seq_len=128,
                        segments=True) == "flash_triton"
    assert resolve_impl("flash", dtype=jnp.bfloat16, head_dim=64, seq_len=128) == "flash_mosaic"
  with pytest.raises(ValueError, match="unknown attention implementation"):
    choose_impl("cudnn2", platform="gpu")


@pytest.mark.parametrize("impl, dtype, packed, want", [
    ("auto", jnp.bfloat16, False, "cudnn"), ("auto", jnp.float32, False, "xla"),
    ("auto", jnp.bfloat16, True, "flash"), ("auto", jnp.float32, True, "flash"),
    ("flash", jnp.bfloat16, True, "mosaic"), ("flash", jnp.float32, True, "flash")])
def test_model_attention_on_gpu_calls_the_choice(monkeypatch, impl, dtype, packed, want):
  """Under a GPU mesh the model's `attention` calls what `choose_impl` picked, with and without
  segment ids. (Tracing cuDNN's attention needs CUDA libraries, so the calls are recorded, not
  run.)"""
  called = []

  def record(name):
    return lambda q, k, v, *, segment_ids=None, causal=True, **_: called.append(name) or q

  monkeypatch.setattr(attention_module, "cudnn_attention", record("cudnn"))
  monkeypatch.setattr(attention_module, "xla_attention", record("xla"))
  monkeypatch.setattr(attention_module, "flash_attention", record("flash"))
  monkeypatch.setattr(attention_module.flash_mosaic, "flash_attention_mosaic", record("mosaic"))
  sds = jax.ShapeDtypeStruct
  q, k = sds((2, 128, 4, 64), dtype), sds((2, 128, 2, 64), dtype)
  seg = sds((2, 128), jnp.int32) if packed else None
  with _for_gpu():
    jax.eval_shape(lambda q, k, v, seg: attention(q, k, v, segment_ids=seg, impl=impl),
                   q, k, k, seg)
  assert called == [want]

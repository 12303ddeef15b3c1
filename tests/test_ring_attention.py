"""Ring attention over the `sequence` axis equals jax.nn.dot_product_attention (forward and all
three gradients) on 2, 4 and 8 devices, causal with the zig-zag layout, with segment ids and
GQA; with the flash kernel as the block (carried state, in-place gradients); on the model's
5-axis mesh; and the whole model trained with ring attention on {data: 2, sequence: 4} equals
the model without."""
import jax
import jax.numpy as jnp
import numpy as np
import pytest
from jax.sharding import AxisType
from test_train_step import _batches, _run

from conftest import tiny_config
from kernels import BlockSizes
from models.attention import resolve_impl, segment_mask
from sharding import make_mesh, ring_attention, ring_work, zigzag, zigzag_order
from trainer.config import ConfigError
from trainer.config.checks import validate


def _sequence_mesh(n):
  return jax.make_mesh((n,), ("sequence",), axis_types=(AxisType.Auto,),
                       devices=jax.devices()[:n])


def _inputs(B=2, S=64, H=4, K=2, D=16, seed=0):
  ks = jax.random.split(jax.random.key(seed), 4)
  q = jax.random.normal(ks[0], (B, S, H, D))
  k = jax.random.normal(ks[1], (B, S, K, D))
  v = jax.random.normal(ks[2], (B, S, K, D))
  do = jax.random.normal(ks[3], (B, S, H, D))
  seg = np.sort(np.random.RandomState(seed).randint(1, 6, (B, S)), axis=1)
  seg[:, -5:] = 0  # trailing padding, as the packer emits
  return q, k, v, do, jnp.asarray(seg, jnp.int32)


def _fwd_and_grads(fn, q, k, v, do):
  out, vjp = jax.vjp(fn, q, k, v)
  return (out, *vjp(do))


def _reference(q, k, v, do, seg, causal):
  return _fwd_and_grads(lambda q, k, v: jax.nn.dot_product_attention(
      q, k, v, mask=segment_mask(seg), is_causal=causal), q, k, v, do)


def _assert_close(got, want, atol=2e-5, rtol=1e-5):
  for what, g, w in zip(("out", "dq", "dk", "dv"), got, want):
    assert g.shape == w.shape, what
    np.testing.assert_allclose(g, w, atol=atol, rtol=rtol, err_msg=what)


@pytest.fixture(scope="module")
def data():
  q, k, v, do, seg = _inputs()
  return (q, k, v, do, seg), {c: _reference(q, k, v, do, seg, c) for c in (True, False)}


@pytest.mark.parametrize("n", [2, 4, 8])
def test_causal_zigzag_matches_reference(data, n, devices):
  (q, k, v, do, seg), want = data
  fn = jax.jit(lambda q, k, v: ring_attention(q, k, v, mesh=_sequence_mesh(n), causal=True,
                                              segment_ids=seg, impl="jnp"))
  _assert_close(_fwd_and_grads(fn, q, k, v, do), want[True])


def test_jnp_blocks_in_key_chunks_match_reference(data, devices):
  """The jnp block scans over key chunks (here 8 keys; every branch has several chunks)."""
  (q, k, v, do, seg), want = data
  fn = jax.jit(lambda q, k, v: ring_attention(q, k, v, mesh=_sequence_mesh(2), causal=True,
                                              segment_ids=seg, impl="jnp", kv_chunk=8))
  _assert_close(_fwd_and_grads(fn, q, k, v, do), want[True])


def test_non_causal_matches_reference(data, devices):
  (q, k, v, do, seg), want = data
  fn = jax.jit(lambda q, k, v: ring_attention(q, k, v, mesh=_sequence_mesh(4), causal=False,
                                              segment_ids=seg, impl="jnp"))
  _assert_close(_fwd_and_grads(fn, q, k, v, do), want[False])


def test_without_segment_ids(data, devices):
  (q, k, v, do, _), _ = data
  want = _fwd_and_grads(lambda q, k, v: jax.nn.dot_product_attention(q, k, v, is_causal=True),
                        q, k, v, do)
  fn = jax.jit(lambda q, k, v: ring_attention(q, k, v, mesh=_sequence_mesh(4), causal=True,
                                              impl="jnp"))
  _assert_close(_fwd_and_grads(fn, q, k, v, do), want)


@pytest.mark.parametrize("n, causal", [(2, True), (8, True), (4, False)])
def test_flash_kernel_blocks_match_reference(data, n, causal, devices):
  """The inner block is the Pallas kernel (interpreted), each step one call updating the
  running (o, lse), dQ and the travelling dK/dV in place within that step's bounds. On 8
  devices a local block (8 tokens) is smaller than a tile, so the bounds cut through tiles."""
  (q, k, v, do, seg), want = data
  fn = jax.jit(lambda q, k, v: ring_attention(
      q, k, v, mesh=_sequence_mesh(n), causal=causal, segment_ids=seg, impl="flash",
      block_sizes=BlockSizes(16, 16, 16, 16)))
  _assert_close(_fwd_and_grads(fn, q, k, v, do), want[causal])


@pytest.mark.parametrize("impl, n", [("flash", 4), ("jnp", 2)])
def test_head_chunks_match_reference(data, impl, n, devices):
  """One ring per chunk of kv heads (2 chunks of 1 kv head and 2 query heads): the flash
  kernel updates its chunk's heads of the shared state and dQ in place; jnp runs on slices."""
  (q, k, v, do, seg), want = data
  fn = jax.jit(lambda q, k, v: ring_attention(
      q, k, v, mesh=_sequence_mesh(n), causal=True, segment_ids=seg, impl=impl,
      block_sizes=BlockSizes(16, 16, 16, 16), head_chunks=2))
  _assert_close(_fwd_and_grads(fn, q, k, v, do), want[True])


def test_model_mesh_with_pre_permuted_layout(data, devices):
  """On the trainer's 5-axis mesh (batch over data, heads over tensor, sequence over sequence)
  with inputs already in zig-zag order (what the model does), the output is in zig-zag order."""
  (q, k, v, do, seg), want = data
  mesh = make_mesh({"data": 2, "tensor": 2, "sequence": 2})
  order = zigzag_order(q.shape[1], 2)

  def fn(q, k, v):
    return ring_attention(zigzag(q), zigzag(k), zigzag(v), causal=True,
                          segment_ids=zigzag(seg), layout="zigzag", impl="jnp")

  with jax.set_mesh(mesh):  # the current mesh, as under the trainer
    got = _fwd_and_grads(jax.jit(fn), q, k, v, do[:, order])
  _assert_close(got, (want[True][0][:, order], *want[True][1:]))


def test_zigzag_layout(devices):
  order = zigzag_order(16, 4)  # chunks of 2: device i holds chunks i and 7 - i
  np.testing.assert_array_equal(order.reshape(4, 4), [[0, 1, 14, 15], [2, 3, 12, 13],
                                                      [4, 5, 10, 11], [6, 7, 8, 9]])
  mesh = _sequence_mesh(4)
  x = jnp.arange(2 * 16 * 3).reshape(2, 16, 3)
  there = jax.jit(lambda x: zigzag(x, mesh=mesh))(x)
  np.testing.assert_array_equal(there, x[:, order])
  np.testing.assert_array_equal(jax.jit(lambda x: zigzag(x, mesh=mesh, inverse=True))(there), x)


@pytest.mark.parametrize("impl", ["jnp", "flash"])
def test_causal_work_is_balanced(impl):
  """Work per device counted from the ring's own per-step bounds (and, for the kernel, its
  tile loop bounds): balanced with zig-zag, not with contiguous blocks on the same schedule."""
  for n in (2, 4, 8):
    work = ring_work(16384, n, layout="zigzag", impl=impl)
    for kind in ("needed", "computed"):
      assert work[kind].max() / work[kind].min() <= 1.1, (n, kind)
    assert work["needed"].sum() == 16384 * 16385 // 2  # every causal pair exactly once
    assert np.all(work["computed"] >= work["needed"]), n  # no needed pair is skipped
    contiguous = ring_work(16384, n, layout="contiguous", impl=impl)
    for kind in ("needed", "computed"):  # what the zig-zag layout fixes
      assert contiguous[kind].max() / contiguous[kind].min() > 1.9, (n, kind)
  # Tiles bigger than a device's block: the kernel computes whole (padded) tiles.
  tiny = ring_work(64, 8, impl=impl, block_sizes=BlockSizes(16, 16, 16, 16))["computed"]
  # flash: 8 steps of one padded 16 x 16 tile; jnp: the 8 x 8 square, then 7 half blocks.
  np.testing.assert_array_equal(tiny, {"flash": 8 * 16 * 16, "jnp": 8 * 8 + 7 * 8 * 4}[impl])


def test_rejects_bad_arguments(data, devices):
  (q, k, v, _, seg), _ = data
  with pytest.raises(ValueError, match="2 x 8"):
    ring_attention(q[:, :40], k[:, :40], v[:, :40], mesh=_sequence_mesh(8), causal=True)
  with pytest.raises(ValueError, match="needs a mesh"):
    ring_attention(q, k, v)
  with pytest.raises(ValueError, match="layout"):
    ring_attention(q, k, v, mesh=_sequence_mesh(2), layout="striped")
  with pytest.raises(ValueError, match="head_chunks=3 does not divide the 2 kv heads"):
    ring_attention(q, k, v, mesh=_sequence_mesh(2), head_chunks=3)


def test_dispatch_and_config():
  ring_mesh = make_mesh({"data": 2, "sequence": 4})
  assert resolve_impl("auto", ring_mesh) == "ring"
  assert resolve_impl("ring", make_mesh({"data": 8})) == "xla"  # nothing to ring over, on CPU
  assert resolve_impl("auto", make_mesh({"data": 8})) == "xla"
  cfg = tiny_config(**{"model.attention": "ring", "mesh.data": 2, "mesh.sequence": 4,
                       "data.seq_len": 36})
  with pytest.raises(ConfigError, match="zig-zag"):
    validate(cfg, 8)
  cfg = tiny_config(**{"model.attention": "ring", "mesh.data": 2, "mesh.tensor": 2,
                       "mesh.sequence": 2, "model.ring_head_chunks": 2})
  with pytest.raises(ConfigError, match="ring_head_chunks=2 does not divide the 1 kv heads"):
    validate(cfg, 8)


def test_model_with_ring_attention_equals_model_without(data_dir, devices):
  """Three training steps: ring attention on {data: 2, sequence: 4} (zig-zag layout, the model
  reorders once at input and output) vs xla attention on one device."""
  ref_cfg = tiny_config()
  batches = _batches(data_dir, ref_cfg, 1)
  ref_losses, ref_params = _run(ref_cfg, {"data": 1}, batches, devices=jax.devices()[:1])
  cfg = tiny_config(**{"model.attention": "ring"})
  losses, params = _run(cfg, {"data": 2, "sequence": 4}, batches)
  np.testing.assert_allclose(losses, ref_losses, rtol=1e-5)
  jax.tree.map(lambda a, b: np.testing.assert_allclose(a, b, rtol=1e-4, atol=1e-5),
               params, ref_params)
  assert ref_losses[-1] < ref_losses[0]

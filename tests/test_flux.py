"""optax_kahan.flux: FLUX.1-dev's sizes, and its blockwise split."""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from flax import nnx

from optax_kahan._src import flux as fm

TINY = fm.FluxConfig.tiny()
SHAPES = dict(batch=2, image_tokens=12, text_tokens=5)  # a 3x4 token grid


def _jit(fn):
  """``jax.jit`` with XLA:CPU's cheapest compile (each program runs once
  here: compiling takes half as long)."""
  return jax.jit(fn, compiler_options={
      "xla_backend_optimization_level": 0,
      "xla_llvm_disable_expensive_passes": True})


def _run_pieces(fns, params, batch):
  """embed, ``lax.scan`` of each block fn over its stack, head: the loss."""
  embed_fn, block_fns, head_fn = fns.embed, fns.blocks, fns.head
  embed_params, stack_params, head_params = params
  carry, consts = embed_fn(embed_params, batch)
  for block_fn, stack in zip(block_fns, stack_params):
    carry, _ = jax.lax.scan(
        lambda c, p, f=block_fn: (f(p, c, consts), None), carry, stack)
  return head_fn(head_params, carry, consts, batch)


@pytest.fixture(scope="module")
def tiny():
  """The tiny model, a batch, and the pieces' loss and grads (one compile)."""
  build = lambda: fm.Flux(TINY, rngs=nnx.Rngs(0))
  graphdef, _ = nnx.split(nnx.eval_shape(build))
  model = nnx.merge(graphdef, _jit(lambda: nnx.split(build())[1])())
  batch = _jit(lambda key: fm.random_batch(key, TINY, dtype=jnp.float32,
                                           **SHAPES))(jax.random.key(1))
  fns, params = fm.flux_blockwise(model)
  loss, grads = _jit(jax.value_and_grad(
      lambda p, b: _run_pieces(fns, p, b)))(params, batch)
  return model, batch, params, loss, grads


def test_dev_param_count_and_stacks():
  cfg = fm.FluxConfig.dev()
  assert cfg == fm.FluxConfig() and cfg.head_dim == 128
  params = fm.abstract_params(cfg)
  embed, (double, single), head = params
  n = fm.num_params(params)
  assert abs(n - 11.90e9) / 11.90e9 < 0.01
  assert n == 11_901_408_320
  assert fm.num_params(double) == 19 * 339_831_296
  assert fm.num_params(single) == 38 * 141_591_808
  assert {x.shape[0] for x in jax.tree.leaves(double)} == {19}
  assert {x.shape[0] for x in jax.tree.leaves(single)} == {38}
  assert {x.dtype for x in jax.tree.leaves(params)} == {jnp.dtype("bfloat16")}
  assert all(isinstance(x, jax.ShapeDtypeStruct)
             for x in jax.tree.leaves(params))


def test_abstract_model_computes_the_models_loss(tiny):
  # the functions built under eval_shape are the concrete model's: the same
  # loss on its params (nothing of the abstract model's is allocated)
  _, batch, params, loss, _ = tiny
  model = fm.abstract_model(TINY)
  assert len(model.blocks) == 2
  got = _jit(lambda p, b: _run_pieces(model, p, b))(params, batch)
  np.testing.assert_array_equal(got, loss)


def test_pieces_match_forward(tiny):
  model, batch, params, loss, _ = tiny
  assert all(isinstance(x, jax.Array) for x in jax.tree.leaves(params))
  graphdef, state = nnx.split(model)
  want = _jit(lambda s, b: nnx.merge(graphdef, s)(b))(state, batch)
  assert want.shape == () and want.dtype == jnp.float32
  assert np.isfinite(want) and want > 0
  np.testing.assert_allclose(loss, want, rtol=1e-6)


def test_grad_through_pieces_finite_and_nonzero(tiny):
  _, _, params, _, grads = tiny
  assert jax.tree.structure(grads) == jax.tree.structure(params)
  for (path, g), p in zip(jax.tree_util.tree_leaves_with_path(grads),
                          jax.tree.leaves(params)):
    assert g.shape == p.shape and g.dtype == p.dtype
    assert np.all(np.isfinite(g)), jax.tree_util.keystr(path)
    assert np.any(g != 0), jax.tree_util.keystr(path)


def test_bf16_carry_and_consts_structure(tiny):
  model = tiny[0]
  fns, params = fm.flux_blockwise(model)
  embed_fn, (double_fn, single_fn), head_fn = fns.embed, fns.blocks, fns.head
  embed_p, (double_p, single_p), head_p = fm.to_dtype(params, jnp.bfloat16)
  spec = fm.batch_spec(TINY, **SHAPES)
  one = lambda stack: jax.tree.map(lambda x: x[0], stack)
  carry, consts = jax.eval_shape(embed_fn, embed_p, spec)
  b, n_img, n_txt = SHAPES["batch"], SHAPES["image_tokens"], SHAPES[
      "text_tokens"]
  bf16 = jnp.bfloat16
  assert carry == fm.Carry(jax.ShapeDtypeStruct((b, n_img, 64), bf16),
                           jax.ShapeDtypeStruct((b, n_txt, 64), bf16))
  assert consts == fm.Consts(
      jax.ShapeDtypeStruct((b, 64), bf16),
      jax.ShapeDtypeStruct((b, n_txt + n_img, 1, 16, 2, 2), jnp.float32))
  assert jax.eval_shape(double_fn, one(double_p), carry, consts) == carry
  assert jax.eval_shape(single_fn, one(single_p), carry, consts) == carry
  loss = jax.eval_shape(head_fn, head_p, carry, consts, spec)
  assert loss == jax.ShapeDtypeStruct((), jnp.float32)


def test_rope_scores_depend_on_relative_position():
  """<R(p) q, R(p') k> is a function of p - p' on every axis."""
  k1, k2 = jax.random.split(jax.random.key(0))
  q = jax.random.normal(k1, (1, 1, 1, 32))
  k = jax.random.normal(k2, (1, 1, 1, 32))

  def score(pq, pk):
    pe = fm.embed_nd(jnp.asarray([[pq, pk]], jnp.float32), (8, 12, 12),
                     10000)
    rq = fm.apply_rope(q, pe[:, :1])
    rk = fm.apply_rope(k, pe[:, 1:])
    return jnp.sum(rq * rk)

  base = score((0.0, 1.0, 2.0), (3.0, 5.0, 1.0))
  shifted = score((7.0, 4.0, 9.0), (10.0, 8.0, 8.0))
  np.testing.assert_allclose(shifted, base, rtol=1e-5, atol=1e-5)
  same = fm.embed_nd(jnp.zeros((1, 1, 3)), (8, 12, 12), 10000)
  np.testing.assert_allclose(fm.apply_rope(q, same), q, rtol=1e-6)

"""clip_by_global_norm and apply_if_finite: optax's results, with a per-leaf form."""

import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest

import optax_kahan as ok

PARAMS = {"a": jnp.linspace(-1.0, 1.0, 12).reshape(3, 4),
          "b": jnp.linspace(0.0, 2.0, 5)}


def _grads(i, scale):
  return jax.tree.map(lambda p: jnp.cos(p * (i + 1)) * scale, PARAMS)


@pytest.mark.parametrize("leafwise", [False, True])
@pytest.mark.parametrize("scale", [1e-3, 10.0], ids=["unclipped", "clipped"])
def test_clip_by_global_norm_is_optax(scale, leafwise):
  ours = ok.per_leaf.clip_by_global_norm(1.0)
  if leafwise:
    ours = ok.leafwise(ours)
  ref = optax.clip_by_global_norm(1.0)
  for i in range(3):
    g = _grads(i, scale)
    got, state = jax.jit(ours.update)(g, ours.init(PARAMS))
    want, _ = ref.update(g, ref.init(PARAMS))
    assert isinstance(state, optax.EmptyState)
    for k in g:
      np.testing.assert_allclose(got[k], want[k], rtol=2e-7, atol=0)
  if scale > 1:
    assert float(optax.tree.norm(got)) == pytest.approx(1.0, rel=1e-6)


def test_apply_if_finite_is_optax_through_nan_bursts():
  # adam on each leaf alone (its per-leaf form) rounds its bias correction
  # within an ulp of the whole-tree program's (see per_leaf).
  inner = lambda: optax.adam(1e-2)
  ours, ref = ok.per_leaf.apply_if_finite(inner(), 2), optax.apply_if_finite(inner(), 2)
  s_ours, s_ref = ours.init(PARAMS), ref.init(PARAMS)
  assert jax.tree.structure(s_ours) == jax.tree.structure(s_ref)
  nan = jnp.float32(jnp.nan)
  # finite, three non-finite steps in a row (the third is applied), finite
  for i, bad in enumerate([False, True, True, True, False]):
    g = _grads(i, 1.0)
    if bad:
      g = {"a": g["a"].at[1, 2].set(nan), "b": g["b"]}
    u_ours, s_ours = jax.jit(ours.update)(g, s_ours, PARAMS)
    u_ref, s_ref = ref.update(g, s_ref, PARAMS)
    for a, b in zip(jax.tree.leaves((u_ours, s_ours)),
                    jax.tree.leaves((u_ref, s_ref))):
      np.testing.assert_allclose(np.asarray(a), np.asarray(b), rtol=1e-6,
                                 atol=0, err_msg=str(i))
  assert int(s_ours.total_notfinite) == 3


def test_kahan_of_the_chain_keeps_its_per_leaf_form_and_skips_nan_steps():
  params = jax.device_put(jax.tree.map(lambda p: p.astype(jnp.bfloat16),
                                       PARAMS), jax.devices()[0])
  tx = ok.kahan(ok.per_leaf.apply_if_finite(
      ok.per_leaf.chain(ok.per_leaf.clip_by_global_norm(1.0), optax.adamw(1e-2)), 3))
  st, reason = ok.per_leaf.stages_of(tx, params, tx.init(params), params)
  assert st is not None, reason
  assert len(st.rounds) == 2  # the finiteness test, then the norm
  state = tx.init(params)
  g = jax.tree.map(lambda p: jnp.full(p.shape, jnp.nan, p.dtype), params)
  u, new = jax.jit(tx.update)(g, state, params)
  assert all(np.all(np.asarray(x) == 0) for x in jax.tree.leaves(u))
  for a, b in zip(jax.tree.leaves(ok.kahan_residuals(new)),
                  jax.tree.leaves(ok.kahan_residuals(state))):
    np.testing.assert_array_equal(a, b)


def test_chain_state_is_optax_chains():
  tx = ok.per_leaf.chain(ok.per_leaf.clip_by_global_norm(1.0), optax.adamw(1e-3))
  ref = optax.chain(optax.clip_by_global_norm(1.0), optax.adamw(1e-3))
  assert (jax.tree.structure(tx.init(PARAMS))
          == jax.tree.structure(ref.init(PARAMS)))
  u, _ = tx.update(PARAMS, tx.init(PARAMS), PARAMS)
  v, _ = ref.update(PARAMS, ref.init(PARAMS), PARAMS)
  for k in u:
    np.testing.assert_allclose(u[k], v[k], rtol=1e-5)


def _optax_own():
  return {
      "chain(clip, adamw)": optax.chain(optax.clip_by_global_norm(1.0),
                                        optax.adamw(1e-2)),
      "chain(adam, clip)": optax.chain(optax.adam(1e-2),
                                       optax.clip_by_global_norm(0.1)),
      "apply_if_finite(chain(clip, adam))": optax.apply_if_finite(
          optax.chain(optax.clip_by_global_norm(1.0), optax.adam(1e-2)), 2),
      "clip": optax.clip_by_global_norm(0.5)}


@pytest.mark.parametrize("name", list(_optax_own()))
def test_optax_own_keep_a_per_leaf_form_with_optax_state_and_results(name):
  ref = _optax_own()[name]
  g = _grads(0, 10.0)
  state = ref.init(PARAMS)
  st, reason = ok.per_leaf.stages_of(ref, g, state, PARAMS)
  assert st is not None, reason
  # The finiteness count and the norm read only the gradients: one pass.
  assert len(st.rounds) == 1
  tx = ok.leafwise(ref)
  for i in range(2):
    g = _grads(i, 10.0)
    u, s = jax.jit(tx.update)(g, state, PARAMS)
    v, state = ref.update(g, state, PARAMS)
    assert jax.tree.structure(s) == jax.tree.structure(state)
    # the global norm is summed leaf by leaf (an ulp); adam's bias
    # correction in a one-leaf row (an ulp, see per_leaf); jax >= 0.12.1's
    # XLA:CPU contracts a multiply-add into an FMA in one program and not the
    # other (0.2 ulps of the leaf's largest element, on an element that
    # cancels to 1/450 of it): so an ulp of each leaf's scale as well
    for a, b in zip(jax.tree.leaves((u, s)), jax.tree.leaves((v, state))):
      a, b = np.asarray(a), np.asarray(b)
      scale = (np.max(np.abs(b), initial=0) * np.finfo(b.dtype).eps
               if np.issubdtype(b.dtype, np.floating) else 0)
      np.testing.assert_allclose(a, b, rtol=1e-6, atol=max(1e-9, scale))
    state = s


def test_any_program_is_cut_from_what_it_computes():
  chain = optax.chain(optax.clip_by_global_norm(1.0), optax.adam(1e-2))
  g, state = _grads(0, 10.0), chain.init(PARAMS)
  # Nothing is recognised: optax.chain's update with another init, and a
  # hand-written clip, are cut from their own programs (one sum each) and
  # give their own results.
  odd_chain = optax.GradientTransformation(lambda p: chain.init(p),
                                           chain.update)

  def clip_update(updates, state, params=None):
    del params
    norm = optax.tree.norm(updates)
    return jax.tree.map(lambda u: u / jnp.maximum(norm, 1.0), updates), state

  odd_clip = optax.GradientTransformation(optax.init_empty_state, clip_update)
  for tx, s in ((odd_chain, state), (odd_clip, optax.EmptyState())):
    st, reason = ok.per_leaf.stages_of(tx, g, s, PARAMS)
    assert st is not None and len(st.rounds) == 1, reason
    want, _ = jax.jit(tx.update)(g, s, PARAMS)
    got, _ = jax.jit(ok.leafwise(tx).update)(g, s, PARAMS)
    for k in want:
      np.testing.assert_allclose(got[k], want[k], rtol=2e-7, atol=0)


def test_kahan_of_optax_chain_is_kahan_of_this_packages_chain():
  params = jax.device_put(jax.tree.map(lambda p: p.astype(jnp.bfloat16),
                                       PARAMS), jax.devices()[0])
  g = jax.tree.map(lambda x: x.astype(jnp.bfloat16), _grads(0, 10.0))
  steps = [ok.kahan(make(1.0), offload=False) for make in (
      lambda c: optax.chain(optax.clip_by_global_norm(c), optax.adamw(1e-2)),
      lambda c: ok.per_leaf.chain(ok.per_leaf.clip_by_global_norm(c), optax.adamw(1e-2)))]
  # no whole-tree warning (pytest makes it an error); the same step
  (u, s), (v, t) = (jax.jit(tx.update)(g, tx.init(params), params)
                    for tx in steps)
  for a, b in zip(jax.tree.leaves((u, s)), jax.tree.leaves((v, t)),
                  strict=True):
    np.testing.assert_array_equal(np.asarray(a), np.asarray(b))

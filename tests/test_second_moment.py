"""scale_by_second_moment: Adam's preconditioner in Prodigy's rescaled form."""

import jax
import jax.numpy as jnp
import numpy as np
import optax

import optax_kahan as ok


def _grads(steps, seed=0):
  rng = np.random.default_rng(seed)
  return [{"w": jnp.asarray(rng.standard_normal((4, 6)), jnp.float32),
           "b": jnp.asarray(rng.standard_normal(6), jnp.float32)}
          for _ in range(steps)]


def test_matches_optax_scale_by_adam_with_bias_correction():
  mine = ok.scale_by_second_moment(0.9, 0.99, 1e-8, bias_correction=True)
  ref = optax.scale_by_adam(0.9, 0.99, 1e-8)
  params = _grads(1)[0]
  s_mine, s_ref = mine.init(params), ref.init(params)
  for g in _grads(20):
    u_mine, s_mine = mine.update(g, s_mine, params)
    u_ref, s_ref = ref.update(g, s_ref, params)
    for k in g:
      np.testing.assert_allclose(u_mine[k], u_ref[k], rtol=2e-6, atol=1e-7)


def test_rescaled_moments_equal_d_scaled_moments():
  """m~ = m / d_k and v~ = v / d_k^2 for the moments of d-scaled gradients."""
  b1, b2, eps = 0.9, 0.999, 1e-8
  tx = ok.scale_by_second_moment(b1, b2, eps)
  d = [1e-6, 1e-6, 3e-4, 2e-2, 2e-2, 0.5, 0.7]
  params = {"w": jnp.zeros(5)}
  state = tx.init(params)
  m = v = np.zeros(5)
  rng = np.random.default_rng(0)
  for k in range(len(d) - 1):
    g = rng.standard_normal(5)
    m = b1 * m + (1 - b1) * d[k] * g
    v = b2 * v + (1 - b2) * d[k]**2 * g**2
    want = d[k] * m / (np.sqrt(v) + d[k + 1] * eps)  # prodigyopt's step / lr
    ratio = d[k - 1] / d[k] if k else 1.0
    u, state = tx.update({"w": jnp.asarray(g, jnp.float32)}, state, params,
                         d_ratio=ratio, d_growth=d[k + 1] / d[k])
    np.testing.assert_allclose(d[k] * np.asarray(u["w"]), want, rtol=1e-5)


def test_b1_zero_keeps_no_first_moment():
  tx = ok.scale_by_second_moment(b1=0.0)
  params = {"w": jnp.ones((3, 3), jnp.bfloat16)}
  state = tx.init(params)
  assert state.mu is None
  assert [x.size for x in jax.tree.leaves(state)] == [1, 9]
  u, _ = tx.update({"w": jnp.ones((3, 3), jnp.bfloat16)}, state, params)
  assert u["w"].dtype == jnp.bfloat16

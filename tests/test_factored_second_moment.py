"""Adafactor's factored second moment, against optax.scale_by_factored_rms."""

import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest

import optax_kahan as ok

# The last two axes are the two largest ones, as optax would pick them.
SHAPES = {"conv": (2, 3, 5, 8), "dense": (6, 10), "stack": (3, 4, 7),
          "bias": (7,), "scalar": ()}


def test_matches_optax_scale_by_factored_rms():
  """Mapping: optax decay_rate=0.8 is b2 = 1 - t**-0.8 (t from 1); optax's
  epsilon (added to g^2) is our eps2; our eps (outside the root) is 0; both
  factor every leaf of >= 2 dims (min_dim_size_to_factor=1)."""
  ref = optax.scale_by_factored_rms(factored=True, decay_rate=0.8,
                                    step_offset=0, min_dim_size_to_factor=1,
                                    epsilon=1e-30)
  mine = ok.scale_by_factored_second_moment(
      b1=0.0, b2=lambda t: 1.0 - t.astype(jnp.float32)**-0.8, eps=0.0,
      eps2=1e-30, min_dim_size_to_factor=1)
  rng = np.random.default_rng(0)
  params = {k: jnp.zeros(s) for k, s in SHAPES.items()}
  s_ref, s_mine = ref.init(params), mine.init(params)
  step_ref, step_mine = jax.jit(ref.update), jax.jit(mine.update)
  for _ in range(15):
    g = {k: jnp.asarray(rng.standard_normal(s) * rng.uniform(0.1, 10),
                        jnp.float32) for k, s in SHAPES.items()}
    u_ref, s_ref = step_ref(g, s_ref, params)
    u_mine, s_mine = step_mine(g, s_mine, params)
    for k in SHAPES:
      np.testing.assert_allclose(u_mine[k], u_ref[k], rtol=2e-5, err_msg=k)


def test_state_is_rows_and_columns():
  tx = ok.scale_by_factored_second_moment()
  params = {k: jnp.zeros(s, jnp.bfloat16) for k, s in SHAPES.items()}
  state = tx.init(params)
  assert state.row["conv"].shape == (2, 3, 5)
  assert state.col["conv"].shape == (2, 3, 8)
  # One-element placeholders where a leaf needs no entry (not None: Flax
  # NNX drops None; not empty: orbax refuses to save empty arrays).
  assert state.v["dense"].shape == (1,) and state.row["bias"].shape == (1,)
  assert state.v["bias"].shape == (7,) and state.v["bias"].dtype == jnp.bfloat16
  assert state.mu is None


def test_eps2_is_not_scaled_by_d_and_zero_gradients_stay_finite():
  tx = ok.scale_by_factored_second_moment(eps=1e-8)
  params = {"w": jnp.zeros((4, 6), jnp.bfloat16)}
  state = tx.init(params)
  zeros = {"w": jnp.zeros((4, 6), jnp.bfloat16)}
  for _ in range(3):  # tiny d_ratio, as Prodigy's d grows from 1e-6
    u, state = tx.update(zeros, state, params, d_ratio=1e-6, d_growth=1e6)
    assert bool(jnp.all(u["w"] == 0))
  assert float(jnp.min(state.row["w"].astype(jnp.float32))) > 0


def test_bad_arguments():
  with pytest.raises(ValueError, match="b2"):
    ok.scale_by_factored_second_moment(b2=1.0)
  with pytest.raises(ValueError, match="eps2"):
    ok.scale_by_factored_second_moment(eps2=-1.0)

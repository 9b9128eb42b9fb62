"""Stochastic rounding to bfloat16: unbiased, neighbours only, NaN/Inf kept."""

import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest

import optax_kahan as ok

VALUES = np.array([1.0 + 2**-10, -3.14159, 1e-3 + 1e-7, -7.7e5, 2.5e-30,
                   1.0 / 3.0], np.float32)


def _neighbours(x):
  down = (np.asarray(x, np.float32).view(np.uint32) & 0xFFFF0000)
  up = down + np.uint32(0x10000)
  return down.view(np.float32), up.view(np.float32)


def test_mean_of_many_roundings_is_unbiased():
  n = 100_000
  x = jnp.broadcast_to(jnp.asarray(VALUES), (n, VALUES.size))
  r = jax.jit(ok.stochastic_round)(x, jax.random.key(0)).astype(jnp.float32)
  mean = np.asarray(jnp.mean(r.astype(jnp.float64) if jax.config.x64_enabled
                             else r, axis=0), np.float64)
  rel = np.abs(mean - VALUES) / np.abs(VALUES)
  assert (rel < 6e-5).all(), rel
  # Plain round-to-nearest is biased by far more than that for these values.
  nearest = np.asarray(jnp.asarray(VALUES).astype(jnp.bfloat16), np.float64)
  assert (np.abs(nearest - VALUES) / np.abs(VALUES)).max() > 1e-3
  down, up = _neighbours(VALUES)
  r = np.asarray(r)
  assert ((r == down) | (r == up)).all(), "only the two neighbours may appear"


def test_nan_and_inf_are_kept():
  x = jnp.array([jnp.nan, jnp.inf, -jnp.inf, 3.3895e38, -0.0, 0.0], jnp.float32)
  for seed in range(20):
    r = np.asarray(ok.stochastic_round(x, jax.random.key(seed)), np.float32)
    assert np.isnan(r[0]) and r[1] == np.inf and r[2] == -np.inf
    assert np.isfinite(r[3]), "a value not beyond the largest bf16 became Inf"
    assert r[4] == 0 and r[5] == 0


def test_apply_updates_and_wrapper():
  params = {"w": jnp.ones(4096, jnp.bfloat16), "b": jnp.zeros(3, jnp.float32)}
  updates = {"w": jnp.full(4096, 1e-3), "b": jnp.ones(3)}
  new = ok.stochastic_round_apply_updates(params, updates, jax.random.key(0))
  assert new["w"].dtype == jnp.bfloat16
  # 1e-3 is about a quarter of a bf16 ulp at 1: some, not all, move up.
  moved = float(jnp.mean(new["w"] != params["w"]))
  assert 0.1 < moved < 0.4
  np.testing.assert_array_equal(new["b"], np.ones(3))

  tx = ok.stochastic_rounding(optax.sgd(1.0), jax.random.key(1))
  state = tx.init(params)
  step = jax.jit(tx.update)
  u1, state = step({"w": -updates["w"], "b": -updates["b"]}, state, params)
  assert u1["w"].dtype == jnp.float32
  landed = optax.apply_updates(params, u1)["w"]
  assert set(np.unique(np.asarray(landed, np.float32))) <= {1.0, 1.0078125}
  # A fresh key each step, derived from the count: two steps differ, and the
  # same count gives the same bits (resume, replicas).
  u2, state2 = step({"w": -updates["w"], "b": -updates["b"]}, state, params)
  assert not np.array_equal(np.asarray(u1["w"]), np.asarray(u2["w"]))
  u2b, _ = step({"w": -updates["w"], "b": -updates["b"]}, state, params)
  np.testing.assert_array_equal(np.asarray(u2["w"]), np.asarray(u2b["w"]))


def test_bad_input():
  with pytest.raises(TypeError, match="float32"):
    ok.stochastic_round(jnp.ones(3, jnp.float16), jax.random.key(0))
  tx = ok.stochastic_rounding(optax.sgd(1.0), jax.random.key(0))
  with pytest.raises(ValueError, match=r"\['i'\].*int32"):
    tx.init({"i": jnp.zeros(3, jnp.int32)})

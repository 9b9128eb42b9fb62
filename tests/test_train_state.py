"""kahan_train_state: a TrainState from float32 pretrained weights, exactly."""

import flax.linen as nn
import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest

import optax_kahan as ok


def test_starts_from_the_exact_float32_weights_and_trains():
  model = nn.Dense(3)
  x = jnp.linspace(-1.0, 1.0, 8).reshape(2, 4)
  params_f32 = jax.device_put(model.init(jax.random.key(0), x)["params"],
                              jax.devices()[0])
  params_f32 = jax.tree.map(lambda p: p + 1e-3, params_f32)  # low bits set
  tx = ok.kahan(ok.prodigy_factored())
  state = ok.kahan_train_state(params_f32, tx, apply_fn=model.apply)
  assert state.params["kernel"].dtype == jnp.bfloat16
  exact = ok.kahan_to_float32(state.params,
                              ok.kahan_residuals(state.opt_state))
  for k in params_f32:
    np.testing.assert_array_equal(np.asarray(exact[k]),
                                  np.asarray(params_f32[k]))
  # Prodigy's x0 is the exact float32 weights too (sliced every 11th).
  x0 = state.opt_state.inner_state.params0["kernel"]
  np.testing.assert_array_equal(
      np.asarray(x0), np.asarray(params_f32["kernel"]).reshape(-1)[::11])

  @jax.jit
  def train_step(state):
    grads = jax.grad(lambda p: jnp.sum(
        state.apply_fn({"params": p}, x).astype(jnp.float32)))(state.params)
    return state.apply_gradients(grads=grads)

  new = train_step(state)
  assert new.step == 1 and new.params["kernel"].dtype == jnp.bfloat16
  # The step count starts committed with the params: the step compiles once.
  assert state.step.committed
  train_step(new)
  assert train_step._cache_size() == 1


def test_needs_a_kahan_transformation():
  with pytest.raises(TypeError, match="needs tx = kahan"):
    ok.kahan_train_state({"w": jnp.ones(3)}, optax.adamw(1e-3),
                         apply_fn=lambda *a: None)

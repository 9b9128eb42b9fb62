"""``kahan_nnx_optimizer``, and the warning for an uncommitted step counter.

``nnx.Optimizer`` makes its step counter an uncommitted array; with
``kahan``'s committed state a jitted step over it compiles twice. The tests
count the compilations from ``jax.log_compiles``' messages.
"""

import warnings

import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest
from flax import nnx

import optax_kahan as ok
from _compiles import counting_compiles

X = jnp.ones((8, 4), jnp.bfloat16)


def _compiles_of_three_steps(model, optimizer):
  """How often the step compiles over three calls (the kernel moves)."""

  @nnx.jit
  def train_step(model, optimizer):
    loss, grads = nnx.value_and_grad(
        lambda m: jnp.mean(jnp.square(m(X).astype(jnp.float32) - 1.0)))(model)
    optimizer.update(model, grads)
    return loss

  before = np.asarray(model.kernel[...], np.float32)
  with counting_compiles() as names:
    for _ in range(3):
      train_step(model, optimizer)
  assert not np.array_equal(before, np.asarray(model.kernel[...], np.float32))
  return names.count("train_step")


def _model(committed):
  model = nnx.Linear(4, 3, param_dtype=jnp.bfloat16, rngs=nnx.Rngs(0))
  if committed:
    nnx.update(model, jax.device_put(nnx.state(model), jax.devices()[0]))
  return model


def test_nnx_optimizer_of_kahan_warns_and_compiles_twice():
  model = _model(committed=True)
  with pytest.warns(ok.OptaxKahanWarning,
                    match="step counter.*ok.kahan_nnx_optimizer"):
    optimizer = nnx.Optimizer(model, ok.kahan(optax.sgd(0.1)), wrt=nnx.Param)
  assert _compiles_of_three_steps(model, optimizer) == 2  # what it warns of


@pytest.mark.parametrize("committed", [False, True])
def test_kahan_nnx_optimizer_commits_and_compiles_once(committed):
  model = _model(committed)
  with warnings.catch_warnings():
    warnings.simplefilter("error")
    optimizer = ok.kahan_nnx_optimizer(model, ok.kahan(optax.sgd(0.1)),
                                       wrt=nnx.Param)
  assert optimizer.step.get_value().committed
  assert all(x.committed for x in jax.tree.leaves(nnx.state(model)))
  assert _compiles_of_three_steps(model, optimizer) == 1


def test_no_warning_where_nothing_is_committed():
  # Residuals in device memory and an uncommitted model: nothing is
  # committed, the step compiles once, and there is nothing to warn of.
  model = _model(committed=False)
  with warnings.catch_warnings():
    warnings.simplefilter("error")
    optimizer = nnx.Optimizer(model, ok.kahan(optax.sgd(0.1), offload=False),
                              wrt=nnx.Param)
  assert _compiles_of_three_steps(model, optimizer) == 1


def test_blockwise_init_of_nnx_params_does_not_warn():
  # nnx_blockwise's params are nnx.State too, but no nnx.Optimizer holds
  # them: blockwise_init does not warn about a step counter.
  state = lambda: jax.device_put(nnx.state(_model(committed=False), nnx.Param),
                                 jax.devices()[0])
  params = ok.blockwise.BlockwiseParams(
      state(), (jax.tree.map(lambda x: jnp.stack([x, x]), state()),), state())
  with warnings.catch_warnings():
    warnings.simplefilter("error")
    ok.blockwise.blockwise_init(ok.kahan(optax.sgd(0.1)), params)
  with pytest.warns(ok.OptaxKahanWarning, match="step counter"):
    ok.kahan(optax.sgd(0.1)).init(params.embed)  # the same params, directly

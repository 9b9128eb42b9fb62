"""The named optimizers under optax's conventions, and their state memory."""

import contextlib
import functools
import inspect

import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest

import optax_kahan as ok
from _matrix import sampled
from _steps import commit
from benchmarks import model_shapes

OPTIMIZERS = {
    "prodigy": ok.prodigy,
    "prodigy_b1_0": lambda **kw: ok.prodigy(b1=0.0, **kw),
    "prodigy_clip": lambda **kw: ok.prodigy(update_clip=1.0, weight_decay=0.1,
                                            decouple=False, **kw),
    "prodigy_factored": ok.prodigy_factored,
    "stable_adamw": lambda **kw: ok.stable_adamw(kw.pop("learning_rate", 1e-3),
                                                 **kw),
}


def _params(dtype):
  """Leaves of 0, 1, 2 and 4 dims, and a None leaf."""
  k = jax.random.split(jax.random.key(0), 4)
  return commit({
      "scale": jnp.asarray(0.5, dtype),
      "bias": jax.random.normal(k[0], (5,), dtype),
      "dense": jax.random.normal(k[1], (6, 5), dtype),
      "conv": jax.random.normal(k[2], (3, 3, 4, 6), dtype),
      "frozen": None,
  })


def _stall_warned(name, dtype):
  """The stall warning of Prodigy on plain bf16 params, which it expects."""
  if dtype == jnp.bfloat16 and name.startswith("prodigy"):
    return pytest.warns(ok.OptaxKahanWarning, match="stalls")
  return contextlib.nullcontext()


def _loss(params):
  x = jnp.ones((2, 6), params["dense"].dtype)
  y = jnp.tanh(x @ params["dense"] + params["bias"]) * params["scale"]
  return jnp.sum(jnp.square(y.astype(jnp.float32))) + jnp.sum(
      jnp.square(params["conv"].astype(jnp.float32)))


@pytest.mark.parametrize("name, dtype", sampled(
    [(n, d) for n in sorted(OPTIMIZERS) for d in (jnp.float32, jnp.bfloat16)],
    0, every=2, ids=[f"{d}-{n}" for n in sorted(OPTIMIZERS)
                     for d in ("float32", "bfloat16")]))
def test_descends_with_matching_dtypes_and_one_compile(name, dtype):
  tx = OPTIMIZERS[name]()
  params = _params(dtype)
  state = tx.init(params)
  traces = []

  @jax.jit
  def step(params, state):
    traces.append(1)
    loss, grads = jax.value_and_grad(_loss)(params)
    updates, state = tx.update(grads, state, params)
    for g, u in zip(jax.tree.leaves(grads), jax.tree.leaves(updates)):
      assert u.dtype == g.dtype and u.shape == g.shape
    return optax.apply_updates(params, updates), state, loss

  losses = []
  with _stall_warned(name, dtype):
    step.lower(params, state)
  # 60 steps: on this deterministic loss Prodigy's d overshoots first (with
  # prodigy_factored's bias-corrected clip the loss peaks near step 10).
  for _ in range(60):
    params, state, loss = step(params, state)
    losses.append(float(loss))
  assert len(traces) == 1, "recompiled across steps"
  assert params["frozen"] is None
  assert all(np.isfinite(losses))
  if dtype == jnp.float32:  # (plain bf16 updates stall: see the kahan test)
    assert losses[-1] < losses[0]


@pytest.mark.parametrize("name", sorted(OPTIMIZERS))
def test_inside_kahan_on_bf16(name):
  tx = ok.kahan(OPTIMIZERS[name]())
  params = _params(jnp.bfloat16)
  state = tx.init(params)
  step = jax.jit(lambda p, s: tx.update(jax.grad(_loss)(p), s, p))
  losses = []
  for _ in range(60):  # 60: Prodigy overshoots first (see the test above)
    updates, state = step(params, state)
    params = optax.apply_updates(params, updates)
    losses.append(float(_loss(params)))
  assert losses[-1] < losses[0]


def test_inject_hyperparams_float32_on_bf16_params():
  # slice_p sets the state's shapes, so it must stay static.
  with pytest.raises(ValueError, match="static_args"):
    optax.inject_hyperparams(ok.prodigy)().init(_params(jnp.float32))
  tx = optax.inject_hyperparams(ok.prodigy, static_args=("slice_p",),
                                hyperparam_dtype=jnp.float32)(
                                    learning_rate=1.0, b1=0.9, b2=0.999)
  params = _params(jnp.bfloat16)
  state = tx.init(params)
  assert state.hyperparams["b2"].dtype == jnp.float32
  step = jax.jit(lambda p, s: tx.update(jax.grad(_loss)(p), s, p))
  ref = ok.prodigy(learning_rate=1.0, b1=0.9, b2=0.999)
  ref_state = ref.init(params)
  with _stall_warned("prodigy", jnp.bfloat16):  # plain Prodigy on bf16
    for _ in range(5):
      updates, state = step(params, state)
      ref_updates, ref_state = ref.update(jax.grad(_loss)(params), ref_state,
                                          params)
      for a, b in zip(jax.tree.leaves(updates),
                      jax.tree.leaves(ref_updates)):
        np.testing.assert_allclose(np.asarray(a, np.float32),
                                   np.asarray(b, np.float32), rtol=1e-2,
                                   atol=1e-6)
  # Changing an injected hyperparameter takes effect without re-tracing.
  state.hyperparams["learning_rate"] = jnp.float32(0.0)
  updates, _ = step(params, state)
  assert all(float(jnp.max(jnp.abs(u))) == 0 for u in jax.tree.leaves(updates))


def test_schedules_masked_partition_multisteps_apply_if_finite():
  params = _params(jnp.float32)
  schedule = optax.warmup_cosine_decay_schedule(0.0, 1.0, 5, 50)
  labels = jax.tree.map(lambda p: "conv" if p.ndim == 4 else "other", params)
  transforms = [
      ok.prodigy(learning_rate=schedule),
      optax.chain(  # masked-out updates pass through: zero them
          optax.masked(ok.prodigy_factored(), jax.tree.map(
              lambda p: p.ndim >= 2, params)),
          optax.masked(optax.set_to_zero(), jax.tree.map(
              lambda p: p.ndim < 2, params))),
      optax.partition({"conv": ok.prodigy_factored(),
                       "other": ok.stable_adamw(1e-2)}, labels),
      optax.MultiSteps(ok.prodigy(), every_k_schedule=2),
      optax.apply_if_finite(ok.prodigy(), max_consecutive_errors=3),
  ]
  for tx in transforms:
    state = tx.init(params)
    p = params
    step = jax.jit(lambda p, s: tx.update(jax.grad(_loss)(p), s, p))
    for _ in range(6):
      updates, state = step(p, state)
      p = optax.apply_updates(p, updates)
    assert _loss(p) < _loss(params)


def _state_bytes_per_param(tx, shapes):
  params = model_shapes.as_params(shapes)
  state = jax.eval_shape(tx.init, params)
  return model_shapes.tree_bytes(state) / model_shapes.num_params(shapes)


def test_state_memory_on_flux_shapes():
  shapes = model_shapes.flux_dev_shapes()
  assert 11.8e9 < model_shapes.num_params(shapes) < 12.0e9
  plain = _state_bytes_per_param(ok.prodigy(), shapes)
  b1_0 = _state_bytes_per_param(ok.prodigy(b1=0.0), shapes)
  factored = _state_bytes_per_param(ok.prodigy_factored(), shapes)
  scalars = 1e-6  # d, counts, ...: a few dozen bytes in all
  assert 7.9 < plain <= 8.0 + scalars
  assert 5.9 < b1_0 <= 6.0 + scalars
  assert 0.3 < factored <= 0.4
  # Inside kahan the state is float32, plus the 2 B/param host residual.
  in_kahan = _state_bytes_per_param(ok.kahan(ok.prodigy_factored()), shapes)
  assert 2.6 < in_kahan <= 2.8
  # The compact state: s, x0 (and 1-D leaves' v) in bf16 inside kahan; the
  # device holds the inner state only (the residuals, 2 B/param, are host).
  tx = ok.kahan(ok.prodigy_factored(state_dtype=jnp.bfloat16))
  inner = jax.eval_shape(tx.init, model_shapes.as_params(shapes)).inner_state
  compact = model_shapes.tree_bytes(inner) / model_shapes.num_params(shapes)
  assert 0.3 < compact <= 0.40
  for leaf in jax.tree.leaves(inner.s) + jax.tree.leaves(inner.params0):
    assert leaf.dtype == jnp.bfloat16


@pytest.mark.parametrize("kwargs, arg", [
    ({"d0": 0.0}, "d0"), ({"d0": -1e-6}, "d0"),
    ({"learning_rate": -1.0}, "learning_rate"),
    ({"b1": 1.0}, "b1"), ({"b1": -0.1}, "b1"), ({"b2": 1.0}, "b2"),
    ({"b3": 1.5}, "b3"), ({"slice_p": 0}, "slice_p"),
    ({"slice_p": 2.5}, "slice_p"), ({"eps": 0.0}, "eps"),
    ({"eps": -1e-8}, "eps"), ({"d_coef": 0.0}, "d_coef"),
    ({"growth_rate": 0.0}, "growth_rate"),
    ({"weight_decay": -0.1}, "weight_decay"),
    ({"update_clip": 0.0}, "update_clip"),
])
def test_bad_hyperparameters_name_the_argument(kwargs, arg):
  with pytest.raises(ValueError, match=arg):
    ok.prodigy(**kwargs)
  with pytest.raises(ValueError, match=arg):
    ok.prodigy_factored(**kwargs)


def test_stable_adamw_bad_hyperparameters():
  with pytest.raises(ValueError, match="b2"):
    ok.stable_adamw(1e-3, b2=1.0)
  with pytest.raises(ValueError, match="eps"):
    ok.stable_adamw(1e-3, eps=0.0)


@pytest.mark.parametrize("name", sorted(OPTIMIZERS))
@pytest.mark.parametrize("wrap", ["plain", "kahan"])
def test_params_and_state_can_be_donated(name, wrap):
  """Eagerly built states share no buffer with the params or each other."""
  tx = OPTIMIZERS[name]()
  if wrap == "kahan":
    tx = ok.kahan(tx)
  params = commit({"w": jnp.ones((4, 8), jnp.bfloat16),
                   "b": jnp.ones(8, jnp.bfloat16),
                   "f": jnp.ones(3, jnp.float32)})
  state = tx.init(params)

  @functools.partial(jax.jit, donate_argnums=(0, 1))
  def step(params, state):
    grads = jax.tree.map(jnp.ones_like, params)
    updates, state = tx.update(grads, state, params)
    return optax.apply_updates(params, updates), state

  with _stall_warned(name if wrap == "plain" else "", jnp.bfloat16):
    step.lower(params, state)
  for _ in range(2):
    params, state = step(params, state)
  assert all(bool(jnp.all(jnp.isfinite(p.astype(jnp.float32))))
             for p in jax.tree.leaves(params))


@pytest.mark.parametrize("name", sorted(OPTIMIZERS))
def test_complex_params_are_refused(name):
  tx = OPTIMIZERS[name]()
  with pytest.raises(TypeError, match=r"\['z'\] is complex64"):
    tx.init({"x": jnp.ones(2), "z": jnp.ones(2, jnp.complex64)})


def test_bf16_hyperparameters_warn():
  tx = optax.inject_hyperparams(ok.prodigy, static_args=("slice_p",))()
  params = {"w": jnp.ones(3, jnp.bfloat16)}
  with pytest.warns(ok.OptaxKahanWarning, match="hyperparam_dtype=jnp.float32"):
    tx.update(params, tx.init(params), params)


def test_every_argument_is_documented():
  # inspect.cleandoc: Python 3.13 strips a docstring's indentation when it
  # compiles it, 3.11 keeps it; cleaned, both read the same.
  for fn in (ok.prodigy, ok.prodigy_factored, ok.stable_adamw):
    for arg in inspect.signature(fn).parameters:
      doc = inspect.cleandoc(
          (ok.prodigy if fn is ok.prodigy_factored else fn).__doc__)
      assert f"\n  {arg}:" in doc, (fn.__name__, arg)
  for arg in ("b1", "slice_p", "update_clip",  # the defaults that differ
              "bias_corrected_clip"):
    assert f"``{arg}=" in ok.prodigy_factored.__doc__, arg


def test_prodigy_factored_is_prodigy_with_its_own_defaults():
  whole = inspect.signature(ok.prodigy).parameters
  factored = inspect.signature(ok.prodigy_factored).parameters
  assert list(factored) == [n for n in whole if n != "factored"]
  differ = {n: p.default for n, p in factored.items()
            if p.default != whole[n].default}
  assert differ == {"b1": 0.0, "slice_p": 11, "update_clip": 1.0,
                    "bias_corrected_clip": True}
  for n, p in factored.items():
    assert p.annotation == whole[n].annotation, n

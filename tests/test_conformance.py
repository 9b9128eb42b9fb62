"""Conformance matrix: every public optimizer in every way users run one.

Rows (``ROWS``): the named optimizers, ``kahan`` of each and of
``optax.adamw``, the ``leafwise`` forms, a chain with this package's
``clip_by_global_norm`` and ``stochastic_rounding``. Each row
is a factory of the learning rate, so ``inject_hyperparams`` and schedules
reach it (Prodigy's learning rate multiplies its ``d``).

Columns (one test each): jit with donation and one compilation over three
steps; ``nnx.Optimizer`` with the float32 export; linen ``TrainState``;
``inject_hyperparams``; ``MultiSteps``, ``masked``, ``partition``,
``apply_if_finite``; a chain with ``clip_by_global_norm``; schedules;
``eval_shape`` and abstract init; ``map_params``; orbax save and restore;
Explicit and Auto sharding on a leading and a non-leading axis (8 CPU
devices, in a child process); bf16, float32 and mixed param trees.

The params are tiny (a bf16 kernel, a bf16 vector and a float32 vector) so
that each case compiles in well under a second. The default suite runs a
third of each column's rows, a different third per column (``_matrix``);
``pytest -m slow`` the rest.
"""

from __future__ import annotations

import contextlib
import functools
import json

import flax.linen as nn
import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest
from flax import nnx
from flax.training import train_state

import optax_kahan as ok

from _matrix import sampled
from _subprocess import run as run_child

KEY = jax.random.key(0)

D0 = 1e-2  # so that a few Prodigy steps move bf16 weights visibly

# name -> (wrapper, inner factory of the learning rate, default rate)
INNER = {
    "prodigy": (lambda lr: ok.prodigy(lr, d0=D0), 1.0),
    "prodigy_factored": (lambda lr: ok.prodigy_factored(lr, d0=D0), 1.0),
    "stable_adamw": (ok.stable_adamw, 1e-2),
    "adamw": (optax.adamw, 1e-2),
    "leafwise(prodigy)": (lambda lr: ok.leafwise(ok.prodigy(lr, d0=D0)), 1.0),
    "leafwise(adamw)": (lambda lr: ok.leafwise(optax.adamw(lr)), 1e-2),
    "chain(clip_by_global_norm, adamw)": (lambda lr: ok.per_leaf.chain(
        ok.per_leaf.clip_by_global_norm(1.0), optax.adamw(lr)), 1e-2),
}
WRAPPERS = {
    "kahan": ok.kahan,
    "stochastic_rounding": lambda tx: ok.stochastic_rounding(tx, KEY),
}
ROWS = {
    "prodigy": (None, "prodigy"),
    "prodigy_factored": (None, "prodigy_factored"),
    "stable_adamw": (None, "stable_adamw"),
    "leafwise(prodigy)": (None, "leafwise(prodigy)"),
    "chain(clip_by_global_norm, adamw)": (None,
                                          "chain(clip_by_global_norm, adamw)"),
    "kahan(adamw)": ("kahan", "adamw"),
    "kahan(prodigy)": ("kahan", "prodigy"),
    "kahan(prodigy_factored)": ("kahan", "prodigy_factored"),
    "kahan(stable_adamw)": ("kahan", "stable_adamw"),
    "kahan(chain(clip_by_global_norm, adamw))": (
        "kahan", "chain(clip_by_global_norm, adamw)"),
    "kahan(leafwise(adamw))": ("kahan", "leafwise(adamw)"),
    "stochastic_rounding(adamw)": ("stochastic_rounding", "adamw"),
}
NAMES = sorted(ROWS)
KAHAN = [n for n in NAMES if ROWS[n][0] == "kahan"]


def make(name, lr=None, inside=lambda tx: tx):
  """Row ``name``: ``wrapper(inside(inner(lr)))`` (default rate if None)."""
  wrapper, inner = ROWS[name]
  factory, default = INNER[inner]
  tx = inside(factory(default if lr is None else lr))
  return tx if wrapper is None else WRAPPERS[wrapper](tx)


def default_lr(name):
  return INNER[ROWS[name][1]][1]


def params_of(kind="mixed", committed=True):
  """A tiny tree: bf16 kernel and bias, float32 scale (``kind`` changes it).

  Committed to the device, as restored params are: a jitted step whose
  arguments mix committed and uncommitted arrays lowers again once its
  outputs (all committed) come back, optax's own optimizers included. With
  ``kahan`` the offloaded residuals are committed, so the params must be too
  (``kahan`` warns otherwise); the other rows get uncommitted params, as in
  optax's own test.
  """
  rng = np.random.default_rng(0)
  tree = {"kernel": rng.standard_normal((4, 3)).astype(np.float32),
          "bias": np.zeros(3, np.float32) + 0.1,
          "scale": np.ones(3, np.float32)}
  def cast(k, a):
    wide = kind == "float32" or (kind == "mixed" and k == "scale")
    x = jnp.asarray(a, jnp.float32 if wide else jnp.bfloat16)
    return jax.device_put(x, jax.devices()[0]) if committed else x
  return {k: cast(k, a) for k, a in tree.items()}


def loss_fn(params, x):
  h = x @ params["kernel"].astype(jnp.float32) + params["bias"]
  return jnp.mean(jnp.square(h * params["scale"] - 1.0))


X = jnp.asarray(np.random.default_rng(1).standard_normal((8, 4)), jnp.float32)


def grads_of(params):
  """Gradients in the params' dtypes, as a bf16 backward pass gives them."""
  g = jax.grad(loss_fn)(jax.tree.map(lambda p: p.astype(jnp.float32), params),
                        X)
  return jax.tree.map(lambda g, p: g.astype(p.dtype), g, params)


def step_fn(tx):
  def step(params, state):
    updates, state = tx.update(grads_of(params), state, params)
    return optax.apply_updates(params, updates), state
  return step


def assert_moved(before, after, names=("kernel",)):
  for k in names:
    assert not np.array_equal(np.asarray(before[k], np.float32),
                              np.asarray(after[k], np.float32)), k


def exact(params, state, name):
  """The weights' exact values in float32 (bf16 and residual under kahan)."""
  if name in KAHAN:
    params = ok.kahan_to_float32(params, ok.kahan_residuals(state))
  return jax.tree.map(lambda p: np.asarray(p, np.float32), params)


def assert_dtypes(params, like):
  assert jax.tree.map(lambda p: p.dtype, params) == jax.tree.map(
      lambda p: p.dtype, like)


@pytest.mark.parametrize("name, kind", sampled(
    [(n, k) for n in NAMES for k in ("mixed", "bfloat16", "float32")], 0,
    every=4, ids=[f"{n}-{k}" for n in NAMES
                  for k in ("mixed", "bfloat16", "float32")]))
def test_jit_donation_one_compile_three_steps(name, kind):
  tx = make(name)
  params = params_of(kind, committed=name in KAHAN)
  # kahan on float32 params compensates nothing, and says so.
  nothing = kind == "float32" and name in KAHAN
  with (pytest.warns(ok.OptaxKahanWarning, match="nothing to compensate")
        if nothing else contextlib.nullcontext()):
    state = tx.init(params)
    init = tx.init(params_of(kind))
  step = jax.jit(step_fn(tx), donate_argnums=(0, 1))
  p = params
  for _ in range(3):
    p, state = step(p, state)
  assert step._cache_size() == 1, "the step compiled more than once"
  assert_dtypes(p, params_of(kind))
  before = exact(params_of(kind), init, name)
  after = exact(p, state, name)
  assert not np.array_equal(before["kernel"], after["kernel"])


@pytest.mark.parametrize("name", sampled(NAMES, 0))
def test_nnx_optimizer_and_float32_export(name):

  class Model(nnx.Module):

    def __init__(self):
      self.dense = nnx.Linear(4, 3, param_dtype=jnp.bfloat16, rngs=nnx.Rngs(0))
      self.scale = nnx.Param(jnp.ones(3, jnp.float32))

    def __call__(self, x):
      return self.dense(x).astype(jnp.float32) * self.scale

  model = Model()
  opt = ok.kahan_nnx_optimizer(model, make(name), wrt=nnx.Param)
  before = np.asarray(model.dense.kernel[...], np.float32)

  @nnx.jit
  def train_step(model, opt):
    loss, grads = nnx.value_and_grad(
        lambda m: jnp.mean(jnp.square(m(X) - 1.0)))(model)
    opt.update(model, grads)
    return loss

  for _ in range(3):
    train_step(model, opt)
  assert not np.array_equal(before, np.asarray(model.dense.kernel[...],
                                               np.float32))
  assert model.dense.kernel[...].dtype == jnp.bfloat16
  if name in KAHAN:
    exact = ok.kahan_to_float32(nnx.state(model, nnx.Param),
                                ok.kahan_residuals(opt.opt_state))
    kernel = exact["dense"]["kernel"][...]
    assert kernel.dtype == jnp.float32
    np.testing.assert_array_equal(
        np.asarray(ok.split_float32(kernel)[0], np.float32),
        np.asarray(model.dense.kernel[...], np.float32))


@pytest.mark.parametrize("name", sampled(NAMES, 1))
def test_linen_train_state(name):
  model = nn.Dense(3, param_dtype=jnp.bfloat16)
  variables = model.init(jax.random.key(0), X)
  params = jax.device_put(variables["params"], jax.devices()[0])
  state = train_state.TrainState.create(apply_fn=model.apply, params=params,
                                        tx=make(name))

  @jax.jit
  def train_step(state):
    grads = jax.grad(lambda p: jnp.mean(jnp.square(
        state.apply_fn({"params": p}, X).astype(jnp.float32) - 1.0)))(
            state.params)
    return state.apply_gradients(grads=grads)

  new = train_step(train_step(state))
  assert new.params["kernel"].dtype == jnp.bfloat16
  assert_moved(state.params, new.params)


@pytest.mark.parametrize("name", sampled(NAMES, 2))
def test_inject_hyperparams_matches_fixed(name):
  params = params_of()
  lr = default_lr(name) / 2
  tx = make(name, lr)
  injected = optax.inject_hyperparams(
      lambda learning_rate: make(name, learning_rate),
      hyperparam_dtype=jnp.float32)(lr)
  a, b = params, params
  sa, sb = tx.init(params), injected.init(params)
  step_a, step_b = jax.jit(step_fn(tx)), jax.jit(step_fn(injected))
  for _ in range(2):
    a, sa = step_a(a, sa)
    b, sb = step_b(b, sb)
  # Without kahan, bf16 leaves may round bf16 ulps apart: optax scales by a
  # Python float (weakly typed, so in bf16) or by an injected float32, and a
  # bf16 global norm moves every clipped entry: a few ulps of the leaf's
  # largest entry.
  for k in a:
    x, y = np.asarray(a[k], np.float32), np.asarray(b[k], np.float32)
    if name in KAHAN:
      np.testing.assert_allclose(x, y, rtol=1e-6, atol=1e-7)
    else:
      np.testing.assert_allclose(x, y, rtol=2.0**-7,
                                 atol=2.0**-6 * np.abs(y).max())


@pytest.mark.parametrize("name", sampled(NAMES, 3))
def test_multisteps_applies_every_second_call(name):
  tx = optax.MultiSteps(make(name), every_k_schedule=2)
  params = params_of()
  state = tx.init(params)
  step = jax.jit(step_fn(tx))
  p1, state = step(params, state)
  for k in params:
    np.testing.assert_array_equal(np.asarray(p1[k], np.float32),
                                  np.asarray(params[k], np.float32))
  p2, state = step(p1, state)
  assert_moved(params, p2)
  assert_dtypes(p2, params)


@pytest.mark.parametrize("name", sampled(NAMES, 4))
def test_masked_and_partition(name):
  # masked: the masked-out leaves' updates are their gradients (optax's
  # rule); partition with set_to_zero freezes them.
  params = params_of()
  train = {"kernel": True, "bias": False, "scale": False}
  labels = {k: "train" if v else "frozen" for k, v in train.items()}
  for how, tx in (
      ("masked", optax.masked(make(name), train)),
      ("partition", optax.partition(
          {"train": make(name), "frozen": optax.set_to_zero()}, labels))):
    state = tx.init(params)
    grads = grads_of(params)
    updates, state = jax.jit(tx.update)(grads, state, params)
    p = optax.apply_updates(params, updates)
    for k in ("bias", "scale"):
      want = grads[k] if how == "masked" else jnp.zeros_like(grads[k])
      np.testing.assert_array_equal(np.asarray(updates[k], np.float32),
                                    np.asarray(want, np.float32))
    if name in KAHAN:
      exact32 = ok.kahan_to_float32(p, ok.kahan_residuals(state))
      assert not np.array_equal(exact32["kernel"],
                                np.asarray(params["kernel"], np.float32))
      np.testing.assert_array_equal(
          np.asarray(ok.split_float32(exact32["kernel"])[0], np.float32),
          np.asarray(p["kernel"], np.float32))
      assert exact32["bias"].dtype == jnp.float32


@pytest.mark.parametrize("name", sampled(NAMES, 5))
def test_apply_if_finite_skips_a_nan_step(name):
  # Inside kahan and stochastic_rounding: their float32 deltas do not fit
  # apply_if_finite's rejected branch, zeros in the gradients' dtype (bf16),
  # so they go outside (kahan's docstring); inside kahan, this package's
  # apply_if_finite keeps the per-leaf form (optax's runs on the whole tree).
  finite = functools.partial(optax.apply_if_finite, max_consecutive_errors=3)
  if ROWS[name][0] is not None:
    tx = make(name, inside=functools.partial(
        ok.per_leaf.apply_if_finite if ROWS[name][0] == "kahan"
        else optax.apply_if_finite, max_consecutive_errors=3))
  else:
    tx = finite(make(name))
  params = params_of(committed=name in KAHAN)
  state = tx.init(params)

  @jax.jit
  def step(params, state, poison):
    g = jax.tree.map(lambda g: jnp.where(poison, jnp.nan, g).astype(g.dtype),
                     grads_of(params))
    updates, state = tx.update(g, state, params)
    return optax.apply_updates(params, updates), state

  p, s = step(params, state, True)
  for k in params:
    np.testing.assert_array_equal(np.asarray(p[k], np.float32),
                                  np.asarray(params[k], np.float32))
  p, s = step(p, s, False)
  assert not np.array_equal(exact(params, state, name)["kernel"],
                            exact(p, s, name)["kernel"])
  assert step._cache_size() == 1


@pytest.mark.parametrize("name", sampled(NAMES, 6))
def test_chain_with_global_norm_clipping(name):
  tx = optax.chain(optax.clip_by_global_norm(1e-3), make(name))
  params = params_of()
  p, _ = jax.jit(step_fn(tx))(params, tx.init(params))
  assert_moved(params, p)
  assert_dtypes(p, params)


@pytest.mark.parametrize("name", sampled(NAMES, 7))
def test_constant_schedule_equals_constant(name):
  params = params_of()
  lr = default_lr(name)
  fixed, sched = make(name, lr), make(name, optax.constant_schedule(lr))
  a, _ = jax.jit(step_fn(fixed))(params, fixed.init(params))
  b, _ = jax.jit(step_fn(sched))(params, sched.init(params))
  for k in a:
    np.testing.assert_array_equal(np.asarray(a[k], np.float32),
                                  np.asarray(b[k], np.float32))


@pytest.mark.parametrize("name", sampled(NAMES, 8))
def test_abstract_init_and_eval_shape(name):
  tx = make(name)
  params = params_of()
  real = jax.tree.map(lambda x: (x.shape, x.dtype), tx.init(params))
  shapes = jax.tree.map(lambda x: jax.ShapeDtypeStruct(x.shape, x.dtype),
                        params)
  for state in (tx.init(shapes), jax.eval_shape(tx.init, params)):
    assert jax.tree.map(lambda x: (x.shape, x.dtype), state) == real


@pytest.mark.parametrize("name", sampled(NAMES, 9))
def test_map_params(name):
  tx = make(name)
  params = params_of()
  state = tx.init(params)
  mapped = optax.tree.map_params(tx, lambda v: v, state)
  assert jax.tree.structure(mapped) == jax.tree.structure(state)


@pytest.mark.parametrize("name", sampled(NAMES, 10))
def test_orbax_round_trip_continues_bit_for_bit(name, tmp_path):
  ocp = pytest.importorskip("orbax.checkpoint")
  tx = make(name)
  step = jax.jit(step_fn(tx))
  params, state = step(params_of(), tx.init(params_of()))
  params, state = step(params, state)
  ckpt = ocp.StandardCheckpointer()
  ckpt.save(tmp_path / "c", {"params": params, "state": state})
  ckpt.wait_until_finished()
  target = jax.tree.map(
      lambda x: jax.ShapeDtypeStruct(x.shape, x.dtype, sharding=x.sharding),
      {"params": params, "state": state})
  restored = ckpt.restore(tmp_path / "c", target)
  want, _ = step(params, state)
  got, _ = step(restored["params"], restored["state"])
  for k in want:
    np.testing.assert_array_equal(np.asarray(want[k], np.float32),
                                  np.asarray(got[k], np.float32))


SHARDED = r'''
sys.path.insert(0, "tests")
from jax.sharding import AxisType
import test_conformance as tc

report = {}
for mode in ("explicit", "auto"):
  axis = AxisType.Explicit if mode == "explicit" else AxisType.Auto
  mesh = jax.make_mesh((8,), ("x",), axis_types=(axis,))
  # A replicated vector as each mode's step returns it (JAX spells it P(None)
  # under Explicit axes and P() under Auto ones; a step given the other
  # spelling compiles again on its second call, optax.adamw included).
  replicated = P(None) if mode == "explicit" else P()
  for where, spec in (("leading", P("x", None)), ("non-leading", P(None, "x"))):
    with jax.set_mesh(mesh):
      for name in tc.NAMES:
        key = f"{mode}/{where}/{name}"
        params = {"kernel": jax.device_put(
                      jnp.asarray(np.linspace(-1, 1, 64).reshape(8, 8),
                                  jnp.bfloat16), NamedSharding(mesh, spec)),
                  "scale": jax.device_put(jnp.ones(8, jnp.float32),
                                          NamedSharding(mesh, replicated))}
        try:
          tx = tc.make(name)
          state = tx.init(params)
          def step(params, state):
            g = jax.tree.map(lambda p: (jnp.cos(p.astype(jnp.float32))
                                        ).astype(p.dtype), params)
            u, state = tx.update(g, state, params)
            return optax.apply_updates(params, u), state
          step = jax.jit(step, donate_argnums=(0, 1))
          p, s = step(params, state)
          p, s = step(p, s)
          kernel = p["kernel"]
          same = kernel.sharding.is_equivalent_to(NamedSharding(mesh, spec), 2)
          checks = {
              "kernel keeps its sharding": bool(same),
              "kernel stays bf16": kernel.dtype == jnp.bfloat16,
              "one compilation": step._cache_size() == 1}
          report[key] = {"ok": all(checks.values()),
                         "failed": [k for k, v in checks.items() if not v]}
        except Exception as e:  # reported to the parent, which fails on it
          report[key] = {"ok": False, "error": f"{type(e).__name__}: {e}"[:400]}

# optax's own sharding tests (optax/_src/sharding_test.py), their bodies run
# on each row. They use float16 params, which kahan and stochastic_rounding
# refuse by design, so those rows are left out here. Their guard
# `jax.__version__ < '0.7.2'` compares strings, so it skips them on jax 0.10;
# they run with the version string they read patched.
from unittest import mock
from optax._src import sharding_test
case = sharding_test.ShardingTest("run")
for test in ("test_init_with_abstract_input",
             "test_state_sharding_type_init_match_update",
             "test_state_sharding_type_preserved_with_jit"):
  body = next(fn.__wrapped__ for fn in (
      getattr(sharding_test.ShardingTest, a)
      for a in dir(sharding_test.ShardingTest))
      if getattr(fn, "__wrapped__", None) is not None
      and fn.__wrapped__.__name__ == test)
  for name in tc.NAMES:
    if tc.ROWS[name][0] is None:
      try:
        with mock.patch.object(jax, "__version__", "99.0.0"):
          body(case, tc.make(name))
        report[f"optax/{test}/{name}"] = {"ok": True}
      except Exception as e:
        report[f"optax/{test}/{name}"] = {
            "ok": False, "error": f"{type(e).__name__}: {e}"[:400]}
emit(report)
'''


@pytest.mark.slow  # 25 s: a child process with 8 devices
def test_explicit_and_auto_sharding_on_leading_and_non_leading_axes():
  report = run_child(SHARDED, timeout=600)
  failed = {k: v for k, v in report.items() if not v["ok"]}
  plain = [n for n in NAMES if ROWS[n][0] is None]
  assert len(report) == 2 * 2 * len(NAMES) + 3 * len(plain)
  assert not failed, json.dumps(failed, indent=1)

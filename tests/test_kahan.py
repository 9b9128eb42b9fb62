"""Kahan-compensated bf16 updates: bit-exact float32 semantics, offload, optax/Flax use."""

import functools
import warnings

import flax.linen
import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest
from flax import nnx
from flax.training import train_state

import optax_kahan as ok
from _steps import commit

ROUNDINGS = ["nearest", "truncate"]


def _bits(x):
  return np.asarray(x).view(np.uint32)


@pytest.mark.parametrize("rounding", ROUNDINGS)
def test_functional_api_equals_float32_accumulation(rounding):
  rng = np.random.default_rng(0)
  n, steps = 256, 1000
  x0 = (rng.standard_normal(n) * 10.0**rng.uniform(-3, 3, n)).astype(np.float32)
  mags = 10.0**rng.uniform(-12, 2, (steps, n))
  ups = (rng.choice([-1, 1], (steps, n)) * mags * np.abs(x0)).astype(np.float32)
  ups[::50] = 0.0  # some exact no-op steps

  @jax.jit
  def run_f32(x, ups):
    return jax.lax.scan(lambda x, u: (x + u, None), x, ups)[0]

  @jax.jit
  def run_kahan(params, residuals, ups):
    def body(carry, u):
      p, r = carry
      p, r = ok.kahan_apply_updates({"w": p}, {"w": u}, {"w": r},
                                    rounding=rounding)
      return (p["w"], r["w"]), None
    return jax.lax.scan(body, (params, residuals), ups)[0]

  want = run_f32(jnp.asarray(x0), jnp.asarray(ups))
  params, residuals = ok.kahan_from_float32({"w": jnp.asarray(x0)},
                                            rounding=rounding, offload=False)
  p, r = run_kahan(params["w"], residuals["w"], jnp.asarray(ups))
  got = ok.kahan_to_float32({"w": p}, {"w": r}, rounding=rounding)["w"]
  np.testing.assert_array_equal(_bits(got), _bits(want))
  # The bf16 params are the rounding of the exact value.
  np.testing.assert_array_equal(
      np.asarray(p).view(np.uint16),
      np.asarray(ok.split_float32(want, rounding)[0]).view(np.uint16))


def test_functional_api_keeps_residual_memory_kind():
  params = {"w": jnp.ones(8, jnp.bfloat16)}
  for offload, kind in ((True, "pinned_host"), (False, "device")):
    res = ok.kahan_init(params, offload=offload)
    p, res = jax.jit(ok.kahan_apply_updates)(
        params, {"w": jnp.full(8, 1e-5)}, res)
    assert res["w"].sharding.memory_kind == kind
    np.testing.assert_allclose(
        ok.kahan_to_float32(p, res)["w"], np.float32(1.0) + np.float32(1e-5))


# A small MLP trained with bf16 weights: Kahan vs float32 master weights.

def _mlp(params, x):
  h = jnp.tanh(x @ params["w1"] + params["b1"])
  return h @ params["w2"] + params["b2"]


def _loss(params, batch):
  x, y = batch
  pred = _mlp(params, x.astype(params["w1"].dtype))
  return jnp.mean(jnp.square(pred.astype(jnp.float32) - y))


def _init_params():
  k1, k2 = jax.random.split(jax.random.key(0))
  return {
      "w1": jax.random.normal(k1, (8, 32)) * 0.5,
      "b1": jnp.zeros(32),
      "w2": jax.random.normal(k2, (32, 1)) * 0.2,
      "b2": jnp.zeros(1),
  }


def _batches(steps):
  kx, kw = jax.random.split(jax.random.key(1))
  x = jax.random.normal(kx, (steps, 16, 8))
  w = jax.random.normal(kw, (8, 1))
  return x, jnp.sin(x @ w)


# AdamW whose bias corrections multiply by reciprocals: the same bits in a
# one-leaf program as in a whole-tree one (optax.adamw divides, and XLA turns
# that division into a multiplication only where the scalar has one user).
ADAMW = ok.per_leaf.chain(ok.scale_by_second_moment(0.9, 0.999, 1e-8,
                                           bias_correction=True),
                 optax.add_decayed_weights(0.1),
                 optax.scale_by_learning_rate(3e-4))


@pytest.mark.parametrize("rounding, form", [
    ("nearest", "cpu"), ("truncate", "cpu"), ("nearest", "gpu chain")])
def test_training_is_bit_identical_to_float32_master(rounding, form,
                                                     monkeypatch):
  """Over 300 steps, against float32 master weights stepped by the same
  optimizer leaf by leaf (``ok.leafwise``: ``kahan`` runs its inner
  transformation leaf by leaf, and XLA rounds optax.adamw's bias-correction
  division differently in a one-leaf program; see
  ``test_per_leaf_adamw_is_optax_adamw_on_each_leaf_alone``). "gpu chain": the
  form lowered for GPUs (rows ordered by data dependencies), forced here on
  the CPU."""
  if form == "gpu chain":
    monkeypatch.setattr(jax.lax, "platform_dependent",
                        lambda *args, cpu, default: default(*args))
  steps = 300
  inner = ADAMW
  reference = inner
  xs, ys = _batches(steps)

  # Reference: float32 master weights, forward pass on their bf16 rounding.
  @jax.jit
  def master_step(master, state, batch):
    hi = jax.tree.map(lambda m: ok.split_float32(m, rounding)[0], master)
    grads = jax.grad(_loss)(hi, batch)
    grads = jax.tree.map(lambda g: g.astype(jnp.float32), grads)
    updates, state = reference.update(grads, state, master)
    return optax.apply_updates(master, updates), state

  master = _init_params()
  params_f32 = master
  m_state = reference.init(master)
  for i in range(steps):
    master, m_state = master_step(master, m_state, (xs[i], ys[i]))

  # Kahan: bf16 params + host residuals, plain optax.apply_updates.
  tx = ok.kahan(inner, rounding=rounding)

  @functools.partial(jax.jit, donate_argnums=(0, 1))
  def kahan_step(params, state, batch):
    grads = jax.grad(_loss)(params, batch)
    updates, state = tx.update(grads, state, params)
    return optax.apply_updates(params, updates), state

  params, residuals = ok.kahan_from_float32(commit(params_f32),
                                            rounding=rounding)
  state = ok.kahan_replace_residuals(tx.init(params), residuals)
  for i in range(steps):
    params, state = kahan_step(params, state, (xs[i], ys[i]))
  assert all(p.dtype == jnp.bfloat16 for p in jax.tree.leaves(params))
  exact = ok.kahan_to_float32(params, state.residuals, rounding=rounding)
  for name in master:
    np.testing.assert_array_equal(_bits(exact[name]), _bits(master[name]),
                                  err_msg=name)

  # Plain bf16 updates (round to nearest even in optax.apply_updates) drift.
  @jax.jit
  def plain_step(params, state, batch):
    grads = jax.grad(_loss)(params, batch)
    updates, state = inner.update(grads, state, params)
    return optax.apply_updates(params, updates), state

  plain = jax.tree.map(lambda p: p.astype(jnp.bfloat16), params_f32)
  p_state = inner.init(plain)
  for i in range(steps):
    plain, p_state = plain_step(plain, p_state, (xs[i], ys[i]))
  drift = max(float(jnp.max(jnp.abs(plain[k].astype(jnp.float32) - master[k])))
              for k in master)
  kahan_drift = max(float(jnp.max(jnp.abs(exact[k] - master[k])))
                    for k in master)
  assert kahan_drift == 0.0
  assert drift > 1e-3, f"plain bf16 should visibly drift, got {drift}"


def test_residuals_memory_kind_after_jitted_step():
  params = commit({"w": jnp.ones((4, 4), jnp.bfloat16), "b": jnp.zeros(4)})
  grads = {"w": jnp.ones((4, 4), jnp.bfloat16), "b": jnp.ones(4)}
  for offload, kind in ((True, "pinned_host"), (False, "device")):
    tx = ok.kahan(optax.sgd(1e-3), offload=offload)
    state = jax.jit(tx.init)(params)
    assert state.residuals["b"] is None
    _, state = jax.jit(tx.update)(grads, state, params)
    assert state.residuals["w"].sharding.memory_kind == kind


def test_float32_leaves_pass_through_and_extra_args():
  params = {"w": jnp.ones(3, jnp.bfloat16), "b": jnp.ones(3, jnp.float32)}
  grads = {"w": jnp.ones(3, jnp.bfloat16), "b": jnp.ones(3)}
  inner = optax.contrib.reduce_on_plateau()  # needs the `value` extra arg
  tx = ok.kahan(optax.chain(optax.sgd(0.5), inner), offload=False)
  state = tx.init(params)
  updates, state = tx.update(grads, state, params, value=jnp.float32(1.0))
  assert updates["b"].dtype == jnp.float32
  np.testing.assert_array_equal(updates["b"], -0.5 * np.ones(3))
  np.testing.assert_array_equal(updates["w"], -0.5 * np.ones(3))


@pytest.mark.parametrize("nesting", ["inside", "outside"])
def test_nan_step_under_apply_if_finite_changes_nothing(nesting):
  """kahan(ok.per_leaf.apply_if_finite(tx)) is the supported nesting.

  Inside, the inner transformation sees float32 gradients and returns zeros on
  a non-finite step; x + 0 splits back into the same bf16 and residual. The
  outer nesting apply_if_finite(kahan(tx)) works only with float32 gradients:
  its reject branch returns zeros in the gradient's dtype, which must match
  kahan's float32 deltas (with bf16 gradients jax.lax.cond refuses to trace).
  """
  adam = optax.adam(1e-3)
  if nesting == "outside":
    tx = optax.apply_if_finite(ok.kahan(adam), max_consecutive_errors=5)
    grad_dtype = jnp.float32
  else:
    tx = ok.kahan(ok.per_leaf.apply_if_finite(adam, max_consecutive_errors=5))
    grad_dtype = jnp.bfloat16
  params = commit({"w": jnp.linspace(-1, 1, 16, dtype=jnp.bfloat16)})
  state = tx.init(params)
  step = jax.jit(lambda g, s, p: tx.update(g, s, p))
  good = jnp.full(16, 0.3, grad_dtype)
  upd, state = step({"w": good}, state, params)
  params = optax.apply_updates(params, upd)
  before = ok.kahan_to_float32(params, ok.kahan_residuals(state))
  upd, state = step({"w": good.at[3].set(jnp.nan)}, state, params)
  new = optax.apply_updates(params, upd)
  np.testing.assert_array_equal(_bits(new["w"].astype(jnp.float32)),
                                _bits(params["w"].astype(jnp.float32)))
  after = ok.kahan_to_float32(new, ok.kahan_residuals(state))
  np.testing.assert_array_equal(_bits(after["w"]), _bits(before["w"]))
  # And the next finite step moves again.
  upd, state = step({"w": good}, state, new)
  assert float(jnp.max(jnp.abs(upd["w"]))) > 0


def test_flax_nnx_optimizer_trains_bf16_model():
  model = nnx.Linear(4, 3, param_dtype=jnp.bfloat16, rngs=nnx.Rngs(0))
  optimizer = ok.kahan_nnx_optimizer(model, ok.kahan(optax.adam(1e-2)),
                                     wrt=nnx.Param)
  x = jax.random.normal(jax.random.key(0), (32, 4)).astype(jnp.bfloat16)
  y = jnp.ones((32, 3))

  @nnx.jit
  def train_step(model, optimizer):
    def loss_fn(model):
      return jnp.mean(jnp.square(model(x).astype(jnp.float32) - y))
    loss, grads = nnx.value_and_grad(loss_fn)(model)
    optimizer.update(model, grads)
    return loss

  losses = [float(train_step(model, optimizer)) for _ in range(30)]
  assert model.kernel[...].dtype == jnp.bfloat16
  assert losses[-1] < 0.5 * losses[0]


def test_flax_train_state_trains_bf16_model():
  model = flax.linen.Dense(3, param_dtype=jnp.bfloat16)
  x = jax.random.normal(jax.random.key(0), (32, 4)).astype(jnp.bfloat16)
  y = jnp.ones((32, 3))
  params = commit(model.init(jax.random.key(1), x))
  state = train_state.TrainState.create(
      apply_fn=model.apply, params=params, tx=ok.kahan(optax.adam(1e-2)))

  @jax.jit
  def train_step(state):
    def loss_fn(params):
      return jnp.mean(jnp.square(
          state.apply_fn(params, x).astype(jnp.float32) - y))
    loss, grads = jax.value_and_grad(loss_fn)(state.params)
    return state.apply_gradients(grads=grads), loss

  losses = []
  for _ in range(30):
    state, loss = train_step(state)
    losses.append(float(loss))
  assert jax.tree.leaves(state.params)[0].dtype == jnp.bfloat16
  assert losses[-1] < 0.5 * losses[0]


def test_works_under_explicit_mesh():
  mesh = jax.make_mesh((1,), ("data",),
                       axis_types=(jax.sharding.AxisType.Explicit,))
  with jax.set_mesh(mesh):
    sharding = jax.sharding.NamedSharding(mesh, jax.P("data"))
    params = {"w": jax.device_put(jnp.ones(8, jnp.bfloat16), sharding)}
    tx = ok.kahan(optax.adam(1e-3))
    state = jax.jit(tx.init)(params)
    assert state.residuals["w"].sharding.spec == jax.P("data")
    updates, state = jax.jit(tx.update)({"w": jnp.ones(8, jnp.bfloat16)},
                                        state, params)
    params = optax.apply_updates(params, updates)
    assert state.residuals["w"].sharding.memory_kind == "pinned_host"


def test_bad_input_errors():
  tx = ok.kahan(optax.sgd(1e-3))
  with pytest.raises(ValueError, match=r"\['h'\].*float16"):
    tx.init({"w": jnp.ones(2, jnp.bfloat16), "h": jnp.ones(2, jnp.float16)})
  with pytest.raises(ValueError, match=r"\['step'\].*int32"):
    tx.init({"step": jnp.zeros(2, jnp.int32)})
  with pytest.raises(ValueError, match="rounding"):
    ok.kahan(optax.sgd(1e-3), rounding="even")
  params = commit({"a": jnp.ones(2, jnp.bfloat16),
                   "b": jnp.ones(2, jnp.bfloat16)})
  with pytest.raises(ValueError, match="do not match the params. tree"):
    ok.kahan_apply_updates(params, params, {"a": jnp.zeros(2, jnp.uint16)})
  with pytest.raises(ValueError, match=r"\['b'\] must be uint16\[2\]"):
    ok.kahan_apply_updates(params, params, {"a": jnp.zeros(2, jnp.uint16),
                                            "b": jnp.zeros(3, jnp.uint16)})
  with pytest.raises(ValueError, match="needs params"):
    tx.update(params, tx.init(params))
  with pytest.raises(ValueError, match="float32"):
    ok.kahan_from_float32({"w": jnp.ones(2, jnp.bfloat16)})


@pytest.mark.parametrize("rounding", ROUNDINGS)
def test_stale_residuals_cost_at_most_one_ulp(rounding):
  """Params changed outside the optimizer, residuals kept: the error bound."""
  rng = np.random.default_rng(0)
  x = jnp.asarray(rng.standard_normal(4096) * 10.0**rng.uniform(-5, 5, 4096),
                  jnp.float32)
  _, stale = ok.kahan_from_float32({"w": x}, rounding=rounding, offload=False)
  new = commit({"w": jnp.asarray(rng.standard_normal(4096), jnp.bfloat16)})
  seen = ok.kahan_to_float32(new, stale, rounding=rounding)["w"]
  p = np.asarray(new["w"], np.float64)
  ulp = 2.0**(np.floor(np.log2(np.abs(p))) - 7)  # one bf16 ulp of p
  err = np.asarray(seen, np.float64) - p
  if rounding == "nearest":
    assert (np.abs(err) <= 0.5 * ulp).all()
  else:  # the low bits add to the magnitude
    assert ((err * np.sign(p) >= 0) & (err * np.sign(p) < ulp)).all()
  # Resetting removes the error; re-importing float32 weights is exact.
  tx = ok.kahan(optax.sgd(0.1), rounding=rounding)
  state = ok.kahan_replace_residuals(tx.init(new),
                                     ok.kahan_init(new, rounding=rounding))
  np.testing.assert_array_equal(
      ok.kahan_to_float32(new, ok.kahan_residuals(state), rounding=rounding)["w"],
      new["w"].astype(jnp.float32))
  with pytest.raises(ValueError, match="does not match"):
    ok.kahan_replace_residuals(state, {"w": jnp.zeros(3, jnp.uint16)})


def test_init_from_exact_float32_weights():
  w32 = commit({"w": jnp.linspace(-1, 1, 22, dtype=jnp.float32) + 1e-4})
  params, residuals = ok.kahan_from_float32(w32)
  tx = ok.kahan(ok.prodigy())
  state = tx.init(params, residuals)
  assert state.residuals["w"].sharding.memory_kind == "pinned_host"
  np.testing.assert_array_equal(
      ok.kahan_to_float32(params, state.residuals)["w"], w32["w"])
  # The inner state saw the exact weights (Prodigy's x0), not their bf16.
  np.testing.assert_array_equal(state.inner_state.params0["w"], w32["w"])
  with pytest.raises(ValueError, match="uint16"):
    tx.init(params, {"w": jnp.zeros(3, jnp.uint16)})


def test_uncommitted_params_warn_and_committed_params_compile_once():
  # Offloaded residuals are committed; a step whose arguments mix committed
  # and uncommitted arrays is lowered again once its (committed) outputs come
  # back. kahan commits its whole state where committed params live.
  tx = ok.kahan(optax.adamw(1e-3))
  raw = {"w": jnp.ones((4, 4), jnp.bfloat16), "b": jnp.zeros(4, jnp.bfloat16)}
  with pytest.warns(UserWarning, match="not committed"):
    tx.init(raw)
  params = jax.device_put(raw, jax.devices()[0])
  state = tx.init(params)

  @jax.jit
  def step(params, state):
    updates, state = tx.update(params, state, params)
    return optax.apply_updates(params, updates), state

  for _ in range(3):
    params, state = step(params, state)
  assert step._cache_size() == 1


def test_update_errors_name_the_mistake():
  tx = ok.kahan(optax.adamw(1e-3))
  params = commit({"w": jnp.ones((2, 2), jnp.bfloat16)})
  state = tx.init(params)
  with pytest.raises(TypeError, match="expected KahanState.*whole state"):
    tx.update(params, state.inner_state, params)
  updates, state = tx.update(params, state, params)
  by_hand = jax.tree.map(lambda p, u: p + u, params, updates)  # float32 now
  with pytest.raises(ValueError, match=r"\['w'\].*optax.apply_updates"):
    tx.update(params, state, by_hand)


def test_residual_tree_mismatch_is_short_and_names_the_path():
  layer = {f"dense_{i}": {"kernel": jnp.ones((8, 8), jnp.bfloat16),
                          "bias": jnp.ones(8, jnp.bfloat16)}
           for i in range(20)}
  residuals = ok.kahan_init({"params": layer}, offload=False)
  params = {"params": {**layer, "dense_7": {"kernel": layer["dense_7"][
      "kernel"]}}}
  with pytest.raises(ValueError) as info:
    ok.kahan_to_float32(params, residuals)
  message = str(info.value)
  assert "['params']['dense_7']" in message, message
  assert "['bias']" in message and len(message) < 400, message


def test_params_container_change_is_named_in_one_line():
  # A FrozenDict tree that became a dict (a Flax upgrade, a checkpoint
  # load): the error names the path and both container types, briefly.
  from flax.core import FrozenDict  # pylint: disable=g-import-not-at-top
  layer = {f"dense_{i}": {"kernel": jnp.ones((8, 8), jnp.bfloat16),
                          "bias": jnp.ones(8, jnp.bfloat16)}
           for i in range(30)}
  tx = ok.kahan(optax.adamw(1e-3), offload=False)
  state = tx.init(FrozenDict({"params": layer}))
  params = {"params": layer}
  with pytest.raises(ValueError) as info:
    tx.update(params, state, params)
  message = str(info.value)
  assert "FrozenDict" in message and "dict" in message, message
  assert "<root>" in message and len(message) < 300, message


def test_a_grads_tree_that_differs_is_named_as_the_grads():
  params = {"enc": {"w": jnp.ones(3, jnp.bfloat16)}}
  tx = ok.kahan(optax.adam(1e-3), offload=False)
  with pytest.raises(ValueError, match=r"the updates \(grads\) do not match "
                     r"the params' tree: at \['enc'\]: params has a dict with "
                     r"\['w'\], the updates \(grads\) has a dict with \['W'\]"):
    tx.update({"enc": {"W": jnp.ones(3)}}, tx.init(params), params)


def test_kahan_on_float32_params_warns_that_it_compensates_nothing():
  params = {"w": jnp.ones((2, 2), jnp.float32)}
  with pytest.warns(ok.OptaxKahanWarning, match="none of the params' 1 leaves "
                    "is bfloat16.*param_dtype=jnp.bfloat16"):
    ok.kahan(optax.adam(1e-3), offload=False).init(params)


def test_staged_residuals_are_not_checked_against_offload():
  # The blockwise step brings host residuals into device memory itself and
  # says so with kahan_staged=True (kahan declares it: it never reaches the
  # inner transformation's rows); without it, device residuals under
  # offload=True warn, naming the leaf.
  tx = ok.kahan(optax.sgd(1e-3))
  assert "kahan_staged" in tx.update.static
  params = jax.device_put({"w": jnp.ones(4, jnp.bfloat16)}, jax.devices()[0])
  state = tx.init(params)
  on_device = ok.kahan_replace_residuals(
      state, jax.device_put(ok.kahan_residuals(state), jax.memory.Space.Device))
  grads = {"w": jnp.full(4, 0.5, jnp.float32)}
  with pytest.warns(ok.OptaxKahanWarning, match=r"\['w'\]"):
    tx.update(grads, on_device, params)
  with warnings.catch_warnings():
    warnings.simplefilter("error", ok.OptaxKahanWarning)
    updates, new = tx.update(grads, on_device, params, kahan_staged=True)
  staged = optax.apply_updates(params, updates)
  plain = optax.apply_updates(params, tx.update(grads, state, params)[0])
  np.testing.assert_array_equal(staged["w"], plain["w"])


def _blocks_step(tx, *, scan: bool, remat: bool):
  """A training step of three tanh blocks: unrolled or in a ``lax.scan``,
  each block rematerialized in the backward pass or not."""
  def block(h, w):
    return jnp.tanh(h @ w)

  if remat:
    block = jax.checkpoint(block)

  def loss(params, x):
    if scan:
      h, _ = jax.lax.scan(lambda h, w: (block(h, w), None), x, params["w"])
    else:
      h = x
      for i in range(3):
        h = block(h, params[f"w{i}"])
    return jnp.sum(h.astype(jnp.float32))

  def step(params, state, x):
    grads = jax.jit(jax.grad(loss))(params, x)  # a jit inside: read through
    updates, state = tx.update(grads, state, params)
    return optax.apply_updates(params, updates), state

  params = ({"w": jnp.ones((3, 8, 8), jnp.bfloat16)} if scan else
            {f"w{i}": jnp.ones((8, 8), jnp.bfloat16) for i in range(3)})
  return step, commit(params)


@pytest.mark.parametrize("offload", [True, False])
def test_init_of_abstract_params_gives_the_residuals_memory(offload):
  # jax.eval_shape keeps a sharding's mesh and spec, not its memory: a
  # restore target made this way must still say host memory.
  mesh = jax.make_mesh((1,), ("x",))
  sharded = jax.NamedSharding(mesh.abstract_mesh, jax.P("x"))
  params = {"w": jax.ShapeDtypeStruct((8, 4), jnp.bfloat16, sharding=sharded),
            "b": jax.ShapeDtypeStruct((4,), jnp.float32, sharding=sharded),
            "v": jax.ShapeDtypeStruct((4,), jnp.bfloat16)}  # the mesh's
  tx = ok.kahan(optax.adamw(1e-3), offload=offload)
  with jax.set_mesh(mesh):
    lows = ok.kahan_residuals(tx.init(params))
  assert lows["b"] is None  # float32: nothing dropped
  assert lows["w"].sharding.spec[0] == "x"  # its params' spec
  for lo in (lows["w"], lows["v"]):
    assert lo.sharding.memory_kind == ("pinned_host" if offload else None)
  # With no sharding there is no memory to say.
  lo = ok.kahan_residuals(tx.init({"v": jax.ShapeDtypeStruct(
      (4,), jnp.bfloat16)}))["v"]
  assert lo.sharding is None and lo.shape == (4,)


def _coupled() -> optax.GradientTransformation:
  """An inner transformation with no per-leaf form: leaf b's update reads
  leaf a (kahan runs it on the whole tree)."""
  def update(updates, state, params=None):
    del params
    b = jax.lax.cond(jnp.sum(updates["a"]) > 0, lambda: updates["b"],
                     lambda: -updates["b"])
    return {"a": updates["a"], "b": b}, state

  return optax.GradientTransformation(lambda p: optax.EmptyState(), update)


@pytest.mark.parametrize("inner,cols,offload,said", [
    # 4096 x 4352 residuals: 35.7 MB, 1.04 ms at 32 GiB/s
    ("adamw", 4352, True, "35.7 MB, copied to the device once and back once "
     "in each step. In an ordinary step (tx.update after jax.grad) XLA on a "
     "GPU runs the updates, and these copies, after the backward pass, so "
     "at 32 GiB/s in each direction they add about 1.04 ms or more"),
    ("adamw", 4096, True, None),  # 0.977 ms: not worth a warning
    ("adamw", 4352, False, None),  # on the device: nothing copied
    # Prodigy's statistic round fetches them again: 2 x 0.977 ms
    ("prodigy_factored", 4096, True, "33.6 MB, copied to the device twice "
     "and back once in each step. In an ordinary step"),
    ("whole tree", 4352, True, "35.7 MB, copied to the device once"),
])
def test_warns_of_the_copies_time_of_host_residuals(inner, cols, offload,
                                                    said):
  # Traced, not run: abstract params and residuals (in host memory by
  # their sharding), a one-device mesh.
  mesh = jax.make_mesh((1,), ("x",))
  where = lambda kind: jax.NamedSharding(mesh.abstract_mesh, jax.P(),
                                         memory_kind=kind)
  shapes = ({"a": (8,), "b": (4096, cols)} if inner == "whole tree"
            else {"w": (4096, cols)})
  params = {k: jax.ShapeDtypeStruct(v, jnp.bfloat16, sharding=where("device"))
            for k, v in shapes.items()}
  tx = ok.kahan({"adamw": lambda: optax.adamw(1e-3),
                 "prodigy_factored": ok.prodigy_factored,
                 "whole tree": _coupled}[inner](), offload=offload)
  state = tx.init(params)  # abstract, each residual in its memory

  def step(params, state):
    loss = lambda p: sum(jnp.sum(v.astype(jnp.float32) ** 2)
                         for v in p.values())
    updates, state = tx.update(jax.grad(loss)(params), state, params)
    return optax.apply_updates(params, updates), state

  with warnings.catch_warnings(record=True) as caught, jax.set_mesh(mesh):
    warnings.simplefilter("always")
    jax.jit(step).trace(params, state)
  told = [str(w.message) for w in caught if "host memory" in str(w.message)]
  if said is None:
    assert not told, told
    return
  assert len(told) == 1 and said in told[0], told
  assert "ok.blockwise.blockwise_step" in told[0]
  assert "offload=False" in told[0] and "rematerializes" not in told[0]
  assert caught[-1].filename == __file__  # points at the user's update


@pytest.mark.parametrize("scan,remat,offload,warns", [
    (False, True, True, True),  # unrolled, rematerialized, host residuals
    (False, True, False, False),  # residuals on the device
    (True, True, True, False),  # the blocks in a loop
    (False, False, True, False),  # no rematerialization
])
def test_warns_for_host_residuals_in_an_unrolled_remat_step(
    scan, remat, offload, warns):
  tx = ok.kahan(optax.adamw(1e-3), offload=offload)
  step, params = _blocks_step(tx, scan=scan, remat=remat)
  state = tx.init(params)
  x = jnp.ones((2, 8), jnp.bfloat16)
  with warnings.catch_warnings(record=True) as caught:
    warnings.simplefilter("always")
    jax.jit(step).trace(params, state, x)
  said = [str(w.message) for w in caught
          if "rematerializes" in str(w.message)]
  assert len(said) == int(warns), said
  if warns:
    assert "rematerializes 3 blocks" in said[0]
    assert "offload=False" in said[0]
    assert "ok.blockwise.blockwise_step" in said[0]
    assert ("compiler_options={'xla_gpu_enable_latency_hiding_scheduler': "
            "False}" in said[0])
    # 3 x 8 x 8 residuals; their copies too short for the time's warning
    assert ("384 bytes, copied to the device once and back once"
            in said[0])
    assert "ms or more" not in said[0]
    assert caught[0].filename == __file__  # points at the user's update

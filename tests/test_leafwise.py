"""Leaf-by-leaf steps: bounded scratch, the same results bit for bit."""

import functools
import sys

import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest

import optax_kahan as ok
from benchmarks import step_memory
import _steps

SHAPES = {"a": (33, 17), "b": (17,), "c": (8, 5, 6), "d": (40, 24)}
STEPS = 5


def _params(dtype):
  key = jax.random.key(0)
  return {n: jax.random.normal(jax.random.fold_in(key, i), s).astype(dtype)
          for i, (n, s) in enumerate(SHAPES.items())}


@jax.jit
def _grads(params, i):
  return jax.tree.map(
      lambda p: (jnp.sin(p.astype(jnp.float32) * (i + 3.0)) + 0.1 * i
                 ).astype(p.dtype), params)


_apply = jax.jit(optax.apply_updates)


def _bits(tree):
  return [np.asarray(x).view(np.uint8) for x in jax.tree.leaves(tree)]


def _assert_bitwise_equal(a, b, what):
  for x, y in zip(_bits(a), _bits(b), strict=True):
    np.testing.assert_array_equal(x, y, err_msg=what)


def _updates_per_step(tx, dtype):
  """Updates of each step (jitted alone) and the final params and state."""
  params = _params(dtype)
  state = tx.init(params)
  update = jax.jit(tx.update)
  out = []
  for i in range(STEPS):
    updates, state = update(_grads(params, i), state, params)
    out.append(updates)
    params = _apply(params, updates)
  return out, params, state


NAMED = {
    "prodigy": lambda lw: ok.prodigy(leafwise=lw),
    "prodigy(b1=0, slice_p=3, bias correction, decay, clip)": lambda lw:
        ok.prodigy(b1=0.0, slice_p=3, use_bias_correction=True,
                   weight_decay=0.1, update_clip=1.0, leafwise=lw),
    "prodigy_factored": lambda lw: ok.prodigy_factored(leafwise=lw),
    "stable_adamw": lambda lw: ok.stable_adamw(1e-2, leafwise=lw),
}


@pytest.mark.parametrize("name", list(NAMED))
def test_named_optimizers_leafwise_give_the_same_updates(name):
  want, _, want_state = _updates_per_step(NAMED[name](False), jnp.float32)
  got, _, got_state = _updates_per_step(NAMED[name](True), jnp.float32)
  assert isinstance(NAMED[name](True), ok.LeafwiseTransformation)
  for step, (w, g) in enumerate(zip(want, got)):
    _assert_bitwise_equal(w, g, f"{name}, step {step}")
  assert all(np.any(np.asarray(u) != 0) for u in jax.tree.leaves(want[-1]))
  if name.startswith("prodigy"):
    assert ok.prodigy_d(want_state) == ok.prodigy_d(got_state)


KAHAN = {
    "kahan(prodigy)": lambda lw: ok.kahan(ok.prodigy(leafwise=lw)),
    "kahan(prodigy_factored)": lambda lw: ok.kahan(
        ok.prodigy_factored(leafwise=lw)),
    "kahan(stable_adamw)": lambda lw: ok.kahan(
        ok.stable_adamw(1e-2, leafwise=lw)),
    "kahan(optax.adafactor)": lambda lw: ok.kahan(
        ok.leafwise(optax.adafactor(1e-2)) if lw else optax.adafactor(1e-2)),
    "kahan(AdamW from scale_by_second_moment)": lambda lw: ok.kahan(
        ok.leafwise(_adamw()) if lw else _adamw()),
}


def _adamw():
  # AdamW whose bias correction multiplies by a reciprocal (see below).
  return optax.chain(
      ok.scale_by_second_moment(0.9, 0.999, 1e-8, bias_correction=True),
      optax.add_decayed_weights(1e-4), optax.scale_by_learning_rate(1e-2))


@pytest.mark.parametrize("name", list(KAHAN))
def test_kahan_leafwise_trains_bit_for_bit_like_the_default(name):

  def run(tx):
    params = _params(jnp.bfloat16)
    state = tx.init(params)

    @jax.jit
    def step(params, state, grads):  # update and apply in one program
      updates, state = tx.update(grads, state, params)
      return optax.apply_updates(params, updates), state

    for i in range(STEPS):
      params, state = step(params, state, _grads(params, i))
    return ok.kahan_to_float32(params, ok.kahan_residuals(state)), params

  want32, want = run(KAHAN[name](False))
  got32, got = run(KAHAN[name](True))
  _assert_bitwise_equal(want, got, name)
  _assert_bitwise_equal(want32, got32, name)
  moved = [np.any(np.asarray(a) != np.asarray(b))
           for a, b in zip(jax.tree.leaves(got32),
                           jax.tree.leaves(_params(jnp.bfloat16)))]
  assert all(moved)


def test_kahan_leafwise_adamw_is_optax_adamw_leaf_by_leaf():
  """optax.adamw divides by its bias correction 1 - b^t; XLA rewrites that
  division as a multiplication by the reciprocal where the scalar has one
  user, i.e. in a one-leaf program or island but not in a many-leaf program.
  So the leafwise step equals optax.adamw run on each leaf alone, bit for
  bit, and the whole-tree step to within an ulp."""
  tx = lambda: optax.adamw(1e-2)

  def run(tx, params):
    state = tx.init(params)
    step = jax.jit(lambda p, s, g: (lambda u, s: (optax.apply_updates(p, u),
                                                  s))(*tx.update(g, s, p)))
    for i in range(STEPS):
      params, state = step(params, state, _grads(params, i))
    return ok.kahan_to_float32(params, ok.kahan_residuals(state))

  params = _params(jnp.bfloat16)
  got = run(ok.kahan(ok.leafwise(tx())), params)
  for name in SHAPES:
    alone = run(ok.kahan(tx()), {name: params[name]})
    _assert_bitwise_equal(alone[name], got[name], name)
  whole = run(ok.kahan(tx()), params)
  for name in SHAPES:
    np.testing.assert_allclose(got[name], whole[name], rtol=1e-6, atol=1e-7)


def _temp_bytes(make, num_leaves, side=128):
  return step_memory.temp_bytes(
      make, {f"w{i}": (side, side) for i in range(num_leaves)})


@pytest.mark.parametrize("name, make", [
    ("kahan(leafwise(optax.adamw))",
     lambda: ok.kahan(ok.leafwise(optax.adamw(1e-4)))),
    ("kahan(prodigy(leafwise=True))",
     lambda: ok.kahan(ok.prodigy(leafwise=True))),
    ("kahan(stable_adamw(leafwise=True))",
     lambda: ok.kahan(ok.stable_adamw(1e-4, leafwise=True))),
    ("prodigy_factored(leafwise=True)",
     lambda: ok.prodigy_factored(leafwise=True)),
])
def test_leafwise_scratch_is_one_leaf_whatever_the_leaf_count(name, make):
  leaf = 128 * 128
  few, many = _temp_bytes(make, 3), _temp_bytes(make, 9)
  assert many <= 16 * leaf + 2**20, name
  # Six more leaves add at most small per-leaf bookkeeping, not leaf data.
  assert many - few < 6 * 1024, (name, few, many)


def test_default_scratch_grows_with_the_leaf_count():
  # The contrast that makes leafwise worth having (measured by
  # benchmarks/step_memory.py at full size).
  tx = lambda: ok.kahan(optax.adamw(1e-4))
  few, many = _temp_bytes(tx, 3), _temp_bytes(tx, 9)
  assert many - few >= 6 * 4 * 128 * 128


def test_leafwise_passes_extra_args_and_works_without_params():

  def scale_by_value():
    def update(updates, state, params=None, *, value=1.0, **extra):
      del params, extra
      return jax.tree.map(lambda g: value * g, updates), state
    return optax.GradientTransformationExtraArgs(
        lambda params: optax.EmptyState(), update)

  tx = ok.leafwise(scale_by_value())
  params = _params(jnp.float32)
  updates, _ = jax.jit(tx.update)(params, tx.init(params), value=3.0)
  for n in SHAPES:
    np.testing.assert_array_equal(updates[n], 3.0 * params[n])
  sgd = ok.leafwise(optax.sgd(0.5, momentum=0.9))
  updates, state = sgd.update(params, sgd.init(params))
  # The state is sgd's own, laid out as sgd lays it out.
  plain = optax.sgd(0.5, momentum=0.9)
  assert jax.tree.structure(state) == jax.tree.structure(plain.init(params))
  np.testing.assert_array_equal(updates["a"], -0.5 * params["a"])


def test_kahan_leafwise_handles_float32_leaves_and_host_residuals():
  params = _params(jnp.bfloat16)
  params["b"] = params["b"].astype(jnp.float32)  # no residual for it
  tx = ok.kahan(ok.leafwise(optax.adam(1e-2)))
  ref = ok.kahan(optax.adam(1e-2))
  state, ref_state = tx.init(params), ref.init(params)

  def step(tx, params, state, i):
    updates, state = tx.update(_grads(params, i), state, params)
    return optax.apply_updates(params, updates), state

  got = jax.jit(functools.partial(step, tx))(params, state, 0)
  want = jax.jit(functools.partial(step, ref))(params, ref_state, 0)
  residuals = ok.kahan_residuals(got[1])
  assert residuals["b"] is None
  assert residuals["a"].sharding.memory_kind == "pinned_host"
  np.testing.assert_allclose(got[0]["b"], want[0]["b"], rtol=1e-6)
  assert got[0]["a"].dtype == jnp.bfloat16


def test_leafwise_errors_name_the_problem():
  tx = ok.leafwise(optax.adam(1e-3))
  state = tx.init({"a": jnp.ones(3)})
  with pytest.raises(ValueError, match="state does not match"):
    tx.update({"a": jnp.ones(3), "b": jnp.ones(2)}, state)
  with pytest.raises(ValueError, match="decouple=True"):
    ok.prodigy(leafwise=True, decouple=False)
  with pytest.raises(ValueError, match="needs params"):
    p = ok.prodigy(leafwise=True)
    p.update({"a": jnp.ones(3)}, p.init({"a": jnp.ones(3)}))


def test_leafwise_refuses_transformations_that_couple_leaves():
  params = {"a": jnp.ones(3), "b": jnp.ones((2, 2))}
  for tx in (optax.chain(optax.clip_by_global_norm(1.0), optax.adam(1e-3)),
             optax.chain(optax.adam(1e-3), optax.clip_by_global_norm(1.0))):
    with pytest.raises(ValueError, match="couples leaves.*clip_by_global_norm"):
      ok.leafwise(tx).init(params)
  # Per-leaf clipping is fine.
  ok.leafwise(optax.chain(optax.clip_by_block_rms(1.0),
                          optax.adam(1e-3))).init(params)


def test_leafwise_state_is_the_inner_state_and_maps_params():
  params = {"a": jnp.ones(3), "b": jnp.ones((2, 2))}
  for inner in (optax.adamw(1e-3), ok.scale_by_factored_second_moment()):
    tx = ok.leafwise(inner)
    state = tx.init(params)
    assert jax.tree.structure(state) == jax.tree.structure(inner.init(params))
    mapped = optax.tree.map_params(tx, lambda v: v, state)
    assert jax.tree.structure(mapped) == jax.tree.structure(state)


SHARDED = r'''
report = {}
grads_np = host_grads(3)
txs = {"adamw": lambda lw: ok.kahan(
           ok.leafwise(optax.adamw(1e-3)) if lw else optax.adamw(1e-3)),
       "prodigy_factored": lambda lw: ok.kahan(
           ok.prodigy_factored(leafwise=lw))}
for name, make in txs.items():
  for mode, lw in (("single", False), ("single-leafwise", True),
                   ("explicit", True), ("auto", True)):
    mesh = make_mesh(mode.split("-")[0])
    with jax.set_mesh(mesh) if mesh is not None else _nullcontext():
      params = place(host_params(), mesh)
      state, step = init_and_step(make(lw), params, mesh,
                                  mode.split("-")[0])
      grads = [place(g, mesh) for g in grads_np]
      compiled = step.lower(params, state, grads[0]).compile()
      for g in grads:
        params, state = step(params, state, g)
      report[f"{name}/{mode}"] = {
          "w": {k: v.tolist() for k, v in exact(params, state).items()},
          "kinds": sorted({r.sharding.memory_kind for r in
                           jax.tree.leaves(ok.kahan_residuals(state))}),
          "collectives": collectives(compiled.as_text())}
emit(report)
'''


@pytest.mark.slow
def test_leafwise_under_fsdp_sharding_matches_the_single_device_run():
  """8 fake devices, Explicit and Auto FSDP axes: kahan(leafwise(adamw)) is
  bitwise its single-device run; kahan(prodigy_factored(leafwise=True)) is
  bitwise the single-device default and within 1e-5 sharded (its sums are
  reduced across devices in another order)."""
  from _subprocess import run
  report = run("from contextlib import nullcontext as _nullcontext\n"
               + SHARDED, devices=8, timeout=300)
  pf = "prodigy_factored"
  assert report[f"{pf}/single"]["w"] == report[f"{pf}/single-leafwise"]["w"]
  for name, tol in (("adamw", 0.0), (pf, 1e-5)):
    want = report[f"{name}/single-leafwise"]["w"]
    for mode in ("explicit", "auto"):
      got = report[f"{name}/{mode}"]
      assert got["kinds"] == ["pinned_host"], (name, mode)
      assert all(dt != "u16" for _, dt, _ in got["collectives"]), (name, mode)
      for k in want:
        np.testing.assert_allclose(got["w"][k], want[k], rtol=tol,
                                   atol=1e-7 if tol else 0,
                                   err_msg=f"{name}/{mode}/{k}")


@pytest.mark.parametrize("name", list(KAHAN))
def test_the_gpu_form_of_the_chain_computes_the_same(name, monkeypatch):
  """for_each_leaf lowers its barrier chain (no conditionals) for GPUs and
  its lax.cond islands for the CPU. The chain, forced here on the CPU, gives
  the same weights and residuals, and the residuals stay in host memory."""
  leafwise_lib = sys.modules["optax_kahan.leafwise"]  # the name is the function

  def run(tx):
    params = jax.device_put(_params(jnp.bfloat16), jax.devices()[0])
    return _steps.train(tx, params, _grads, STEPS)[0]

  want = run(KAHAN[name](True))
  monkeypatch.setattr(leafwise_lib, "_islands", leafwise_lib._chain)
  got = run(KAHAN[name](True))
  _assert_bitwise_equal(want, got, name)


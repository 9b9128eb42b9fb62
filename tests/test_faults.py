"""Faults: non-finite gradients, zero gradients, bf16 overflow, mismatched
restored state, params/state sharding mismatch. None may corrupt silently."""

import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest

import optax_kahan as ok
from _steps import commit
from _subprocess import run


def _bits(x):
  return np.asarray(x, np.float32).view(np.uint32)


def _params():
  return commit({"w": jnp.linspace(-1, 1, 32, dtype=jnp.bfloat16).reshape(4, 8),
                 "b": jnp.zeros(8, jnp.float32)})


def _grads(seed):
  k = jax.random.key(seed)
  return {"w": jax.random.normal(k, (4, 8)).astype(jnp.bfloat16),
          "b": jax.random.normal(k, (8,))}


def _train(tx, grads_list):
  params = _params()
  state = tx.init(params)
  step = jax.jit(lambda p, s, g: (lambda u, s: (optax.apply_updates(p, u), s))(
      *tx.update(g, s, p)))
  for g in grads_list:
    params, state = step(params, state, g)
  return params, state


def test_nan_inf_bursts_are_skipped_exactly():
  """A burst shorter than max_consecutive_errors changes nothing: the run
  equals, bit for bit, the run that never saw the bad steps; the skips are
  counted in the apply_if_finite state."""
  tx = ok.kahan(ok.per_leaf.apply_if_finite(optax.adamw(1e-2), 3))
  good = [_grads(i) for i in range(4)]
  nan = jax.tree.map(lambda g: g.at[0].set(jnp.nan), good[0])
  inf = jax.tree.map(lambda g: g.at[-1].set(-jnp.inf), good[1])
  p_ref, s_ref = _train(tx, good)
  p, s = _train(tx, good[:2] + [nan, inf, nan] + good[2:])
  want = ok.kahan_to_float32(p_ref, ok.kahan_residuals(s_ref))
  got = ok.kahan_to_float32(p, ok.kahan_residuals(s))
  for k in want:
    np.testing.assert_array_equal(_bits(got[k]), _bits(want[k]))
  assert int(s.inner_state.total_notfinite) == 3
  assert int(s.inner_state.notfinite_count) == 0


def test_burst_longer_than_the_limit_is_visible():
  """After max_consecutive_errors skips apply_if_finite lets the update
  through (optax's contract): the weights become NaN, loudly."""
  tx = ok.kahan(ok.per_leaf.apply_if_finite(optax.adamw(1e-2), 2))
  nan = jax.tree.map(lambda g: g.at[0].set(jnp.nan), _grads(0))
  p, s = _train(tx, [_grads(1), nan, nan, nan])
  assert int(s.inner_state.total_notfinite) == 3
  assert bool(jnp.isnan(p["w"]).any())
  x = ok.kahan_to_float32(p, ok.kahan_residuals(s))["w"]
  assert bool(jnp.isnan(x).any())  # params and residuals agree: NaN


def test_zero_gradients():
  zero = jax.tree.map(jnp.zeros_like, _grads(0))
  params = _params()
  for tx in (ok.kahan(optax.adam(1e-2)), ok.kahan(ok.prodigy_factored())):
    p, s = _train(tx, [zero] * 3)
    x = ok.kahan_to_float32(p, ok.kahan_residuals(s))
    for k in params:
      np.testing.assert_array_equal(_bits(x[k]), _bits(params[k]))
    p, s = _train(tx, [zero, _grads(1)])  # and it trains on afterwards
    x = ok.kahan_to_float32(p, ok.kahan_residuals(s))["w"]
    assert bool(jnp.all(jnp.isfinite(x)))
    assert not np.array_equal(_bits(x), _bits(params["w"]))


BF16_MAX = float(jnp.finfo(jnp.bfloat16).max)  # 3.3895e38


def _one_step(x0, u):
  params = commit({"w": jnp.full(4, x0, jnp.bfloat16)})
  tx = ok.kahan(optax.sgd(1.0))
  state = tx.init(params)
  upd, state = tx.update({"w": jnp.full(4, -u, jnp.float32)}, state, params)
  return params, optax.apply_updates(params, upd), state, tx


def test_overflow_past_bf16_max_saturates_finite():
  """x + u in (bf16 max, float32 max]: hi saturates to the largest bf16 and
  the merge lands one bf16 ulp (2**120) low (the README's saturation band);
  nothing becomes Inf and training can come back down."""
  _, p, s, tx = _one_step(BF16_MAX, 1e36)
  want = np.float32(BF16_MAX) + np.float32(1e36)
  assert float(p["w"][0]) == BF16_MAX
  x = ok.kahan_to_float32(p, ok.kahan_residuals(s))["w"]
  assert float(x[0]) == float(want - np.float32(2.0**120))
  upd, s = tx.update({"w": jnp.full(4, 1e37, jnp.float32)}, s, p)
  p = optax.apply_updates(p, upd)
  assert bool(jnp.all(jnp.isfinite(p["w"]))) and float(p["w"][0]) < BF16_MAX


def test_overflow_to_inf_is_visible_and_not_recoverable():
  """x + u rounds past float32 max: hi = +Inf, lo = 0, the bf16 param is
  +Inf (visible to any isfinite check; apply_if_finite inside kahan sees only
  finite gradients and cannot catch it). It stays +Inf on later steps (never
  NaN: a weight that does not move gets a zero delta). Restore a checkpoint."""
  _, p, s, tx = _one_step(BF16_MAX, 3e36)
  assert bool(jnp.all(jnp.isposinf(p["w"])))
  assert int(ok.kahan_residuals(s)["w"][0]) == 0
  assert bool(jnp.all(jnp.isposinf(ok.kahan_to_float32(
      p, ok.kahan_residuals(s))["w"])))
  upd, s = tx.update({"w": jnp.full(4, 1.0, jnp.float32)}, s, p)
  p = optax.apply_updates(p, upd)
  assert bool(jnp.all(jnp.isposinf(p["w"])))


def test_restored_state_that_does_not_match_params(tmp_path):
  import orbax.checkpoint as ocp  # a test dependency
  tx = ok.kahan(optax.adam(1e-3))
  params = _params()
  ckptr = ocp.StandardCheckpointer()
  ckptr.save(tmp_path / "s", tx.init(params))
  ckptr.wait_until_finished()
  state = ckptr.restore(tmp_path / "s", jax.eval_shape(tx.init, params))
  other = {"w": params["w"], "b": params["b"],
           "extra": jnp.ones(3, jnp.bfloat16)}
  with pytest.raises(ValueError, match="do not match the params. tree"):
    tx.update(other, state, other)
  wider = {"w": jnp.ones((4, 9), jnp.bfloat16), "b": params["b"]}
  with pytest.raises(ValueError, match=r"\['w'\] must be uint16\[4, 9\]"):
    tx.update(wider, state, wider)
  with pytest.raises(ValueError, match="does not match"):
    ok.kahan_replace_residuals(state, ok.kahan_init(wider))
  # orbax itself refuses a target tree of another structure.
  with pytest.raises(Exception):
    ckptr.restore(tmp_path / "s", jax.eval_shape(tx.init, other))


MISMATCH = r'''
from contextlib import nullcontext
report = {}
grads_np = host_grads(1)
for mode in ("explicit", "auto"):
  mesh = make_mesh(mode)
  with jax.set_mesh(mesh):
    tx = make_tx("adamw")
    params = place(host_params(), mesh)
    state, _ = init_and_step(tx, params, mesh, mode)
    step = jax.jit(lambda p, s, g: (lambda u, s: (optax.apply_updates(p, u), s))(
        *tx.update(g, s, p)))
    # Residuals and moments of w1 sharded along the other axis.
    other = lambda x: jax.device_put(x, NamedSharding(
        mesh, P(None, "fsdp"), memory_kind=x.sharding.memory_kind))
    bad_res = state._replace(residuals={**state.residuals,
                                        "w1": other(state.residuals["w1"])})
    inner = bad_res.inner_state[0]
    bad_all = bad_res._replace(inner_state=(inner._replace(
        mu={**inner.mu, "w1": other(inner.mu["w1"])},
        nu={**inner.nu, "w1": other(inner.nu["w1"])}),) + state.inner_state[1:])
    results = []
    for s in (state, bad_res, bad_all) if mode == "auto" else (bad_res,):
      p = params
      try:
        for g in grads_np:
          p, s = step(p, s, place(g, mesh))
        results.append((exact(p, s), s.residuals["w1"].sharding.memory_kind))
      except Exception as e:
        results.append(f"{type(e).__name__}: {e}"[:300])
    if mode == "explicit":
      report[mode] = {"error": results[0]}
    else:
      ref = results[0][0]
      report[mode] = {
          "residuals_only_equal": all(np.array_equal(
              results[1][0][k].view(np.uint32), ref[k].view(np.uint32))
              for k in ref),
          "all_max_rel": max(float(np.max(np.abs(results[2][0][k] - ref[k])
                                          / np.maximum(np.abs(ref[k]), 1e-30)))
                             for k in ref),
          "kinds": [results[1][1], results[2][1]]}
emit(report)
'''


def test_params_state_sharding_mismatch():
  """Explicit axes: a residual sharded unlike its param is a type error at
  trace time (nothing runs). Auto axes: XLA reshards, and the result is
  bit for bit the matched run's."""
  r = run(MISMATCH, devices=8, timeout=300)
  print(r)
  assert "ShardingTypeError" in r["explicit"]["error"], r
  auto = r["auto"]
  assert auto["residuals_only_equal"], r
  assert auto["kinds"] == ["pinned_host", "pinned_host"], r
  assert auto["all_max_rel"] < 1e-6, r


RESTORED_ON_DEVICE = r'''
import tempfile
import orbax.checkpoint as ocp
params = jax.device_put({"w": jnp.ones((4, 4), jnp.bfloat16)}, jax.devices()[0])
tx = ok.kahan(optax.adamw(1e-3))
step = jax.jit(lambda p, s: (lambda u, s: (optax.apply_updates(p, u), s))(
    *tx.update(p, s, p)), donate_argnums=(0, 1))
params, state = step(params, tx.init(params))
ckpt = ocp.StandardCheckpointer()
path = tempfile.mkdtemp() + "/c"
ckpt.save(path, {"p": params, "s": state})
ckpt.wait_until_finished()
# No sharding in the target: orbax puts the residuals in device memory.
restored = ckpt.restore(path, jax.tree.map(
    lambda x: jax.ShapeDtypeStruct(x.shape, x.dtype), {"p": params, "s": state}))
kind = ok.kahan_residuals(restored["s"])["w"].sharding.memory_kind
import warnings
with warnings.catch_warnings(record=True) as caught:
  warnings.simplefilter("always")
  p, s = step(restored["p"], restored["s"])
after = ok.kahan_residuals(s)["w"].sharding.memory_kind
# Moved back as the warning says, the residuals stay in host memory again.
s = ok.kahan_replace_residuals(s, jax.device_put(ok.kahan_residuals(s),
                                                 jax.memory.Space.Host))
p, s = step(p, s)
emit({"kind": kind, "after": after,
      "moved": ok.kahan_residuals(s)["w"].sharding.memory_kind,
      "warnings": [str(w.message) for w in caught]})
'''


def test_residuals_restored_in_device_memory_stay_there_with_a_warning():
  # Before, the donated step sent them to host memory and the process
  # aborted (rc 134) inside the runtime.
  out = run(RESTORED_ON_DEVICE, devices=1)
  assert out["kind"] == "device" and out["after"] == "device"
  assert out["moved"] == "pinned_host"
  warned = [w for w in out["warnings"] if "['w']" in w]
  assert warned and "kahan_replace_residuals" in warned[0]

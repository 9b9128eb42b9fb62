"""stage_by_leaf: a whole-tree step whose host inputs come in leaf by leaf.

On the CPU ``stage_by_leaf`` runs the step as it is; lowered for a GPU it
runs the traced equations in a chain of optimization barriers. The chain is
forced here on the CPU (``lax.platform_dependent`` replaced by its default
branch), where it must give the same bits as the CPU form (and float32
master weights bit for bit under ``kahan(optax.adamw)``: ``tests/test_kahan.py``
runs its bit-identity test on the chain too). What the chain does
to a GPU program's staging is checked by ``tests/test_gpu_compile.py``.
"""


import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest

import _steps
import optax_kahan as ok
from optax_kahan import staging

SHAPES = {"a": (33, 17), "b": (17,), "c": (8, 5, 6), "d": (40, 24)}
STEPS = 3


def _force_chain(monkeypatch):
  monkeypatch.setattr(jax.lax, "platform_dependent",
                      lambda *args, cpu, default: default(*args))


def _params():
  key = jax.random.key(0)
  params = {n: jax.random.normal(jax.random.fold_in(key, i), s)
            for i, (n, s) in enumerate(SHAPES.items())}
  params = {n: p.astype(jnp.float32 if n == "b" else jnp.bfloat16)
            for n, p in params.items()}  # one float32 leaf: no residual
  return jax.device_put(params, jax.devices()[0])


@jax.jit
def _grads(params, i):
  return jax.tree.map(
      lambda p: (jnp.sin(p.astype(jnp.float32) * (i + 3.0)) + 0.1 * i
                 ).astype(p.dtype), params)


def _bits(tree):
  return [np.atleast_1d(np.asarray(x)).view(np.uint8)
          for x in jax.tree.leaves(tree)]


def _train(tx, steps=STEPS):
  return _steps.train(tx, _params(), _grads, steps)


INNER = {
    "optax.adamw": lambda: optax.adamw(1e-2, weight_decay=0.1),
    "optax.adafactor": lambda: optax.adafactor(1e-2),
    "prodigy_factored": ok.prodigy_factored,
    "prodigy(decay, bias correction)": lambda: ok.prodigy(
        weight_decay=0.1, use_bias_correction=True),
    "stable_adamw": lambda: ok.stable_adamw(1e-2),
    "chain(clip_by_global_norm, adam)": lambda: optax.chain(
        optax.clip_by_global_norm(0.1), optax.adam(1e-2)),
    "apply_if_finite(adamw)": lambda: optax.apply_if_finite(
        optax.adamw(1e-2), 3),
}


@pytest.mark.parametrize("name", list(INNER))
def test_the_gpu_form_of_kahan_computes_the_same_bits(name, monkeypatch):
  want = _train(ok.kahan(INNER[name]()))
  _force_chain(monkeypatch)
  got = _train(ok.kahan(INNER[name]()))
  for a, b in zip(_bits(want), _bits(got), strict=True):
    np.testing.assert_array_equal(a, b, err_msg=name)


def _device_puts(tx, monkeypatch):
  """The step's host-to-device copies, and how many read a barrier's output."""
  _force_chain(monkeypatch)
  params = _params()
  state = tx.init(params)
  jaxpr = jax.make_jaxpr(lambda g, s, p: tx.update(g, s, p))(
      params, state, params).jaxpr
  made_by = {v: e.primitive.name for e in jaxpr.eqns for v in e.outvars}
  puts = [e for e in jaxpr.eqns if e.primitive.name == "device_put"
          and e.params["devices"] == (jax.memory.Space.Device,)]
  tied = [e for e in puts if made_by.get(e.invars[0]) == "optimization_barrier"]
  return len(puts), len(tied)


def test_each_residual_is_copied_in_once_per_pass_after_a_barrier(
    monkeypatch):
  n = len(SHAPES) - 1  # the float32 leaf has no residual
  assert _device_puts(ok.kahan(optax.adamw(1e-3)), monkeypatch) == (n, n)
  # Prodigy's <g, x0 - x> reads the weights before d is known: two passes.
  assert _device_puts(ok.kahan(ok.prodigy_factored()), monkeypatch) == (
      2 * n, 2 * n)


def test_stage_by_leaf_on_a_toy_step(monkeypatch):
  """Shared outputs that read every leaf, a state entry that reads one,
  a leaf with no host input: the chained form returns fn's values."""
  host = lambda x: jax.device_put(x, jax.memory.Space.Host)
  leaves = [(host(jnp.arange(4.0) + i), jnp.full(4, i + 1.0))
            for i in range(3)] + [(None, jnp.ones(4))]
  common = {"scale": jnp.float32(2.0), "ema": jnp.zeros(4)}

  def fn(leaves, common):
    xs = [staging.stage(x) for x, _ in leaves[:3]]
    total = sum(jnp.sum(x) for x in xs)  # shared: reads all leaves
    free = [x * common["scale"] / total + g for x, (_, g) in
            zip(xs, leaves)] + [leaves[3][1]]
    chained = [x + 1 for x in xs] + [None]
    shared = {"ema0": common["ema"] + xs[0] * 0.5,  # reads leaf 0 only
              "total": total}
    return free, chained, shared

  want = jax.jit(fn)(leaves, common)
  _force_chain(monkeypatch)
  staged = lambda leaves, common: staging.stage_by_leaf(fn, leaves, common)
  got = jax.jit(staged)(leaves, common)
  for a, b in zip(_bits(want), _bits(got), strict=True):
    np.testing.assert_array_equal(a, b)
  puts = [e for e in jax.make_jaxpr(staged)(leaves, common).jaxpr.eqns
          if e.primitive.name == "device_put"]
  assert len(puts) == 6  # each leaf: once for the total, once for its own


def test_stage_by_leaf_without_host_inputs_adds_nothing(monkeypatch):
  _force_chain(monkeypatch)
  fn = lambda leaves, c: ([x + c for x in leaves], [None] * len(leaves), c)
  jaxpr = jax.make_jaxpr(lambda xs, c: staging.stage_by_leaf(fn, xs, c))(
      [jnp.ones(3), jnp.zeros(3)], jnp.ones(3))
  assert not any(e.primitive.name == "optimization_barrier"
                 for e in jaxpr.eqns)


def test_the_gpu_form_of_kahan_apply_updates_computes_the_same_bits(
    monkeypatch):
  def run():
    params = _params()
    residuals = ok.kahan_init(params)
    apply = jax.jit(ok.kahan_apply_updates)
    for i in range(STEPS):
      updates = jax.tree.map(lambda g: 1e-3 * g.astype(jnp.float32),
                             _grads(params, i))
      params, residuals = apply(params, updates, residuals)
    assert all(r.sharding.memory_kind == "pinned_host"
               for r in jax.tree.leaves(residuals))
    return ok.kahan_to_float32(params, residuals)

  want = run()
  _force_chain(monkeypatch)
  for a, b in zip(_bits(want), _bits(run()), strict=True):
    np.testing.assert_array_equal(a, b)


SHARDED = r'''
grads_np = host_grads(3)
report = {}
for name in ("adamw", "prodigy"):
  for mode in ("explicit", "auto"):
    for form in ("cpu", "chain"):
      if form == "chain":
        jax.lax.platform_dependent = lambda *a, cpu, default: default(*a)
      mesh = make_mesh(mode)
      with jax.set_mesh(mesh):
        params = place(host_params(), mesh)
        state, step = init_and_step(make_tx(name), params, mesh, mode)
        for g in grads_np:
          params, state = step(params, state, place(g, mesh))
        kinds = sorted({r.sharding.memory_kind for r in
                        jax.tree.leaves(ok.kahan_residuals(state))})
        report[f"{name}/{mode}/{form}"] = {
            "w": {k: v.tolist() for k, v in exact(params, state).items()},
            "kinds": kinds, "cache_size": step._cache_size()}
emit(report)
'''


def test_the_gpu_form_under_fsdp_sharding_computes_the_same_bits():
  """8 fake devices, Explicit and Auto axes: the chain, forced on the CPU,
  gives the CPU form's weights, residuals in host memory, one compilation."""
  from _subprocess import run
  report = run(SHARDED, devices=8, timeout=300)
  for name in ("adamw", "prodigy"):
    for mode in ("explicit", "auto"):
      want, got = (report[f"{name}/{mode}/{form}"] for form in ("cpu", "chain"))
      assert got["kinds"] == ["pinned_host"] and got["cache_size"] == 1
      for k in want["w"]:
        np.testing.assert_array_equal(np.float32(got["w"][k]),
                                      np.float32(want["w"][k]),
                                      err_msg=f"{name}/{mode}/{k}")

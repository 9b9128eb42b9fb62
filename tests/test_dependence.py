"""The proof that an optax transformation acts leaf by leaf: sound, never a guess."""

import jax
import jax.numpy as jnp
import optax
import pytest

import optax_kahan as ok
from optax_kahan._src import dependence
from optax_kahan._src import per_leaf

PARAMS = {"a": jnp.ones((4, 3)), "b": jnp.linspace(0.0, 1.0, 3),
          "c": jnp.ones((2, 2, 3))}


def _proof(tx, params=PARAMS):
  st, reason = ok.stages_of(tx, params, tx.init(params), params)
  return reason if st is None else ""


@pytest.mark.parametrize("make", [
    lambda: optax.adamw(1e-3), lambda: optax.adafactor(1e-3),
    lambda: optax.lion(1e-3), lambda: optax.sgd(1e-2, momentum=0.9),
    lambda: optax.chain(optax.clip_by_block_rms(1.0), optax.adam(1e-3)),
    lambda: optax.adamw(optax.cosine_decay_schedule(1e-3, 100)),
    lambda: optax.inject_hyperparams(optax.adamw)(learning_rate=1e-3),
    lambda: optax.MultiSteps(optax.adamw(1e-3), 2),
], ids=["adamw", "adafactor", "lion", "sgd", "clip_by_block_rms+adam",
        "schedule", "inject_hyperparams", "MultiSteps"])
def test_optax_per_leaf_transformations_are_proved(make):
  assert _proof(make()) == ""


@pytest.mark.parametrize("make, rounds", [
    (lambda: optax.chain(optax.clip_by_global_norm(1.0), optax.adam(1e-3)),
     1),
    (lambda: optax.apply_if_finite(optax.adam(1e-3), 2), 1),
    (lambda: optax.contrib.prodigy(), None),
], ids=["clip_by_global_norm", "apply_if_finite", "contrib.prodigy"])
def test_couplings_are_found(make, rounds):
  tx = optax.with_extra_args_support(make())
  state = tx.init(PARAMS)
  labels = per_leaf.Layout.of(tx).labels(state, jax.tree.structure(PARAMS))
  assert "reads leaf" in dependence.per_leaf_proof(
      tx.update, PARAMS, state, PARAMS, labels, {})
  # optax's own clip and apply_if_finite then stand in as this package's
  # (coupled.optax_form), one round each; optax.contrib.prodigy has no
  # per-leaf form.
  st, reason = ok.stages_of(tx, PARAMS, state, PARAMS)
  if rounds is None:
    assert st is None and "reads leaf" in reason, reason
  else:
    assert len(st.rounds) == rounds


def _elementwise(fn):
  def update(updates, state, params=None):
    del params
    return jax.tree.map(fn, updates), state
  return optax.GradientTransformation(lambda p: optax.EmptyState(), update)


def test_what_the_proof_does_not_follow_is_refused_by_name():
  solve = _elementwise(lambda g: jax.lax.custom_linear_solve(
      lambda x: 2 * x, g, lambda mv, b: b / 2))
  assert "custom_linear_solve" in _proof(solve)

  def printing(g):
    jax.debug.print("{}", g)
    return g
  assert "effects" in _proof(_elementwise(printing))


def test_a_state_entry_shared_by_all_leaves_may_not_read_a_leaf():
  def update(updates, state, params=None):
    del params
    return updates, jnp.sum(updates["a"])
  tx = optax.GradientTransformation(lambda p: jnp.zeros([]), update)
  assert "shared by all leaves reads leaf ['a']" in _proof(tx)


def test_reads_follows_scan_carries_to_a_fixed_point():
  def f(a, b, c):
    def body(carry, _):
      x, y, z = carry
      return (y, z, x), None   # a reaches the third slot after two rounds
    return jax.lax.scan(body, (a, b, c), None, length=1)[0]
  jaxpr = jax.make_jaxpr(f)(1.0, 2.0, 3.0)
  labels = dependence.reads(jaxpr, [frozenset("a"), frozenset("b"),
                                    frozenset("c")])
  assert all(lab == frozenset("abc") for lab in labels)

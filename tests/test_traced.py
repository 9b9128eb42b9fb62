"""The cut of a traced program decides the same on every supported jax.

``optax_kahan/_src/traced.py`` reads jax's program representation; these tests
pin what it decides where jax releases differ: jax >= 0.11 keeps
``jax.jit(..., inline=True)`` helpers (optax's ``tree_bias_correction``, many
``jnp`` functions) in the jaxpr as calls, jax 0.10 inlined them while tracing.
CI runs them on the oldest and the newest supported jax.
"""

import functools
import warnings

import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest

import optax_kahan as ok
from optax_kahan._src import traced
from benchmarks import corpus, model_shapes, step_memory

import test_same_answer


def _scaled(helper):
  """A transformation that scales each leaf by ``1 / (1 + |g|^2)`` through
  ``helper`` (a plain function or a jit of it)."""
  def update(updates, state, params=None):
    del params
    return jax.tree.map(helper, updates), state
  return optax.GradientTransformation(lambda p: optax.EmptyState(), update)


def _body(g):
  return g / (1.0 + jnp.sum(g * g))


HELPERS = {
    "plain": _body,
    "jit(inline=True)": jax.jit(_body, inline=True),
    "jit": jax.jit(_body),
}
TREE = {"embed": {"kernel": jax.ShapeDtypeStruct((4, 3), jnp.float32)},
        "head": {"kernel": jax.ShapeDtypeStruct((3, 2), jnp.float32),
                 "bias": jax.ShapeDtypeStruct((2,), jnp.float32)}}


def test_a_jit_helper_gets_the_decision_of_its_body():
  # The rows of each leaf are the same equations, whether the helper is a
  # call or not, on the whole tree and on a one-leaf group.
  keys = {}
  for name, helper in HELPERS.items():
    prog = traced._rows(_scaled(helper), TREE)
    assert not isinstance(prog, str), (name, prog)
    keys[name] = [prog.row_key(i) for i in range(3)]
    one = traced._rows(_scaled(helper), {"kernel": TREE["embed"]["kernel"]})
    assert one.row_key(0) == keys[name][0], name
    groups = [(TREE["embed"], [0]), (TREE["head"], [1, 2])]
    assert traced.same_rows(_scaled(helper), TREE, groups) == "", name
  assert keys["jit(inline=True)"] == keys["plain"] == keys["jit"]


def test_a_jit_helper_over_two_leaves_is_refused_as_its_body_is():
  # A helper that sums over the tree: the same refusal with or without jit.
  def clip(tree):
    norm = jnp.sqrt(sum(jnp.sum(x * x) for x in jax.tree.leaves(tree)))
    return jax.tree.map(lambda x: x / jnp.maximum(1.0, norm), tree)

  reasons = set()
  for helper in (clip, jax.jit(clip, inline=True), jax.jit(clip)):
    tx = optax.GradientTransformation(
        lambda p: optax.EmptyState(),
        lambda u, s, p=None, h=helper: (h(u), s))
    reasons.add(traced.same_rows(tx, TREE, [(TREE, [0, 1, 2])]))
    st, why = traced.stages_of(tx, TREE, optax.EmptyState(), None)
    assert st is not None and len(st.rounds) == 1, why
  assert len(reasons) == 1 and "sums over the leaves" in reasons.pop()


def test_a_loop_over_two_leaves_is_a_unit_not_inlined():
  # A fixed-count loop with no scanned inputs has one inner program typed as
  # the call: it must run three times, not be read as one pass of its body.
  def update(updates, state, params=None):
    del params
    a, b = jax.lax.fori_loop(0, 3, lambda _, c: (c[0] * 0.5, c[1] * 0.5),
                             (jnp.sum(updates["a"]), jnp.sum(updates["b"])))
    return jax.tree.map(lambda g: g * (a + b), updates), state

  tx = optax.GradientTransformation(lambda p: optax.EmptyState(), update)
  grads = {"a": jnp.ones(3), "b": jnp.ones(2)}
  u, _ = jax.jit(ok.leafwise(tx).update)(grads, optax.EmptyState())
  np.testing.assert_array_equal(u["a"], 5 * 0.125)


def test_row_keys_are_structure_not_text():
  # Equal programs give equal, hashable keys; a changed constant or
  # primitive parameter changes the key.
  def make(c, bits):
    def update(updates, state, params=None):
      del params
      return jax.tree.map(lambda g: c * jax.lax.reduce_precision(
          g, exponent_bits=8, mantissa_bits=bits), updates), state
    return optax.GradientTransformation(lambda p: optax.EmptyState(), update)

  key = lambda tx: traced._rows(tx, TREE).row_key(1)
  assert hash(key(make(2.0, 7))) == hash(key(make(2.0, 7)))
  assert key(make(2.0, 7)) == key(make(2.0, 7))
  assert key(make(2.0, 7)) != key(make(3.0, 7))
  assert key(make(2.0, 7)) != key(make(2.0, 10))


# -- the regressions of jax 0.11 -----------------------------------------------
@pytest.mark.filterwarnings("ignore:kahan. none of")
def test_blockwise_adamw_with_one_leaf_embedding_and_head():
  # jax 0.11 kept adamw's bias correction a call on a one-leaf group and
  # inlined it on the tree: blockwise_step refused its own example.
  model, params = test_same_answer._model()
  params = params._replace(embed={"dense": {"kernel": params.embed[
      "dense"]["kernel"]}}, head={"out": {"kernel": params.head["out"][
          "kernel"]}})
  model = model._replace(
      embed=lambda p, x: (jnp.tanh(x @ p["dense"]["kernel"]), ()),
      head=lambda p, h, _, x: jnp.mean((h @ p["out"]["kernel"] - x[:, :2])
                                       ** 2))
  batch = jax.random.normal(jax.random.key(9), (5, 4))
  tx = optax.adamw(1e-2, weight_decay=0.1)
  state = ok.blockwise.blockwise_init(tx, params)
  _, new, _ = jax.jit(ok.blockwise.blockwise_step, static_argnums=(0, 1))(
      model, tx, params, state, batch)
  whole = test_same_answer._unstacked(params)
  grads = jax.grad(lambda p: ok.blockwise.blockwise_loss(model, p, batch))(
      params)
  u, _ = jax.jit(tx.update)(test_same_answer._unstacked(grads),
                            tx.init(whole), whole)
  test_same_answer._assert_close(test_same_answer._unstacked(new),
                                 optax.apply_updates(whole, u), "adamw")


@pytest.mark.parametrize("wrap", ["kahan", "leafwise"])
def test_adamw_on_flux_shapes_traces_leaf_by_leaf(wrap):
  # jax 0.11.2 on an H200: kahan(optax.adamw) warned "no per-leaf form" on
  # FLUX shapes and ran whole-tree; leafwise(optax.adamw) raised.
  params = model_shapes.as_params(model_shapes.flux_dev_shapes(
      double_blocks=1, single_blocks=1))
  tx = getattr(ok, wrap)(optax.adamw(1e-5))
  grads = jax.tree.map(lambda p: jax.ShapeDtypeStruct(p.shape, jnp.float32),
                       params)
  with warnings.catch_warnings():
    warnings.simplefilter("error")
    # what their copies cost (1.09 GB of residuals) is not at issue here
    warnings.filterwarnings("ignore", "kahan: the residuals are in host")
    state = step_memory.abstract_state(tx, params)  # residuals on the host
    u, _ = jax.jit(tx.update).trace(grads, state, params).out_info
  assert jax.tree.structure(u) == jax.tree.structure(params)


# What blockwise_step decides for each program of the corpus on the
# blockwise test model (test_same_answer._model): the same on every supported
# jax. "pytree structure": the program's mask or labels are trees shaped as
# corpus.params(), another tree than the model's (optax raises in init).
BLOCKWISE_DECISIONS = {
    "accepted": [
        "sgd", "sgd(momentum, nesterov)", "adam", "adamw",
        "adamw(mask by path)", "adamw(mask by shape)", "adamax", "adabelief",
        "adadelta", "adafactor", "adagrad", "adan", "amsgrad", "lamb", "lars",
        "lion", "lion(mask by path)", "nadamw", "radam", "rmsprop", "sm3",
        "yogi", "masked(adam, callable)", "inject_hyperparams(adamw)",
        "named_chain", "add_decayed_weights(mask) + sgd",
        "clip_by_block_rms + adam", "contrib.schedule_free_adamw",
        "ok.stable_adamw"],
    "pytree structure": ["adamw(bool tree)", "masked(adam, bool tree)",
                         "multi_transform(label tree)"],
    "sums over the leaves": [
        "novograd", "MultiSteps(adam, 2)", "apply_if_finite(adam)",
        "clip_by_global_norm + adamw", "contrib.prodigy"],
    "another program": ["noisy_sgd", "add_noise + sgd"],
    "could not be traced": ["multi_transform(label fn)",
                            "partition(label fn)"],
    "reduce late": ["ok.prodigy", "ok.prodigy_factored",
                    "ok.per_leaf.chain(ok.per_leaf.clip_by_global_norm, "
                    "adamw)"],
}


def _decision(model, params, tx):
  try:
    state = jax.eval_shape(functools.partial(ok.blockwise.blockwise_init, tx),
                           params)
    jax.eval_shape(functools.partial(ok.blockwise.blockwise_step, model, tx),
                   params, state, jnp.ones((5, 4)))
  except ValueError as e:
    found = [d for d in BLOCKWISE_DECISIONS if d in str(e)]
    return found[0] if found else str(e)
  return "accepted"


@pytest.mark.filterwarnings("ignore:kahan. none of")
def test_the_corpus_gets_the_same_blockwise_decisions():
  assert sorted(n for ns in BLOCKWISE_DECISIONS.values() for n in ns) == \
      sorted(corpus.PROGRAMS)
  model, params = test_same_answer._model()
  got = {name: _decision(model, params, make())
         for name, make in corpus.PROGRAMS.items()}
  want = {name: d for d, names in BLOCKWISE_DECISIONS.items()
          for name in names}
  assert got == want, {n: (got[n], want[n]) for n in got if got[n] != want[n]}


def test_rematerialized_calls_counts_the_traced_programs_unrolled_remats():
  block = jax.checkpoint(lambda h, w: jnp.tanh(h @ w))
  seen = []

  def step(ws, x):
    h = x
    for w in ws:
      h = block(h, w)
    jax.lax.scan(lambda h, w: (block(h, w), None), h, jnp.stack(ws))
    seen.append(traced.rematerialized_calls())  # the scan's are in a loop
    return h

  ws = [jnp.eye(4)] * 3
  jax.jit(step).trace(ws, jnp.ones((2, 4)))
  step(ws, jnp.ones((2, 4)))  # eager: no program being traced
  assert seen == [3, 0]

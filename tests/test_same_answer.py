"""The same answer as optax: a corpus of programs users write, every path.

Each program of the corpus (``benchmarks/corpus.py``) is checked against
optax's own whole-tree float32 program on a
Flax-like tree (``encoder/dense/kernel``, ``bias``, norm ``scale``, a 3-D
conv kernel, a float32 head), teacher-forced: both start each step from the
same float32 weights and state.

Paths: ``kahan`` (residuals in host memory and not), ``leafwise``, the
blockwise step (groups: embedding, each block, head) and ``per_block`` on a
stacked tree. Each program either gives optax's weights and state within the
bound below, or is refused with an error that names why (``leafwise``,
``blockwise_step``); ``kahan`` runs a program it cannot cut on the whole tree,
with a warning, and must then give optax's answer too.

The bound (teacher-forced, per step): the rows are the whole-tree program's
own equations, compiled apart, so XLA may fuse a division into a reciprocal
multiply or reorder nothing else; each new float32 weight and state entry is
within ``ULPS`` float32 ulps of ``|old| + |new|`` of optax's (bit for bit
in most cases).
"""

from __future__ import annotations

import warnings

import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest

import optax_kahan as ok
from benchmarks import corpus

from _matrix import quick_only

ULPS = 4


QUICK = ["adamw(mask by path)", "add_decayed_weights(mask) + sgd",
         "multi_transform(label fn)", "masked(adam, callable)", "noisy_sgd",
         "clip_by_global_norm + adamw", "apply_if_finite(adam)",
         "inject_hyperparams(adamw)", "ok.prodigy_factored", "adafactor"]


def _assert_close(got, want, what, old=None):
  """Each float entry within ``ULPS`` ulps of ``|old| + |want|`` (the
  update's error is relative to its own size, at most that), other entries
  equal."""
  olds = jax.tree.leaves(want if old is None else old)
  for (path, g), w, o in zip(jax.tree_util.tree_flatten_with_path(got)[0],
                             jax.tree.leaves(want), olds):
    if jnp.issubdtype(jnp.result_type(g), jax.dtypes.prng_key):
      g, w = jax.random.key_data(g), jax.random.key_data(w)
    if jnp.issubdtype(jnp.result_type(g), jnp.floating):
      g, w, o = (np.asarray(a, np.float32) for a in (g, w, o))
      scale = np.spacing(np.abs(w) + np.abs(o)) * ULPS
      bad = ~(np.abs(g - w) <= scale) & ~(g == w)
      assert not bad.any(), (what, jax.tree_util.keystr(path),
                             g[bad][:3], w[bad][:3])
    else:
      np.testing.assert_array_equal(g, w, err_msg=f"{what} {path}")


def _teacher_forced(name, run_step, steps=2):
  """Feeds ``run_step(x32, state, grads) -> (new x32, new state)`` optax's
  own float32 weights and state at each step and compares."""
  tx = corpus.PROGRAMS[name]()
  x = jax.tree.map(lambda p: p.astype(jnp.float32), corpus.params())
  state = tx.init(x)
  ref = jax.jit(tx.update)
  for step in range(steps):
    g = corpus.grads(step)
    u, new_state = ref(g, state, x)
    want = optax.apply_updates(x, u)
    got, got_state = run_step(x, state, g)
    _assert_close(got, want, f"{name}, step {step}, weights", x)
    _assert_close(got_state, new_state, f"{name}, step {step}, state",
                  state)
    x, state = want, new_state


def _kahan_cases():
  """Each quick program once in the default suite, offloaded or not by
  turns; the other placement, and the other programs, in the slow one."""
  cases = []
  for k, name in enumerate(corpus.PROGRAMS):
    for offload in (True, False):
      quick = name in QUICK and offload == (k % 2 == 0)
      cases.append(pytest.param(name, offload, id=f"{name}-{offload}",
                                marks=() if quick else pytest.mark.slow))
  return cases


@pytest.mark.parametrize("name, offload", _kahan_cases())
def test_kahan_gives_optaxs_answer(name, offload):
  tx = ok.kahan(corpus.PROGRAMS[name](), offload=offload)
  step = jax.jit(tx.update)
  with warnings.catch_warnings(record=True) as caught:
    warnings.simplefilter("always", ok.OptaxKahanWarning)

    def run_step(x32, inner_state, g):
      p, res = ok.kahan_from_float32(x32, offload=offload)
      state = ok.KahanState(res, inner_state)
      u, state = step(g, state, p)
      new = ok.kahan_to_float32(optax.apply_updates(p, u), state.residuals)
      return new, state.inner_state

    _teacher_forced(name, run_step)
  whole_tree = [w for w in caught if "no per-leaf form" in str(w.message)]
  assert not whole_tree or name in WHOLE_TREE, whole_tree[0].message


@pytest.mark.parametrize("name", quick_only(list(corpus.PROGRAMS), QUICK))
def test_leafwise_gives_optaxs_answer_or_refuses(name):
  tx = ok.leafwise(corpus.PROGRAMS[name]())
  step = jax.jit(tx.update)
  if name in WHOLE_TREE:
    tx0 = corpus.PROGRAMS[name]()
    with pytest.raises(ValueError, match="no per-leaf form"):
      step(corpus.grads(0), tx0.init(corpus.params()), corpus.params())
    return

  def run_step(x32, state, g):
    u, state = step(g, state, x32)
    return optax.apply_updates(x32, u), state

  _teacher_forced(name, run_step)


# Programs that cannot be cut (they run whole-tree under kahan, with the
# warning; leafwise refuses them): none of the corpus today. Add a name here
# when a program's update couples leaves through a large value.
WHOLE_TREE: set[str] = set()


# -- blockwise: groups of leaves stepped apart ---------------------------------
def _model():
  def embed(p, x):
    return jnp.tanh(x @ p["dense"]["kernel"] + p["dense"]["bias"]), ()

  def block(p, h, _):
    h = h * p["norm"]["scale"]
    return jnp.tanh(h @ p["attn"]["kernel"] + p["attn"]["bias"])

  def head(p, h, _, x):
    out = h @ p["out"]["kernel"] + p["out"]["bias"]
    return jnp.mean((out - x[:, :2]) ** 2)

  k = iter(jax.random.split(jax.random.key(5), 8))
  n = lambda *s: 0.5 * jax.random.normal(next(k), s, jnp.float32)
  params = ok.blockwise.BlockwiseParams(
      embed={"dense": {"kernel": n(4, 8), "bias": n(8)}},
      stacks=({"attn": {"kernel": n(3, 8, 8), "bias": n(3, 8)},
               "norm": {"scale": 1 + n(3, 8)}},),
      head={"out": {"kernel": n(8, 2), "bias": n(2)}})
  return ok.blockwise.BlockwiseModel(embed, (block,), head), params


def _unstacked(params):
  return ok.blockwise.BlockwiseParams(
      params.embed,
      tuple(tuple(jax.tree.map(lambda x, b=b: x[b], s)
                  for b in range(ok.blockwise.num_blocks(s))) for s in params.stacks),
      params.head)


BLOCKWISE = {
    "adamw": lambda: optax.adamw(1e-2, weight_decay=0.1),
    "adamw(mask by leaf name)": lambda: optax.adamw(
        1e-2, weight_decay=0.5, mask=corpus.decay_mask),
    "lion": lambda: optax.lion(1e-3),
    "adafactor": lambda: optax.adafactor(1e-2),
    "kahan(adamw)": lambda: ok.kahan(optax.adamw(1e-2), offload=False),
    "ok.prodigy_factored(lagged_d)": lambda: ok.prodigy_factored(
        d0=1e-3, lagged_d=True),
}
REFUSED = {
    "clip_by_global_norm + adam": (lambda: optax.chain(
        optax.clip_by_global_norm(0.1), optax.adam(1e-2)), "sums over"),
    "noisy_sgd": (lambda: optax.noisy_sgd(0.1, key=0), "another program"),
    "multi_transform(by group)": (lambda: optax.multi_transform(
        {"a": optax.adam(1e-2), "b": optax.sgd(0.1)},
        lambda p: jax.tree.map(lambda _: "a", p) if isinstance(
            p, ok.blockwise.BlockwiseParams) else jax.tree.map(lambda _: "b", p)),
                                  "another program"),
    "kahan(clip_by_global_norm + adam)": (lambda: ok.kahan(optax.chain(
        optax.clip_by_global_norm(0.1), optax.adam(1e-2)), offload=False),
                                          "sums over"),
}


@pytest.mark.parametrize("name", list(BLOCKWISE))
# kahan on this float32 model has nothing to compensate, and says so.
@pytest.mark.filterwarnings("ignore:kahan. none of")
def test_blockwise_gives_optaxs_answer(name):
  model, params = _model()
  batch = jax.random.normal(jax.random.key(9), (5, 4))
  tx = BLOCKWISE[name]()
  state = ok.blockwise.blockwise_init(tx, params)
  loss, new, _ = jax.jit(ok.blockwise.blockwise_step, static_argnums=(0, 1))(
      model, tx, params, state, batch)
  # optax's whole-tree program on the blocks as separate leaves.
  whole = _unstacked(params)
  grads = jax.grad(lambda p: ok.blockwise.blockwise_loss(model, p, batch))(params)
  ref = BLOCKWISE[name]()
  u, _ = jax.jit(ref.update)(_unstacked(grads), ref.init(whole), whole)
  want = optax.apply_updates(whole, u)
  _assert_close(_unstacked(new), want, name)


@pytest.mark.parametrize("name", list(REFUSED))
# kahan on this float32 model has nothing to compensate, and says so.
@pytest.mark.filterwarnings("ignore:kahan. none of")
def test_blockwise_refuses_what_groups_would_change(name):
  model, params = _model()
  make, why = REFUSED[name]
  tx = make()
  state = ok.blockwise.blockwise_init(tx, params)
  with pytest.raises(ValueError, match=why):
    ok.blockwise.blockwise_step(model, tx, params, state, jnp.ones((5, 4)))


def test_blockwise_refuses_a_global_clip_with_a_one_leaf_head():
  model, params = _model()
  params = params._replace(head={"out": {"kernel": params.head["out"][
      "kernel"]}})
  model = model._replace(head=lambda p, h, _, x: jnp.mean(
      (h @ p["out"]["kernel"] - x[:, :2]) ** 2))
  tx = optax.chain(optax.clip_by_global_norm(0.1), optax.sgd(1.0))
  with pytest.raises(ValueError, match="sums over the leaves"):
    ok.blockwise.blockwise_step(model, tx, params, ok.blockwise.blockwise_init(tx, params),
                      jnp.ones((5, 4)))


# -- per_block: a stacked tree with its block axes -----------------------------
@pytest.mark.parametrize("name", ["adamw(mask by path)", "noisy_sgd",
                                  "clip_by_global_norm + adamw",
                                  "multi_transform(label fn)"])
def test_per_block_gives_optaxs_answer_on_the_unstacked_tree(name):
  stacked = {"encoder": {"blocks": {
      "kernel": jax.random.normal(jax.random.key(1), (3, 4, 4)),
      "bias": jax.random.normal(jax.random.key(2), (3, 4))}},
      "head": {"kernel": jnp.ones((4, 2)), "bias": jnp.zeros(2)}}
  axes = {"encoder": 1, "head": 0}
  unstack = lambda t: {"encoder": {"blocks": {
      k: tuple(v[b] for b in range(3))
      for k, v in t["encoder"]["blocks"].items()}}, "head": t["head"]}
  grads = jax.tree.map(lambda x: 0.1 * jnp.cos(x), stacked)
  tx = ok.blockwise.per_block(corpus.PROGRAMS[name](), axes)
  u, _ = jax.jit(tx.update)(grads, tx.init(stacked), stacked)
  ref = corpus.PROGRAMS[name]()
  w, _ = jax.jit(ref.update)(unstack(grads), ref.init(unstack(stacked)),
                             unstack(stacked))
  _assert_close(unstack(optax.apply_updates(stacked, u)),
                optax.apply_updates(unstack(stacked), w), name,
                unstack(stacked))

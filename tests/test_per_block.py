"""per_block: tx on stacked leaves is tx on their blocks as leaves of their own.

The reference is ``tx`` on the unstacked tree, written out here (each stacked
leaf a list of its blocks). (The blockwise step against both:
``test_blockwise.py``.)
"""

from flax import linen as nn
import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest

import optax_kahan as ok
from optax_kahan._src import traced

from _matrix import sampled

AXES = {"blocks": {"w": 1, "b": 1}, "deep": 2, "out": 0}


def params():
  ks = jax.random.split(jax.random.key(0), 4)
  return {"blocks": {"w": jax.random.normal(ks[0], (3, 4, 6)),
                     "b": jax.random.normal(ks[1], (3, 6))},
          "deep": jax.random.normal(ks[2], (2, 2, 5)),
          "out": jax.random.normal(ks[3], (6,))}


def unstack(tree):
  blocks = lambda x, k: tuple(x.reshape(-1, *x.shape[k:]))
  return {"blocks": {n: blocks(x, 1) for n, x in tree["blocks"].items()},
          "deep": blocks(tree["deep"], 2), "out": tree["out"]}


def restack(tree, like):
  return jax.tree.map(lambda blocks, x: jnp.stack(blocks).reshape(x.shape),
                      tree, like, is_leaf=lambda x: isinstance(x, tuple))


def grads(step, tree):
  return jax.tree.map(lambda x: jnp.sin(x * (step + 1.5)) + 0.1 * x, tree)


OPTIMIZERS = {
    "optax.adafactor": lambda: optax.adafactor(1e-2),
    "clip_by_block_rms": lambda: optax.chain(optax.clip_by_block_rms(0.1),
                                             optax.adam(1e-2)),
    "prodigy_factored": lambda: ok.prodigy_factored(slice_p=2),
    "stable_adamw": lambda: ok.stable_adamw(1e-2),
    "clip_by_global_norm": lambda: ok.per_leaf.chain(ok.per_leaf.clip_by_global_norm(0.5),
                                            optax.adamw(1e-2)),
    "optax.contrib.prodigy": lambda: optax.contrib.prodigy(),  # whole tree
}


@pytest.mark.parametrize("name", sampled(list(OPTIMIZERS), 0, every=2,
                                         ids=list(OPTIMIZERS)))
def test_per_block_is_tx_on_the_unstacked_tree(name):
  tx = OPTIMIZERS[name]()
  blocked = ok.blockwise.per_block(tx, AXES)
  p, p_ref = params(), unstack(params())
  s, s_ref = blocked.init(p), tx.init(p_ref)
  update, update_ref = jax.jit(blocked.update), jax.jit(tx.update)
  for step in range(4):
    u, s = update(grads(step, p), s, p)
    u_ref, s_ref = update_ref(grads(step, p_ref), s_ref, p_ref)
    p, p_ref = optax.apply_updates(p, u), optax.apply_updates(p_ref, u_ref)
  for x, y in zip(jax.tree.leaves(p), jax.tree.leaves(restack(p_ref, p)),
                  strict=True):
    np.testing.assert_allclose(x, y, rtol=1e-6, atol=1e-7)
  # the state is tx's on the unstacked tree
  assert jax.tree.structure(s) == jax.tree.structure(s_ref)
  # and a stacked leaf's statistics are not its blocks': without per_block,
  # adafactor, the clip and the factored moment are other optimizers
  if name in ("optax.adafactor", "clip_by_block_rms", "prodigy_factored"):
    q, sq = params(), tx.init(params())
    for step in range(4):
      u, sq = jax.jit(tx.update)(grads(step, q), sq, q)
      q = optax.apply_updates(q, u)
    start = params()["blocks"]["b"]
    assert not np.allclose(q["blocks"]["b"] - start, p["blocks"]["b"] - start,
                           rtol=1e-2)


def test_per_block_keeps_a_per_leaf_form_and_kahan_its_memory():
  p = params()
  tx = ok.blockwise.per_block(ok.prodigy_factored(), AXES)
  st, reason = traced.stages_of(tx, p, tx.init(p), p)
  assert st is not None, reason
  assert len(st.leaf_states) == len(jax.tree.leaves(p))  # a row per leaf
  assert len(st.rounds) == 1  # Prodigy's sums, over every block
  # kahan(per_block(tx)) has no whole-tree fallback (it would warn)
  w = jax.device_put(jax.tree.map(lambda x: x.astype(jnp.bfloat16), p),
                     jax.devices()[0])
  k = ok.kahan(tx)
  state = k.init(w)
  u, state = jax.jit(k.update)(jax.tree.map(jnp.cos, w), state, w)
  ref = ok.kahan(ok.prodigy_factored())
  u_ref, _ = jax.jit(ref.update)(jax.tree.map(jnp.cos, unstack(w)),
                                 ref.init(unstack(w)), unstack(w))
  for x, y in zip(jax.tree.leaves(u), jax.tree.leaves(restack(u_ref, w)),
                  strict=True):
    np.testing.assert_array_equal(x, y)


def test_per_block_names_what_does_not_fit():
  p = params()
  with pytest.raises(ValueError, match=r"\['deep'\] of shape \[2, 2, 5\] "
                     "cannot have 4"):
    ok.blockwise.per_block(optax.adam(1.0), {**AXES, "deep": 4}).init(p)
  with pytest.raises(ValueError, match=r"\['out'\] must be an int >= 0"):
    ok.blockwise.per_block(optax.adam(1.0), {**AXES, "out": -1}).init(p)
  with pytest.raises(ValueError, match="not a prefix"):
    ok.blockwise.per_block(optax.adam(1.0), {"blocks": 1}).init(p)
  tx = ok.blockwise.per_block(ok.kahan(optax.adam(1.0)), AXES)
  w = jax.device_put(jax.tree.map(lambda x: x.astype(jnp.bfloat16), p),
                     jax.devices()[0])
  # (the inner kahan sees the outer one's float32 weights, and says so)
  with pytest.warns(ok.OptaxKahanWarning, match="nothing to compensate"):
    state = ok.kahan(tx).init(w)
  with pytest.raises(ValueError, match=r"write kahan\(per_block"):
    ok.kahan(tx).update(w, state, w)


def test_block_axes_come_from_linen_scan_metadata():

  class Block(nn.Module):

    @nn.compact
    def __call__(self, x, _):
      dense = nn.Dense(4, kernel_init=nn.with_partitioning(
          nn.initializers.lecun_normal(), ("embed", "mlp")),
                       bias_init=nn.with_partitioning(nn.initializers.zeros,
                                                      ("mlp",)))
      return dense(x), None

  class Model(nn.Module):

    @nn.compact
    def __call__(self, x):
      x = nn.Dense(4)(x)
      x, _ = nn.scan(Block, variable_axes={"params": 0},
                     split_rngs={"params": True}, length=3,
                     metadata_params={nn.PARTITION_NAME: "layers"})()(x, None)
      return x

  boxed = Model().init(jax.random.key(0), jnp.ones((2, 4)))["params"]
  axes = ok.blockwise.block_axes_of(boxed, "layers")
  assert axes == {"Dense_0": {"kernel": 0, "bias": 0},
                  "ScanBlock_0": {"Dense_0": {"kernel": 1, "bias": 1}}}
  unboxed = nn.meta.unbox(boxed)
  tx = ok.blockwise.per_block(ok.prodigy_factored(), axes)
  tx.update(unboxed, tx.init(unboxed), unboxed)


def test_block_axes_come_from_nnx_vmap_metadata():
  from flax import nnx
  mesh = jax.sharding.Mesh(jax.devices()[:1], ("mlp",),
                           axis_types=(jax.sharding.AxisType.Explicit,))

  class Block(nnx.Module):

    def __init__(self, rngs):
      self.dense = nnx.Linear(
          3, 3, rngs=rngs, kernel_init=nnx.with_partitioning(
              nnx.initializers.lecun_normal(), (None, "mlp")),
          bias_init=nnx.with_partitioning(nnx.initializers.zeros, ("mlp",)))

  with jax.set_mesh(mesh):
    make = nnx.vmap(Block, in_axes=0, out_axes=0,
                    transform_metadata={nnx.PARTITION_NAME: "layers"})
    blocks = make(nnx.Rngs(0).split(4))
    axes = ok.blockwise.block_axes_of(nnx.state(blocks, nnx.Param), "layers")
  assert jax.tree.leaves(axes) == [1, 1]  # bias, kernel


def _scanned(partition_name, bias_metadata=True):
  class Block(nn.Module):

    @nn.compact
    def __call__(self, x, _):
      bias_init = (nn.with_partitioning(nn.initializers.zeros, ("mlp",))
                   if bias_metadata else nn.initializers.zeros)
      dense = nn.Dense(4, kernel_init=nn.with_partitioning(
          nn.initializers.lecun_normal(), ("embed", "mlp")),
                       bias_init=bias_init)
      return dense(x), None

  scan = nn.scan(Block, variable_axes={"params": 0},
                 split_rngs={"params": True}, length=3,
                 metadata_params={nn.PARTITION_NAME: partition_name})
  return scan().init(jax.random.key(0), jnp.ones((2, 4)), None)["params"]


def test_block_axes_of_refuses_a_stack_it_cannot_see():
  # MaxDiffusion's FLUX scans with PARTITION_NAME None: the block axis has
  # no name, and a stack must never be taken for one tensor.
  with pytest.raises(ValueError, match="no leaf has an axis named 'layers'"):
    ok.blockwise.block_axes_of(_scanned(None), "layers")
  with pytest.raises(ValueError, match=r"\['Dense_0'\]\['bias'\] has no "
                     "partitioning metadata but sits beside stacked"):
    ok.blockwise.block_axes_of(_scanned("layers", bias_metadata=False), "layers")
  with pytest.raises(ValueError, match="tree of ints"):
    ok.blockwise.block_axes_of(_scanned("layers"), None)
  assert ok.blockwise.block_axes_of(_scanned("layers"), "layers") == {
      "Dense_0": {"kernel": 1, "bias": 1}}

"""Stochastic rounding to bfloat16 (the baseline), on the magnitude's bits::

    bits = (bits(x) + r) & 0xFFFF0000,    r ~ uniform 16-bit integer

References:
  Gupta et al., "Deep Learning with Limited Numerical Precision", ICML 2015.
  Zamirai et al., "Revisiting BFloat16 Training", arXiv:2010.06192, 2020.
"""

from typing import Any, NamedTuple

import jax
import jax.numpy as jnp
import optax
from jax import lax

from optax_kahan._src import validation
from optax_kahan._src import leaves


def stochastic_round(x: jax.Array, key: jax.Array) -> jax.Array:
  """Rounds float32 ``x`` to bfloat16 stochastically, without bias.

  Args:
    x: a float32 array.
    key: a JAX PRNG key.

  Returns:
    A bfloat16 array, each element one of the two bfloat16 neighbours of ``x``
    (``E[y] = x``). NaN and +-Inf stay; finite values become Inf only beyond
    the largest bfloat16, 3.3895e38.

  Example:
    >>> y = stochastic_round(jnp.full(4, 1.0 + 2**-10), jax.random.key(0))
  """
  x = jnp.asarray(x)
  if x.dtype != jnp.float32:
    raise TypeError(f"stochastic_round expects float32, got {x.dtype}")
  validation.check_key("stochastic_round", key)
  noise = jax.random.bits(key, x.shape, jnp.uint32) >> 16
  x_bits = lax.bitcast_convert_type(x, jnp.uint32)
  rounded = (x_bits + noise) & jnp.uint32(0xFFFF0000)
  hi = lax.bitcast_convert_type(rounded, jnp.float32).astype(jnp.bfloat16)
  return jnp.where(jnp.isnan(x), jnp.bfloat16(jnp.nan), hi)


def _leaf_keys(key: jax.Array, tree: Any) -> Any:
  """One independent key per leaf of ``tree`` (None leaves included)."""
  flat, treedef = jax.tree.flatten(tree, is_leaf=lambda x: x is None)
  keys = [jax.random.fold_in(key, i) for i in range(len(flat))]
  return jax.tree.unflatten(treedef, keys)


def stochastic_round_apply_updates(params: Any, updates: Any,
                                   key: jax.Array) -> Any:
  """``p <- stochastic_round(float32(p) + u)`` for bfloat16 leaves.

  Args:
    params: a tree of bfloat16 arrays; float32/float64 leaves get ``p + u``,
      other dtypes raise.
    updates: a tree like ``params``.
    key: a PRNG key; use a fresh one every step.

  Returns:
    The new params, with the params' dtypes.
  """
  def apply_leaf(path, p, u, k):
    if p is None:
      return None
    if not leaves.needs_residual(p, path):
      return (p + u).astype(p.dtype)
    return stochastic_round(p.astype(jnp.float32) + u.astype(jnp.float32), k)
  validation.check_key("stochastic_round_apply_updates", key)
  leaves.leaves_like(params, updates, "updates")  # names where the trees differ
  return leaves.map_leaves(apply_leaf, params, updates, _leaf_keys(key, params))


class StochasticRoundingState(NamedTuple):
  """State of ``stochastic_rounding``: a step counter and the inner state."""
  count: jax.Array  # int32 scalar
  inner_state: optax.OptState


def stochastic_rounding(inner: optax.GradientTransformation, key: jax.Array
                        ) -> optax.GradientTransformationExtraArgs:
  """Wraps ``inner`` to update bfloat16 params with stochastic rounding.

  As under ``kahan``, ``inner`` sees float32 params and gradients, and
  ``optax.apply_updates`` lands on ``stochastic_round(float32(p) + u)``. Step
  ``t`` uses ``fold_in(key, t)``: the same on every device and on resuming.

  Args:
    inner: any optax transformation.
    key: a PRNG key.

  Returns:
    An ``optax.GradientTransformationExtraArgs``.

  Example:
    >>> tx = stochastic_rounding(optax.adamw(1e-6), jax.random.key(0))
  """
  validation.check_transformation("stochastic_rounding", "inner", inner)
  validation.check_key("stochastic_rounding", key)
  inner = optax.with_extra_args_support(inner)
  def init_fn(params):
    if validation.is_abstract(params):
      return jax.eval_shape(init_fn, params)
    leaves.map_leaves(lambda path, p: leaves.needs_residual(p, path), params)
    return StochasticRoundingState(
        jnp.zeros([], jnp.int32), inner.init(leaves.upcast(params)))
  def update_fn(updates, state, params=None, **extra_args):
    if params is None:
      raise ValueError("stochastic_rounding(...).update needs params")
    x32 = leaves.upcast(params)
    g32 = leaves.upcast(updates)
    u, inner_state = inner.update(g32, state.inner_state, x32, **extra_args)
    keys = _leaf_keys(jax.random.fold_in(key, state.count), params)
    def step_leaf(path, p, u, k):
      if p is None or u is None:
        return None
      if not leaves.needs_residual(p, path):
        return u
      hi = stochastic_round(p.astype(jnp.float32) + u.astype(jnp.float32), k)
      return leaves.landing_delta(p, hi)
    deltas = leaves.map_leaves(step_leaf, params, u, keys)
    count = optax.safe_increment(state.count)
    return deltas, StochasticRoundingState(count, inner_state)
  return optax.GradientTransformationExtraArgs(init_fn, update_fn)


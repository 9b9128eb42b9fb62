"""A bf16 params tree's leaves, for ``kahan`` and ``stochastic_rounding``."""

from typing import Any, Callable

import jax
import jax.numpy as jnp
import optax

from optax_kahan._src import validation

_WIDE_FLOATS = (jnp.dtype(jnp.float32), jnp.dtype(jnp.float64))


def is_none(x: Any) -> bool:
  return x is None


def paths(tree: Any) -> list[str]:
  """The key path of each leaf of ``tree`` (None leaves included)."""
  flat, _ = jax.tree_util.tree_flatten_with_path(tree, is_leaf=is_none)
  return [jax.tree_util.keystr(path) for path, _ in flat]


def needs_residual(leaf: Any, path: str = "") -> bool:
  """True for bfloat16 leaves, False for float32/float64 or None ones; raises
  ValueError naming ``path`` for any other dtype."""
  if leaf is None:
    return False
  dtype = jnp.result_type(leaf)
  if dtype == jnp.bfloat16:
    return True
  if dtype in _WIDE_FLOATS:
    return False
  raise ValueError(
      f"leaf {path or '<root>'} has dtype {dtype}: Kahan-compensated updates "
      "take bfloat16 leaves (with a residual) or float32/float64 leaves "
      "(updated normally); cast it, or leave it out with optax.masked")


def leaves_like(params: Any, tree: Any, what: str,
                strict: bool = False) -> list[Any]:
  """``tree``'s entries, one per leaf of ``params``; unless ``strict``, node
  types may differ where key paths agree (``nnx.State``, ``optax.MaskedNode``).
  Raises ValueError naming the first path where the trees differ."""
  treedef = jax.tree.structure(params, is_leaf=is_none)
  try:
    return treedef.flatten_up_to(tree)
  except (ValueError, TypeError):
    if strict:
      where = validation.tree_mismatch(params, tree, names=("params", what),
                                       is_leaf=is_none)
      raise ValueError(
          f"{what} do not match the params' tree: {where}") from None
  t_flat = jax.tree_util.tree_flatten_with_path(
      tree, is_leaf=lambda x: x is None or isinstance(x, optax.MaskedNode))[0]
  if paths(params) == [jax.tree_util.keystr(k) for k, _ in t_flat]:
    return [x for _, x in t_flat]
  where = validation.tree_mismatch(params, tree, names=("params", what),
                                   is_leaf=is_none)
  raise ValueError(f"{what} do not match the params' tree: {where}")


def map_leaves(fn: Callable[..., Any], params: Any, *trees: Any) -> Any:
  """Maps ``fn(path, p, *xs)`` over params' leaves (None leaves included)."""
  treedef = jax.tree.structure(params, is_leaf=is_none)
  others = [leaves_like(params, t, "trees") for t in trees]
  out = [fn(path, p, *xs) for path, p, *xs in
         zip(paths(params), treedef.flatten_up_to(params), *others)]
  return jax.tree.unflatten(treedef, out)


def upcast(tree: Any) -> Any:
  """Float leaves to at least float32 (exact); float64 stays float64."""
  return jax.tree.map(
      lambda x: x.astype(jnp.promote_types(x.dtype, jnp.float32))
      if x is not None and jnp.issubdtype(x.dtype, jnp.floating) else x,
      tree, is_leaf=is_none)


def landing_delta(p: jax.Array, new: jax.Array) -> jax.Array:
  """The float32 update with which ``optax.apply_updates`` turns ``p`` into
  ``new``: exact unless magnitudes differ by about ``2**15``; zero where the
  weight does not move, so a weight at +-Inf does not become ``NaN``."""
  return jnp.where(new == p, 0.0,
                   new.astype(jnp.float32) - p.astype(jnp.float32))

"""Stacked leaves as blocks: an optimizer applied to each block of a stack.

``per_block(tx, block_axes)`` is ``tx`` on the tree in which every stacked
(``nn.scan``, ``nnx.vmap``) leaf is replaced by its blocks::

    per_block(tx).init(theta)       = tx.init(U(theta))
    per_block(tx).update(g, s, theta) = (S(u), s'),
        (u, s') = tx.update(U(g), s, U(theta))

with ``U`` the unstacking (``theta_i -> (theta_{i,1}, ..., theta_{i,L_i})``)
and ``S`` its inverse; see docs/guides/flux.md.

References:
  Flax ``nn.scan`` and ``nnx.vmap`` (``variable_axes``, ``transform_metadata``
  with ``PARTITION_NAME``); MaxText's ``scan_layers``.
"""

import math
from typing import Any, Optional

from flax import linen as nn
from flax import nnx
import jax
import jax.numpy as jnp
import optax

from optax_kahan._src import per_leaf
from optax_kahan._src import traced
from optax_kahan._src import validation


class _Blocks:
  """A stacked leaf's per-block states; its block axes are static."""
  def __init__(self, states: tuple[Any, ...], axes: int):
    self.states = states
    self.axes = axes


jax.tree_util.register_pytree_node(
    _Blocks, lambda b: (b.states, b.axes), lambda axes, s: _Blocks(s, axes))


def _blocks(x: Any, axes: int) -> list[Any]:
  """``x``'s slices over its first ``axes`` axes, in row-major order."""
  if x is None:
    return None
  shape = jnp.shape(x)
  n = math.prod(shape[:axes])
  if isinstance(x, jax.ShapeDtypeStruct):
    return [jax.ShapeDtypeStruct(shape[axes:], x.dtype)] * n
  flat = jnp.reshape(x, (n, *shape[axes:]))
  return [flat[b] for b in range(n)]


def _leaf_axes(block_axes: Any, tree: Any) -> list[int]:
  """``block_axes`` as one int per leaf of ``tree``, checked."""
  leaves = jax.tree_util.tree_flatten_with_path(tree)[0]
  try:
    axes = jax.tree.leaves(jax.tree.broadcast(block_axes, tree))
  except (ValueError, TypeError) as e:
    raise ValueError(
        f"per_block: block_axes {block_axes!r} is not a prefix of the "
        f"updates' tree ({e}). (blockwise_step steps each block on its "
        "own already: give it tx itself.)") from e
  for (path, x), k in zip(leaves, axes):
    if not isinstance(k, int) or isinstance(k, bool) or k < 0:
      raise ValueError(f"per_block: block_axes for leaf "
                       f"{jax.tree_util.keystr(path)} must be an int >= 0, "
                       f"got {k!r}")
    if k > jnp.ndim(x) or (k and not math.prod(jnp.shape(x)[:k])):
      raise ValueError(
          f"per_block: leaf {jax.tree_util.keystr(path)} of shape "
          f"{list(jnp.shape(x))} cannot have {k} leading block axes")
  return axes


def _unstack(tree: Any, axes: list[int]) -> Any:
  """``U``: each stacked leaf replaced by the tuple of its blocks."""
  if tree is None:
    return None
  leaves, treedef = jax.tree.flatten(tree)
  return treedef.unflatten([tuple(_blocks(x, k)) if k else x
                            for x, k in zip(leaves, axes)])


def _stack(blocks: list[Any], like: Any) -> jax.Array:
  """``S`` for one leaf: its blocks back in the shape of ``like``."""
  return jnp.reshape(jnp.stack(blocks), jnp.shape(like))


def per_block(tx: optax.GradientTransformation,
              block_axes: Any) -> optax.GradientTransformationExtraArgs:
  """``tx`` applied to each block of stacked leaves as to a leaf of its own.

  Every per-leaf statistic of ``tx`` is then a block's, every sum over the
  leaves runs over every block. Give ``blockwise_step`` ``tx`` itself.

  Args:
    tx: any gradient transformation.
    block_axes: each leaf's number of leading block axes: an int, a tree of
      ints that is a prefix of the params' tree, or ``block_axes_of(...)``.

  Returns:
    An ``optax.GradientTransformationExtraArgs`` with ``tx``'s state on the
    unstacked tree, and a per-leaf form where ``tx`` has one.

  Raises:
    ValueError: for ``block_axes`` that do not fit the tree, naming the
      leaf; for ``per_block(kahan(...))`` (write ``kahan(per_block(...))``).

  Example:
    >>> import optax_kahan as ok
    >>> params = {"blocks": {"b": jnp.zeros((4, 8))}, "out": jnp.zeros(8)}
    >>> tx = ok.blockwise.per_block(ok.prodigy_factored(),
    ...                             {"blocks": 1, "out": 0})
    >>> state = tx.init(params)

  References:
    Shazeer & Stern, "Adafactor", 2018 (per-matrix statistics);
    Mishchenko & Defazio, "Prodigy", 2024.
  """
  validation.check_transformation("per_block", "tx", tx)
  tx = optax.with_extra_args_support(tx)

  def init_fn(params):
    return tx.init(_unstack(params, _leaf_axes(block_axes, params)))
  def whole_tree(updates, state, params=None, **extra_args):
    leaves, treedef = jax.tree.flatten(updates)
    axes = _leaf_axes(block_axes, updates)
    new, state = tx.update(_unstack(updates, axes), state,
                           _unstack(params, axes), **extra_args)
    new = treedef.flatten_up_to(new)
    return treedef.unflatten([_stack(list(u), g) if k else u
                              for u, g, k in zip(new, leaves, axes)]), state

  def stages(updates, state, params, **extra_args):
    axes = _leaf_axes(block_axes, updates)
    inner, reason = traced.stages_of(tx, _unstack(updates, axes), state,
                                       _unstack(params, axes), **extra_args)
    if inner is None:
      return reason
    if inner.inputs is not None:
      raise ValueError("per_block(tx): tx brings its own per-leaf inputs "
                       "(kahan); write kahan(per_block(tx, block_axes))")
    cuts, start = [], 0
    for x, k in zip(jax.tree.leaves(updates), axes):
      n = math.prod(jnp.shape(x)[:k])
      cuts.append(_Blocks(tuple(inner.leaf_states[start:start + n]), k))
      start += n
    if start != len(inner.leaf_states):
      return (f"its stages cut the state into {len(inner.leaf_states)} "
              f"leaves for {start} blocks")
    def rows(fn, g, s, x):
      if not s.axes:
        return [fn(g, s.states[0], x)]
      xs = _blocks(x, s.axes) or [None] * len(s.states)
      return [fn(*row) for row in zip(_blocks(g, s.axes), s.states, xs)]
    def round_of(rnd):
      def statistic(g, s, x, shared, **extra):
        outs = rows(lambda *r: rnd.statistic(*r, shared, **extra), g, s, x)
        return (tuple(stat for stat, _ in outs),
                _Blocks(tuple(b for _, b in outs), s.axes))
      def reduce(stats):
        blocks = [b for leaf in stats for b in leaf]
        return (per_leaf.total if rnd.reduce is None else rnd.reduce)(blocks)
      return rnd._replace(statistic=statistic, reduce=reduce)
    def update(g, s, x, shared, **extra):
      outs = rows(lambda *r: inner.update(*r, shared, **extra), g, s, x)
      u = _stack([u for u, _ in outs], g) if s.axes else outs[0][0]
      return u, _Blocks(tuple(b for _, b in outs), s.axes)
    def finish(states, shared):
      return inner.finish([b for s in states for b in s.states], shared)
    return per_leaf.LeafStages(
        cuts, inner.shared, tuple(round_of(r) for r in inner.rounds), update,
        finish)

  return per_leaf.transformation(init_fn, stages, whole_tree=whole_tree,
                                 parts=(tx,))


def _names(x: Any) -> Optional[tuple[Any, ...]]:
  """The axis names of an ``nn.Partitioned`` or ``nnx.Variable``, or None."""
  if isinstance(x, nn.Partitioned):
    return tuple(x.names)
  if isinstance(x, nnx.Variable):
    meta = x.get_metadata()
    names = meta.get("out_sharding") or meta.get("sharding")
    return None if names is None else tuple(names)
  return None


def block_axes_of(tree: Any, axis_name: str) -> Any:
  """Each leaf's number of leading block axes, from partitioning metadata.

  A leaf's block axes are its leading axes named ``axis_name`` (the scan's
  ``PARTITION_NAME``). A stack this cannot see (no leaf names ``axis_name``,
  or an unannotated leaf beside stacked ones) is refused, not one tensor.

  Args:
    tree: boxed linen params (before ``nn.meta.unbox``) or an ``nnx.State``.
    axis_name: the scan's partition name (MaxText: ``"layers"``).

  Returns:
    ``per_block``'s ``block_axes``: an int per array, 0 outside the stacks.

  Raises:
    ValueError: if ``axis_name`` is not a str, names a non-leading axis or
      none, or a leaf's block axes are unknown.
  """
  if not isinstance(axis_name, str):
    raise ValueError(
        f"block_axes_of: axis_name must be the scan's partition name (a "
        f"str), got {axis_name!r}; for a stack whose block axis has no name, "
        "give per_block its block axes as a tree of ints")
  is_box = lambda x: _names(x) is not None
  def axes(path, x):
    names = _names(x)
    if names is None:
      return None  # decided below
    k = 0
    while k < len(names) and names[k] == axis_name:
      k += 1
    if axis_name in names[k:]:
      raise ValueError(
          f"block_axes_of: leaf {jax.tree_util.keystr(path)} has the block "
          f"axis {axis_name!r} at a position that is not leading "
          f"(names {names}); per_block needs leading block axes")
    return k
  found = jax.tree_util.tree_map_with_path(axes, tree, is_leaf=is_box)
  flat = jax.tree_util.tree_flatten_with_path(
      found, is_leaf=lambda x: x is None)[0]
  if not any(k for _, k in flat):
    raise ValueError(
        f"block_axes_of: no leaf has an axis named {axis_name!r}. An nn.scan "
        "with metadata_params={nn.PARTITION_NAME: None} (MaxDiffusion) leaves "
        f"its block axis unnamed: scan with {{nn.PARTITION_NAME: "
        f"{axis_name!r}}}, or give per_block the block axes as a tree of ints")
  stacked = {path[:-1] for path, k in flat if k}
  for path, k in flat:
    if k is None and path[:-1] in stacked:
      raise ValueError(
          f"block_axes_of: leaf {jax.tree_util.keystr(path)} has no "
          "partitioning metadata but sits beside stacked leaves, so its "
          "block axes are unknown: annotate it (nn.with_partitioning) or "
          "give per_block the block axes as a tree of ints")
  return jax.tree.map(lambda k: k or 0, found, is_leaf=lambda x: x is None)

"""Late sums (``LateSums``, as of ``lagged_d=True``) added over all groups."""

from typing import Any

import jax
import jax.numpy as jnp

from optax_kahan._src import per_leaf
from optax_kahan._src import placement
from optax_kahan._src import validation
from optax_kahan._src.blockwise.model import BlockwiseState
from optax_kahan._src.interleaved import Interleaved
from optax_kahan._src.interleaved import is_interleaved


def _is_late(x: Any) -> bool:
  return isinstance(x, per_leaf.LateSums)


def _like(x: jax.Array, where: jax.Array) -> jax.Array:
  """``x`` in ``where``'s memory (a streamed stack's: host)."""
  return placement.to_host(x) if placement.on_host(where) else x


def _block_sum(x: Any) -> jax.Array:
  """A stacked leaf's sum over its blocks (an ``Interleaved`` one's parts)."""
  parts = x.parts if is_interleaved(x) else (x,)
  sums = [jnp.sum(placement.on_device(p), axis=0) for p in parts]
  return sum(sums[1:], sums[0])


def _filled(total: jax.Array, x: Any) -> Any:
  """``total`` in every block of ``x``, where ``x`` is."""
  if is_interleaved(x):
    return Interleaved(_filled(total, p) for p in x.parts)
  return _like(jnp.broadcast_to(total, x.shape), x)


def sum_late(state: BlockwiseState) -> BlockwiseState:
  """Gives every ``LateSums`` of the state (each group's, one per block in a
  stack) the sums over all groups."""
  groups = [state.embed, *state.stacks, state.head]
  found = [validation.find(g, per_leaf.LateSums) for g in groups]
  totals = []
  for j in range(len(found[0])):
    parts = [found[0][j].sums, found[-1][j].sums]
    parts += [jax.tree.map(_block_sum, g[j].sums, is_leaf=is_interleaved)
              for g in found[1:-1]]
    totals.append(jax.tree.map(lambda *xs: sum(xs[1:], xs[0]), *parts))

  def with_totals(tree):
    it = iter(totals)
    return jax.tree.map(
        lambda x: per_leaf.LateSums(jax.tree.map(_filled, next(it), x.sums))
        if _is_late(x) else x, tree, is_leaf=_is_late)

  return BlockwiseState(
      embed=with_totals(state.embed),
      stacks=tuple(with_totals(s) for s in state.stacks),
      head=with_totals(state.head))


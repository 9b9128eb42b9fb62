"""Software pipelining of host leaves: fetch a block ahead, write one behind.

A stacked leaf in host memory (``kahan``'s residuals; ``stream_blocks``'
streamed weights and state) is never brought to the device whole: the loop
over a stack fetches block ``i + 1`` (forward) or ``i - 1`` (backward) while
block ``i`` computes, and writes a block's new values back the iteration
after. XLA's scheduler then runs the copies beside the compute.
"""

from __future__ import annotations

from typing import Any

import jax
import jax.numpy as jnp
from jax import lax

from optax_kahan._src import placement
from optax_kahan._src.blockwise.model import num_blocks


def take(tree: Any, i: jax.Array) -> Any:
  """Entry ``i`` of each leaf's leading (block) axis."""
  return jax.tree.map(
      lambda x: lax.dynamic_index_in_dim(x, i, keepdims=False), tree)


def fetch(leaves: list[Any], i: jax.Array) -> list[Any]:
  """Block ``i`` of each stacked host leaf, brought into device memory
  (None for device leaves, sliced where they are used)."""
  return [placement.to_device(lax.dynamic_index_in_dim(x, i, keepdims=False))
          if placement.on_host(x) else None for x in leaves]


def block_of(leaves: list[Any], staged: list[Any], i: jax.Array
             ) -> list[Any]:
  """Block ``i``: host leaves from ``staged`` (fetched ahead), the others
  sliced from their stacks."""
  return [y if placement.on_host(x)
          else lax.dynamic_index_in_dim(x, i, keepdims=False)
          for x, y in zip(leaves, staged)]


def write_back(leaves: list[Any], pending: list[Any], i: jax.Array
               ) -> list[Any]:
  """The host leaves with block ``i`` set to ``pending``'s values, sent back
  to host memory."""
  return [lax.dynamic_update_index_in_dim(x, placement.to_host(p), i, 0)
          if placement.on_host(x) else x for x, p in zip(leaves, pending)]


def forward_stack(block, stack, carry, consts):
  """``lax.scan`` of ``block`` over a stack; the carries that enter each
  block are returned stacked. Leaves in host memory (streamed weights) are
  fetched one block ahead: block ``i + 1``'s copy runs during block ``i``'s
  compute (the last iteration fetches its own block again)."""
  leaves, treedef = jax.tree.flatten(stack)
  last = num_blocks(stack) - 1
  # Device leaves are the scan's xs (their gradient, under jax.grad, is its
  # stacked output, as for a plain lax.scan over the stack).
  device = [None if placement.on_host(x) else x for x in leaves]

  def body(loop, xs):
    c, staged = loop
    sliced, i = xs
    ahead = fetch(leaves, jnp.minimum(i + 1, last))
    params = treedef.unflatten([y if x is None else x
                                for x, y in zip(sliced, staged)])
    return (block(params, c, consts), ahead), c

  (carry, _), saved = lax.scan(body, (carry, fetch(leaves, 0)),
                               (device, jnp.arange(last + 1)))
  return carry, saved


"""Software pipelining of host leaves: fetch a block ahead, write one behind."""

from typing import Any

import jax
import jax.numpy as jnp
from jax import lax

from optax_kahan._src import placement
from optax_kahan._src.blockwise.model import num_blocks


def fetch(leaves: list[Any], i: jax.Array) -> list[Any]:
  """Block ``i`` of each stacked host leaf, on the device (else None)."""
  return [placement.to_device(lax.dynamic_index_in_dim(x, i, keepdims=False))
          if placement.on_host(x) else None for x in leaves]


def block_of(leaves: list[Any], staged: list[Any], i: jax.Array
             ) -> list[Any]:
  """Block ``i``: host leaves from ``staged``, the others sliced."""
  return [y if placement.on_host(x)
          else lax.dynamic_index_in_dim(x, i, keepdims=False)
          for x, y in zip(leaves, staged)]


def write_back(leaves: list[Any], pending: list[Any], i: jax.Array
               ) -> list[Any]:
  """The host leaves with block ``i`` set to ``pending`` (sent to host)."""
  return [lax.dynamic_update_index_in_dim(x, placement.to_host(p), i, 0)
          if placement.on_host(x) else x for x, p in zip(leaves, pending)]


def forward_stack(block, stack, carry, consts, offload: bool = False):
  """``lax.scan`` of ``block`` over a stack, host leaves fetched a block ahead;
  also returns the carries entering each block, stacked (in host memory if
  ``offload``: each sent while the next block computes)."""
  leaves, treedef = jax.tree.flatten(stack)
  last = num_blocks(stack) - 1
  # Device leaves are the scan's xs, so jax.grad treats them as lax.scan's.
  device = [None if placement.on_host(x) else x for x in leaves]

  def body(loop, xs):
    c, staged = loop
    sliced, i = xs
    ahead = fetch(leaves, jnp.minimum(i + 1, last))
    params = treedef.unflatten([y if x is None else x
                                for x, y in zip(sliced, staged)])
    return (block(params, c, consts), ahead), (
        placement.to_host(c) if offload else c)

  (carry, _), saved = lax.scan(body, (carry, fetch(leaves, 0)),
                               (device, jnp.arange(last + 1)))
  return carry, saved


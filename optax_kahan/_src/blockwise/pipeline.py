"""Software pipelining of host leaves: fetch a block ahead, write one behind.

A block is addressed by ``at``: its index in the stack; for a stack with
``Interleaved`` leaves, a pair ``(r, q)``: block ``3 q + r``, row ``q`` of part
``r`` (``r`` static, so the part is known when the program is built); or
None: the leaf is that one block's value already (not stacked).
"""

from typing import Any, NamedTuple

import jax
import jax.numpy as jnp
from jax import lax

from optax_kahan._src import placement
from optax_kahan._src.blockwise.model import num_blocks
from optax_kahan._src.interleaved import Interleaved
from optax_kahan._src.interleaved import PERIOD
from optax_kahan._src.interleaved import is_interleaved


def interleaved_in(tree: Any) -> bool:
  """Whether ``tree`` holds an ``Interleaved`` leaf."""
  return any(map(is_interleaved, jax.tree.leaves(tree,
                                                 is_leaf=is_interleaved)))


def on_host(x: Any) -> bool:
  """A leaf in host memory (an ``Interleaved`` one: its parts)."""
  return placement.on_host(x.parts[0] if is_interleaved(x) else x)


def read(x: Any, at: Any) -> Any:
  """Block ``at`` of a stacked leaf (see the module's docstring)."""
  if at is None:
    return x
  if is_interleaved(x):
    r, q = at
    return lax.dynamic_index_in_dim(x.parts[r], q, keepdims=False)
  i = PERIOD * at[1] + at[0] if isinstance(at, tuple) else at
  return lax.dynamic_index_in_dim(x, i, keepdims=False)


def write(x: Any, y: Any, at: Any) -> Any:
  """``x`` with block ``at`` set to ``y``."""
  if is_interleaved(x):
    r, q = at
    parts = list(x.parts)
    parts[r] = lax.dynamic_update_index_in_dim(parts[r], y, q, 0)
    return Interleaved(parts)
  i = PERIOD * at[1] + at[0] if isinstance(at, tuple) else at
  return lax.dynamic_update_index_in_dim(x, y, i, 0)


def fetch(leaves: list[Any], at: Any) -> list[Any]:
  """Block ``at`` of each stacked host leaf, on the device (else None)."""
  return [placement.to_device(read(x, at)) if on_host(x) else None
          for x in leaves]


def block_of(leaves: list[Any], staged: list[Any], at: Any) -> list[Any]:
  """Block ``at``: host leaves from ``staged``, the others sliced."""
  return [y if on_host(x) else read(x, at) for x, y in zip(leaves, staged)]


def write_back(leaves: list[Any], pending: list[Any], at: Any) -> list[Any]:
  """The host leaves with block ``at`` set to ``pending`` (sent to host)."""
  return [write(x, placement.to_host(p), at) if on_host(x) else x
          for x, p in zip(leaves, pending)]


class Rows(NamedTuple):
  """How a stack with ``Interleaved`` leaves is walked: ``loops`` iterations of
  ``PERIOD`` blocks (rows ``0 .. loops - 1`` of each part), then ``top``
  blocks, ``3 loops .. n - 1`` (at least one, so the first block the
  backward pass updates and the last the forward pass fetches ahead are not
  in the loop, where a block past the end has no part to clamp into)."""
  loops: int
  top: int

  @classmethod
  def of(cls, n: int) -> "Rows":
    top = (n - 1) % PERIOD + 1
    return cls((n - top) // PERIOD, top)


def up(at: tuple[int, Any]) -> tuple[int, Any]:
  """The block after ``at = (r, q)``."""
  r, q = at
  return (0, q + 1) if r + 1 == PERIOD else (r + 1, q)


def down(at: tuple[int, Any]) -> tuple[int, Any]:
  """The block before ``at = (r, q)``."""
  r, q = at
  return (PERIOD - 1, q - 1) if r == 0 else (r - 1, q)


def forward_stack(block, stack, carry, consts, offload: bool = False):
  """``lax.scan`` of ``block`` over a stack, host leaves fetched a block ahead;
  also returns the carries entering each block, stacked (in host memory if
  ``offload``: each sent while the next block computes). A stack with
  ``Interleaved`` leaves (or state): ``forward_interleaved``."""
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


class SavedInputs(NamedTuple):
  """The carries entering each block of a stack with ``Interleaved`` leaves:
  ``parts``, a tree of ``Interleaved`` leaves (the loop's blocks), and
  ``top``, the last ``Rows.top`` blocks' carries, one tree each."""
  parts: Any
  top: tuple[Any, ...]


def forward_interleaved(block, stack, carry, consts, offload: bool = False
                        ) -> tuple[Any, SavedInputs]:
  """``forward_stack`` for a stack with ``Interleaved`` leaves: each loop
  iteration runs ``PERIOD`` blocks, so each fetch reads a part known when the
  program is built; the carries come back as ``SavedInputs``."""
  leaves, treedef = jax.tree.flatten(stack, is_leaf=is_interleaved)
  rows = Rows.of(num_blocks(stack))
  # the first fetch waits for the carry (else XLA may fetch at the start)
  carry, gate = lax.optimization_barrier((carry, jnp.zeros((), jnp.int32)))

  def run(c, staged, at, ahead_at):
    params = treedef.unflatten(block_of(leaves, staged, at))
    ahead = fetch(leaves, ahead_at) if ahead_at is not None else staged
    # one block at a time, as across a loop's iterations (no fetch early)
    out, ahead = lax.optimization_barrier((block(params, c, consts), ahead))
    return out, ahead, placement.to_host(c) if offload else c

  def body(loop, q):
    c, staged = loop
    saved = []
    for r in range(PERIOD):
      c, staged, s = run(c, staged, (r, q), up((r, q)))
      saved.append(s)
    return (c, staged), tuple(saved)

  staged = fetch(leaves, (0, gate))
  parts = ()
  if rows.loops:  # (else a part may have no rows to trace a read of)
    (carry, staged), parts = lax.scan(body, (carry, staged),
                                      jnp.arange(rows.loops))
  top = []
  for r in range(rows.top):  # the stack's last block fetches none ahead
    carry, staged, s = run(carry, staged, (r, rows.loops + gate),
                           None if r == rows.top - 1
                           else up((r, rows.loops + gate)))
    top.append(s)
  if parts:
    parts = jax.tree.map(lambda *p: Interleaved(p), *parts)
  return carry, SavedInputs(parts, tuple(top))

"""Two host buffers for one streamed leaf: the values, and a spare.

``optax_kahan.blockwise``'s streamed layout (``stream_blocks``) holds a
``DoubleBuffer`` where a leaf is streamed; ``front_buffers`` reads the
values as plain arrays.
"""

from __future__ import annotations

from typing import Any

import jax


@jax.tree_util.register_pytree_node_class
class DoubleBuffer:
  """Two host buffers for one stacked leaf: the values, and a spare.

  ``blockwise_step`` reads a block's values from ``front`` and writes its new
  values into ``back``; the new pair has them the other way round. A fetch
  and a write-back then never touch the same array, so XLA runs both PCIe
  directions beside the compute, each block's copies starting as its
  iteration starts; with one buffer, a leaf's fetch must wait for its
  write-back. The cost is a second copy in host memory of what is streamed.

  The arrays keep their places in the tree (``a`` is always the first
  child), so a donated step writes into the spare in place and passes the
  read buffer through; which one holds the values is static (``front_is_a``),
  so a jitted step compiles once for each of the two.

  Attributes:
    a, b: the two buffers, of one shape, dtype and sharding.
    front_is_a: whether ``a`` holds the values.
  """

  def __init__(self, a: Any, b: Any, front_is_a: bool = True):
    self.a, self.b, self.front_is_a = a, b, front_is_a

  @property
  def front(self) -> Any:
    """The buffer that holds the values."""
    return self.a if self.front_is_a else self.b

  @property
  def back(self) -> Any:
    """The spare, into which a step writes the new values."""
    return self.b if self.front_is_a else self.a

  def flip(self, new: Any) -> "DoubleBuffer":
    """The pair after a step that wrote ``new`` into the back buffer."""
    if self.front_is_a:
      return DoubleBuffer(self.a, new, False)
    return DoubleBuffer(new, self.b, True)

  def tree_flatten(self) -> tuple[tuple[Any, Any], bool]:
    return (self.a, self.b), self.front_is_a

  @classmethod
  def tree_unflatten(cls, front_is_a: bool, children: Any) -> "DoubleBuffer":
    return cls(*children, front_is_a)

  def __repr__(self) -> str:
    return (f"DoubleBuffer(a={self.a!r}, b={self.b!r}, "
            f"front_is_a={self.front_is_a})")


def is_double(x: Any) -> bool:
  return isinstance(x, DoubleBuffer)


def front_buffers(tree: Any) -> Any:
  """``tree`` with each ``DoubleBuffer`` replaced by the buffer that holds
  its values (``stream_blocks(..., spare_buffers=True)``' layout read as
  plain arrays): for checkpoints, metrics, ``join_stacks``."""
  return jax.tree.map(lambda x: x.front if is_double(x) else x, tree,
                      is_leaf=is_double)


def check_not_doubled(tree: Any, what: str, arg: str) -> None:
  """Raises ValueError, naming the argument, the leaf and ``front_buffers``,
  where ``tree`` holds a ``DoubleBuffer``: ``what`` takes plain arrays."""
  for path, x in jax.tree_util.tree_flatten_with_path(
      tree, is_leaf=is_double)[0]:
    if is_double(x):
      raise ValueError(
          f"{what}: {arg} leaf {jax.tree_util.keystr(path)} is a "
          "DoubleBuffer (a streamed layout from stream_blocks), whose spare "
          f"half means nothing; pass ok.blockwise.front_buffers({arg})")

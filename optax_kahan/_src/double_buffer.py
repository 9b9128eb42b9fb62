"""Two host buffers for one streamed leaf (``stream_blocks``)."""

from typing import Any

import jax

from optax_kahan._src.interleaved import is_interleaved


@jax.tree_util.register_pytree_node_class
class DoubleBuffer:
  """Two host buffers for one stacked leaf: the values, and a spare.

  ``blockwise_step`` reads a block from ``front`` and writes into ``back``, so
  a fetch never waits for a write-back (cost: a second host copy). ``a`` stays
  the first child, so a donated step writes the spare in place; ``front_is_a``
  is static, so a jitted step compiles once per role.

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
  """``tree`` with each ``DoubleBuffer`` replaced by its ``front`` buffer."""
  return jax.tree.map(lambda x: x.front if is_double(x) else x, tree,
                      is_leaf=is_double)


def check_plain_leaves(tree: Any, what: str, arg: str,
                      instead: str = "") -> None:
  """Refuses a ``DoubleBuffer`` or ``Interleaved`` leaf in ``tree``: ``what``
  takes plain arrays."""
  is_layout = lambda x: is_double(x) or is_interleaved(x)
  for path, x in jax.tree_util.tree_flatten_with_path(
      tree, is_leaf=is_layout)[0]:
    if is_double(x):
      raise ValueError(
          f"{what}: {arg} leaf {jax.tree_util.keystr(path)} is a "
          "DoubleBuffer (a streamed layout from stream_blocks), whose spare "
          "half means nothing here; "
          + (instead or f"pass ok.blockwise.front_buffers({arg})"))
    if is_interleaved(x):
      raise ValueError(
          f"{what}: {arg} leaf {jax.tree_util.keystr(path)} is Interleaved "
          "(a streamed layout from stream_blocks(..., interleave=True)), its "
          "blocks dealt into three arrays; "
          + (instead or "join the stacks first (ok.blockwise.join_stacks)"))

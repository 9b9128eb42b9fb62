"""A streamed leaf split three ways by block index (``stream_blocks``)."""

import math
from typing import Any

import jax
import jax.numpy as jnp

#: Blocks ``i - 1``, ``i`` and ``i + 1`` lie in different parts.
PERIOD = 3


@jax.tree_util.register_pytree_node_class
class Interleaved:
  """One stacked host leaf as three arrays: block ``b`` is row ``b // 3`` of
  ``parts[b % 3]``.

  While block ``i`` computes, ``blockwise_step`` writes block ``i + 1`` back
  and fetches block ``i - 1``. In one host array the fetch reads what the
  write-back wrote, so XLA orders them: one PCIe direction waits for the
  other. Blocks ``i - 1``, ``i`` and ``i + 1`` lie in three parts, so the
  two copies are independent, as with a ``DoubleBuffer``, in one host copy
  instead of two: a fetch depends only on the write-back one block earlier.

  Attributes:
    parts: three arrays (or ``jax.ShapeDtypeStruct``) of one dtype and
      sharding, ``parts[r]`` holding blocks ``r, r + 3, r + 6, ...``.
  """

  def __init__(self, parts: Any):
    self.parts = tuple(parts)

  @property
  def num_blocks(self) -> int:
    return sum(jnp.shape(p)[0] for p in self.parts)

  @property
  def dtype(self) -> Any:
    return self.parts[0].dtype

  @property
  def block_shape(self) -> tuple[int, ...]:
    """One block's shape."""
    return tuple(jnp.shape(self.parts[0])[1:])

  def tree_flatten(self) -> tuple[tuple[Any, ...], None]:
    return self.parts, None

  @classmethod
  def tree_unflatten(cls, aux: None, parts: Any) -> "Interleaved":
    del aux
    return cls(parts)

  def __repr__(self) -> str:
    return f"Interleaved(parts={self.parts!r})"


def is_interleaved(x: Any) -> bool:
  return isinstance(x, Interleaved)


def interleave(x: Any) -> Interleaved:
  """``x``'s blocks (its leading axis) dealt into ``PERIOD`` parts."""
  if isinstance(x, jax.ShapeDtypeStruct):
    n = x.shape[0]
    return Interleaved(
        jax.ShapeDtypeStruct((math.ceil((n - r) / PERIOD), *x.shape[1:]),
                             x.dtype, sharding=x.sharding)
        for r in range(PERIOD))
  return Interleaved(x[r::PERIOD] for r in range(PERIOD))


def deinterleave(x: Interleaved) -> jax.Array:
  """The stacked leaf, blocks in order (where the parts are)."""
  n = x.num_blocks
  out = jnp.zeros((n, *x.block_shape), x.parts[0].dtype)
  for r, part in enumerate(x.parts):
    out = out.at[r::PERIOD].set(part)
  return out

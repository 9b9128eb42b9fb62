"""A model as blocks: functions, weights, state. See docs/guides/flux.md."""

from typing import Any, Callable, NamedTuple, Optional

import jax
import jax.numpy as jnp
import optax

from optax_kahan._src.interleaved import is_interleaved

Carry = Any
Consts = Any
Batch = Any


class ContinueStack:
  """The identity transition between a stack's parts (``stream_blocks``)."""

  def __call__(self, carry: Carry, consts: Consts) -> Carry:
    del consts
    return carry

  def __repr__(self) -> str:
    return "continue_stack"


continue_stack = ContinueStack()


class BlockwiseModel(NamedTuple):
  """A model as embed -> scan over stacked blocks -> head, as pure functions.

  Attributes:
    embed: ``embed(embed_params, batch) -> (carry, consts)``; ``consts`` are
      read by every block and changed by none.
    blocks: per stack, ``block(block_params, carry, consts) -> carry`` on
      one block's slice; the carry keeps its structure, shapes and dtypes.
    head: ``head(head_params, carry, consts, batch) -> loss``, a scalar.
    transitions: none, or per pair of consecutive stacks a weightless
      ``transition(carry, consts) -> carry`` (or None: nothing runs);
      ``continue_stack`` joins the parts of a split stack.
  """
  embed: Callable[[Any, Batch], tuple[Carry, Consts]]
  blocks: tuple[Callable[[Any, Carry, Consts], Carry], ...]
  head: Callable[[Any, Carry, Consts, Batch], jax.Array]
  transitions: tuple[Callable[[Carry, Consts], Carry], ...] = ()

  def transition(self, s: int) -> Optional[Callable[[Carry, Consts], Carry]]:
    """What runs after stack ``s``, or None (nothing)."""
    if not self.transitions or s == len(self.blocks) - 1:
      return None
    return self.transitions[s]

  def joins(self, s: int) -> bool:
    """Whether stacks ``s`` and ``s + 1`` are parts of one stack."""
    return isinstance(self.transition(s), ContinueStack)


class BlockwiseParams(NamedTuple):
  """The weights: ``stacks[s]`` has a leading axis of one entry per block."""
  embed: Any
  stacks: tuple[Any, ...]
  head: Any


class BlockwiseState(NamedTuple):
  """``tx``'s state per group; each stack's is its blocks' states stacked."""
  embed: optax.OptState
  stacks: tuple[optax.OptState, ...]
  head: optax.OptState


def check_params(model: BlockwiseModel, params: BlockwiseParams) -> None:
  check_stacks(params)
  if len(params.stacks) != len(model.blocks):
    raise ValueError(f"the model has {len(model.blocks)} block functions but "
                     f"params.stacks has {len(params.stacks)} stacks")
  if model.transitions and len(model.transitions) != len(model.blocks) - 1:
    raise ValueError(f"the model has {len(model.transitions)} transitions "
                     f"for {len(model.blocks)} stacks; give one per pair of "
                     "consecutive stacks, or none")


def check_stacks(params: Any) -> None:
  """Refuses all but ``BlockwiseParams`` of stacked, undonated leaves."""
  if not isinstance(params, BlockwiseParams):
    raise TypeError(f"params must be a BlockwiseParams, got "
                    f"{type(params).__name__}")
  for path, x in jax.tree_util.tree_flatten_with_path(params)[0]:
    if (isinstance(x, jax.Array) and not isinstance(x, jax.core.Tracer)
        and x.is_deleted()):
      raise ValueError(
          f"params{jax.tree_util.keystr(path)} was donated to an earlier "
          "jitted call (its buffer is deleted): pass the arrays that call "
          "returned")
  for s, stack in enumerate(params.stacks):
    if isinstance(stack, (list, tuple)):
      raise TypeError(
          f"params.stacks[{s}] is a {type(stack).__name__} of "
          f"{len(stack)} entries; a stack is one tree whose leaves carry the "
          "blocks on a leading axis: jax.tree.map(lambda *b: jnp.stack(b), "
          "*blocks)")
    flat = jax.tree_util.tree_flatten_with_path(stack,
                                                is_leaf=is_interleaved)[0]
    if not flat:
      raise ValueError(f"params.stacks[{s}] has no arrays")
    first_path, first = flat[0][0], stacked_shape(flat[0][1])
    for path, x in flat:
      shape = stacked_shape(x)
      if not shape or not first or shape[0] != first[0]:
        raise ValueError(
            f"params.stacks[{s}]: every leaf needs the same leading (block) "
            f"axis; leaf {jax.tree_util.keystr(path)} has shape "
            f"{list(shape)}, the first leaf "
            f"{jax.tree_util.keystr(first_path)} {list(first)}")


def stacked_shape(x: Any) -> tuple[int, ...]:
  """A stacked leaf's shape, blocks first (an ``Interleaved`` one's too)."""
  if is_interleaved(x):
    return (x.num_blocks, *x.block_shape)
  return tuple(jnp.shape(x))


def num_blocks(stack: Any) -> int:
  """The number of blocks in a stack (its leaves' leading axis)."""
  leaves = jax.tree.leaves(stack, is_leaf=is_interleaved)
  if not leaves or not stacked_shape(leaves[0]):
    raise ValueError(
        f"num_blocks: a stack is a tree whose leaves have a leading block "
        f"axis; got {'no leaves' if not leaves else 'a scalar leaf'}")
  return stacked_shape(leaves[0])[0]


"""``kahan_residuals`` of a ``BlockwiseState``, registered with ``kahan``."""

from optax_kahan._src import kahan
from optax_kahan._src.blockwise.model import BlockwiseParams
from optax_kahan._src.blockwise.model import BlockwiseState


def residuals_of(state: BlockwiseState) -> BlockwiseParams:
  """Each group's residuals (the stacks' with their block axis)."""
  return BlockwiseParams(
      kahan.kahan_residuals(state.embed),
      tuple(kahan.kahan_residuals(s) for s in state.stacks),
      kahan.kahan_residuals(state.head))


def with_residuals(state: BlockwiseState,
                    residuals: BlockwiseParams) -> BlockwiseState:
  """``kahan_replace_residuals``, group by group."""
  if (not isinstance(residuals, BlockwiseParams)
      or len(residuals.stacks) != len(state.stacks)):
    raise ValueError(
        "the residuals of a BlockwiseState are a BlockwiseParams with "
        f"{len(state.stacks)} stacks (as kahan_residuals gives), got "
        f"{type(residuals).__name__}")
  return BlockwiseState(
      kahan.kahan_replace_residuals(state.embed, residuals.embed),
      tuple(kahan.kahan_replace_residuals(s, r)
            for s, r in zip(state.stacks, residuals.stacks)),
      kahan.kahan_replace_residuals(state.head, residuals.head))


kahan.register_grouped_state(BlockwiseState, residuals_of, with_residuals)

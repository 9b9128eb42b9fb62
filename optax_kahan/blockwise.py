"""Models as blocks: the blockwise step, streaming, and stacked blocks.

``blockwise_step`` updates each block inside the backward pass,
``stream_blocks`` keeps blocks in host memory, ``plan`` chooses which for
a card from compiled candidates, ``per_block`` maps a
transformation over stacked blocks. See docs/guides/flux.md.
"""

from optax_kahan._src.blockwise.step import blockwise_init
from optax_kahan._src.blockwise.step import blockwise_loss
from optax_kahan._src.blockwise.step import blockwise_step
from optax_kahan._src.blockwise.model import BlockwiseModel
from optax_kahan._src.blockwise.model import BlockwiseParams
from optax_kahan._src.blockwise.model import BlockwiseState
from optax_kahan._src.blockwise.model import continue_stack
from optax_kahan._src.double_buffer import DoubleBuffer
from optax_kahan._src.double_buffer import front_buffers
from optax_kahan._src.interleaved import Interleaved
from optax_kahan._src.blockwise.streaming import join_stacks
from optax_kahan._src.blockwise.flax_adapters import linen_apply
from optax_kahan._src.blockwise.flax_adapters import nnx_blockwise
from optax_kahan._src.blockwise.plan import Layout
from optax_kahan._src.blockwise.plan import NoLayoutFits
from optax_kahan._src.blockwise.plan import Plan
from optax_kahan._src.blockwise.plan import plan
from optax_kahan._src.blockwise.model import num_blocks
from optax_kahan._src.blockwise.streaming import stream_blocks
from optax_kahan._src.blockwise.streaming import STREAMING_COMPILER_OPTIONS
from optax_kahan._src.blockwise.streaming import with_front_buffers
from optax_kahan._src.per_block import block_axes_of
from optax_kahan._src.per_block import per_block

__all__ = (
    "BlockwiseModel", "BlockwiseParams", "BlockwiseState", "DoubleBuffer",
    "STREAMING_COMPILER_OPTIONS", "block_axes_of", "blockwise_init",
    "blockwise_loss", "blockwise_step", "continue_stack", "front_buffers",
    "Interleaved", "Layout", "NoLayoutFits", "Plan", "join_stacks", "linen_apply", "nnx_blockwise",
    "num_blocks", "per_block", "plan",
    "stream_blocks", "with_front_buffers",
)

"""optax_kahan: bfloat16 weights with float32-exact updates, for optax."""

from optax_kahan._src.alias import prodigy
from optax_kahan._src.alias import prodigy_factored
from optax_kahan._src.alias import stable_adamw
from optax_kahan._src.bias_corrected_clip import clip_by_bias_corrected_rms
from optax_kahan._src.bias_corrected_clip import ClipByBiasCorrectedRmsState
from optax_kahan._src.bits import merge_float32
from optax_kahan._src.bits import split_float32
from optax_kahan._src.blockwise import blockwise_init
from optax_kahan._src.blockwise import blockwise_loss
from optax_kahan._src.blockwise import blockwise_step
from optax_kahan._src.blockwise import continue_stack
from optax_kahan._src.blockwise import DoubleBuffer
from optax_kahan._src.blockwise import front_buffers
from optax_kahan._src.blockwise import with_front_buffers
from optax_kahan._src.blockwise import join_stacks
from optax_kahan._src.blockwise import BlockwiseModel
from optax_kahan._src.blockwise import BlockwiseParams
from optax_kahan._src.blockwise import BlockwiseState
from optax_kahan._src.blockwise import linen_apply
from optax_kahan._src.blockwise import nnx_blockwise
from optax_kahan._src.blockwise import num_blocks
from optax_kahan._src.blockwise import stream_blocks
from optax_kahan._src.blockwise import STREAMING_COMPILER_OPTIONS
from optax_kahan._src.coupled import apply_if_finite
from optax_kahan._src.coupled import clip_by_global_norm
from optax_kahan._src.factored_second_moment import scale_by_factored_second_moment
from optax_kahan._src.factored_second_moment import ScaleByFactoredSecondMomentState
from optax_kahan._src.kahan import kahan
from optax_kahan._src.kahan import kahan_apply_updates
from optax_kahan._src.kahan import kahan_from_float32
from optax_kahan._src.kahan import kahan_init
from optax_kahan._src.kahan import kahan_replace_residuals
from optax_kahan._src.kahan import kahan_residuals
from optax_kahan._src.kahan import kahan_to_float32
from optax_kahan._src.kahan import KahanState
from optax_kahan._src.per_block import block_axes_of
from optax_kahan._src.per_block import per_block
from optax_kahan._src.leafwise import chain
from optax_kahan._src.per_leaf import for_each_leaf
from optax_kahan._src.per_leaf import LateSums
from optax_kahan._src.per_leaf import LeafStages
from optax_kahan._src.leafwise import leafwise
from optax_kahan._src.per_leaf import Round
from optax_kahan._src.traced import stages_of
from optax_kahan._src.per_leaf import transformation as per_leaf_transformation
from optax_kahan._src.prodigy import prodigy_d
from optax_kahan._src.prodigy import scale_by_prodigy
from optax_kahan._src.prodigy import ScaleByProdigyState
from optax_kahan._src.second_moment import scale_by_second_moment
from optax_kahan._src.second_moment import ScaleBySecondMomentState
from optax_kahan._src.stable_adamw import scale_by_stable_adamw
from optax_kahan._src.stable_adamw import ScaleByStableAdamWState
from optax_kahan._src.stochastic_rounding import stochastic_round
from optax_kahan._src.stochastic_rounding import stochastic_round_apply_updates
from optax_kahan._src.stochastic_rounding import stochastic_rounding
from optax_kahan._src.stochastic_rounding import StochasticRoundingState
from optax_kahan._src.train_state import kahan_train_state
from optax_kahan._src.validation import OptaxKahanWarning

__version__ = "0.1.0"

__all__ = (
    "BlockwiseModel",
    "BlockwiseParams",
    "BlockwiseState",
    "ClipByBiasCorrectedRmsState",
    "KahanState",
    "LateSums",
    "LeafStages",
    "OptaxKahanWarning",
    "Round",
    "ScaleByFactoredSecondMomentState",
    "ScaleByProdigyState",
    "ScaleBySecondMomentState",
    "ScaleByStableAdamWState",
    "StochasticRoundingState",
    "STREAMING_COMPILER_OPTIONS",
    "apply_if_finite",
    "block_axes_of",
    "blockwise_init",
    "blockwise_loss",
    "blockwise_step",
    "chain",
    "clip_by_bias_corrected_rms",
    "clip_by_global_norm",
    "continue_stack",
    "DoubleBuffer",
    "front_buffers",
    "with_front_buffers",
    "for_each_leaf",
    "join_stacks",
    "kahan",
    "kahan_apply_updates",
    "kahan_from_float32",
    "kahan_init",
    "kahan_replace_residuals",
    "kahan_residuals",
    "kahan_to_float32",
    "kahan_train_state",
    "leafwise",
    "linen_apply",
    "merge_float32",
    "nnx_blockwise",
    "num_blocks",
    "per_block",
    "per_leaf_transformation",
    "prodigy",
    "prodigy_d",
    "prodigy_factored",
    "scale_by_factored_second_moment",
    "scale_by_prodigy",
    "scale_by_second_moment",
    "scale_by_stable_adamw",
    "split_float32",
    "stages_of",
    "stochastic_round",
    "stochastic_round_apply_updates",
    "stochastic_rounding",
    "stream_blocks",
    "stable_adamw",
)

"""optax_kahan: bfloat16 weights with float32-exact updates, for optax."""

from optax_kahan.alias import prodigy
from optax_kahan.alias import prodigy_factored
from optax_kahan.alias import stable_adamw
from optax_kahan.bits import merge_float32
from optax_kahan.blockwise import blockwise_init
from optax_kahan.blockwise import blockwise_loss
from optax_kahan.blockwise import blockwise_step
from optax_kahan.blockwise import BlockwiseModel
from optax_kahan.blockwise import BlockwiseParams
from optax_kahan.blockwise import BlockwiseState
from optax_kahan.blockwise import nnx_blockwise
from optax_kahan.bits import split_float32
from optax_kahan.kahan import kahan
from optax_kahan.kahan import kahan_apply_updates
from optax_kahan.kahan import kahan_from_float32
from optax_kahan.kahan import kahan_init
from optax_kahan.kahan import kahan_replace_residuals
from optax_kahan.kahan import kahan_residuals
from optax_kahan.kahan import kahan_to_float32
from optax_kahan.kahan import KahanState
from optax_kahan.factored_second_moment import scale_by_factored_second_moment
from optax_kahan.factored_second_moment import ScaleByFactoredSecondMomentState
from optax_kahan.leafwise import for_each_leaf
from optax_kahan.leafwise import leafwise
from optax_kahan.leafwise import LeafwisePlan
from optax_kahan.leafwise import LeafwiseTransformation
from optax_kahan.prodigy import prodigy_d
from optax_kahan.prodigy import scale_by_prodigy
from optax_kahan.prodigy import ScaleByProdigyState
from optax_kahan.second_moment import scale_by_second_moment
from optax_kahan.second_moment import ScaleBySecondMomentState
from optax_kahan.staging import stage_by_leaf
from optax_kahan.stable_adamw import scale_by_stable_adamw
from optax_kahan.stable_adamw import ScaleByStableAdamWState
from optax_kahan.stochastic_rounding import stochastic_round
from optax_kahan.stochastic_rounding import stochastic_round_apply_updates
from optax_kahan.stochastic_rounding import stochastic_rounding
from optax_kahan.stochastic_rounding import StochasticRoundingState
from optax_kahan.train_state import kahan_train_state

__version__ = "0.1.0"

__all__ = (
    "BlockwiseModel",
    "BlockwiseParams",
    "BlockwiseState",
    "KahanState",
    "LeafwisePlan",
    "LeafwiseTransformation",
    "ScaleByFactoredSecondMomentState",
    "ScaleByProdigyState",
    "ScaleBySecondMomentState",
    "ScaleByStableAdamWState",
    "StochasticRoundingState",
    "blockwise_init",
    "blockwise_loss",
    "blockwise_step",
    "for_each_leaf",
    "kahan",
    "kahan_apply_updates",
    "kahan_from_float32",
    "kahan_init",
    "kahan_replace_residuals",
    "kahan_residuals",
    "kahan_to_float32",
    "kahan_train_state",
    "leafwise",
    "merge_float32",
    "nnx_blockwise",
    "prodigy",
    "prodigy_d",
    "prodigy_factored",
    "scale_by_factored_second_moment",
    "scale_by_prodigy",
    "scale_by_second_moment",
    "scale_by_stable_adamw",
    "split_float32",
    "stage_by_leaf",
    "stochastic_round",
    "stochastic_round_apply_updates",
    "stochastic_rounding",
    "stable_adamw",
)

"""optax_kahan: bfloat16 weights with float32-exact updates, for optax."""

from optax_kahan._src.alias import prodigy
from optax_kahan._src.alias import prodigy_factored
from optax_kahan._src.alias import stable_adamw
from optax_kahan._src.bias_corrected_clip import clip_by_bias_corrected_rms
from optax_kahan._src.bias_corrected_clip import ClipByBiasCorrectedRmsState
from optax_kahan._src.bits import merge_float32
from optax_kahan._src.bits import split_float32
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
from optax_kahan._src.known_answer import known_answer_check
from optax_kahan._src.leafwise import leafwise
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
from optax_kahan._src.nnx_optimizer import kahan_nnx_optimizer
from optax_kahan._src.train_state import kahan_train_state
from optax_kahan._src.validation import OptaxKahanWarning
from optax_kahan import blockwise as blockwise
from optax_kahan import per_leaf as per_leaf
__version__ = "0.1.0"

__all__ = (
    "ClipByBiasCorrectedRmsState",
    "KahanState",
    "OptaxKahanWarning",
    "ScaleByFactoredSecondMomentState",
    "ScaleByProdigyState",
    "ScaleBySecondMomentState",
    "ScaleByStableAdamWState",
    "StochasticRoundingState",
    "clip_by_bias_corrected_rms",
    "kahan",
    "kahan_apply_updates",
    "kahan_from_float32",
    "kahan_init",
    "kahan_replace_residuals",
    "kahan_residuals",
    "kahan_to_float32",
    "kahan_nnx_optimizer",
    "kahan_train_state",
    "known_answer_check",
    "leafwise",
    "merge_float32",
    "prodigy",
    "prodigy_d",
    "prodigy_factored",
    "scale_by_factored_second_moment",
    "scale_by_prodigy",
    "scale_by_second_moment",
    "scale_by_stable_adamw",
    "split_float32",
    "stochastic_round",
    "stochastic_round_apply_updates",
    "stochastic_rounding",
    "stable_adamw",
)

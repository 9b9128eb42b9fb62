"""The per-leaf contract, for authors of transformations.

A step in three stages (per-leaf statistic, one small sum, per-leaf update)
runs leaf by leaf under ``kahan`` and ``leafwise``. ``stages_of`` cuts them
from any optax program; ``transformation`` declares them, and ``chain`` keeps
them through a chain. See docs/guides/per_leaf.md.
"""

from optax_kahan._src.coupled import apply_if_finite
from optax_kahan._src.coupled import clip_by_global_norm
from optax_kahan._src.leafwise import chain
from optax_kahan._src.per_leaf import for_each_leaf
from optax_kahan._src.per_leaf import LateSums
from optax_kahan._src.per_leaf import LeafStages
from optax_kahan._src.per_leaf import Round
from optax_kahan._src.per_leaf import transformation
from optax_kahan._src.traced import stages_of

__all__ = (
    "LateSums", "LeafStages", "Round", "apply_if_finite", "chain",
    "clip_by_global_norm", "for_each_leaf", "stages_of", "transformation",
)

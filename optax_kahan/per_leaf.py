"""The per-leaf contract, for authors of transformations.

A step written as three stages (per-leaf statistic, one small sum, per-leaf
update) runs leaf by leaf under ``optax_kahan.kahan`` and
``optax_kahan.leafwise``. Any optax transformation gets its stages cut from
its own program (``stages_of``); ``transformation`` declares them instead,
``chain`` keeps declared stages through a chain, and ``clip_by_global_norm``
and ``apply_if_finite`` are optax's with declared stages.

See the guide "Per-leaf steps" for the contract and an example.
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
    "LateSums",
    "LeafStages",
    "Round",
    "apply_if_finite",
    "chain",
    "clip_by_global_norm",
    "for_each_leaf",
    "stages_of",
    "transformation",
)

"""FLUX.1-dev's flow transformer (an MMDiT) in Flax NNX, for blockwise training.

``Flux(FluxConfig.dev(), ...)`` has FLUX.1-dev's real dimensions (11.9B
params); ``flux_blockwise`` splits it into ``embed``, the double- and
single-stream stacks and ``head`` for ``optax_kahan.blockwise``;
``abstract_model``, ``abstract_params`` and ``batch_spec`` give its shapes without allocating
(what ``python -m optax_kahan.plan --model flux-dev`` compiles). No weights
are loaded or downloaded. See docs/guides/flux.md.
"""

from optax_kahan._src.flux import abstract_model
from optax_kahan._src.flux import abstract_params
from optax_kahan._src.flux import batch_spec
from optax_kahan._src.flux import Carry
from optax_kahan._src.flux import Consts
from optax_kahan._src.flux import Flux
from optax_kahan._src.flux import flux_blockwise
from optax_kahan._src.flux import FluxConfig
from optax_kahan._src.flux import num_params
from optax_kahan._src.flux import random_batch
from optax_kahan._src.flux import to_dtype

__all__ = (
    "Carry", "Consts", "Flux", "FluxConfig", "abstract_model", "abstract_params",
    "batch_spec",
    "flux_blockwise", "num_params", "random_batch", "to_dtype",
)

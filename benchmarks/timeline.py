"""The timeline model of a compiled GPU program, as the benchmarks name it.

It lives in the library (``optax_kahan._src.timeline``), where
``ok.blockwise.plan`` ranks streamed layouts by it; see its docstring.
"""

from optax_kahan._src.timeline import GEMM_FLOPS
from optax_kahan._src.timeline import PCIE
from optax_kahan._src.timeline import Timeline
from optax_kahan._src.timeline import model
from optax_kahan._src.timeline import parse

__all__ = ("GEMM_FLOPS", "PCIE", "Timeline", "model", "parse")

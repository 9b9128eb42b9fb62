"""The blockwise step and streaming (public names: ``optax_kahan.blockwise``).

Modules: ``model``, ``step``, ``pipeline``, ``streaming``, ``late_sums``,
``residuals`` and ``flax_adapters``; each docstring says what it holds.
"""

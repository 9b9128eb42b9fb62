"""The blockwise step and streaming (public names: ``optax_kahan.blockwise``).

``model``: the model's functions, weights and state; ``step``: the step that
updates each block inside the backward pass; ``pipeline``: host leaves
fetched a block ahead and written back a block behind; ``streaming``: blocks
kept in host memory and their spare buffers; ``late_sums``: sums over all
groups for transformations that reduce late; ``residuals``: ``kahan``'s
residual helpers on a blockwise state; ``flax_adapters``: Flax models as
blockwise models.
"""

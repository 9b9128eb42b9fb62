"""Adafactor's factored second moment, in the rescaled form Prodigy drives.

Unlike optax's ``scale_by_factored_rms`` (the two largest axes, if the second
has >= 128 entries; decay ``1 - t^-0.8``) it factors the last two axes
(Flax's ``(..., in, out)``) and ``b2`` is a constant or a schedule. ``eps2``
is never scaled by ``d^2``: such a floor underflowed in bf16, giving
``0/0 = NaN`` on all-zero gradients (Stable Cascade, prodigyopt discussion).

References:
  Shazeer & Stern, "Adafactor: Adaptive Learning Rates with Sublinear Memory
  Cost", ICML 2018 (arXiv:1804.04235); prodigyopt PR #20.
"""

import functools
from typing import Callable, NamedTuple, Optional, Union

import chex
import jax
import jax.numpy as jnp
import optax

from optax_kahan._src import validation
from optax_kahan._src.second_moment import first_moment
from optax_kahan._src.second_moment import rescale_moment


class ScaleByFactoredSecondMomentState(NamedTuple):
  """State of ``scale_by_factored_second_moment``; unused ``row``, ``col``,
  ``v`` leaves are one-element placeholders (``nnx.Optimizer`` drops None,
  orbax refuses empty arrays)."""
  count: chex.Array  # int32 scalar
  mu: Optional[optax.Updates]
  row: optax.Updates  # shape[:-1] per factored leaf
  col: optax.Updates  # shape[:-2] + shape[-1:] per factored leaf
  v: optax.Updates    # the full second moment of the other leaves


def scale_by_factored_second_moment(
    b1: float = 0.0,
    b2: Union[float, Callable[[chex.Array], chex.Array]] = 0.999,
    eps: float = 1e-8,
    eps2: float = 1e-30,
    *,
    min_dim_size_to_factor: int = 1,
    state_dtype: Optional[jnp.dtype] = None,
) -> optax.GradientTransformationExtraArgs:
  """Adafactor's factored second moment as a (Prodigy-rescalable) preconditioner.

  .. math::

    R_t = b_2 \\rho^2 R_{t-1} + (1-b_2)\\,\\mathrm{mean}_{-1}(g_t^2 + \\epsilon_2),
    \\quad C_t = b_2 \\rho^2 C_{t-1} + (1-b_2)\\,\\mathrm{mean}_{-2}(g_t^2 +
    \\epsilon_2), \\quad \\hat v_t = \\frac{R_t \\otimes C_t}{\\mathrm{mean}(R_t)},
    \\quad u_t = \\frac{m_t}{\\sqrt{\\hat v_t} + \\gamma\\epsilon}

  with ``m_t``, ``rho``, ``gamma`` as in ``scale_by_second_moment``.

  Args:
    b1: first-moment decay; 0 (the default) keeps no first moment.
    b2: second-moment decay, a float or a schedule ``count -> decay``.
    eps: added outside the root (may be 0 when ``eps2`` keeps ``v^ > 0``).
    eps2: added to ``g^2`` inside the moments; never scaled by ``d^2``.
    min_dim_size_to_factor: factor a leaf if its last two axes are this long.
    state_dtype: dtype of ``m`` and of unfactored leaves' ``v`` (e.g.
      ``jnp.bfloat16``); None follows the params. ``R`` and ``C`` keep the
      params' dtype: they are small and their smooth change would round away.

  Returns:
    An ``optax.GradientTransformationExtraArgs`` accepting the extra args
    ``d_ratio`` and ``d_growth`` (see ``scale_by_second_moment``).

  Example:
    >>> tx = optax.chain(scale_by_factored_second_moment(b2=lambda t: 1 - t**-0.8),
    ...                  optax.clip_by_block_rms(1.0),
    ...                  optax.scale_by_learning_rate(1e-3))

  References:
    Shazeer & Stern, 2018.
  """
  validation.check_beta("b1", b1)
  if not callable(b2):
    validation.check_beta("b2", b2)
  validation.check_positive("eps", eps, allow_zero=True)
  validation.check_positive("eps2", eps2, allow_zero=True)

  def init_fn(params):
    if validation.is_abstract(params):
      return jax.eval_shape(init_fn, params)
    validation.check_real("scale_by_factored_second_moment", params)
    use_mu = not validation.is_static_zero(b1)
    mu = (optax.tree.zeros_like(params, dtype=state_dtype) if use_mu
          else None)
    return ScaleByFactoredSecondMomentState(
        jnp.zeros([], jnp.int32), mu,
        jax.tree.map(lambda p: _init_mean(p, -1, min_dim_size_to_factor),
                     params),
        jax.tree.map(lambda p: _init_mean(p, -2, min_dim_size_to_factor),
                     params),
        jax.tree.map(lambda p: _init_v(p, min_dim_size_to_factor,
                                       state_dtype), params))

  def update_fn(updates, state, params=None, *, d_ratio=1.0, d_growth=1.0,
                **extra_args):
    del params, extra_args
    validation.check_state("scale_by_factored_second_moment", state,
                           ScaleByFactoredSecondMomentState)
    count = optax.safe_increment(state.count)
    decay = b2(count) if callable(b2) else b2
    scale = d_ratio**2

    leaves, treedef = jax.tree.flatten(updates)
    moment = functools.partial(_update_moment, decay=decay, scale=scale,
                               eps2=eps2, min_dim=min_dim_size_to_factor)
    moments = [moment(*leaf) for leaf in zip(
        leaves, *(treedef.flatten_up_to(t)
                  for t in (state.row, state.col, state.v)))]
    row, col, v, v_hat = (treedef.unflatten(list(part))
                          for part in zip(*moments))

    g32 = jax.tree.map(lambda g: g.astype(jnp.float32), updates)
    mu, num = first_moment(state.mu, g32, b1, d_ratio, d_growth)

    out = jax.tree.map(
        lambda g, m, v: (m.astype(jnp.float32) / (jnp.sqrt(v) + d_growth * eps)
                         ).astype(g.dtype), updates, num, v_hat)
    return out, ScaleByFactoredSecondMomentState(count, mu, row, col, v)

  return optax.GradientTransformationExtraArgs(init_fn, update_fn)


def _factored(p: jax.Array, min_dim: int) -> bool:
  return p.ndim >= 2 and min(p.shape[-2:]) >= min_dim


def _init_mean(p: jax.Array, axis: int, min_dim: int) -> jax.Array:
  """Zeros like ``p``'s mean over ``axis`` (its sharding), or a placeholder."""
  if not _factored(p, min_dim):
    return jnp.zeros((1,), p.dtype)
  return jnp.zeros_like(jnp.mean(p, axis=axis), dtype=p.dtype)


def _init_v(p: jax.Array, min_dim: int, state_dtype) -> jax.Array:
  """The full second moment of an unfactored leaf, or a placeholder."""
  if _factored(p, min_dim):
    return jnp.zeros((1,), p.dtype)
  return jnp.zeros_like(p, dtype=state_dtype)


def _update_moment(g, row, col, v, *, decay, scale, eps2, min_dim):
  """One leaf's new ``(row, col, v)`` and its float32 ``v^``."""
  g2 = jnp.square(g.astype(jnp.float32)) + eps2
  if not _factored(g, min_dim):
    v = rescale_moment(v, decay, scale, g2)
    return row, col, v, v.astype(jnp.float32)
  row = rescale_moment(row, decay, scale, jnp.mean(g2, axis=-1))
  col = rescale_moment(col, decay, scale, jnp.mean(g2, axis=-2))
  r32 = row.astype(jnp.float32)
  row_factor = r32 / jnp.mean(r32, axis=-1, keepdims=True)
  v_hat = row_factor[..., :, None] * col.astype(jnp.float32)[..., None, :]
  return row, col, v, v_hat

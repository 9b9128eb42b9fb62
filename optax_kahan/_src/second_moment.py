"""Adam's preconditioner in the rescaled form that Prodigy's d-estimator drives.

prodigyopt keeps moments of ``d_k g`` and steps
``d_k lr m / (sqrt(v) + d_{k+1} eps)``. Divided by ``d_k`` (``d_k^2`` for
``v``) they are moments of ``g`` whose old values are rescaled by
``d_ratio = d_{k-1} / d_k`` (squared for ``v``); ``d_growth = d_{k+1} / d_k``
scales ``eps`` and, with ``b1 = 0``, the numerator (prodigyopt's ``d_{k+1} g``).

References:
  Kingma & Ba, "Adam: A Method for Stochastic Optimization", ICLR 2015;
  Mishchenko & Defazio, "Prodigy", ICML 2024 (arXiv:2306.06101).
"""

from typing import NamedTuple, Optional

import chex
import jax
import jax.numpy as jnp
import optax

from optax_kahan._src import validation


class ScaleBySecondMomentState(NamedTuple):
  """State of ``scale_by_second_moment``; ``mu`` is None when ``b1 == 0``."""
  count: chex.Array  # int32 scalar
  mu: Optional[optax.Updates]
  nu: optax.Updates


def rescale_moment(moment: jax.Array, decay: chex.Numeric, scale: chex.Numeric,
                   new_term: jax.Array) -> jax.Array:
  """``decay * scale * moment + (1 - decay) * new_term``, in moment's dtype."""
  decay = jnp.asarray(decay, jnp.float32)
  out = decay * scale * moment.astype(jnp.float32) + (1 - decay) * new_term
  return out.astype(moment.dtype)


def first_moment(mu: Optional[optax.Updates], g32: optax.Updates,
                 b1: chex.Numeric, d_ratio: chex.Numeric,
                 d_growth: chex.Numeric) -> tuple[Optional[optax.Updates],
                                                  optax.Updates]:
  """The new first moment (or None) and the numerator: ``m``, or
  ``d_growth * g`` where ``b1 == 0`` (also for a traced ``b1``)."""
  if mu is None:
    return None, jax.tree.map(lambda g: d_growth * g, g32)
  mu = jax.tree.map(lambda m, g: rescale_moment(m, b1, d_ratio, g), mu, g32)
  if isinstance(b1, (int, float)):
    return mu, mu
  num = jax.tree.map(
      lambda m, g: jnp.where(b1 == 0, d_growth * g, m.astype(jnp.float32)),
      mu, g32)
  return mu, num


def scale_by_second_moment(
    b1: float = 0.9,
    b2: float = 0.999,
    eps: float = 1e-8,
    *,
    bias_correction: bool = False,
    state_dtype: Optional[jnp.dtype] = None,
) -> optax.GradientTransformationExtraArgs:
  """Adam's preconditioner ``m / (sqrt(v) + eps)``, rescalable by Prodigy.

  .. math::

    m_t = b_1 \\rho m_{t-1} + (1-b_1) g_t, \\quad
    v_t = b_2 \\rho^2 v_{t-1} + (1-b_2) g_t^2, \\quad
    u_t = \\frac{\\hat m_t}{\\sqrt{\\hat v_t} + \\gamma \\epsilon}

  with ``rho = d_ratio`` and ``gamma = d_growth`` (extra args, default 1),
  ``hat`` the optional bias correction, and ``m_t = gamma g_t`` if ``b1 == 0``.

  Args:
    b1: first-moment decay; 0 disables the first moment and its buffer.
    b2: second-moment decay.
    eps: added to ``sqrt(v)`` (outside the root).
    bias_correction: divide the moments by ``1 - b^t`` (Prodigy passes False).
    state_dtype: dtype of ``m`` and ``v`` (e.g. ``jnp.bfloat16``, rounded to
      nearest from float32 arithmetic); None follows the params.

  Returns:
    An ``optax.GradientTransformationExtraArgs`` whose ``update`` takes the
    extra args ``d_ratio`` and ``d_growth`` and ignores others.

  Example:
    >>> tx = optax.chain(scale_by_second_moment(bias_correction=True),
    ...                  optax.scale_by_learning_rate(1e-3))  # optax.adam

  References:
    Kingma & Ba, 2015; Mishchenko & Defazio, 2024 (Prodigy).
  """
  validation.check_beta("b1", b1)
  validation.check_beta("b2", b2)

  def init_fn(params):
    validation.check_real("scale_by_second_moment", params)
    use_mu = not validation.is_static_zero(b1)
    zeros = lambda: optax.tree.zeros_like(params, dtype=state_dtype)
    return ScaleBySecondMomentState(
        jnp.zeros([], jnp.int32), zeros() if use_mu else None, zeros())

  def update_fn(updates, state, params=None, *, d_ratio=1.0, d_growth=1.0,
                **extra_args):
    del params, extra_args
    validation.check_state("scale_by_second_moment", state,
                           ScaleBySecondMomentState)
    count = optax.safe_increment(state.count)
    g32 = jax.tree.map(lambda g: g.astype(jnp.float32), updates)
    nu = jax.tree.map(lambda v, g: rescale_moment(v, b2, d_ratio**2, g * g),
                      state.nu, g32)
    mu, num = first_moment(state.mu, g32, b1, d_ratio, d_growth)
    # Reciprocals multiplied in, as XLA does only for a one-user scalar: keeps
    # whole-tree and leafwise runs bit-identical.
    r1, r2 = 1.0, 1.0
    if bias_correction:
      t = count.astype(jnp.float32)
      if mu is not None:
        r1 = 1 / (1 - jnp.asarray(b1, jnp.float32)**t)
      r2 = 1 / (1 - jnp.asarray(b2, jnp.float32)**t)

    def precondition(g, m, v):
      m = m.astype(jnp.float32) * r1
      v = v.astype(jnp.float32) * r2
      return (m / (jnp.sqrt(v) + d_growth * eps)).astype(g.dtype)

    out = jax.tree.map(precondition, updates, num, nu)
    return out, ScaleBySecondMomentState(count, mu, nu)

  return optax.GradientTransformationExtraArgs(init_fn, update_fn)

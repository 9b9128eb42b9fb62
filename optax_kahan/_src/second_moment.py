"""Adam's preconditioner in the rescaled form that Prodigy's d-estimator drives.

Prodigy (prodigyopt) keeps moments of d-scaled gradients,
``m <- b1 m + (1-b1) d_k g`` and ``v <- b2 v + (1-b2) d_k^2 g^2``, and steps
``d_k lr m / (sqrt(v) + d_{k+1} eps)``. With ``m~ = m / d_k`` and
``v~ = v / d_k^2`` the same step is ``d_k lr * m~ / (sqrt(v~) + eps d_{k+1}/d_k)``
where, with ``rho = d_{k-1} / d_k``::

    m~ <- b1 rho   m~ + (1 - b1) g
    v~ <- b2 rho^2 v~ + (1 - b2) g^2

so a standard preconditioner on ``g`` sits beside a d-estimator, coupled by
two extra arguments of ``update`` (both 1 on its own): ``d_ratio`` rescales
the old moments, and ``d_growth = d_{k+1} / d_k`` scales ``eps`` and, with
``b1 = 0`` (no first-moment buffer), the numerator: prodigyopt steps
``d_k lr d_{k+1} g / (sqrt(v) + d_{k+1} eps)`` then. With
``bias_correction=True`` this is ``optax.scale_by_adam`` (up to the last bit:
the bias correction multiplies by ``1 / (1 - b^t)``).

References:
  Kingma & Ba, "Adam: A Method for Stochastic Optimization", ICLR 2015.
  Mishchenko & Defazio, "Prodigy: An Expeditiously Adaptive Parameter-Free
  Learner", ICML 2024 (arXiv:2306.06101).
"""

from __future__ import annotations

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
  """The new first moment (None when there is none) and the step's numerator.

  With a first moment: ``m <- b1 rho m + (1 - b1) g`` is also the numerator.
  Without (``mu is None``, b1 = 0): the numerator is ``d_growth * g``, as
  prodigyopt's ``d_{k+1} g`` in the rescaled form. A ``b1`` that is an array
  (``optax.inject_hyperparams``) keeps the buffer, and the numerator follows
  the reference for every value: ``d_growth * g`` wherever ``b1 == 0``.
  """
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
  ``hat`` the bias correction when enabled, and ``m_t = gamma g_t`` when
  ``b1 == 0`` (no first-moment buffer is allocated then).

  Args:
    b1: first-moment decay; 0 disables the first moment and its buffer.
    b2: second-moment decay.
    eps: added to ``sqrt(v)`` (outside the root).
    bias_correction: divide the moments by ``1 - b^t`` as Adam does. Prodigy
      does its bias correction in the step size instead, so it passes False.
    state_dtype: dtype of ``m`` and ``v`` (as optax's ``mu_dtype``, e.g.
      ``jnp.bfloat16``); the arithmetic is float32 and each moment is rounded
      to nearest when stored. None follows the params.

  Returns:
    An ``optax.GradientTransformationExtraArgs``. Its ``update`` accepts the
    extra keyword arguments ``d_ratio`` and ``d_growth`` and ignores others.
    State follows the params' dtype unless ``state_dtype`` is given.

  Example:
    >>> tx = optax.chain(scale_by_second_moment(0.9, 0.999, 1e-8,
    ...                                         bias_correction=True),
    ...                  optax.scale_by_learning_rate(1e-3))  # == optax.adam

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
    # Reciprocals of Adam's 1 - b^t, multiplied in: XLA rewrites a division by
    # a broadcast scalar into this form only where the scalar has one user
    # (a single leaf), so writing it out keeps whole-tree and leafwise runs
    # bit-identical.
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

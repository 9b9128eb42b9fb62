"""Update clipping measured on the bias-corrected update.

Prodigy's early, not bias-corrected updates are up to ``1/sqrt(1 - b2)`` times
a steady gradient's, so a plain clip slows ``d``: see docs/guides/prodigy.md.

References:
  Shazeer & Stern, "Adafactor: Adaptive Learning Rates with Sublinear Memory
  Cost", ICML 2018 (update clipping); Kingma & Ba, "Adam", ICLR 2015.
"""

from typing import NamedTuple

import chex
import jax
import jax.numpy as jnp
import optax

from optax_kahan._src import validation


class ClipByBiasCorrectedRmsState(NamedTuple):
  """State of ``clip_by_bias_corrected_rms``: the number of updates."""
  count: chex.Array  # int32 scalar


def clip_by_bias_corrected_rms(threshold: float, b1: float, b2: float
                               ) -> optax.GradientTransformationExtraArgs:
  """Clips each leaf's update so that its bias-corrected RMS is at most ``threshold``.

  .. math::

    u_n \\leftarrow \\frac{u_n}{\\max\\big(1,\\ \\mathrm{RMS}(u_n)\\, c_n /
    \\tau\\big)},\\quad c_n = \\frac{\\sqrt{1 - \\beta_2^n}}{1 - \\beta_1^n}

  at the ``n``-th update: ``c_n u`` clipped to ``tau``; bit for bit unchanged
  where ``optax.clip_by_block_rms(tau)`` would not act. Chain it after
  moments (decays ``b1``, ``b2``) that start at zero, not bias-corrected.

  Args:
    threshold: ``tau``, the largest bias-corrected RMS of a leaf's update.
    b1: the preconditioner's first-moment decay (0 without one).
    b2: its second-moment decay.

  Returns:
    An ``optax.GradientTransformationExtraArgs`` that acts leaf by leaf.

  Example:
    >>> import optax_kahan as ok
    >>> tx = ok.scale_by_prodigy(ok.per_leaf.chain(
    ...     ok.scale_by_factored_second_moment(b1=0.0, b2=0.999),
    ...     ok.clip_by_bias_corrected_rms(1.0, b1=0.0, b2=0.999)))

  References:
    Shazeer & Stern, 2018; Kingma & Ba, 2015.
  """
  validation.check_positive("threshold", threshold)
  validation.check_beta("b1", b1)
  validation.check_beta("b2", b2)

  def init_fn(params):
    del params
    return ClipByBiasCorrectedRmsState(jnp.zeros([], jnp.int32))

  def update_fn(updates, state, params=None):
    del params
    validation.check_state("clip_by_bias_corrected_rms", state,
                           ClipByBiasCorrectedRmsState)
    count = optax.safe_increment(state.count)
    n = count.astype(jnp.float32)
    correction = jnp.sqrt(1 - jnp.float32(b2)**n) / (1 - jnp.float32(b1)**n)
    per_rms = correction / threshold  # one scalar, multiplied by each RMS

    def clip(u):
      rms = jnp.sqrt(jnp.mean(u * u))
      return u / jnp.maximum(1.0, rms * per_rms.astype(u.dtype))

    return jax.tree.map(clip, updates), ClipByBiasCorrectedRmsState(count)

  return optax.with_extra_args_support(
      optax.GradientTransformation(init_fn, update_fn))

"""StableAdamW's update clipping: the per-leaf step shrinks when g^2 outruns v.

When ``v`` lags a sudden rise of the gradient, ``m / sqrt(v)`` spikes; the
clip (``scale_by_stable_adamw``) covers the weight decay too, so it owns it.

References:
  Wortsman et al., "Stable and low-precision training for large-scale
  vision-language models", NeurIPS 2023 (arXiv:2304.13013), Algorithm 2.
  torch-optimi 0.3.3, ``optimi.StableAdamW``.
"""

from typing import NamedTuple

import jax
import jax.numpy as jnp
import optax

from optax_kahan._src import validation
from optax_kahan._src.second_moment import ScaleBySecondMomentState
from optax_kahan._src.second_moment import scale_by_second_moment


class ScaleByStableAdamWState(NamedTuple):
  """State of ``scale_by_stable_adamw``: the Adam moments."""
  moments: ScaleBySecondMomentState


def scale_by_stable_adamw(
    b1: float = 0.9,
    b2: float = 0.99,
    eps: float = 1e-6,
    weight_decay: float = 1e-2,
) -> optax.GradientTransformation:
  """Adam's direction plus decoupled decay, divided by ``max(1, RMS_t)`` per leaf.

  .. math::

    u_t = \\frac{1}{\\max(1, \\mathrm{RMS}_t)}\\left(\\frac{\\hat m_t}
    {\\sqrt{\\hat v_t} + \\epsilon} + \\lambda x_t\\right), \\quad
    \\mathrm{RMS}_t = \\sqrt{\\mathrm{mean}\\left(\\frac{g_t^2}
    {\\max(\\hat v_t, \\epsilon^2)}\\right)}

  Args:
    b1: first-moment decay.
    b2: second-moment decay.
    eps: added to ``sqrt(v^)``; ``eps^2`` floors ``v^`` in the RMS.
    weight_decay: decoupled weight decay ``lambda`` (scaled with the step).

  Returns:
    The direction, an ``optax.GradientTransformation``; chain a learning rate.

  Example:
    >>> tx = optax.chain(scale_by_stable_adamw(), optax.scale_by_learning_rate(1e-3))

  References:
    Wortsman et al., 2023, Algorithm 2.
  """
  validation.check_positive("eps", eps)
  validation.check_positive("weight_decay", weight_decay, allow_zero=True)
  adam = scale_by_second_moment(b1, b2, eps, bias_correction=True)

  def init_fn(params):
    validation.check_real("scale_by_stable_adamw", params)
    return ScaleByStableAdamWState(adam.init(params))

  def update_fn(updates, state, params=None):
    if params is None:
      raise ValueError("scale_by_stable_adamw needs params (weight decay)")
    validation.check_state("scale_by_stable_adamw", state,
                           ScaleByStableAdamWState)
    direction, moments = adam.update(updates, state.moments, params)
    # Reciprocal multiplied in, as in scale_by_second_moment.
    r2 = 1 / (1 - jnp.asarray(b2, jnp.float32)**moments.count.astype(
        jnp.float32))

    def clip(g, u, v, x):
      v_hat = v.astype(jnp.float32) * r2
      g32 = g.astype(jnp.float32)
      rms = jnp.sqrt(jnp.mean(g32 * g32 / jnp.maximum(v_hat, eps * eps)))
      step = u.astype(jnp.float32) + weight_decay * x.astype(jnp.float32)
      return (step * (1 / jnp.maximum(1.0, rms))).astype(u.dtype)

    out = jax.tree.map(clip, updates, direction, moments.nu, params)
    return out, ScaleByStableAdamWState(moments)

  return optax.with_extra_args_support(
      optax.GradientTransformation(init_fn, update_fn))

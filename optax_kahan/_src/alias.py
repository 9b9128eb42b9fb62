"""Named optimizers: thin per-leaf chains (sizes: docs/guides/prodigy.md)."""

from typing import Optional

import jax.numpy as jnp
import optax

from optax_kahan._src import leafwise
from optax_kahan._src.bias_corrected_clip import clip_by_bias_corrected_rms
from optax_kahan._src.factored_second_moment import scale_by_factored_second_moment
from optax_kahan._src.prodigy import scale_by_prodigy
from optax_kahan._src import validation
from optax_kahan._src.second_moment import scale_by_second_moment
from optax_kahan._src.stable_adamw import scale_by_stable_adamw


def prodigy(
    learning_rate: optax.ScalarOrSchedule = 1.0,
    b1: float = 0.9,
    b2: float = 0.999,
    b3: Optional[float] = None,
    eps: float = 1e-8,
    weight_decay: float = 0.0,
    decouple: bool = True,
    use_bias_correction: bool = False,
    safeguard_warmup: bool = False,
    d0: float = 1e-6,
    d_coef: float = 1.0,
    growth_rate: float = float("inf"),
    slice_p: int = 1,
    factored: bool = False,
    update_clip: Optional[float] = None,
    eps2: float = 1e-30,
    lagged_d: bool = False,
    state_dtype: Optional[jnp.dtype] = None,
    bias_corrected_clip: bool = False,
) -> optax.GradientTransformationExtraArgs:
  """Prodigy, the learning-rate-free Adam, as in prodigyopt 1.1.2, plus low-memory options.

  .. math::

    d_{k+1} = \\min\\Big(d_{\\max}, \\gamma\\, d_k\\Big),\\quad
    \\hat d = c\\,\\frac{r_k}{\\sum\\|s_k\\|_1},\\quad
    x_{k+1} = x_k - d_k\\, \\eta_k\\, \\Big(\\frac{m_k}{\\sqrt{v_k} +
    d_{k+1}\\epsilon} + \\lambda x_k\\Big)

  (``r`` and ``s``: ``scale_by_prodigy``.) An all-zero gradient step is
  skipped, as in prodigyopt (``optax.contrib.prodigy``: NaN). Its
  ``betas=(b1, b2)``, ``beta3``, ``estim_lr0``, ``estim_lr_coef`` are ``b1``,
  ``b2``, ``b3``, ``d0``, ``d_coef``, and it has ``use_bias_correction=True``.

  Args:
    learning_rate: multiplier of Prodigy's ``d`` (keep 1.0), float or schedule.
    b1: first-moment decay; 0 keeps no first-moment buffer.
    b2: second-moment decay.
    b3: decay of the d statistics; None means ``sqrt(b2)``.
    eps: added to ``sqrt(v)``, scaled by ``d``.
    weight_decay: weight decay ``lambda``.
    decouple: AdamW-style decoupled decay (True) or L2 added to the gradient.
    use_bias_correction: fold Adam's bias correction into the step size.
    safeguard_warmup: leave the learning rate out of ``s`` (for warm-up).
    d0: initial ``d``.
    d_coef: multiplier of the estimate ``d^``.
    growth_rate: largest per-step growth of ``d`` (inf: unbounded).
    slice_p: estimate ``d`` on every ``slice_p``-th entry of each leaf.
    factored: Adafactor's factored second moment for leaves of >= 2 dims.
    update_clip: clip each leaf's update to this RMS (``clip_by_block_rms``).
    eps2: added to ``g^2`` in the factored moment.
    lagged_d: ``d`` one step late, for ``blockwise`` (``scale_by_prodigy``).
    state_dtype: dtype of ``s``, ``x0`` and the moments, not of the factored
      row and column statistics; None follows the params.
    bias_corrected_clip: clip the bias-corrected update, which leaves early
      steps alone (``clip_by_bias_corrected_rms``).

  Returns:
    An ``optax.GradientTransformationExtraArgs`` with a per-leaf form.

  Raises:
    ValueError: for an out-of-range value (d0 <= 0, b1 outside [0, 1), ...).

  Example:
    >>> params = {"w": jnp.ones((4, 4), jnp.bfloat16)}
    >>> grads = {"w": jnp.full((4, 4), 0.1, jnp.bfloat16)}
    >>> tx = ok.kahan(ok.prodigy())  # bf16 params, exact float32 update
    >>> updates, state = tx.update(grads, tx.init(params), params)
    >>> params = optax.apply_updates(params, updates)
    >>> d = ok.prodigy_d(state)  # the current step size estimate

  References:
    Mishchenko & Defazio, "Prodigy: An Expeditiously Adaptive Parameter-Free
    Learner", ICML 2024; prodigyopt 1.1.2, PRs #20 and #22.
  """
  validation.check_beta("b1", b1)
  validation.check_beta("b2", b2)
  validation.check_positive("eps", eps)
  validation.check_positive("eps2", eps2, allow_zero=True)
  validation.check_float_dtype("state_dtype", state_dtype)
  if update_clip is not None:
    validation.check_positive("update_clip", update_clip)
  validation.warn_low_precision_hyperparams(
      "prodigy", learning_rate=learning_rate, b1=b1, b2=b2, b3=b3, eps=eps,
      weight_decay=weight_decay, d0=d0, d_coef=d_coef)
  if b3 is None:
    b3 = b2**0.5
  if factored:
    preconditioner = scale_by_factored_second_moment(
        b1, b2, eps, eps2, state_dtype=state_dtype)
  else:
    preconditioner = scale_by_second_moment(b1, b2, eps,
                                            state_dtype=state_dtype)
  if update_clip is not None:
    clip = (clip_by_bias_corrected_rms(update_clip, b1, b2)
            if bias_corrected_clip else optax.clip_by_block_rms(update_clip))
    preconditioner = leafwise.chain(preconditioner, clip)
  estimator = scale_by_prodigy(
      preconditioner,
      learning_rate=learning_rate,
      b3=b3,
      weight_decay=weight_decay if decouple else 0.0,
      d0=d0,
      d_coef=d_coef,
      growth_rate=growth_rate,
      slice_p=slice_p,
      safeguard_warmup=safeguard_warmup,
      bias_correction=(b1, b2) if use_bias_correction else None,
      lagged_d=lagged_d,
      state_dtype=state_dtype)
  # Leafwise: the step's scratch is one leaf's, bare or in kahan.
  if decouple:
    return leafwise.leafwise(estimator)
  return leafwise.leafwise(leafwise.chain(
      optax.add_decayed_weights(weight_decay), estimator))


def prodigy_factored(
    learning_rate: optax.ScalarOrSchedule = 1.0,
    b1: float = 0.0,
    b2: float = 0.999,
    b3: Optional[float] = None,
    eps: float = 1e-8,
    weight_decay: float = 0.0,
    decouple: bool = True,
    use_bias_correction: bool = False,
    safeguard_warmup: bool = False,
    d0: float = 1e-6,
    d_coef: float = 1.0,
    growth_rate: float = float("inf"),
    slice_p: int = 11,
    update_clip: Optional[float] = 1.0,
    eps2: float = 1e-30,
    lagged_d: bool = False,
    state_dtype: Optional[jnp.dtype] = None,
    bias_corrected_clip: bool = True,
) -> optax.GradientTransformationExtraArgs:
  """Prodigy at about 0.36 B/param of state: b1 = 0, factored v, slice_p = 11, clip 1.

  ``prodigy(factored=True)`` with prodigyopt PRs #20/#22's ``b1=0``,
  ``slice_p=11`` and ``update_clip=1``, but ``bias_corrected_clip=True``: the
  PRs' raw clip shrinks the early steps up to 31.6-fold, slowing ``d`` (or,
  on bf16 weights without ``kahan``, stalling it at ``d0``; see
  docs/guides/prodigy.md). Use it inside ``kahan``: on plain bf16 params the
  first steps are below half an ulp and ``d`` never leaves ``d0``.

  Args:
    **others: as in ``prodigy`` (less ``factored``), defaults as above.

  Returns:
    An ``optax.GradientTransformationExtraArgs`` with a per-leaf form.

  Example:
    >>> tx = ok.kahan(ok.prodigy_factored())

  References:
    Shazeer & Stern, 2018 (Adafactor); Mishchenko & Defazio, 2024 (Prodigy).
  """
  return prodigy(
      learning_rate=learning_rate, b1=b1, b2=b2, b3=b3, eps=eps,
      weight_decay=weight_decay, decouple=decouple,
      use_bias_correction=use_bias_correction,
      safeguard_warmup=safeguard_warmup, d0=d0, d_coef=d_coef,
      growth_rate=growth_rate, slice_p=slice_p, factored=True,
      update_clip=update_clip, eps2=eps2, lagged_d=lagged_d,
      state_dtype=state_dtype, bias_corrected_clip=bias_corrected_clip)


def stable_adamw(
    learning_rate: optax.ScalarOrSchedule,
    b1: float = 0.9,
    b2: float = 0.99,
    eps: float = 1e-6,
    weight_decay: float = 1e-2,
) -> optax.GradientTransformationExtraArgs:
  """StableAdamW: AdamW whose per-leaf step shrinks by ``1/max(1, RMS(g/sqrt(v)))``.

  .. math::

    x_{t} = x_{t-1} - \\frac{\\eta_t}{\\max(1, \\mathrm{RMS}_t)}
    \\left(\\frac{\\hat m_t}{\\sqrt{\\hat v_t} + \\epsilon} + \\lambda x_{t-1}\\right)

  Defaults are torch-optimi's; see ``scale_by_stable_adamw``.

  Args:
    learning_rate: float or schedule.
    b1: first-moment decay.
    b2: second-moment decay.
    eps: added to ``sqrt(v^)``.
    weight_decay: decoupled weight decay, clipped with the step.

  Returns:
    An ``optax.GradientTransformationExtraArgs`` with a per-leaf form.

  Example:
    >>> tx = ok.kahan(ok.stable_adamw(1e-4))

  References:
    Wortsman et al., "Stable and low-precision training for large-scale
    vision-language models", NeurIPS 2023 (arXiv:2304.13013).
  """
  validation.check_beta("b1", b1)
  validation.check_beta("b2", b2)
  validation.warn_low_precision_hyperparams(
      "stable_adamw", learning_rate=learning_rate, b1=b1, b2=b2, eps=eps,
      weight_decay=weight_decay)
  return leafwise.leafwise(leafwise.chain(
      scale_by_stable_adamw(b1, b2, eps, weight_decay),
      optax.scale_by_learning_rate(learning_rate)))

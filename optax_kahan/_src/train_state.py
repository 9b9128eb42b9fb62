"""A Flax ``TrainState`` of bf16 params started from float32 weights.

References:
  Flax, ``flax.training.train_state.TrainState``.
"""

from typing import Any, Callable, Optional

import jax.numpy as jnp
import optax
from flax.training import train_state

from optax_kahan._src.bits import Rounding
from optax_kahan._src.kahan import kahan_from_float32
from optax_kahan._src.placement import commit_with


def kahan_train_state(
    params_f32: Any, tx: optax.GradientTransformation, *,
    apply_fn: Callable[..., Any], rounding: Rounding = "nearest",
    offload: bool = True,
    state_class: Optional[type[train_state.TrainState]] = None, **kwargs: Any,
) -> train_state.TrainState:
  """A ``TrainState`` of bf16 params whose ``kahan`` state keeps float32 bits.

  Unlike ``TrainState.create``, keeps the weights' low 16 bits: the residuals
  from ``kahan_from_float32`` go to ``tx.init``.

  Args:
    params_f32: the float32 weights (float64 leaves get no residual).
    tx: a ``kahan(...)`` transformation (its ``init`` takes the residuals).
    apply_fn: the model's apply function, as in ``TrainState.create``.
    rounding: the ``rounding`` that ``tx`` was made with.
    offload: the ``offload`` that ``tx`` was made with.
    state_class: a ``TrainState`` subclass (default ``TrainState``).
    **kwargs: further fields of ``state_class``.

  Returns:
    The ``state_class`` instance, its int32 ``step`` committed where the
    params are so that the jitted step compiles once.

  Raises:
    TypeError: if ``tx.init`` does not take residuals (``tx`` is not
      ``kahan(...)``; wrap the whole pipeline in ``kahan``).

  Example:
    >>> import flax.linen as nn
    >>> model = nn.Dense(3)
    >>> params_f32 = model.init(jax.random.key(0), jnp.ones((1, 4)))["params"]
    >>> state = ok.kahan_train_state(params_f32, ok.kahan(optax.adamw(1e-5)),
    ...                              apply_fn=model.apply)
  """
  params, residuals = kahan_from_float32(params_f32, rounding=rounding,
                                         offload=offload)
  try:
    opt_state = tx.init(params, residuals)
  except TypeError as e:
    raise TypeError(
        "kahan_train_state needs tx = kahan(...), whose init takes the "
        f"residuals ({e}); put the whole pipeline inside kahan") from e
  state_class = state_class or train_state.TrainState
  step = commit_with(jnp.zeros((), jnp.int32), params, "kahan_train_state")
  return state_class(step=step, apply_fn=apply_fn, params=params, tx=tx,
                     opt_state=opt_state, **kwargs)

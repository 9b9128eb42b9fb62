"""A Flax NNX ``nnx.Optimizer`` whose jitted step compiles once.

References:
  Flax, ``flax.nnx.Optimizer``.
"""

from typing import Any

import jax
import jax.numpy as jnp
import optax
from flax import nnx

from optax_kahan._src import validation
from optax_kahan._src.kahan import no_step_counter
from optax_kahan._src.placement import commit_with


def kahan_nnx_optimizer(model: nnx.Module, tx: optax.GradientTransformation,
                        *, wrt: Any) -> nnx.Optimizer:
  """``nnx.Optimizer(model, tx, wrt=wrt)`` with every array committed.

  A jitted step given ``kahan``'s committed residuals and uncommitted arrays
  compiles twice, so the model's state is committed (beside its committed
  arrays, else on ``jax.devices()[0]``) before ``tx.init``, the counter after.

  Args:
    model: the NNX model (its state is committed in place).
    tx: the transformation, e.g. ``kahan(prodigy_factored())``.
    wrt: the filter of the variables to train, e.g. ``nnx.Param``.

  Returns:
    The ``nnx.Optimizer``.

  Example:
    >>> from flax import nnx
    >>> model = nnx.Linear(4, 2, param_dtype=jnp.bfloat16, rngs=nnx.Rngs(0))
    >>> optimizer = ok.kahan_nnx_optimizer(model, ok.kahan(ok.prodigy()),
    ...                                    wrt=nnx.Param)
    >>> optimizer.step.get_value().committed
    True
  """
  if not isinstance(model, nnx.Module):
    raise TypeError(f"kahan_nnx_optimizer: model must be an nnx.Module, got "
                    f"{type(model).__name__}")
  validation.check_transformation("kahan_nnx_optimizer", "tx", tx)
  state = nnx.state(model)
  anchor = ([x for x in jax.tree.leaves(state)
             if isinstance(x, jax.Array) and x.committed]
            or jax.device_put(jnp.zeros(()), jax.devices()[0]))
  nnx.update(model, commit_with(state, anchor, "kahan_nnx_optimizer"))
  with no_step_counter():  # the counter is committed below
    optimizer = nnx.Optimizer(model, tx, wrt=wrt)
  optimizer.step.set_value(commit_with(
      optimizer.step.get_value(), nnx.state(model, wrt),
      "kahan_nnx_optimizer"))
  return optimizer

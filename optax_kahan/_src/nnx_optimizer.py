"""A Flax NNX ``nnx.Optimizer`` whose jitted step compiles once.

``kahan``'s residuals are committed arrays (they live in host memory). A
jitted step given committed and uncommitted arrays returns committed ones,
so its second call compiles again: minutes for a large model. An NNX model's
arrays are uncommitted as built, and so is the step counter that
``nnx.Optimizer`` makes; ``kahan_nnx_optimizer`` commits both.

References:
  Flax, ``flax.nnx.Optimizer``.
"""

from __future__ import annotations

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

  The model's state is committed first (to the device its committed arrays
  are on, else ``jax.devices()[0]``), so that ``tx.init`` sees committed
  params and commits its state beside them; then the optimizer's step
  counter. A jitted step over the model and the optimizer then compiles once.

  Args:
    model: the NNX model (its state is committed in place).
    tx: the transformation, e.g. ``kahan(prodigy_factored())``.
    wrt: the filter of the variables to train, as ``nnx.Optimizer`` takes it
      (``nnx.Param``).

  Returns:
    The ``nnx.Optimizer``.

  Example:
    >>> import jax.numpy as jnp
    >>> from flax import nnx
    >>> import optax_kahan as ok
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
  # Where the committed arrays are (replicated over their mesh), else on the
  # first device.
  anchor = ([x for x in jax.tree.leaves(state)
             if isinstance(x, jax.Array) and x.committed]
            or jax.device_put(jnp.zeros(()), jax.devices()[0]))
  nnx.update(model, commit_with(state, anchor, "kahan_nnx_optimizer"))
  with no_step_counter():  # committed below, as the warning asks
    optimizer = nnx.Optimizer(model, tx, wrt=wrt)
  optimizer.step.set_value(commit_with(
      optimizer.step.get_value(), nnx.state(model, wrt),
      "kahan_nnx_optimizer"))
  return optimizer

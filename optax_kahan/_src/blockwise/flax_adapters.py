"""Flax models (NNX modules, linen) as the parts of a ``BlockwiseModel``."""

from typing import Any, Callable, Optional, Sequence

from flax import linen as nn
from flax import nnx
import jax

from optax_kahan._src.blockwise.model import BlockwiseModel
from optax_kahan._src.blockwise.model import BlockwiseParams
from optax_kahan._src.blockwise.model import Carry
from optax_kahan._src.blockwise.model import Consts


def _split_module(module: nnx.Module, what: str
                  ) -> tuple[Callable[..., Any], Any]:
  """``(fn, params)`` with ``fn(params, *args) = merge(module)(*args)``."""
  if not isinstance(module, nnx.Module):
    raise TypeError(f"nnx_blockwise: {what} must be an nnx.Module, got "
                    f"{type(module).__name__}")
  graphdef, params, rest = nnx.split(module, nnx.Param, ...)
  if jax.tree.leaves(rest):
    raise ValueError(
        f"nnx_blockwise: {what} ({type(module).__name__}) holds state other "
        f"than nnx.Param: {rest}; the blockwise step carries only the params")

  def fn(params: Any, *args: Any) -> Any:
    return nnx.merge(graphdef, params)(*args)
  return fn, params


def nnx_blockwise(
    embed: nnx.Module, stacks: Sequence[nnx.Module], head: nnx.Module,
    transitions: Sequence[Callable[[Carry, Consts], Carry]] = (),
) -> tuple[BlockwiseModel, BlockwiseParams]:
  """A Flax NNX model's parts as a ``BlockwiseModel`` and its params.

  The parts are the modules' ``__call__``; a stack's ``nnx.Param`` leaves have
  a leading block axis (``nnx.vmap``). Write params back with ``nnx.update``.

  Args:
    embed: the embedding module.
    stacks: the stacked block modules, in the order they run.
    head: the head module, returning the scalar loss.
    transitions: the model's ``transitions`` (functions without weights).

  Returns:
    ``(model, params)``, the params the modules' ``nnx.Param`` state.

  Raises:
    ValueError: if a module holds state other than ``nnx.Param`` (RNG, stats).
  """
  embed_fn, embed_params = _split_module(embed, "embed")
  split = [_split_module(m, f"stacks[{i}]") for i, m in enumerate(stacks)]
  head_fn, head_params = _split_module(head, "head")
  return (BlockwiseModel(embed_fn, tuple(fn for fn, _ in split), head_fn,
                         tuple(transitions)),
          BlockwiseParams(embed_params, tuple(p for _, p in split),
                          head_params))


def linen_apply(module: nn.Module,
                method: Optional[Callable[..., Any]] = None
                ) -> Callable[..., Any]:
  """A Flax linen module as a part of a ``BlockwiseModel``.

  A stack scanned by ``nn.scan(Block, variable_axes={"params": 0}, ...)`` has
  its params stacked already; its block is ``linen_apply`` of one ``Block``::

    model = BlockwiseModel(
        embed=linen_apply(Embed(cfg)),
        blocks=(linen_apply(Block(cfg), lambda m, c, k: m(c, **k)[0]),),
        head=linen_apply(Head(cfg)))
    params = BlockwiseParams(p["embed"], (p["blocks"],), p["head"])

  Args:
    module: the (unbound) module of one part, configured as in the model.
    method: ``method(module, *args)``, what to call (default ``__call__``).

  Returns:
    ``fn(params, *args)`` calling ``module.apply``; a module that needs other
    collections than ``params`` (batch statistics) fails there, naming them.
  """
  if not isinstance(module, nn.Module):
    raise TypeError(f"linen_apply: module must be a flax.linen Module, got "
                    f"{type(module).__name__}")

  def fn(params: Any, *args: Any) -> Any:
    return module.apply({"params": params}, *args, method=method)
  return fn

"""Argument, state and tree checks whose errors name the culprit.

Every check raises (or warns) with the name of the argument or the path of the
leaf at fault, so that a mistake in a 1,000-leaf model is found in one read.
Every warning of the package is an ``OptaxKahanWarning``, so that a test suite
or a training script can turn them into errors
(``warnings.simplefilter("error", OptaxKahanWarning)``).
"""

from __future__ import annotations

import math
import warnings
from typing import Any, Callable, Optional

import jax
import jax.numpy as jnp


class OptaxKahanWarning(UserWarning):
  """A warning of optax_kahan: a run that works, but not as the user meant
  (a second compilation, a stall, residuals in the wrong memory, a step that
  runs on the whole tree)."""


def warn(message: str, stacklevel: int) -> None:
  """``warnings.warn`` with the package's category (``stacklevel`` counts
  from the caller of ``warn``)."""
  warnings.warn(message, OptaxKahanWarning, stacklevel=stacklevel + 1)


def find(tree: Any, node_type: type) -> list[Any]:
  """The nodes of ``tree`` of type ``node_type``, under any wrapper's state."""
  is_node = lambda x: isinstance(x, node_type)
  return [x for x in jax.tree.leaves(tree, is_leaf=is_node) if is_node(x)]


def check_beta(name: str, value: Any) -> None:
  """Raises ValueError unless a Python-number beta lies in [0, 1)."""
  if isinstance(value, (int, float)) and not 0.0 <= value < 1.0:
    raise ValueError(f"{name} must be in [0, 1), got {value}")


def check_positive(name: str, value: Any, allow_zero: bool = False) -> None:
  """Raises ValueError naming ``name`` unless a Python number is > 0 (>= 0)."""
  if not isinstance(value, (int, float)):
    return
  if value < 0 or (value == 0 and not allow_zero) or math.isnan(value):
    bound = ">= 0" if allow_zero else "> 0"
    raise ValueError(f"{name} must be {bound}, got {value}")


def is_narrow_float(dtype: Any) -> bool:
  """True for floating dtypes narrower than float32 (bfloat16, float16)."""
  return (jnp.issubdtype(dtype, jnp.floating)
          and jnp.finfo(dtype).bits < 32)


def warn_low_precision_hyperparams(where: str, **hyperparams: Any) -> None:
  """Warns for each hyperparameter that arrives narrower than float32.

  That happens under ``optax.inject_hyperparams`` without
  ``hyperparam_dtype=jnp.float32`` on bfloat16 or float16 params: the
  hyperparameters are cast to the params' dtype, and in bfloat16
  ``0.999 == 1.0``, ``0.9999 == 1.0``, ``1e-8`` keeps three digits.
  """
  for name, value in hyperparams.items():
    dtype = getattr(value, "dtype", None)
    if dtype is not None and is_narrow_float(dtype):
      warn(
          f"{where}: hyperparameter {name} is {jnp.dtype(dtype).name}, which "
          "rounds it (in bfloat16 0.999 is 1.0 and the second moment stops "
          "moving); with optax.inject_hyperparams pass "
          "hyperparam_dtype=jnp.float32", stacklevel=3)


def check_transformation(where: str, name: str, tx: Any) -> None:
  """Raises TypeError unless ``tx`` is an optax transformation (has ``init``
  and ``update``), suggesting the call a factory such as ``optax.adamw``
  needs."""
  if callable(getattr(tx, "init", None)) and callable(
      getattr(tx, "update", None)):
    return
  hint = (f"; {getattr(tx, '__name__', 'it')} is a function that makes one: "
          "call it, e.g. optax.adamw(1e-5)" if callable(tx) else "")
  raise TypeError(f"{where}: {name} must be an optax GradientTransformation "
                  f"(with init and update), got {type(tx).__name__}{hint}")


def check_bool(where: str, name: str, value: Any) -> None:
  """Raises TypeError unless ``value`` is a Python bool."""
  if not isinstance(value, bool):
    raise TypeError(f"{where}: {name} must be True or False, got {value!r}")


def check_float_dtype(name: str, dtype: Any) -> None:
  """Raises TypeError unless ``dtype`` is None or a floating dtype."""
  if dtype is None:
    return
  try:
    ok = jnp.issubdtype(jnp.dtype(dtype), jnp.floating)
  except TypeError:
    ok = False
  if not ok:
    raise TypeError(f"{name} must be a floating dtype such as jnp.bfloat16 "
                    f"or jnp.float32 (or None), got {dtype!r}")


def check_key(where: str, key: Any) -> None:
  """Raises TypeError unless ``key`` is a JAX PRNG key: a typed key
  (``jax.random.key``) or a raw ``uint32[2]`` one (``jax.random.PRNGKey``)."""
  dtype = getattr(key, "dtype", None)
  if dtype is not None and (jnp.issubdtype(dtype, jax.dtypes.prng_key) or (
      dtype == jnp.uint32 and jnp.shape(key)[-1:] == (2,))):
    return
  raise TypeError(f"{where}: key must be a JAX PRNG key, e.g. "
                  f"jax.random.key(0), got {type(key).__name__} {key!r}")


def check_real(where: str, params: Any) -> None:
  """Raises TypeError naming the first complex leaf of ``params``."""
  for path, leaf in jax.tree_util.tree_flatten_with_path(params)[0]:
    dtype = getattr(leaf, "dtype", None)
    if dtype is not None and jnp.issubdtype(dtype, jnp.complexfloating):
      raise TypeError(
          f"{where}: leaf {jax.tree_util.keystr(path) or '<root>'} is "
          f"{jnp.dtype(dtype).name}; this transformation implements "
          "real-valued math only. Split complex params into real and "
          "imaginary parts, or use an optax optimizer that supports them")


def check_state(where: str, state: Any, state_type: type) -> None:
  """Raises TypeError unless ``state`` is a ``state_type`` (what init made)."""
  if not isinstance(state, state_type):
    raise TypeError(
        f"{where}.update got a state of type {type(state).__name__}, expected "
        f"{state_type.__name__}: pass the whole state returned by "
        f"{where}.init (or by the previous update), not a part of it")


def tree_mismatch(a: Any, b: Any, *, names: tuple[str, str] = ("a", "b"),
                  is_leaf: Optional[Callable[[Any], bool]] = None
                  ) -> Optional[str]:
  """Where two trees first differ, in one line, or None if they match.

  Names the first differing key path, and what each tree has there: the node
  type and its keys (a ``FrozenDict`` against a ``dict``, a missing key), or a
  leaf against a node.
  """

  def children(node):
    # (key path, child) pairs one level down, or None for a leaf.
    if node is None or (is_leaf is not None and is_leaf(node)):
      return None
    flat = jax.tree_util.tree_flatten_with_path(
        node, is_leaf=lambda x: x is not node)[0]
    return None if len(flat) == 1 and not flat[0][0] else flat

  def describe(node) -> str:
    kids = children(node)
    if node is None:
      return "None"
    if kids is None:
      return f"a leaf ({type(node).__name__})"
    if not kids:
      return f"an empty {type(node).__name__}"
    keys = [jax.tree_util.keystr(k) for k, _ in kids]
    shown = ", ".join(keys[:6]) + (", ..." if len(keys) > 6 else "")
    return f"a {type(node).__name__} with {shown}"

  def walk(x, y, path: str) -> Optional[str]:
    kx, ky = children(x), children(y)
    if kx is None and ky is None:
      return None
    if (kx is None or ky is None or type(x) is not type(y)
        or [k for k, _ in kx] != [k for k, _ in ky]):
      return (f"at {path or '<root>'}: {names[0]} has {describe(x)}, "
              f"{names[1]} has {describe(y)}")
    for (key, cx), (_, cy) in zip(kx, ky):
      found = walk(cx, cy, path + jax.tree_util.keystr(key))
      if found:
        return found
    return None

  return walk(a, b, "")


def is_abstract(tree: Any) -> bool:
  """True when ``tree`` has ``jax.ShapeDtypeStruct`` leaves: ``init``
  functions then return ``jax.eval_shape(init, tree)`` (the state's shapes,
  dtypes and shardings, as optax's own optimizers do)."""
  return any(isinstance(x, jax.ShapeDtypeStruct) for x in jax.tree.leaves(tree))


def is_static_zero(value: Any) -> bool:
  """True for a Python 0 or a concrete (not traced) array equal to 0 (a
  ``b1=0`` that ``optax.inject_hyperparams`` made an array, outside jit)."""
  if isinstance(value, (int, float)):
    return value == 0
  if isinstance(value, jax.core.Tracer):
    return False
  try:
    return bool(jnp.all(jnp.asarray(value) == 0))
  except (TypeError, jax.errors.ConcretizationTypeError):
    return False

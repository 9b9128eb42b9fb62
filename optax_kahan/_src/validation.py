"""Argument, state and tree checks whose errors name the argument or leaf."""

import math
import warnings
from typing import Any, Callable, Optional

import jax
import jax.numpy as jnp


class OptaxKahanWarning(UserWarning):
  """A warning of optax_kahan: a run that works, but not as meant (a second
  compilation, residuals in the wrong memory, a step on the whole tree); make
  it an error with ``warnings.simplefilter("error", OptaxKahanWarning)``."""


def warn(message: str, stacklevel: int) -> None:
  """``warnings.warn`` as an ``OptaxKahanWarning``; ``stacklevel`` counts
  from ``warn``'s caller."""
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
  return jnp.issubdtype(dtype, jnp.floating) and jnp.finfo(dtype).bits < 32


def warn_low_precision_hyperparams(where: str, **hyperparams: Any) -> None:
  """Warns for each hyperparameter narrower than float32 (as
  ``optax.inject_hyperparams`` casts them to bf16 params' dtype)."""
  for name, value in hyperparams.items():
    dtype = getattr(value, "dtype", None)
    if dtype is not None and is_narrow_float(dtype):
      warn(
          f"{where}: hyperparameter {name} is {jnp.dtype(dtype).name}, which "
          "rounds it (in bfloat16 0.999 is 1.0 and the second moment stops "
          "moving); with optax.inject_hyperparams pass "
          "hyperparam_dtype=jnp.float32", stacklevel=3)


def check_transformation(where: str, name: str, tx: Any) -> None:
  if callable(getattr(tx, "init", None)) and callable(
      getattr(tx, "update", None)):
    return
  hint = (f"; {getattr(tx, '__name__', 'it')} is a function that makes one: "
          "call it, e.g. optax.adamw(1e-5)" if callable(tx) else "")
  raise TypeError(f"{where}: {name} must be an optax GradientTransformation "
                  f"(with init and update), got {type(tx).__name__}{hint}")


def check_bool(where: str, name: str, value: Any) -> None:
  if not isinstance(value, bool):
    raise TypeError(f"{where}: {name} must be True or False, got {value!r}")


def check_float_dtype(name: str, dtype: Any) -> None:
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
  """Raises TypeError unless ``key`` is a typed or ``uint32[2]`` PRNG key."""
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
  if not isinstance(state, state_type):
    raise TypeError(
        f"{where}.update got a state of type {type(state).__name__}, expected "
        f"{state_type.__name__}: pass the whole state returned by "
        f"{where}.init (or by the previous update), not a part of it")


def tree_mismatch(a: Any, b: Any, *, names: tuple[str, str] = ("a", "b"),
                  is_leaf: Optional[Callable[[Any], bool]] = None
                  ) -> Optional[str]:
  """The first differing key path and what each tree has there (node type
  and keys, or a leaf), in one line; None if the trees match."""
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
  """True when ``tree`` has ``jax.ShapeDtypeStruct`` leaves (``init`` then
  returns ``jax.eval_shape(init, tree)``, as optax's optimizers do)."""
  return any(isinstance(x, jax.ShapeDtypeStruct) for x in jax.tree.leaves(tree))


def is_static_zero(value: Any) -> bool:
  """True for a Python 0 or a concrete array equal to 0 (an injected ``b1``)."""
  if isinstance(value, (int, float)):
    return value == 0
  if isinstance(value, jax.core.Tracer):
    return False
  try:
    return bool(jnp.all(jnp.asarray(value) == 0))
  except (TypeError, jax.errors.ConcretizationTypeError):
    return False

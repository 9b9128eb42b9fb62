"""Where arrays live: host or device memory, and committed to a device."""

import math
from typing import Any

import jax
import jax.numpy as jnp

from optax_kahan._src import validation


def on_host(x: Any) -> bool:
  return (isinstance(x, (jax.Array, jax.core.Tracer))
          and jax.typeof(x).memory_space == jax.memory.Space.Host)


def to_host(x: jax.Array) -> jax.Array:
  """Sends ``x`` to host memory (``pinned_host``), keeping its sharding."""
  return jax.device_put(x, jax.memory.Space.Host)


def to_device(x: jax.Array) -> jax.Array:
  return jax.device_put(x, jax.memory.Space.Device)


def on_device(tree: Any) -> Any:
  """The tree with its host-memory arrays brought into device memory."""
  return jax.tree.map(lambda x: to_device(x) if on_host(x) else x, tree)


def in_host_memory(x: Any) -> bool:
  """An array, or an abstract ``jax.ShapeDtypeStruct``, in host memory."""
  return on_host(x) or getattr(
      getattr(x, "sharding", None), "memory_kind", None) == "pinned_host"


def host_bytes(tree: Any) -> int:
  """The bytes of ``tree``'s arrays (or abstract ones) in host memory."""
  return sum(math.prod(x.shape) * jnp.dtype(x.dtype).itemsize
             for x in jax.tree.leaves(tree) if in_host_memory(x))


def commit_with(state: Any, params: Any, where: str) -> Any:
  """Commits ``state``'s uncommitted arrays where the (committed) params live.

  A jitted step given committed and uncommitted arguments returns committed
  outputs, so its second call compiles again. Uncommitted params with a
  committed state (host residuals) warn: only the caller can commit them.
  """
  concrete = lambda x: (isinstance(x, jax.Array)
                        and not isinstance(x, jax.core.Tracer))
  arrays = [x for x in jax.tree.leaves(params) if concrete(x)]
  if not arrays:
    return state
  if not all(x.committed for x in arrays):
    if any(concrete(x) and x.committed for x in jax.tree.leaves(state)):
      validation.warn(
          f"{where}: the params are not committed to a device, so the first "
          "jitted step will compile twice (its outputs are committed). "
          "Commit them once, before init: params = jax.device_put(params, "
          "jax.devices()[0]) (restored and sharded params already are)",
          stacklevel=3)
    return state
  sharding = arrays[0].sharding
  if isinstance(sharding, jax.sharding.NamedSharding):
    target = jax.sharding.NamedSharding(sharding.mesh, jax.P())
  else:  # one device (jax.device_put to a Device commits to it)
    target = next(iter(sharding.device_set))
  return jax.tree.map(
      lambda x: jax.device_put(x, target) if concrete(x) and not x.committed
      else x, state)

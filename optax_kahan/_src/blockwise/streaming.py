"""Streaming blocks through host memory. See docs/guides/flux.md.

References:
  sd-scripts (kohya-ss) ``--blocks_to_swap``.
"""

from typing import Any, Optional, Sequence

import jax
import jax.numpy as jnp
import numpy as np
from jax import lax

from optax_kahan._src import interleaved
from optax_kahan._src import placement
from optax_kahan._src import validation
from optax_kahan._src.blockwise.model import BlockwiseModel
from optax_kahan._src.blockwise.model import BlockwiseParams
from optax_kahan._src.blockwise.model import BlockwiseState
from optax_kahan._src.blockwise.model import check_params
from optax_kahan._src.blockwise.model import continue_stack
from optax_kahan._src.blockwise.model import num_blocks
from optax_kahan._src.double_buffer import DoubleBuffer
from optax_kahan._src.double_buffer import check_plain_leaves
from optax_kahan._src.double_buffer import front_buffers
from optax_kahan._src.double_buffer import is_double as _is_double


#: ``jax.jit`` options for a streamed step: XLA:GPU keeps about one host
#: transfer in flight, a block moves one per host leaf each way (about 80 for
#: FLUX.1-dev's; at 64, fetches wait). Experimental; XLA:CPU ignores it.
STREAMING_COMPILER_OPTIONS: dict[str, Any] = {
    "xla_gpu_experimental_parallel_async_compute_limit": 256}


def with_front_buffers(layout: Any, values: Any) -> Any:
  """``layout`` holding ``values``: the inverse of ``front_buffers``.

  Checkpoint ``front_buffers((params, state))``, not the pairs: a pair's role
  is static, so restored into the other role it would read the stale buffer.

  Example:
    >>> layout = {"w": DoubleBuffer(jnp.zeros(2), jnp.ones(2)), "b": 0.0}
    >>> tree = with_front_buffers(layout, {"w": jnp.full(2, 5.0), "b": 1.0})
    >>> front_buffers(tree)["w"].tolist(), tree["w"].back.tolist(), tree["b"]
    ([5.0, 5.0], [1.0, 1.0], 1.0)

  Args:
    layout: a tree with ``DoubleBuffer`` nodes (``stream_blocks``' layout).
    values: laid out as ``front_buffers(layout)`` (a checkpoint of it).

  Returns:
    ``layout``'s pairs and roles, ``values``' arrays.

  Raises:
    ValueError: for a value in device memory where ``layout``'s is on host
      (``jax.device_put(x, jax.memory.Space.Host)`` places orbax's), or a
      spare a donating step deleted, naming the leaf.
  """
  def put(path, x, value):
    front = x.front if _is_double(x) else x
    if placement.on_host(front) and not placement.on_host(value):
      raise ValueError(
          f"with_front_buffers: {jax.tree_util.keystr(path)} is in host "
          f"memory in the layout but not in values; place it with "
          f"jax.device_put(value, jax.memory.Space.Host)")
    if not _is_double(x):
      return value
    spare = x.b if x.front_is_a else x.a
    if isinstance(spare, jax.Array) and spare.is_deleted():
      raise ValueError(
          f"with_front_buffers: the spare buffer of "
          f"{jax.tree_util.keystr(path)} in layout was deleted (a jitted "
          "step donated it); pass the layout the last step returned, or a "
          "new one from ok.blockwise.stream_blocks")
    if x.front_is_a:
      return DoubleBuffer(value, x.b, True)
    return DoubleBuffer(x.a, value, False)
  where = validation.tree_mismatch(front_buffers(layout), values,
                                   names=("layout", "values"))
  if where:
    raise ValueError(f"with_front_buffers: values must be laid out as "
                     f"front_buffers(layout); {where}")
  return jax.tree_util.tree_map_with_path(put, layout, values,
                                          is_leaf=_is_double)


def flip(tree: Any, new: Any) -> Any:
  """``new`` in ``tree``'s layout, each ``DoubleBuffer`` flipped (``flip``)."""
  return jax.tree.map(lambda x, y: x.flip(y) if _is_double(x) else y, tree,
                      new, is_leaf=_is_double)


def _spare(x: Any) -> Any:
  """A second host buffer like ``x`` (its contents never read)."""
  if isinstance(x, jax.ShapeDtypeStruct):
    return x
  # made in host memory, not on the device and copied out
  return jax.device_put(np.zeros(x.shape, x.dtype), x.sharding)


def _part(x: Any, start: int, stop: int, kind: Optional[str]) -> Any:
  """Blocks ``start:stop`` of a stacked leaf in memory ``kind`` (None: kept)."""
  if isinstance(x, jax.ShapeDtypeStruct):
    sharding = x.sharding
    if kind is not None and sharding is not None:
      sharding = sharding.with_memory_kind(kind)
    return jax.ShapeDtypeStruct((stop - start, *x.shape[1:]), x.dtype,
                                sharding=sharding)
  part = lax.slice_in_dim(x, start, stop)
  if kind == "pinned_host":
    return placement.to_host(part)
  if kind == "device" and placement.in_host_memory(part):
    return placement.to_device(part)
  return part


def _counts(name: str, value: Any, limits: list[int], what: str,
            unit: str = "blocks") -> tuple[int, ...]:
  """``value``: an int per stack, from 0 to its limit; or an error."""
  if (not isinstance(value, (tuple, list)) or len(value) != len(limits)
      or not all(type(k) is int for k in value)):
    raise ValueError(
        f"stream_blocks: {name} must be a tuple of {len(limits)} ints, one "
        f"per stack ({unit} per stack: {tuple(limits)}): {what}; got "
        f"{value!r}")
  for s, (k, limit) in enumerate(zip(value, limits)):
    if not 0 <= k <= limit:
      raise ValueError(f"stream_blocks: {name}[{s}] = {k}, but stack {s} "
                       f"has {limit} {unit}")
  return tuple(value)


def stream_blocks(
    model: BlockwiseModel, params: BlockwiseParams, state: BlockwiseState,
    num_streamed: Sequence[int], *, spare_buffers: Optional[bool] = None,
    interleave: bool = False,
    residuals_on_device: Optional[Sequence[int]] = None,
) -> tuple[BlockwiseModel, BlockwiseParams, BlockwiseState]:
  """Moves the last blocks of each stack, weights and state, to host memory.

  ``blockwise_step`` streams them (``pinned_host``) two blocks at a time
  (sd-scripts' ``--blocks_to_swap``, state and residuals too), bit for bit
  the same step (Prodigy's late sums: in another order). The other blocks'
  weights go to the device (load a too large model into host memory first).

  Example:
    >>> import optax
    >>> model = BlockwiseModel(
    ...     embed=lambda p, x: (x * p["w"], ()),
    ...     blocks=(lambda p, h, _: jnp.tanh(h @ p["w"]),),
    ...     head=lambda p, h, _, x: jnp.mean((h @ p["w"] - x) ** 2))
    >>> params = BlockwiseParams(
    ...     embed={"w": jnp.ones(4)}, stacks=({"w": jnp.ones((5, 4, 4)) / 4},),
    ...     head={"w": jnp.eye(4)})
    >>> tx = optax.adamw(1e-3)
    >>> state = blockwise_init(tx, params)
    >>> model, params, state = stream_blocks(model, params, state, (3,))
    >>> [num_blocks(stack) for stack in params.stacks]  # device, host
    [2, 3]
    >>> loss, params, state = blockwise_step(model, tx, params, state,
    ...                                      jnp.arange(4.0))

  Args:
    model: the model's functions.
    params: a ``BlockwiseParams`` (arrays or ``jax.ShapeDtypeStruct``).
    state: its ``BlockwiseState`` (from ``blockwise_init``), left in place
      for the blocks not streamed.
    num_streamed: per stack, how many of its last blocks live in host
      memory (0: none, but the residuals get their spares).
    spare_buffers: give every stacked host leaf a ``DoubleBuffer``, so the
      copies hide behind the compute, at twice the host memory streamed.
      False: each fetch waits for its leaf's write-back. Default: True
      unless ``interleave``.
    interleave: split every stacked host leaf three ways by block index
      (``Interleaved``): the copies are independent as with spare buffers,
      in one host copy; the step's loop runs three blocks per iteration.
    residuals_on_device: per stack, how many of its first blocks (none of
      them streamed) keep their whole state, ``kahan``'s offloaded residuals
      included, on the device: where a block's residuals cross PCIe in more
      time than its backward computes (default: none).

  Returns:
    ``(model, params, state)``, split stacks joined by ``continue_stack``.

  Raises:
    ValueError: for a count per stack that does not fit.
  """
  check_params(model, params)
  validation.check_bool("stream_blocks", "interleave", interleave)
  if spare_buffers is None:
    spare_buffers = not interleave
  validation.check_bool("stream_blocks", "spare_buffers", spare_buffers)
  if spare_buffers and interleave:
    raise ValueError(
        "stream_blocks: spare_buffers=True and interleave=True are two ways "
        "to keep a fetch from waiting for a write-back; choose one "
        "(interleave: one host copy, spare_buffers: two)")
  if not isinstance(state, BlockwiseState):
    raise TypeError(f"stream_blocks: state must be the BlockwiseState "
                    f"blockwise_init made, got {type(state).__name__}")
  check_plain_leaves((params, state), "stream_blocks", "(params, state)",
                    "join the stacks first (join_stacks)")
  counts = [num_blocks(stack) for stack in params.stacks]
  num_streamed = _counts(
      "num_streamed", num_streamed, counts, "how many of each stack's last "
      f"blocks to stream, e.g. {tuple(counts)} for all of them")
  if len(state.stacks) != len(counts):
    raise ValueError(
        f"stream_blocks: state has {len(state.stacks)} stacks and params "
        f"{len(counts)}: give the state blockwise_init made for these params")
  kept = (0,) * len(counts) if residuals_on_device is None else _counts(
      "residuals_on_device", residuals_on_device,
      [n - k for n, k in zip(counts, num_streamed)], "how many of each "
      "stack's first blocks keep their state on the device",
      "blocks not streamed")
  blocks, transitions, stacks, states = [], [], [], []
  for s, (k, d, stack, stack_state) in enumerate(
      zip(num_streamed, kept, params.stacks, state.stacks)):
    n = num_blocks(stack)
    if d and not any(map(placement.in_host_memory, jax.tree.leaves(
        stack_state))):
      validation.warn(f"stream_blocks: residuals_on_device[{s}] = {d} moves "
                      f"nothing: stack {s}'s state is on the device already "
                      "(kahan(..., offload=False))", stacklevel=2)
    parts = [(a, b) for a, b in ((0, d), (d, n - k), (n - k, n)) if a < b]
    for j, (a, b) in enumerate(parts):
      if blocks:  # what runs between this part and the one before it
        transitions.append(continue_stack if j else model.transition(s - 1))
      # streamed: in host memory; the first d blocks: on the device
      where = "pinned_host" if a == n - k else ("device" if b <= d else None)
      def place(x, kind=None):  # used at once: a, b, where are current
        y = _part(x, a, b, where or kind)
        if spare_buffers and placement.in_host_memory(y):
          return DoubleBuffer(y, _spare(y))
        if interleave and placement.in_host_memory(y):
          # dealt where x is (the device, usually), then sent
          return jax.tree.map(lambda p: _part(p, 0, p.shape[0], where),
                              interleaved.interleave(_part(x, a, b, None)))
        return y
      blocks.append(model.blocks[s])
      stacks.append(jax.tree.map(lambda x: place(x, kind="device"), stack))
      states.append(jax.tree.map(place, stack_state))
  return (BlockwiseModel(model.embed, tuple(blocks), model.head,
                         tuple(transitions)),
          BlockwiseParams(params.embed, tuple(stacks), params.head),
          BlockwiseState(state.embed, tuple(states), state.head))


def join_stacks(model: BlockwiseModel, params: BlockwiseParams
                ) -> tuple[BlockwiseModel, BlockwiseParams]:
  """Undoes ``stream_blocks``: each stack whole again, in device memory.

  Args:
    model: the model ``stream_blocks`` returned.
    params: a ``BlockwiseParams`` laid out as that model's stacks (or any
      tree so laid out, e.g. ``kahan_residuals(state)``).

  Returns:
    ``(model, params)`` with one stack per original stack.
  """
  if not isinstance(model, BlockwiseModel):
    raise TypeError(f"join_stacks: model must be the BlockwiseModel "
                    f"stream_blocks returned, got {type(model).__name__}")
  if (not isinstance(params, BlockwiseParams)
      or len(params.stacks) != len(model.blocks)):
    raise ValueError(
        f"join_stacks: params must be a BlockwiseParams with "
        f"{len(model.blocks)} stacks, as the model's, got "
        f"{type(params).__name__}")
  params = front_buffers(params)
  groups = [[0]]
  for s in range(1, len(params.stacks)):
    if model.joins(s - 1):
      groups[-1].append(s)
    else:
      groups.append([s])
  def whole(x):  # a part of a stack, in device memory, blocks in order
    if interleaved.is_interleaved(x):
      return interleaved.deinterleave(placement.on_device(x))
    return placement.on_device(x)
  stacks = [jax.tree.map(lambda *xs: jnp.concatenate([whole(x) for x in xs]),
                         *[params.stacks[s] for s in g],
                         is_leaf=interleaved.is_interleaved)
            for g in groups]
  transitions = (tuple(model.transition(g[-1]) for g in groups[:-1])
                 if model.transitions else ())
  return (BlockwiseModel(model.embed, tuple(model.blocks[g[0]] for g in groups),
                         model.head, transitions),
          BlockwiseParams(params.embed, tuple(stacks), params.head))

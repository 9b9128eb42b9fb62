"""A training step that updates each block inside the backward pass.

A step written as ``jax.value_and_grad`` followed by ``tx.update`` holds the
whole gradient tree at the update: 2 B/param in bfloat16, as much as the
weights (24 GB for FLUX.1-dev's 11.9B params). A fused backward pass (as in
sd-scripts' ``--fused_backward_pass``) updates each weight as soon as its
gradient exists, so only one block's gradients are ever alive.

This module does that for models written as **embed -> scan over stacked
blocks -> head**: the blocks of a stack share one tree of weights with a
leading block axis (``lax.scan`` or ``nnx.scan`` over ``nnx.vmap``-built
blocks, as in MaxText and MaxDiffusion), and there may be several stacks one
after the other (FLUX: 19 double-stream, then 38 single-stream blocks)::

    carry, consts = embed(theta_E, batch)
    carry = block_s(theta_{s,i}, carry, consts)     for each stack s, block i
    carry = transition_s(carry, consts)             between stacks s and s + 1
    loss  = head(theta_H, carry, consts, batch)

``consts`` are the values every block reads and none changes (FLUX's
conditioning vector and rotary tables); a transition has no weights (FLUX
joins its text and image tokens between its two stacks). The step:

1. Forward: the embedding (its vjp kept), then each stack by ``lax.scan``,
   keeping only each block's input ``carry`` (block remat); then the head.
2. The head's gradient, and its update: ``u, s = tx.update(g, s, theta_H)``.
3. Backward, block by block from the last: with ``c_i`` the saved input,
   ``(g_i, ct, ct_k) = vjp(block, theta_i, c_i, consts)(ct)``; then
   ``theta_i, s_i <- update(g_i, s_i, theta_i)`` right there, written back
   into the stack in place (a ``fori_loop`` carrying the stacked weights and
   state, so with donation nothing is copied); ``ct`` goes on to block
   ``i - 1`` and ``ct_k`` is summed into the cotangent of ``consts``.
4. The embedding's gradient from ``(ct, ct_consts)``, and its update.

One block's gradients are alive at a time, and the optimizer's scratch is
one block's. With ``kahan(...)`` a stack's residuals are one host array per
leaf; a block's slice comes to the device for its update and goes back after.

Streaming: whatever lives in host memory (the residuals; with
``stream_blocks``, whole blocks' weights and state) is software-pipelined,
fetched a block ahead and written back a block behind, so the copies run
beside the compute. ``stream_blocks`` gives each host leaf a spare buffer
(``DoubleBuffer``): a block is read from one and written into the other, so
a write-back and the next fetch are independent and both PCIe directions
run at once.

Which transformations: ``tx`` is applied to each group of weights (the
embedding, each block, the head) with its own state, so it must act leaf by
leaf (its per-leaf form, ``optax_kahan.per_leaf``, with no round before the
update) or reduce late: Prodigy with ``lagged_d=True`` steps each block with
the ``d`` known at the start of the step; the step adds the groups'
``LateSums`` up, folded into ``d`` at the next step (a one-step lag, as in
fused-backward Prodigy variants).

References:
  sd-scripts (kohya-ss) ``--fused_backward_pass`` and PR #2159;
  Lv et al., "Full Parameter Fine-tuning for Large Language Models with
  Limited Resources" (LOMO), arXiv:2306.09782, 2023.
"""

from __future__ import annotations

import functools
from typing import Any, Callable, NamedTuple, Optional, Sequence

from flax import linen as nn
from flax import nnx
import jax
import jax.numpy as jnp
import numpy as np
import optax
from jax import lax

from optax_kahan._src import kahan
from optax_kahan._src import per_leaf
from optax_kahan._src import placement
from optax_kahan._src import traced
from optax_kahan._src import validation
from optax_kahan._src.double_buffer import DoubleBuffer
from optax_kahan._src.double_buffer import front_buffers
from optax_kahan._src.double_buffer import is_double as _is_double

Carry = Any
Consts = Any
Batch = Any


def continue_stack(carry: Carry, consts: Consts) -> Carry:
  """The transition between two parts of one stack (``stream_blocks``): the
  identity. The step sums the parts' cotangents of ``consts`` as it would
  one stack's, so splitting a stack changes no bit of the gradients."""
  del consts
  return carry


class BlockwiseModel(NamedTuple):
  """A model as embed -> scan over stacked blocks -> head, as pure functions.

  Attributes:
    embed: ``embed(embed_params, batch) -> (carry, consts)``.
    blocks: one function per stack, ``block(block_params, carry, consts) ->
      carry``, where ``block_params`` is one block's slice of the stack (no
      leading axis) and the carry keeps its structure, shapes and dtypes.
    head: ``head(head_params, carry, consts, batch) -> loss``, a scalar.
    transitions: none, or one function per pair of consecutive stacks,
      ``transition(carry, consts) -> carry``, run after stack ``s`` (the
      next stack's carry may have another structure), or None where
      nothing runs. ``continue_stack`` joins the parts of a stack that
      ``stream_blocks`` split.
  """
  embed: Callable[[Any, Batch], tuple[Carry, Consts]]
  blocks: tuple[Callable[[Any, Carry, Consts], Carry], ...]
  head: Callable[[Any, Carry, Consts, Batch], jax.Array]
  transitions: tuple[Callable[[Carry, Consts], Carry], ...] = ()

  def transition(self, s: int) -> Optional[Callable[[Carry, Consts], Carry]]:
    """What runs after stack ``s``, or None (nothing)."""
    if not self.transitions or s == len(self.blocks) - 1:
      return None
    return self.transitions[s]


class BlockwiseParams(NamedTuple):
  """The weights: ``stacks[s]`` has a leading axis of one entry per block."""
  embed: Any
  stacks: tuple[Any, ...]
  head: Any


class BlockwiseState(NamedTuple):
  """``tx``'s state per group; each stack's is its blocks' states stacked."""
  embed: optax.OptState
  stacks: tuple[optax.OptState, ...]
  head: optax.OptState


def _residuals_of(state: BlockwiseState) -> BlockwiseParams:
  """``kahan_residuals`` of a blockwise state: each group's residuals (the
  stacks' with their block axis)."""
  return BlockwiseParams(
      kahan.kahan_residuals(state.embed),
      tuple(kahan.kahan_residuals(s) for s in state.stacks),
      kahan.kahan_residuals(state.head))


def _with_residuals(state: BlockwiseState,
                    residuals: BlockwiseParams) -> BlockwiseState:
  """``kahan_replace_residuals`` of a blockwise state, group by group."""
  if (not isinstance(residuals, BlockwiseParams)
      or len(residuals.stacks) != len(state.stacks)):
    raise ValueError(
        "the residuals of a BlockwiseState are a BlockwiseParams with "
        f"{len(state.stacks)} stacks (as kahan_residuals gives), got "
        f"{type(residuals).__name__}")
  return BlockwiseState(
      kahan.kahan_replace_residuals(state.embed, residuals.embed),
      tuple(kahan.kahan_replace_residuals(s, r)
            for s, r in zip(state.stacks, residuals.stacks)),
      kahan.kahan_replace_residuals(state.head, residuals.head))


kahan.register_grouped_state(BlockwiseState, _residuals_of, _with_residuals)


def _check_params(model: BlockwiseModel, params: BlockwiseParams) -> None:
  _check_stacks(params)
  if len(params.stacks) != len(model.blocks):
    raise ValueError(f"the model has {len(model.blocks)} block functions but "
                     f"params.stacks has {len(params.stacks)} stacks")
  if model.transitions and len(model.transitions) != len(model.blocks) - 1:
    raise ValueError(f"the model has {len(model.transitions)} transitions "
                     f"for {len(model.blocks)} stacks; give one per pair of "
                     "consecutive stacks, or none")


def _check_stacks(params: Any) -> None:
  """A ``BlockwiseParams`` whose stacks' leaves share a leading block axis,
  and no array an earlier jitted call took (donated)."""
  if not isinstance(params, BlockwiseParams):
    raise TypeError(f"params must be a BlockwiseParams, got "
                    f"{type(params).__name__}")
  for path, x in jax.tree_util.tree_flatten_with_path(params)[0]:
    if (isinstance(x, jax.Array) and not isinstance(x, jax.core.Tracer)
        and x.is_deleted()):
      raise ValueError(
          f"params{jax.tree_util.keystr(path)} was donated to an earlier "
          "jitted call (its buffer is deleted): pass the arrays that call "
          "returned")
  for s, stack in enumerate(params.stacks):
    if isinstance(stack, (list, tuple)):
      raise TypeError(
          f"params.stacks[{s}] is a {type(stack).__name__} of "
          f"{len(stack)} entries; a stack is one tree whose leaves carry the "
          "blocks on a leading axis: jax.tree.map(lambda *b: jnp.stack(b), "
          "*blocks)")
    flat = jax.tree_util.tree_flatten_with_path(stack)[0]
    if not flat:
      raise ValueError(f"params.stacks[{s}] has no arrays")
    first_path, first = flat[0][0], jnp.shape(flat[0][1])
    for path, x in flat:
      shape = jnp.shape(x)
      if not shape or not first or shape[0] != first[0]:
        raise ValueError(
            f"params.stacks[{s}]: every leaf needs the same leading (block) "
            f"axis; leaf {jax.tree_util.keystr(path)} has shape "
            f"{list(shape)}, the first leaf "
            f"{jax.tree_util.keystr(first_path)} {list(first)}")


def _split_module(module: nnx.Module, what: str
                  ) -> tuple[Callable[..., Any], Any]:
  """``(fn, params)`` with ``fn(params, *args) = merge(module)(*args)``."""
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

  ``embed(batch) -> (carry, consts)``, each stacked module's block
  ``block(carry, consts) -> carry`` and ``head(carry, consts, batch) -> loss``
  are the modules' ``__call__``. A stack is one module whose ``nnx.Param``
  leaves have a leading block axis (``nnx.vmap`` over a block's constructor,
  the layout ``nnx.scan`` runs). Write the trained params back with
  ``nnx.update(module, params.embed)`` and so on.

  Args:
    embed: the embedding module.
    stacks: the stacked block modules, in the order they run.
    head: the head module, returning the scalar loss.
    transitions: the model's ``transitions`` (functions without weights).

  Returns:
    ``(model, params)`` for ``blockwise_step``; the params are the modules'
    ``nnx.State`` of ``nnx.Param``.

  Raises:
    ValueError: if a module holds state other than ``nnx.Param`` (batch
      statistics, RNG counters), which the step would not carry.
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

  ``fn(params, *args) = module.apply({"params": params}, *args,
  method=method)``. For a stack run under ``nn.scan(Block,
  variable_axes={"params": 0}, ...)`` (the layout MaxText and MaxDiffusion
  train in), the scanned module's params are already one stack (a leading
  block axis on every leaf); the block function is ``linen_apply`` of one
  unscanned ``Block``, with a ``method`` that maps ``(carry, consts)`` to its
  call (keyword arguments, a ``(carry, None)`` return)::

    model = BlockwiseModel(
        embed=linen_apply(Embed(cfg)),
        blocks=(linen_apply(Block(cfg), lambda m, c, k: m(c, **k)[0]),),
        head=linen_apply(Head(cfg)))
    params = BlockwiseParams(p["embed"], (p["blocks"],), p["head"])

  Args:
    module: the (unbound) module of one part, configured as in the model.
    method: ``method(module, *args)``, what to call (default ``__call__``).

  Returns:
    ``fn(params, *args)``. A module that needs collections other than
    ``params`` (batch statistics) fails in ``apply``, naming them.
  """

  def fn(params: Any, *args: Any) -> Any:
    return module.apply({"params": params}, *args, method=method)

  return fn


def num_blocks(stack: Any) -> int:
  """The number of blocks in a stack (its leaves' leading axis)."""
  return jnp.shape(jax.tree.leaves(stack)[0])[0]


#: Compiler options for a streamed step: ``jax.jit(step,
#: compiler_options=STREAMING_COMPILER_OPTIONS)``. By default XLA:GPU's
#: latency-hiding scheduler keeps about one asynchronous host transfer in
#: flight beside the compute and runs the others back to back. A streamed
#: block moves one transfer per host leaf in each direction (FLUX.1-dev's
#: double block, weights, state and residuals streamed: about 80 each way),
#: and its transfers should all be in flight at once: at a limit of 64 the
#: fetches of a streamed block wait for write-backs to free a slot. With
#: this (experimental) option the FLUX.1-dev step hides most of its PCIe
#: time (``benchmarks/streaming.py`` compiles it both ways). XLA:CPU
#: accepts and ignores it.
STREAMING_COMPILER_OPTIONS: dict[str, Any] = {
    "xla_gpu_experimental_parallel_async_compute_limit": 256}


def with_front_buffers(layout: Any, values: Any) -> Any:
  """``layout`` holding ``values``: the inverse of ``front_buffers``.

  ``values`` is laid out as ``front_buffers(layout)`` (a checkpoint of it,
  say); each ``DoubleBuffer`` of ``layout`` gets its value as its front and
  keeps its spare, and every other leaf is replaced by its value. Save
  ``front_buffers((params, state))`` rather than the pairs: a pair's role is
  part of the tree's structure, not its arrays, so a checkpoint of the pairs
  restored into a layout with the other role would read the stale buffer.

  Example:
    >>> layout = {"w": DoubleBuffer(jnp.zeros(2), jnp.ones(2)), "b": 0.0}
    >>> tree = with_front_buffers(layout, {"w": jnp.full(2, 5.0), "b": 1.0})
    >>> front_buffers(tree)["w"].tolist(), tree["w"].back.tolist(), tree["b"]
    ([5.0, 5.0], [1.0, 1.0], 1.0)

  Args:
    layout: a tree with ``DoubleBuffer`` nodes (``stream_blocks``' layout).
    values: the values, as ``front_buffers(layout)`` is laid out.

  Returns:
    ``layout``'s pairs and roles, ``values``' arrays.

  Raises:
    ValueError: for a value in device memory where ``layout``'s is in host
      memory (orbax restores host arrays whose type says device memory:
      ``jax.device_put(x, jax.memory.Space.Host)`` places them), or a spare
      buffer a donating step has deleted, naming the leaf.
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

  return jax.tree_util.tree_map_with_path(put, layout, values,
                                          is_leaf=_is_double)


def _back(tree: Any) -> Any:
  return jax.tree.map(lambda x: x.back if _is_double(x) else x, tree,
                      is_leaf=_is_double)


def _flip(tree: Any, new: Any) -> Any:
  """``new`` (laid out as ``front_buffers(tree)``) placed as ``tree`` is: each
  ``DoubleBuffer``'s new values in its back buffer, which becomes front."""
  return jax.tree.map(lambda x, y: x.flip(y) if _is_double(x) else y, tree,
                      new, is_leaf=_is_double)


def _check_not_doubled(tree: Any, what: str, instead: str) -> None:
  for path, x in jax.tree_util.tree_flatten_with_path(
      tree, is_leaf=_is_double)[0]:
    if _is_double(x):
      raise ValueError(
          f"{what}: {jax.tree_util.keystr(path)} is a DoubleBuffer "
          f"(stream_blocks' layout already); {instead}")


def _spare(x: Any) -> Any:
  """A second host buffer like ``x`` (its contents never read)."""
  if isinstance(x, jax.ShapeDtypeStruct):
    return x
  # made in host memory, not on the device and copied out
  return jax.device_put(np.zeros(x.shape, x.dtype), x.sharding)


def _part(x: Any, start: int, stop: int, kind: Optional[str]) -> Any:
  """Blocks ``start:stop`` of a stacked leaf (an array or an abstract
  ``jax.ShapeDtypeStruct``), in memory ``kind`` (``"pinned_host"`` or
  ``"device"``; None: where ``x`` is)."""
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


def stream_blocks(
    model: BlockwiseModel, params: BlockwiseParams, state: BlockwiseState,
    num_streamed: Sequence[int], *, spare_buffers: bool = True,
) -> tuple[BlockwiseModel, BlockwiseParams, BlockwiseState]:
  """Moves the last blocks of each stack, weights and state, to host memory.

  ``blockwise_step`` streams whatever lives in host memory (``pinned_host``):
  the forward pass fetches block ``j + 1``'s weights while block ``j``
  computes; the backward pass, while block ``j`` computes, writes block
  ``j + 1``'s new weights, state and residuals back and fetches block
  ``j - 1``'s. The device then holds two blocks of those stacks instead of
  all of them (sd-scripts' ``--blocks_to_swap``, applied to the optimizer
  state and ``kahan``'s residuals too).

  Layout: stack ``s`` with ``0 < num_streamed[s] < num_blocks`` becomes two
  parts, its first blocks on the device and its last ``num_streamed[s]`` in
  host memory, joined by the transition ``continue_stack``. The weights of
  the blocks not streamed go to the device from wherever they are (a model
  too large for it is loaded into host memory first); their state stays
  where it is (``kahan``'s residuals in host memory). With
  ``spare_buffers``, every leaf of the stacks in host memory (streamed, or
  ``kahan``'s residuals) becomes a ``DoubleBuffer``: the step reads one
  buffer and writes the other, so both PCIe directions run beside the
  compute, at the cost of a second copy in host memory. ``num_streamed = (0, ...)`` moves
  nothing and gives the residuals their spare. ``join_stacks`` undoes the
  layout.

  The arithmetic is unchanged: the step computes what it computes without
  streaming, bit for bit (Prodigy's late sums aside: they add the parts'
  sums in another order). Call it after ``blockwise_init``, on arrays or on
  abstract ``jax.ShapeDtypeStruct`` leaves (to compile ahead).

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
    params: a ``BlockwiseParams``.
    state: its ``BlockwiseState`` (from ``blockwise_init``).
    num_streamed: per stack, how many of its last blocks live in host
      memory (0 to its number of blocks).
    spare_buffers: give every leaf of the stacks in host memory a second
      buffer (``DoubleBuffer``): twice the host memory of what is streamed, the
      copies hidden behind the compute. False keeps one buffer per leaf:
      each leaf's fetch waits for its write-back.

  Returns:
    ``(model, params, state)`` with the stacks split and placed.

  Raises:
    ValueError: for a count per stack that does not fit.
  """
  _check_params(model, params)
  _check_not_doubled((params, state), "stream_blocks",
                     "join the stacks first (join_stacks)")
  counts = [num_blocks(stack) for stack in params.stacks]
  if (not isinstance(num_streamed, (tuple, list))
      or len(num_streamed) != len(counts)
      or not all(isinstance(k, int) for k in num_streamed)):
    raise ValueError(
        f"stream_blocks: num_streamed must be a tuple of {len(counts)} ints, "
        f"one per stack (blocks per stack: {tuple(counts)}): how many of each "
        f"stack's last blocks to stream, e.g. {tuple(counts)} for all of "
        f"them; got {num_streamed!r}")
  if len(state.stacks) != len(counts):
    raise ValueError(
        f"stream_blocks: state has {len(state.stacks)} stacks and params "
        f"{len(counts)}: give the state blockwise_init made for these params")
  blocks, transitions, stacks, states = [], [], [], []
  for s, (k, stack, stack_state) in enumerate(
      zip(num_streamed, params.stacks, state.stacks)):
    n = num_blocks(stack)
    if not 0 <= k <= n:
      raise ValueError(f"stream_blocks: num_streamed[{s}] = {k}, but stack "
                       f"{s} has {n} blocks")
    parts = [(a, b) for a, b in ((0, n - k), (n - k, n)) if a < b]
    for j, (a, b) in enumerate(parts):
      if blocks:  # what runs between this part and the one before it
        transitions.append(continue_stack if j else model.transition(s - 1))
      # Streamed blocks go to host memory; the others' weights to the
      # device (from wherever they were loaded), their state stays put
      # (kahan's residuals in host memory, unless offload=False).
      streamed = a == n - k
      def place(x, kind=None):  # used at once: a, b, streamed are current
        y = _part(x, a, b, "pinned_host" if streamed else kind)
        if spare_buffers and placement.in_host_memory(y):
          return DoubleBuffer(y, _spare(y))
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

  The parts joined by ``continue_stack`` are concatenated (the values of a
  ``DoubleBuffer``), so the weights can be written back into the model
  (``nnx.update``) or exported. Works on any tree laid out like the params:
  pass ``kahan_residuals(state)`` for the residuals.

  Args:
    model: the model ``stream_blocks`` returned.
    params: a ``BlockwiseParams`` laid out as that model's stacks.

  Returns:
    ``(model, params)`` with one stack per original stack.
  """
  params = front_buffers(params)
  groups = [[0]]
  for s in range(1, len(params.stacks)):
    if model.transition(s - 1) is continue_stack:
      groups[-1].append(s)
    else:
      groups.append([s])
  stacks = [jax.tree.map(lambda *xs: jnp.concatenate(
      [placement.on_device(x) for x in xs]), *[params.stacks[s] for s in g])
            for g in groups]
  transitions = (tuple(model.transition(g[-1]) for g in groups[:-1])
                 if model.transitions else ())
  return (BlockwiseModel(model.embed, tuple(model.blocks[g[0]] for g in groups),
                         model.head, transitions),
          BlockwiseParams(params.embed, tuple(stacks), params.head))


def blockwise_init(tx: optax.GradientTransformation, params: BlockwiseParams,
                   *args: BlockwiseParams) -> BlockwiseState:
  """``tx``'s state for each group: the embedding, every block, the head.

  A stack's state is ``jax.vmap(tx.init)`` of its weights: the state of each
  block's weights on its own, stacked on a leading axis (a step count per
  block, say, all equal). The state is committed where the params are, so
  the jitted step compiles once.

  Args:
    tx: the transformation ``blockwise_step`` will apply.
    params: a ``BlockwiseParams``.
    *args: more arguments of ``tx.init``, each laid out like ``params`` and
      split the same way: ``kahan``'s residuals from
      ``kahan_from_float32``, to start from exact float32 weights.

  Returns:
    A ``BlockwiseState``.

  Raises:
    TypeError, ValueError: for params (or arguments) that are not a
      ``BlockwiseParams``, a stack without one leading axis, or an array an
      earlier jitted call took (donated), naming the leaf.
  """
  _check_stacks(params)
  _check_not_doubled((params, args), "blockwise_init",
                     "initialize before stream_blocks, or pass "
                     "front_buffers(params)")
  for i, tree in enumerate(args):
    if not isinstance(tree, BlockwiseParams):
      raise TypeError(f"blockwise_init's argument {i + 2} must be a "
                      f"BlockwiseParams, got {type(tree).__name__}")
  state = BlockwiseState(
      embed=tx.init(params.embed, *(a.embed for a in args)),
      stacks=tuple(jax.vmap(tx.init)(stack, *(a.stacks[s] for a in args))
                   for s, stack in enumerate(params.stacks)),
      head=tx.init(params.head, *(a.head for a in args)))
  return placement.commit_with(state, params, "blockwise_init")


def blockwise_loss(model: BlockwiseModel, params: BlockwiseParams,
                   batch: Batch) -> jax.Array:
  """The ordinary forward pass: embed, ``lax.scan`` over each stack, head.

  Each block is rematerialized in the backward pass (``jax.checkpoint``), as
  in ``blockwise_step``; ``jax.value_and_grad`` of this is the ordinary step's
  gradient.
  """
  _check_params(model, params)
  params = front_buffers(params)
  carry, consts = model.embed(params.embed, batch)
  for s, stack in enumerate(params.stacks):
    carry, _ = _forward_stack(jax.checkpoint(model.blocks[s]), stack, carry,
                              consts)
    if model.transition(s) not in (None, continue_stack):
      carry = model.transition(s)(carry, consts)
  return model.head(params.head, carry, consts, batch)


def _take(tree: Any, i: jax.Array) -> Any:
  return jax.tree.map(
      lambda x: lax.dynamic_index_in_dim(x, i, keepdims=False), tree)


def _fetch(leaves: list[Any], i: jax.Array) -> list[Any]:
  """Block ``i`` of each stacked host leaf, brought into device memory
  (None for device leaves, sliced where they are used)."""
  return [placement.to_device(lax.dynamic_index_in_dim(x, i, keepdims=False))
          if placement.on_host(x) else None for x in leaves]


def _block_of(leaves: list[Any], staged: list[Any], i: jax.Array
              ) -> list[Any]:
  """Block ``i``: host leaves from ``staged`` (fetched ahead), the others
  sliced from their stacks."""
  return [y if placement.on_host(x)
          else lax.dynamic_index_in_dim(x, i, keepdims=False)
          for x, y in zip(leaves, staged)]


def _write_back(leaves: list[Any], pending: list[Any], i: jax.Array
                ) -> list[Any]:
  """The host leaves with block ``i`` set to ``pending``'s values, sent back
  to host memory."""
  return [lax.dynamic_update_index_in_dim(x, placement.to_host(p), i, 0)
          if placement.on_host(x) else x for x, p in zip(leaves, pending)]


def _forward_stack(block, stack, carry, consts):
  """``lax.scan`` of ``block`` over a stack; the carries that enter each
  block are returned stacked. Leaves in host memory (streamed weights) are
  fetched one block ahead: block ``i + 1``'s copy runs during block ``i``'s
  compute (the last iteration fetches its own block again)."""
  leaves, treedef = jax.tree.flatten(stack)
  last = num_blocks(stack) - 1
  # Device leaves are the scan's xs (their gradient, under jax.grad, is its
  # stacked output, as for a plain lax.scan over the stack).
  device = [None if placement.on_host(x) else x for x in leaves]

  def body(loop, xs):
    c, staged = loop
    sliced, i = xs
    ahead = _fetch(leaves, jnp.minimum(i + 1, last))
    params = treedef.unflatten([y if x is None else x
                                for x, y in zip(sliced, staged)])
    return (block(params, c, consts), ahead), c

  (carry, _), saved = lax.scan(body, (carry, _fetch(leaves, 0)),
                               (device, jnp.arange(last + 1)))
  return carry, saved


def _update(tx: optax.GradientTransformation, grads: Any, state: Any,
            params: Any, staged: bool = False) -> tuple[Any, Any]:
  """``params`` updated by ``tx``. ``staged``: this step brought the state's
  host arrays into device memory and sends them back, which a ``kahan``
  (one that declares ``kahan_staged``) is told."""
  extra = ({"kahan_staged": True}
           if staged and "kahan_staged" in getattr(tx.update, "static", ())
           else {})
  updates, state = tx.update(grads, state, params, **extra)
  return optax.apply_updates(params, updates), state


def _add_cotangents(a: Any, b: Any) -> Any:
  # Cotangents of integer inputs are float0 zeros, which do not add.
  return jax.tree.map(
      lambda x, y: x if x.dtype == jax.dtypes.float0 else x + y, a, b)


def _is_late(x: Any) -> bool:
  return isinstance(x, per_leaf.LateSums)


def _check_per_group(tx: optax.GradientTransformation, grads: Any,
                     state: Any, params: Any) -> None:
  """Refuses ``tx`` unless it acts leaf by leaf but for late sums."""
  st, reason = traced.stages_of(tx, grads, state, params)
  if st is None:
    raise ValueError(
        f"blockwise_step applies tx to each block on its own, and tx has no "
        f"per-leaf form ({reason}), so that is not provably the same "
        "optimizer; use transformations that act leaf by leaf")
  if st.rounds:
    raise ValueError(
        "blockwise_step updates each block before the other blocks' "
        "gradients exist, but tx sums a statistic over all leaves before its "
        "update (Prodigy's d, a global norm): build it to reduce late, e.g. "
        "prodigy(..., lagged_d=True), which takes each step with the d known "
        "at its start")


def _check_same_rows(tx: optax.GradientTransformation,
                     params: BlockwiseParams) -> None:
  """Refuses ``tx`` unless each group's step gives every leaf the update
  ``tx`` gives it on the whole tree (the stacks' blocks as separate
  leaves): ``traced.same_rows``."""
  abstract = lambda t: jax.tree.map(
      lambda x: jax.ShapeDtypeStruct(jnp.shape(x), jnp.result_type(x)), t)
  blocks = [jax.tree.map(lambda x: jax.ShapeDtypeStruct(
      jnp.shape(x)[1:], jnp.result_type(x)), stack) for stack in params.stacks]
  whole = BlockwiseParams(
      abstract(params.embed),
      tuple((b,) * num_blocks(stack) for b, stack in zip(blocks, params.stacks)),
      abstract(params.head))
  groups, start = [], 0
  for tree in (whole.embed, *(b for s in whole.stacks for b in s),
               whole.head):
    size = len(jax.tree.leaves(tree))
    groups.append((tree, list(range(start, start + size))))
    start += size
  reason = traced.same_rows(tx, whole, groups)
  if reason:
    raise ValueError(
        "blockwise_step applies tx to each group of leaves (the embedding, "
        "each block, the head) on its own, and that is not tx on the whole "
        f"tree: {reason}. Compute masks and labels from the leaf's own path "
        "or shape, clip per leaf (optax.clip_by_block_rms), and give Prodigy "
        "lagged_d=True")


def _like(x: jax.Array, where: jax.Array) -> jax.Array:
  """``x`` in the memory ``where`` lives in (a streamed stack's: host)."""
  return placement.to_host(x) if placement.on_host(where) else x


def _sum_late(state: BlockwiseState) -> BlockwiseState:
  """Gives every ``LateSums`` of the state (each group's, over its own
  leaves; the blocks' one per block) the sums over all groups."""
  groups = [state.embed, *state.stacks, state.head]
  found = [validation.find(g, per_leaf.LateSums) for g in groups]
  totals = []
  for j in range(len(found[0])):
    parts = [found[0][j].sums, found[-1][j].sums]
    parts += [jax.tree.map(lambda x: jnp.sum(placement.on_device(x), axis=0),
                           g[j].sums) for g in found[1:-1]]
    totals.append(jax.tree.map(lambda *xs: sum(xs[1:], xs[0]), *parts))

  def with_totals(tree):
    it = iter(totals)
    return jax.tree.map(
        lambda x: per_leaf.LateSums(jax.tree.map(
            lambda t, s: _like(jnp.broadcast_to(t, s.shape), s), next(it),
            x.sums))
        if _is_late(x) else x, tree, is_leaf=_is_late)

  return BlockwiseState(
      embed=with_totals(state.embed),
      stacks=tuple(with_totals(s) for s in state.stacks),
      head=with_totals(state.head))


def _backward_stack(tx, block, stacks, spares, inputs, consts, ct, ct_consts):
  """The reverse loop over one stack: each block's vjp, then its update.

  ``stacks`` is the stack and its state; ``spares`` the same, where a
  ``DoubleBuffer``'s back buffer stands for its front (``_back``). Returns
  the carry's cotangent, the sum of the blocks' cotangents of ``consts``
  (from ``ct_consts``, zero for a whole stack, in this order, as JAX's
  transpose of ``lax.scan``: ``blockwise_loss``'s gradient bit for bit), and
  the new stack and state (their host leaves in the spares, if any).

  Leaves in host memory (``kahan``'s residuals; streamed weights and state)
  are software-pipelined: while block ``i`` computes, block ``i + 1``'s new
  ones are written back and block ``i - 1``'s are copied in. A leaf with a
  spare is read from its front and written into its spare: the two copies
  are independent and start together with the iteration. A leaf without
  one is read from the array its write-back produced (different blocks, in
  that order), so XLA copies no buffer, but the fetch waits for the
  write-back. The first iteration writes back block ``n - 1``'s old values
  (fetched before the loop) and the last fetches block 0 again: one block
  of each direction more than needed per stack.
  """
  reads, treedef = jax.tree.flatten(stacks)
  leaves = jax.tree.leaves(spares)
  spare = [x is not y for x, y in zip(reads, leaves)]
  last = num_blocks(stacks[0]) - 1

  def body(j, loop):
    ct, ct_consts, leaves, staged, pending = loop
    i = last - j
    leaves = _write_back(leaves, pending, jnp.minimum(i + 1, last))
    ahead = _fetch([x if s else y for x, y, s in zip(reads, leaves, spare)],
                   jnp.maximum(i - 1, 0))
    ct, ct_block, leaves, pending = _step_block(
        tx, block, leaves, treedef, staged, i, inputs, consts, ct)
    return ct, _add_cotangents(ct_consts, ct_block), leaves, ahead, pending

  staged = _fetch(reads, last)
  ct, ct_consts, leaves, _, pending = lax.fori_loop(
      0, last + 1, body, (ct, ct_consts, leaves, staged, staged))
  stack, stack_state = treedef.unflatten(_write_back(leaves, pending, 0))
  return ct, ct_consts, stack, stack_state


def _step_block(tx, block, leaves, treedef, staged, k, inputs, consts, ct):
  """Block ``k`` of a stack (its host leaves in ``staged``): its vjp, then its
  update. Returns the cotangents (carry, ``consts``), the stack's leaves with
  the new device leaves written in place, and the new host leaves (None for
  the others), which the caller writes back."""
  params, state = treedef.unflatten(_block_of(leaves, staged, k))
  _, vjp = jax.vjp(block, params, _take(inputs, k), consts)
  grads, ct, ct_block = vjp(ct)
  # On the CPU, XLA would fuse the block's update into the stacks' in-place
  # writes, recomputing the new moments there from the old stacked ones,
  # and then copy every stack the loop carries; an island prevents it.
  new = jax.tree.leaves(per_leaf.apart_on_cpu(
      functools.partial(_update, tx, staged=True), grads, state, params))
  pending = [y if placement.on_host(x) else None for x, y in zip(leaves, new)]
  leaves = [x if placement.on_host(x)
            else lax.dynamic_update_index_in_dim(x, y, k, 0)
            for x, y in zip(leaves, new)]
  return ct, ct_block, leaves, pending


def blockwise_step(
    model: BlockwiseModel,
    tx: optax.GradientTransformation,
    params: BlockwiseParams,
    state: BlockwiseState,
    batch: Batch,
) -> tuple[jax.Array, BlockwiseParams, BlockwiseState]:
  """One training step that updates each block inside the backward pass.

  Computes ``loss = blockwise_loss(model, params, batch)`` and, per group of
  weights ``theta`` (embedding, each block, head) with state ``s``::

    g         = d loss / d theta
    u, s      = tx.update(g, s, theta)
    theta     = optax.apply_updates(theta, u)

  as the module docstring describes: the head's update after the forward
  pass, each block's inside the reverse loop, the embedding's last: the
  arithmetic of the ordinary step (``jax.value_and_grad`` of
  ``blockwise_loss``, then ``tx.update``) on the blocks' weights as separate
  leaves.

  Jit it with the params and state donated (``donate_argnums=(0, 1)``), so
  the stacks are updated in place. The memory figures are the compiled
  programs' (``benchmarks/blockwise.py``): on the GPU and the CPU, fewer
  temporaries than the ordinary step.

  Leaves in host memory (``kahan``'s residuals, ``stream_blocks``' streamed
  blocks) are fetched a block ahead and written back a block behind. A
  ``DoubleBuffer`` is read from its front; the new values go into its back,
  and the returned pair has the roles swapped (the jitted step compiles
  once per role). A streamed step wants
  ``compiler_options=STREAMING_COMPILER_OPTIONS`` on its ``jax.jit``.

  Args:
    model: the model's functions.
    tx: a leaf-by-leaf gradient transformation, ``kahan`` of one, or the
      Prodigy family with ``lagged_d=True``.
    params: a ``BlockwiseParams``.
    state: from ``blockwise_init(tx, params)`` or a previous step.
    batch: passed to ``embed`` and ``head``.

  Returns:
    ``(loss, new_params, new_state)``; the loss is that of ``params``.

  Raises:
    TypeError, ValueError: for params or state of the wrong structure, or a
      ``tx`` not provably the same optimizer per block.

  Example:
    >>> import optax
    >>> model = BlockwiseModel(
    ...     embed=lambda p, x: (x * p["w"], ()),
    ...     blocks=(lambda p, h, _: jnp.tanh(h @ p["w"]),),
    ...     head=lambda p, h, _, x: jnp.mean((h @ p["w"] - x) ** 2))
    >>> params = BlockwiseParams(
    ...     embed={"w": jnp.ones(4)}, stacks=({"w": jnp.ones((3, 4, 4)) / 4},),
    ...     head={"w": jnp.eye(4)})
    >>> tx = optax.adamw(1e-3)
    >>> state = blockwise_init(tx, params)
    >>> loss, params, state = blockwise_step(model, tx, params, state,
    ...                                      jnp.arange(4.0))

  References:
    sd-scripts ``--fused_backward_pass``; Lv et al., 2023 (LOMO).
  """
  _check_params(model, params)
  if not isinstance(state, BlockwiseState):
    raise TypeError(f"state must be a BlockwiseState (from blockwise_init), "
                    f"got {type(state).__name__}")
  if len(state.stacks) != len(params.stacks):
    raise ValueError(f"state has {len(state.stacks)} stacks, params "
                     f"{len(params.stacks)}")

  # A DoubleBuffer is read from its front and written into its back.
  layout = (params, state)
  params, state = front_buffers(layout)
  _check_same_rows(tx, params)
  spares = _back(layout)
  (carry, consts), embed_vjp = jax.vjp(lambda p: model.embed(p, batch),
                                       params.embed)
  inputs, transitions = [], []
  for s, stack in enumerate(params.stacks):
    carry, saved = _forward_stack(model.blocks[s], stack, carry, consts)
    inputs.append(saved)
    transition_vjp = None
    if model.transition(s) not in (None, continue_stack):
      carry, transition_vjp = jax.vjp(model.transition(s), carry, consts)
    transitions.append(transition_vjp)
  loss, head_vjp = jax.vjp(lambda p, c, k: model.head(p, c, k, batch),
                           params.head, carry, consts)
  grads, ct, ct_consts = head_vjp(jnp.ones_like(loss))
  _check_per_group(tx, grads, state.head, params.head)
  head, head_state = _update(tx, grads, state.head, params.head)

  stacks = list(params.stacks)
  stack_states = list(state.stacks)
  zeros = jax.tree.map(
      lambda x: jnp.zeros(jnp.shape(x), jax.dtypes.float0)
      if not jnp.issubdtype(jnp.result_type(x), jnp.inexact)
      else jnp.zeros_like(x), consts)
  ct_stack = zeros
  for s in reversed(range(len(stacks))):
    if transitions[s] is not None:
      ct, ct_transition = transitions[s](ct)
      ct_consts = _add_cotangents(ct_consts, ct_transition)
    ct, ct_stack, stacks[s], stack_states[s] = _backward_stack(
        tx, model.blocks[s], (stacks[s], stack_states[s]),
        (spares[0].stacks[s], spares[1].stacks[s]), inputs[s], consts, ct,
        ct_stack)
    if s == 0 or model.transition(s - 1) is not continue_stack:
      ct_consts = _add_cotangents(ct_consts, ct_stack)
      ct_stack = zeros
    # else the part before continues this stack's sum, as one stack's would
  grads, = embed_vjp((ct, ct_consts))
  embed, embed_state = _update(tx, grads, state.embed, params.embed)

  new_state = _sum_late(
      BlockwiseState(embed_state, tuple(stack_states), head_state))
  new_params, new_state = _flip(
      layout, (BlockwiseParams(embed, tuple(stacks), head), new_state))
  return loss, new_params, new_state

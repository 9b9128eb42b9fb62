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
fetched a block or two ahead and written back a block behind, so the copies
run beside the compute. ``stream_blocks`` lays a stack's host data out as
its even and odd blocks, so that a write-back and the next fetch use
different buffers and both PCIe directions run at once.

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
import optax
from jax import lax

from optax_kahan._src import per_leaf
from optax_kahan._src import validation
from optax_kahan._src.leaves import commit_with

Carry = Any
Consts = Any
Batch = Any


def continue_stack(carry: Carry, consts: Consts) -> Carry:
  """The transition between two parts of one stack (``stream_blocks``): the
  identity. The step sums the parts' cotangents of ``consts`` as it would
  one stack's, so splitting a stack changes no bit of the gradients."""
  del consts
  return carry


def alternate(carry: Carry, consts: Consts) -> Carry:
  """Marks stacks ``s`` and ``s + 1`` (``transitions[s] = alternate``) as the
  even and the odd blocks of one stack, run in alternation: 0, 1, 2, ...

  ``stream_blocks`` lays out so each part of a stack whose blocks hold data in
  host memory: two host buffers per leaf let a block's write-back (into one)
  and the next block's fetch (from the other) run at the same time. It is a
  marker for ``blockwise_step`` and ``blockwise_loss``, not a function to
  run."""
  raise TypeError("alternate marks two stacks as one stack's even and odd "
                  "blocks; blockwise_step and blockwise_loss run them, it is "
                  "not called")


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
    flat = jax.tree_util.tree_flatten_with_path(stack)[0]
    if not flat:
      raise ValueError(f"params.stacks[{s}] has no arrays")
    first = jnp.shape(flat[0][1])
    for path, x in flat:
      shape = jnp.shape(x)
      if not shape or not first or shape[0] != first[0]:
        raise ValueError(
            f"params.stacks[{s}]: every leaf needs the same leading (block) "
            f"axis; leaf {jax.tree_util.keystr(path)} has shape "
            f"{list(shape)}, the first leaf {list(first)}")


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


def _part(x: Any, start: int, stop: int, host: bool, stride: int = 1
          ) -> Any:
  """Blocks ``start:stop:stride`` of a stacked leaf (an array or an abstract
  ``jax.ShapeDtypeStruct``), in host memory if ``host``."""
  if isinstance(x, jax.ShapeDtypeStruct):
    sharding = x.sharding
    if host and sharding is not None:
      sharding = sharding.with_memory_kind("pinned_host")
    return jax.ShapeDtypeStruct(
        (len(range(start, stop, stride)), *x.shape[1:]), x.dtype,
        sharding=sharding)
  # static: no gather on the host
  part = lax.slice_in_dim(x, start, stop, stride)
  return per_leaf.to_host(part) if host else part


def stream_blocks(
    model: BlockwiseModel, params: BlockwiseParams, state: BlockwiseState,
    num_streamed: Sequence[int], *, alternate_buffers: bool = True,
) -> tuple[BlockwiseModel, BlockwiseParams, BlockwiseState]:
  """Moves the last blocks of each stack, weights and state, to host memory.

  ``blockwise_step`` streams whatever lives in host memory (``pinned_host``):
  the forward pass fetches block ``j + 1``'s weights while block ``j``
  computes; the backward pass, while block ``j`` computes, writes block
  ``j + 1``'s new weights, state and residuals back and fetches the next
  block's. The device then holds a few blocks of those stacks instead of
  all of them (sd-scripts' ``--blocks_to_swap``, applied to the optimizer
  state and ``kahan``'s residuals too).

  Layout: stack ``s`` with ``0 < num_streamed[s] < num_blocks`` becomes two
  parts, its first blocks on the device and its last ``num_streamed[s]`` in
  host memory, joined by the transition ``continue_stack``. With
  ``alternate_buffers``, a part whose blocks hold host data (streamed, or
  ``kahan``'s residuals) is laid out as two stacks, its even and its odd
  blocks, joined by ``alternate``: a block's write-back goes into one and
  the next fetch comes from the other, so the two PCIe directions run at
  once. ``num_streamed = (0, ...)`` moves nothing and lays the residuals out
  so. ``join_stacks`` undoes the layout.

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
    >>> [num_blocks(stack) for stack in params.stacks]  # device, even, odd
    [2, 2, 1]
    >>> loss, params, state = blockwise_step(model, tx, params, state,
    ...                                      jnp.arange(4.0))

  Args:
    model: the model's functions.
    params: a ``BlockwiseParams``.
    state: its ``BlockwiseState`` (from ``blockwise_init``).
    num_streamed: per stack, how many of its last blocks live in host
      memory (0 to its number of blocks).
    alternate_buffers: lay each part with host data out as its even and odd
      blocks (two buffers per leaf: the write-back and the next fetch run at
      once; four blocks' host data on the device). False keeps one buffer
      per leaf: two blocks' host data on the device, a lower peak, and each
      leaf's two directions one after the other.

  Returns:
    ``(model, params, state)`` with the stacks split and placed.

  Raises:
    ValueError: for a count per stack that does not fit.
  """
  _check_params(model, params)
  if len(num_streamed) != len(params.stacks) or len(state.stacks) != len(
      params.stacks):
    raise ValueError(
        f"stream_blocks: num_streamed has {len(num_streamed)} entries and "
        f"state {len(state.stacks)} stacks, for {len(params.stacks)} stacks")
  blocks, transitions, stacks, states = [], [], [], []
  for s, (k, stack, stack_state) in enumerate(
      zip(num_streamed, params.stacks, state.stacks)):
    n = num_blocks(stack)
    if not 0 <= k <= n:
      raise ValueError(f"stream_blocks: num_streamed[{s}] = {k}, but stack "
                       f"{s} has {n} blocks")
    first_part = True
    for a, b in ((0, n - k), (n - k, n)):
      if a == b:
        continue
      host = a == n - k
      cut = lambda tree, a, stride: jax.tree.map(
          lambda x: _part(x, a, b, host, stride), tree)
      # A part whose blocks hold host data goes as its even and odd blocks
      # (two buffers per leaf), when it has two blocks or more.
      on_host = host or any(
          per_leaf.on_host(x) or getattr(getattr(x, "sharding", None),
                                         "memory_kind", None) == "pinned_host"
          for x in jax.tree.leaves(stack_state))
      layout = (((a, 2), (a + 1, 2))
                if alternate_buffers and on_host and b - a >= 2
                else ((a, 1),))
      for j, (start, stride) in enumerate(layout):
        if blocks:  # what runs between this stack and the one before it
          transitions.append(alternate if j else continue_stack
                             if not first_part else model.transition(s - 1))
        first_part = False
        blocks.append(model.blocks[s])
        stacks.append(cut(stack, start, stride))
        states.append(cut(stack_state, start, stride))
  return (BlockwiseModel(model.embed, tuple(blocks), model.head,
                         tuple(transitions)),
          BlockwiseParams(params.embed, tuple(stacks), params.head),
          BlockwiseState(state.embed, tuple(states), state.head))


def _interleave(even: jax.Array, odd: jax.Array) -> jax.Array:
  """Blocks 0, 1, 2, ... from the even and the odd ones."""
  ne, no = even.shape[0], odd.shape[0]
  pairs = jnp.stack([even[:no], odd], axis=1).reshape(2 * no, *odd.shape[1:])
  return jnp.concatenate([pairs, even[no:]]) if ne > no else pairs


def join_stacks(model: BlockwiseModel, params: BlockwiseParams
                ) -> tuple[BlockwiseModel, BlockwiseParams]:
  """Undoes ``stream_blocks``: each stack whole again, in device memory.

  The parts joined by ``continue_stack`` are concatenated and the even and
  odd blocks joined by ``alternate`` interleaved, so the weights can be
  written back into the model (``nnx.update``) or exported. Works on any
  tree laid out like the params: pass ``kahan_residuals(state)`` for the
  residuals.

  Args:
    model: the model ``stream_blocks`` returned.
    params: a ``BlockwiseParams`` laid out as that model's stacks.

  Returns:
    ``(model, params)`` with one stack per original stack.
  """
  groups, current = [], []
  for s in range(len(params.stacks)):
    current.append(s)
    if model.transition(s) not in (continue_stack, alternate):
      groups.append(current)
      current = []
  blocks, transitions, stacks = [], [], []
  for g in groups:
    parts, s = [], 0
    while s < len(g):
      tree = jax.tree.map(_on_device, params.stacks[g[s]])
      if model.transition(g[s]) is alternate:
        odd = jax.tree.map(_on_device, params.stacks[g[s + 1]])
        tree = jax.tree.map(_interleave, tree, odd)
        s += 1
      parts.append(tree)
      s += 1
    stacks.append(jax.tree.map(lambda *xs: jnp.concatenate(xs), *parts)
                  if len(parts) > 1 else parts[0])
    blocks.append(model.blocks[g[0]])
    transitions.append(model.transition(g[-1]))
  transitions = tuple(transitions[:-1]) if model.transitions else ()
  return (BlockwiseModel(model.embed, tuple(blocks), model.head,
                         transitions),
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
  for i, tree in enumerate(args):
    if not isinstance(tree, BlockwiseParams):
      raise TypeError(f"blockwise_init's argument {i + 2} must be a "
                      f"BlockwiseParams, got {type(tree).__name__}")
  state = BlockwiseState(
      embed=tx.init(params.embed, *(a.embed for a in args)),
      stacks=tuple(jax.vmap(tx.init)(stack, *(a.stacks[s] for a in args))
                   for s, stack in enumerate(params.stacks)),
      head=tx.init(params.head, *(a.head for a in args)))
  return commit_with(state, params, "blockwise_init")


def blockwise_loss(model: BlockwiseModel, params: BlockwiseParams,
                   batch: Batch) -> jax.Array:
  """The ordinary forward pass: embed, ``lax.scan`` over each stack, head.

  Each block is rematerialized in the backward pass (``jax.checkpoint``), as
  in ``blockwise_step``; ``jax.value_and_grad`` of this is the ordinary step's
  gradient.
  """
  _check_params(model, params)
  carry, consts = model.embed(params.embed, batch)
  for run in _runs(model, len(params.stacks)):
    block, s = jax.checkpoint(model.blocks[run[0]]), run[-1]
    if len(run) == 1:
      carry, _ = _forward_stack(block, params.stacks[s], carry, consts)
    else:
      carry, _ = _forward_alternating(
          block, [params.stacks[i] for i in run], carry, consts)
    if model.transition(s) not in (None, continue_stack):
      carry = model.transition(s)(carry, consts)
  return model.head(params.head, carry, consts, batch)


def _take(tree: Any, i: jax.Array) -> Any:
  return jax.tree.map(
      lambda x: lax.dynamic_index_in_dim(x, i, keepdims=False), tree)


def _fetch(leaves: list[Any], i: jax.Array) -> list[Any]:
  """Block ``i`` of each stacked host leaf, brought into device memory
  (None for device leaves, sliced where they are used)."""
  return [per_leaf.to_device(lax.dynamic_index_in_dim(x, i, keepdims=False))
          if per_leaf.on_host(x) else None for x in leaves]


def _block_of(leaves: list[Any], staged: list[Any], i: jax.Array
              ) -> list[Any]:
  """Block ``i``: host leaves from ``staged`` (fetched ahead), the others
  sliced from their stacks."""
  return [y if per_leaf.on_host(x)
          else lax.dynamic_index_in_dim(x, i, keepdims=False)
          for x, y in zip(leaves, staged)]


def _write_back(leaves: list[Any], pending: list[Any], i: jax.Array
                ) -> list[Any]:
  """The host leaves with block ``i`` set to ``pending``'s values, sent back
  to host memory."""
  return [lax.dynamic_update_index_in_dim(x, per_leaf.to_host(p), i, 0)
          if per_leaf.on_host(x) else x for x, p in zip(leaves, pending)]


def _forward_stack(block, stack, carry, consts):
  """``lax.scan`` of ``block`` over a stack; the carries that enter each
  block are returned stacked. Leaves in host memory (streamed weights) are
  fetched one block ahead: block ``i + 1``'s copy runs during block ``i``'s
  compute (the last iteration fetches its own block again)."""
  leaves, treedef = jax.tree.flatten(stack)
  last = num_blocks(stack) - 1
  # Device leaves are the scan's xs (their gradient, under jax.grad, is its
  # stacked output, as for a plain lax.scan over the stack).
  device = [None if per_leaf.on_host(x) else x for x in leaves]

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
            params: Any) -> tuple[Any, Any]:
  updates, state = tx.update(grads, state, params)
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
  st, reason = per_leaf.stages_of(tx, grads, state, params)
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


def _on_device(x: jax.Array) -> jax.Array:
  return per_leaf.to_device(x) if per_leaf.on_host(x) else x


def _like(x: jax.Array, where: jax.Array) -> jax.Array:
  """``x`` in the memory ``where`` lives in (a streamed stack's: host)."""
  return per_leaf.to_host(x) if per_leaf.on_host(where) else x


def _sum_late(state: BlockwiseState) -> BlockwiseState:
  """Gives every ``LateSums`` of the state (each group's, over its own
  leaves; the blocks' one per block) the sums over all groups."""
  groups = [state.embed, *state.stacks, state.head]
  found = [validation.find(g, per_leaf.LateSums) for g in groups]
  totals = []
  for j in range(len(found[0])):
    parts = [found[0][j].sums, found[-1][j].sums]
    parts += [jax.tree.map(lambda x: jnp.sum(_on_device(x), axis=0),
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


def _backward_stack(tx, block, stack, stack_state, inputs, consts, ct,
                    ct_consts):
  """The reverse loop over one stack: each block's vjp, then its update.

  Returns the carry's cotangent, the sum of the blocks' cotangents of
  ``consts`` (from ``ct_consts``, zero for a whole stack, in this order, as
  JAX's transpose of ``lax.scan``: ``blockwise_loss``'s gradient bit for
  bit), and the new stack and state.

  Leaves of the stack and its state that live in host memory (``kahan``'s
  residuals; streamed weights and state) are software-pipelined: while block
  ``i`` computes, block ``i + 1``'s new ones are written back and block
  ``i - 1``'s are copied in, beside the compute. Each leaf's copy in reads
  the stack its write-back produced (different blocks, in that order), so
  XLA keeps one buffer per host leaf and copies none; but the two
  directions of one leaf run one after the other (``stream_blocks``' even
  and odd layout, ``_backward_alternating``, lets them run at once). The
  first iteration writes back block ``n - 1``'s old values (fetched before
  the loop) and the last fetches block 0 again: one block of each direction
  more than needed per stack.
  """
  leaves, treedef = jax.tree.flatten((stack, stack_state))
  last = num_blocks(stack) - 1

  def body(j, loop):
    ct, ct_consts, leaves, staged, pending = loop
    i = last - j
    # Block i + 1's new host leaves go back, then block i - 1's come in.
    leaves = _write_back(leaves, pending, jnp.minimum(i + 1, last))
    ahead = _fetch(leaves, jnp.maximum(i - 1, 0))
    ct, ct_block, leaves, pending = _step_block(
        tx, block, leaves, treedef, staged, i, inputs, consts, ct)
    return ct, _add_cotangents(ct_consts, ct_block), leaves, ahead, pending

  staged = _fetch(leaves, last)
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
  with validation.staged_by_caller():
    new = jax.tree.leaves(per_leaf.apart_on_cpu(
        functools.partial(_update, tx), grads, state, params))
  pending = [y if per_leaf.on_host(x) else None for x, y in zip(leaves, new)]
  leaves = [x if per_leaf.on_host(x)
            else lax.dynamic_update_index_in_dim(x, y, k, 0)
            for x, y in zip(leaves, new)]
  return ct, ct_block, leaves, pending


def _runs(model: BlockwiseModel, n: int) -> list[tuple[int, ...]]:
  """The stacks in running order: ``(s,)``, or ``(s, s + 1)`` for the even
  and odd blocks of one stack (joined by ``alternate``)."""
  runs, s = [], 0
  while s < n:
    if model.transition(s) is alternate:
      runs.append((s, s + 1))
      s += 2
    else:
      runs.append((s,))
      s += 1
  return runs


def _forward_alternating(block, stacks, carry, consts):
  """``_forward_stack`` over a stack laid out as its even and odd blocks:
  block ``j + 1``'s host leaves are fetched (from the other buffer) while
  block ``j`` computes. Returns the carry and the saved inputs, per parity."""
  (even, tree_e), (odd, tree_o) = (jax.tree.flatten(t) for t in stacks)
  ne, no = num_blocks(stacks[0]), num_blocks(stacks[1])

  def run(leaves, treedef, staged, k, c):
    return block(treedef.unflatten(_block_of(leaves, staged, k)), c, consts)

  def body(loop, k):
    c, staged = loop
    ahead = _fetch(odd, k)
    out = run(even, tree_e, staged, k, c)
    ahead_even = _fetch(even, jnp.minimum(k + 1, ne - 1))
    return (run(odd, tree_o, ahead, k, out), ahead_even), (c, out)

  (carry, staged), (saved_e, saved_o) = lax.scan(
      body, (carry, _fetch(even, 0)), jnp.arange(no))
  if ne > no:  # the last block is even
    saved_e = jax.tree.map(lambda x, c: jnp.concatenate([x, c[None]]),
                           saved_e, carry)
    carry = run(even, tree_e, staged, ne - 1, carry)
  return carry, (saved_e, saved_o)


def _backward_alternating(tx, block, stacks, states, inputs, consts, ct,
                          ct_consts):
  """``_backward_stack`` over a stack laid out as its even and odd blocks.

  While block ``j`` computes, block ``j + 1``'s new host leaves are written
  back into one parity's buffers and block ``j - 2``'s are fetched from the
  other's, so the two PCIe directions never wait on each other (each
  buffer's fetch is tied to it by an optimization barrier, so its next
  write-back follows it and XLA copies no buffer). Blocks ``j - 1`` and
  ``j - 2`` are on the device ahead of use, ``j + 1`` behind: four blocks'
  host data in flight. Returns what ``_backward_stack`` returns, per parity.
  """
  flat = [jax.tree.flatten(t) for t in zip(stacks, states)]
  treedef = flat[0][1]
  ne, no = num_blocks(stacks[0]), num_blocks(stacks[1])
  m = ne + no

  def sub(j, par, loop):
    ct, ct_consts, bufs, cur, nxt, pending, pidx = loop
    bufs = list(bufs)
    bufs[1 - par] = _write_back(bufs[1 - par], pending, pidx // 2)
    fetched = _fetch(bufs[par], jnp.maximum(j - 2, par) // 2)
    host = [k for k, x in enumerate(bufs[par]) if per_leaf.on_host(x)]
    tied = lax.optimization_barrier(
        ([bufs[par][k] for k in host], [fetched[k] for k in host]))
    bufs[par] = list(bufs[par])
    for k, x, y in zip(host, *tied):
      bufs[par][k], fetched[k] = x, y
    ct, ct_block, bufs[par], pending = _step_block(
        tx, block, bufs[par], treedef, cur, j // 2, inputs[par], consts, ct)
    return (ct, _add_cotangents(ct_consts, ct_block), bufs, nxt, fetched,
            pending, jnp.asarray(j, jnp.int32))

  bufs = [flat[0][0], flat[1][0]]
  top = m - 1  # its parity, then m - 2's
  cur = _fetch(bufs[top % 2], top // 2)
  nxt = _fetch(bufs[1 - top % 2], (top - 1) // 2)
  # the first write-back puts block m - 2's own values back (nothing new yet)
  loop = (ct, ct_consts, bufs, cur, nxt, nxt, jnp.int32(top - 1))
  if m % 2:  # the top block is even: one step before the pairs
    loop = sub(top, 0, loop)

  def body(q, loop):
    j = 2 * (no - 1 - q) + 1
    return sub(j - 1, 0, sub(j, 1, loop))

  ct, ct_consts, bufs, _, _, pending, _ = lax.fori_loop(0, no, body, loop)
  bufs[0] = _write_back(bufs[0], pending, 0)  # block 0's
  (stack_e, state_e), (stack_o, state_o) = (treedef.unflatten(b)
                                            for b in bufs)
  return ct, ct_consts, (stack_e, stack_o), (state_e, state_o)


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

  (carry, consts), embed_vjp = jax.vjp(lambda p: model.embed(p, batch),
                                       params.embed)
  runs = _runs(model, len(params.stacks))
  inputs, transitions = [], []
  for run in runs:
    block, s = model.blocks[run[0]], run[-1]
    if len(run) == 1:
      carry, saved = _forward_stack(block, params.stacks[s], carry, consts)
    else:
      carry, saved = _forward_alternating(
          block, [params.stacks[i] for i in run], carry, consts)
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
  for r in reversed(range(len(runs))):
    run = runs[r]
    if transitions[r] is not None:
      ct, ct_transition = transitions[r](ct)
      ct_consts = _add_cotangents(ct_consts, ct_transition)
    if len(run) == 1:
      s = run[0]
      ct, ct_stack, stacks[s], stack_states[s] = _backward_stack(
          tx, model.blocks[s], stacks[s], stack_states[s], inputs[r], consts,
          ct, ct_stack)
    else:
      ct, ct_stack, new_stacks, new_states = _backward_alternating(
          tx, model.blocks[run[0]], [stacks[i] for i in run],
          [stack_states[i] for i in run], inputs[r], consts, ct, ct_stack)
      for i, new, new_state in zip(run, new_stacks, new_states):
        stacks[i], stack_states[i] = new, new_state
    first = run[0]
    if first == 0 or model.transition(first - 1) is not continue_stack:
      ct_consts = _add_cotangents(ct_consts, ct_stack)
      ct_stack = zeros
    # else the part before continues this stack's sum, as one stack's would
  grads, = embed_vjp((ct, ct_consts))
  embed, embed_state = _update(tx, grads, state.embed, params.embed)

  new_state = _sum_late(
      BlockwiseState(embed_state, tuple(stack_states), head_state))
  return loss, BlockwiseParams(embed, tuple(stacks), head), new_state

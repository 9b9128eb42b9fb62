"""A training step that updates each block inside the backward pass.

``tx`` runs on each group (embedding, block, head) on its own, so it must act
leaf by leaf or reduce late (``late_sums``). See docs/guides/flux.md.

References:
  sd-scripts (kohya-ss) ``--fused_backward_pass`` and PR #2159;
  Lv et al., "Full Parameter Fine-tuning for Large Language Models with
  Limited Resources" (LOMO), arXiv:2306.09782, 2023.
"""

import functools
from typing import Any

import jax
import jax.numpy as jnp
import optax
from jax import lax

from optax_kahan._src import per_leaf
from optax_kahan._src import placement
from optax_kahan._src import traced
from optax_kahan._src import validation
from optax_kahan._src.blockwise import residuals  # noqa: F401  (registers)
from optax_kahan._src.blockwise.late_sums import sum_late
from optax_kahan._src.blockwise.model import Batch
from optax_kahan._src.blockwise.model import BlockwiseModel
from optax_kahan._src.blockwise.model import BlockwiseParams
from optax_kahan._src.blockwise.model import BlockwiseState
from optax_kahan._src.blockwise.model import check_params
from optax_kahan._src.blockwise.model import check_stacks
from optax_kahan._src.blockwise.model import num_blocks
from optax_kahan._src.blockwise.model import stacked_shape
from optax_kahan._src.blockwise import pipeline
from optax_kahan._src.blockwise.streaming import flip
from optax_kahan._src.double_buffer import check_plain_leaves
from optax_kahan._src.double_buffer import front_buffers
from optax_kahan._src.double_buffer import is_double
from optax_kahan._src.interleaved import is_interleaved
from optax_kahan._src.kahan import no_step_counter


def blockwise_init(tx: optax.GradientTransformation, params: BlockwiseParams,
                   *args: BlockwiseParams) -> BlockwiseState:
  """``tx``'s state for each group: the embedding, every block, the head.

  A stack's state is ``jax.vmap(tx.init)`` of its weights (each block's state,
  stacked), committed where the params are, so the jitted step compiles once.

  Args:
    tx: the transformation ``blockwise_step`` will apply.
    params: a ``BlockwiseParams``.
    *args: more arguments of ``tx.init``, each laid out like ``params``
      (``kahan``'s residuals from ``kahan_from_float32``).

  Returns:
    A ``BlockwiseState``.

  Raises:
    TypeError, ValueError: for arguments that are not a ``BlockwiseParams``,
      a stack without one leading axis, or a donated array, naming the leaf.
  """
  validation.check_transformation("blockwise_init", "tx", tx)
  check_stacks(params)
  check_plain_leaves((params, args), "blockwise_init", "(params, *args)",
                    "initialize before stream_blocks")
  for i, tree in enumerate(args):
    if not isinstance(tree, BlockwiseParams):
      raise TypeError(f"blockwise_init's argument {i + 2} must be a "
                      f"BlockwiseParams, got {type(tree).__name__}")
  with no_step_counter():  # nnx_blockwise's params: no nnx.Optimizer's
    state = BlockwiseState(
        embed=tx.init(params.embed, *(a.embed for a in args)),
        stacks=tuple(jax.vmap(tx.init)(stack, *(a.stacks[s] for a in args))
                     for s, stack in enumerate(params.stacks)),
        head=tx.init(params.head, *(a.head for a in args)))
  return placement.commit_with(state, params, "blockwise_init")


def blockwise_loss(model: BlockwiseModel, params: BlockwiseParams,
                   batch: Batch) -> jax.Array:
  """The ordinary forward pass: embed, ``lax.scan`` over each stack, head.

  Blocks are rematerialized (``jax.checkpoint``), as in ``blockwise_step``.
  """
  check_params(model, params)
  params = front_buffers(params)
  carry, consts = model.embed(params.embed, batch)
  for s, stack in enumerate(params.stacks):
    forward = (pipeline.forward_interleaved if pipeline.interleaved_in(stack)
               else pipeline.forward_stack)
    carry, _ = forward(jax.checkpoint(model.blocks[s]), stack, carry, consts)
    if model.transition(s) is not None and not model.joins(s):
      carry = model.transition(s)(carry, consts)
  return model.head(params.head, carry, consts, batch)


def _update(tx: optax.GradientTransformation, grads: Any, state: Any,
            params: Any, staged: bool = False) -> tuple[Any, Any]:
  """``params`` updated by ``tx``; ``staged`` (the state's host arrays are
  staged on the device) is passed to a ``tx`` that declares ``kahan_staged``."""
  extra = ({"kahan_staged": True}
           if staged and "kahan_staged" in getattr(tx.update, "static", ())
           else {})
  updates, state = tx.update(grads, state, params, **extra)
  return optax.apply_updates(params, updates), state


def _add_cotangents(a: Any, b: Any) -> Any:
  # Cotangents of integer inputs are float0 zeros, which do not add.
  return jax.tree.map(
      lambda x, y: x if x.dtype == jax.dtypes.float0 else x + y, a, b)


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
  """Refuses ``tx`` unless each group's update is ``tx``'s on the whole tree
  (the blocks as separate leaves): ``traced.same_rows``."""
  abstract = lambda t: jax.tree.map(
      lambda x: jax.ShapeDtypeStruct(jnp.shape(x), jnp.result_type(x)), t)
  blocks = [jax.tree.map(lambda x: jax.ShapeDtypeStruct(
      stacked_shape(x)[1:], x.dtype), stack, is_leaf=is_interleaved)
            for stack in params.stacks]
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


def _backward_stack(tx, block, layout, inputs, consts, ct, ct_consts):
  """The reverse loop over a stack, each block's vjp then update; ``ct_consts``
  sums as ``lax.scan``'s transpose does (bit for bit ``blockwise_loss``)."""
  if isinstance(inputs, pipeline.SavedInputs):
    return _backward_interleaved(tx, block, layout, inputs, consts, ct,
                                 ct_consts)
  # While block i computes, i + 1 is written back and i - 1 fetched (host
  # leaves and saved inputs); a spare (DoubleBuffer) makes the copies
  # independent, else the fetch waits for the write-back. The ends write back
  # n - 1's old values and fetch 0 twice.
  nodes, treedef = jax.tree.flatten(layout, is_leaf=is_double)
  spare = [is_double(x) for x in nodes]
  reads = [x.front if s else x for x, s in zip(nodes, spare)]
  leaves = [x.back if s else x for x, s in zip(nodes, spare)]  # written
  saved, saved_def = jax.tree.flatten(inputs)
  last = num_blocks(inputs) - 1

  def body(j, loop):
    ct, ct_consts, leaves, staged, pending = loop
    i = last - j
    leaves = pipeline.write_back(leaves, pending, jnp.minimum(i + 1, last))
    ahead = pipeline.fetch([x if s else y for x, y, s in zip(
        reads, leaves, spare)] + saved, jnp.maximum(i - 1, 0))
    here = pipeline.block_of(leaves + saved, staged, i)
    ct, ct_block, leaves, pending = _step_block(
        tx, block, leaves, treedef, here, i, saved_def, consts, ct)
    return ct, _add_cotangents(ct_consts, ct_block), leaves, ahead, pending

  staged = pipeline.fetch(reads + saved, last)
  ct, ct_consts, leaves, _, pending = lax.fori_loop(
      0, last + 1, body, (ct, ct_consts, leaves, staged, staged[:len(reads)]))
  stack, stack_state = treedef.unflatten(
      pipeline.write_back(leaves, pending, 0))
  return ct, ct_consts, stack, stack_state


def _backward_interleaved(tx, block, layout, inputs, consts, ct, ct_consts):
  """``_backward_stack`` for a stack with ``Interleaved`` leaves: the top
  blocks (``pipeline.Rows``), then a loop whose iterations run ``PERIOD``
  blocks each, so that every copy's part is known when the program is built.
  Block ``i - 1``'s fetch reads another part than block ``i + 1``'s
  write-back: it waits only for the write-back one block earlier."""
  leaves, treedef = jax.tree.flatten(layout, is_leaf=is_interleaved)
  saved = jax.tree.leaves(inputs.parts, is_leaf=is_interleaved)
  tops = [jax.tree.leaves(t) for t in inputs.top]
  saved_def = jax.tree.structure(inputs.top[0])
  # Nothing of the stack is fetched before its cotangent: the saved inputs
  # pass a barrier with it (else XLA kept some offloaded ones on the device:
  # FLUX.1-dev, batch 4, 1.9 GB more peak), and the top blocks' rows are
  # offset by a traced 0 that comes out of it.
  ct, gate, saved, tops = lax.optimization_barrier(
      (ct, jnp.zeros((), jnp.int32), saved, tops))
  gated = lambda at: (at[0], at[1] + gate) if isinstance(at[1], int) else at
  rows = pipeline.Rows.of(num_blocks(layout[0]))
  width = len(leaves)

  def saved_at(at):  # the saved leaves holding block at, and its address
    r, q = at
    if isinstance(q, int) and q == rows.loops:
      return tops[r], None
    return saved, at

  def step(loop, at, first, last):
    ct, ct_consts, leaves, staged, pending = loop
    if not first:
      leaves = pipeline.write_back(leaves, pending, pipeline.up(at))
    source, source_at = saved_at(at)
    here = (pipeline.block_of(leaves, staged[:width], at)
            + pipeline.block_of(source, staged[width:], source_at))
    ahead = staged
    if not last:
      r, q = pipeline.down(at)
      if not isinstance(q, int):  # block 0 of the loop: reads a block unused
        q = jnp.maximum(q, 0)
      source, source_at = saved_at((r, q))
      ahead = (pipeline.fetch(leaves, gated((r, q)))
               + pipeline.fetch(source, source_at))
    ct, ct_block, leaves, pending = _step_block(
        tx, block, leaves, treedef, here, at, saved_def, consts, ct)
    # One block at a time, as across a loop's iterations: else XLA would
    # start the next blocks' recomputed forwards early, their activations
    # alive at once (FLUX.1-dev, batch 4: +11 GB).
    return lax.optimization_barrier(
        (ct, _add_cotangents(ct_consts, ct_block), leaves, ahead, pending))

  top = (rows.top - 1, rows.loops)
  source, source_at = saved_at(top)
  staged = (pipeline.fetch(leaves, gated(top))
            + pipeline.fetch(source, source_at))
  loop = (ct, ct_consts, leaves, staged, None)
  for r in reversed(range(rows.top)):
    loop = step(loop, (r, rows.loops), r == rows.top - 1,
                rows.loops == 0 and r == 0)

  def body(j, loop):
    for r in reversed(range(pipeline.PERIOD)):
      loop = step(loop, (r, rows.loops - 1 - j), False, False)
    return loop

  if rows.loops:  # (else a part may have no rows to trace a read of)
    loop = lax.fori_loop(0, rows.loops, body, loop)
  ct, ct_consts, leaves, _, pending = loop
  stack, stack_state = treedef.unflatten(
      pipeline.write_back(leaves, pending, (0, 0)))
  return ct, ct_consts, stack, stack_state


def _step_block(tx, block, leaves, treedef, here, at, saved_def, consts, ct):
  """Block ``at``'s vjp (``here``: its leaves, then its saved input) and
  update: the cotangents, the leaves (device ones updated in place), and the
  new host leaves (else None) to write back."""
  params, state = treedef.unflatten(here[:len(leaves)])
  carry = saved_def.unflatten(here[len(leaves):])
  _, vjp = jax.vjp(block, params, carry, consts)
  grads, ct, ct_block = vjp(ct)
  # On the CPU, XLA would fuse the update into the stacks' in-place writes
  # and then copy every stack the loop carries; an island prevents it.
  new = jax.tree.leaves(per_leaf.apart_on_cpu(
      functools.partial(_update, tx, staged=True), grads, state, params))
  pending = [y if pipeline.on_host(x) else None for x, y in zip(leaves, new)]
  leaves = [x if pipeline.on_host(x) else pipeline.write(x, y, at)
            for x, y in zip(leaves, new)]
  return ct, ct_block, leaves, pending


def blockwise_step(
    model: BlockwiseModel,
    tx: optax.GradientTransformation,
    params: BlockwiseParams,
    state: BlockwiseState,
    batch: Batch,
    *,
    offload_activations: bool = False,
) -> tuple[jax.Array, BlockwiseParams, BlockwiseState]:
  """One training step that updates each block inside the backward pass.

  Computes ``loss = blockwise_loss(model, params, batch)`` and, per group of
  weights ``theta`` (embedding, each block, head) with state ``s``::

    g         = d loss / d theta
    u, s      = tx.update(g, s, theta)
    theta     = optax.apply_updates(theta, u)

  The head is updated after the forward pass, each block in the reverse loop,
  the embedding last: the ordinary step's arithmetic, blocks as separate leaves.

  Jit it with the params and state donated (``donate_argnums=(0, 1)``), so
  the stacks are updated in place, and a streamed one with
  ``compiler_options=STREAMING_COMPILER_OPTIONS``. Each ``DoubleBuffer`` comes
  back with its roles swapped (the jitted step compiles once per role).
  ``offload_activations`` keeps the blocks' saved inputs in host memory,
  each sent while the next block computes and fetched a block ahead in the
  backward pass: the same arithmetic, with their bytes over PCIe.

  Args:
    model: the model's functions.
    tx: a leaf-by-leaf gradient transformation, ``kahan`` of one, or the
      Prodigy family with ``lagged_d=True``.
    params: a ``BlockwiseParams``.
    state: from ``blockwise_init(tx, params)`` or a previous step.
    batch: passed to ``embed`` and ``head``.
    offload_activations: keep each block's saved input in host memory.

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
  check_params(model, params)
  validation.check_transformation("blockwise_step", "tx", tx)
  validation.check_bool("blockwise_step", "offload_activations",
                        offload_activations)
  if not isinstance(state, BlockwiseState):
    raise TypeError(f"state must be a BlockwiseState (from blockwise_init), "
                    f"got {type(state).__name__}")
  if len(state.stacks) != len(params.stacks):
    raise ValueError(f"state has {len(state.stacks)} stacks, params "
                     f"{len(params.stacks)}")

  layout = (params, state)
  params, state = front_buffers(layout)
  _check_same_rows(tx, params)
  (carry, consts), embed_vjp = jax.vjp(lambda p: model.embed(p, batch),
                                       params.embed)
  inputs, transitions = [], []
  for s, stack in enumerate(params.stacks):
    forward = (pipeline.forward_interleaved if pipeline.interleaved_in(
        (stack, state.stacks[s])) else pipeline.forward_stack)
    carry, saved = forward(model.blocks[s], stack, carry, consts,
                           offload_activations)
    inputs.append(saved)
    transition_vjp = None
    if model.transition(s) is not None and not model.joins(s):
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
        tx, model.blocks[s], (layout[0].stacks[s], layout[1].stacks[s]),
        inputs[s], consts, ct, ct_stack)
    if s == 0 or not model.joins(s - 1):
      ct_consts = _add_cotangents(ct_consts, ct_stack)
      ct_stack = zeros
    # else the part before continues this stack's sum
  grads, = embed_vjp((ct, ct_consts))
  embed, embed_state = _update(tx, grads, state.embed, params.embed)

  new_state = sum_late(
      BlockwiseState(embed_state, tuple(stack_states), head_state))
  new_params, new_state = flip(
      layout, (BlockwiseParams(embed, tuple(stacks), head), new_state))
  return loss, new_params, new_state

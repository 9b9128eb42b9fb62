"""A training step that updates each block inside the backward pass.

A step written as ``jax.value_and_grad`` followed by ``tx.update`` holds the
whole gradient tree at the update: 2 B/param in bfloat16, as much as the
weights (24 GB for FLUX.1-dev's 11.9B params). A fused backward pass (as in
sd-scripts' ``--fused_backward_pass``) updates each weight as soon as its
gradient exists, so only one block's gradients are ever alive.

For a ``BlockwiseModel`` (embed -> scan over stacked blocks -> head, see
``model``) the step is:

1. Forward: the embedding (its vjp kept), then each stack by ``lax.scan``,
   keeping only each block's input ``carry`` (block remat: the block's
   activations are recomputed in the backward pass); then the head.
2. The head's gradient, and its update: ``u, s = tx.update(g, s, theta_H)``.
3. Backward, block by block from the last: with ``c_i`` the saved input,
   ``(g_i, ct, ct_k) = vjp(block, theta_i, c_i, consts)(ct)``; then
   ``theta_i, s_i <- update(g_i, s_i, theta_i)`` right there, written back
   into the stack in place (a ``fori_loop`` carrying the stacked weights and
   state, so with donation nothing is copied); ``ct`` goes on to block
   ``i - 1`` and ``ct_k`` is summed into the cotangent of ``consts``.
4. The embedding's gradient from ``(ct, ct_consts)``, and its update.

One block's gradients are alive at a time, and the optimizer's scratch is
one block's. Leaves in host memory (``kahan``'s residuals, ``stream_blocks``'
blocks) are fetched a block ahead and written back a block behind
(``pipeline``).

Which transformations: ``tx`` is applied to each group of weights (the
embedding, each block, the head) with its own state, so it must act leaf by
leaf (its per-leaf form, ``optax_kahan.per_leaf``, with no round before the
update) or reduce late: Prodigy with ``lagged_d=True`` steps each block with
the ``d`` known at the start of the step; the step adds the groups'
``LateSums`` up (``late_sums``), folded into ``d`` at the next step (a
one-step lag, as in fused-backward Prodigy variants).

References:
  sd-scripts (kohya-ss) ``--fused_backward_pass`` and PR #2159;
  Lv et al., "Full Parameter Fine-tuning for Large Language Models with
  Limited Resources" (LOMO), arXiv:2306.09782, 2023.
"""

from __future__ import annotations

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
from optax_kahan._src.blockwise.pipeline import block_of
from optax_kahan._src.blockwise.pipeline import fetch
from optax_kahan._src.blockwise.pipeline import forward_stack
from optax_kahan._src.blockwise.pipeline import take
from optax_kahan._src.blockwise.pipeline import write_back
from optax_kahan._src.blockwise.streaming import check_not_doubled
from optax_kahan._src.blockwise.streaming import flip
from optax_kahan._src.double_buffer import front_buffers
from optax_kahan._src.double_buffer import is_double
from optax_kahan._src.kahan import no_step_counter


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
  validation.check_transformation("blockwise_init", "tx", tx)
  check_stacks(params)
  check_not_doubled((params, args), "blockwise_init",
                     "initialize before stream_blocks, or pass "
                     "front_buffers(params)")
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

  Each block is rematerialized in the backward pass (``jax.checkpoint``), as
  in ``blockwise_step``; ``jax.value_and_grad`` of this is the ordinary step's
  gradient.
  """
  check_params(model, params)
  params = front_buffers(params)
  carry, consts = model.embed(params.embed, batch)
  for s, stack in enumerate(params.stacks):
    carry, _ = forward_stack(jax.checkpoint(model.blocks[s]), stack, carry,
                              consts)
    if model.transition(s) is not None and not model.joins(s):
      carry = model.transition(s)(carry, consts)
  return model.head(params.head, carry, consts, batch)



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



def _backward_stack(tx, block, layout, inputs, consts, ct, ct_consts):
  """The reverse loop over one stack: each block's vjp, then its update.

  ``layout`` is the stack and its state as the step got them (a
  ``DoubleBuffer`` where a host leaf has a spare buffer). Returns
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
  nodes, treedef = jax.tree.flatten(layout, is_leaf=is_double)
  spare = [is_double(x) for x in nodes]
  reads = [x.front if s else x for x, s in zip(nodes, spare)]
  leaves = [x.back if s else x for x, s in zip(nodes, spare)]  # written
  last = num_blocks(front_buffers(layout[0])) - 1

  def body(j, loop):
    ct, ct_consts, leaves, staged, pending = loop
    i = last - j
    leaves = write_back(leaves, pending, jnp.minimum(i + 1, last))
    ahead = fetch([x if s else y for x, y, s in zip(reads, leaves, spare)],
                  jnp.maximum(i - 1, 0))
    ct, ct_block, leaves, pending = _step_block(
        tx, block, leaves, treedef, staged, i, inputs, consts, ct)
    return ct, _add_cotangents(ct_consts, ct_block), leaves, ahead, pending

  staged = fetch(reads, last)
  ct, ct_consts, leaves, _, pending = lax.fori_loop(
      0, last + 1, body, (ct, ct_consts, leaves, staged, staged))
  stack, stack_state = treedef.unflatten(write_back(leaves, pending, 0))
  return ct, ct_consts, stack, stack_state


def _step_block(tx, block, leaves, treedef, staged, k, inputs, consts, ct):
  """Block ``k`` of a stack (its host leaves in ``staged``): its vjp, then its
  update. Returns the cotangents (carry, ``consts``), the stack's leaves with
  the new device leaves written in place, and the new host leaves (None for
  the others), which the caller writes back."""
  params, state = treedef.unflatten(block_of(leaves, staged, k))
  _, vjp = jax.vjp(block, params, take(inputs, k), consts)
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
  check_params(model, params)
  validation.check_transformation("blockwise_step", "tx", tx)
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
  (carry, consts), embed_vjp = jax.vjp(lambda p: model.embed(p, batch),
                                       params.embed)
  inputs, transitions = [], []
  for s, stack in enumerate(params.stacks):
    carry, saved = forward_stack(model.blocks[s], stack, carry, consts)
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
    # else the part before continues this stack's sum, as one stack's would
  grads, = embed_vjp((ct, ct_consts))
  embed, embed_state = _update(tx, grads, state.embed, params.embed)

  new_state = sum_late(
      BlockwiseState(embed_state, tuple(stack_states), head_state))
  new_params, new_state = flip(
      layout, (BlockwiseParams(embed, tuple(stacks), head), new_state))
  return loss, new_params, new_state

"""Leaf-by-leaf execution: an optimizer step whose scratch memory is one leaf's.

XLA compiles the optimizer step as one program and schedules it breadth-first:
each stage runs for every leaf before the next stage starts, so every leaf's
float32 temporaries (an update, a sum of moments, a copy of a weight that is
overwritten in place) are alive at once. On bf16 params that is 6 to 10 bytes
of scratch per parameter: 70 to 120 GB for a 12B model.

``leafwise(tx)`` runs ``tx`` on one leaf at a time, as PyTorch's per-tensor
loops do, through ``for_each_leaf``, which orders the leaves by data
dependencies and picks its form by the backend it is lowered for
(``lax.platform_dependent``: one form is lowered, no conditional is left):

* GPU and other backends: a chain of optimization barriers. Leaf ``i + 1``'s
  inputs wait for leaf ``i``'s chained outputs (new state, new residual), and
  inputs in host memory (``kahan``'s residuals) are brought to the device one
  leaf ahead, so at most two leaves' residuals are staged at once and each
  copy overlaps the previous leaf's update. The update itself is a free
  output that XLA fuses into ``optax.apply_updates``. No ``lax.cond``: on a
  GPU a conditional copies its predicate to the host and waits for the
  device to drain, once per leaf.
* CPU: each leaf in a ``lax.cond`` island whose two branches are the same
  function (the predicate, a token that leaves each island through an
  optimization barrier with its outputs, cannot change the result). A
  branch is scheduled as one unit with its own temporaries, so XLA:CPU frees
  one leaf's scratch before the next starts; under data dependencies alone
  its scheduler leaves every leaf's update waiting for
  ``optax.apply_updates`` at the end (measured). A conditional costs no host
  round trip on the CPU.

Two passes. A transformation that couples the leaves (Prodigy's d-estimate
sums over all of them) is split into a first pass, which computes per-leaf
statistics (dot products, norms: scalars) in rows of their own and combines
them, and a per-leaf second pass that uses the combined scalars. That split is
a ``LeafwisePlan``, returned by the ``prepare`` function of a
``LeafwiseTransformation``. ``leafwise(tx)`` has an empty first pass;
``scale_by_prodigy(leafwise(preconditioner))`` (``prodigy(leafwise=True)``)
has a real one. ``kahan`` puts its merge of bf16 weight and residual, and its
split, inside both passes' rows, so that no float32 copy of a whole tree
ever exists (and a residual crosses to the device once per pass).

Which transformations ``leafwise`` may wrap: elementwise ones (Adam, AdamW,
Lion, SGD with momentum, ``scale_by_second_moment``) and per-leaf ones
(Adafactor's factored moment, ``optax.clip_by_block_rms``, StableAdamW's
clip). Not ``optax.clip_by_global_norm`` or Prodigy's estimator: each leaf
would see only itself.

Bit for bit: a leafwise step computes the same arithmetic as ``tx`` on the
whole tree, and for this package's optimizers (plain and inside ``kahan``)
the results are identical bit for bit (tested). Two XLA rewrites depend on
what surrounds an expression, and this package's code is written so that
neither applies: XLA turns a division by a broadcast scalar into a
multiplication by its reciprocal only where the scalar has one user (one
leaf), so ``optax.adamw``'s bias correction rounds differently in a
one-leaf program than in a many-leaf one (up to an ulp in some elements:
the leafwise step is then ``optax.adamw`` run on each leaf alone, bit for
bit); and XLA's CPU backend may contract a multiply and an add into an FMA
when the update is fused into ``optax.apply_updates``, which a row
boundary prevents (inside ``kahan`` the sum is formed inside the row
either way).

State: ``leafwise(tx)`` keeps ``tx``'s own state, laid out as ``tx`` lays it
out, so checkpoints of the two mix and ``optax.tree.map_params`` works. At
each step the state is cut into per-leaf states: the subtrees shaped like the
params (found, as ``optax.tree.map_params`` finds them, by initialising ``tx``
on a stand-in for the params) give leaf ``i``'s entry, and every other entry
(a step count) is shared; after the rows the per-leaf states are put back
together, the shared entries taken from the first leaf. ``init`` checks, by
tracing ``tx.update`` once on the whole tree, that no leaf's output reads
another leaf and that the shared entries read no leaf; a transformation that
couples leaves (``optax.clip_by_global_norm`` anywhere in a chain) is refused.

Costs: the leaves run in sequence (the CPU step time is measured by
``benchmarks/step_memory.py``; the GPU programs by
``benchmarks/gpu_compile.py``). On a GPU, inside ``kahan``, this bounds the
staged residuals, as ``kahan``'s default whole-tree step does too
(``optax_kahan.staging``): the GPU programs of the two stage the same bytes,
and the bound that ``leafwise`` adds is the CPU's scratch. With unrolled
blocks under ``jax.checkpoint`` any host copy in the program (a residual's)
lets XLA:GPU's latency-hiding scheduler move the blocks' recomputed forward
passes early, which costs more activation memory than the residuals save
(measured; see the README).

Layering: this module depends only on ``staging`` (the barrier helpers);
``kahan`` and ``scale_by_prodigy`` build on it.

References:
  PyTorch optimizers' ``foreach=False`` loops, one tensor at a time.
  XLA operation semantics, ``Conditional``: the branch computations are
  separate computations, called as a unit.
"""

from __future__ import annotations

from typing import Any, Callable, NamedTuple

import jax
import jax.extend as jex
import jax.numpy as jnp
import optax

from optax_kahan.staging import stage
from optax_kahan.staging import tie

LeafUpdate = Callable[[Any, Any, Any], tuple[Any, Any]]


class LeafwisePlan(NamedTuple):
  """The second pass of a step, prepared by the first.

  Attributes:
    leaf_update: ``(g_i, s_i, x_i) -> (u_i, new_s_i)`` for one leaf (``x_i``
      may be None when the transformation needs no params).
    leaf_states: the per-leaf states ``s_i``, in leaf order.
    finish: new per-leaf states (a list, in leaf order) -> the new state.
  """
  leaf_update: LeafUpdate
  leaf_states: list[Any]
  finish: Callable[[list[Any]], optax.OptState]


class LeafwiseTransformation(optax.GradientTransformationExtraArgs):
  """A ``GradientTransformationExtraArgs`` that runs one leaf at a time.

  Besides ``init`` and ``update`` it has the first pass::

    prepare(grads, state, xs, decode, treedef, **extra_args) -> LeafwisePlan

  with ``grads`` and ``xs`` (or None) lists of leaves in ``jax.tree.leaves``
  order, ``treedef`` the params' tree structure, and
  ``decode(g_i, x_i) -> (g, x)`` the function that turns one leaf's entries
  into the values the math sees, applied inside the first pass's own
  per-leaf rows. ``update`` is ``prepare`` (with ``decode`` the identity)
  followed by ``for_each_leaf(plan.leaf_update, ...)``. ``kahan`` instead
  passes the bf16 params with their residuals and a ``decode`` that merges
  them, and runs ``plan.leaf_update`` inside its own rows, between its
  merge and its split: no float32 copy of the whole tree is ever made.
  """

  prepare: Callable[..., LeafwisePlan]

  def __new__(cls, init, prepare):
    def update(updates, state, params=None, **extra_args):
      grads, treedef = jax.tree.flatten(updates)
      xs = None if params is None else treedef.flatten_up_to(params)
      plan = prepare(grads, state, xs, identity_decode, treedef, **extra_args)
      outs = for_each_leaf(plan.leaf_update, grads, plan.leaf_states,
                           [None] * len(grads) if xs is None else xs)
      return (jax.tree.unflatten(treedef, [u for u, _ in outs]),
              plan.finish([s for _, s in outs]))

    tx = super().__new__(cls, init, update)
    tx.prepare = prepare
    return tx


def identity_decode(g: Any, x: Any) -> tuple[Any, Any]:
  """The ``decode`` of plain leaves: gradient and params as they are."""
  return g, x


def for_each_leaf(fn: Callable[..., tuple[Any, Any]],
                  *columns: list[Any]) -> list[tuple[Any, Any]]:
  """``[fn(*row) for row in zip(*columns)]``, one row after the other.

  ``fn`` returns a pair ``(free, chained)``. Rows are ordered by data
  dependencies, with no control flow::

    token_0 = barrier(0)
    for i, row in enumerate(rows):
      row_i = stage(tie(row_i, token_{i-1}))   # host arrays -> device
      row_i = tie(row_i, token_i)
      free_i, chained_i = fn(*row_i)
      chained_i, token_{i+1} = tie(chained_i, token_i)

  ``tie(x, t)`` passes ``x`` and ``t`` through one
  ``lax.optimization_barrier``: nothing that reads its outputs runs before
  all of its inputs exist. So row ``i + 1``'s work starts once row ``i``'s
  ``chained`` outputs exist, and one row's temporaries are dead before the
  next row's are made. ``free`` outputs are not tied, so XLA may fuse them
  with their consumers outside (an update with ``optax.apply_updates``: a
  tied float32 update would be written out whole, and XLA may run every
  consumer at the end, keeping them all). Arrays of a row that live in host
  memory (``kahan``'s residuals) are brought to the device one row ahead:
  row ``i + 1``'s copy may start once row ``i - 1`` is done, so it overlaps
  row ``i``'s compute, and at most two rows' host arrays are staged at once.

  A row's scalar inputs are not tied (a scalar shared by all rows, such as
  a step count, is then computed once, as in a whole-tree program); its
  scalar ``chained`` outputs are (a per-leaf sum must not wait, holding the
  leaf's staged inputs, until the end).

  That is the form lowered for GPUs and other backends: no ``lax.cond``,
  since on a GPU a conditional reads its predicate back to the host and
  waits for the device to drain, once per row. Lowered for the CPU, each
  row runs in a ``lax.cond`` island instead (see the module docstring);
  ``lax.platform_dependent`` lowers only the form of the target backend.

  Args:
    fn: the per-leaf work, returning ``(free, chained)``; arguments and
      outputs are pytrees of arrays (``None`` allowed).
    *columns: equal-length lists, one entry per leaf.

  Returns:
    The list of ``fn``'s outputs, in order.

  References:
    XLA operation semantics, ``OptimizationBarrier``.
  """
  rows = list(zip(*columns))
  if not rows:
    return []
  flat, treedef = jax.tree.flatten(rows)
  return jax.lax.platform_dependent(
      *flat,
      cpu=lambda *flat: _islands(fn, treedef.unflatten(flat)),
      default=lambda *flat: _chain(fn, treedef.unflatten(flat)))


def _chain(fn: Callable[..., Any], rows: list[Any]) -> list[Any]:
  """``for_each_leaf`` by data dependencies alone (GPU and other backends)."""
  outs = []
  token = jax.lax.optimization_barrier(jnp.zeros([], jnp.int32))
  prev = token  # the token of the row before the last
  for row in rows:
    staged, _ = tie(row, prev, scalars=False)
    row, _ = tie(stage(staged), token, scalars=False)
    free, chained = fn(*row)
    chained, new = tie(chained, token)
    outs.append((free, chained))
    prev, token = token, new
  return outs


def _islands(fn: Callable[..., Any], rows: list[Any]) -> list[Any]:
  """``for_each_leaf`` on the CPU: each row in a ``lax.cond`` island.

  XLA's CPU scheduler does not keep the free outputs' consumers next to
  their row under data dependencies alone (every leaf's update then waits
  for ``optax.apply_updates`` at the end); a conditional's branch is
  scheduled as one unit, so one row's temporaries die before the next
  row's are made. Both branches are ``fn``, so the predicate (the token,
  which leaves each island through an optimization barrier with the row's
  outputs, so XLA cannot fold it) does not change the result; on the CPU a
  conditional costs no host round trip.
  """

  def island(token, *row):
    return jax.lax.optimization_barrier((fn(*row), token))

  outs = []
  token = jax.lax.optimization_barrier(jnp.array(True))
  for row in rows:
    out, token = jax.lax.cond(token, island, island, token, *row)
    outs.append(out)
  return outs


class _ParamsSlot:
  """Stands in for the params tree in ``tx.init``: a pytree with no leaves.

  ``jax.tree.map(f, slot)`` returns a slot, so every subtree of ``tx``'s
  state that is made by mapping over the params comes out as a slot; these
  are the entries cut leaf by leaf (``optax.tree.map_params`` finds the
  params-shaped parts of a state the same way).
  """


jax.tree_util.register_pytree_node(
    _ParamsSlot, lambda _: ((), None), lambda *_: _ParamsSlot())


def _is_slot(x: Any) -> bool:
  return isinstance(x, _ParamsSlot)


class _Layout(NamedTuple):
  """Where a state's per-leaf entries are: a template cut at the slots."""
  entries: list[Any]  # the template's entries: a _ParamsSlot or a shared leaf
  treedef: Any        # the template's structure, the slots as leaves


def _layout(tx: optax.GradientTransformation) -> _Layout:
  template = jax.eval_shape(tx.init, _ParamsSlot())
  entries, treedef = jax.tree.flatten(template, is_leaf=_is_slot)
  return _Layout(entries, treedef)


def _split(layout: _Layout, state: Any, params_def: Any) -> list[Any]:
  """``state`` cut into one state per leaf (shared entries in each)."""
  n = params_def.num_leaves
  columns = [params_def.flatten_up_to(part) if _is_slot(entry) else [part] * n
             for entry, part in zip(layout.entries,
                                    layout.treedef.flatten_up_to(state))]
  return [layout.treedef.unflatten([col[i] for col in columns])
          for i in range(n)]


def _merge(layout: _Layout, states: list[Any], params_def: Any) -> Any:
  """The per-leaf states put back together (shared entries from the first)."""
  rows = [layout.treedef.flatten_up_to(s) for s in states]
  parts = [params_def.unflatten([row[j] for row in rows]) if _is_slot(entry)
           else rows[0][j] for j, entry in enumerate(layout.entries)]
  return layout.treedef.unflatten(parts)


def _labels_of(layout: _Layout, state: Any, params_def: Any) -> list[int]:
  """For each array of ``state``: the leaf it belongs to, or -1 if shared."""
  labels = []
  for entry, part in zip(layout.entries, layout.treedef.flatten_up_to(state)):
    if _is_slot(entry):
      for i, sub in enumerate(params_def.flatten_up_to(part)):
        labels += [i] * len(jax.tree.leaves(sub))
    else:
      labels += [-1] * len(jax.tree.leaves(part))
  return labels


def _reads(jaxpr: Any, in_labels: list[frozenset]) -> list[frozenset]:
  """Which labelled inputs each output of ``jaxpr`` reads (data flow).

  Inlined calls (``jit``, custom derivatives) are followed inside; any other
  equation is taken to read all of its inputs into all of its outputs.
  """
  env: dict[Any, frozenset] = {}

  def read(v):
    if isinstance(v, jex.core.Literal):
      return frozenset()
    return env.get(v, frozenset())

  for v, lab in zip(jaxpr.invars, in_labels):
    env[v] = lab
  for eqn in jaxpr.eqns:
    ins = [read(v) for v in eqn.invars]
    inner = eqn.params.get("jaxpr", eqn.params.get("call_jaxpr"))
    inner = getattr(inner, "jaxpr", inner)
    if (isinstance(inner, jex.core.Jaxpr) and len(inner.invars) == len(ins)
        and len(inner.outvars) == len(eqn.outvars)):
      outs = _reads(inner, ins)
    else:
      outs = [frozenset().union(*ins)] * len(eqn.outvars)
    for v, lab in zip(eqn.outvars, outs):
      env[v] = lab
  return [read(v) for v in jaxpr.outvars]


def _check_per_leaf(tx: optax.GradientTransformation, layout: _Layout,
                    params: Any, state: Any) -> None:
  """Raises ValueError if ``tx.update`` lets one leaf's output read another."""
  flat, params_def = jax.tree.flatten(params)
  if len(flat) < 2:
    return
  paths = [jax.tree_util.keystr(p)
           for p, _ in jax.tree_util.tree_flatten_with_path(params)[0]]
  shapes = [jax.ShapeDtypeStruct(jnp.shape(x), jnp.result_type(x))
            for x in flat]
  abstract = params_def.unflatten(shapes)
  try:
    closed, (_, new_state) = jax.make_jaxpr(
        lambda g, s, p: tx.update(g, s, p), return_shape=True)(
            abstract, state, abstract)
  except TypeError:
    return  # tx.update needs extra args to run; nothing to check at init
  leaf_labels = list(range(len(flat)))
  in_labels = [frozenset() if i < 0 else frozenset([i]) for i in
               leaf_labels + _labels_of(layout, state, params_def)
               + leaf_labels]
  outs = _reads(closed.jaxpr, in_labels)
  want = leaf_labels + _labels_of(layout, new_state, params_def)
  for out, own in zip(outs, want):
    foreign = sorted(out - {own})
    if foreign:
      what = (f"its output for leaf {paths[own]}" if own >= 0 else
              "a state entry shared by all leaves (such as a step count)")
      raise ValueError(
          f"leafwise: the transformation couples leaves: {what} reads leaf "
          f"{paths[foreign[0]]}. Run one leaf at a time, it would see only "
          "its own leaf. Keep transformations that combine leaves (optax."
          "clip_by_global_norm, Prodigy's estimator) outside leafwise(...)")


def leafwise(tx: optax.GradientTransformation) -> LeafwiseTransformation:
  """Runs ``tx`` on one leaf at a time, so its scratch is bounded by one leaf.

  For every leaf ``i`` of the params (in ``jax.tree.leaves`` order)::

    u_i, state_i = tx.update(g_i, state_i, params_i, **extra_args)

  each update in its own row of ``for_each_leaf``, ordered after the previous
  leaf's (see the module docstring), with ``state_i`` leaf ``i``'s cut of
  ``tx``'s state. With ``tx`` elementwise or per-leaf the updates are those
  of ``tx`` on the whole tree (bit for bit, but for the XLA rewrite the
  module docstring describes); extra args (``d_ratio``, ``value``, ...) reach
  every leaf's update unchanged.

  Chain inside, not outside: ``kahan`` runs its own per-leaf work in the
  rows only when the ``LeafwiseTransformation`` is its direct inner
  transformation, so write ``kahan(leafwise(optax.chain(a, b)))``; around
  ``optax.chain(leafwise(a), b)`` it computes the same, without the bound.

  Args:
    tx: an elementwise or per-leaf transformation (Adam, Adafactor's factored
      moment, block-RMS clipping, StableAdamW), not one that couples leaves
      (global-norm clipping, Prodigy's estimator): ``init`` refuses those.

  Returns:
    A ``LeafwiseTransformation`` whose state is ``tx``'s state.

  Raises:
    ValueError: at ``init``, when ``tx.update`` of one leaf reads another.

  Example:
    >>> import optax
    >>> import optax_kahan as ok
    >>> params = {"w": jnp.ones((4, 4), jnp.bfloat16)}
    >>> tx = ok.kahan(ok.leafwise(optax.adamw(1e-4)))
    >>> state = tx.init(params)
    >>> updates, state = tx.update(params, state, params)
    >>> params = optax.apply_updates(params, updates)

  References:
    See the module docstring.
  """
  tx = optax.with_extra_args_support(tx)

  def init_fn(params):
    state = tx.init(params)
    _check_per_leaf(tx, _layout(tx), params, state)
    return state

  def prepare_fn(grads, state, xs, decode, params_def, **extra_args):
    del xs, decode  # no first pass
    layout = _layout(tx)

    def leaf_update(g, s, x):
      return tx.update(g, s, x, **extra_args)

    try:
      states = _split(layout, state, params_def)
    except (ValueError, TypeError) as e:
      raise ValueError(
          f"leafwise: the state does not match the updates' tree ({e}); "
          "initialise it with init on params of the same structure") from e
    return LeafwisePlan(leaf_update, states,
                        lambda states: _merge(layout, states, params_def))

  return LeafwiseTransformation(init_fn, prepare_fn)

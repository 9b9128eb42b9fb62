"""The per-leaf contract: an optimizer step as map, sum, map, run leaf by leaf.

Every step this package needs is three stages (``DESIGN``: map, reduce,
map)::

  1. map:    stat_i   = statistic(g_i, s_i, x_i)      per leaf (a dot, a norm)
  2. reduce: shared   = combine(sum_i stat_i)         one small sum
  3. map:    u_i, s_i = update(g_i, s_i, x_i, shared) per leaf

A transformation that declares its stages (a ``LeafStages``: the state cut per
leaf, zero or more ``Round`` s of stages 1 and 2, and stage 3) can be run
leaf by leaf: ``kahan`` merges each leaf's bf16 weight and residual inside the
leaf's own rows and splits it there, so a GPU step holds one or two leaves'
residuals and temporaries instead of all of them. A chain of such
transformations is again one (``chain``): its rounds are the members' rounds
in order, each recomputing the earlier members' per-leaf updates, with one sum
per round.

Reduce late: a transformation may instead fold this step's sums in at the
start of the next step (Prodigy's ``lagged_d``). Its rows then compute the
statistics beside the update, and its state keeps their sums in a
``LateSums`` node. Whoever runs the step on groups of leaves
(``optax_kahan.blockwise``: one group per block) adds the groups' ``LateSums``
up: the reduction is a sum whichever way the leaves are grouped.

Who implements it: every transformation of this package. Transformations of
optax (``adam``, ``adamw``, ``lion``, ``sgd``, ``adafactor``,
``clip_by_block_rms``, schedules, ...) are given it by one adapter
(``adapt``), once ``dependence.per_leaf_proof`` has proved from the traced
update that no leaf's output reads another leaf; ``stages_of`` does both. A
transformation that neither declares stages nor passes that proof has no
per-leaf form: ``kahan`` then runs it on the whole tree, with a warning.
optax's ``clip_by_global_norm`` and ``apply_if_finite`` couple the leaves;
``optax_kahan.coupled`` gives them the contract.

One ordering primitive, ``for_each_leaf``, runs rows. Lowered for a GPU (or
any non-CPU backend) it orders them by data dependencies alone; lowered for
the CPU, each row is a ``lax.cond`` island (``lax.platform_dependent`` lowers
one of the two). Both forms evaluate the same per-leaf functions, so they
compute the same values, and ``jax.grad`` and ``jax.vmap`` go through both.

Bit for bit: a per-leaf step computes the arithmetic of the transformation
applied to each leaf alone. XLA rewrites a division by a scalar into a
multiplication by its reciprocal only where the scalar has one user (one
leaf), so ``optax.adam``'s bias correction rounds differently in a one-leaf
row than in a whole-tree program: such a step is that optimizer on each leaf
alone, bit for bit, and within an ulp of the whole-tree program. This
package's own bias corrections multiply by the reciprocal and do not change.

References:
  PyTorch optimizers' ``foreach=False`` loops, one tensor at a time.
  XLA operation semantics, ``OptimizationBarrier`` and ``Conditional``.
"""

from __future__ import annotations

from typing import Any, Callable, NamedTuple, Optional

import jax
import jax.numpy as jnp
import optax

from optax_kahan._src import dependence


class Round(NamedTuple):
  """Stages 1 and 2: a per-leaf statistic, summed over the leaves.

  Attributes:
    statistic: ``(g_i, s_i, x_i, shared, **extra_args) -> (stat_i, s_i)``:
      a pytree of arrays summed over the leaves, and the leaf's state (which
      a round may update, as Prodigy's ``s``).
    combine: ``(sums, shared) -> shared``: what the later stages see.
  """
  statistic: Callable[..., tuple[Any, Any]]
  combine: Callable[[Any, Any], Any]


class LeafStages(NamedTuple):
  """One step of a transformation, cut into rounds and a per-leaf update.

  Attributes:
    leaf_states: the state cut into one entry per leaf, in leaf order.
    shared: what every leaf's stages see before the first round (scalars
      computed from the state: a learning rate, Prodigy's ``d``).
    rounds: the ``Round`` s, each one sum over the leaves.
    update: ``(g_i, s_i, x_i, shared, **extra_args) -> (u_i, s_i)``.
    finish: ``(leaf_states, shared) -> state``: the new state from the new
      per-leaf states (a reduce-late transformation sums its statistics
      here into its ``LateSums``).
    inputs: each leaf's ``x_i``, when it is not the leaf's param (``kahan``:
      the bf16 weight and its residual, merged inside the rows); None for
      the params.
  """
  leaf_states: list[Any]
  shared: Any
  rounds: tuple[Round, ...]
  update: Callable[..., tuple[Any, Any]]
  finish: Callable[[list[Any], Any], Any]
  inputs: Optional[list[Any]] = None


# ``stages(updates, state, params, **extra_args) -> LeafStages``, or None when
# the transformation has no per-leaf form for these arguments. ``updates`` and
# ``params`` may be abstract (``jax.ShapeDtypeStruct``); ``params`` may be
# None for a transformation that needs none.
StagesFn = Callable[..., Optional[LeafStages]]


class LateSums(NamedTuple):
  """The sums of a reduce-late transformation's statistics, for the next step.

  Groups of leaves stepped apart (``blockwise_step``) each hold their own
  sums; adding the groups' ``sums`` gives the whole step's.
  """
  sums: Any


class PerLeafUpdate:
  """The ``update`` of a transformation that declares its stages.

  Called, it runs the stages on the whole tree (``ordered=False``: one XLA
  program that XLA fuses freely, as optax's own transformations are) or row
  by row (``for_each_leaf``). ``stages`` is what ``stages_of`` reads.
  """

  def __init__(self, stages: StagesFn, *, ordered: bool = False,
               whole_tree: Optional[Callable[..., Any]] = None):
    self.stages = stages
    self.ordered = ordered
    self.whole_tree = whole_tree

  def __call__(self, updates, state, params=None, **extra_args):
    st = self.stages(updates, state, params, **extra_args)
    if st is None:
      if self.whole_tree is None:
        raise ValueError("this transformation has no per-leaf form for "
                         "these arguments")
      return self.whole_tree(updates, state, params, **extra_args)
    grads, treedef = jax.tree.flatten(updates)
    xs = ([None] * len(grads) if params is None
          else treedef.flatten_up_to(params))
    us, state = run(st, grads, xs, ordered=self.ordered, **extra_args)
    return treedef.unflatten(us), state


def transformation(
    init: Callable[..., Any], stages: StagesFn, *, ordered: bool = False,
    whole_tree: Optional[Callable[..., Any]] = None,
) -> optax.GradientTransformationExtraArgs:
  """A transformation that implements the per-leaf contract.

  Args:
    init: the ``init`` function.
    stages: ``(updates, state, params, **extra_args) -> LeafStages`` (or
      None, when ``whole_tree`` is given, for arguments with no per-leaf
      form).
    ordered: run the rows in order (``for_each_leaf``), so that one leaf's
      temporaries are dead before the next leaf's are made; otherwise its
      ``update`` is one whole-tree program.
    whole_tree: the update to call where ``stages`` returns None.

  Returns:
    An ``optax.GradientTransformationExtraArgs`` whose ``update`` is a
    ``PerLeafUpdate``. ``optax`` wrappers around it (``optax.chain``,
    ``inject_hyperparams``) build other update functions: use ``chain``.
  """
  return optax.GradientTransformationExtraArgs(
      init, PerLeafUpdate(stages, ordered=ordered, whole_tree=whole_tree))


def declared_stages(tx: Any) -> Optional[StagesFn]:
  """The stages ``tx`` declares (its update is a ``PerLeafUpdate``), or None."""
  update = getattr(tx, "update", None)
  return update.stages if isinstance(update, PerLeafUpdate) else None


def stages_of(tx: optax.GradientTransformation, updates: Any, state: Any,
              params: Any, **extra_args: Any
              ) -> tuple[Optional[LeafStages], str]:
  """``tx``'s stages for these arguments, and why not when there are none.

  A transformation that declares stages gives them. Any other is traced
  once (abstractly) and given ``adapt``'s stages if
  ``dependence.per_leaf_proof`` proves that it acts leaf by leaf; otherwise
  the result is ``(None, reason)``.

  Args:
    tx: a gradient transformation.
    updates: the gradients (arrays or ``jax.ShapeDtypeStruct`` s).
    state: ``tx``'s state.
    params: the params (arrays, abstract, or None).
    **extra_args: the extra arguments its update will get.

  Returns:
    ``(stages, "")`` or ``(None, reason)``.
  """
  declared = declared_stages(tx)
  if declared is not None:
    st = declared(updates, state, params, **extra_args)
    return st, "" if st is not None else "it has no per-leaf form here"
  tx = optax.with_extra_args_support(tx)
  try:
    layout = Layout.of(tx)
  except Exception as e:  # pylint: disable=broad-except
    return None, f"its state's per-leaf entries cannot be found ({e})"
  labels = layout.labels(state, jax.tree.structure(updates))
  if labels is None:
    return None, "its state does not match the updates' tree"
  reason = dependence.per_leaf_proof(tx.update, updates, state, params,
                                     labels, extra_args)
  if reason:
    return None, reason
  return adapt(tx, updates, state, layout), ""


# -- the adapter: a transformation that acts leaf by leaf ---------------------
class _ParamsSlot:
  """Stands in for the params in ``tx.init``: a pytree with no leaves.

  ``jax.tree.map(f, slot)`` returns a slot, so every subtree of the state
  made by mapping over the params comes out as a slot: the per-leaf entries
  (``optax.tree.map_params`` finds them the same way).
  """


jax.tree_util.register_pytree_node(
    _ParamsSlot, lambda _: ((), None), lambda *_: _ParamsSlot())


def _is_slot(x: Any) -> bool:
  return isinstance(x, _ParamsSlot)


class Layout(NamedTuple):
  """Where a transformation's state has per-leaf entries (its slots)."""
  entries: list[Any]  # a _ParamsSlot, or a shared entry's template
  treedef: Any        # the state's structure with the slots as leaves

  @classmethod
  def of(cls, tx: optax.GradientTransformation) -> "Layout":
    entries, treedef = jax.tree.flatten(jax.eval_shape(tx.init, _ParamsSlot()),
                                        is_leaf=_is_slot)
    return cls(entries, treedef)

  def split(self, state: Any, params_def: Any) -> list[Any]:
    """``state`` cut into one state per leaf (shared entries in each).

    A slot that the state leaves None (a first moment that ``init`` left
    out for a static ``b1 = 0``) is None for every leaf.
    """
    n = params_def.num_leaves
    columns = [params_def.flatten_up_to(part)
               if _is_slot(e) and part is not None else [part] * n
               for e, part in zip(self.entries,
                                  self.treedef.flatten_up_to(state))]
    return [self.treedef.unflatten([c[i] for c in columns]) for i in range(n)]

  def merge(self, states: list[Any], params_def: Any) -> Any:
    """The per-leaf states put back together (shared entries from the first)."""
    rows = [self.treedef.flatten_up_to(s) for s in states]
    parts = [params_def.unflatten([r[j] for r in rows])
             if _is_slot(e) and rows[0][j] is not None else rows[0][j]
             for j, e in enumerate(self.entries)]
    return self.treedef.unflatten(parts)

  def labels(self, state: Any, params_def: Any) -> Optional[list[int]]:
    """For each array of ``state``: its leaf, or -1 if shared; None if the
    state does not have this layout."""
    try:
      parts = self.treedef.flatten_up_to(state)
      out = []
      for e, part in zip(self.entries, parts):
        if _is_slot(e) and part is not None:
          for i, sub in enumerate(params_def.flatten_up_to(part)):
            out += [i] * len(jax.tree.leaves(sub))
        else:
          out += [-1] * len(jax.tree.leaves(part))
      return out
    except (ValueError, TypeError):
      return None


def adapt(tx: optax.GradientTransformationExtraArgs, updates: Any, state: Any,
          layout: Optional[Layout] = None) -> LeafStages:
  """The stages of a transformation that acts leaf by leaf: no rounds, and
  ``tx.update`` on each leaf alone with its cut of the state.

  Only for a transformation known or proved (``stages_of``) to act leaf by
  leaf; the state keeps ``tx``'s own layout.
  """
  layout = layout or Layout.of(tx)
  params_def = jax.tree.structure(updates)
  try:
    leaf_states = layout.split(state, params_def)
  except (ValueError, TypeError) as e:
    raise ValueError(
        f"the state does not match the updates' tree ({e}); initialise it "
        "with init on params of the same structure") from e

  def update(g, s, x, shared, **extra_args):
    del shared
    return tx.update(g, s, x, **extra_args)

  return LeafStages(leaf_states, None, (), update,
                    lambda states, _: layout.merge(states, params_def))


def leaf_by_leaf(tx: optax.GradientTransformation
                 ) -> optax.GradientTransformationExtraArgs:
  """Declares that ``tx`` acts leaf by leaf (for this package's own
  elementwise and per-leaf transformations): its stages are ``adapt``'s."""
  tx = optax.with_extra_args_support(tx)

  def stages(updates, state, params, **extra_args):
    del params, extra_args
    return adapt(tx, updates, state)

  return transformation(tx.init, stages)


# -- running the stages -----------------------------------------------------
def total(stats: list[Any]) -> Any:
  """The sum over leaves of per-leaf statistics (pytrees of one structure).

  Each entry is summed as one operation that XLA keeps whole: a Python sum is
  a chain of one add per leaf, which XLA copies into every fused reader of
  the result (the program grows with the square of the leaf count); the last
  entry of a cumulative sum stays one operation.
  """
  if not stats:
    return None
  return jax.tree.map(lambda *xs: jnp.cumsum(jnp.stack(xs), axis=0)[-1],
                      *stats)


def run(st: LeafStages, grads: list[Any], xs: list[Any], *, ordered: bool,
        **extra_args: Any) -> tuple[list[Any], Any]:
  """Runs ``st`` on the leaves: each round (its statistics summed), then the
  update.

  Args:
    st: the stages.
    grads: one gradient per leaf.
    xs: one param per leaf (or None); ``st.inputs`` instead if it has them.
    ordered: rows by ``for_each_leaf``, or one whole-tree program.
    **extra_args: passed to every per-leaf stage.

  Returns:
    ``([u_i], new_state)``.
  """
  rows = for_each_leaf if ordered else _unordered
  xs = xs if st.inputs is None else st.inputs
  states = list(st.leaf_states)
  shared = st.shared
  after = None  # each pass after the first waits for the sums before it
  for rnd in st.rounds:

    def statistic(g, s, x, rnd=rnd, shared=shared):
      return None, rnd.statistic(g, s, x, shared, **extra_args)

    outs = [chained for _, chained in rows(statistic, grads, states, xs,
                                           after=after)]
    states = [s for _, s in outs]
    shared = after = rnd.combine(total([stat for stat, _ in outs]), shared)
  outs = rows(lambda g, s, x: st.update(g, s, x, shared, **extra_args),
              grads, states, xs, after=after)
  return [u for u, _ in outs], st.finish([s for _, s in outs], shared)


def _unordered(fn: Callable, *columns: list[Any], after: Any = None
               ) -> list[Any]:
  del after
  return [fn(*row) for row in zip(*columns)]


def on_host(x: Any) -> bool:
  """True for an array (or tracer) that lives in host memory."""
  return (isinstance(x, (jax.Array, jax.core.Tracer))
          and jax.typeof(x).memory_space == jax.memory.Space.Host)


def _stage(tree: Any) -> Any:
  """The tree's arrays that live in host memory, brought into device memory."""
  return jax.tree.map(
      lambda x: jax.device_put(x, jax.memory.Space.Device) if on_host(x)
      else x, tree)


def tie(x: Any, token: jax.Array,
        scalars: bool = True) -> tuple[Any, jax.Array]:
  """``x`` and ``token`` through one optimization barrier.

  Whatever reads the returned arrays runs after ``token`` exists, and the
  returned token exists only once all of ``x`` does. With ``scalars=False``
  the scalars of ``x`` stay outside: a row's inputs such as a step count,
  shared by all rows, are then computed once.
  """
  flat, treedef = jax.tree.flatten(x)
  tied = [i for i, a in enumerate(flat) if scalars or jnp.ndim(a) > 0]
  out, token = jax.lax.optimization_barrier(([flat[i] for i in tied], token))
  for i, a in zip(tied, out):
    flat[i] = a
  return treedef.unflatten(flat), token


def for_each_leaf(fn: Callable[..., tuple[Any, Any]], *columns: list[Any],
                  after: Any = None) -> list[tuple[Any, Any]]:
  """``[fn(*row) for row in zip(*columns)]``, one row after the other.

  ``fn`` returns ``(free, chained)``. Lowered for GPUs and other non-CPU
  backends, rows are ordered by data dependencies alone (no conditional: on
  a GPU each one reads its predicate back to the host and waits for the
  device to drain)::

    token_0 = barrier(0)
    for i, row in enumerate(rows):
      row_i = stage(tie(row_i, token_{i-1}))   # host arrays -> device
      row_i = tie(row_i, token_i)
      free_i, chained_i = fn(*row_i)
      chained_i, token_{i+1} = tie(chained_i, token_i)

  so row ``i + 1``'s work starts once row ``i``'s ``chained`` outputs exist,
  and its host arrays (``kahan``'s residuals) are copied in once row
  ``i - 1`` is done, overlapping row ``i``. ``free`` outputs are not tied, so
  XLA may fuse them into their readers outside (an update into
  ``optax.apply_updates``). A row's scalar inputs are not tied (a scalar
  shared by all rows is computed once); its scalar ``chained`` outputs are.

  Lowered for the CPU, each row is a ``lax.cond`` island whose two branches
  are ``fn`` (the predicate, a token leaving each island with its outputs,
  cannot change the result): XLA:CPU schedules a branch as one unit, so one
  row's temporaries die before the next row's are made, which data
  dependencies alone do not achieve there. A conditional costs no host round
  trip on the CPU.

  Args:
    fn: the per-row work; arguments and outputs are pytrees of arrays
      (``None`` allowed).
    *columns: equal-length lists, one entry per row.
    after: arrays that the first rows wait for (``token_0`` is made from
      them): a pass that needs the sums of the pass before it, so that its
      first host copies do not start during that pass.

  Returns:
    ``fn``'s outputs, in order.

  Example:
    >>> outs = for_each_leaf(lambda a, b: (a + b, a * b),
    ...                      [jnp.ones(2), jnp.ones(3)], [2.0, 3.0])
  """
  rows = list(zip(*columns))
  if not rows:
    return []
  flat, treedef = jax.tree.flatten((rows, after))
  return jax.lax.platform_dependent(
      *flat,
      cpu=lambda *flat: _islands(fn, *treedef.unflatten(flat)),
      default=lambda *flat: _chain(fn, *treedef.unflatten(flat)))


def _chain(fn: Callable[..., Any], rows: list[Any], after: Any) -> list[Any]:
  """``for_each_leaf`` by data dependencies alone (GPU and other backends)."""
  outs = []
  _, token = tie(after, jax.lax.optimization_barrier(jnp.zeros([], jnp.int32)))
  prev = token  # the token of the row before the last
  for row in rows:
    staged, _ = tie(row, prev, scalars=False)
    row, _ = tie(_stage(staged), token, scalars=False)
    free, chained = fn(*row)
    chained, new = tie(chained, token)
    outs.append((free, chained))
    prev, token = token, new
  return outs


def _islands(fn: Callable[..., Any], rows: list[Any], after: Any
             ) -> list[Any]:
  """``for_each_leaf`` on the CPU: each row in a ``lax.cond`` island."""

  def island(token, *row):
    return jax.lax.optimization_barrier((fn(*row), token))

  outs = []
  _, token = tie(after, jax.lax.optimization_barrier(jnp.array(True)))
  for row in rows:
    out, token = jax.lax.cond(token, island, island, token, *row)
    outs.append(out)
  return outs


# -- composition ---------------------------------------------------------------
def chain(*txs: optax.GradientTransformation
          ) -> optax.GradientTransformationExtraArgs:
  """``optax.chain`` that keeps the per-leaf contract of its members.

  Same state and results as ``optax.chain(*txs)``. Its stages: the members'
  rounds in order (member ``j``'s statistics read the per-leaf updates of
  members ``0..j-1``, recomputed in that round's rows), then every member's
  update in turn. A member with no per-leaf form (neither declared nor
  proved) makes the chain one too: its update is then ``optax.chain``'s.

  Args:
    *txs: the transformations, in order.

  Returns:
    An ``optax.GradientTransformationExtraArgs``.

  Example:
    >>> import optax
    >>> import optax_kahan as ok
    >>> tx = ok.chain(ok.clip_by_global_norm(1.0), optax.adamw(1e-4))
  """
  txs = tuple(optax.with_extra_args_support(t) for t in txs)
  plain = optax.chain(*txs)

  def stages(updates, state, params, **extra_args):
    if len(state) != len(txs):
      raise ValueError(f"chain of {len(txs)} transformations got a state of "
                       f"{len(state)} entries")
    n = jax.tree.structure(updates).num_leaves
    members = []
    for tx, s in zip(txs, state):
      st, _ = stages_of(tx, updates, s, params, **extra_args)
      if st is None:
        return None
      members.append(st)
      # The next member sees this one's output: same tree, float updates.
    leaf_states = [tuple(m.leaf_states[i] for m in members) for i in range(n)]

    def through(g, s, x, shared, upto, **extra):
      # The updates of members 0..upto-1 of one leaf (states unchanged).
      for m, si, sh in zip(members[:upto], s, shared):
        g, _ = m.update(g, si, x, sh, **extra)
      return g

    rounds = []
    for j, m in enumerate(members):
      for rnd in m.rounds:

        def statistic(g, s, x, shared, j=j, rnd=rnd, **extra):
          g = through(g, s, x, shared, j, **extra)
          stat, sj = rnd.statistic(g, s[j], x, shared[j], **extra)
          return stat, s[:j] + (sj,) + s[j + 1:]

        def combine(sums, shared, j=j, rnd=rnd):
          return shared[:j] + (rnd.combine(sums, shared[j]),) + shared[j + 1:]

        rounds.append(Round(statistic, combine))

    def update(g, s, x, shared, **extra):
      new = []
      for m, si, sh in zip(members, s, shared):
        g, si = m.update(g, si, x, sh, **extra)
        new.append(si)
      return g, tuple(new)

    def finish(states, shared):
      return tuple(m.finish([s[j] for s in states], shared[j])
                   for j, m in enumerate(members))

    return LeafStages(leaf_states, tuple(m.shared for m in members),
                      tuple(rounds), update, finish)

  return transformation(plain.init, stages, whole_tree=plain.update)


def leafwise(tx: optax.GradientTransformation
             ) -> optax.GradientTransformationExtraArgs:
  """Runs ``tx`` row by row (``for_each_leaf``), bounding its scratch by a leaf.

  XLA compiles a whole-tree step as one program and runs each stage for
  every leaf before the next, so every leaf's float32 temporaries are alive
  at once. ``leafwise(tx)`` runs ``tx``'s stages (declared, or proved by
  ``stages_of``) one leaf after the other; the results are those of ``tx``
  on each leaf alone (see the module docstring). ``kahan`` always runs its
  inner transformation this way.

  Args:
    tx: a transformation with a per-leaf form.

  Returns:
    An ``optax.GradientTransformationExtraArgs`` with ``tx``'s state.

  Raises:
    ValueError: at the first update, when ``tx`` has no per-leaf form (it
      couples leaves in a way it does not declare), saying why.

  Example:
    >>> import optax
    >>> tx = leafwise(optax.adamw(1e-4))
  """
  tx = optax.with_extra_args_support(tx)

  def stages(updates, state, params, **extra_args):
    st, reason = stages_of(tx, updates, state, params, **extra_args)
    if st is None:
      raise ValueError(f"leafwise: the transformation has no per-leaf form: "
                       f"{reason}. Keep transformations that couple leaves "
                       "(optax.clip_by_global_norm, optax.apply_if_finite) "
                       "out of it, or use optax_kahan.clip_by_global_norm, "
                       "optax_kahan.apply_if_finite and optax_kahan.chain")
    return st

  return transformation(tx.init, stages, ordered=True)

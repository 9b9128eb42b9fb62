"""The per-leaf contract: an optimizer step as map, sum, map, run leaf by leaf.

Every step this package needs is three stages::

  1. map:    stat_i   = statistic(g_i, s_i, x_i)      per leaf (a dot, a norm)
  2. reduce: shared   = combine(sum_i stat_i)         one small sum
  3. map:    u_i, s_i = update(g_i, s_i, x_i, shared) per leaf

A transformation that declares them (``LeafStages``: the state cut per leaf,
zero or more ``Round`` s of stages 1 and 2, and stage 3) can run leaf by
leaf: ``kahan`` merges and splits each leaf's bf16 weight and residual inside
the leaf's rows, so a GPU step holds a leaf or two of residuals and
temporaries instead of all of them. A ``chain`` of such transformations is
one (its rounds are the members', each recomputing the earlier members'
per-leaf updates). Reduce late: a transformation may fold a step's sums in
at the start of the next (Prodigy's ``lagged_d``), keeping them in a
``LateSums``, which ``blockwise_step`` adds up over groups of leaves.

Who implements it (``optax_kahan.traced.stages_of``): a transformation
built with ``transformation`` declares its stages; any other has the stages
cut from its own whole-tree program (``optax_kahan.traced``), or none, and
then ``kahan`` runs it on the whole tree, with a warning.

One ordering primitive runs rows, ``for_each_leaf``: by data dependencies
when lowered for a GPU (or any non-CPU backend), as ``lax.cond`` islands on
the CPU. Both evaluate the same per-leaf functions, and ``jax.grad`` and
``jax.vmap`` go through both. Against the whole-tree program a row
can differ by an ulp (XLA turns ``optax.adam``'s bias-correction division
into a reciprocal multiply only where the scalar has one user, a leaf's row).

References:
  PyTorch optimizers' ``foreach=False`` loops, one tensor at a time.
  XLA operation semantics, ``OptimizationBarrier`` and ``Conditional``.
"""

from __future__ import annotations

from typing import Any, Callable, NamedTuple, Optional, Union

import jax
import jax.numpy as jnp
import optax

from optax_kahan._src import placement

class Round(NamedTuple):
  """Stages 1 and 2: ``statistic(g_i, s_i, x_i, shared, **extra_args) ->
  (stat_i, s_i)`` (arrays, and the leaf's state, which a round may update,
  as Prodigy's ``s``), then ``combine(reduce([stat_i]), shared) -> shared``,
  what the later stages see. ``reduce`` is the sum over the leaves
  (``total``) unless given: a round cut from a traced program
  (``optax_kahan.traced``) takes the list and adds it up as that program
  does."""
  statistic: Callable[..., tuple[Any, Any]]
  combine: Callable[[Any, Any], Any]
  reduce: Optional[Callable[[list[Any]], Any]] = None


class LeafStages(NamedTuple):
  """One step of a transformation, cut into rounds and a per-leaf update.

  Attributes:
    leaf_states: the state cut into one entry per leaf, in leaf order.
    shared: what the stages see before the first round (a learning rate,
      Prodigy's ``d``).
    rounds: the ``Round`` s, each one sum over the leaves.
    update: ``(g_i, s_i, x_i, shared, **extra_args) -> (u_i, s_i)``.
    finish: ``(leaf_states, shared) -> state`` (a reduce-late transformation
      sums its statistics into its ``LateSums`` here).
    inputs: each leaf's ``x_i`` when it is not the param (``kahan``: the
      bf16 weight and its residual, merged inside the rows), else None.
  """
  leaf_states: list[Any]
  shared: Any
  rounds: tuple[Round, ...]
  update: Callable[..., tuple[Any, Any]]
  finish: Callable[[list[Any], Any], Any]
  inputs: Optional[list[Any]] = None


# ``stages(updates, state, params, **extra_args) -> LeafStages``, or a string
# saying why the transformation has no per-leaf form for these arguments.
# ``updates`` and ``params`` may be abstract (``jax.ShapeDtypeStruct``);
# ``params`` may be None for a transformation that needs none.
StagesFn = Callable[..., Union[LeafStages, str]]


class LateSums(NamedTuple):
  """A reduce-late transformation's sums, for the next step. Groups of leaves
  stepped apart (``blockwise_step``) hold their own; their sum is the step's.
  """
  sums: Any


class PerLeafUpdate:
  """The ``update`` of a transformation that declares its stages: runs them
  as one whole-tree program (XLA fuses freely, as for optax's own) or, if
  ``ordered``, row by row (``for_each_leaf``). ``traced.stages_of`` reads
  ``stages``; ``parts`` are the transformations whose updates its rows run
  on the same leaves (``kahan``'s inner one, a chain's members); ``static``
  the keyword arguments that only ``stages`` and ``whole_tree`` take (Python
  values that shape the step, never passed to the rows)."""

  def __init__(self, stages: StagesFn, *, ordered: bool = False,
               whole_tree: Optional[Callable[..., Any]] = None,
               parts: tuple[optax.GradientTransformation, ...] = (),
               static: tuple[str, ...] = ()):
    self.stages = stages
    self.ordered = ordered
    self.whole_tree = whole_tree
    self.parts = parts
    self.static = static

  def __call__(self, updates, state, params=None, **extra_args):
    static = {k: extra_args.pop(k) for k in self.static if k in extra_args}
    st = self.stages(updates, state, params, **static, **extra_args)
    if not isinstance(st, LeafStages):
      return self.whole_tree(updates, state, params, **static, **extra_args)
    grads, treedef = jax.tree.flatten(updates)
    xs = ([None] * len(grads) if params is None
          else treedef.flatten_up_to(params))
    us, state = run(st, grads, xs, ordered=self.ordered, **extra_args)
    return treedef.unflatten(us), state


def transformation(
    init: Callable[..., Any], stages: StagesFn, *, ordered: bool = False,
    whole_tree: Optional[Callable[..., Any]] = None,
    parts: tuple[optax.GradientTransformation, ...] = (),
    static: tuple[str, ...] = (),
) -> optax.GradientTransformationExtraArgs:
  """A transformation that implements the per-leaf contract.

  Args:
    init: the ``init`` function.
    stages: ``(updates, state, params, **extra_args) -> LeafStages``, or
      why there is no per-leaf form (a string; then ``whole_tree`` runs).
    ordered: run the rows in order (``for_each_leaf``), one leaf's
      temporaries dead before the next's are made, not as one program.
    whole_tree: the update where ``stages`` returns a reason.
    parts: the transformations ``stages`` runs on the same leaves, whose
      programs ``traced.same_rows`` checks in each group of leaves.
    static: keyword arguments of ``update`` that go to ``stages`` and
      ``whole_tree`` alone, not to the rows (e.g. ``kahan``'s
      ``kahan_staged``).

  Returns:
    An ``optax.GradientTransformationExtraArgs`` whose ``update`` is a
    ``PerLeafUpdate`` (an optax wrapper around it builds another update
    function, whose stages ``traced.stages_of`` cuts from its program).
  """
  return optax.GradientTransformationExtraArgs(
      init, PerLeafUpdate(stages, ordered=ordered, whole_tree=whole_tree,
                          parts=parts, static=static))


# -- running the stages -----------------------------------------------------
def total(stats: list[Any]) -> Any:
  """The sum over leaves of per-leaf statistics (pytrees of one structure),
  each entry as one operation: a Python sum is one add per leaf, a chain XLA
  copies into every fused reader (a program quadratic in the leaf count);
  the last entry of a cumulative sum stays one operation."""
  if not stats:
    return None
  return jax.tree.map(lambda *xs: jnp.cumsum(jnp.stack(xs), axis=0)[-1],
                      *stats)


def run(st: LeafStages, grads: list[Any], xs: list[Any], *, ordered: bool,
        **extra_args: Any) -> tuple[list[Any], Any]:
  """Runs ``st`` on the leaves (``grads``, and ``xs`` or ``st.inputs``):
  each round, its statistics summed, then the update; rows by
  ``for_each_leaf`` if ``ordered``. Returns ``([u_i], new_state)``.

  Each pass runs its rows in the direction opposite to the pass before
  (results unchanged: sums in leaf order): on 24 equal leaves XLA:GPU then
  packs a two-pass step's staged residuals in two leaves' slots, not three."""
  rows = for_each_leaf if ordered else _unordered

  def one_pass(fn, columns, after, backwards):
    if not backwards:
      return rows(fn, *columns, after=after)
    return rows(fn, *(c[::-1] for c in columns), after=after)[::-1]

  xs = xs if st.inputs is None else st.inputs
  states = list(st.leaf_states)
  shared = st.shared
  after = None  # each pass after the first waits for the sums before it
  for i, rnd in enumerate(st.rounds):

    def statistic(g, s, x, rnd=rnd, shared=shared):
      return None, rnd.statistic(g, s, x, shared, **extra_args)

    outs = [chained for _, chained in one_pass(
        statistic, (grads, states, xs), after, backwards=i % 2 == 1)]
    states = [s for _, s in outs]
    stats = [stat for stat, _ in outs]
    shared = after = rnd.combine(
        total(stats) if rnd.reduce is None else rnd.reduce(stats), shared)
  outs = one_pass(lambda g, s, x: st.update(g, s, x, shared, **extra_args),
                  (grads, states, xs), after,
                  backwards=len(st.rounds) % 2 == 1)
  return [u for u, _ in outs], st.finish([s for _, s in outs], shared)


def _unordered(fn: Callable, *columns: list[Any], after: Any = None
               ) -> list[Any]:
  del after
  return [fn(*row) for row in zip(*columns)]


def tie(x: Any, token: jax.Array,
        scalars: bool = True) -> tuple[Any, jax.Array]:
  """``x`` and ``token`` through one optimization barrier: what reads the
  returned ``x`` runs after ``token`` exists, and the returned token exists
  once all of ``x`` does. ``scalars=False`` leaves the scalars of ``x`` out
  (a step count shared by all rows is then computed once)."""
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

    token_0 = barrier(after)
    for i, row in enumerate(rows):
      row_i = stage(tie(row_i, token_{i-1}))   # host arrays -> device
      row_i = tie(row_i, token_i)
      free_i, chained_i = fn(*row_i)
      chained_i, token_{i+1} = tie(chained_i, token_i)

  Row ``i + 1``'s work starts once row ``i``'s ``chained`` outputs exist (a
  residual ``fn`` sent back to host memory included), and its host inputs
  are copied in once row ``i - 1``'s are: one row's host outputs go out while
  the next row's come in. ``free`` outputs are not tied (XLA may fuse an
  update into ``optax.apply_updates``), nor are scalar inputs (a scalar all
  rows share is computed once); scalar ``chained`` outputs are.

  Lowered for the CPU, each row is a ``lax.cond`` island whose two branches
  are ``fn`` (its predicate, a token, cannot change the result): XLA:CPU
  schedules a branch as one unit, so one row's temporaries die before the
  next row's are made, which data dependencies alone do not achieve there.

  Args:
    fn: the per-row work; arguments and outputs are pytrees of arrays
      (``None`` allowed).
    *columns: equal-length lists, one entry per row.
    after: arrays the first row waits for (the sums of the pass before, so
      that this pass's host copies do not start during that one).

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
    row, _ = tie(placement.on_device(staged), token, scalars=False)
    free, chained = fn(*row)
    chained, new = tie(chained, token)
    outs.append((free, chained))
    prev, token = token, new
  return outs


def _island(fn: Callable[..., Any], token: jax.Array, *args: Any
            ) -> tuple[Any, jax.Array]:
  """``(fn(*args), token)`` as a ``lax.cond`` whose two branches are ``fn``
  (the predicate, a token, cannot change the result): XLA:CPU compiles a
  branch as one unit, fused with nothing outside it."""

  def branch(token, *args):
    return jax.lax.optimization_barrier((fn(*args), token))

  return jax.lax.cond(token, branch, branch, token, *args)


def _islands(fn: Callable[..., Any], rows: list[Any], after: Any
             ) -> list[Any]:
  """``for_each_leaf`` on the CPU: each row in a ``lax.cond`` island."""
  outs = []
  _, token = tie(after, jax.lax.optimization_barrier(jnp.array(True)))
  for row in rows:
    out, token = _island(fn, token, *row)
    outs.append(out)
  return outs


def apart_on_cpu(fn: Callable[..., Any], *args: Any) -> Any:
  """``fn(*args)``; lowered for the CPU, as one ``lax.cond`` island, so that
  XLA:CPU fuses none of it with its consumers (its optimization barriers are
  expanded before fusion). Other backends get ``fn`` itself."""

  def cpu(*args):
    return _island(fn, jax.lax.optimization_barrier(jnp.array(True)),
                   *args)[0]

  return jax.lax.platform_dependent(*args, cpu=cpu, default=fn)

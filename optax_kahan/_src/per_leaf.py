"""The per-leaf contract: an optimizer step as map, sum, map, run leaf by leaf.

Every step this package needs is three stages::

  1. map:    stat_i   = statistic(g_i, s_i, x_i)      per leaf (a dot, a norm)
  2. reduce: shared   = combine(sum_i stat_i)         one small sum
  3. map:    u_i, s_i = update(g_i, s_i, x_i, shared) per leaf

Leaf by leaf (``for_each_leaf``), a step holds a leaf or two of temporaries,
not all, and may differ from the whole-tree program by an ulp (XLA rounds a
scalar factor apart); see docs/guides/per_leaf.md.

References:
  PyTorch optimizers' ``foreach=False`` loops, one tensor at a time.
  XLA operation semantics, ``OptimizationBarrier`` and ``Conditional``.
"""

from typing import Any, Callable, NamedTuple, Optional, Union

import jax
import jax.numpy as jnp
import optax

from optax_kahan._src import placement


class Round(NamedTuple):
  """Stages 1 and 2: ``statistic(g_i, s_i, x_i, shared, **extra_args) ->
  (stat_i, s_i)`` (a new leaf state), then ``combine(reduce([stat_i]),
  shared) -> shared``; ``reduce`` defaults to the sum over the leaves."""
  statistic: Callable[..., tuple[Any, Any]]
  combine: Callable[[Any, Any], Any]
  reduce: Optional[Callable[[list[Any]], Any]] = None


class LeafStages(NamedTuple):
  """One step of a transformation, cut into rounds and a per-leaf update.

  Attributes:
    leaf_states: the state cut into one entry per leaf, in leaf order.
    shared: what the stages see before the first round.
    rounds: the ``Round`` s, each one sum over the leaves.
    update: ``(g_i, s_i, x_i, shared, **extra_args) -> (u_i, s_i)``.
    finish: ``(leaf_states, shared) -> state``.
    inputs: each leaf's ``x_i`` if not the param (``kahan``'s), else None.
  """
  leaf_states: list[Any]
  shared: Any
  rounds: tuple[Round, ...]
  update: Callable[..., tuple[Any, Any]]
  finish: Callable[[list[Any], Any], Any]
  inputs: Optional[list[Any]] = None


# ``(updates, state, params, **extra_args) -> LeafStages``, or why not (a str);
# ``updates`` and ``params`` may be abstract, ``params`` None.
StagesFn = Callable[..., Union[LeafStages, str]]


class LateSums(NamedTuple):
  """A reduce-late transformation's sums, for the next step; groups of leaves
  stepped apart (``blockwise_step``) hold their own, summed."""
  sums: Any


class PerLeafUpdate:
  """A ``transformation``'s update: its stages, row by row if ``ordered``."""

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
    ordered: run the rows one after the other (``for_each_leaf``).
    whole_tree: the update where ``stages`` returns a reason.
    parts: the transformations ``stages`` runs on the same leaves.
    static: ``update``'s keywords for ``stages`` and ``whole_tree`` only.

  Returns:
    An ``optax.GradientTransformationExtraArgs``.
  """
  return optax.GradientTransformationExtraArgs(
      init, PerLeafUpdate(stages, ordered=ordered, whole_tree=whole_tree,
                          parts=parts, static=static))


def total(stats: list[Any]) -> Any:
  """The sum over leaves of per-leaf statistics, as one operation: a chain of
  adds XLA copies into every fused reader (quadratic in the leaf count)."""
  if not stats:
    return None
  return jax.tree.map(lambda *xs: jnp.cumsum(jnp.stack(xs), axis=0)[-1],
                      *stats)


def run(st: LeafStages, grads: list[Any], xs: list[Any], *, ordered: bool,
        **extra_args: Any) -> tuple[list[Any], Any]:
  """Runs ``st``'s rounds, then its update: ``([u_i], new_state)``. Passes
  alternate direction (sums stay in leaf order; on a GPU, among rows of
  equal bytes in host memory, see ``_chain``): XLA:GPU then packs a
  two-pass step's staged residuals in two leaves' slots, not three."""
  rows = for_each_leaf if ordered else _unordered

  def one_pass(fn, columns, after, backwards):
    if not backwards:
      return rows(fn, *columns, after=after)
    return rows(fn, *(c[::-1] for c in columns), after=after)[::-1]

  xs = xs if st.inputs is None else st.inputs
  states = list(st.leaf_states)
  shared = st.shared
  after = None
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
  """``x`` and ``token`` through one optimization barrier; ``scalars=False``
  leaves ``x``'s scalars out (a scalar all rows share is computed once)."""
  flat, treedef = jax.tree.flatten(x)
  tied = [i for i, a in enumerate(flat) if scalars or jnp.ndim(a) > 0]
  out, token = jax.lax.optimization_barrier(([flat[i] for i in tied], token))
  for i, a in zip(tied, out):
    flat[i] = a
  return treedef.unflatten(flat), token


def for_each_leaf(fn: Callable[..., tuple[Any, Any]], *columns: list[Any],
                  after: Any = None) -> list[tuple[Any, Any]]:
  """``[fn(*row) for row in zip(*columns)]``, one row after the other.

  ``fn`` returns ``(free, chained)``. Lowered for non-CPU backends, rows are
  ordered by data dependencies alone (a GPU conditional would wait for the
  device to drain)::

    token_0 = barrier(after)
    for i, row in enumerate(sorted(rows, key=bytes_in_host_memory)):
      row_i = stage(tie(row_i, token_{i-1}))   # host arrays -> device
      row_i = tie(row_i, token_i)
      free_i, chained_i = fn(*row_i)
      chained_i, token_{i+1} = tie(chained_i, token_i)

  Row ``i + 1``'s host inputs come in while row ``i``'s outputs go out (the
  sort, stable, puts copies of about the same size side by side); ``free``
  outputs and scalar inputs are not tied (XLA may fuse an update into
  ``optax.apply_updates``). On the CPU each row is a ``lax.cond`` island,
  in the rows' order.

  Args:
    fn: the per-row work, on pytrees of arrays (``None`` allowed).
    *columns: equal-length lists, one entry per row.
    after: arrays the first row waits for (the sums of the pass before).

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
  """``for_each_leaf`` by data dependencies alone (non-CPU backends).

  The rows run in ascending order of their bytes in host memory (ties, and
  rows without any, in their own order); the outputs come back in the rows'
  order. Row i's host inputs come in while row i-1's outputs go out, so
  copies of about the same size share the two PCIe directions. In tree
  order a model's large kernels and small biases alternate, each pair of
  copies costs its larger one, and the step takes about both directions'
  time (``python -m benchmarks.gpu_compile``: FLUX.1-dev's layers, 2 + 2
  blocks unrolled, a whole training step compiled for an H200, modelled at
  85.0 ms in this order against a PCIe floor of 59.8 ms; docs/guides/gpu.md).
  """
  order = sorted(range(len(rows)), key=lambda i: placement.host_bytes(rows[i]))
  outs: list[Any] = [None] * len(rows)
  _, token = tie(after, jax.lax.optimization_barrier(jnp.zeros([], jnp.int32)))
  prev = token  # the row before the last's: its host inputs gate ours
  for i in order:
    staged, _ = tie(rows[i], prev, scalars=False)
    row, _ = tie(placement.on_device(staged), token, scalars=False)
    free, chained = fn(*row)
    chained, new = tie(chained, token)
    outs[i] = (free, chained)
    prev, token = token, new
  return outs


def _island(fn: Callable[..., Any], token: jax.Array, *args: Any
            ) -> tuple[Any, jax.Array]:
  """``(fn(*args), token)`` as a ``lax.cond`` with ``fn`` in both branches:
  XLA:CPU compiles a branch as one unit, fused with nothing outside it."""

  def branch(token, *args):
    return jax.lax.optimization_barrier((fn(*args), token))
  return jax.lax.cond(token, branch, branch, token, *args)


def _islands(fn: Callable[..., Any], rows: list[Any], after: Any) -> list[Any]:
  """``for_each_leaf`` on the CPU: each row in a ``lax.cond`` island."""
  outs = []
  _, token = tie(after, jax.lax.optimization_barrier(jnp.array(True)))
  for row in rows:
    out, token = _island(fn, token, *row)
    outs.append(out)
  return outs


def apart_on_cpu(fn: Callable[..., Any], *args: Any) -> Any:
  """``fn(*args)``; on the CPU as one ``lax.cond`` island, so XLA:CPU fuses
  none of it with its consumers (barriers are expanded before fusion)."""

  def cpu(*args):
    return _island(fn, jax.lax.optimization_barrier(jnp.array(True)),
                   *args)[0]
  return jax.lax.platform_dependent(*args, cpu=cpu, default=fn)

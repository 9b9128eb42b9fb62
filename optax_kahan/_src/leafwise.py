"""Running a transformation leaf by leaf: ``leafwise``, and ``chain``.

References:
  PyTorch optimizers' ``foreach=False`` loops, one tensor at a time.
"""

import jax
import optax

from optax_kahan._src import validation
from optax_kahan._src.per_leaf import LeafStages
from optax_kahan._src.per_leaf import transformation
from optax_kahan._src.traced import stages_of


def chain(*txs: optax.GradientTransformation
          ) -> optax.GradientTransformationExtraArgs:
  """``optax.chain`` that keeps the per-leaf contract of its members.

  ``optax.chain``'s state and results, each member's own stages kept (its
  ``LateSums``; member ``j``'s rows recompute members ``0..j-1``'s updates).
  A member with no per-leaf form makes the update ``optax.chain``'s.

  Args:
    *txs: the transformations, in order.

  Returns:
    An ``optax.GradientTransformationExtraArgs``.

  Example:
    >>> import optax
    >>> tx = chain(clip_by_global_norm(1.0), optax.adamw(1e-4))
  """
  txs = tuple(optax.with_extra_args_support(t) for t in txs)
  plain = optax.chain(*txs)

  def stages(updates, state, params, **extra_args):
    if len(state) != len(txs):
      raise ValueError(f"chain of {len(txs)} transformations got a state of "
                       f"{len(state)} entries")
    n = jax.tree.structure(updates).num_leaves
    members = []
    for j, (tx, s) in enumerate(zip(txs, state)):
      st, reason = stages_of(tx, updates, s, params, **extra_args)
      if st is None:
        return f"member {j} of the chain: {reason}"
      members.append(st)
    leaf_states = [tuple(m.leaf_states[i] for m in members) for i in range(n)]

    def through(g, s, x, shared, upto, **extra):
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
        rounds.append(rnd._replace(statistic=statistic, combine=combine))

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

  return transformation(plain.init, stages, whole_tree=plain.update, parts=txs)


def leafwise(tx: optax.GradientTransformation
             ) -> optax.GradientTransformationExtraArgs:
  """Runs ``tx`` row by row (``for_each_leaf``), bounding its scratch by a leaf.

  Args:
    tx: a transformation with a per-leaf form.

  Returns:
    An ``optax.GradientTransformationExtraArgs`` with ``tx``'s state.

  Raises:
    ValueError: at the first update, when ``tx`` has no per-leaf form.

  Example:
    >>> import optax
    >>> tx = leafwise(optax.adamw(1e-4))
  """
  validation.check_transformation("leafwise", "tx", tx)
  tx = optax.with_extra_args_support(tx)

  def stages(updates, state, params, **extra_args):
    st, reason = stages_of(tx, updates, state, params, **extra_args)
    if st is None:
      raise ValueError(f"leafwise: the transformation has no per-leaf form: "
                       f"{reason}")
    return st

  return transformation(tx.init, stages, ordered=True, parts=(tx,))

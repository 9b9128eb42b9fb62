"""Running a transformation leaf by leaf: ``leafwise``, and ``chain``.

``leafwise(tx)`` runs ``tx``'s stages (declared, or cut from its own
whole-tree program: ``optax_kahan.traced``) one leaf after the other;
``chain`` composes declared stages (``optax.chain``'s state and results) so
that a member's own form, a reduce-late ``LateSums`` say, is kept.

References:
  PyTorch optimizers' ``foreach=False`` loops, one tensor at a time.
"""

from __future__ import annotations

import jax
import optax

from optax_kahan._src import validation
from optax_kahan._src.per_leaf import LeafStages
from optax_kahan._src.per_leaf import transformation
from optax_kahan._src.traced import stages_of


def chain(*txs: optax.GradientTransformation
          ) -> optax.GradientTransformationExtraArgs:
  """``optax.chain`` that keeps the per-leaf contract of its members.

  ``optax.chain``'s state and results. Its stages: the members' rounds in
  order (member ``j``'s statistics read members ``0..j-1``'s per-leaf
  updates, recomputed in that round's rows), then each member's update. With
  a member that has no per-leaf form, the update is ``optax.chain``'s.

  Args:
    *txs: the transformations, in order.

  Returns:
    An ``optax.GradientTransformationExtraArgs``.

  Example:
    >>> import optax
    >>> import optax_kahan as ok
    >>> tx = ok.per_leaf.chain(ok.per_leaf.clip_by_global_norm(1.0), optax.adamw(1e-4))
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

  return transformation(plain.init, stages, whole_tree=plain.update,
                        parts=txs)


def leafwise(tx: optax.GradientTransformation
             ) -> optax.GradientTransformationExtraArgs:
  """Runs ``tx`` row by row (``for_each_leaf``), bounding its scratch by a leaf.

  A whole-tree program has every leaf's float32 temporaries alive at once;
  ``leafwise(tx)`` runs ``tx``'s stages (``stages_of``) one leaf after the
  other, as ``kahan`` does, with ``tx``'s results (module docstring).

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
  validation.check_transformation("leafwise", "tx", tx)
  tx = optax.with_extra_args_support(tx)

  def stages(updates, state, params, **extra_args):
    st, reason = stages_of(tx, updates, state, params, **extra_args)
    if st is None:
      raise ValueError(f"leafwise: the transformation has no per-leaf form: "
                       f"{reason}")
    return st

  return transformation(tx.init, stages, ordered=True, parts=(tx,))

"""optax's transformations that couple the leaves by one sum, with the contract.

optax's read every leaf's gradient for one norm or finiteness test; these
have optax's state and results as ``optax_kahan.per_leaf`` stages::

  clip_by_global_norm:  sum_i ||g_i||^2  ->  norm  ->  g_i * min(1, c / norm)
  apply_if_finite:      sum_i #nonfinite(g_i)  ->  finite  ->  inner or zero

optax's own ``clip_by_global_norm`` needs neither: its stages are cut from
its program (``optax_kahan.traced``), and they sum the norm in optax's
order. optax's ``apply_if_finite`` selects the whole tree with one
``lax.cond``, which cannot be cut; this one selects each leaf.

References:
  optax, ``clip_by_global_norm`` and ``apply_if_finite``.
  Pascanu et al., "On the difficulty of training recurrent neural networks",
  ICML 2013.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp
import optax

from optax_kahan._src import per_leaf
from optax_kahan._src import traced


def clip_by_global_norm(max_norm: float
                        ) -> optax.GradientTransformationExtraArgs:
  """``optax.clip_by_global_norm`` with a per-leaf form.

  .. math::

    u_i = g_i \\cdot \\frac{c}{\\max(c, \\|g\\|)}, \\qquad
    \\|g\\|^2 = \\sum_i \\|g_i\\|^2

  (``g_i`` unchanged where ``||g|| < c``, as optax selects). The norm is one
  round: each leaf's sum of squares, summed. Its state is optax's
  (``EmptyState``); the norm's summation order differs from optax's, so the
  clipped values can differ by an ulp.

  Args:
    max_norm: the largest global norm ``c``.

  Returns:
    An ``optax.GradientTransformationExtraArgs``.

  Example:
    >>> import optax
    >>> tx = chain(clip_by_global_norm(1.0), optax.adamw(1e-4))
  """

  def stages(updates, state, params, **extra_args):
    del params, extra_args
    n = jax.tree.structure(updates).num_leaves

    def statistic(g, s, x, shared, **extra):
      del x, shared, extra
      return jnp.sum(jnp.square(g)), s  # in g's dtype, as optax

    def update(g, s, x, norm, **extra):
      del x, extra
      clipped = (g / norm.astype(g.dtype)) * max_norm
      return jax.lax.select(norm < max_norm, g, clipped), s

    return per_leaf.LeafStages(
        [None] * n, None,
        (per_leaf.Round(statistic, lambda sums, _: jnp.sqrt(sums)),),
        update, lambda states, _: state)

  return per_leaf.transformation(lambda params: optax.EmptyState(), stages)


def apply_if_finite(inner: optax.GradientTransformation,
                    max_consecutive_errors: int
                    ) -> optax.GradientTransformationExtraArgs:
  """``optax.apply_if_finite`` with a per-leaf form.

  A step whose gradients hold a NaN or an Inf changes nothing (zero updates,
  ``inner``'s state kept) unless it is the ``max_consecutive_errors + 1``-th
  in a row. One round counts the non-finite entries; the inner update is
  selected (``jnp.where``) where optax has a ``lax.cond`` over the whole tree.
  The state is optax's ``ApplyIfFiniteState``.

  Args:
    inner: the transformation to protect; it needs a per-leaf form for this
      one to have one (otherwise the update is optax's).
    max_consecutive_errors: how many non-finite steps in a row to skip.

  Returns:
    An ``optax.GradientTransformationExtraArgs``.

  Example:
    >>> import optax
    >>> tx = apply_if_finite(optax.adamw(1e-4), max_consecutive_errors=3)
  """
  inner = optax.with_extra_args_support(inner)
  plain = optax.apply_if_finite(inner, max_consecutive_errors)

  def stages(updates, state, params, **extra_args):
    st, reason = traced.stages_of(inner, updates, state.inner_state, params,
                                    **extra_args)
    if st is None:
      return f"its inner transformation: {reason}"

    def statistic(g, s, x, shared, **extra):
      del x, shared, extra
      return jnp.sum(~jnp.isfinite(g), dtype=jnp.int32), s

    def combine(bad, shared):
      finite = bad == 0
      count = jnp.where(finite, jnp.zeros([], jnp.int32),
                        optax.safe_increment(state.notfinite_count))
      apply = finite | (count > max_consecutive_errors)
      return (finite, count, apply, shared[3])

    def inner_round(rnd):
      return rnd._replace(
          statistic=lambda g, s, x, shared, **extra: rnd.statistic(
              g, s, x, shared[3], **extra),
          combine=lambda sums, shared: (*shared[:3],
                                        rnd.combine(sums, shared[3])))

    def update(g, s, x, shared, **extra):
      u, new = st.update(g, s, x, shared[3], **extra)
      return jnp.where(shared[2], u, jnp.zeros_like(u)), new

    def finish(states, shared):
      finite, count, apply, inner_shared = shared
      new = st.finish(states, inner_shared)
      return optax.ApplyIfFiniteState(
          notfinite_count=count, last_finite=finite,
          total_notfinite=jnp.where(
              finite, state.total_notfinite,
              optax.safe_increment(state.total_notfinite)),
          inner_state=jax.tree.map(lambda n, o: jnp.where(apply, n, o), new,
                                   state.inner_state))

    no = jnp.zeros([], bool)
    return per_leaf.LeafStages(
        st.leaf_states, (no, state.notfinite_count, no, st.shared),
        (per_leaf.Round(statistic, combine),
         *(inner_round(r) for r in st.rounds)), update, finish)

  return per_leaf.transformation(plain.init, stages, whole_tree=plain.update,
                                 parts=(inner,))

"""optax's transformations that couple the leaves by one sum, as stages::

  clip_by_global_norm:  sum_i ||g_i||^2  ->  norm  ->  g_i * min(1, c / norm)
  apply_if_finite:      sum_i #nonfinite(g_i)  ->  finite  ->  inner or zero

References:
  optax, ``clip_by_global_norm`` and ``apply_if_finite``.
  Pascanu et al., "On the difficulty of training recurrent neural networks",
  ICML 2013.
"""

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

  Sums the norm in another order than ``optax.clip_by_global_norm`` (an ulp).

  Args:
    max_norm: the largest global norm ``c``.

  Returns:
    An ``optax.GradientTransformationExtraArgs`` with optax's state.

  Example:
    >>> tx = clip_by_global_norm(1.0)
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

  A step with a NaN or Inf gradient changes nothing unless it is the
  ``max_consecutive_errors + 1``-th in a row; each leaf is selected
  (``jnp.where``) where optax's one ``lax.cond`` cannot be cut.

  Args:
    inner: the transformation to protect; without a per-leaf form, the
      update is optax's.
    max_consecutive_errors: how many non-finite steps in a row to skip.

  Returns:
    An ``optax.GradientTransformationExtraArgs`` with optax's state.

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

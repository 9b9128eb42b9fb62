"""optax's transformations that couple the leaves by one sum, with the contract.

optax's read every leaf's gradient for one norm or finiteness test; these
have optax's state and results as ``optax_kahan.per_leaf`` stages::

  clip_by_global_norm:  sum_i ||g_i||^2  ->  norm  ->  g_i * min(1, c / norm)
  apply_if_finite:      sum_i #nonfinite(g_i)  ->  finite  ->  inner or zero

``optax_form`` recognises optax's own (and ``optax.chain`` s holding them),
so ``kahan(optax.chain(optax.clip_by_global_norm(1.0), optax.adamw(...)))``
keeps a per-leaf form.

References:
  optax, ``clip_by_global_norm`` and ``apply_if_finite``.
  Pascanu et al., "On the difficulty of training recurrent neural networks",
  ICML 2013.
"""

from __future__ import annotations

from typing import Any, Callable, Optional

import jax
import jax.numpy as jnp
import optax

from optax_kahan._src import per_leaf


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
    st, reason = per_leaf.stages_of(inner, updates, state.inner_state, params,
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
      return per_leaf.Round(
          lambda g, s, x, shared, **extra: rnd.statistic(
              g, s, x, shared[3], **extra),
          lambda sums, shared: (*shared[:3], rnd.combine(sums, shared[3])))

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

  return per_leaf.transformation(plain.init, stages, whole_tree=plain.update)



# -- optax's own, recognised ---------------------------------------------------
def _code(fn: Any) -> Any:
  return getattr(fn, "__code__", None)


def _free(fn: Callable[..., Any]) -> dict[str, Any]:
  return dict(zip(fn.__code__.co_freevars,
                  (c.cell_contents for c in fn.__closure__ or ())))


_EMPTY = optax.GradientTransformation(optax.init_empty_state,
                                      lambda u, s, p=None: (u, s))
_EXTRA_ARGS = _code(optax.with_extra_args_support(_EMPTY).update)
_CHAIN_INIT = _code(optax.chain(_EMPTY).init)
_CHAIN_UPDATE = _code(optax.chain(_EMPTY).update)
_CLIP = _code(optax.clip_by_global_norm(1.0).update)
_IF_FINITE = _code(optax.apply_if_finite(_EMPTY, 1).update)


def optax_form(tx: optax.GradientTransformation
               ) -> Optional[optax.GradientTransformationExtraArgs]:
  """This package's form of optax's ``chain``, ``clip_by_global_norm`` or
  ``apply_if_finite`` (or ``with_extra_args_support`` of one), or None.

  Recognised by the update function's code object (the installed optax's
  own) and rebuilt from its free variables (the members, the norm, the inner
  transformation), with the same state; any other layout is not recognised
  (no guess). The results are optax's up to the summation order of the
  global norm (an ulp).
  """
  code = _code(getattr(tx, "update", None))
  free = _free(tx.update) if code is not None else {}
  if code is _EXTRA_ARGS and set(free) == {"tx"}:
    return optax_form(free["tx"])
  if code is _CLIP and set(free) == {"max_norm"}:
    return clip_by_global_norm(free["max_norm"])
  if code is _IF_FINITE and set(free) == {"inner", "max_consecutive_errors"}:
    return apply_if_finite(free["inner"], free["max_consecutive_errors"])
  if (code is _CHAIN_UPDATE and set(free) == {"update_fns"}
      and _code(tx.init) is _CHAIN_INIT
      and set(_free(tx.init)) == {"init_fns"}):
    inits, updates = _free(tx.init)["init_fns"], free["update_fns"]
    if len(inits) == len(updates):
      return per_leaf.chain(*map(optax.GradientTransformationExtraArgs,
                                 inits, updates))
  return None

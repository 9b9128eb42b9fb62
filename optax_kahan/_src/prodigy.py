"""Prodigy's learning-rate-free d-estimation around a rescalable preconditioner.

See ``scale_by_prodigy`` and docs/guides/prodigy.md (why clipping slows d).

References:
  Mishchenko & Defazio, "Prodigy: An Expeditiously Adaptive Parameter-Free
  Learner", ICML 2024 (arXiv:2306.06101); prodigyopt 1.1.2
  (https://github.com/konstmish/prodigy), including PRs #20 and #22.
"""

import functools
from typing import Any, NamedTuple, Optional

import chex
import jax
import jax.numpy as jnp
import optax

from optax_kahan._src import per_leaf
from optax_kahan._src import traced
from optax_kahan._src import validation


class ScaleByProdigyState(NamedTuple):
  """State of ``scale_by_prodigy``: ``count`` calls of ``update`` (for
  schedules), ``k`` steps taken, ``numerator`` ``r``, ``params0`` the sliced
  ``x0``, ``d_prev`` the ``d`` the preconditioner's moments are scaled by and,
  with ``lagged_d``, ``pending`` the step's sums (else None)."""
  count: chex.Array
  k: chex.Array
  d: chex.Array
  d_prev: chex.Array
  d_max: chex.Array
  numerator: chex.Array
  s: optax.Updates
  params0: optax.Params
  preconditioner_state: optax.OptState
  pending: Optional[per_leaf.LateSums] = None


def _explicit_axes(x: Any) -> tuple[str, ...]:
  sharding = jax.typeof(x).sharding
  explicit = set(sharding.mesh.explicit_axes)
  used = jax.tree.leaves(tuple(sharding.spec))
  return tuple(a for a in used if a in explicit)


def _slice(x: jax.Array, slice_p: int) -> jax.Array:
  """Every ``slice_p``-th entry of the flattened ``x`` (``x`` itself for 1).
  JAX refuses an uneven strided slice of an Explicit sharding: auto_axes."""
  if slice_p == 1:
    return x
  if _explicit_axes(x):
    return jax.sharding.auto_axes(
        lambda y: jnp.reshape(y, (-1,))[::slice_p],
        out_sharding=jax.P())(x)
  return jnp.reshape(x, (-1,))[::slice_p]


def _warn_if_narrow(params: Any, first_step: Any) -> None:
  """Warns if a first step ``d0 * lr < 2**-9`` cannot move bf16/fp16 weights."""
  narrow = sorted({jnp.dtype(x.dtype).name for x in jax.tree.leaves(params)
                   if validation.is_narrow_float(x.dtype)
                   and not isinstance(x, jax.ShapeDtypeStruct)})
  if narrow and isinstance(first_step, (int, float)) and first_step < 2**-9:
    validation.warn(
        f"scale_by_prodigy on {', '.join(narrow)} params: its first steps "
        f"(d0 times the learning rate, {first_step:.3g}) are below half an "
        "ulp of these weights, so they do not move and d stays at d0 (the "
        "run stalls). Wrap the optimizer in optax_kahan.kahan(...), which "
        "gives it float32 weights", stacklevel=4)


def _scalar_dtype(params: Any) -> jnp.dtype:
  dtypes = [jnp.result_type(p) for p in jax.tree.leaves(params)]
  return jnp.result_type(jnp.float32, *dtypes)


def scale_by_prodigy(
    preconditioner: optax.GradientTransformation,
    *,
    learning_rate: optax.ScalarOrSchedule = 1.0,
    b3: float = 0.999**0.5,
    weight_decay: float = 0.0,
    d0: float = 1e-6,
    d_coef: float = 1.0,
    growth_rate: float = float("inf"),
    slice_p: int = 1,
    safeguard_warmup: bool = False,
    bias_correction: Optional[tuple[float, float]] = None,
    lagged_d: bool = False,
    state_dtype: Optional[jnp.dtype] = None,
) -> optax.GradientTransformationExtraArgs:
  """Prodigy's step size ``d`` around a preconditioner; returns the final step.

  With ``d = d_k`` at step ``k`` (prodigyopt 1.1.2; sums over all leaves)::

    bc    = sqrt(1 - b2^(k+1)) / (1 - b1^(k+1))  with bias_correction, else 1
    dlr   = d * lr_k * bc
    r    <- b3 r + (d / d0) dlr <g_S, x0_S - x_S>
    s    <- b3 s + (d / d0) dlr g_S      ((d / d0) d g_S with safeguard_warmup)
    d^    = d_coef r / sum |s|
    d     = max(d, d^) if d == d0 else d
    d_max = max(d_max, d^);  d_{k+1} = min(d_max, d growth_rate)
    x    <- x - dlr (P_k + lambda x)

  ``S``: every ``slice_p``-th entry of a flattened leaf; ``P_k``: the
  preconditioner's output. For L2 decay put ``optax.add_decayed_weights``
  first. As in prodigyopt, a step with ``sum |s| == 0`` is skipped (params,
  ``d``, ``r``, ``k`` stay; the moments take ``g``; optax.contrib gives NaN)
  and ``lr == 0`` is a no-op. ``d``, ``d_max``, ``r`` are float32 (float64
  with float64 params); an all-zero leaf's ``x0`` is a zero slice (0-d in
  prodigyopt). Schedules see the ``update`` count, bias correction ``k``.

  Args:
    preconditioner: e.g. ``scale_by_second_moment(b1, b2, eps)``, with a
      per-leaf form; its ``update`` gets the args ``d_ratio``, ``d_growth``.
    learning_rate: multiplier of ``d`` (1.0 in Prodigy), float or schedule.
    b3: decay of ``r`` and ``s`` (``sqrt(b2)`` in prodigyopt).
    weight_decay: decoupled weight decay ``lambda``.
    d0: initial ``d``.
    d_coef: multiplier of ``d^``.
    growth_rate: largest growth of ``d`` per step (inf: unbounded).
    slice_p: use every ``slice_p``-th entry of each leaf for ``r`` and ``s``.
    safeguard_warmup: leave ``lr`` out of ``s`` (helps with warm-up schedules).
    bias_correction: ``(b1, b2)`` for ``bc``, or None.
    lagged_d: fold step ``k``'s sums into ``d_{k+1}`` when step ``k+1`` starts
      (for ``optax_kahan.blockwise``). Then ``d_growth = 1`` (``eps d_k``, and
      ``d_k g`` if ``b1 = 0``) and ``sum |s| == 0`` keeps only ``d, r, k``.
    state_dtype: dtype of ``s`` and ``x0`` (e.g. ``jnp.bfloat16``, rounded to
      nearest; ``x0`` is exact from bf16 weights); None follows the params.

  Returns:
    A per-leaf ``optax.GradientTransformationExtraArgs`` (one round; none
    with ``lagged_d``); ValueError at the first update if the preconditioner
    has no per-leaf form. Extra args go to the preconditioner.

  Example:
    >>> tx = scale_by_prodigy(scale_by_second_moment(0.9, 0.999, 1e-8))

  References:
    Mishchenko & Defazio, 2024; prodigyopt 1.1.2.
  """
  validation.check_positive("d0", d0)
  validation.check_positive("d_coef", d_coef)
  validation.check_positive("growth_rate", growth_rate)
  validation.check_positive("weight_decay", weight_decay, allow_zero=True)
  if not callable(learning_rate):
    validation.check_positive("learning_rate", learning_rate,
                              allow_zero=True)
  validation.check_beta("b3", b3)
  if not isinstance(slice_p, int) or isinstance(slice_p, bool) or slice_p < 1:
    raise ValueError(
        f"slice_p must be a Python int >= 1 (it sets the state's shapes), got "
        f"{slice_p!r}; with optax.inject_hyperparams pass "
        "static_args=('slice_p',)")
  hp = _Hyper(learning_rate, b3, weight_decay, d0, d_coef, growth_rate,
              slice_p, safeguard_warmup, bias_correction, lagged_d,
              state_dtype)
  preconditioner = optax.with_extra_args_support(preconditioner)

  def init_fn(params):
    if validation.is_abstract(params):
      return jax.eval_shape(init_fn, params)
    validation.check_real("scale_by_prodigy", params)
    dtype = _scalar_dtype(params)
    d = lambda: jnp.full([], d0, dtype)  # distinct buffers, so all donate
    return ScaleByProdigyState(
        count=jnp.zeros([], jnp.int32),
        k=jnp.zeros([], jnp.int32),
        d=d(), d_prev=d(), d_max=d(),
        numerator=jnp.zeros([], dtype),
        s=jax.tree.map(lambda p: jnp.zeros_like(_slice(p, slice_p),
                                                dtype=state_dtype), params),
        params0=jax.tree.map(  # a copy, never the params' own buffer
            lambda p: jnp.array(_slice(p, slice_p), dtype=state_dtype,
                                copy=True), params),
        preconditioner_state=preconditioner.init(params),
        pending=(per_leaf.LateSums(jnp.zeros([2], dtype)) if lagged_d
                 else None))

  return per_leaf.transformation(
      init_fn, functools.partial(_stages, hp, preconditioner),
      parts=(preconditioner,))


class _Hyper(NamedTuple):
  learning_rate: optax.ScalarOrSchedule
  b3: float
  weight_decay: float
  d0: float
  d_coef: float
  growth_rate: float
  slice_p: int
  safeguard_warmup: bool
  bias_correction: Optional[tuple[float, float]]
  lagged_d: bool
  state_dtype: Optional[jnp.dtype]


class _LeafState(NamedTuple):
  """One leaf's part of Prodigy's state in the per-leaf stages."""
  s: jax.Array
  x0: jax.Array
  preconditioner: Any
  late: Any = None  # with lagged_d: this step's sums, for the next step


class _Step(NamedTuple):
  """The step's scalars, from the state at its start."""
  d: jax.Array
  dlr: jax.Array  # d * lr * bias correction
  weight: jax.Array  # of the sums in r: d / d0 * dlr
  d_ratio: jax.Array  # d_prev / d, for the preconditioner
  frozen: jax.Array  # lr == 0: prodigyopt skips the whole step


def _fold_pending(hp: _Hyper, state: ScaleByProdigyState
                  ) -> ScaleByProdigyState:
  """With ``lagged_d``: the previous step's sums folded into ``d``."""
  sums = state.pending.sums
  new = _next_d(state, hp.b3 * state.numerator + sums[0], sums[1], d0=hp.d0,
                d_coef=hp.d_coef, growth_rate=hp.growth_rate)
  return state._replace(
      k=jnp.where(new.skip, state.k, optax.safe_increment(state.k)),
      d=new.d, d_prev=state.d, d_max=new.d_max, numerator=new.numerator)


def _step(hp: _Hyper, state: ScaleByProdigyState) -> _Step:
  """``d``, the learning rate and the weights this step uses."""
  dtype = state.d.dtype
  lr = hp.learning_rate
  lr = jnp.asarray(lr(state.count) if callable(lr) else lr, dtype)
  bc = 1.0
  if hp.bias_correction is not None:
    b1, b2 = (jnp.asarray(b, dtype) for b in hp.bias_correction)
    kf = (state.k + 1).astype(dtype)
    bc = jnp.sqrt(1 - b2**kf) / (1 - b1**kf)
  dlr = state.d * lr * bc
  return _Step(state.d, dlr, (state.d / hp.d0) * dlr, state.d_prev / state.d,
               lr == 0)


def _preconditioner_stages(preconditioner, updates, state, params, step,
                           **extra_args) -> per_leaf.LeafStages:
  """The preconditioner's stages, which must have no round of their own."""
  pst, reason = traced.stages_of(
      preconditioner, updates, state.preconditioner_state, params,
      d_ratio=step.d_ratio, d_growth=jnp.ones([], state.d.dtype),
      **extra_args)
  if pst is None or pst.rounds:
    raise ValueError(
        "scale_by_prodigy: the preconditioner "
        + (f"has no per-leaf form ({reason})" if pst is None else
           "sums over the leaves itself") + "; build it from "
        "transformations that act leaf by leaf, and clip the gradients "
        "by their global norm before Prodigy (optax_kahan.per_leaf.chain)")
  return pst


def _finish(hp: _Hyper, state: ScaleByProdigyState, step: _Step,
            pst: per_leaf.LeafStages, states: list[_LeafState],
            shared: "_Shared") -> ScaleByProdigyState:
  """The new state from the leaves' and the shared values."""
  new = state._replace(
      s=jax.tree.unflatten(jax.tree.structure(state.s),
                           [ls.s for ls in states]),
      preconditioner_state=pst.finish([ls.preconditioner for ls in states],
                                      shared.pshared))
  old = state
  if hp.lagged_d:
    sums = per_leaf.total([ls.late for ls in states])
    new = new._replace(pending=per_leaf.LateSums(
        jnp.stack([step.weight * sums[0], sums[1]])))
    old = state._replace(pending=per_leaf.LateSums(
        jnp.zeros_like(state.pending.sums)))
  else:
    new = new._replace(
        k=jnp.where(shared.skip, state.k, optax.safe_increment(state.k)),
        d=shared.d, d_prev=step.d, d_max=shared.d_max,
        numerator=shared.numerator)
  new = jax.tree.map(lambda n, o: jnp.where(step.frozen, o, n), new, old)
  return new._replace(count=optax.safe_increment(state.count))


def _stages(hp: _Hyper, preconditioner: optax.GradientTransformationExtraArgs,
            updates: Any, state: ScaleByProdigyState, params: Any,
            **extra_args: Any) -> per_leaf.LeafStages:
  """Prodigy's step as per-leaf stages: one round (the sums), none lagged."""
  if params is None:
    raise ValueError("scale_by_prodigy needs params: "
                     "tx.update(grads, state, params)")
  validation.check_state("scale_by_prodigy", state, ScaleByProdigyState)
  lr = hp.learning_rate
  _warn_if_narrow(params, hp.d0 * (1.0 if callable(lr) else lr))
  if hp.lagged_d:
    state = _fold_pending(hp, state)
  step = _step(hp, state)
  dtype = state.d.dtype
  sums_of = functools.partial(
      _statistics, slice_p=hp.slice_p, b3=jnp.asarray(hp.b3, dtype),
      dtype=dtype, s_weight=((step.d / hp.d0) * step.d
                             if hp.safeguard_warmup else step.weight))
  pst = _preconditioner_stages(preconditioner, updates, state, params, step,
                               **extra_args)

  def statistic(g, ls, x, shared, **extra):
    del shared, extra
    stat, s = sums_of(g, x, ls.x0, ls.s)
    return stat, ls._replace(s=s)

  def combine(sums, shared):
    new = _next_d(state, hp.b3 * state.numerator + step.weight * sums[0],
                  sums[1], d0=hp.d0, d_coef=hp.d_coef,
                  growth_rate=hp.growth_rate)
    return new._replace(d_growth=new.d / step.d, pshared=shared.pshared)

  def update(g, ls, x, shared, **extra):
    late, s = sums_of(g, x, ls.x0, ls.s) if hp.lagged_d else (None, ls.s)
    u, ps = pst.update(g, ls.preconditioner, x, shared.pshared,
                       d_ratio=step.d_ratio, d_growth=shared.d_growth,
                       **extra)
    delta = -step.dlr * (u.astype(dtype) + hp.weight_decay * x.astype(dtype))
    delta = jnp.where(shared.skip | step.frozen, 0, delta).astype(u.dtype)
    return delta, _LeafState(s, ls.x0, ps, late)

  shared = _Shared(step.d, state.d_max, state.numerator, jnp.zeros([], bool),
                   jnp.ones([], dtype), pst.shared)
  return per_leaf.LeafStages(
      [_LeafState(s, x0, ps) for s, x0, ps in zip(
          jax.tree.leaves(state.s), jax.tree.leaves(state.params0),
          pst.leaf_states)], shared,
      () if hp.lagged_d else (per_leaf.Round(statistic, combine),), update,
      functools.partial(_finish, hp, state, step, pst))


def _statistics(g, x, x0, s, *, slice_p, b3, s_weight, dtype):
  """One leaf's ``[<g_S, x0_S - x_S>, sum |s|]`` and its new ``s``."""
  g_s = _slice(g, slice_p).astype(dtype)
  x_s = _slice(x, slice_p).astype(dtype)
  dot = jnp.sum(g_s * (x0.astype(dtype) - x_s))
  s = (b3 * s.astype(dtype) + s_weight * g_s).astype(s.dtype)
  return jnp.stack([dot, jnp.sum(jnp.abs(s.astype(dtype)))]), s


def _next_d(state, numerator, denom, *, d0, d_coef, growth_rate) -> "_Shared":
  """``d_{k+1}``, ``d_max``, ``r`` and ``skip`` (``sum |s| == 0``: all kept)."""
  skip = denom == 0
  d = state.d
  d_hat = d_coef * numerator / jnp.where(skip, 1, denom)
  d_new = jnp.where(d == d0, jnp.maximum(d, d_hat), d)
  d_max = jnp.maximum(state.d_max, d_hat)
  d_new = jnp.minimum(d_max, d_new * growth_rate)
  return _Shared(jnp.where(skip, d, d_new),
                 jnp.where(skip, state.d_max, d_max),
                 jnp.where(skip, state.numerator, numerator), skip)


class _Shared(NamedTuple):
  """What Prodigy's per-leaf stages share: ``d_{k+1}`` and its companions."""
  d: jax.Array
  d_max: jax.Array
  numerator: jax.Array
  skip: jax.Array
  d_growth: Any = None
  pshared: Any = None  # the preconditioner's


def prodigy_d(opt_state: optax.OptState) -> jax.Array:
  """The current ``d`` of the (first) Prodigy estimator in ``opt_state``
  (through ``kahan``, ``optax.chain`` and other wrappers), for logging.

  Raises:
    ValueError: if the state holds no ``ScaleByProdigyState``.
  """
  found = validation.find(opt_state, ScaleByProdigyState)
  if not found:
    raise ValueError("no ScaleByProdigyState in this optimizer state")
  (d,) = jax.tree.leaves(found[0].d)
  return d

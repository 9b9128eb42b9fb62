"""Kahan-compensated bfloat16 updates with uint16 residuals parked in host memory.

bfloat16 keeps the upper 16 bits of a float32 (see ``optax_kahan.bits``). Plain
bfloat16 updates ``p <- bf16(p + u)`` drop every change smaller than half an ulp
(about ``2**-9 |p|``): at polishing learning rates training silently stops. Here
the low 16 bits are kept as a ``uint16`` residual per weight, so the exact
float32 value ``x = merge(p, lo)`` survives between steps::

    x     = merge(p, lo)              # exact float32, rebuilt from the bits
    x'    = x + u                     # float32 arithmetic
    p, lo = split(x')                 # bf16 for the device, uint16 residual

The sequence of ``x`` is bit for bit that of float32 master weights, while the
device holds 2 bytes per weight. Between steps the residuals live in host memory
(``pinned_host``); inside a jitted step they move with ``jax.device_put``, each
in its own leaf's rows (``optax_kahan.per_leaf``), so the step stays one XLA
program and holds a leaf or two of residuals at a time.

References:
  Kahan, "Further remarks on reducing truncation errors", CACM 1965.
  Zamirai et al., "Revisiting BFloat16 Training", arXiv:2010.06192, 2020.
  sd-scripts PR #2159 (uint16 residuals sent to the CPU between steps).
"""

from __future__ import annotations

import contextlib
import dataclasses
import functools
import sys
import warnings
from typing import Any, Callable, Iterator, NamedTuple

import jax
import jax.numpy as jnp
import optax

from optax_kahan._src import bits
from optax_kahan._src import per_leaf
from optax_kahan._src import traced
from optax_kahan._src import validation
from optax_kahan._src.bits import Rounding
from optax_kahan._src.double_buffer import check_not_doubled
from optax_kahan._src.leaves import is_none
from optax_kahan._src.leaves import landing_delta
from optax_kahan._src.leaves import leaves_like
from optax_kahan._src.leaves import map_leaves
from optax_kahan._src.leaves import needs_residual
from optax_kahan._src.leaves import paths
from optax_kahan._src.leaves import upcast
from optax_kahan._src.placement import commit_with
from optax_kahan._src.placement import on_host
from optax_kahan._src.placement import to_device
from optax_kahan._src.placement import to_host

Residuals = Any  # A tree like the params: uint16 arrays, None for wide leaves.


def _check_residuals(params: Any, residuals: Residuals,
                     allow_masked: bool = False) -> list[Any]:
  """The residuals, one per params leaf, checked leaf by leaf; a ValueError
  names the leaf whose residual is missing, superfluous or of the wrong dtype
  or shape, or where the trees differ. With ``allow_masked`` (the export),
  node types may differ where the key paths agree, and ``MaskedNode``
  residuals are accepted."""
  if validation.find(residuals, KahanState):
    raise ValueError(
        "residuals is an optimizer state (it holds a KahanState); pass its "
        "residuals: ok.kahan_residuals(opt_state)")
  lows = leaves_like(params, residuals, "residuals", strict=not allow_masked)
  flat = jax.tree.structure(params, is_leaf=is_none).flatten_up_to(params)
  for path, p, r in zip(paths(params), flat, lows):
    if allow_masked and isinstance(r, optax.MaskedNode):
      continue
    if needs_residual(p, path):
      if r is None or jnp.result_type(r) != jnp.uint16 or r.shape != p.shape:
        got = None if r is None else f"{jnp.result_type(r)}{list(r.shape)}"
        raise ValueError(
            f"residual for bfloat16 leaf {path} must be uint16{list(p.shape)}, "
            f"got {got}")
    elif r is not None:
      dtype = jnp.result_type(p) if p is not None else None
      hint = (": it was bfloat16 when the residual was made; kahan's float32 "
              "updates promote p + u to float32, so apply them with "
              "optax.apply_updates, which keeps each param's dtype"
              if dtype is not None and jnp.issubdtype(dtype, jnp.floating)
              else "")
      raise ValueError(
          f"leaf {path} is {dtype} and needs no residual, got "
          f"{jnp.result_type(r)}{list(r.shape)}{hint}")
  return lows


def _exact(p: jax.Array, lo: Any, rounding: Rounding) -> jax.Array:
  """The exact float32 weight ``merge(p, lo)``; a wide leaf (lo None) as is."""
  if lo is None:
    return p
  device = lambda x: to_device(x) if on_host(x) else x  # streamed: both
  return bits.merge_float32(device(p), device(lo), rounding)


def _add(p: jax.Array, lo: Any, x: jax.Array, u: jax.Array,
         rounding: Rounding) -> tuple[jax.Array, Any]:
  """``split(x + u)`` for a bf16 leaf (``x = merge(p, lo)``), ``p + u`` else."""
  if lo is None:
    return (p + u).astype(p.dtype), None
  return bits.split_float32(x + u.astype(jnp.float32), rounding)


@functools.partial(jax.tree_util.register_dataclass,
                   data_fields=["p", "lo"], meta_fields=["host"])
@dataclasses.dataclass(frozen=True)
class _Weight:
  """One leaf's row input: its bf16 weight, its residual, and (static)
  whether the residual lives in host memory."""
  p: jax.Array
  lo: Any
  host: bool


def kahan_init(
    params: Any, *, rounding: Rounding = "nearest", offload: bool = True
) -> Residuals:
  """Zero residuals for ``params``: the float32 value of each weight is its bf16.

  Args:
    params: a tree of bfloat16 (and optionally float32/float64) arrays.
    rounding: the rounding mode the residuals will be used with (checked here
      so a typo fails early; zero residuals mean the same in both modes).
    offload: put the residuals in host memory (``pinned_host``). With False
      they stay in device memory.

  Returns:
    A tree like ``params``: ``uint16`` zeros with each bfloat16 leaf's shape
    and sharding, ``None`` for wide float leaves.

  Raises:
    ValueError: for a leaf of another dtype, naming its path.
  """
  bits.check_rounding(rounding)

  def init_leaf(path, p):
    if not needs_residual(p, path):
      return None
    lo = jnp.zeros_like(p, dtype=jnp.uint16)
    return to_host(lo) if offload else lo

  return map_leaves(init_leaf, params)


def kahan_apply_updates(
    params: Any,
    updates: Any,
    residuals: Residuals,
    *,
    rounding: Rounding = "nearest",
) -> tuple[Any, Residuals]:
  """Applies ``updates`` exactly: ``p, lo <- split(merge(p, lo) + u)``.

  The sum is float32, so each weight's float32 value evolves bit for bit as
  float32 master weights would. Leaf by leaf (``for_each_leaf``), each host
  residual brought in and sent back to host memory inside its leaf's row.

  Args:
    params: the params tree (bfloat16 leaves with residuals; float32/float64
      leaves are updated as ``p + u``).
    updates: a tree like ``params`` of updates of any float dtype (upcast to
      float32 exactly).
    residuals: from ``kahan_init``, ``kahan_from_float32`` or a previous call.
    rounding: the mode the residuals were made with.

  Returns:
    ``(new_params, new_residuals)``.

  Example:
    >>> params = {"w": jnp.ones(3, jnp.bfloat16)}
    >>> res = kahan_init(params, offload=False)
    >>> step = jax.jit(kahan_apply_updates)
    >>> for _ in range(100):
    ...   params, res = step(params, {"w": jnp.full(3, 1e-4)}, res)
    >>> kahan_to_float32(params, res)["w"][0]  # 1 + 1e-4 + ... + 1e-4, in float32
    Array(1.0100017, dtype=float32)
  """
  bits.check_rounding(rounding)
  check_not_doubled(params, "kahan_apply_updates", "params")
  check_not_doubled(residuals, "kahan_apply_updates", "residuals")
  lows = _check_residuals(params, residuals)
  treedef = jax.tree.structure(params, is_leaf=is_none)

  def row(w, u):
    # One leaf: the new weight is free (XLA may fuse it into its reader), the
    # new residual chained, sent back to the host inside the row.
    if w.p is None:
      return None, None
    p, lo = _add(w.p, w.lo, _exact(w.p, w.lo, rounding), u, rounding)
    return p, to_host(lo) if w.host else lo

  outs = per_leaf.for_each_leaf(
      row, [_Weight(p, lo, lo is not None and on_host(lo)) for p, lo in
            zip(treedef.flatten_up_to(params), lows)],
      leaves_like(params, updates, "updates"))
  return (treedef.unflatten([p for p, _ in outs]),
          treedef.unflatten([lo for _, lo in outs]))


def kahan_from_float32(
    params_f32: Any, *, rounding: Rounding = "nearest", offload: bool = True
) -> tuple[Any, Residuals]:
  """Splits float32 params (a float32 checkpoint) into bf16 params and residuals.

  No bit is lost (see ``optax_kahan.bits`` for the one saturation band in
  nearest mode). float64 leaves are kept as they are, with no residual.

  Args:
    params_f32: a tree of float32 (or float64) arrays.
    rounding: rounding mode of the bf16 params the forward pass will see.
    offload: put the residuals in host memory.

  Returns:
    ``(params_bf16, residuals)``.
  """
  bits.check_rounding(rounding)

  def split_leaf(path, x):
    if x is None:
      return None, None
    dtype = jnp.result_type(x)
    if dtype == jnp.float64:
      return x, None
    if dtype != jnp.float32:
      raise ValueError(
          f"kahan_from_float32: leaf {path} has dtype {dtype}, expected "
          "float32")
    hi, lo = bits.split_float32(x, rounding)
    return hi, to_host(lo) if offload else lo

  treedef = jax.tree.structure(params_f32, is_leaf=is_none)
  pairs = treedef.flatten_up_to(map_leaves(split_leaf, params_f32))
  return (treedef.unflatten([hi for hi, _ in pairs]),
          treedef.unflatten([lo for _, lo in pairs]))


def kahan_to_float32(
    params: Any, residuals: Residuals, *, rounding: Rounding = "nearest"
) -> Any:
  """The exact float32 value of each weight: ``merge(p, lo)``.

  To export a float32 checkpoint, evaluate at full precision or compare with
  a float32 run. Wide float leaves are returned as they are; a bf16 leaf
  this ``kahan`` does not train (an ``optax.MaskedNode`` residual, under
  ``optax.masked`` or ``partition``) is its bf16 value in float32.

  Args:
    params: the params; with Flax NNX, ``nnx.state(model, nnx.Param)``.
    residuals: ``kahan_residuals(opt_state)`` (with NNX,
      ``kahan_residuals(optimizer.opt_state)``), or from ``kahan_init``.
    rounding: the mode the residuals were made with.

  Returns:
    A tree like ``params`` of float32 (and the wide leaves' dtypes) arrays.
  """
  bits.check_rounding(rounding)
  check_not_doubled(params, "kahan_to_float32", "params")
  check_not_doubled(residuals, "kahan_to_float32", "residuals")
  _check_residuals(params, residuals, allow_masked=True)

  def merge_leaf(path, p, lo):
    if isinstance(lo, optax.MaskedNode):
      return p.astype(jnp.promote_types(p.dtype, jnp.float32))
    return _exact(p, lo, rounding)

  return map_leaves(merge_leaf, params, residuals)


class KahanState(NamedTuple):
  """State of ``kahan``: the residuals and the inner transformation's state."""
  residuals: Residuals
  inner_state: optax.OptState


#: The start of the warning ``kahan``'s init gives for an ``nnx.State``.
NNX_STEP_WARNING = "kahan: the params are an nnx.State"


@contextlib.contextmanager
def no_step_counter() -> Iterator[None]:
  """Silences the ``nnx.State`` warning of ``kahan``'s init, for callers
  whose params no uncommitted step counter comes with (``blockwise_init``)
  or that commit it themselves (``kahan_nnx_optimizer``)."""
  with warnings.catch_warnings():
    warnings.filterwarnings("ignore", message=NNX_STEP_WARNING,
                            category=validation.OptaxKahanWarning)
    yield


def _warn_if_nnx_optimizer(params: Any, state: Any) -> None:
  """Warns for params that are an ``nnx.State`` (as ``nnx.Optimizer`` passes
  them) when the state holds committed arrays: the optimizer's step counter
  is uncommitted, so the jitted step would compile twice."""
  nnx = sys.modules.get("flax.nnx")  # no nnx.State without flax.nnx loaded
  if nnx is None or not isinstance(params, nnx.State):
    return
  if any(isinstance(x, jax.Array) and not isinstance(x, jax.core.Tracer)
         and x.committed for x in jax.tree.leaves(state)):
    validation.warn(
        f"{NNX_STEP_WARNING}, as nnx.Optimizer passes them. nnx.Optimizer "
        "makes its step counter an uncommitted array, and this state is "
        "committed, so a jitted step over the optimizer compiles twice (its "
        "outputs are committed). Make it with ok.kahan_nnx_optimizer(model, "
        "tx, wrt=...), which commits the counter, or commit it yourself: "
        "optimizer.step.set_value(jax.device_put(optimizer.step.get_value(), "
        "jax.devices()[0])). (A functional NNX loop with no nnx.Optimizer "
        "and a committed step count of its own has nothing to fix.)",
        stacklevel=4)


def kahan(
    inner: optax.GradientTransformation,
    *,
    rounding: Rounding = "nearest",
    offload: bool = True,
) -> optax.GradientTransformationExtraArgs:
  """Wraps ``inner`` so that bfloat16 params train as exact float32 ones.

  At each step, for every leaf, with ``x = merge(p, lo)`` its exact float32
  weight::

    u, inner_state = inner's update(float32(g), inner_state, x, **extra_args)
    p', lo'        = split(x + u)
    returned delta = float32(p') - float32(p)

  ``inner`` sees the exact float32 params and float32 gradients (an exact
  upcast): its moments live in float32, and weight decay or Prodigy's
  distance to the initial point see the true weights.

  Why float32 deltas: ``optax.apply_updates`` computes ``(p + u).astype(p.dtype)``.
  With ``u = float32(p') - float32(p)`` the sum is ``p'`` exactly (the
  difference of two bf16 numbers is exact in float32 unless their magnitudes
  differ by more than about ``2**15``), so the bf16 params land on ``p'``,
  matching ``lo'``. A bf16 delta would itself be rounded: about 3% of
  elements would land on a neighbour of ``p'`` when ``|delta / p| >= 0.5``.

  Float32 and float64 leaves need no residual: their update is ``inner``'s.
  Other dtypes raise a ValueError at init naming the leaf. ``init(params)``
  starts the residuals at zero (each weight's float32 value is its bf16);
  ``init(params, residuals)`` from exact float32 weights
  (``kahan_from_float32(w32)``), which the inner state starts from too.

  Leaf by leaf: ``inner``'s per-leaf stages (``optax_kahan.per_leaf``) run in
  rows, each leaf's merge, update and split inside its own; on a GPU one
  residual goes out while the next comes in. Prodigy's sums take a pass of
  their own, so its residuals come in twice. An ``inner`` with no per-leaf
  form runs on the whole tree, with a warning.

  Donation: params and state can be donated; each residual leaves the step
  in the memory it came in (one restored into device memory under
  ``offload=True`` stays there, with a warning that says how to move it).
  Committed params: the residuals are committed arrays, and a jitted step
  whose arguments mix committed and uncommitted ones compiles again on its
  second call; ``init`` commits the rest of the state where the params live
  and warns when they are uncommitted (``jax.device_put(params,
  jax.devices()[0])`` before ``init``). Wrappers: ``kahan`` goes outermost,
  or under ``optax.MultiSteps``, ``masked``, ``partition`` or
  ``inject_hyperparams``; ``apply_if_finite`` goes inside (around ``kahan``
  it would pair the float32 deltas with zeros of bf16 gradients).

  Args:
    inner: any optax transformation (extra args such as ``value`` are passed
      through to it).
    rounding: how the bf16 params seen by the forward pass are rounded:
      ``"nearest"`` (default, ties away from zero) or ``"truncate"``.
    offload: where ``init`` puts the residuals: host memory
      (``pinned_host``, the default) or device memory (False).

  Returns:
    An ``optax.GradientTransformationExtraArgs`` whose state is
    ``KahanState``; it implements the per-leaf contract itself.

  Example:
    >>> import optax
    >>> params = {"w": jnp.ones((4, 4), jnp.bfloat16)}
    >>> tx = kahan(optax.adamw(1e-6))
    >>> state = tx.init(params)
    >>> grads = {"w": jnp.ones((4, 4), jnp.bfloat16)}
    >>> updates, state = tx.update(grads, state, params)
    >>> params = optax.apply_updates(params, updates)

  References:
    sd-scripts PR #2159; Zamirai et al., "Revisiting BFloat16 Training", 2020.
  """
  validation.check_transformation("kahan", "inner", inner)
  bits.check_rounding(rounding)
  validation.check_bool("kahan", "offload", offload)
  inner = optax.with_extra_args_support(inner)

  def init_fn(params, residuals=None):
    if validation.is_abstract(params):
      return jax.eval_shape(init_fn, params, residuals)
    leaves = jax.tree.leaves(params)
    if leaves and all(jnp.result_type(p) in (jnp.float32, jnp.float64)
                      for p in leaves):
      validation.warn(
          f"kahan: none of the params' {len(leaves)} leaves is bfloat16, so "
          "there is nothing to compensate and this is plain "
          f"{jnp.result_type(leaves[0])} training; for bf16 weights with "
          "exact updates, make the params bfloat16 (Flax: "
          "param_dtype=jnp.bfloat16)", stacklevel=2)
    if residuals is None:
      residuals = kahan_init(params, rounding=rounding, offload=offload)
      state = KahanState(residuals, inner.init(upcast(params)))
    else:
      _check_residuals(params, residuals)
      exact = kahan_to_float32(params, residuals, rounding=rounding)
      residuals = jax.tree.map(lambda lo: to_host(lo) if offload else lo,
                               residuals)
      state = KahanState(residuals, inner.init(exact))
    state = commit_with(state, params, "kahan")
    _warn_if_nnx_optimizer(params, state)
    return state

  stages = functools.partial(_stages, inner, rounding, offload)
  whole_tree = functools.partial(_whole_tree, inner, rounding, offload)
  return per_leaf.transformation(init_fn, stages, ordered=True, parts=(inner,),
                                 whole_tree=whole_tree,
                                 static=("kahan_staged",))


def _checked(updates: Any, state: KahanState, params: Any, offload: bool,
             staged: bool):
  """The residuals one per gradient leaf, after the checks, and the function
  that makes the residual tree of the new ones (each back in the memory its
  old one came from). ``staged``: the caller brought the residuals into
  device memory and sends the new ones back (the blockwise step), so their
  memory is not checked against ``offload``."""
  if params is None:
    raise ValueError("kahan(...).update needs params: call "
                     "tx.update(grads, state, params)")
  validation.check_state("kahan(...)", state, KahanState)
  lows = _check_residuals(params, state.residuals)
  if not staged:
    _check_memory(params, lows, offload)
  leaves_like(params, updates, "the updates (grads)")
  full = leaves_like(updates, state.residuals, "residuals")  # None grads too
  grads = jax.tree.structure(updates, is_leaf=is_none).flatten_up_to(updates)
  lows = [lo for g, lo in zip(grads, full) if g is not None]

  def residuals(new_lows):
    it = iter(to_host(new) if lo is not None and on_host(lo) else new
              for lo, new in zip(lows, new_lows))
    return jax.tree.structure(state.residuals, is_leaf=is_none).unflatten(
        [lo if g is None else next(it) for g, lo in zip(grads, full)])

  return lows, residuals


def _stages(inner, rounding, offload, updates, state, params, *,
            kahan_staged: bool = False, **extra_args):
  """``kahan``'s stages: ``inner``'s, each row merging its leaf's weight and
  residual and the last one splitting the sum; or, for an ``inner`` with no
  per-leaf form, the reason (after a warning)."""
  lows, residuals = _checked(updates, state, params, offload,
                             kahan_staged)
  exact_like = jax.tree.map(lambda p: jax.ShapeDtypeStruct(
      p.shape, jnp.promote_types(p.dtype, jnp.float32)), params)
  inner_st, reason = traced.stages_of(
      inner, upcast(updates), state.inner_state, exact_like, **extra_args)
  if inner_st is None:
    validation.warn(
        f"kahan: the inner transformation has no per-leaf form ({reason}); "
        "its step runs on the whole tree, so on a GPU every host residual "
        "is staged on the device at once. Declare its stages with "
        "optax_kahan.per_leaf.transformation to keep the per-leaf form",
        stacklevel=3)
    return reason

  def statistic(rnd):
    def fn(g, s, w, shared, **extra):
      return rnd.statistic(upcast(g), s, _exact(w.p, w.lo, rounding), shared,
                           **extra)
    return rnd._replace(statistic=fn)

  def update(g, s, w, shared, **extra):
    # The new residual goes back to host memory inside the leaf's row, so
    # that the next leaf's rows wait for its copy (on a GPU).
    x = _exact(w.p, w.lo, rounding)
    u, s = inner_st.update(upcast(g), s, x, shared, **extra)
    hi, new_lo = _add(w.p, w.lo, x, u, rounding)
    if w.lo is None:
      return u, (None, s)
    return landing_delta(w.p, hi), (to_host(new_lo) if w.host else new_lo, s)

  def finish(states, shared):
    return KahanState(residuals([lo for lo, _ in states]),
                      inner_st.finish([s for _, s in states], shared))

  return per_leaf.LeafStages(
      inner_st.leaf_states, inner_st.shared,
      tuple(statistic(r) for r in inner_st.rounds), update, finish,
      inputs=[_Weight(p, lo, lo is not None and on_host(lo)) for p, lo in
              zip(jax.tree.structure(updates).flatten_up_to(params), lows)])


def _whole_tree(inner, rounding, offload, updates, state, params, *,
                kahan_staged: bool = False, **extra_args):
  """``kahan``'s step for an ``inner`` with no per-leaf form: merge every
  leaf, ``inner.update`` on the whole tree, split every leaf."""
  lows, residuals = _checked(updates, state, params, offload,
                             kahan_staged)
  treedef = jax.tree.structure(updates)
  ps = treedef.flatten_up_to(params)
  x32 = [_exact(p, lo, rounding) for p, lo in zip(ps, lows)]
  u, inner_state = inner.update(upcast(updates), state.inner_state,
                                treedef.unflatten(x32), **extra_args)
  deltas, new_lows = [], []
  for p, lo, x, u in zip(ps, lows, x32, treedef.flatten_up_to(u)):
    hi, new_lo = _add(p, lo, x, u, rounding)
    deltas.append(u if lo is None else landing_delta(p, hi))
    new_lows.append(new_lo)
  return (treedef.unflatten(deltas),
          KahanState(residuals(new_lows), inner_state))


def _check_memory(params: Any, lows: list[Any], offload: bool) -> None:
  """Warns, naming the leaf and the fix, for residuals (``lows``, one per
  params leaf) outside the memory ``offload`` says. They stay there: a step
  whose output lands in another memory than a donated input aborts."""
  misplaced = [path for path, lo in zip(paths(params), lows)
               if lo is not None and not isinstance(lo, optax.MaskedNode)
               and on_host(lo) != offload]
  if misplaced:
    where, want = (("device", "host (pinned_host)") if offload
                   else ("host", "device"))
    validation.warn(
        f"kahan(offload={offload}): {len(misplaced)} residuals (the first of "
        f"leaf {misplaced[0]}) are in {where} memory and stay there; kahan "
        f"keeps them in {want} memory. Restore checkpoints with targets that "
        "carry the state's shardings (jax.ShapeDtypeStruct(x.shape, x.dtype, "
        "sharding=x.sharding) of a fresh tx.init(params)), or move them once: "
        "opt_state = ok.kahan_replace_residuals(opt_state, jax.device_put("
        f"residuals, jax.memory.Space.{'Host' if offload else 'Device'}))",
        stacklevel=5)


# Optimizer states that hold one state per group of params (the blockwise
# step's): their type -> (residuals of one, the state with new residuals).
# The layer that defines such a state registers it.
_GROUPED: dict[type, tuple[Callable[..., Any], Callable[..., Any]]] = {}


def register_grouped_state(
    state_type: type,
    residuals_of: Callable[[Any], Any],
    with_residuals: Callable[[Any, Any], Any],
) -> None:
  """Declares ``state_type`` a state of groups of params, each with its own
  optimizer state: ``kahan_residuals`` of one is ``residuals_of(state)``
  and ``kahan_replace_residuals`` is ``with_residuals(state, residuals)``
  (both built from the per-group functions)."""
  _GROUPED[state_type] = (residuals_of, with_residuals)


def kahan_residuals(opt_state: optax.OptState) -> Residuals:
  """The residuals of the ``KahanState`` inside ``opt_state``.

  Works whatever wraps ``kahan`` (``MultiSteps``, ``inject_hyperparams``, a
  chain, ``nnx.Optimizer``'s state); export exact float32 weights with
  ``kahan_to_float32``. With one ``kahan`` per group under
  ``optax.partition`` or ``masked``, the groups' residuals (``MaskedNode``
  for the other groups' leaves) are combined leaf by leaf. Of a
  ``BlockwiseState``, a ``BlockwiseParams`` of each group's residuals (the
  stacks' with their block axis).

  Raises:
    ValueError: if ``opt_state`` holds no ``KahanState``, or two of them
      hold a residual for the same leaf.
  """
  if type(opt_state) in _GROUPED:
    return _GROUPED[type(opt_state)][0](opt_state)
  found = validation.find(opt_state, KahanState)
  if not found:
    raise ValueError("no KahanState in this optimizer state")

  def combine(path, a, b):
    if isinstance(a, optax.MaskedNode) or a is None:
      return b
    if isinstance(b, optax.MaskedNode) or b is None:
      return a
    raise ValueError(
        f"two KahanStates hold a residual for leaf {jax.tree_util.keystr(path)}"
        ": read each one's .residuals instead")

  residuals = found[0].residuals
  for other in found[1:]:
    residuals = jax.tree_util.tree_map_with_path(
        combine, residuals, other.residuals,
        is_leaf=lambda x: x is None or isinstance(x, optax.MaskedNode))
  return residuals


def kahan_replace_residuals(
    opt_state: optax.OptState, residuals: Residuals
) -> optax.OptState:
  """Puts ``residuals`` into every ``KahanState`` inside ``opt_state``.

  Use it when the params change outside the optimizer (a checkpoint load, an
  EMA swap): re-import exact float32 weights with
  ``params, res = kahan_from_float32(w32)``, or reset with
  ``res = kahan_init(params)`` (the float32 value of each weight is then its
  bf16 value), then ``opt_state = kahan_replace_residuals(opt_state, res)``.

  Stale residuals are never unsafe: ``merge(p, lo)`` lies within half a bf16
  ulp of ``p`` in nearest mode (``|p| <= |merge| < |p| + ulp`` in truncate
  mode) whatever ``lo`` holds: forgetting to reset costs that, once.

  Args:
    opt_state: a state containing one or more ``KahanState``, or a
      ``BlockwiseState``.
    residuals: a tree like the old residuals (same structure, dtypes,
      shapes): a ``BlockwiseParams`` of them for a ``BlockwiseState``.

  Returns:
    The state with the new residuals (in the memory kind they come in).

  Raises:
    ValueError: if there is no ``KahanState`` or the trees do not match.
  """
  if type(opt_state) in _GROUPED:
    return _GROUPED[type(opt_state)][1](opt_state, residuals)
  if not validation.find(opt_state, KahanState):
    raise ValueError("no KahanState in this optimizer state")

  def replace(s):
    if not isinstance(s, KahanState):
      return s
    where = validation.tree_mismatch(s.residuals, residuals,
                                     names=("the state", "residuals"),
                                     is_leaf=is_none)
    if where:
      raise ValueError(f"residuals do not match the state's: {where}")
    for a, b in zip(jax.tree.leaves(s.residuals), jax.tree.leaves(residuals)):
      if a.shape != b.shape or a.dtype != b.dtype:
        raise ValueError(f"residual {b.dtype}{list(b.shape)} does not match "
                         f"the state's {a.dtype}{list(a.shape)}")
    return s._replace(residuals=residuals)

  return jax.tree.map(replace, opt_state,
                      is_leaf=lambda x: isinstance(x, KahanState))

"""Kahan-compensated bfloat16 updates with uint16 residuals parked in host memory.

Plain bfloat16 updates ``p <- bf16(p + u)`` drop every change under half an
ulp (about ``2**-9 |p|``). Here the low 16 bits of each float32 weight are kept
as a ``uint16`` residual (``optax_kahan.bits``)::

    x     = merge(p, lo)              # exact float32, rebuilt from the bits
    p, lo = split(x + u)              # bf16 for the device, uint16 residual

Between steps the residuals live in host memory (``pinned_host``); inside the
jitted step they move with ``jax.device_put`` in their leaf's rows
(``optax_kahan.per_leaf``). See docs/guides/kahan.md.

References:
  Kahan, "Further remarks on reducing truncation errors", CACM 1965.
  Zamirai et al., "Revisiting BFloat16 Training", arXiv:2010.06192, 2020.
  sd-scripts PR #2159 (uint16 residuals sent to the CPU between steps).
"""

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
from optax_kahan._src import gpu_targets
from optax_kahan._src import per_leaf
from optax_kahan._src import traced
from optax_kahan._src import validation
from optax_kahan._src.bits import Rounding
from optax_kahan._src.double_buffer import check_plain_leaves
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
  """The residuals, one per params leaf; a ValueError names the leaf whose
  residual is wrong. ``allow_masked``: ``MaskedNode`` residuals and node
  types that differ where the key paths agree are accepted (the export)."""
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


# A diagnosis of the 2026-12-04 H200 run (benchmarks/exactness.py sets it in
# a child process): an optimization barrier between each new float32 weight
# and its split, so that no fusion computes both the uint16 residual and
# float32 values (the new weight then makes one more float32 round trip
# through memory). Off: the programs the tests check.
_SPLIT_APART = False


def _add(p: jax.Array, lo: Any, x: jax.Array, u: jax.Array,
         rounding: Rounding) -> tuple[jax.Array, Any]:
  """``split(x + u)`` for a bf16 leaf (``x = merge(p, lo)``), ``p + u`` else."""
  if lo is None:
    return (p + u).astype(p.dtype), None
  new = x + u.astype(jnp.float32)
  if _SPLIT_APART:
    new = jax.lax.optimization_barrier(new)
  return bits.split_float32(new, rounding)


@functools.partial(jax.tree_util.register_dataclass,
                   data_fields=["p", "lo"], meta_fields=["host"])
@dataclasses.dataclass(frozen=True)
class _Weight:
  """One leaf's row input: weight, residual, whether that is on the host."""
  p: jax.Array
  lo: Any
  host: bool


def kahan_init(
    params: Any, *, rounding: Rounding = "nearest", offload: bool = True
) -> Residuals:
  """Zero residuals for ``params``: the float32 value of each weight is its bf16.

  Args:
    params: a tree of bfloat16 (and optionally float32/float64) arrays.
    rounding: the mode the residuals will be used with (checked early).
    offload: put the residuals in host memory (``pinned_host``).

  Returns:
    ``uint16`` zeros like each bfloat16 leaf, ``None`` for wide leaves; a
    leaf of another dtype raises a ValueError naming it.
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

  The sum is float32, leaf by leaf (``for_each_leaf``); each host residual
  comes in and goes back inside its leaf's row.

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
  check_plain_leaves(params, "kahan_apply_updates", "params")
  check_plain_leaves(residuals, "kahan_apply_updates", "residuals")
  lows = _check_residuals(params, residuals)
  treedef = jax.tree.structure(params, is_leaf=is_none)

  def row(w, u):
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

  Wide float leaves are returned as they are; a bf16 leaf this ``kahan`` does
  not train (a ``MaskedNode`` residual) is its bf16 value in float32.

  Args:
    params: the params; with Flax NNX, ``nnx.state(model, nnx.Param)``.
    residuals: ``kahan_residuals(opt_state)`` (with NNX,
      ``kahan_residuals(optimizer.opt_state)``), or from ``kahan_init``.
    rounding: the mode the residuals were made with.

  Returns:
    A tree like ``params`` of float32 (and the wide leaves' dtypes) arrays.
  """
  bits.check_rounding(rounding)
  check_plain_leaves(params, "kahan_to_float32", "params")
  check_plain_leaves(residuals, "kahan_to_float32", "residuals")
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
  """Silences ``kahan`` init's ``nnx.State`` warning (for callers that have
  no uncommitted step counter or commit it themselves)."""
  with warnings.catch_warnings():
    warnings.filterwarnings("ignore", message=NNX_STEP_WARNING,
                            category=validation.OptaxKahanWarning)
    yield


def _warn_if_nnx_optimizer(params: Any, state: Any) -> None:
  """Warns for ``nnx.State`` params beside a committed state: nnx.Optimizer's
  uncommitted step counter would make the jitted step compile twice."""
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

  ``inner`` sees the exact float32 weights and gradients. The float32 delta
  makes ``optax.apply_updates`` (``(p + u).astype(p.dtype)``) land exactly on
  ``p'`` (a difference of two bf16 numbers is exact in float32 unless their
  magnitudes differ by more than about ``2**15``); a bf16 delta would itself
  be rounded. float32/float64 leaves get ``inner``'s update; other dtypes
  raise at init. ``init(params, residuals)`` starts from exact float32
  weights (``kahan_from_float32(w32)``), the inner state too.

  ``inner``'s per-leaf stages (``optax_kahan.per_leaf``) run in rows, each
  leaf's merge, update and split in its own; an ``inner`` with no per-leaf
  form runs on the whole tree, with a warning. Params and state can be
  donated; each residual leaves the step in the memory it came in. ``init``
  commits the state where the params live (commit the params first, or the
  first step compiles twice); of abstract params (``jax.ShapeDtypeStruct``)
  it gives the state's shapes, a residual's sharding in its memory. ``kahan`` goes outermost or under
  ``MultiSteps``, ``masked``, ``partition``, ``inject_hyperparams``;
  ``apply_if_finite`` goes inside it.

  Args:
    inner: any optax transformation (extra args are passed through).
    rounding: ``"nearest"`` (default, ties away from zero) or ``"truncate"``.
    offload: ``init`` puts the residuals in host memory (default) or not.
      In an ordinary training step on a GPU their copies run after the
      backward pass, adding about their bytes over PCIe to the step, and
      a backward pass that rematerializes unrolled blocks may peak higher
      than with ``offload=False``; a warning says so where the copies take
      1 ms or more at 32 GiB/s, or unrolled blocks are rematerialized
      (docs/guides/troubleshooting.md). ``ok.blockwise.blockwise_step``
      hides them.

  Returns:
    An ``optax.GradientTransformationExtraArgs`` whose state is
    ``KahanState``.

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
      state = jax.eval_shape(init_fn, params, residuals)
      if not offload:
        return state
      return kahan_replace_residuals(state, jax.tree.map(
          _in_host_memory, kahan_residuals(state)))
    flat = jax.tree.leaves(params)
    if flat and all(jnp.result_type(p) in (jnp.float32, jnp.float64)
                    for p in flat):
      validation.warn(
          f"kahan: none of the params' {len(flat)} leaves is bfloat16, so "
          "there is nothing to compensate and this is plain "
          f"{jnp.result_type(flat[0])} training; for bf16 weights with "
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


def _in_host_memory(spec: jax.ShapeDtypeStruct) -> jax.ShapeDtypeStruct:
  """An abstract residual in host memory, where its sharding can say so
  (``jax.eval_shape`` gives the memory of none: a restore target must)."""
  if spec.sharding is None:
    return spec
  return jax.ShapeDtypeStruct(spec.shape, spec.dtype,
                              sharding=spec.sharding.with_memory_kind(
                                  "pinned_host"))


def _checked(updates: Any, state: KahanState, params: Any, offload: bool,
             staged: bool):
  """The residuals, one per gradient leaf, checked, and the function that
  makes the tree of new ones (each in its old one's memory). ``staged``: the
  caller moves them (the blockwise step); their memory is not checked."""
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
  """``inner``'s stages around merge and split; or, with no per-leaf form,
  the reason (after a warning)."""
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
  if not kahan_staged:  # each statistic round fetches the residuals again
    _warn_of_host_copies(lows, fetches=1 + len(inner_st.rounds))

  def statistic(rnd):
    def fn(g, s, w, shared, **extra):
      return rnd.statistic(upcast(g), s, _exact(w.p, w.lo, rounding), shared,
                           **extra)
    return rnd._replace(statistic=fn)

  def update(g, s, w, shared, **extra):
    # The new residual goes to the host inside the row (the next row waits).
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
  """``kahan``'s whole-tree step: merge all, ``inner.update``, split all."""
  lows, residuals = _checked(updates, state, params, offload,
                             kahan_staged)
  if not kahan_staged:
    _warn_of_host_copies(lows, fetches=1)
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
  """Warns, naming the leaf and the fix, for residuals outside the memory
  ``offload`` says (they stay there: a donated input's output must too)."""
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


#: Host residuals whose copies take at least this long in the larger direction
#: on one GPU (at ``gpu_targets.PCIE``) make ``kahan`` say what they cost.
COPY_WARNING_S = 1e-3


def _size(nbytes: int) -> str:
  return next(f"{nbytes / scale:.3g} {unit}" for scale, unit in
              ((1e9, "GB"), (1e6, "MB"), (1e3, "kB"), (1, "bytes"))
              if nbytes >= scale or scale == 1)


def _warn_of_host_copies(lows: list[Any], fetches: int) -> None:
  """Warns of what host residuals cost an ordinary step (``tx.update``
  after ``jax.grad``; the blockwise step's updates, inside the backward
  pass, stage their own) on a GPU. ``fetches``: how often the step copies
  them to the device (once, and again for each of the inner
  transformation's statistic rounds, as Prodigy's).

  Time, where the larger direction takes at least ``COPY_WARNING_S`` at
  ``gpu_targets.PCIE`` (32 GiB/s): XLA:GPU runs an ordinary step's updates,
  and the copies that feed them, after the backward pass, so the copies add
  to the step instead of hiding behind it (in every whole training step of
  ``benchmarks.gpu_compile``, about that floor or more). Memory, where the
  backward pass rematerializes two or more blocks outside a loop: any host
  copy makes XLA's latency-hiding scheduler reorder such a program, and
  where activations are large against the weights the device peak rises
  instead of falling. The warning gives the bytes and the remedies
  (docs/guides/gpu.md).
  """
  host = [lo for lo in lows if lo is not None and on_host(lo)]
  if not host:
    return
  nbytes = sum(lo.size * lo.dtype.itemsize for lo in host)
  seconds = fetches * nbytes / gpu_targets.PCIE
  blocks = traced.rematerialized_calls()
  if seconds < COPY_WARNING_S and blocks < 2:
    return
  times = {1: "once", 2: "twice"}.get(fetches, f"{fetches} times")
  said = [f"kahan: the residuals are in host memory: {_size(nbytes)}, "
          f"copied to the device {times} and back once in each step."]
  if seconds >= COPY_WARNING_S:
    said.append(
        "In an ordinary step (tx.update after jax.grad) XLA on a GPU runs "
        "the updates, and these copies, after the backward pass, so at 32 "
        f"GiB/s in each direction they add about {1e3 * seconds:.3g} ms or "
        "more to the step on one GPU (the compiled steps of python -m "
        "benchmarks.gpu_compile; docs/guides/gpu.md).")
  if blocks >= 2:
    said.append(
        f"This step's backward pass rematerializes {blocks} blocks outside "
        "a loop (jax.checkpoint, nn.remat or nnx.remat, unrolled): on a GPU "
        "any host copy makes XLA's latency-hiding scheduler reorder such a "
        "program, keeping the blocks' gradients until the end of the "
        "backward pass, and where activations are large against the "
        "weights the device peak rises instead of falling. Compare "
        "jax.jit(step).lower(...).compile().memory_analysis() with the "
        "residuals in host memory and on the device. With jax 0.12 or "
        "later, jax.jit(step, compiler_options={'xla_gpu_enable_latency_"
        "hiding_scheduler': False}) keeps XLA's memory-minimizing order: "
        "the residuals then save their 2 bytes per param (2.00 on the "
        "unrolled DiT-like model of benchmarks.gpu_compile), copied one "
        "copy at a time, overlapping nothing (the option applies to the "
        "whole program, a sharded step's collectives too); or run the "
        "blocks in a loop (lax.scan, nn.scan, nnx.scan).")
  said.append(
      "To hide the copies, update each block inside the backward pass "
      "(ok.blockwise.blockwise_step); to keep the step's speed, keep the "
      "residuals on the device (ok.kahan(tx, offload=False), 2 bytes per "
      "param more there)")
  validation.warn(" ".join(said), stacklevel=4)


# States of groups of params (the blockwise step's), registered by their
# layer: type -> (residuals of one, the state with new residuals).
_GROUPED: dict[type, tuple[Callable[..., Any], Callable[..., Any]]] = {}


def register_grouped_state(
    state_type: type,
    residuals_of: Callable[[Any], Any],
    with_residuals: Callable[[Any, Any], Any],
) -> None:
  """Declares how ``kahan_residuals`` and ``kahan_replace_residuals`` read and
  replace the residuals of a ``state_type`` (a state of groups of params)."""
  _GROUPED[state_type] = (residuals_of, with_residuals)


def kahan_residuals(opt_state: optax.OptState) -> Residuals:
  """The residuals of the ``KahanState`` inside ``opt_state``.

  Works whatever wraps ``kahan``. With one ``kahan`` per group (``partition``,
  ``masked``) the groups' residuals are combined leaf by leaf. Of a
  ``BlockwiseState``: a ``BlockwiseParams`` of each group's residuals.

  Raises ValueError if there is no ``KahanState``, or two hold a residual
  for the same leaf.
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

  For params changed outside the optimizer (a checkpoint load, an EMA swap):
  ``params, res = kahan_from_float32(w32)`` or ``res = kahan_init(params)``,
  then ``opt_state = kahan_replace_residuals(opt_state, res)``. A stale
  residual costs at most one bf16 ulp (half in nearest mode), once.

  Args:
    opt_state: a state containing one or more ``KahanState``, or a
      ``BlockwiseState``.
    residuals: a tree like the old residuals (a ``BlockwiseParams`` of them
      for a ``BlockwiseState``).

  Returns:
    The state with the new residuals (in the memory they come in); a
    ValueError if there is no ``KahanState`` or the trees do not match.
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

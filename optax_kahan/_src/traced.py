"""The per-leaf form of any transformation, cut from its own whole-tree program.

``tx.update`` is traced once on the whole tree (``jax.make_jaxpr``), so that
what it decides in Python from the tree (masks, labels, key paths, key
splits) is decided as always. Each value is labelled with the leaves it
reads::

  L(g_i) = L(x_i) = {i};  L(state, consts, extra args) = {}
  L(out)  = union of L(in)                   for an equation's outputs
  L(out)  = {}, out shared ("global")        when that union has two leaves

A global value (a norm, Prodigy's sums) is computed between passes
(``Round``); leaf ``i``'s row binds again, in order, the program's own
equations its targets need, with no other leaf's input in reach. Nothing is
recognised by name.

The program is normalised first: a call whose meaning is its body (jax's
public ``jit``, ``closed_call``, ``call`` and ``remat`` primitives) is always
inlined, so a helper reads the same whether jax kept it as a call (jax >= 0.11
keeps ``jax.jit(..., inline=True)`` calls in the jaxpr) or inlined it while
tracing (jax 0.10), and whether its operands come from one leaf or many (a
``jit``'s sharding annotations go with it: they place values, the values are
the same). Any
other equation with an inner program (``cond``, ``scan``, a custom derivative)
is a unit. Rows are compared by structure (``row_key``): primitives by
identity, parameters by value, inner programs equation by equation; never by
jax's printed text. Refused, with the reason: effects, or two leaves meeting
in a value of more than ``MAX_SHARED`` elements. This module is the package's
one reader of jax's program representation. See docs/guides/per_leaf.md.

References:
  JAX, "Understanding Jaxprs" and "Writing custom Jaxpr interpreters".
"""

import contextlib
import dataclasses
import functools
from typing import Any, NamedTuple, Optional, Union

import jax
import jax.extend as jex
import numpy as np
import optax

from optax_kahan._src import per_leaf

# The most elements of a value two leaves share (computed between passes),
# and of one that continues a shared one (the rest of a sum over the leaves).
MAX_SHARED = 1 << 14
MAX_CARRIED = 64


@functools.partial(jax.tree_util.register_dataclass,
                   data_fields=["values"], meta_fields=["index"])
@dataclasses.dataclass(frozen=True)
class Cut:
  """Leaf ``index``'s part of a traced transformation's state."""
  values: tuple[Any, ...]
  index: int


_DROP = getattr(jex.core, "DropVar", ())  # an output nobody reads


def _is_literal(v: Any) -> bool:
  return isinstance(v, jex.core.Literal)


def _abstract(x: Any) -> Any:
  """An array as a ``jax.ShapeDtypeStruct`` (weak type kept); else as is."""
  if isinstance(x, (jax.Array, jax.core.Tracer)):
    return jax.ShapeDtypeStruct(x.shape, x.dtype,
                                weak_type=jax.typeof(x).weak_type)
  return x


# The calls whose meaning is their body, from jax's public primitives.
_INLINED = tuple(p for p in (getattr(jex.core.primitives, name, None) for name
                             in ("jit_p", "closed_call_p", "call_p", "remat_p"))
                 if p is not None)


_REMAT = getattr(jex.core.primitives, "remat_p", None)


def rematerialized_calls() -> int:
  """Rematerialized calls (``jax.checkpoint``, Flax's ``remat``) in the
  program being traced, so far, outside any loop: the unrolled
  rematerialized blocks of a training step whose ``jax.grad`` is traced
  before its optimizer update (inside the calls ``_call_body`` reads through,
  as everywhere here). 0 outside a trace (eager), or where jax keeps no
  readable record (then ``kahan`` does not warn; tests/test_traced.py reads
  it on every supported jax). Only a warning depends on it.
  """
  try:
    from jax._src import core  # the trace being recorded; no public API
    eqns = list(core.trace_ctx.trace.frame.tracing_eqns)
  except (ImportError, AttributeError):
    return 0

  def count(eqns) -> int:
    n = 0
    for eqn in eqns:
      primitive = getattr(eqn, "primitive", None)
      if _REMAT is not None and primitive is _REMAT:
        n += 1
      elif (body := _call_body(eqn)) is not None:
        n += count(body[0].eqns)
    return n

  return count(eqns)


def _value_key(x: Any) -> tuple[Any, ...]:
  """A constant by value: dtype, shape, bytes (one that is no array, such as
  a traced value, by identity)."""
  try:
    a = np.asarray(x)
  except Exception:  # pylint: disable=broad-except
    return ("object", id(x))
  if a.dtype == object:
    return ("object", id(x))
  return ("array", str(a.dtype), a.shape, a.tobytes())


def _aval_key(aval: Any) -> tuple[Any, ...]:
  return (type(aval).__name__, tuple(getattr(aval, "shape", ())),
          str(getattr(aval, "dtype", "")), bool(getattr(aval, "weak_type",
                                                        False)))


def _structure(x: Any) -> Any:
  """An equation parameter as a hashable key: equal keys, equal parameters.
  Inner programs equation by equation, arrays by value, containers item by
  item, anything else itself (its own equality; an unhashable object by
  identity)."""
  if isinstance(x, jex.core.ClosedJaxpr):
    return ("closed", _structure(x.jaxpr),
            tuple(_value_key(c) for c in x.consts))
  if isinstance(x, jex.core.Jaxpr):
    names = {}

    def ref(v):
      if _is_literal(v):
        return ("literal", _value_key(v.val), _aval_key(v.aval))
      return names.setdefault(v, len(names))

    head = tuple((ref(v), _aval_key(v.aval))
                 for v in [*x.constvars, *x.invars])
    eqns = tuple((e.primitive, _params_key(e.params),
                  tuple(ref(v) for v in e.invars),
                  tuple((ref(v), _aval_key(v.aval)) for v in e.outvars))
                 for e in x.eqns)
    return ("jaxpr", head, eqns, tuple(ref(v) for v in x.outvars))
  if isinstance(x, (np.ndarray, np.generic, jax.Array)):
    return _value_key(x)
  if isinstance(x, (tuple, list)):
    return (type(x).__name__, *map(_structure, x))
  if isinstance(x, dict):
    return ("dict", *((k, _structure(v)) for k, v in sorted(
        x.items(), key=lambda kv: str(kv[0]))))
  try:
    hash(x)
  except TypeError:
    return ("object", id(x))
  return x


def _params_key(params: dict[str, Any]) -> tuple[Any, ...]:
  """An equation's parameters as a hashable key (``_structure``)."""
  return tuple((k, _structure(v)) for k, v in sorted(params.items()))


def _size(v: Any) -> int:
  size = 1
  for d in v.aval.shape:
    size *= d
  return size


class _Eqn(NamedTuple):
  """An equation of the program, its operands renamed where it was inlined."""
  primitive: Any
  params: dict[str, Any]
  invars: list[Any]
  outvars: list[Any]
  effects: Any
  ctx: Any


class _Inner:
  """A value of an inlined call's body: one per call and inner variable."""
  __slots__ = ("aval",)

  def __init__(self, aval: Any):
    self.aval = aval


def _call_body(eqn: Any) -> Optional[tuple[Any, list[Any]]]:
  """The body of a call whose meaning is its body (``_INLINED``) and whose
  one inner program takes its operands and gives its results, type for type;
  None for any other equation."""
  if eqn.primitive not in _INLINED:
    return None
  bodies = [v for v in eqn.params.values()
            if isinstance(v, (jex.core.Jaxpr, jex.core.ClosedJaxpr))]
  if len(bodies) != 1:
    return None
  body = bodies[0]
  jaxpr, consts = ((body.jaxpr, list(body.consts))
                   if isinstance(body, jex.core.ClosedJaxpr) else (body, []))
  types = lambda vs: [(tuple(v.aval.shape), v.aval.dtype) for v in vs]
  if (len(jaxpr.constvars) != len(consts)
      or types(jaxpr.invars) != types(eqn.invars)
      or types(jaxpr.outvars) != types(eqn.outvars)):
    return None
  return jaxpr, consts


class _Program:
  """A traced update and its cut: labels, levels, and each row's equations."""

  def __init__(self, closed: Any, n: int, state_paths: list[str],
               has_params: bool, paths: list[str]):
    self.jaxpr = closed.jaxpr
    self.n = n
    invars = list(self.jaxpr.invars)
    self.grads = invars[:n]
    num_state = len(state_paths)
    self.state = invars[n:n + num_state]
    self.state_paths = dict(zip(self.state, state_paths))
    rest = invars[n + num_state:]
    self.params = rest[:n] if has_params else [None] * n
    self.extra = rest[n:] if has_params else rest
    self.consts = dict(zip(self.jaxpr.constvars, closed.consts))
    self.paths = paths

  def label(self) -> str:
    """Labels every value and checks the cut; the reason it fails or ""."""
    self.labels, self.levels = {}, {}
    for i in range(self.n):
      self.labels[self.grads[i]] = frozenset([i])
      if self.params[i] is not None:
        self.labels[self.params[i]] = frozenset([i])
    self.eqns, self.globals, self._is_global = [], [], set()
    names = {}
    reason = self._visit(self.jaxpr.eqns, names, True)
    if reason:
      return reason
    self.outs = [v if _is_literal(v) else names.get(v, v)
                 for v in self.jaxpr.outvars]
    self.producer = {v: e for e, eqn in enumerate(self.eqns)
                     for v in eqn.outvars}
    self.passes = max([self.levels[v] for v in self.globals], default=0)
    for i, u in enumerate(self.outs[:self.n]):
      other = sorted(self._read(u) - {i})
      if other:
        return (f"its update of leaf {self.paths[i]} reads leaf "
                f"{self.paths[other[0]]}")
    return ""

  def _read(self, v) -> frozenset:
    """The leaves value ``v`` reads."""
    return frozenset() if _is_literal(v) else self.labels.get(v, frozenset())

  def _visit(self, eqns, names: dict, top: bool) -> str:
    """Labels ``eqns`` (``names`` renames an inlined body's variables)."""
    for eqn in eqns:
      get = lambda v: v if _is_literal(v) else names.get(v, v)
      invars = [get(v) for v in eqn.invars]
      if eqn.effects:
        return f"its update has effects ({eqn.primitive})"
      ins = frozenset().union(*(self._read(v) for v in invars))
      body = _call_body(eqn)
      if body is not None:
        jaxpr, consts = body
        inner = dict(zip(jaxpr.invars, invars))
        for var, c in zip(jaxpr.constvars, consts):
          inner[var] = _Inner(var.aval)
          self.consts[inner[var]] = c
        reason = self._visit(jaxpr.eqns, inner, False)
        if reason:
          return reason
        for v, w in zip(eqn.outvars, jaxpr.outvars):
          names[v] = w if _is_literal(w) else inner.get(w, w)
        continue
      outvars = []
      for v in eqn.outvars:
        if not top and not isinstance(v, _DROP):
          names[v] = _Inner(v.aval)
        outvars.append(names.get(v, v))
      reason = self._one(_Eqn(eqn.primitive, eqn.params, invars, outvars,
                              eqn.effects, getattr(eqn, "ctx", None)), ins)
      if reason:
        return reason
    return ""

  def _one(self, eqn: "_Eqn", ins: frozenset) -> str:
    """Labels one equation's outputs; a value two leaves meet in, or a small
    one carrying a shared one on, is shared (computed between passes)."""
    shared = len(ins) > 1 or (
        ins and any(v in self._is_global for v in eqn.invars
                    if not _is_literal(v))
        and all(_size(v) <= MAX_CARRIED for v in eqn.outvars))
    for v in eqn.outvars:
      if shared and _size(v) > MAX_SHARED:
        a, b = sorted(ins)[:2]
        return (f"its values for leaves {self.paths[a]} and "
                f"{self.paths[b]} meet in one array of "
                f"{_size(v)} elements ({eqn.primitive}), not in a sum")
    lvl = max([self.levels.get(v, 0) + (1 if shared and self._read(v) else 0)
               for v in eqn.invars if not _is_literal(v)], default=0)
    for v in eqn.outvars:
      self.labels[v] = frozenset() if shared else ins
      self.levels[v] = lvl
    if shared:
      self.globals.extend(v for v in eqn.outvars if not isinstance(v, _DROP))
      self._is_global.update(eqn.outvars)
    self.eqns.append(eqn)
    return ""

  def plan(self, out_paths: list[str]) -> None:
    """Each pass's targets and equations per leaf: pass ``k < passes`` the
    values level ``k + 1``'s shared ones read; the last, each leaf's update
    and its entries of the new state (at ``out_paths``)."""
    n, outs = self.n, self.outs[self.n:]
    own = lambda v: (not _is_literal(v) and len(self.labels.get(v, ())) == 1)
    self.stats = []
    for k in range(1, self.passes + 1):
      per = [[] for _ in range(n)]
      for v in self.globals:
        if self.levels[v] == k:
          for w in self.eqns[self.producer[v]].invars:
            if own(w) and w not in per[next(iter(self.labels[w]))]:
              per[next(iter(self.labels[w]))].append(w)
      self.stats.append(per)
    self.mine = [[j for j, v in enumerate(outs)
                  if own(v) and self.labels[v] == {i}] for i in range(n)]
    # An entry that reads no leaf goes in the row of the leaf at its path.
    shared = set(self.globals)
    for j, (v, path) in enumerate(zip(outs, out_paths)):
      if own(v) or _is_literal(v) or v in shared:
        continue
      at = [i for i in range(n) if self.paths[i] != "<root>"
            and path.endswith(self.paths[i])]
      if at:
        self.mine[max(at, key=lambda i: len(self.paths[i]))].append(j)
    self.mine = [sorted(m) for m in self.mine]
    self.finals = [[self.outs[i]] + [outs[j] for j in self.mine[i]]
                   for i in range(n)]
    self.plans = []  # plans[k][i]: (equations, inputs read)
    for k in range(self.passes + 1):
      known = {v for v in self.globals if self.levels[v] <= k}
      targets = self.stats[k] if k < self.passes else self.finals
      self.plans.append([self.slice(t, known) for t in targets])

  def slice(self, targets: list[Any], known: set[Any]) -> tuple[list[int],
                                                                set[Any]]:
    """The equations (in program order) that compute ``targets`` from
    ``known`` values, and the inputs they read."""
    need, inputs, seen = set(), set(), set()
    stack = [v for v in targets if not _is_literal(v)]
    while stack:
      v = stack.pop()
      if v in seen or v in known:
        continue
      seen.add(v)
      e = self.producer.get(v)
      if e is None:
        inputs.add(v)
      elif e not in need:
        need.add(e)
        stack.extend(w for w in self.eqns[e].invars if not _is_literal(w))
    return sorted(need), inputs

  def run(self, eqn_ids: list[int], env: dict[Any, Any]) -> None:
    """Binds the equations in order, their values into ``env``."""
    for e in eqn_ids:
      eqn = self.eqns[e]
      args = [self.read(env, v) for v in eqn.invars]
      bound = eqn.primitive.get_bind_params(eqn.params)
      subfuns, params = bound if isinstance(bound, tuple) else ((), bound)
      # The context it was traced in (compute type, random-bits mode).
      context = getattr(getattr(eqn, "ctx", None), "manager", None)
      with context or contextlib.nullcontext():
        out = eqn.primitive.bind(*subfuns, *args, **params)
      out = out if eqn.primitive.multiple_results else [out]
      env.update((v, x) for v, x in zip(eqn.outvars, out)
                 if not isinstance(v, _DROP))

  def row_key(self, i: int) -> tuple[Any, ...]:
    """Leaf ``i``'s last-pass row by structure: each equation's primitive,
    parameters (``_params_key``) and operands named by role (gradient, param,
    state path without the leaf's, extra argument, constant by value, an
    earlier output by position): equal keys are equal programs on equal
    inputs."""
    eqn_ids, _ = self.plans[-1][i]
    where = {}
    leaf = self.paths[i]

    def ref(v):
      if _is_literal(v):
        return ("literal", _value_key(v.val), _aval_key(v.aval))
      if v in where:
        return where[v]
      if v is self.grads[i]:
        return ("g",)
      if v is self.params[i]:
        return ("x",)
      if v in self.state_paths:
        return ("state", self.state_paths[v].replace(leaf, "<leaf>"))
      if v in self.consts:
        return ("const", _value_key(self.consts[v]))
      return ("extra", self.extra.index(v), _aval_key(v.aval))

    rows = []
    for e in eqn_ids:
      eqn = self.eqns[e]
      rows.append((eqn.primitive, _params_key(eqn.params),
                   tuple(ref(v) for v in eqn.invars)))
      for k, v in enumerate(eqn.outvars):
        where[v] = ("out", len(rows) - 1, k)
    rows.append(tuple(ref(v) for v in self.finals[i]))
    return tuple(rows)

  def read(self, env: dict[Any, Any], v: Any) -> Any:
    if _is_literal(v):
      return v.val
    if v in env:
      return env[v]
    return self.consts[v]


def stages(tx: optax.GradientTransformationExtraArgs, updates: Any,
           state: Any, params: Any, **extra_args: Any
           ) -> Union[per_leaf.LeafStages, str]:
  """``tx``'s stages cut from its whole-tree update (rounds: the levels of
  the shared values; leaf states: ``Cut`` s), or why it cannot be cut. The
  shared values are computed from ``state``; ``updates`` and ``params`` may
  be abstract; the rows read the extra arguments they are given."""
  traced = _trace(tx, updates, state, params, extra_args)
  return traced if isinstance(traced, str) else _cut(*traced)


def _trace(tx: optax.GradientTransformationExtraArgs, updates: Any,
           state: Any, params: Any, extra_args: dict[str, Any]) -> Any:
  """``tx.update`` traced and labelled, with what ``_cut`` needs; or why not."""
  grads, treedef = jax.tree.flatten(updates)
  n = len(grads)
  paths = [jax.tree_util.keystr(p) or "<root>" for p, _ in
           jax.tree_util.tree_flatten_with_path(updates)[0]]
  ps = None if params is None else treedef.flatten_up_to(params)
  state_flat, state_def = jax.tree.flatten(state)
  arrays = {k: v for k, v in extra_args.items() if hasattr(v, "shape")}
  others = {k: v for k, v in extra_args.items() if k not in arrays}
  keys = sorted(arrays)

  def fn(g, s, p, a):
    return tx.update(treedef.unflatten(g), state_def.unflatten(s),
                     None if p is None else treedef.unflatten(p),
                     **dict(zip(keys, a)), **others)

  abstract = lambda t: jax.tree.map(_abstract, t)
  try:
    closed, (u, new_state) = jax.make_jaxpr(fn, return_shape=True)(
        abstract(grads), abstract(state_flat), abstract(ps),
        abstract([arrays[k] for k in keys]))
  except Exception as e:  # pylint: disable=broad-except
    return f"its update could not be traced ({type(e).__name__}: {e})"
  if jax.tree.structure(u) != treedef:
    return "its update returns a tree other than the gradients'"
  state_paths = [jax.tree_util.keystr(p) for p, _ in
                 jax.tree_util.tree_flatten_with_path(state)[0]]
  prog = _Program(closed, n, state_paths, ps is not None, paths)
  reason = prog.label()
  if reason:
    return reason
  prog.plan([jax.tree_util.keystr(p) for p, _ in
             jax.tree_util.tree_flatten_with_path(new_state)[0]])
  return prog, state_flat, [arrays[k] for k in keys], jax.tree.structure(
      new_state), keys


def _cut(prog: _Program, state: list[Any], arrays: list[Any], new_def: Any,
         keys: list[str]) -> per_leaf.LeafStages:
  """The ``LeafStages`` of a labelled program."""
  n = prog.n
  stats, mine, finals, plans = prog.stats, prog.mine, prog.finals, prog.plans
  new_outs = prog.outs[n:]
  state_pos = {v: j for j, v in enumerate(prog.state)}
  cuts = [sorted({state_pos[v] for plan in plans for v in plan[i][1]
                  if v in state_pos}) for i in range(n)]

  def env_of(i, g, cut, x, extra):
    env = {prog.grads[i]: g}
    if prog.params[i] is not None:
      env[prog.params[i]] = x
    env.update(zip((prog.state[j] for j in cuts[i]), cut.values))
    env.update(zip(prog.extra, jax.tree.leaves(
        [extra[k] for k in keys] if extra else [])))
    return env

  def with_shared(env, shared):
    env.update((v, x) for v, x in zip(prog.globals, shared) if x is not None)
    return env

  def row(k, targets, g, cut, x, shared, extra):
    env = with_shared(env_of(cut.index, g, cut, x, extra), shared)
    prog.run(plans[k][cut.index][0], env)
    return [prog.read(env, v) for v in targets[cut.index]]

  def outer_env(shared):
    env = dict(zip(prog.state, state))
    env.update(zip(prog.extra, arrays))
    return with_shared(env, shared)

  def round_of(k):
    def statistic(g, cut, x, shared, **extra):
      return tuple(row(k, stats[k], g, cut, x, shared, extra)), cut

    def combine(per_row, shared):
      env = outer_env(shared)
      for i, values in enumerate(per_row):
        env.update(zip(stats[k][i], values))
      level = [v for v in prog.globals if prog.levels[v] == k + 1]
      prog.run(prog.slice(level, set(env))[0], env)
      return tuple(env.get(v, s) for v, s in zip(prog.globals, shared))

    return per_leaf.Round(statistic, combine, reduce=list)

  def update(g, cut, x, shared, **extra):
    u, *new = row(prog.passes, finals, g, cut, x, shared, extra)
    return u, Cut(tuple(new), cut.index)

  def finish(new_cuts, shared):
    values = [None] * len(new_outs)
    for i, cut in enumerate(new_cuts):
      for j, x in zip(mine[i], cut.values):
        values[j] = x
    rest = [v for j, v in enumerate(new_outs) if values[j] is None]
    env = outer_env(shared)
    prog.run(prog.slice(rest, set(env))[0], env)
    for j, v in enumerate(new_outs):
      if values[j] is None:
        values[j] = prog.read(env, v)
    return new_def.unflatten(values)

  leaf_states = [Cut(tuple(state[j] for j in cuts[i]), i) for i in range(n)]
  return per_leaf.LeafStages(
      leaf_states, (None,) * len(prog.globals),
      tuple(round_of(k) for k in range(prog.passes)), update, finish)


def stages_of(tx: optax.GradientTransformation, updates: Any, state: Any,
              params: Any, **extra_args: Any
              ) -> tuple[Optional[per_leaf.LeafStages], str]:
  """``(stages, "")``: ``tx``'s declared stages, else those cut from its
  update (``stages``); or ``(None, reason)``."""
  if isinstance(getattr(tx, "update", None), per_leaf.PerLeafUpdate):
    st = tx.update.stages(updates, state, params, **extra_args)
  else:
    st = stages(optax.with_extra_args_support(tx), updates, state, params,
                **extra_args)
  return (st, "") if isinstance(st, per_leaf.LeafStages) else (None, st)


def _parts(tx: optax.GradientTransformation) -> list[Any]:
  """The traced transformations whose programs run in ``tx``'s rows."""
  update = getattr(tx, "update", None)
  if isinstance(update, per_leaf.PerLeafUpdate):
    return [p for part in update.parts for p in _parts(part)]
  return [tx]


def _rows(tx: Any, tree: Any) -> Union[_Program, str]:
  """``tx``'s labelled program on the abstract params ``tree``."""
  tx = optax.with_extra_args_support(tx)
  try:
    state = jax.eval_shape(tx.init, tree)
  except Exception as e:  # pylint: disable=broad-except
    return f"its init could not be traced ({type(e).__name__}: {e})"
  traced = _trace(tx, tree, state, tree, {})
  if isinstance(traced, str):
    return traced
  prog = traced[0]
  if prog.passes:
    v = prog.globals[0]
    return (f"it sums over the leaves ({prog.eqns[prog.producer[v]].primitive}"
            " of values of several leaves), and a group's sum is not the "
            "tree's")
  return prog


def same_rows(tx: optax.GradientTransformation, whole: Any,
              groups: list[tuple[Any, list[int]]]) -> str:
  """Why ``tx`` applied to each group of leaves on its own does not give
  every leaf the update ``tx`` gives it on the whole tree; "" if it does.

  Each traced part of ``tx`` must hold no sum over the leaves, and give
  each leaf the same row (``row_key``) on its group as on ``whole``.
  ``groups``: each group's (abstract) params tree and the indices of its
  leaves among ``whole``'s. The reason names the leaf.
  """
  paths = [jax.tree_util.keystr(p) for p, _ in
           jax.tree_util.tree_flatten_with_path(whole)[0]]
  for part in _parts(tx):
    prog = _rows(part, whole)
    if isinstance(prog, str):
      return prog
    programs = {}  # the blocks of a stack share one group tree
    for tree, leaves in groups:
      if id(tree) not in programs:
        programs[id(tree)] = _rows(part, tree)
      group = programs[id(tree)]
      if isinstance(group, str):
        return f"on the group of leaf {paths[leaves[0]]}: {group}"
      for j, i in enumerate(leaves):
        if group.row_key(j) != prog.row_key(i):
          return (f"its update of leaf {paths[i]} is another program on "
                  "the leaf's group than on the whole tree (a mask or label "
                  "computed from the tree, or a random key split over its "
                  "leaves)")
  return ""

"""Host arrays brought to the device one leaf at a time, in a whole-tree step.

XLA:GPU schedules a host-to-device copy as early as its memory limit allows.
An optimizer step that reads every leaf's host residual therefore copies them
all in at the start: ``kahan(tx)`` on a GPU kept every residual (2 B/param)
on the device at once, and offloading saved nothing at the peak. Nothing in
the data flow said otherwise: every copy's only input is a step argument.

``stage_by_leaf(fn, leaves, common)`` computes ``fn(leaves, common)``, a step
written for the whole tree (``kahan``'s merge, ``inner.update`` on all
leaves, split), and adds the data dependencies that bound the copies. It
traces ``fn`` once into a jaxpr and labels each equation by

* ``R``: the leaves whose host inputs it reads, and
* ``F``: the outputs it feeds: leaf ``i``'s outputs (a state entry computed
  from leaf ``i``'s inputs alone, such as Adam's moments of it, counts as
  one), or shared ones (a step count, Prodigy's ``d``).

It then evaluates the same equations in two passes, with barriers
(``tie(x, t)``: one ``lax.optimization_barrier`` over ``x`` and ``t``)::

  token_0 = tie(0)
  the shared equations with R = {}
  pass 1, for each leaf i that has shared equations with R = {i}:
    host_i = tie((host_i, other inputs of leaf i), token_{k-1})
    those equations; their results that others read (a dot product),
    token_{k+1} = tie(results, token_k)
  the shared equations that read several leaves
  pass 2, for each leaf i:
    host_i = tie((host_i, other inputs of leaf i), token_{k-1})
    own_i = tie(the other inputs that only leaf i reads, token_k)
    the equations that feed only leaf i's outputs, and those with R = {i}
    that they read (recomputed from this copy, not kept from pass 1)
    chained_i, token_{k+1} = tie(chained_i, token_k)

Row ``k``'s host inputs are copied in once row ``k - 2`` is done and the
leaf's other inputs exist (a gradient made by the backward pass: no copy
waits on the device through it), so the copy overlaps row ``k - 1``'s work,
and about two leaves' host inputs are on the device at once. A leaf's own
work (its moments, its update) starts once the previous row is done, so one
row's temporaries are dead before the next row's are made, as in
``leafwise``'s chain. The ``free`` outputs (``kahan``'s deltas) are not
tied, so XLA fuses them into ``optax.apply_updates``.

Same arithmetic: every equation is the traced one, bound with its own
parameters, and shared values (a bias correction, ``d``) are computed once
and read by every leaf, as in the whole-tree program; only the order is
constrained. Equations with R = {i} that feed both shared values and leaf
``i``'s outputs run twice, on two copies of the same bits.

Costs: a transformation whose shared values read the weights (Prodigy's
``<g, x0 - x>``) copies each host input in twice, once per pass: three
copies per residual and step instead of two, with the staging still
bounded. Control flow over the whole tree (``optax.apply_if_finite``'s
``lax.cond``) is one equation that reads every leaf's float32 weight: the
first pass then leaves those rows untied (tied, each weight would be written
out whole and kept until the ``cond``), so their residuals are all staged at
once, as without the chain.

The chain is lowered for GPUs and other backends; lowered for the CPU, where
memory kinds are bookkeeping and a copy is free, ``fn`` runs as it is
(``lax.platform_dependent`` lowers one of the two).

Layering: this module depends on nothing else in the package.

References:
  XLA operation semantics, ``OptimizationBarrier``.
  JAX, "Writing custom jaxpr interpreters".
"""

from __future__ import annotations

from typing import Any, Callable, NamedTuple

import jax
import jax.extend as jex
import jax.numpy as jnp

SHARED = -1  # the label of an output that no single leaf owns


def on_host(x: Any) -> bool:
  """True for an array (or tracer) that lives in host memory."""
  return (isinstance(x, (jax.Array, jax.core.Tracer))
          and jax.typeof(x).memory_space == jax.memory.Space.Host)


def stage(tree: Any) -> Any:
  """Brings the tree's arrays that live in host memory into device memory."""
  return jax.tree.map(
      lambda x: jax.device_put(x, jax.memory.Space.Device) if on_host(x)
      else x, tree)


def tie(x: Any, token: jax.Array,
        scalars: bool = True) -> tuple[Any, jax.Array]:
  """``x`` and ``token`` through one optimization barrier.

  Whatever reads the returned arrays runs after ``token`` exists, and the
  returned token exists only once all of ``x`` does. With ``scalars=False``
  the scalars of ``x`` stay outside: a row's inputs such as a step count or
  a bias correction, shared by all leaves, are then computed once, as in the
  whole-tree program.
  """
  flat, treedef = jax.tree.flatten(x)
  tied = [i for i, a in enumerate(flat) if scalars or jnp.ndim(a) > 0]
  out, token = jax.lax.optimization_barrier(([flat[i] for i in tied], token))
  for i, a in zip(tied, out):
    flat[i] = a
  return treedef.unflatten(flat), token


class _Op(NamedTuple):
  """One equation of the flattened jaxpr, its values named by keys."""
  eqn: Any          # the JaxprEqn: primitive and parameters
  ins: list[Any]    # keys of the values it reads, or Literals
  outs: list[Any]   # keys of the values it writes


def _is_literal(k: Any) -> bool:
  return isinstance(k, jex.core.Literal)


def _flatten(jaxpr: Any, names: dict, reads: dict, env: dict,
             ops: list[_Op]) -> None:
  """Appends ``jaxpr``'s equations to ``ops``.

  ``names`` maps ``jaxpr``'s variables to keys (fresh ``object()``s, so
  that a jaxpr inlined twice gets distinct values); ``reads[k]`` is the set
  of leaves whose host inputs the value ``k`` reads (R), the union of its
  equation's inputs'. A ``jit`` call that reads two leaves or more is
  inlined, so that its body is labelled equation by equation; so is a
  ``custom_jvp_call`` (``bits``' straight-through split and merge), whose
  rule matters to differentiation only and whose evaluation would trace its
  body again (most of the chain's trace time). Any other equation is one
  unit. The constants of inlined calls go into ``env``.
  """
  for eqn in jaxpr.eqns:
    ins = [v if _is_literal(v) else names[v] for v in eqn.invars]
    r = frozenset().union(*(reads.get(k, frozenset()) for k in ins
                            if not _is_literal(k)))
    body = eqn.params.get("jaxpr", eqn.params.get("call_jaxpr"))
    if isinstance(body, jex.core.ClosedJaxpr) and (
        (eqn.primitive.name == "jit" and len(r) > 1)
        or eqn.primitive.name == "custom_jvp_call"):
      sub = dict(zip(body.jaxpr.invars, ins))
      for v, c in zip(body.jaxpr.constvars, body.consts):
        sub[v] = object()
        env[sub[v]] = c
      _flatten(body.jaxpr, sub, reads, env, ops)
      for v, out in zip(eqn.outvars, body.jaxpr.outvars):
        names[v] = out if _is_literal(out) else sub[out]
      continue
    outs = [object() for _ in eqn.outvars]
    for v, k in zip(eqn.outvars, outs):
      names[v] = k
      if r:
        reads[k] = r
    ops.append(_Op(eqn, ins, outs))


def _bind(op: _Op, get: Callable[[Any], Any]) -> list[Any]:
  """Evaluates one equation on the values ``get`` returns for its keys."""
  vals = [k.val if _is_literal(k) else get(k) for k in op.ins]
  params = op.eqn.primitive.get_bind_params(op.eqn.params)
  with op.eqn.ctx.manager:
    out = op.eqn.primitive.bind(*vals, **params)
  return list(out) if op.eqn.primitive.multiple_results else [out]


def stage_by_leaf(fn: Callable[[list[Any], Any], tuple[list, list, Any]],
                  leaves: list[Any], common: Any) -> tuple[list, list, Any]:
  """``fn(leaves, common)``, its host inputs copied in one leaf at a time.

  ``leaves[i]`` is leaf ``i``'s inputs (a pytree of arrays: its gradient,
  weight and ``kahan``'s residual); those in host memory are brought in by
  the chain of the module docstring, once the leaf's other inputs exist (a
  gradient made by the backward pass: no copy waits on the device through
  it). ``common`` is the rest (an optimizer state). ``fn`` returns
  ``(free, chained, shared)``: ``free`` and ``chained`` lists with one entry
  (a pytree) per leaf, and ``shared`` any pytree (a new optimizer state).
  An entry of ``shared`` computed from one leaf's inputs (and ``common``) is
  chained with that leaf; the values are ``fn``'s.

  Args:
    fn: the whole-tree step.
    leaves: one pytree of arrays (or None) per leaf.
    common: the other inputs, a pytree of arrays.

  Returns:
    ``fn``'s outputs, the ``chained`` ones having passed the barriers.

  Example:
    >>> def fn(leaves, scale):
    ...   ys = [stage(x) * scale for x in leaves]
    ...   return ys, [None] * len(ys), ()
    >>> host = lambda x: jax.device_put(x, jax.memory.Space.Host)
    >>> step = jax.jit(lambda xs, s: stage_by_leaf(fn, xs, s))
    >>> ys, _, _ = step([host(jnp.ones(2)), host(jnp.zeros(3))], 2.0)
  """
  flat, treedef = jax.tree.flatten((leaves, common))
  run = lambda *flat: fn(*treedef.unflatten(flat))
  if not any(on_host(x) for x in jax.tree.leaves(leaves)):
    return run(*flat)
  return jax.lax.platform_dependent(
      *flat, cpu=run,
      default=lambda *flat: _chain(fn, *treedef.unflatten(flat)))


def _chain(fn: Callable, leaves: list[Any], common: Any) -> Any:
  """``stage_by_leaf``'s GPU form: the traced ``fn`` in two chained passes."""
  closed, shape = jax.make_jaxpr(fn, return_shape=True)(leaves, common)
  jaxpr = closed.jaxpr
  names, reads, env, ops = {}, {}, {}, []
  for v, c in zip(jaxpr.constvars, closed.consts):
    names[v] = object()
    env[names[v]] = c
  owner = [i for i, x in enumerate(leaves) for _ in jax.tree.leaves(x)]
  owner += [SHARED] * (len(jaxpr.invars) - len(owner))
  host: dict[int, list[Any]] = {}   # leaf -> keys of its host inputs
  other: dict[int, list[Any]] = {}  # leaf -> keys of its other array inputs
  for v, i, x in zip(jaxpr.invars, owner, jax.tree.leaves((leaves, common))):
    names[v] = k = object()
    env[k] = x
    if i != SHARED and on_host(x):
      reads[k] = frozenset([i])
      host.setdefault(i, []).append(k)
    elif i != SHARED and jnp.ndim(x) > 0:
      other.setdefault(i, []).append(k)
  _flatten(jaxpr, names, reads, env, ops)
  r_of = lambda k: frozenset() if _is_literal(k) else reads.get(k, frozenset())
  outs = [v if _is_literal(v) else names[v] for v in jaxpr.outvars]
  out_keys = {k for k in outs if not _is_literal(k)}

  # owned[k]: the leaves whose inputs of any kind the value k reads.
  owned = {names[v]: frozenset([i]) for v, i in zip(jaxpr.invars, owner)
           if i != SHARED}
  for op in ops:
    r = frozenset().union(*(owned.get(k, frozenset()) for k in op.ins
                            if not _is_literal(k)))
    owned.update((k, r) for k in op.outs if r)

  # Output labels: leaf i for free[i] and chained[i]; an entry of shared that
  # reads one leaf's inputs (with common ones: Adam's moments of the leaf) is
  # chained with that leaf, the rest (a step count, d) are shared.
  free, chained, _ = shape
  n_free = len(jax.tree.leaves(free))
  label = [i for i, x in enumerate(free) for _ in jax.tree.leaves(x)]
  label += [i for i, x in enumerate(chained) for _ in jax.tree.leaves(x)]
  for k in outs[len(label):]:
    r = frozenset() if _is_literal(k) else owned.get(k, frozenset())
    label.append(next(iter(r)) if len(r) == 1 else SHARED)

  # F: the labels of the outputs each equation feeds (one with effects is
  # kept as shared); R: the leaves whose host inputs it reads.
  feeds: dict[Any, set] = {}
  for k, lab in zip(outs, label):
    if not _is_literal(k):
      feeds.setdefault(k, set()).add(lab)
  op_feeds = [set() for _ in ops]
  for j in reversed(range(len(ops))):
    op_feeds[j] = set().union(*(feeds.get(k, ()) for k in ops[j].outs))
    if ops[j].eqn.effects:
      op_feeds[j].add(SHARED)
    for k in ops[j].ins:
      if not _is_literal(k):
        feeds.setdefault(k, set()).update(op_feeds[j])
  op_reads = [r_of(op.outs[0]) if op.outs else frozenset() for op in ops]
  producer = {k: j for j, op in enumerate(ops) for k in op.outs}
  readers: dict[Any, list[int]] = {}
  for j, op in enumerate(ops):
    for k in op.ins:
      if not _is_literal(k):
        readers.setdefault(k, []).append(j)

  # Pass 1 evaluates the shared equations (F not a single leaf); groups[i]
  # are those with R = {i}. Pass 2 evaluates, for leaf i, the equations its
  # outputs need that feed only leaf i, or read only leaf i's host inputs
  # (recomputed from its second copy rather than kept from the first).
  shared = [j for j, f in enumerate(op_feeds) if len(f) > 1 or SHARED in f]
  groups: dict[int, list[int]] = {}
  for j in shared:
    if len(op_reads[j]) == 1:
      groups.setdefault(next(iter(op_reads[j])), []).append(j)
  own: dict[int, list[int]] = {}  # leaf -> positions of its outputs
  for m, lab in enumerate(label):
    if lab != SHARED:
      own.setdefault(lab, []).append(m)
  needed: dict[int, list[int]] = {}
  for i, ms in own.items():
    seen, todo = set(), [outs[m] for m in ms]
    while todo:
      k = todo.pop()
      j = None if _is_literal(k) else producer.get(k)
      if j is None or j in seen:
        continue
      if op_feeds[j] == {i} or (op_reads[j] == {i} and i in op_feeds[j]):
        seen.add(j)
        todo += ops[j].ins
    needed[i] = sorted(seen)

  token = jax.lax.optimization_barrier(jnp.zeros([], jnp.int32))
  prev = token  # the token of the row before the last

  def bring(i: int, js: list[int]) -> dict:
    # Leaf i's host inputs that equations js read, copied in once the row
    # before the last is done and the leaf's other inputs exist.
    read = {k for j in js for k in ops[j].ins if not _is_literal(k)}
    keys = [k for k in host.get(i, ()) if k in read]
    deps = [env[k] for k in other.get(i, ())]
    (values, _), _ = tie(([env[k] for k in keys], deps), prev)
    return dict(zip(keys, values))

  def wait(i: int, js: list[int]) -> dict:
    # Leaf i's other inputs that only equations js read (its gradient), so
    # that its work starts once the previous row is done.
    mine = set(js)
    keys = [k for k in other.get(i, ())
            if all(r in mine for r in readers.get(k, ()))]
    return dict(zip(keys, tie([env[k] for k in keys], token)[0]))

  def advance(values: list[Any]) -> list[Any]:
    # The row's chained values, and the token that the next rows wait for.
    nonlocal prev, token
    values, new = tie(values, token)
    prev, token = token, new
    return values

  def evaluate(js: list[int], local: dict) -> dict:
    get = lambda k: local[k] if k in local else env[k]
    for j in js:
      local.update(zip(ops[j].outs, _bind(ops[j], get)))
    return local

  evaluate([j for j in shared if not op_reads[j]], env)
  for i, group in sorted(groups.items()):
    inside = set(group) | set(needed.get(i, ()))
    escaping = [(k, v.aval) for j in group
                for k, v in zip(ops[j].outs, ops[j].eqn.outvars)
                if k in out_keys
                or any(r not in inside for r in readers.get(k, ()))]
    if any(aval.shape for _, aval in escaping):
      # Arrays, not statistics, leave the row (a lax.cond over the whole
      # tree reads the float32 weights): tied, each would be written out
      # whole and kept; untied, XLA fuses the row into its reader.
      evaluate(group, env)
      continue
    local = evaluate(group, bring(i, group))
    keys = [k for k, _ in escaping]
    env.update(zip(keys, advance([local[k] for k in keys])))
  evaluate([j for j in shared if len(op_reads[j]) > 1], env)

  values = [None] * len(outs)
  for i in sorted(own):
    js = needed[i]
    local = {**bring(i, js), **wait(i, js)} if i in host else {}
    evaluate(js, local)
    for m in own[i]:
      k = outs[m]
      values[m] = (k.val if _is_literal(k) else
                   local[k] if k in local else env[k])
    tied = [m for m in own[i] if m >= n_free]
    if i in host and tied:
      for m, v in zip(tied, advance([values[m] for m in tied])):
        values[m] = v
  for m, (k, lab) in enumerate(zip(outs, label)):
    if lab == SHARED:
      values[m] = k.val if _is_literal(k) else env[k]
  return jax.tree.unflatten(jax.tree.structure(shape), values)

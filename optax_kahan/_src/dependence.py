"""A proof, from the traced update, that a transformation acts leaf by leaf.

``per_leaf.stages_of`` may run an optax transformation one leaf at a time
only if the update of leaf ``i`` reads nothing of any other leaf. That is read
off the jaxpr of ``tx.update`` (``jax.make_jaxpr``, nothing is run): each
value is labelled with the set of leaves whose inputs it reads, and the proof
holds when every output of leaf ``i`` (its update and its entries of the new
state) reads at most leaf ``i``, and every shared entry of the new state (a
step count) reads no leaf.

The labels are propagated soundly, never guessed: an equation without inner
jaxprs reads all its inputs into all its outputs; calls whose body takes the
equation's inputs in order (``jit``, ``closed_call``, ``remat``,
``custom_jvp_call`` and ``custom_vjp_call``, whose forward value is their
body's) are followed inside; a ``cond``'s outputs read the predicate and
every branch; ``scan`` and ``while`` carries are iterated to a fixed point
(a leaf that reaches the carry in the second iteration is seen), a ``while``
loop's outputs reading its condition. Anything else with an inner jaxpr, or
with effects, fails the proof, naming the primitive: a renamed or new JAX
primitive makes the caller fall back to the whole-tree step, with a warning,
never pass.

References:
  JAX, "Understanding Jaxprs" (jax.readthedocs.io).
"""

from __future__ import annotations

from typing import Any, Callable, Optional

import jax
import jax.extend as jex

Labels = frozenset
_NONE: Labels = frozenset()

# Calls whose body is applied to the equation's inputs, in order, and whose
# outputs are the body's outputs; the parameter that holds the body.
_CALLS = {"jit": "jaxpr", "pjit": "jaxpr", "closed_call": "call_jaxpr",
          "core_call": "call_jaxpr", "remat": "jaxpr", "checkpoint": "jaxpr",
          "custom_jvp_call": "call_jaxpr", "custom_vjp_call": "call_jaxpr",
          "custom_vjp_call_jaxpr": "fun_jaxpr"}


class Unproven(Exception):
  """The jaxpr holds something the proof does not follow."""


def _has_jaxpr(value: Any) -> bool:
  if isinstance(value, (jex.core.Jaxpr, jex.core.ClosedJaxpr)):
    return True
  if isinstance(value, (tuple, list)):
    return any(_has_jaxpr(v) for v in value)
  return False


def _open(jaxpr: Any) -> Any:
  return jaxpr.jaxpr if isinstance(jaxpr, jex.core.ClosedJaxpr) else jaxpr


def reads(jaxpr: Any, in_labels: list[Labels]) -> list[Labels]:
  """The labels each output of ``jaxpr`` reads, from its inputs' labels.

  Raises:
    Unproven: for an equation the propagation does not follow.
  """
  jaxpr = _open(jaxpr)
  env: dict[Any, Labels] = dict(zip(jaxpr.invars, in_labels))
  read = lambda v: (_NONE if isinstance(v, jex.core.Literal)
                    else env.get(v, _NONE))
  for eqn in jaxpr.eqns:
    ins = [read(v) for v in eqn.invars]
    outs = _equation(eqn, ins)
    env.update(zip(eqn.outvars, outs))
  return [read(v) for v in jaxpr.outvars]


def _equation(eqn: Any, ins: list[Labels]) -> list[Labels]:
  name = eqn.primitive.name
  if eqn.effects:
    raise Unproven(f"the primitive {name!r} has effects")
  params = eqn.params
  if not any(_has_jaxpr(v) for v in params.values()):
    return [frozenset().union(*ins)] * len(eqn.outvars)
  if name in _CALLS and _CALLS[name] in params:
    return reads(params[_CALLS[name]], ins)
  if name == "cond":
    index, ops = ins[0], ins[1:]
    branches = [reads(b, ops) for b in params["branches"]]
    return [frozenset().union(*outs) | index for outs in zip(*branches)]
  if name == "scan":
    return _scan(eqn, ins)
  if name == "while":
    return _while(eqn, ins)
  raise Unproven(f"the primitive {name!r} holds a jaxpr this proof does "
                 "not follow")


def _scan(eqn: Any, ins: list[Labels]) -> list[Labels]:
  nc, nk = eqn.params["num_consts"], eqn.params["num_carry"]
  consts, carry, xs = ins[:nc], ins[nc:nc + nk], ins[nc + nk:]
  body = eqn.params["jaxpr"]
  while True:
    outs = reads(body, consts + carry + xs)
    new = [c | o for c, o in zip(carry, outs[:nk])]
    if new == carry:
      return carry + outs[nk:]
    carry = new


def _while(eqn: Any, ins: list[Labels]) -> list[Labels]:
  nc, nb = eqn.params["cond_nconsts"], eqn.params["body_nconsts"]
  cconsts, bconsts, carry = ins[:nc], ins[nc:nc + nb], ins[nc + nb:]
  while True:
    pred = frozenset().union(*reads(eqn.params["cond_jaxpr"], cconsts + carry))
    outs = reads(eqn.params["body_jaxpr"], bconsts + carry)
    new = [c | o | pred for c, o in zip(carry, outs)]
    if new == carry:
      return carry
    carry = new


def _abstract(x: Any) -> Any:
  if isinstance(x, (jax.Array, jax.core.Tracer, jax.ShapeDtypeStruct)):
    return jax.ShapeDtypeStruct(x.shape, x.dtype)
  return x


def per_leaf_proof(update: Callable[..., Any], updates: Any, state: Any,
                   params: Any, state_labels: list[int],
                   extra_args: dict[str, Any]) -> str:
  """Why ``update`` may not run leaf by leaf, or ``""`` when it may.

  Args:
    update: ``tx.update``.
    updates, state, params: its arguments (arrays or abstract; params may
      be None).
    state_labels: for each array of ``state``, its leaf, or -1 if shared;
      the new state must have the same layout.
    extra_args: the extra arguments of the update.

  Returns:
    ``""`` if every output of leaf ``i`` reads at most leaf ``i`` (and
    inputs that read no leaf), else the first reason found.
  """
  grads_flat, treedef = jax.tree.flatten(updates)
  paths = [jax.tree_util.keystr(p) or "<root>" for p, _ in
           jax.tree_util.tree_flatten_with_path(updates)[0]]
  n = len(grads_flat)
  if n < 2:
    return ""
  arrays, others = {}, {}
  for k, v in extra_args.items():
    (arrays if hasattr(v, "shape") else others)[k] = v
  abstract = lambda t: jax.tree.map(_abstract, t)

  def fn(g, s, p, arrays):
    return update(g, s, p, **arrays, **others)

  try:
    closed, (_, new_state) = jax.make_jaxpr(fn, return_shape=True)(
        abstract(updates), abstract(state), abstract(params), abstract(arrays))
  except Exception as e:  # pylint: disable=broad-except
    return f"its update could not be traced alone ({type(e).__name__}: {e})"
  new_leaves, new_def = jax.tree.flatten(new_state)
  if new_def != jax.tree.structure(state):
    return "its update changes the state's structure"
  leaf = lambda i: _NONE if i < 0 else frozenset([i])
  p_labels = [] if params is None else [leaf(i) for i in range(n)]
  if params is not None and len(jax.tree.leaves(params)) != n:
    return "its params do not match the updates' tree"
  if len(closed.jaxpr.outvars) != n + len(new_leaves):
    return "its update returns a tree other than the gradients'"
  in_labels = ([leaf(i) for i in range(n)] + [leaf(i) for i in state_labels]
               + p_labels + [_NONE] * len(jax.tree.leaves(arrays)))
  try:
    outs = reads(closed.jaxpr, in_labels)
  except Unproven as e:
    return str(e)
  want = list(range(n)) + list(state_labels)
  for got, own in zip(outs, want):
    foreign = sorted(got - leaf(own))
    if foreign:
      what = (f"its output for leaf {paths[own]}" if own >= 0 else
              "a state entry shared by all leaves")
      return f"{what} reads leaf {paths[foreign[0]]}"
  return ""

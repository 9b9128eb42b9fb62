"""How far apart the blockwise and the ordinary step end up: ulps and relative error.

    python -m benchmarks.blockwise_bounds [--steps 50]

Both steps take the same optimizer: ``blockwise_step(model, tx)``, and the
reference, the ordinary step (``jax.value_and_grad`` of ``blockwise_loss``,
then ``tx.update``) on the blocks' weights as leaves of their own, which is
``per_block(tx, block_axes)`` on the stacked tree. Their gradients are the
same; the update arithmetic is compiled in two programs (one block's, the
whole tree's), where XLA may simplify scalar factors differently (Adam's
bias-correction division into a reciprocal multiply) and sums over blocks
run in other orders (Prodigy's ``d``). Measured teacher-forced (each step
from the reference's weights and state, as for the references in
``tests/``): the largest distance over all weights and ``--steps`` steps in
float32 ulps (for ``kahan``: of the float32 weights that the bf16 weight and
its residual make) and relative to each leaf's largest weight; and, free
(the blockwise step run on its own), the relative distance at the end:
adaptive trajectories amplify a one-ulp difference, so that column grows
with the steps and is no bound.

Models: a two-stack model with biases and RMS norms (``two_stack``), and
``benchmarks.flux_linen``'s FLUX-like linen MMDiT in MaxDiffusion's layout
(nn.scan stacks, a join between them). ``BOUND`` is the bound the README
states; ``tests/test_blockwise.py`` asserts it. Writes
``benchmarks/results/blockwise_bounds.{md,json}``.
"""

from __future__ import annotations

import argparse
import datetime
from typing import Any, Callable

import jax
import jax.numpy as jnp
import numpy as np
import optax

import optax_kahan as ok
from benchmarks import flux_linen
from benchmarks import report
from examples import blockwise_linen

W = 16

# name -> (make tx, in kahan: bf16 weights; else float32)
OPTIMIZERS: dict[str, tuple[Callable[[], Any], bool]] = {
    "optax.adamw": (lambda: optax.adamw(1e-3, weight_decay=0.01), False),
    "optax.adafactor": (lambda: optax.adafactor(1e-2), False),
    "kahan(optax.adamw)": (lambda: optax.adamw(1e-3), True),
    "kahan(prodigy_factored(lagged_d=True))": (
        lambda: ok.prodigy_factored(lagged_d=True), True),
}

# What the README states for every row: per step (teacher-forced), the
# blockwise step's float32 weights are within this relative error of the
# ordinary step's (|a - b| <= BOUND * max |b|, per leaf).
BOUND = 1e-6


# -- the two-stack model: biases and RMS norms in both stacks ----------------
def _rms(x, scale):
  return x * jax.lax.rsqrt(jnp.mean(jnp.square(x), -1, keepdims=True)
                           + 1e-6) * scale


def _embed(p, b):
  return b["x"] @ p["w"] + p["b"], jnp.tanh(b["t"][:, None] * p["t"])


def _attn_block(p, h, vec):
  x = _rms(h, p["norm"])
  x = jnp.tanh(x @ p["w1"] + p["b1"] + (vec @ p["mod"])[:, None, :])
  return h + x @ p["w2"] + p["b2"]


def _mlp_block(p, h, vec):
  x = _rms(h, p["norm"]) * (1 + vec[:, None, :])
  return h + jax.nn.gelu(x @ p["w"] + p["b"]) @ p["out"]


def _head(p, h, vec, b):
  del vec
  out = _rms(h, p["norm"]) @ p["w"] + p["b"]
  return jnp.mean(jnp.square(out - b["y"]))


def two_stack() -> tuple[ok.blockwise.BlockwiseModel, ok.blockwise.BlockwiseParams,
                         Callable[[int], Any]]:
  ks = iter(jax.random.split(jax.random.key(0), 16))
  n = lambda *s: 0.3 * jax.random.normal(next(ks), s)
  params = ok.blockwise.BlockwiseParams(
      embed={"w": n(8, W), "b": n(W), "t": n(W)},
      stacks=({"norm": 1 + n(3, W), "w1": n(3, W, W), "b1": n(3, W),
               "mod": n(3, W, W), "w2": n(3, W, W), "b2": n(3, W)},
              {"norm": 1 + n(2, W), "w": n(2, W, 2 * W), "b": n(2, 2 * W),
               "out": n(2, 2 * W, W)}),
      head={"norm": jnp.ones(W), "w": n(W, 8), "b": jnp.zeros(8)})

  def batch(step):
    k = jax.random.split(jax.random.key(step + 1), 3)
    return {"x": jax.random.normal(k[0], (2, 5, 8)),
            "t": jax.random.uniform(k[1], (2,)),
            "y": jax.random.normal(k[2], (2, 5, 8))}

  return (ok.blockwise.BlockwiseModel(_embed, (_attn_block, _mlp_block), _head),
          params, batch)


def linen_flux() -> tuple[ok.blockwise.BlockwiseModel, ok.blockwise.BlockwiseParams,
                          Callable[[int], Any]]:
  cfg = flux_linen.Config()
  batch = lambda step: flux_linen.random_batch(jax.random.key(step + 1), cfg)
  params = flux_linen.Flux(cfg).init(jax.random.key(0), batch(0))["params"]
  return blockwise_linen.adapt(cfg, params) + (batch,)


MODELS = {"two_stack": two_stack, "flux_linen": linen_flux}


# -- the reference: the ordinary step on each block's weights as leaves ------
GROUPS = ("embed", "stacks", "head")


def unstack(params: ok.blockwise.BlockwiseParams) -> dict:
  """The blocks' weights as leaves of their own."""
  return {"embed": params.embed, "head": params.head,
          "stacks": [[jax.tree.map(lambda x: x[i], stack)
                      for i in range(ok.blockwise.num_blocks(stack))]
                     for stack in params.stacks]}


def restack(tree: dict) -> ok.blockwise.BlockwiseParams:
  return ok.blockwise.BlockwiseParams(
      tree["embed"],
      tuple(jax.tree.map(lambda *xs: jnp.stack(xs), *blocks)
            for blocks in tree["stacks"]),
      tree["head"])


def to_blockwise_state(state: Any, template: ok.blockwise.BlockwiseState,
                       params: ok.blockwise.BlockwiseParams) -> ok.blockwise.BlockwiseState:
  """The unstacked tree's state in the blockwise layout (``template``'s),
  its scalars copied to each group. Both states are one ``tx``'s, so their
  leaves come in the same order once the params-shaped subtrees are taken
  whole."""
  is_mirror = lambda x: isinstance(x, dict) and set(x) == set(GROUPS)
  items = jax.tree.leaves(state, is_leaf=is_mirror)

  def fill(group_state, group_params, part):
    keys = set(group_params)
    is_group = lambda x: isinstance(x, dict) and set(x) == keys
    leaves, treedef = jax.tree.flatten(group_state, is_leaf=is_group)
    assert len(leaves) == len(items)
    return treedef.unflatten([part(o) if is_mirror(o) else
                              jnp.broadcast_to(o, jnp.shape(g))
                              for g, o in zip(leaves, items)])

  return ok.blockwise.BlockwiseState(
      embed=fill(template.embed, params.embed, lambda o: o["embed"]),
      stacks=tuple(
          fill(st, jax.tree.map(lambda x: x[0], sp),
               lambda o, s=s: restack({"embed": None, "head": None,
                                       "stacks": [o["stacks"][s]]}).stacks[0])
          for s, (st, sp) in enumerate(zip(template.stacks, params.stacks))),
      head=fill(template.head, params.head, lambda o: o["head"]))


def ordinary_step(model: ok.blockwise.BlockwiseModel, tx: Any, params: Any, state: Any,
                  batch: Any) -> tuple[jax.Array, Any, Any]:
  """``value_and_grad`` of ``blockwise_loss``, then ``tx`` on the blocks'
  weights as leaves of their own (``unstack``)."""
  loss, grads = jax.value_and_grad(ok.blockwise.blockwise_loss, argnums=1)(
      model, params, batch)
  p = unstack(params)
  updates, state = tx.update(unstack(grads), state, p)
  return loss, restack(optax.apply_updates(p, updates)), state


# -- the comparison ----------------------------------------------------------
def _float32(params: Any, residuals: Any) -> Any:
  """The float32 weights (``kahan``: the bf16 weights and their residuals)."""
  if residuals is None:
    return params
  return ok.kahan_to_float32(params, residuals)


def measure(model_name: str, opt_name: str, steps: int) -> dict[str, float]:
  """Teacher-forced: each step, the blockwise step starts from the
  reference's weights and state (the ordinary step on the unstacked tree,
  running free); the largest distance of its result from the reference's
  next weights, in float32 ulps (of each weight) and relative error."""
  model, params, batch = MODELS[model_name]()
  make, in_kahan = OPTIMIZERS[opt_name]
  dtype = jnp.bfloat16 if in_kahan else jnp.float32
  params = jax.device_put(jax.tree.map(lambda x: x.astype(dtype), params),
                          jax.devices()[0])
  tx = ok.kahan(make()) if in_kahan else make()
  step_or = jax.jit(lambda p, s, b: ordinary_step(model, tx, p, s, b))
  step_bw = jax.jit(lambda p, s, b: ok.blockwise.blockwise_step(model, tx, p, s, b))
  template = ok.blockwise.blockwise_init(tx, params)
  p_ref, s_ref = params, tx.init(unstack(params))
  p_free, s_free = params, template
  ulps, rel, losses = 0.0, 0.0, []
  for i in range(steps):
    _, p_free, s_free = step_bw(p_free, s_free, batch(i))
    _, p_bw, s_bw = step_bw(p_ref, to_blockwise_state(s_ref, template, p_ref),
                            batch(i))
    loss, p_ref, s_ref = step_or(p_ref, s_ref, batch(i))
    losses.append(float(loss))
    got = _float32(p_bw, ok.kahan_residuals(s_bw) if in_kahan else None)
    want = _float32(p_ref, restack(ok.kahan_residuals(s_ref))
                    if in_kahan else None)
    for a, b in zip(jax.tree.leaves(got), jax.tree.leaves(want), strict=True):
      a, b = np.asarray(a, np.float32), np.asarray(b, np.float32)
      ulps = max(ulps, float(np.max(np.abs(a - b) / np.spacing(np.abs(b)))))
      rel = max(rel, _relative(a, b))
  free = _float32(p_free, ok.kahan_residuals(s_free) if in_kahan else None)
  return {"ulps": ulps, "relative": rel, "first_loss": losses[0],
          "last_loss": losses[-1],
          "free_relative": max(_relative(a, b) for a, b in zip(
              jax.tree.leaves(free), jax.tree.leaves(want), strict=True))}


def _relative(a: Any, b: Any) -> float:
  a, b = np.asarray(a, np.float32), np.asarray(b, np.float32)
  return float(np.max(np.abs(a - b)) / np.max(np.abs(b)))


def to_markdown(r: dict) -> str:
  lines = [
      f"Measured on the CPU ({r['date']}, jax {r['jax']}), {r['steps']} "
      "steps. Teacher-forced: at each step the blockwise step starts from the "
      "reference's weights and state (the ordinary step on the blocks' "
      "weights as leaves of their own); the largest distance of its float32 "
      "weights from the reference's over all weights and steps, in ulps of "
      "each weight (large only where a weight is near zero) and relative to "
      "each leaf's largest weight. Free: the blockwise step run on its own "
      f"for {r['steps']} steps, against the reference, relative. Bound (the "
      f"README's, per step, relative): {BOUND:.0e}.", "",
      "| model | optimizer | per step: ulps | per step: relative | free: "
      "relative | loss first -> last |", "|---|---|---|---|---|---|"]
  for model, rows in r["rows"].items():
    for name, m in rows.items():
      lines.append(f"| {model} | {name} | {m['ulps']:.0f} | "
                   f"{m['relative']:.1e} | {m['free_relative']:.1e} | "
                   f"{m['first_loss']:.3f} -> {m['last_loss']:.3f} |")
  return "\n".join(lines) + "\n"


def main(argv=None) -> dict:
  parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
  parser.add_argument("--steps", type=int, default=50)
  args = parser.parse_args(argv)
  rows = {m: {o: measure(m, o, args.steps) for o in OPTIMIZERS}
          for m in MODELS}
  r = {"date": datetime.date.today().isoformat(), "jax": jax.__version__,
       "steps": args.steps, "rows": rows}
  report.save("blockwise_bounds", to_markdown(r), r)
  over = [(m, o) for m, rows_m in rows.items() for o, v in rows_m.items()
          if v["relative"] > BOUND]
  for m, o in over:
    print(f"OVER THE BOUND: {m} | {o}")
  return r


if __name__ == "__main__":
  main()

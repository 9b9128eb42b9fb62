"""Quality of four bf16 update rules, in the style of "Revisiting BFloat16 Training".

    python -m benchmarks.quality [--quick] [--seeds 3]

For each task the same initial weights, batches and optimizer are trained under:

* ``float32``: float32 master weights; the forward pass sees their bf16
  rounding (``split_float32(w)[0]``, ties away from zero, as Kahan's);
* ``nearest``: bf16 weights, plain ``optax.apply_updates`` (round to nearest);
* ``stochastic``: bf16 weights, ``stochastic_rounding(tx, key)``;
* ``kahan``: bf16 weights, ``kahan(tx)`` (residuals in host memory).

Reported per rule: the final loss (held-out set, bf16 forward pass) and the
largest distance of any weight to the float32-master run, as mean ± std over
``--seeds`` seeds (the seed changes the initial weights and the batch order).

Tasks:

* ``digits-logreg``: logistic regression on scikit-learn's digits (ships with
  the package), AdamW lr 1e-3, from zero weights;
* ``digits-mlp``: a 64-128-10 tanh MLP on the digits, AdamW lr 3e-4;
* ``diffusion-polish``: the example's low-learning-rate polish of a pretrained
  diffusion model (``examples/finetune_diffusion.py``, AdamW lr 5e-6, 400
  steps), run through its own ``main``.

Compact state (``--tasks`` ``compact-state``, in its own table): the digits
MLP trained with ``kahan(prodigy_factored())`` (600 steps, batch 64), its
inner state float32 (the default) against ``state_dtype=jnp.bfloat16``
(``s``, ``x0`` and the 1-D leaves' ``v`` in bf16; 0.37 instead of 0.73
B/param on FLUX-sized leaves): final held-out loss, final ``d`` and the
largest distance of a weight to the float32-state run, into
``results/quality_compact_state``.

Writes ``benchmarks/results/quality{,_quick}.{md,json}``.
"""

from __future__ import annotations

import argparse
import pathlib
import statistics
from typing import Callable

import jax
import jax.numpy as jnp
import numpy as np
import optax
from sklearn.datasets import load_digits

import optax_kahan as ok
from benchmarks import example
from benchmarks import report

OUTPUTS = pathlib.Path(__file__).parent.parent / "outputs" / "quality_diffusion"

RULES = ("float32", "nearest", "stochastic", "kahan")


def _hi(tree):
  """The bf16 the forward pass sees: nearest, ties away from zero."""
  return jax.tree.map(lambda w: w if w.dtype == jnp.bfloat16
                      else ok.split_float32(w)[0], tree)


def train_rules(loss_fn: Callable, params32: dict, batches, eval_batch,
                tx: optax.GradientTransformation, seed: int) -> dict:
  """Trains ``params32`` under each rule; returns final loss and distance.

  Every rule takes its gradients from one jitted function of the bf16 weights
  the forward pass sees, so that the rules differ only in their update. The
  float32 rule steps its master weights leaf by leaf, as ``kahan`` steps its
  inner optimizer (the example's ``master_weights``: XLA then rounds both
  alike). The Kahan run starts from the exact float32 weights (bf16 +
  residuals); the other bf16 rules from their bf16 rounding.
  """
  grad_fn = jax.jit(jax.grad(loss_fn))
  steps = len(jax.tree.leaves(batches)[0])
  batch = lambda i: jax.tree.map(lambda a: a[i], batches)
  params32 = jax.device_put(params32, jax.devices()[0])  # committed
  master = example.load().master_weights(tx)
  final = {}

  rules = {"float32": master, "nearest": tx,
           "stochastic": ok.stochastic_rounding(tx, jax.random.key(seed)),
           "kahan": ok.kahan(tx)}
  for rule, wrapped in rules.items():
    step = jax.jit(lambda w, s, g, wrapped=wrapped: (
        lambda u_s: (optax.apply_updates(w, u_s[0]), u_s[1]))(
            wrapped.update(g, s, w)))
    w = _hi(params32)
    if rule == "float32":
      s = wrapped.init(w, params32)
    elif rule == "kahan":  # the residuals carry the float32 initial weights
      w, residuals = ok.kahan_from_float32(params32)
      s = wrapped.init(w, residuals)
    else:
      s = wrapped.init(w)
    for i in range(steps):
      w, s = step(w, s, grad_fn(w, batch(i)))
    final[rule] = (ok.kahan_to_float32(w, ok.kahan_residuals(s))
                   if rule == "kahan" else s.master if rule == "float32"
                   else w)
  out = {}
  for rule in RULES:
    w = final[rule]
    out[rule] = {
        "loss": float(loss_fn(_hi(w), eval_batch)),
        "distance": max(float(jnp.max(jnp.abs(w[k].astype(jnp.float32)
                                              - final["float32"][k])))
                        for k in w),
    }
  return out


def _digits(seed: int, steps: int, batch: int):
  x, y = load_digits(return_X_y=True)
  x = (x / 16.0).astype(np.float32)
  rng = np.random.default_rng(seed)
  order = rng.permutation(len(x))
  test, train = order[:300], order[300:]
  idx = rng.choice(train, (steps, batch))
  batches = (jnp.asarray(x[idx]), jnp.asarray(y[idx]))
  return batches, (jnp.asarray(x[test]), jnp.asarray(y[test])), rng


def _xent(logits, y):
  return jnp.mean(optax.softmax_cross_entropy_with_integer_labels(
      logits.astype(jnp.float32), y))


def digits_logreg(seed: int, steps: int) -> dict:
  batches, test, _ = _digits(seed, steps, 64)
  params = {"w": jnp.zeros((64, 10)), "b": jnp.zeros(10)}

  def loss(p, b):
    x, y = b
    return _xent(x.astype(p["w"].dtype) @ p["w"] + p["b"], y)

  return train_rules(loss, params, batches, test, optax.adamw(1e-3), seed)


def _mlp(seed: int, steps: int):
  batches, test, rng = _digits(seed, steps, 64)
  params = {"w1": jnp.asarray(rng.standard_normal((64, 128)) / 8, jnp.float32),
            "b1": jnp.zeros(128),
            "w2": jnp.asarray(rng.standard_normal((128, 10)) / 11, jnp.float32),
            "b2": jnp.zeros(10)}

  def loss(p, b):
    x, y = b
    h = jnp.tanh(x.astype(p["w1"].dtype) @ p["w1"] + p["b1"])
    return _xent(h @ p["w2"] + p["b2"], y)

  return params, loss, batches, test


def digits_mlp(seed: int, steps: int) -> dict:
  params, loss, batches, test = _mlp(seed, steps)
  return train_rules(loss, params, batches, test, optax.adamw(3e-4), seed)


def compact_state(seed: int, steps: int) -> dict:
  """``kahan(prodigy_factored())`` with float32 and with bf16 inner state."""
  params32, loss, batches, test = _mlp(seed, steps)
  grad_fn = jax.jit(jax.grad(loss))
  out = {}
  for name, dtype in (("float32 state", None), ("bf16 state", jnp.bfloat16)):
    tx = ok.kahan(ok.prodigy_factored(state_dtype=dtype))
    w, residuals = ok.kahan_from_float32(
        jax.device_put(params32, jax.devices()[0]))
    s = tx.init(w, residuals)

    @jax.jit
    def step(w, s, g, tx=tx):
      u, s = tx.update(g, s, w)
      return optax.apply_updates(w, u), s

    for i in range(steps):
      w, s = step(w, s, grad_fn(w, jax.tree.map(lambda a: a[i], batches)))
    exact = ok.kahan_to_float32(w, ok.kahan_residuals(s))
    out[name] = {"loss": float(loss(w, test)), "d": float(ok.prodigy_d(s)),
                 "exact": exact,
                 "state_bytes": sum(x.nbytes for x in jax.tree.leaves(
                     s.inner_state))}
  ref = out["float32 state"].pop("exact")
  bf = out["bf16 state"].pop("exact")
  out["bf16 state"]["distance"] = max(
      float(jnp.max(jnp.abs(bf[k] - ref[k]))) for k in ref)
  return out


def compact_markdown(per_seed: list[dict], steps: int) -> str:
  lines = [r"| inner state | held-out loss | final d | state bytes | max\|w − "
           r"w_float32 state\| |", "|---|---|---|---|---|"]
  for name in ("float32 state", "bf16 state"):
    stat = lambda key, fmt: (
        f"{statistics.fmean(r[name][key] for r in per_seed):{fmt}} ± "
        f"{statistics.pstdev([r[name][key] for r in per_seed]):{fmt}}")
    dist = stat("distance", ".1e") if "distance" in per_seed[0][name] else "0"
    lines.append(f"| {name} | {stat('loss', '.4f')} | {stat('d', '.2e')} | "
                 f"{per_seed[0][name]['state_bytes']} | {dist} |")
  lines += ["", f"kahan(prodigy_factored()) on the digits MLP, {steps} "
            f"steps; mean ± std over {len(per_seed)} seeds."]
  return "\n".join(lines) + "\n"


def diffusion_polish(seed: int, steps: int, quick: bool) -> dict:
  """The example's default polish (AdamW, lr 5e-6), through its own code.

  The pretrained weights of each seed are cached under
  ``outputs/quality_diffusion``; ``--quick`` runs a tiny model.
  """
  argv = ["--seed", str(seed), "--steps", str(steps), "--no-progress",
          "--out", str(OUTPUTS / ("quick" if quick else "full"))]
  if quick:
    argv += ["--pretrain-steps", "30", "--width", "8", "--batch-size", "16",
             "--eval-every", "10", "--num-samples", "4", "--sample-steps", "4",
             "--rules", "float32,nearest,kahan"]
  table = example.load().main(argv)["table"]
  return {rule: {"loss": row["heldout_loss"],
                 "distance": row["max_abs_diff_to_float32"]}
          for rule, row in table.items() if rule in RULES}


def summarize(per_seed: list[dict]) -> dict:
  out = {}
  for rule in [r for r in RULES if r in per_seed[0]]:
    out[rule] = {}
    for key in ("loss", "distance"):
      vals = [r[rule][key] for r in per_seed]
      out[rule][key] = {"mean": statistics.fmean(vals),
                        "std": statistics.pstdev(vals) if len(vals) > 1 else 0.0,
                        "values": vals}
  return out


def to_markdown(results: dict) -> str:
  lines = ["| task | " + " | ".join(f"{r} loss" for r in RULES) + " | "
           + " | ".join(f"{r} max\\|w − w_f32\\|" for r in RULES[1:]) + " |",
           "|---|" + "---|" * (2 * len(RULES) - 1)]
  for task, r in results["tasks"].items():
    cell = lambda x, key, fmt: (
        "n/a" if x not in r else
        f"{r[x][key]['mean']:{fmt}} ± {r[x][key]['std']:{fmt}}")
    loss = [cell(x, "loss", ".4f") for x in RULES]
    dist = [cell(x, "distance", ".1e") for x in RULES[1:]]
    lines.append(f"| {task} | " + " | ".join(loss + dist) + " |")
  lines.append("")
  lines.append(f"Mean ± std over {results['seeds']} seeds; "
               f"steps: {results['steps']}.")
  return "\n".join(lines) + "\n"


def main(argv=None) -> dict:
  parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
  parser.add_argument("--quick", action="store_true")
  parser.add_argument("--seeds", type=int, default=3)
  parser.add_argument(
      "--tasks",
      default="digits-logreg,digits-mlp,diffusion-polish,compact-state")
  args = parser.parse_args(argv)
  steps = {"digits-logreg": 60 if args.quick else 600,
           "digits-mlp": 60 if args.quick else 600,
           "diffusion-polish": 10 if args.quick else 400,
           "compact-state": 60 if args.quick else 600}
  tasks = {"digits-logreg": lambda s, n: digits_logreg(s, n),
           "digits-mlp": lambda s, n: digits_mlp(s, n),
           "diffusion-polish": lambda s, n: diffusion_polish(s, n, args.quick)}
  results = {"seeds": args.seeds, "steps": {}, "tasks": {}}
  for task in args.tasks.split(","):
    if task == "compact-state":
      per_seed = [compact_state(seed, steps[task])
                  for seed in range(args.seeds)]
      report.save("quality_compact_state",
                  compact_markdown(per_seed, steps[task]),
                  {"seeds": args.seeds, "steps": steps[task],
                   "per_seed": per_seed}, args.quick)
      continue
    per_seed = [tasks[task](seed, steps[task]) for seed in range(args.seeds)]
    results["tasks"][task] = summarize(per_seed)
    results["steps"][task] = steps[task]
  if results["tasks"]:
    report.save("quality", to_markdown(results), results, args.quick)
  return results


if __name__ == "__main__":
  main()

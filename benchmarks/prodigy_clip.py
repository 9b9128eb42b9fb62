"""Prodigy's d under the update clip: clip off, clip on, clip on bias-corrected.

    python -m benchmarks.prodigy_clip [--quick] [--steps 1000]

Each model trains from the same weights and batches with three
``prodigy_factored`` rules (``b1 = 0``, factored ``v``, ``slice_p = 11``):

* ``clip off``: ``update_clip=None``;
* ``clip on``: ``update_clip=1``, the raw preconditioned update clipped to RMS 1
  (prodigyopt's PR #20);
* ``clip on, bias-corrected``: ``update_clip=1, bias_corrected_clip=True``, the
  threshold ``1 / sqrt(1 - b2^(k+1))``: the clip acts on the bias-corrected
  update.

and under two weight precisions: ``kahan`` (bf16 weights, ``kahan(tx)``:
float32-exact updates) and ``bf16`` (bf16 weights stepped directly, rounded to
nearest; ``scale_by_prodigy``'s stall warning is silenced here on purpose).

Models (each trains on the CPU in seconds):

* ``encoder``: a text-encoder-like transformer (two pre-norm blocks, width 64,
  sequences of 32 tokens) with an 8192-token embedding; tokens are Zipf
  distributed (p ∝ 1/rank), so most rows are rarely seen. It learns a frozen
  random teacher's pooled output from its own random start (noisy targets).
* ``digits-mlp``: the 64-128-10 tanh MLP of ``benchmarks.quality`` on
  scikit-learn's digits (batch 64).
* ``convex``: least squares, 64 features, 256 noiseless samples, batch 8, from
  zero weights.

Reported per model, precision and rule (``--seeds`` seeds, 3 by default; the
seed changes the weights and the batches): ``d`` at steps 10, 100 and the
last; the held-out loss at the end; the peak of the training loss (10-step means)
over its start, how far the run overshoots; and, to read the mechanism, at step 10 the
numerator ``r`` and denominator ``sum |s|`` of ``d^ = r / sum |s|`` and the
share of weights that have moved from their start. Writes
``benchmarks/results/prodigy_clip{,_quick}.{md,json}``.
"""

from __future__ import annotations

import argparse
import warnings
from typing import Any, Callable

import jax
import jax.numpy as jnp
import numpy as np
import optax

import optax_kahan as ok
from benchmarks import quality
from benchmarks import report

RULES: dict[str, dict[str, Any]] = {
    "clip off": {"update_clip": None},
    "clip on": {"update_clip": 1.0, "bias_corrected_clip": False},
    "clip on, bias-corrected": {"update_clip": 1.0,
                                "bias_corrected_clip": True},
}
PRECISIONS = ("kahan", "bf16")
REPORT_STEPS = (10, 100)
D0 = 1e-6  # prodigy_factored's


def encoder(seed: int, steps: int, vocab: int = 8192, width: int = 64,
            seq: int = 32, batch: int = 8, depth: int = 2):
  """The Zipf-token transformer: ``(params, loss, batches, held_out)``."""

  def init(key):
    keys = iter(jax.random.split(key, 2 + 4 * depth))
    normal = lambda shape, scale: scale * jax.random.normal(next(keys), shape)
    params = {"embed": normal((vocab, width), 0.02),
              "head": normal((width, 1), width**-0.5)}
    for i in range(depth):
      params[f"block{i}"] = {
          "qkv": normal((width, 3 * width), width**-0.5),
          "out": normal((width, width), width**-0.5),
          "up": normal((width, 4 * width), width**-0.5),
          "down": normal((4 * width, width), (4 * width)**-0.5),
          "norm": jnp.ones(width)}
    return params

  def rms_norm(h):
    return h * jax.lax.rsqrt(jnp.mean(h * h, -1, keepdims=True) + 1e-6)

  def apply(p, tokens):
    h = p["embed"][tokens].astype(jnp.float32)
    for i in range(depth):
      b = jax.tree.map(lambda w: w.astype(jnp.float32), p[f"block{i}"])
      q, k, v = jnp.split(rms_norm(h) * b["norm"] @ b["qkv"], 3, -1)
      attn = jax.nn.softmax(q @ k.swapaxes(-1, -2) * width**-0.5, -1)
      h = h + attn @ v @ b["out"]
      h = h + jax.nn.gelu(rms_norm(h) @ b["up"]) @ b["down"]
    return (jnp.mean(h, 1) @ p["head"].astype(jnp.float32))[:, 0]

  rng = np.random.default_rng(seed)
  teacher_key, student_key = jax.random.split(jax.random.key(seed))
  teacher = init(teacher_key)
  zipf = 1.0 / np.arange(1, vocab + 1)
  tokens = jnp.asarray(rng.choice(vocab, (steps + 16, batch, seq),
                                  p=zipf / zipf.sum()))
  targets = jax.vmap(lambda t: apply(teacher, t))(tokens)
  targets += 0.1 * jnp.asarray(rng.standard_normal(targets.shape),
                               jnp.float32)

  def loss(p, b):
    t, y = b
    return jnp.mean((apply(p, t) - y) ** 2)

  data = (tokens[:steps], targets[:steps])
  held_out = (tokens[steps:].reshape(-1, seq), targets[steps:].reshape(-1))
  return init(student_key), loss, data, held_out


def digits_mlp(seed: int, steps: int):
  """``benchmarks.quality``'s digits MLP."""
  return quality._mlp(seed, steps)  # pylint: disable=protected-access


def convex(seed: int, steps: int, samples: int = 256, features: int = 64,
           batch: int = 8):
  """Noiseless least squares from zero weights."""
  rng = np.random.default_rng(seed)
  a = rng.standard_normal((samples, features)).astype(np.float32)
  y = a @ (0.1 * rng.standard_normal(features)).astype(np.float32)
  idx = rng.integers(0, samples, (steps, batch))
  params = {"w": jnp.zeros((features, 1)), "b": jnp.zeros(1)}

  def loss(p, b):
    x, t = b
    pred = x @ p["w"].astype(jnp.float32) + p["b"].astype(jnp.float32)
    return jnp.mean((pred[:, 0] - t) ** 2)

  return params, loss, (jnp.asarray(a[idx]), jnp.asarray(y[idx])), (
      jnp.asarray(a), jnp.asarray(y))


MODELS: dict[str, Callable] = {"encoder": encoder, "digits-mlp": digits_mlp,
                               "convex": convex}


def _prodigy_state(opt_state) -> ok.ScaleByProdigyState:
  is_prodigy = lambda x: isinstance(x, ok.ScaleByProdigyState)
  return next(x for x in jax.tree.leaves(opt_state, is_leaf=is_prodigy)
              if is_prodigy(x))


def train(model: str, precision: str, rule: str, seed: int, steps: int
          ) -> dict:
  """One run: ``d``, ``r``, ``sum |s|`` and the moved share, per step."""
  params, loss_fn, batches, held_out = MODELS[model](seed, steps)
  params = jax.device_put(jax.tree.map(lambda p: p.astype(jnp.bfloat16),
                                        params), jax.devices()[0])
  tx = ok.prodigy_factored(**RULES[rule])
  if precision == "kahan":
    tx = ok.kahan(tx)
  with warnings.catch_warnings():  # the bf16 rows stall on purpose
    warnings.filterwarnings("ignore", "scale_by_prodigy on bfloat16",
                            ok.OptaxKahanWarning)
    state = tx.init(params)

    def step(carry, batch):
      p, s = carry
      loss, grads = jax.value_and_grad(loss_fn)(p, batch)
      updates, s = tx.update(grads, s, p)
      p = optax.apply_updates(p, updates)
      prodigy = _prodigy_state(s)
      moved = sum(jnp.sum(a != b) for a, b in zip(jax.tree.leaves(p),
                                                  jax.tree.leaves(params)))
      return (p, s), {
          "loss": loss, "d": prodigy.d, "numerator": prodigy.numerator,
          "denominator": sum(jnp.sum(jnp.abs(x.astype(jnp.float32)))
                             for x in jax.tree.leaves(prodigy.s)),
          "moved": moved}

    run = jax.jit(lambda p, s, b: jax.lax.scan(step, (p, s), b))
    (final, _), trace = run(params, state, batches)
  size = sum(x.size for x in jax.tree.leaves(params))
  trace = {k: np.asarray(v, np.float64) for k, v in trace.items()}
  trace["moved"] /= size
  return {"held_out_loss": float(loss_fn(final, held_out)),
          **{k: v.tolist() for k, v in trace.items()}}


def peak_loss(losses: list[float], window: int = 10) -> float:
  """The highest ``window``-step mean of the training loss over the first:
  how far the run overshoots before it descends."""
  smooth = np.convolve(losses, np.ones(window) / window, mode="valid")
  return float(smooth.max() / smooth[0])


def settling(by_rule: dict[str, list[dict]]) -> dict[str, list]:
  """Per seed: for each rule the step at which ``d`` first exceeds ``10 d0``;
  the step at which the unclipped run's ``d`` first reaches 90% of its last
  value (its plateau); and for each clipped rule the step from which its
  ``d`` stays within 2x of the unclipped run's to the end (None: not by the
  end)."""
  out = {"plateau_step": [], "leaves_d0": {}}
  for rule, runs in by_rule.items():  # the step at which d first passes 10 d0
    for r in runs:
      above = np.flatnonzero(np.asarray(r["d"]) > 10 * D0)
      out["leaves_d0"].setdefault(rule, []).append(
          int(above[0]) + 1 if above.size else None)
  for i, off in enumerate(by_rule["clip off"]):
    d_off = np.asarray(off["d"])
    out["plateau_step"].append(int(np.argmax(d_off >= 0.9 * d_off[-1])) + 1)
    for rule in RULES:
      if rule != "clip off":
        ratio = np.asarray(by_rule[rule][i]["d"]) / d_off
        apart = np.flatnonzero((ratio > 2) | (ratio < 0.5))
        settled = (1 if not apart.size else
                   None if apart[-1] == len(ratio) - 1 else int(apart[-1]) + 2)
        out.setdefault(rule, []).append(settled)
  return out


def _steps(steps: list) -> str:
  return ", ".join("never" if k is None else str(k) for k in steps)


def to_markdown(results: dict) -> str:
  """Medians over the seeds, and the held-out loss's mean ± std."""
  steps = results["steps"]
  at = [s for s in REPORT_STEPS if s < steps] + [steps]
  ten = min(10, steps) - 1
  lines = ["| model | weights | rule | "
           + " | ".join(f"d at {s}" for s in at)
           + " | held-out loss | peak loss | r, Σ\\|s\\| at 10 | moved at 10 |",
           "|---|---|---|" + "---|" * (len(at) + 4)]
  for model, by_precision in results["runs"].items():
    for precision, by_rule in by_precision.items():
      for rule, seeds in by_rule.items():
        med = lambda key, i: float(np.median([r[key][i] for r in seeds]))
        loss = [r["held_out_loss"] for r in seeds]
        lines.append(
            f"| {model} | {precision} | {rule} | "
            + " | ".join(f"{med('d', s - 1):.2e}" for s in at)
            + f" | {np.mean(loss):.3g} ± {np.std(loss):.2g} | "
            f"{np.median([peak_loss(r['loss']) for r in seeds]):.2f} | "
            f"{med('numerator', ten):.1e}, {med('denominator', ten):.1e} | "
            f"{med('moved', ten):.1%} |")
  clipped = [r for r in RULES if r != "clip off"]
  lines += ["", "| model | weights | "
            + " | ".join(f"{r}: d > 10 d0 from step" for r in RULES) + " |",
            "|---|---|" + "---|" * len(RULES)]
  for model, by_precision in results["runs"].items():
    for precision, by_rule in by_precision.items():
      leaves = settling(by_rule)["leaves_d0"]
      lines.append(f"| {model} | {precision} | "
                   + " | ".join(_steps(leaves[r]) for r in RULES) + " |")
  lines += ["", "| model | weights | clip off: d at 90% of its last from "
            "step | " + " | ".join(f"{r}: d within 2x of clip off's from step"
                                   for r in clipped) + " |",
            "|---|---|---|" + "---|" * len(clipped)]
  for model, by_precision in results["runs"].items():
    for precision, by_rule in by_precision.items():
      settled = settling(by_rule)
      lines.append(f"| {model} | {precision} | "
                   f"{_steps(settled['plateau_step'])} | "
                   + " | ".join(_steps(settled[r]) for r in clipped) + " |")
  lines += ["", f"`prodigy_factored` (b1 = 0, factored v, slice_p = 11, "
            f"d0 = 1e-6), {steps} steps; medians over {results['seeds']} "
            "seeds, the loss as mean ± std. d^ = r / Σ|s| is the estimate "
            "d grows to; 'peak loss': the highest 10-step mean training loss "
            "over the first; 'moved': the share of the bf16 weights that "
            "differ from their start. Second table, per seed: the step at which d "
            "first exceeds 10 d0 ('never': not by the end). Third, per seed: "
            "the step at which "
            "the unclipped run's d first reaches 90% of its last value (its "
            "plateau), and the step from which each clipped run's d stays "
            "within 2x of the unclipped run's to the end ('never': not by "
            "the end)."]
  return "\n".join(lines) + "\n"


def main(argv=None) -> dict:
  parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
  parser.add_argument("--quick", action="store_true")
  parser.add_argument("--steps", type=int, default=None)
  parser.add_argument("--seeds", type=int, default=3)
  parser.add_argument("--models", default=",".join(MODELS))
  args = parser.parse_args(argv)
  steps = args.steps or (30 if args.quick else 1000)
  results = {"steps": steps, "seeds": args.seeds, "runs": {}}
  for model in args.models.split(","):
    results["runs"][model] = {
        precision: {rule: [train(model, precision, rule, seed, steps)
                           for seed in range(args.seeds)]
                    for rule in RULES}
        for precision in PRECISIONS}
  report.save("prodigy_clip", to_markdown(results), compact(results),
              args.quick)
  return results


def compact(results: dict) -> dict:
  """What the JSON keeps: per run the loss figures, the step-10 statistics
  and ``d`` at steps 1-10 and every 10th after; per model and precision the
  second and third tables' steps."""
  steps = results["steps"]
  keep = sorted({*range(1, min(10, steps) + 1), *range(10, steps + 1, 10),
                 steps})
  ten = min(10, steps) - 1

  def run(r):
    return {"held_out_loss": r["held_out_loss"],
            "peak_loss": peak_loss(r["loss"]),
            "at_10": {k: r[k][ten] for k in ("numerator", "denominator",
                                             "moved")},
            "d": {str(k): r["d"][k - 1] for k in keep}}

  return {"steps": steps, "seeds": results["seeds"], "runs": {
      model: {precision: {"steps": settling(by_rule),
                          **{rule: [run(r) for r in seeds]
                             for rule, seeds in by_rule.items()}}
              for precision, by_rule in by_precision.items()}
      for model, by_precision in results["runs"].items()}}


if __name__ == "__main__":
  main()

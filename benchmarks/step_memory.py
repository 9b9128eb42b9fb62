"""Scratch memory of the optimizer step: compiled temporary bytes per parameter.

    python -m benchmarks.step_memory [--quick]

The step is ``tx.update`` + ``optax.apply_updates`` on bf16 params, jitted with
params and state donated, compiled for shapes only (``ShapeDtypeStruct``:
nothing is allocated). Reported: ``compiled.memory_analysis()
.temp_size_in_bytes`` per parameter, for

* 64 leaves of 1M elements (``--quick``: 8 leaves of 64K), and
* FLUX.1-dev at full width (hidden 3072) with 2 double-stream and 2
  single-stream blocks (1.03B params, 112 leaves; ``--quick``: a small one),
  because compiling all 57 blocks takes long on a small machine and the figure
  per parameter does not depend on the number of blocks.

The bound to compare with is ``16 B x largest leaf + 1 MiB``, also per
parameter. A figure that does not fall with more leaves grows with the model:
XLA keeps every leaf's temporaries alive at once.

Writes ``benchmarks/results/step_memory{,_quick}.{md,json}``.
"""

from __future__ import annotations

import argparse
import functools
import math

import jax
import optax

import optax_kahan as ok
from benchmarks import model_shapes
from benchmarks import report

CONFIGS = {
    "optax.adamw": lambda: optax.adamw(1e-4),
    "optax.adafactor": lambda: optax.adafactor(1e-4),
    "optax.contrib.prodigy": optax.contrib.prodigy,
    "kahan(optax.adamw)": lambda: ok.kahan(optax.adamw(1e-4)),
    "prodigy": ok.prodigy,
    "kahan(prodigy)": lambda: ok.kahan(ok.prodigy()),
    "prodigy_factored": ok.prodigy_factored,
    "kahan(prodigy_factored)": lambda: ok.kahan(ok.prodigy_factored()),
    "stable_adamw": lambda: ok.stable_adamw(1e-4),
    "kahan(stable_adamw)": lambda: ok.kahan(ok.stable_adamw(1e-4)),
}


def temp_bytes(make, shapes: model_shapes.Shapes) -> int:
  tx = make()
  params = model_shapes.as_params(shapes)
  state = jax.eval_shape(tx.init, params)

  @functools.partial(jax.jit, donate_argnums=(0, 1))
  def step(params, state, grads):
    updates, state = tx.update(grads, state, params)
    return optax.apply_updates(params, updates), state

  compiled = step.lower(params, state, params).compile()
  return compiled.memory_analysis().temp_size_in_bytes


def run(models: dict[str, model_shapes.Shapes]) -> dict:
  out = {}
  for model, shapes in models.items():
    n = model_shapes.num_params(shapes)
    largest = max(math.prod(s) for s in shapes.values())
    rows = {name: temp_bytes(make, shapes) / n for name, make in CONFIGS.items()}
    out[model] = {"params": n, "leaves": len(shapes),
                  "bound_B_per_param": (16 * largest + 2**20) / n,
                  "temp_B_per_param": rows}
  return out


def to_markdown(results: dict) -> str:
  models = list(results)
  lines = ["| step (bf16 params) | " + " | ".join(
      f"{m} ({r['params'] / 1e6:.0f}M, {r['leaves']} leaves)"
      for m, r in results.items()) + " |", "|---|" + "---|" * len(models)]
  for name in CONFIGS:
    lines.append(f"| {name} | " + " | ".join(
        f"{results[m]['temp_B_per_param'][name]:.2f}" for m in models) + " |")
  lines.append("| goal: 16 B x largest leaf + 1 MiB | " + " | ".join(
      f"{results[m]['bound_B_per_param']:.2f}" for m in models) + " |")
  return "\n".join(lines) + "\n"


def main(argv=None) -> dict:
  parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
  parser.add_argument("--quick", action="store_true")
  args = parser.parse_args(argv)
  if args.quick:
    models = {
        "8 x 64K": {f"w{i}": (256, 256) for i in range(8)},
        "tiny FLUX": model_shapes.flux_dev_shapes(
            hidden=64, double_blocks=1, single_blocks=1, head_dim=16)}
  else:
    models = {
        "64 x 1M": {f"w{i}": (1024, 1024) for i in range(64)},
        "FLUX.1-dev, 2+2 blocks": model_shapes.flux_dev_shapes(
            double_blocks=2, single_blocks=2)}
  results = run(models)
  report.save("step_memory", to_markdown(results), results, args.quick)
  return results


if __name__ == "__main__":
  main()

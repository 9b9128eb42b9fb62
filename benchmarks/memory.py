"""Optimizer memory per parameter on real model shapes, without allocating.

    python -m benchmarks.memory [--quick]

For each model (FLUX.1-dev transformer, SDXL UNet, Llama-3-8B; ``--quick``:
a tiny stand-in) and each optimizer setup, ``jax.eval_shape(tx.init, params)``
gives the state's shapes; nothing is allocated. Reported:

* device state B/param: optimizer state kept in device memory;
* host B/param: Kahan residuals (``pinned_host`` between steps);
* device total B/param: weights + device state + float32 master copy if any;
* device total GB for the whole model (1 GB = 1e9 bytes).

Writes ``benchmarks/results/memory.{md,json}``.
"""

from __future__ import annotations

import argparse
from typing import Callable, NamedTuple

import jax
import jax.numpy as jnp
import optax

import optax_kahan as ok
from benchmarks import model_shapes
from benchmarks import report



class Setup(NamedTuple):
  name: str
  make: Callable[[], optax.GradientTransformation]
  weight_dtype: jnp.dtype  # dtype of the params the optimizer is given
  master: bool = False     # bf16 weights on device + a float32 master copy


def setups() -> list[Setup]:
  bf16, f32 = jnp.bfloat16, jnp.float32
  rows = [
      Setup("optax.adamw, float32 master weights (mixed precision)",
            lambda: optax.adamw(1e-4), f32, master=True),
      Setup("optax.adamw on bf16", lambda: optax.adamw(1e-4), bf16),
      Setup("stochastic_rounding(optax.adamw) on bf16",
            lambda: ok.stochastic_rounding(optax.adamw(1e-4),
                                           jax.random.key(0)), bf16),
      Setup("kahan(optax.adamw) on bf16",
            lambda: ok.kahan(optax.adamw(1e-4)), bf16),
      Setup("optax.adafactor on bf16", lambda: optax.adafactor(1e-4), bf16),
      Setup("optax.contrib.prodigy on bf16", optax.contrib.prodigy, bf16),
  ]
  prodigies = [
      ("prodigy()", ok.prodigy),
      ("prodigy(b1=0)", lambda: ok.prodigy(b1=0.0)),
      ("prodigy(slice_p=11)", lambda: ok.prodigy(slice_p=11)),
      ("prodigy_factored()", ok.prodigy_factored),
      ("stable_adamw()", lambda: ok.stable_adamw(1e-4)),
  ]
  for name, make in prodigies:
    rows.append(Setup(f"{name} on bf16", make, bf16))
    rows.append(Setup(f"kahan({name}) on bf16",
                      lambda make=make: ok.kahan(make()), bf16))
  rows.append(Setup(
      "kahan(prodigy_factored(state_dtype=bf16)) on bf16",
      lambda: ok.kahan(ok.prodigy_factored(state_dtype=bf16)), bf16))
  return rows


def _bytes(tree) -> int:
  return model_shapes.tree_bytes(tree)


def measure(setup: Setup, shapes: model_shapes.Shapes) -> dict[str, float]:
  n = model_shapes.num_params(shapes)
  params = model_shapes.as_params(shapes, setup.weight_dtype)
  state = jax.eval_shape(setup.make().init, params)
  kahan_states = [s for s in jax.tree.leaves(
      state, is_leaf=lambda x: isinstance(x, ok.KahanState))
                  if isinstance(s, ok.KahanState)]
  host = sum(_bytes(s.residuals) for s in kahan_states)
  device_state = _bytes(state) - host
  weights = 2 * n  # bf16 weights on the device in every setup
  master = 4 * n if setup.master else 0
  total = weights + master + device_state
  return {
      "device_state_B_per_param": device_state / n,
      "host_B_per_param": host / n,
      "device_total_B_per_param": total / n,
      "device_total_GB": total / 1e9,
  }


def run(models: dict[str, Callable[[], model_shapes.Shapes]]) -> dict:
  results = {}
  for model, shapes_fn in models.items():
    shapes = shapes_fn()
    results[model] = {
        "params": model_shapes.num_params(shapes),
        "rows": {s.name: measure(s, shapes) for s in setups()},
    }
  return results


def seed_comparison(results: dict) -> list[str]:
  """The seed discussion's form: Prodigy vs sliced & factored vs AdamW."""
  names = {"Prodigy": "prodigy() on bf16",
           "Prodigy sliced & factored": "prodigy_factored() on bf16",
           "AdamW": "optax.adamw on bf16",
           "Kahan + Prodigy sliced & factored":
               "kahan(prodigy_factored()) on bf16"}
  lines = ["| model | " + " | ".join(names) + " |",
           "|---|" + "---|" * len(names)]
  for model, r in results.items():
    cells = [f"{r['rows'][v]['device_total_GB']:.1f} GB" for v in names.values()]
    lines.append(f"| {model} | " + " | ".join(cells) + " |")
  return lines


def to_markdown(results: dict) -> str:
  out = []
  for model, r in results.items():
    out.append(f"**{model}** ({r['params'] / 1e9:.2f}B params; weights are bf16 "
               "on the device in every row)\n")
    out.append("| optimizer | device state B/param | host B/param | "
               "device total B/param | device total GB |")
    out.append("|---|---|---|---|---|")
    for name, m in r["rows"].items():
      out.append(f"| {name} | {m['device_state_B_per_param']:.2f} | "
                 f"{m['host_B_per_param']:.2f} | "
                 f"{m['device_total_B_per_param']:.2f} | "
                 f"{m['device_total_GB']:.1f} |")
    out.append("")
  out.append("Weights + optimizer state on the device (the seed's comparison):\n")
  out.extend(seed_comparison(results))
  return "\n".join(out) + "\n"


def main(argv=None) -> dict:
  parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
  parser.add_argument("--quick", action="store_true",
                      help="a tiny model instead of the real shapes")
  args = parser.parse_args(argv)
  if args.quick:
    models = {"tiny FLUX-like": lambda: model_shapes.flux_dev_shapes(
        hidden=256, double_blocks=1, single_blocks=1, head_dim=32)}
  else:
    models = model_shapes.MODELS
  results = run(models)
  report.save("memory", to_markdown(results), results, args.quick)
  return results


if __name__ == "__main__":
  main()

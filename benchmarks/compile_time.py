"""Compile time of one optimizer step on a model of many small leaves.

A diffusers-style UNet has about 200 leaves, most of them small (norms,
biases, 3x3 convs). XLA's compile time grows with the number of operations,
so per-leaf work (sliced statistics, factored moments, a NaN guard on each
state entry) multiplies it. This times ``jax.jit(step).lower(...).compile()``
of update + apply, params and state donated, for each optimizer on bf16
params, and reports each one's ratio to ``kahan(optax.adamw)``.

Usage::

  python -m benchmarks.compile_time            # 208 leaves, ~0.8M params
  python -m benchmarks.compile_time --quick    # 40 leaves

Writes ``benchmarks/results/compile_time.{md,json}``.
"""

from __future__ import annotations

import argparse
import time

import jax
import jax.numpy as jnp
import optax

import optax_kahan as ok
from benchmarks import report


def unet_like_shapes(blocks: int) -> dict[str, tuple[int, ...]]:
  """``blocks`` resnet-like blocks of 8 leaves each, plus 8 stem/head leaves.

  26 blocks give 216 leaves and about 0.8M parameters, like the UNet of the
  issue's report (208 leaves, 0.8M).
  """
  shapes = {"stem/kernel": (3, 3, 4, 32), "stem/bias": (32,),
            "head/kernel": (3, 3, 32, 4), "head/bias": (4,),
            "time/kernel": (64, 128), "time/bias": (128,),
            "norm_out/scale": (32,), "norm_out/bias": (32,)}
  for b in range(blocks):
    c = 32 if b % 2 else 48
    shapes.update({
        f"block{b}/norm1/scale": (c,), f"block{b}/norm1/bias": (c,),
        f"block{b}/conv1/kernel": (3, 3, c, c), f"block{b}/conv1/bias": (c,),
        f"block{b}/norm2/scale": (c,), f"block{b}/norm2/bias": (c,),
        f"block{b}/time/kernel": (128, c), f"block{b}/time/bias": (c,)})
  return shapes


OPTIMIZERS = {
    "optax.adamw": lambda: optax.adamw(1e-4),
    "kahan(optax.adamw)": lambda: ok.kahan(optax.adamw(1e-4)),
    "prodigy_factored()": lambda: ok.prodigy_factored(),
    "kahan(prodigy_factored())": lambda: ok.kahan(ok.prodigy_factored()),
    "kahan(prodigy())": lambda: ok.kahan(ok.prodigy()),
    "kahan(stable_adamw())": lambda: ok.kahan(ok.stable_adamw(1e-4)),
}


def compile_seconds(make, shapes) -> float:
  params = {k: jnp.zeros(s, jnp.bfloat16) for k, s in shapes.items()}
  params = jax.device_put(params, jax.devices()[0])
  tx = make()
  state = tx.init(params)

  def step(params, state, grads):
    updates, state = tx.update(grads, state, params)
    return optax.apply_updates(params, updates), state

  start = time.perf_counter()
  jax.jit(step, donate_argnums=(0, 1)).lower(params, state,
                                             params).compile()
  return time.perf_counter() - start


def main(argv=None) -> dict:
  parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
  parser.add_argument("--quick", action="store_true")
  args = parser.parse_args(argv)
  shapes = unet_like_shapes(4 if args.quick else 26)
  n_params = sum(int(jnp.prod(jnp.array(s))) for s in shapes.values())
  seconds = {name: compile_seconds(make, shapes)
             for name, make in OPTIMIZERS.items()}
  base = seconds["kahan(optax.adamw)"]
  cache = jax.config.jax_compilation_cache_dir
  lines = [f"Compile time of update + apply, {len(shapes)} leaves, "
           f"{n_params / 1e6:.2f}M bf16 params (XLA:CPU)"
           + (" with jax's persistent compilation cache on (a program "
              "compiled before is read from it, not compiled)" if cache
              else ""), "",
           "| step | compile s | / kahan(optax.adamw) |", "|---|---|---|"]
  lines += [f"| {name} | {s:.1f} | {s / base:.2f} |"
            for name, s in seconds.items()]
  result = {"leaves": len(shapes), "params": n_params, "seconds": seconds,
            "ratio_to_kahan_adamw": {k: v / base for k, v in seconds.items()}}
  report.save("compile_time", "\n".join(lines) + "\n", result,
              quick=args.quick)
  return result


if __name__ == "__main__":
  main()

"""Speed of the optimizer step (update + apply), as ratios measured side by side.

    python -m benchmarks.speed [--quick] [--reps 25]

What is timed: one jitted, donated call of ``tx.update`` followed by
``optax.apply_updates`` (the model is not run), on real-shaped leaves: a
FLUX.1-dev-style transformer shrunk to about 50M parameters (hidden 768, one
double-stream and two single-stream blocks; ``--quick``: about 1M). Every
configuration of a comparison is timed in the same process, interleaved
(A, B, C, A, B, C, ...), and the median of ``--reps`` repetitions is reported
as a ratio, since the machines are noisy.

The physical limit: the same run times a large jitted copy (read + write) to
get the machine's copy bandwidth, counts the bytes each configuration must read
and write per parameter, and reports the achieved GB/s as a fraction of it.

Writes ``benchmarks/results/speed{,_quick}.{md,json}``.
"""

from __future__ import annotations

import argparse
import functools
import platform
import statistics
import time
from typing import Callable, NamedTuple

import jax
import jax.numpy as jnp
import optax

import optax_kahan as ok
from benchmarks import model_shapes
from benchmarks import report



class Config(NamedTuple):
  name: str
  make: Callable[[], optax.GradientTransformation]
  param_dtype: jnp.dtype
  master: bool  # float32 master weights + a bf16 copy for the forward pass
  bytes_per_param: float  # bytes the step must read + write per parameter


def _adamw():
  return optax.adamw(1e-4, weight_decay=0.01)


# Bytes per parameter moved (read + write), counted by hand:
#   bf16 p 2+2, bf16 grad 2, uint16 residual 2+2, float32 m and v 4+4 each way,
#   float32 master 4+4 plus the bf16 copy written (2).
CONFIGS = {
    "kahan(adamw)": Config("kahan(adamw)", lambda: ok.kahan(_adamw()),
                           jnp.bfloat16, False, 2 + 2 + 2 + 2 + 2 + 16 + 0),
    "adamw, float32 master": Config("adamw, float32 master", _adamw,
                                    jnp.float32, True, 4 + 4 + 2 + 16 + 2),
    "adamw on bf16 (bf16 state)": Config("adamw on bf16 (bf16 state)", _adamw,
                                         jnp.bfloat16, False, 2 + 2 + 2 + 8),
    "stochastic_rounding(adamw)": Config(
        "stochastic_rounding(adamw)",
        lambda: ok.stochastic_rounding(_adamw(), jax.random.key(0)),
        jnp.bfloat16, False, 2 + 2 + 2 + 16),
    # bf16 p, g, m, v, s, x0 read (2 each), p, m, v, s written.
    "prodigy": Config("prodigy", ok.prodigy, jnp.bfloat16, False, 12 + 8),
    "optax.contrib.prodigy": Config("optax.contrib.prodigy",
                                    optax.contrib.prodigy, jnp.bfloat16, False,
                                    12 + 8),
    # bf16 p, g read and p written; s and x0 on every 11th entry.
    "prodigy_factored": Config("prodigy_factored", ok.prodigy_factored,
                               jnp.bfloat16, False, 6 + 6 / 11),
    # The same steps run one leaf at a time (optax_kahan.leafwise; kahan
    # always runs its inner transformation so).
    "leafwise(prodigy)": Config(
        "leafwise(prodigy)", lambda: ok.leafwise(ok.prodigy()),
        jnp.bfloat16, False, 12 + 8),
    "leafwise(prodigy_factored)": Config(
        "leafwise(prodigy_factored)",
        lambda: ok.leafwise(ok.prodigy_factored()), jnp.bfloat16, False,
        6 + 6 / 11),
}

COMPARISONS = [
    # (label, numerator, denominator, goal or None)
    ("kahan(adamw) / adamw with float32 master", "kahan(adamw)",
     "adamw, float32 master", 1.0),
    ("kahan(adamw) / adamw on bf16", "kahan(adamw)",
     "adamw on bf16 (bf16 state)", None),
    ("stochastic_rounding(adamw) / kahan(adamw)",
     "stochastic_rounding(adamw)", "kahan(adamw)", None),
    ("prodigy / optax.contrib.prodigy", "prodigy", "optax.contrib.prodigy",
     1.0),
    ("prodigy_factored / prodigy", "prodigy_factored", "prodigy", 0.7),
    ("leafwise(prodigy_factored) / leafwise(prodigy)",
     "leafwise(prodigy_factored)", "leafwise(prodigy)", 0.7),
]


def make_step(cfg: Config, shapes: model_shapes.Shapes):
  """Returns (jitted step, initial carry)."""
  tx = cfg.make()
  keys = jax.random.split(jax.random.key(0), len(shapes))
  params = jax.device_put(  # committed, as kahan wants: one compilation
      {k: (0.02 * jax.random.normal(key, s)).astype(cfg.param_dtype)
       for key, (k, s) in zip(keys, shapes.items())}, jax.devices()[0])
  grads = {k: (1e-3 * jnp.ones(s)).astype(jnp.bfloat16)
           for k, s in shapes.items()}
  state = jax.jit(tx.init)(params)  # (optax.contrib.prodigy aliases x0)
  if cfg.master:
    copy = jax.tree.map(lambda p: p.astype(jnp.bfloat16), params)

    @functools.partial(jax.jit, donate_argnums=(0,))
    def step(carry, grads):
      params, copy, state = carry
      grads = jax.tree.map(lambda g: g.astype(jnp.float32), grads)
      updates, state = tx.update(grads, state, params)
      params = optax.apply_updates(params, updates)
      return params, jax.tree.map(lambda p: p.astype(jnp.bfloat16), params), state

    return step, (params, copy, state), grads

  @functools.partial(jax.jit, donate_argnums=(0,))
  def step(carry, grads):
    params, state = carry
    updates, state = tx.update(grads, state, params)
    return optax.apply_updates(params, updates), state

  return step, (params, state), grads


def copy_bandwidth(n_bytes: int, reps: int) -> float:
  """GB/s of a jitted read + write of an n_bytes float32 array."""
  x = jnp.ones(n_bytes // 4, jnp.float32)
  copy = jax.jit(lambda x: x + 1.0, donate_argnums=(0,))
  x = copy(x).block_until_ready()
  times = []
  for _ in range(reps):
    t0 = time.perf_counter()
    x = copy(x).block_until_ready()
    times.append(time.perf_counter() - t0)
  return 2 * n_bytes / statistics.median(times) / 1e9


def temporary_cost(n: int, reps: int) -> dict[str, float]:
  """Times two outputs sharing one float32 intermediate (a temporary) against
  the same outputs computed independently (no temporary), donated."""

  def shared(c):
    a, b = c
    y = jnp.sqrt(a * 1.0001 + b)  # read by both outputs: materialized
    return y + a, y - b

  def separate(c):
    a, b = c
    return a * 1.0001 + 1e-7, b * 0.9999

  fns = {k: jax.jit(f, donate_argnums=(0,))
         for k, f in (("with temporary", shared), ("without", separate))}
  carries = {k: (jnp.ones(n), jnp.ones(n)) for k in fns}
  times = {k: [] for k in fns}
  for i in range(reps + 1):
    for k, f in fns.items():
      t0 = time.perf_counter()
      carries[k] = jax.block_until_ready(f(carries[k]))
      if i:  # the first call compiles
        times[k].append(time.perf_counter() - t0)
  temp = fns["with temporary"].lower(carries["without"]).compile()
  return {"elements": n,
          "temp_bytes_per_element":
              temp.memory_analysis().temp_size_in_bytes / n,
          "ratio": statistics.median(times["with temporary"])
                   / statistics.median(times["without"])}


def run(shapes: model_shapes.Shapes, reps: int) -> dict:
  n = model_shapes.num_params(shapes)
  steps, carries, grads = {}, {}, {}
  for name, cfg in CONFIGS.items():
    steps[name], carries[name], grads[name] = make_step(cfg, shapes)
    carries[name] = steps[name](carries[name], grads[name])  # compile, warm
    jax.block_until_ready(carries[name])
  times = {name: [] for name in CONFIGS}
  bandwidth = []
  for _ in range(reps):
    bandwidth.append(copy_bandwidth(8 * n, 1))
    for name in CONFIGS:
      t0 = time.perf_counter()
      carries[name] = steps[name](carries[name], grads[name])
      jax.block_until_ready(carries[name])
      times[name].append(time.perf_counter() - t0)
  medians = {k: statistics.median(v) for k, v in times.items()}
  copy_gbs = statistics.median(bandwidth)
  per_config = {}
  for name, cfg in CONFIGS.items():
    gbs = cfg.bytes_per_param * n / medians[name] / 1e9
    per_config[name] = {"median_ms": 1e3 * medians[name],
                        "bytes_per_param": cfg.bytes_per_param,
                        "achieved_GBps": gbs,
                        "fraction_of_copy_bandwidth": gbs / copy_gbs}
  ratios = {}
  for label, a, b, goal in COMPARISONS:
    r = medians[a] / medians[b]
    ratios[label] = {"ratio": r, "goal": goal,
                     "met": None if goal is None else r <= goal}
  return {"params": n, "reps": reps, "copy_GBps": copy_gbs,
          "temporary_cost": temporary_cost(n // 2, reps),
          "machine": f"{platform.machine()}, {jax.devices()[0].device_kind}, "
                     f"{jax.device_count()} device(s)",
          "configs": per_config, "ratios": ratios}


def to_markdown(r: dict) -> str:
  lines = [f"{r['params'] / 1e6:.1f}M parameters, median of {r['reps']} "
           f"interleaved repetitions; copy bandwidth {r['copy_GBps']:.1f} GB/s "
           f"({r['machine']}).", "",
           "| comparison | time ratio | goal | met |", "|---|---|---|---|"]
  for label, v in r["ratios"].items():
    goal = "" if v["goal"] is None else f"<= {v['goal']}"
    met = "" if v["met"] is None else ("yes" if v["met"] else "**no**")
    lines.append(f"| {label} | {v['ratio']:.2f} | {goal} | {met} |")
  lines += ["", "| configuration | bytes/param moved | achieved GB/s | "
            "fraction of copy bandwidth |", "|---|---|---|---|"]
  for name, v in r["configs"].items():
    lines.append(f"| {name} | {v['bytes_per_param']:.1f} | "
                 f"{v['achieved_GBps']:.1f} | "
                 f"{v['fraction_of_copy_bandwidth']:.2f} |")
  t = r["temporary_cost"]
  lines += ["", f"Cost of a temporary buffer ({t['temp_bytes_per_element']:.0f} "
            f"B/element, {t['elements'] / 1e6:.1f}M elements): "
            f"{t['ratio']:.1f}x the time of the same arithmetic without it."]
  return "\n".join(lines) + "\n"


def main(argv=None) -> dict:
  parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
  parser.add_argument("--quick", action="store_true")
  parser.add_argument("--reps", type=int, default=None)
  args = parser.parse_args(argv)
  if args.quick:
    shapes = model_shapes.flux_dev_shapes(hidden=64, double_blocks=1,
                                          single_blocks=1, head_dim=16)
  else:
    shapes = model_shapes.flux_dev_shapes(hidden=768, double_blocks=1,
                                          single_blocks=2, head_dim=64)
  reps = args.reps or (5 if args.quick else 25)
  results = run(shapes, reps)
  report.save("speed", to_markdown(results), results, args.quick)
  return results


if __name__ == "__main__":
  main()

"""Scratch memory of the optimizer step: compiled temporary bytes per parameter.

    python -m benchmarks.step_memory [--quick] [--reps 7]

The step is ``tx.update`` + ``optax.apply_updates`` on bf16 params, jitted with
params and state donated, compiled for shapes only (``ShapeDtypeStruct``:
nothing is allocated). Reported: ``compiled.memory_analysis()
.temp_size_in_bytes`` per parameter, for each optimizer as one whole-tree
program and run one leaf at a time (``optax_kahan.leafwise(tx)``; ``kahan``
always runs its inner transformation so), on

* 64 leaves of 1M elements (``--quick``: 8 leaves of 64K, and nothing else),
* FLUX.1-dev at full width (hidden 3072) with 2 double-stream and 2
  single-stream blocks (1.03B params, 112 leaves),
  because compiling all 57 blocks takes long on a small machine and the figure
  per parameter does not depend on the number of blocks.

The bound to compare with is ``16 B x largest leaf + 1 MiB``, also per
parameter; a figure that does not fall with more leaves grows with the model.
The same run also compiles the leafwise steps for half the leaves (32 x 1M) to
show that their scratch does not depend on the leaf count, and times each
whole-tree/leaf-by-leaf pair side by side (interleaved, median of ``--reps``) on the
speed benchmark's 50M-parameter FLUX-shaped model.

Writes ``benchmarks/results/step_memory{,_quick}.{md,json}``.
"""

from __future__ import annotations

import argparse
import functools
import math
import statistics
import time
from typing import Callable, Optional

import jax
import jax.numpy as jnp
import optax

import optax_kahan as ok
from benchmarks import model_shapes
from benchmarks import report
from benchmarks import speed

Make = Callable[[], optax.GradientTransformation]

# name: (whole tree or None, leaf by leaf or None). kahan always runs its
# inner transformation leaf by leaf (no whole-tree form); optax.contrib.prodigy
# couples the leaves inside its own update (no leaf-by-leaf form).
CONFIGS: dict[str, tuple[Optional[Make], Optional[Make]]] = {
    "optax.adamw": (lambda: optax.adamw(1e-4),
                    lambda: ok.leafwise(optax.adamw(1e-4))),
    "optax.adafactor": (lambda: optax.adafactor(1e-4),
                        lambda: ok.leafwise(optax.adafactor(1e-4))),
    "optax.contrib.prodigy": (optax.contrib.prodigy,
                              lambda: ok.leafwise(optax.contrib.prodigy())),
    # This package's optimizers run row by row already (leafwise inside).
    "prodigy": (ok.prodigy, lambda: ok.leafwise(ok.prodigy())),
    "prodigy_factored": (ok.prodigy_factored,
                         lambda: ok.leafwise(ok.prodigy_factored())),
    "stable_adamw": (lambda: ok.stable_adamw(1e-4),
                     lambda: ok.leafwise(ok.stable_adamw(1e-4))),
    "kahan(optax.adamw)": (None, lambda: ok.kahan(optax.adamw(1e-4))),
    "kahan(optax.adafactor)": (None, lambda: ok.kahan(optax.adafactor(1e-4))),
    "kahan(prodigy)": (None, lambda: ok.kahan(ok.prodigy())),
    "kahan(prodigy_factored)": (None,
                                lambda: ok.kahan(ok.prodigy_factored())),
    "kahan(stable_adamw)": (None, lambda: ok.kahan(ok.stable_adamw(1e-4))),
}


def abstract_state(tx, params):
  """``tx.init``'s shapes, with kahan's residuals in host memory.

  ``jax.eval_shape`` drops memory kinds; a real ``init`` puts the residuals
  in ``pinned_host`` memory, and the step lowered here must read them there.
  (A ``SingleDeviceSharding``'s memory kind is ignored when tracing a
  ``ShapeDtypeStruct``; a ``NamedSharding``'s is kept.)
  """
  state = jax.eval_shape(tx.init, params)
  try:
    residuals = ok.kahan_residuals(state)
  except ValueError:  # no kahan in this optimizer
    return state
  mesh = jax.sharding.Mesh(jax.devices()[:1], ("one",))
  host = jax.sharding.NamedSharding(mesh, jax.P(), memory_kind="pinned_host")
  return ok.kahan_replace_residuals(state, jax.tree.map(
      lambda r: jax.ShapeDtypeStruct(r.shape, r.dtype, sharding=host),
      residuals))


def temp_bytes(make, shapes: model_shapes.Shapes) -> int:
  tx = make()
  params = model_shapes.as_params(shapes)
  state = abstract_state(tx, params)

  @functools.partial(jax.jit, donate_argnums=(0, 1))
  def step(params, state, grads):
    updates, state = tx.update(grads, state, params)
    return optax.apply_updates(params, updates), state

  compiled = step.lower(params, state, params).compile()
  return compiled.memory_analysis().temp_size_in_bytes


def bound(shapes: model_shapes.Shapes) -> float:
  """The goal in bytes: 16 B x the largest leaf's elements + 1 MiB."""
  return 16 * max(math.prod(s) for s in shapes.values()) + 2**20


def time_ratios(shapes: model_shapes.Shapes, reps: int) -> dict[str, float]:
  """Median step time of leafwise / default, each pair timed interleaved.

  One pair at a time, its two steps alternating, so that each ratio comes
  from steps timed close together. (Timed all in one loop, one run of three
  gave ratios up to 2x those of the runs around it, for no reason found.)
  """
  ratios = {}
  for name, (default, leafwise) in CONFIGS.items():
    if leafwise is None or default is None:
      continue
    steps, carries, grads, times = {}, {}, {}, {}
    for mode, make in (("default", default), ("leafwise", leafwise)):
      cfg = speed.Config(name, make, jnp.bfloat16, False, 0.0)
      steps[mode], carries[mode], grads[mode] = speed.make_step(cfg, shapes)
      carries[mode] = jax.block_until_ready(
          steps[mode](carries[mode], grads[mode]))  # compile, warm
      times[mode] = []
    for _ in range(reps):
      for mode in steps:
        t0 = time.perf_counter()
        carries[mode] = jax.block_until_ready(steps[mode](carries[mode],
                                                          grads[mode]))
        times[mode].append(time.perf_counter() - t0)
    ratios[name] = (statistics.median(times["leafwise"])
                    / statistics.median(times["default"]))
  return ratios


def run(models: dict[str, model_shapes.Shapes],
        timing_shapes: model_shapes.Shapes, reps: int) -> dict:
  out = {"models": {}}
  for model, shapes in models.items():
    n = model_shapes.num_params(shapes)
    rows = {}
    for name, (default, leafwise) in CONFIGS.items():
      rows[name] = {
          "default": None if default is None
                     else temp_bytes(default, shapes) / n,
          "leafwise": None if leafwise is None
                      else temp_bytes(leafwise, shapes) / n}
    out["models"][model] = {"params": n, "leaves": len(shapes),
                            "bound_B_per_param": bound(shapes) / n,
                            "temp_B_per_param": rows}
  # Independence of the leaf count: the first model with half its leaves.
  model, shapes = next(iter(models.items()))
  half = dict(list(shapes.items())[:len(shapes) // 2])
  out["leaf_count_check"] = {
      "model": model, "leaves": [len(shapes), len(half)],
      "leafwise_temp_bytes": {
          name: [temp_bytes(leafwise, shapes), temp_bytes(leafwise, half)]
          for name, (_, leafwise) in CONFIGS.items() if leafwise is not None}}
  out["timing_params"] = model_shapes.num_params(timing_shapes)
  out["reps"] = reps
  out["time_ratio_leafwise_over_default"] = time_ratios(timing_shapes, reps)
  return out


def to_markdown(results: dict) -> str:
  models = results["models"]
  lines = ["| step (bf16 params) | " + " | ".join(
      f"{m} ({r['params'] / 1e6:.0f}M, {r['leaves']} leaves): whole tree | "
      "leaf by leaf" for m, r in models.items()) + " | leaf-by-leaf step "
      "time / whole tree |", "|---|" + "---|---|" * len(models) + "---|"]
  ratios = results["time_ratio_leafwise_over_default"]
  for name in CONFIGS:
    cells = []
    for m in models:
      row = models[m]["temp_B_per_param"][name]
      cells.append("n/a (always leaf by leaf)" if row["default"] is None
                   else f"{row['default']:.2f}")
      cells.append("n/a (couples leaves)" if row["leafwise"] is None
                   else f"{row['leafwise']:.3f}")
    ratio = f"{ratios[name]:.2f}" if name in ratios else ""
    lines.append(f"| {name} | " + " | ".join(cells) + f" | {ratio} |")
  lines.append("| goal: 16 B x largest leaf + 1 MiB | " + " | ".join(
      f" | {models[m]['bound_B_per_param']:.3f}" for m in models) + " | |")
  check = results["leaf_count_check"]
  extra = check["leaves"][0] - check["leaves"][1]
  per_leaf = max((a - b) / extra
                 for a, b in check["leafwise_temp_bytes"].values())
  worst = max(max(v) for v in check["leafwise_temp_bytes"].values())
  lines += ["", f"Leafwise scratch of {check['model']} against its first "
            f"{check['leaves'][1]} leaves: at most {per_leaf:.0f} bytes more "
            f"per extra leaf (its scalars), largest {worst / 2**20:.2f} MiB. "
            f"Step times on {results['timing_params'] / 1e6:.0f}M parameters, "
            f"median of {results['reps']} interleaved repetitions."]
  return "\n".join(lines) + "\n"


def main(argv=None) -> dict:
  parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
  parser.add_argument("--quick", action="store_true")
  parser.add_argument("--reps", type=int, default=None)
  args = parser.parse_args(argv)
  if args.quick:
    models = {"8 x 64K": {f"w{i}": (256, 256) for i in range(8)}}
    timing = models["8 x 64K"]
  else:
    models = {
        "64 x 1M": {f"w{i}": (1024, 1024) for i in range(64)},
        "FLUX.1-dev, 2+2 blocks": model_shapes.flux_dev_shapes(
            double_blocks=2, single_blocks=2)}
    timing = model_shapes.flux_dev_shapes(hidden=768, double_blocks=1,
                                          single_blocks=2, head_dim=64)
  results = run(models, timing, args.reps or (2 if args.quick else 7))
  report.save("step_memory", to_markdown(results), results, args.quick)
  return results


if __name__ == "__main__":
  main()

"""A full training step of the example's model: Kahan with host offload vs plain bf16.

    python -m benchmarks.gpu_step [--quick] [--width 384] [--batch 256]
    python -m benchmarks.gpu_step --model dit-scanned    # or dit-unrolled

The step is forward + backward + optimizer update + apply, jitted once with
params and state donated, on the UNet of ``examples/finetune_diffusion.py``
(widened so that the optimizer's memory matters), or on the DiT-like model of
``benchmarks.gpu_compile`` (8 blocks of width 1024, each rematerialized,
batch 4 x 1024 tokens; ``--quick``: width 256, batch 2 x 256), its blocks in a
``lax.scan`` or unrolled: there the configurations are ``bf16 adamw``,
``kahan(adamw)`` and ``kahan(adamw), offload=False`` (what the compiled tables
say about host residuals in a whole step, measured). Configurations:

* ``bf16 adamw``: bf16 params, ``optax.adamw`` (bf16 state), plain apply;
* ``kahan(adamw)``: bf16 params, float32 state, residuals in ``pinned_host``;
* ``kahan(prodigy_factored)``: the low-memory configuration;
* ``kahan(chain(clip_by_global_norm, adamw))``: a chain with a global sum
  that keeps its per-leaf form (``optax_kahan.per_leaf.chain``);
* ``float32 master adamw``: classic mixed precision.

Per configuration: the median step time (interleaved, in one process) as a
ratio to ``bf16 adamw``; ``compiled.memory_analysis()`` (device and host
argument / temporary bytes, which XLA reports separately on GPU); and the peak
device memory of a fresh process running only that configuration
(``jax.local_devices()[0].memory_stats()['peak_bytes_in_use']``, where the
backend has it). The question: does XLA overlap the residual copies with
compute, and does it avoid bringing every residual onto the device at once
(peak of ``kahan`` minus peak of ``bf16`` compared with 2 B/param)?

Writes ``benchmarks/results/gpu_step{,_quick}.{md,json}``.
"""

from __future__ import annotations

import argparse
import functools
import json
import pathlib
import statistics
import subprocess
import sys
import time
import warnings

import jax
import jax.numpy as jnp
import optax

import optax_kahan as ok
from benchmarks import example
from benchmarks import gpu_compile
from benchmarks import report

ROOT = pathlib.Path(__file__).parent.parent
CONFIGS = ("bf16 adamw", "kahan(adamw)",
           "kahan(chain(clip_by_global_norm, adamw))",
           "kahan(prodigy_factored)", "float32 master adamw")
DIT_CONFIGS = ("bf16 adamw", "kahan(adamw)", "kahan(adamw), offload=False")


def configs(model: str) -> tuple[str, ...]:
  return CONFIGS if model == "unet" else DIT_CONFIGS


def dit_sizes(quick: bool) -> tuple[int, int, int]:
  """The DiT-like model's width, batch and tokens."""
  return (256, 2, 256) if quick else (1024, 4, 1024)


def make_dit_step(name: str, model: str, quick: bool):
  """The DiT-like model's step: (jitted step, carry, batch, params)."""
  width, batch, tokens = dit_sizes(quick)
  dit = gpu_compile.dit_model(width, 8, model == "dit-scanned", batch, tokens)
  key = jax.random.key(0)
  params = jax.device_put(jax.tree.map(
      lambda s: (0.02 * jax.random.normal(key, s.shape)).astype(s.dtype),
      dit.params), jax.devices()[0])  # committed: one compile
  data = tuple(jax.random.normal(jax.random.fold_in(key, i), s.shape, s.dtype)
               for i, s in enumerate(dit.batch))
  tx = {"bf16 adamw": optax.adamw(1e-5),
        "kahan(adamw)": ok.kahan(optax.adamw(1e-5)),
        "kahan(adamw), offload=False": ok.kahan(optax.adamw(1e-5),
                                                offload=False)}[name]

  @functools.partial(jax.jit, donate_argnums=(0,))
  def step(carry, data):
    params, state = carry
    u, state = tx.update(jax.grad(dit.loss)(params, *data), state, params)
    return optax.apply_updates(params, u), state

  n = sum(x.size for x in jax.tree.leaves(params))
  return step, (params, jax.jit(tx.init)(params)), data, n


def make_step(name: str, width: int, batch: int, model: str = "unet",
              quick: bool = False):
  """Returns (jitted step, carry, batch, number of params)."""
  if model != "unet":
    return make_dit_step(name, model, quick)
  ex = example.load()
  graphdef, _ = ex.model_def(width)
  params32 = ex.init_params(width, 0)
  n = ex.count_params(params32)
  key = jax.random.key(0)
  x0 = jax.random.uniform(key, (batch, 8, 8, 1), minval=-1, maxval=1)
  eps = jax.random.normal(jax.random.fold_in(key, 1), x0.shape)
  t = jax.random.uniform(jax.random.fold_in(key, 2), (batch,))
  data = (x0, eps, t)

  def loss(p, data):
    return ex.flow_matching_loss(graphdef, p, *data)

  if name == "float32 master adamw":
    tx = optax.adamw(1e-5)

    @functools.partial(jax.jit, donate_argnums=(0,))
    def step(carry, data):
      master, state = carry
      g = jax.grad(loss)(ex.to_bf16(master), data)
      g = jax.tree.map(lambda x: x.astype(jnp.float32), g)
      u, state = tx.update(g, state, master)
      return optax.apply_updates(master, u), state

    return step, (params32, jax.jit(tx.init)(params32)), data, n

  tx = {"bf16 adamw": optax.adamw(1e-5),
        "kahan(adamw)": ok.kahan(optax.adamw(1e-5)),
        "kahan(chain(clip_by_global_norm, adamw))": ok.kahan(ok.per_leaf.chain(
            ok.per_leaf.clip_by_global_norm(1.0), optax.adamw(1e-5))),
        "kahan(prodigy_factored)": ok.kahan(ok.prodigy_factored())}[name]
  params = ex.to_bf16(params32)

  @functools.partial(jax.jit, donate_argnums=(0,))
  def step(carry, data):
    params, state = carry
    u, state = tx.update(jax.grad(loss)(params, data), state, params)
    return optax.apply_updates(params, u), state

  return step, (params, jax.jit(tx.init)(params)), data, n


def analysis(compiled) -> dict[str, int]:
  m = compiled.memory_analysis()
  fields = ("argument_size_in_bytes", "output_size_in_bytes",
            "temp_size_in_bytes", "host_argument_size_in_bytes",
            "host_output_size_in_bytes", "host_temp_size_in_bytes")
  return {f: int(getattr(m, f, 0) or 0) for f in fields}


def peak_of(name: str, width: int, batch: int, model: str = "unet",
            quick: bool = False) -> dict:
  """Runs one configuration in this (fresh) process; its peak device bytes."""
  step, carry, data, n = make_step(name, width, batch, model, quick)
  for _ in range(3):
    carry = step(carry, data)
  jax.block_until_ready(carry)
  stats = jax.local_devices()[0].memory_stats() or {}
  return {"params": n, "peak_bytes_in_use": stats.get("peak_bytes_in_use"),
          "residual_memory_kinds": sorted({
              r.sharding.memory_kind for r in jax.tree.leaves(
                  [s.residuals for s in jax.tree.leaves(
                      carry, is_leaf=lambda x: isinstance(x, ok.KahanState))
                   if isinstance(s, ok.KahanState)])})}


def run(width: int, batch: int, reps: int, model: str = "unet",
        quick: bool = False) -> dict:
  steps, carries, datas, mem = {}, {}, {}, {}
  names = configs(model)
  for name in names:
    step, carries[name], datas[name], n = make_step(name, width, batch, model,
                                                    quick)
    steps[name] = step.lower(carries[name], datas[name]).compile()
    mem[name] = analysis(steps[name])
    carries[name] = steps[name](carries[name], datas[name])
    jax.block_until_ready(carries[name])
  times = {name: [] for name in names}
  for _ in range(reps):
    for name in names:
      t0 = time.perf_counter()
      carries[name] = steps[name](carries[name], datas[name])
      jax.block_until_ready(carries[name])
      times[name].append(time.perf_counter() - t0)
  base = statistics.median(times["bf16 adamw"])
  peaks = {name: {"peak_bytes_in_use": None, "residual_memory_kinds": []}
           for name in names}
  has_stats = bool(jax.local_devices()[0].memory_stats())  # None on CPU
  for name in names if has_stats else ():  # fresh process: peaks are global
    out = subprocess.run(
        [sys.executable, "-m", "benchmarks.gpu_step", "--peak-of", name,
         "--width", str(width), "--batch", str(batch), "--model", model,
         *(["--quick"] if quick else [])],
        cwd=ROOT, capture_output=True, text=True, check=True)
    peaks[name] = json.loads(out.stdout.strip().splitlines()[-1])
  rows = {}
  for name in names:
    peak = peaks[name]["peak_bytes_in_use"]
    kinds = peaks[name]["residual_memory_kinds"] or sorted({
        r.sharding.memory_kind for s in jax.tree.leaves(
            carries[name], is_leaf=lambda x: isinstance(x, ok.KahanState))
        if isinstance(s, ok.KahanState) for r in jax.tree.leaves(s.residuals)})
    rows[name] = {
        "time_ratio_vs_bf16": statistics.median(times[name]) / base,
        "median_ms": 1e3 * statistics.median(times[name]),
        **mem[name],
        "peak_bytes_in_use": peak,
        "peak_B_per_param": None if peak is None else peak / n,
        "residual_memory_kinds": kinds,
    }
  if model == "unet":
    what = f"UNet width {width}, batch {batch}"
  else:
    width, batch, tokens = dit_sizes(quick)
    what = (f"DiT-like model, 8 blocks of width {width} "
            f"{model.split('-')[1]}, remat, batch {batch} x {tokens}")
  return {"params": n, "width": width, "batch": batch, "reps": reps,
          "model": what,
          "device": f"{jax.devices()[0].device_kind} ({jax.default_backend()})",
          "rows": rows}


def to_markdown(r: dict) -> str:
  n = r["params"]
  lines = [f"{r['device']}; {r['model']}, {n / 1e6:.1f}M params, "
           f"median of {r['reps']}.", "",
           "| configuration | step time vs bf16 | device args B/param | "
           "host args B/param | device temp B/param | peak device B/param | "
           "residuals in |", "|---|---|---|---|---|---|---|"]
  for name, v in r["rows"].items():
    peak = ("n/a" if v["peak_B_per_param"] is None
            else f"{v['peak_B_per_param']:.2f}")
    lines.append(
        f"| {name} | {v['time_ratio_vs_bf16']:.2f} | "
        f"{v['argument_size_in_bytes'] / n:.2f} | "
        f"{v['host_argument_size_in_bytes'] / n:.2f} | "
        f"{v['temp_size_in_bytes'] / n:.2f} | {peak} | "
        f"{', '.join(v['residual_memory_kinds']) or '-'} |")
  return "\n".join(lines) + "\n"


def main(argv=None) -> dict:
  parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
  parser.add_argument("--quick", action="store_true")
  parser.add_argument("--width", type=int, default=None)
  parser.add_argument("--batch", type=int, default=None)
  parser.add_argument("--reps", type=int, default=None)
  parser.add_argument("--model", default="unet",
                      choices=("unet", "dit-scanned", "dit-unrolled"))
  parser.add_argument("--peak-of", default=None, help=argparse.SUPPRESS)
  args = parser.parse_args(argv)
  if args.model != "unet" and (args.width or args.batch):
    parser.error("--width and --batch size the UNet; the DiT-like model's "
                 "sizes are fixed (--quick: the small ones)")
  width = args.width or (8 if args.quick else 384)
  batch = args.batch or (8 if args.quick else 256)
  with warnings.catch_warnings():
    # kahan's warning for host residuals with unrolled remat: what is measured
    warnings.filterwarnings("ignore", "kahan: the residuals are in host "
                            "memory", ok.OptaxKahanWarning)
    if args.peak_of:
      print(json.dumps(peak_of(args.peak_of, width, batch, args.model,
                               args.quick)))
      return {}
    results = run(width, batch, args.reps or (3 if args.quick else 20),
                  args.model, args.quick)
  name = "gpu_step" if args.model == "unet" else f"gpu_step_{args.model}"
  report.save(name, to_markdown(results), results, args.quick)
  return results


if __name__ == "__main__":
  main()

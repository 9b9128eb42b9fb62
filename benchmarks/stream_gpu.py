"""The streaming blockwise FLUX step, run on a GPU: measured against the model.

    python -m benchmarks.stream_gpu            # on a GPU (benchmarks/gpu.sh)
    python -m benchmarks.stream_gpu --batch 8 --only "residuals on the device" \
        --only "all blocks streamed, activations on host"
    python -m benchmarks.stream_gpu --tiny     # anywhere: a smoke run

FLUX.1-dev at reduced depth (4 double + 8 single blocks of width 3072,
2.5B params), at 1024x1024, batch 1 (``--batch``), ``blockwise_step`` of
``kahan(prodigy_factored(lagged_d=True, state_dtype=bf16))`` with random
weights, in five setups: residuals on the device, residuals in host memory
(``stream_blocks(..., (0, 0))``: a spare buffer per leaf), the same but the
first half of the double-stream blocks' (``residuals_on_device``), every
block streamed (``stream_blocks``), and that with the blocks' saved inputs in
host memory (``offload_activations=True``), each jitted with
``ok.blockwise.STREAMING_COMPILER_OPTIONS`` as the README's table (``--only``:
some of them). Each setup runs in a process of its own (the device's
``peak_bytes_in_use`` counts from the process start): it compiles the step
(once per role of the spare buffers), reads the compiled peak and the
``benchmarks.timeline`` model of the compiled schedule, runs ``--warmup``
untimed (2) and ``--steps`` timed steps, and reports the measured peak and
median step time.
The table sets the measured step-time ratios (to residuals on the device)
beside the modeled ones, and the measured peak beside the compiled one.

Writes ``benchmarks/results/stream_gpu{,_b<batch>}.{md,json}``.
"""

from __future__ import annotations

import argparse
import dataclasses
import datetime
import json
import statistics
import subprocess
import sys
import time

SETUPS = ("residuals on the device", "residuals in host memory",
          "residuals in host memory but half the double blocks'",
          "all blocks streamed", "all blocks streamed, activations on host")


def run_setup(setup: str, tiny: bool, steps: int, warmup: int = 2,
              batch_size: int = 1) -> dict:
  import jax
  import jax.numpy as jnp

  import optax_kahan as ok
  from optax_kahan import flux
  from benchmarks import timeline

  cfg = flux.FluxConfig.dev()
  cfg = dataclasses.replace(cfg, double_blocks=4, single_blocks=8,
                            heads_per_chunk=2)
  tokens = (4096, 512)
  if tiny:
    cfg = flux.FluxConfig.tiny()
    tokens = (64, 16)
  model = flux.abstract_model(cfg)
  abstract = flux.abstract_params(cfg, jnp.bfloat16)
  leaves, treedef = jax.tree.flatten(abstract)
  keys = jax.random.split(jax.random.key(0), len(leaves))
  device = jax.devices()[0]
  # one program for every leaf (eagerly, one compile per distinct shape)
  params = jax.jit(lambda keys: treedef.unflatten([
      0.02 * jax.random.normal(k, x.shape, x.dtype)
      for k, x in zip(keys, leaves)]),
                   out_shardings=jax.sharding.SingleDeviceSharding(device))(
                       keys)
  tx = ok.kahan(ok.prodigy_factored(lagged_d=True, state_dtype=jnp.bfloat16),
                offload=setup != "residuals on the device")
  state = ok.blockwise.blockwise_init(tx, params)
  if setup != "residuals on the device":  # spare host buffers
    model, params, state = ok.blockwise.stream_blocks(
        model, params, state, (cfg.double_blocks, cfg.single_blocks)
        if setup.startswith("all blocks streamed") else (0, 0),
        residuals_on_device=(cfg.double_blocks // 2, 0)
        if setup.endswith("double blocks'") else None)
  spec = flux.batch_spec(cfg, batch_size, *tokens)
  batch = {k: jax.device_put(jnp.ones(v.shape, v.dtype) * 0.1, device)
           for k, v in spec.items()}
  activations = setup.endswith("activations on host")
  step = jax.jit(lambda p, s, b: ok.blockwise.blockwise_step(
      model, tx, p, s, b, offload_activations=activations),
                 donate_argnums=(0, 1),
                 compiler_options=ok.blockwise.STREAMING_COMPILER_OPTIONS)
  # one program per role of the spare buffers, each compiled once, ahead
  programs = {}

  def program(params, state):
    key = jax.tree.structure((params, state))
    if key not in programs:
      programs[key] = step.lower(params, state, batch).compile()
    return programs[key]

  compiled = program(params, state)
  m = compiled.memory_analysis()
  compiled_peak = (m.argument_size_in_bytes + m.output_size_in_bytes
                   - m.alias_size_in_bytes + m.temp_size_in_bytes)
  # the model reads GPU schedules (the CPU program has lax.cond islands)
  modeled = (timeline.model(compiled.as_text()).step_s
             if device.platform == "gpu" else None)
  times = []
  for i in range(warmup + steps):
    t0 = time.perf_counter()
    loss, params, state = program(params, state)(params, state, batch)
    loss.block_until_ready()
    if i >= warmup:
      times.append(time.perf_counter() - t0)
  stats = device.memory_stats() or {}
  return {"setup": setup, "device": device.device_kind, "batch": batch_size,
          "compiled_peak_bytes": compiled_peak,
          "measured_peak_bytes": stats.get("peak_bytes_in_use"),
          "modeled_s": modeled, "median_s": statistics.median(times),
          "loss": float(loss)}


def to_markdown(r: dict) -> str:
  rows = r["rows"]
  ref = rows[0]
  lines = [f"Run on {ref['device']} ({r['date']}): {r['model']}. Measured "
           "peak: the device's peak_bytes_in_use in the setup's own process; "
           "compiled peak: memory_analysis(); modeled: benchmarks.timeline "
           "(gemms 700 TFLOP/s, PCIe 50 GB/s per direction, other kernels "
           "free).", "",
           "| setup | compiled peak GB | measured peak GB | median step ms | "
           "measured ratio | modeled ms | modeled ratio |",
           "|---|---|---|---|---|---|---|"]
  for v in rows:
    measured = (f"{v['measured_peak_bytes'] / 1e9:.2f}"
                if v["measured_peak_bytes"] else "n/a")
    lines.append(
        f"| {v['setup']} | {v['compiled_peak_bytes'] / 1e9:.2f} | {measured} "
        f"| {v['median_s'] * 1e3:.1f} | {v['median_s'] / ref['median_s']:.2f}x"
        + (f" | {v['modeled_s'] * 1e3:.1f} | "
           f"{v['modeled_s'] / ref['modeled_s']:.2f}x |" if v["modeled_s"]
           else " | n/a | n/a |"))
  return "\n".join(lines) + "\n"


def main(argv=None) -> dict:
  parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
  parser.add_argument("--tiny", action="store_true",
                      help="FluxConfig.tiny(), a smoke run")
  parser.add_argument("--steps", type=int, default=5)
  parser.add_argument("--warmup", type=int, default=2,
                      help="untimed steps first (2: both roles of the spare "
                      "buffers compiled and run once)")
  parser.add_argument("--batch", type=int, default=1)
  parser.add_argument("--only", action="append", choices=SETUPS,
                      metavar="SETUP", help="run this setup (repeatable; "
                      "the first is the ratios' reference); default: all")
  parser.add_argument("--setup", choices=SETUPS, help=argparse.SUPPRESS)
  args = parser.parse_args(argv)
  if args.setup:  # a child: one setup, its JSON on the last line
    print(json.dumps(run_setup(args.setup, args.tiny, args.steps,
                               args.warmup, args.batch)))
    return {}
  rows = []
  for setup in args.only or SETUPS:
    cmd = [sys.executable, "-m", "benchmarks.stream_gpu", "--setup", setup,
           "--steps", str(args.steps), "--warmup", str(args.warmup),
           "--batch", str(args.batch)] + (["--tiny"] if args.tiny else [])
    out = subprocess.run(cmd, check=True, capture_output=True, text=True)
    rows.append(json.loads(out.stdout.strip().splitlines()[-1]))
    print(f"  {setup}: {rows[-1]['median_s'] * 1e3:.1f} ms", flush=True)
  from benchmarks import report
  r = {"date": datetime.date.today().isoformat(), "rows": rows,
       "model": (f"FluxConfig.tiny() (a smoke run), batch {args.batch}"
                 if args.tiny else "FLUX.1-dev shapes, 4 + 8 blocks of "
                 f"width 3072, batch {args.batch} at 1024x1024")}
  report.save("stream_gpu" + (f"_b{args.batch}" if args.batch != 1 else ""),
              to_markdown(r), r, quick=args.tiny)
  return r


if __name__ == "__main__":
  main()

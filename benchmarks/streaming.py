"""FLUX.1-dev's blockwise step with blocks streamed through the device: compiled
peak and modeled step time, for an H200, without a GPU.

    pip install -e ".[gpu-aot]"      # jax's CUDA plugin: XLA's GPU compiler
    python -m benchmarks.streaming [--quick] [--target h200]

Nothing runs. Each step is ``optax_kahan.blockwise.blockwise_step`` of
``kahan(prodigy_factored(lagged_d=True, state_dtype=bf16))`` on
``benchmarks.flux_model`` at FLUX.1-dev's real dimensions (11.9B params),
batch 1 (and 2) at 1024x1024, compiled deviceless from abstract arguments
(``benchmarks.gpu_compile``), params and state donated, with
``ok.blockwise.STREAMING_COMPILER_OPTIONS`` (one row without, to show what they do).
Rows:

* residuals on the device (``kahan(..., offload=False)``): the reference
  time, and the peak a card would need without offload;
* residuals in host memory, weights and state on the device: as
  ``blockwise_init`` lays them out (one host buffer per leaf: a block's
  fetch waits for the previous block's write-back), and as
  ``stream_blocks(..., (0, 0))`` lays them out (a spare buffer per leaf:
  read one, write the other, both directions at once);
* ``stream_blocks``: the last blocks of the stacks, weights, state and
  residuals, in host memory. Single-stream blocks go first: a single block
  moves 283 MB of weights against about 4 TFLOP of backward compute, a
  double block 680 MB against about the same. The smallest count whose
  compiled peak fits 24 GB is searched (bisection over the count), then all
  57 blocks (the smallest peak streaming reaches).

Read from each program: the device peak (arguments + outputs - aliased +
temporaries, ``memory_analysis()``), the host memory its arguments take,
the margin to a card of 24 or 12 GiB after 0.5 GB of CUDA context, and the
``benchmarks.timeline`` model of its schedule (gemms at 700 TFLOP/s, PCIe
50 GB/s per direction, other kernels free): modeled step time, its ratio to
the residuals-on-device step at the same batch, and the share of each PCIe
direction hidden behind compute. Estimates from the compiled schedule, not
measurements.

``--quick``: 2 + 4 blocks of width 256, batch 1, no search and no row without
the options (for CI).
``--fit GB``: only the search for a peak of at most GB (for the 32 GB card:
``--fit 32``), to ``results/streaming_fit<GB>``. ``--one-buffer``: the
streamed rows with ``stream_blocks(..., spare_buffers=False)``.
``--device-residuals``: with ``--fit``, ``kahan(..., offload=False)``: the
blocks not streamed keep their residuals on the device. ``--cards``: runs
``python -m optax_kahan.plan`` (``ok.blockwise.plan``'s search) for
FLUX.1-dev at each ``--card`` (default 8 to 80 GiB) and ``--max-host``
(default 64 GB and no cap), batches 1 and 4 (or ``--batch``), with
``--interleave`` also interleaved host arrays, and saves its output to
``results/streaming_cards``.
``--residuals-on-device``: the residuals in host memory but the first 0, 5 or
10 double-stream blocks' (``stream_blocks(..., residuals_on_device=)``), at
batch 1 and 2, to ``results/streaming_residuals_on_device``. Every row also
gives its loop floor (``Timeline.loop_floor_s``).
Writes ``benchmarks/results/streaming{,_quick}.{md,json}``.
"""

from __future__ import annotations

import os

if __name__ == "__main__":  # before jax is imported: no CUDA driver is touched
  os.environ["JAX_PLATFORMS"] = "cpu"

import argparse
import dataclasses
import datetime
import math
import resource
import subprocess
import sys
import time
from typing import Any, Optional

import jax
import jax.numpy as jnp

import optax_kahan as ok
from optax_kahan import flux
from optax_kahan import plan as ok_plan
from optax_kahan._src.blockwise.plan import hidden_share
from benchmarks import blockwise as blockwise_bench
from benchmarks import gpu_compile
from benchmarks import report
from benchmarks import timeline

CONTEXT = 0.5e9  # CUDA context and cuDNN/cuBLAS workspaces, about
MARGIN = 0.5e9  # left free on a card beside the peak and the context
CARDS = (8, 12, 16, 24, 32, 48, 80)  # GiB, --cards' default
OPTIMIZER = ok_plan.OPTIMIZER
make_tx = ok_plan.default_tx


def compile_row(cfg, target: str, batch: int, offload: bool,
                streamed: Optional[tuple[int, ...]], spare: bool = True,
                options: bool = True, activations: bool = False,
                kept: Optional[tuple[int, ...]] = None,
                interleave: bool = False) -> dict[str, Any]:
  """One step compiled (with ``STREAMING_COMPILER_OPTIONS``, or XLA's
  defaults; ``activations``: the blocks' saved inputs in host memory;
  ``kept``: ``stream_blocks``' ``residuals_on_device``; ``interleave``:
  its ``interleave``, with ``spare`` False); its peak and modeled time."""
  mesh = gpu_compile.gpu_mesh(target)
  device = jax.NamedSharding(mesh.abstract_mesh, jax.P())
  host = jax.NamedSharding(mesh.abstract_mesh, jax.P(),
                           memory_kind="pinned_host")
  sds = lambda x: jax.ShapeDtypeStruct(x.shape, x.dtype, sharding=device)
  model = flux.abstract_model(cfg)
  params = jax.tree.map(sds, flux.abstract_params(cfg, jnp.bfloat16))
  tx = make_tx(offload)
  state = blockwise_bench._state(tx, params, True, device,
                                 host if offload else device)
  if streamed is not None:
    model, params, state = ok.blockwise.stream_blocks(
        model, params, state, streamed, spare_buffers=spare,
        interleave=interleave, residuals_on_device=kept)
  b = jax.tree.map(sds, flux.batch_spec(cfg, batch, 4096, 512))
  t0 = time.perf_counter()
  compiled = gpu_compile.compile_step(
      lambda p, s, x: ok.blockwise.blockwise_step(
          model, tx, p, s, x, offload_activations=activations),
      (params, state, b),
      mesh, compiler_options=ok.blockwise.STREAMING_COMPILER_OPTIONS if options else None)
  m = compiled.memory_analysis()
  peak = (m.argument_size_in_bytes + m.output_size_in_bytes
          - m.alias_size_in_bytes + m.temp_size_in_bytes)
  t = timeline.model(compiled.as_text())
  row = {"batch": batch, "offload": offload, "spare": spare,
         "interleave": interleave,
         "options": options, "activations": activations,
         "streamed": None if streamed is None else list(streamed),
         "kept": None if kept is None else list(kept),
         "peak_bytes": peak, "temp_bytes": m.temp_size_in_bytes,
         "host_bytes": m.host_argument_size_in_bytes,
         "host_temp_bytes": m.host_temp_size_in_bytes,
         "compile_s": time.perf_counter() - t0, **t.as_dict()}
  print(f"  batch {batch} offload={offload} streamed={streamed}"
        f"{' activations in host memory' if activations else ''}: "
        f"{peak / 1e9:.2f} GB, {t.step_s * 1e3:.0f} ms modeled "
        f"({row['compile_s']:.0f} s)", flush=True)
  return row


def fewest_streamed(cfg, target: str, limit: float, spare: bool = True,
                    offload: bool = True, batch: int = 1, lo: int = 0,
                    found: Optional[dict[int, dict]] = None,
                    activations: bool = False) -> tuple[int, int, dict]:
  """The fewest streamed blocks (single-stream ones first) whose step's
  compiled peak is at most ``limit`` bytes, searched over the count from
  ``lo``, the peak taken to fall as the count grows (it does past the first
  block: streaming one block adds its spare buffers, 33.36 to 33.91 GB at
  batch 1, a rise the search steps over): each guess interpolates the
  peak linearly between the nearest counts compiled on either side, and a
  count that fits is confirmed by the one below it. ``offload=False``: the
  blocks not streamed keep their residuals on the device. ``found``: rows
  compiled before, by count (filled in). ``activations``: the blocks' saved
  inputs in host memory. With every block streamed and still over the
  limit, returns that row."""
  counts = (cfg.double_blocks, cfg.single_blocks)
  streamed = lambda k: (max(0, k - counts[1]), min(k, counts[1]))
  found = {} if found is None else found

  def row(k: int) -> dict:
    if k not in found:
      found[k] = compile_row(cfg, target, batch, offload, streamed(k), spare,
                             activations=activations)
    return found[k]

  hi = sum(counts)
  peak = lambda k: row(k)["peak_bytes"]
  if peak(hi) > limit:
    return (*streamed(hi), row(hi))
  for k in found:  # what earlier searches compiled narrows this one
    if lo <= k < hi:
      if found[k]["peak_bytes"] <= limit:
        hi = k
      else:
        lo = max(lo, k + 1)
  k = None
  while lo < hi:  # counts below lo do not fit; hi fits
    if k == hi:  # the last guess fits: does one block fewer?
      k = hi - 1
    else:
      below = max([c for c in found if c < lo] or [lo])
      k = below + math.ceil((peak(below) - limit) * (hi - below)
                            / max(1.0, peak(below) - peak(hi)))
      k = min(max(k, lo), hi - 1)
    if peak(k) <= limit:
      hi = k
    else:
      lo = k + 1
  return (*streamed(lo), row(lo))


def host_bytes(row: dict) -> float:
  """The step's arguments and temporaries in host memory."""
  return row["host_bytes"] + row.get("host_temp_bytes", 0)


def plan_argv(cards: list[float], host_rams: list[str], batches: list[int],
              target: str, interleave: bool = False) -> list[str]:
  """``python -m optax_kahan.plan``'s arguments for ``--cards``."""
  argv = ["--model", "flux-dev"]
  argv += [a for c in cards for a in ("--card", f"{c:g}")]
  argv += [a for r in host_rams for a in ("--host-ram", r)]
  argv += [a for b in batches for a in ("--batch", str(b))]
  argv += [] if target == "h200" else ["--target", target]
  return argv + (["--interleave"] if interleave else [])


def plan_env() -> dict[str, str]:
  """The command's environment: this one, unbuffered, with
  ``MALLOC_ARENA_MAX=4`` unless set. XLA compiles on threads, and glibc's
  per-thread malloc arenas grow a long search's memory: about 0.3 GB a
  compile without the cap, 0.1 to 0.15 GB with it, in the FLUX.1-dev runs
  (docs/guides/flux.md)."""
  return {"MALLOC_ARENA_MAX": "4", **os.environ, "PYTHONUNBUFFERED": "1"}


def run_plan(argv: list[str]) -> str:
  """``python -m optax_kahan.plan`` as users run it, in a child process
  (``plan_env()``); its output, each line shown as it comes (each compile
  takes 30 to 60 s)."""
  child = subprocess.Popen([sys.executable, "-m", "optax_kahan.plan", *argv],
                           stdout=subprocess.PIPE, text=True, env=plan_env())
  lines = []
  for line in child.stdout:
    print(line, end="", flush=True)
    lines.append(line)
  if child.wait():
    raise SystemExit(f"python -m optax_kahan.plan failed ({child.returncode})")
  return "".join(lines)


def save_cards(argv: list[str], output: str, tag: str = "",
               peak_rss: Optional[int] = None) -> None:
  """``--cards``' results: the command, the date and versions, the command
  process's peak resident memory (bytes) and ``MALLOC_ARENA_MAX``, its
  output."""
  command = "python -m optax_kahan.plan " + " ".join(argv)
  date = datetime.date.today().isoformat()
  python = sys.version.split()[0]
  arenas = plan_env()["MALLOC_ARENA_MAX"]
  memory = "" if peak_rss is None else (
      f"; the command's process peaked at {peak_rss / 1e9:.2f} GB resident "
      f"(MALLOC_ARENA_MAX={arenas})")
  report.save(
      "streaming_cards" + (f"_{tag}" if tag else ""),
      f"`{command}` ({date}, Python {python}, jax {jax.__version__}"
      f"{memory}); its output, each compile as it finished, then the layout "
      "per card and host budget:\n\n" + output,
      {"command": command, "date": date, "python": python,
       "jax": jax.__version__, "peak_rss_bytes": peak_rss,
       "malloc_arena_max": arenas, "output": output})


def rows_for(cfg, target: str, quick: bool, spare: bool = True
             ) -> dict[str, dict]:
  counts = (cfg.double_blocks, cfg.single_blocks)
  rows = {}
  for batch in (1,) if quick else (1, 2):
    rows[f"residuals on the device, batch {batch}"] = compile_row(
        cfg, target, batch, False, None)
    rows[f"residuals in host memory, one buffer per leaf, batch {batch}"] = (
        compile_row(cfg, target, batch, True, None))
    rows[f"residuals in host memory, spare buffers, batch {batch}"] = (
        compile_row(cfg, target, batch, True, (0, 0)))
  layout = "spare buffers" if spare else "one buffer per leaf"
  if quick:
    rows["residuals in host memory but the first double-stream block's, "
         "batch 1"] = compile_row(cfg, target, 1, True, (0, 0), kept=(1, 0))
    rows[f"1 + 2 blocks streamed, {layout}, batch 1"] = compile_row(
        cfg, target, 1, True, (1, 2), spare)
    rows[f"1 + 2 blocks streamed, {layout}, activations in host memory, "
         "batch 1"] = compile_row(cfg, target, 1, True, (1, 2), spare,
                                  activations=True)
  else:
    rows["residuals in host memory, spare buffers, XLA's default options, "
         "batch 1"] = compile_row(cfg, target, 1, True, (0, 0), options=False)
    d, s, row = fewest_streamed(cfg, target, 24e9, spare)
    rows[f"{d} + {s} blocks streamed (fewest under 24 GB), {layout}, "
         "batch 1"] = row
    rows[f"all {sum(counts)} blocks streamed, {layout}, batch 1"] = (
        compile_row(cfg, target, 1, True, counts, spare))
  for row in rows.values():
    ref = rows[f"residuals on the device, batch {row['batch']}"]
    row["ratio"] = row["step_s"] / ref["step_s"]
  return rows


def activation_rows(cfg, target: str, batches=(2, 4)) -> dict[str, dict]:
  """Every block streamed at each batch, the blocks' saved inputs on the
  device and in host memory, against the residuals-on-device step."""
  counts = (cfg.double_blocks, cfg.single_blocks)
  rows = {}
  for batch in batches:
    ref = rows[f"residuals on the device, batch {batch}"] = compile_row(
        cfg, target, batch, False, None)
    for act, where in ((False, "on the device"), (True, "in host memory")):
      rows[f"all {sum(counts)} blocks streamed, activations {where}, batch "
           f"{batch}"] = compile_row(cfg, target, batch, True, counts,
                                     activations=act)
    for row in list(rows.values())[-3:]:
      row["ratio"] = row["step_s"] / ref["step_s"]
  return rows


def kept_rows(cfg, target: str) -> dict[str, dict]:
  """The residuals in host memory but for the first k double-stream
  blocks' (``stream_blocks(..., (0, 0), residuals_on_device=(k, 0))``), at
  batch 1 and 2, against the residuals-on-device step."""
  rows = {}
  for batch in (1, 2):
    ref = rows[f"residuals on the device, batch {batch}"] = compile_row(
        cfg, target, batch, False, None)
    ref["ratio"] = 1.0
    for k in (0, 5, 10):
      row = compile_row(cfg, target, batch, True, (0, 0), kept=(k, 0))
      row["ratio"] = row["step_s"] / ref["step_s"]
      but = f" but the first {k} double-stream blocks'" if k else ""
      rows[f"residuals in host memory{but}, batch {batch}"] = row
  return rows


def interleave_rows(cfg, target: str, quick: bool) -> dict[str, dict]:
  """One buffer per leaf against ``stream_blocks(..., interleave=True)``
  (the same host bytes, dealt three ways), activations in host memory, at
  the layout ``plan`` found for a 16 GiB card within 64 GB (batch 4,
  residuals of the 4 double-stream blocks not streamed on the device) and
  at batch 8, every block streamed or all but one; each beside the
  residuals-on-device step at its batch."""
  layouts = ([(2, (2, 4), None)] if quick else
             [(4, (15, 38), (4, 0)), (8, (19, 38), None),
              (8, (18, 38), None)])
  rows = {}
  for batch, streamed, kept in layouts:
    name = f"residuals on the device, batch {batch}"
    if name not in rows:
      rows[name] = compile_row(cfg, target, batch, False, None)
      rows[name]["ratio"] = 1.0
    ref = rows[name]
    where = (f", the first {kept[0]} double-stream blocks' residuals on the "
             "device" if kept else "")
    for interleave in (False, True):
      row = compile_row(cfg, target, batch, True, streamed, spare=False,
                        activations=True, kept=kept, interleave=interleave)
      row["ratio"] = row["step_s"] / ref["step_s"]
      how = ("interleaved (three host arrays per leaf)" if interleave
             else "one buffer per leaf")
      rows[f"`{streamed}` streamed, {how}, activations in host memory"
           f"{where}, batch {batch}"] = row
  return rows


def to_markdown(r: dict) -> str:
  lines = [
      f"Compiled for {r['target_name']}, not run ({r['date']}, jax "
      f"{r['jax']}): {r['model']}, `{OPTIMIZER}`, blockwise step. Device "
      "peak = arguments + outputs - aliased + temporaries (GB = 1e9 bytes); "
      "margin to a card of 24 GiB / 12 GiB after 0.5 GB of CUDA context. "
      "Modeled time: `benchmarks.timeline` on the compiled schedule, gemms "
      f"at {timeline.GEMM_FLOPS / 1e12:.0f} TFLOP/s, PCIe "
      f"{timeline.PCIE / 1e9:.0f} GB/s per direction, other kernels free "
      "(an estimate); ratio to the residuals-on-device step at the same "
      "batch; hidden: the share of each direction's PCIe time that runs "
      "beside compute; loop floor: each loop iteration at the longest of its "
      "gemms and its bytes each way (`Timeline.loop_floor_s`, what any "
      "schedule of these loops reaches), over the same reference. Compiled "
      "with `ok.blockwise.STREAMING_COMPILER_OPTIONS` "
      f"(`{r['compiler_options']}`) unless the row says otherwise; host GB: "
      "the step's arguments and temporaries in host memory (with spare "
      f"buffers, both buffers). XLA_FLAGS: `{r.get('xla_flags') or '(none)'}`.", "",
      "| setup | device peak GB | margin 24 GiB | margin 12 GiB | host GB | "
      "modeled ms | ratio | loop floor | H2D GB (hidden) | D2H GB (hidden) |",
      "|---|---|---|---|---|---|---|---|---|---|"]
  for name, v in r["rows"].items():
    margin = lambda gib: (gib * 2**30 - CONTEXT - v["peak_bytes"]) / 1e9
    lines.append(
        f"| {name} | {v['peak_bytes'] / 1e9:.2f} | {margin(24):+.2f} | "
        f"{margin(12):+.2f} | {host_bytes(v) / 1e9:.2f} | "
        f"{v['step_s'] * 1e3:.0f} | {v['ratio']:.2f}x | "
        f"{v['ratio'] * v['loop_floor_s'] / v['step_s']:.2f}x | "
        f"{v['h2d_bytes'] / 1e9:.1f} ({hidden_share(v['h2d_hidden'])}) | "
        f"{v['d2h_bytes'] / 1e9:.1f} ({hidden_share(v['d2h_hidden'])}) |")
  return "\n".join(lines) + "\n"


def main(argv=None) -> dict:
  parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
  parser.add_argument("--quick", action="store_true",
                      help="2 + 4 blocks of width 256, batch 1, no search")
  parser.add_argument("--target", default="h200",
                      choices=sorted(gpu_compile.TARGETS))
  parser.add_argument("--one-buffer", action="store_true",
                      help="the searched and all-streamed rows (and --fit) "
                      "with stream_blocks(..., spare_buffers=False)")
  parser.add_argument("--tag", default="",
                      help="a suffix for the results' names (a run under "
                      "other XLA_FLAGS)")
  parser.add_argument("--fit", type=float, metavar="GB",
                      help="only the fewest streamed blocks whose peak is at "
                      "most GB (1e9 bytes), to results/streaming_fit<GB>")
  parser.add_argument("--cards", action="store_true",
                      help="python -m optax_kahan.plan for FLUX.1-dev at "
                      "each --card and --max-host, to "
                      "results/streaming_cards")
  parser.add_argument("--batch", type=int, action="append",
                      help="with --cards or --activations: this batch "
                      "only (repeat for more; default 1 and 4, and 2 and "
                      "4)")
  parser.add_argument("--card", type=float, action="append", metavar="GIB",
                      help="with --cards: a card's memory (repeat; default "
                      f"{CARDS})")
  parser.add_argument("--max-host", action="append", metavar="GB",
                      help="with --cards: the most host memory, GB, or none "
                      "(repeat; default 64 and none)")
  parser.add_argument("--activations", action="store_true",
                      help="every block streamed at batch 2 and 4 (or "
                      "--batch), the "
                      "saved activations on the device and in host memory, "
                      "to results/streaming_activations")
  parser.add_argument("--residuals-on-device", action="store_true",
                      help="the residuals in host memory but the first 0, "
                      "5 or 10 double-stream blocks', batch 1 and 2, to "
                      "results/streaming_residuals_on_device")
  parser.add_argument("--interleave", action="store_true",
                      help="one buffer per leaf against interleave=True at "
                      "batch 4 (15 + 38 streamed) and 8 (19 or 18 + 38), to "
                      "results/streaming_interleave; with --cards: the "
                      "search also tries interleaved host arrays")
  parser.add_argument("--device-residuals", action="store_true",
                      help="with --fit: kahan(..., offload=False), the "
                      "blocks not streamed keep their residuals on the "
                      "device")
  args = parser.parse_args(argv)
  cfg = flux.FluxConfig.dev()
  if args.quick:  # compiles in seconds: for CI
    cfg = dataclasses.replace(cfg, hidden=256, heads=2, double_blocks=2,
                              single_blocks=4, context_dim=256, vec_dim=64)
  cfg = dataclasses.replace(cfg, heads_per_chunk=2)
  if args.cards:  # the command's search, as users run it
    if args.quick or args.one_buffer:
      parser.error("--cards runs python -m optax_kahan.plan, which tries "
                   "both buffer layouts on FLUX.1-dev: no --quick or "
                   "--one-buffer")
    argv = plan_argv(args.card or list(CARDS),
                     args.max_host or ["64", "none"],
                     args.batch or [1, 4], args.target, args.interleave)
    output = run_plan(argv)
    # the child's (Linux: KiB)
    peak = resource.getrusage(resource.RUSAGE_CHILDREN).ru_maxrss * 1024
    save_cards(argv, output, args.tag, peak)
    return {}
  if args.activations:
    rows = activation_rows(cfg, args.target, tuple(args.batch or (2, 4)))
  elif args.residuals_on_device:
    rows = kept_rows(cfg, args.target)
  elif args.interleave:
    rows = interleave_rows(cfg, args.target, args.quick)
  elif args.fit:
    d, s, row = fewest_streamed(cfg, args.target, args.fit * 1e9,
                                not args.one_buffer,
                                not args.device_residuals)
    ref = compile_row(cfg, args.target, 1, False, None)
    where = (", the others' residuals on the device"
             if args.device_residuals else "")
    rows = {"residuals on the device, batch 1": {**ref, "ratio": 1.0},
            f"{d} + {s} blocks streamed (fewest under {args.fit:g} GB)"
            f"{where}, batch 1": {**row,
                                  "ratio": row["step_s"] / ref["step_s"]}}
  else:
    rows = rows_for(cfg, args.target, args.quick, not args.one_buffer)
  n = flux.num_params(flux.abstract_params(cfg))
  r = {"target": args.target,
       "target_name": gpu_compile.gpu_mesh(args.target).devices.flat[0]
       .device_kind,
       "date": datetime.date.today().isoformat(), "jax": jax.__version__,
       "model": (f"FLUX-shaped MMDiT, {cfg.double_blocks} + "
                 f"{cfg.single_blocks} blocks of width {cfg.hidden} "
                 f"({n / 1e9:.2f}B params), 4096 + 512 tokens, block remat"),
       "rows": rows}
  r["xla_flags"] = os.environ.get("XLA_FLAGS", "")
  r["compiler_options"] = ok.blockwise.STREAMING_COMPILER_OPTIONS
  name = ("streaming_activations" if args.activations else
          "streaming_residuals_on_device" if args.residuals_on_device else
          "streaming_interleave" if args.interleave else
          f"streaming_fit{args.fit:g}" if args.fit else "streaming")
  report.save(name + (f"_{args.tag}" if args.tag else ""), to_markdown(r),
              r, args.quick)
  return r


if __name__ == "__main__":
  main()

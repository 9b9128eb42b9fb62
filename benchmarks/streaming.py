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
blocks not streamed keep their residuals on the device. ``--cards``: for
each card (12 to 80 GiB), the setup and batch (1, 2, 4) with the lowest
modeled time per sample that leaves 0.5 GB beside the peak and the CUDA
context, with the step's floor (its matrix multiplies, or its PCIe bytes in
either direction, whichever is longer), to ``results/streaming_cards``.
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
import time
from typing import Any, Optional

import jax
import jax.numpy as jnp
from flax import nnx

import optax_kahan as ok
from optax_kahan import flux
from optax_kahan import plan as ok_plan
from benchmarks import blockwise as blockwise_bench
from benchmarks import gpu_compile
from benchmarks import report
from benchmarks import timeline

CONTEXT = 0.5e9  # CUDA context and cuDNN/cuBLAS workspaces, about
MARGIN = 0.5e9  # left free on a card beside the peak and the context
CARDS = (12, 16, 24, 32, 48, 80)  # GiB
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
  model = ok.blockwise.BlockwiseModel(*flux.flux_blockwise(nnx.eval_shape(
      lambda: flux.Flux(cfg, rngs=nnx.Rngs(0))))[0])
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


def card_rows(cfg, target: str, batches=(1, 2, 4), cards=CARDS,
              activation_batches=(4,), spare: bool = True,
              max_host: float = math.inf) -> dict[str, dict]:
  """For each card (GiB), the setup and batch with the lowest modeled time
  per sample whose peak leaves ``MARGIN`` after the CUDA context and whose
  host memory is at most ``max_host`` bytes: residuals on the device,
  residuals alone in host memory, or the fewest streamed blocks that fit,
  at each batch; at ``activation_batches`` also each of these with the
  blocks' saved inputs in host memory. ``spare``: spare buffers (else one
  buffer per host leaf)."""
  layout = "spare buffers" if spare else "one buffer per leaf"
  ok_for = lambda r, gib: fits(r, gib) and host_bytes(r) <= max_host
  candidates = []
  for batch, act in [(b, False) for b in batches] + [
      (b, True) for b in activation_batches if b in batches]:
    also = (", activations in host memory" if act else "") + (
        "" if spare else f", {layout}")
    candidates += [
        (f"residuals on the device (`offload=False`){also}",
         compile_row(cfg, target, batch, False, None, activations=act)),
        (f"residuals in host memory, {layout} (`(0, 0)`){also}",
         compile_row(cfg, target, batch, True, (0, 0), spare,
                     activations=act))]
    plain, found, lo = candidates[-2:], {0: candidates[-1][1]}, 0
    for gib in sorted(cards, reverse=True):  # fewer blocks for larger cards
      if any(ok_for(r, gib) for _, r in plain):
        continue
      d, s, row = fewest_streamed(cfg, target, usable_bytes(gib), spare,
                                  batch=batch, lo=lo, found=found,
                                  activations=act)
      lo = d + s
      candidates.append((f"`({d}, {s})` blocks streamed{also}", row))
  best = {}
  for gib in cards:
    fitting = [(r["step_s"] / r["batch"], name, r) for name, r in candidates
               if ok_for(r, gib)]
    if fitting:
      _, name, r = min(fitting, key=lambda x: x[0])
      best[f"{gib} GiB"] = {**r, "setup": name, "card_gib": gib}
  on_device = {r["batch"]: r for _, r in candidates
               if not r["offload"] and not r.get("activations")}
  if 1 not in on_device:  # the reference of every row's ratio
    on_device[1] = compile_row(cfg, target, 1, False, None)
  for row in best.values():
    row["ratio"] = (row["step_s"] / row["batch"]) / on_device[1]["step_s"]
    row["same_batch_ratio"] = row["step_s"] / on_device[row["batch"]]["step_s"]
    row["floor_s"] = floor_s(row)
  return best


def usable_bytes(gib: int) -> float:
  """The largest peak a card of ``gib`` GiB takes with the margin."""
  return gib * 2**30 - CONTEXT - MARGIN


def host_bytes(row: dict) -> float:
  """The step's arguments and temporaries in host memory."""
  return row["host_bytes"] + row.get("host_temp_bytes", 0)


def fits(row: dict, gib: int) -> bool:
  return row["peak_bytes"] <= usable_bytes(gib)


def floor_s(row: dict) -> float:
  """The step's physical floor: its matrix multiplies at the modeled rate,
  or its bytes over PCIe in either direction, whichever takes longest."""
  return max(row["gemm_s"], row["h2d_bytes"] / timeline.PCIE,
             row["d2h_bytes"] / timeline.PCIE)


def cards_markdown(r: dict) -> str:
  lines = [
      f"Compiled for {r['target_name']}, not run ({r['date']}, jax "
      f"{r['jax']}): {r['model']}, `{OPTIMIZER}`, blockwise step. For each "
      "card, the setup and batch with the lowest modeled time per sample "
      f"whose device peak leaves {MARGIN / 1e9:.1f} GB after "
      f"{CONTEXT / 1e9:.1f} GB of CUDA context"
      + (f" and whose host memory is at most {r['max_host_gb']:g} GB"
         if r.get("max_host_gb") else "")
      + f" (batches {r['batches']}). "
      "Modeled: `benchmarks.timeline` on the compiled schedule (gemms at "
      f"{timeline.GEMM_FLOPS / 1e12:.0f} TFLOP/s, PCIe "
      f"{timeline.PCIE / 1e9:.0f} GB/s per direction, other kernels free; an "
      "estimate); per sample: the step over the batch; ratio: to the "
      "residuals-on-device step at batch 1, per sample; same batch: to the "
      "residuals-on-device step at the row's batch; host: its arguments "
      "and temporaries in host memory; floor: the longest of the matrix "
      "multiplies and each PCIe direction's bytes; loop floor: each loop "
      "iteration at the longest of its gemms and its bytes each way "
      "(`Timeline.loop_floor_s`), over the same batch's reference.", "",
      "| card | setup | batch | device peak GB | margin GB | host GB | "
      "modeled ms per sample | ratio | same batch | floor ms per sample | "
      "modeled / floor | loop floor |",
      "|---|---|---|---|---|---|---|---|---|---|---|---|"]
  for card, v in r["rows"].items():
    margin = v["card_gib"] * 2**30 - CONTEXT - v["peak_bytes"]
    lines.append(
        f"| {card} | {v['setup']} | {v['batch']} | "
        f"{v['peak_bytes'] / 1e9:.2f} | {margin / 1e9:.2f} | "
        f"{host_bytes(v) / 1e9:.1f} | "
        f"{v['step_s'] / v['batch'] * 1e3:.0f} | {v['ratio']:.2f}x | "
        f"{v['same_batch_ratio']:.2f}x | "
        f"{v['floor_s'] / v['batch'] * 1e3:.0f} | "
        f"{v['step_s'] / v['floor_s']:.2f}x | "
        f"{v['same_batch_ratio'] * v['loop_floor_s'] / v['step_s']:.2f}x |")
  return "\n".join(lines) + "\n"


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
  the layouts ``plan`` and ``--cards`` found for a 16 GiB card within 64 GB
  (batch 4, residuals of the 4 double-stream blocks not streamed on the
  device) and at batch 8, every block streamed or all but one; each beside
  the residuals-on-device step at its batch."""
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
    hidden = lambda x: "-" if x != x else f"{100 * x:.0f}%"
    lines.append(
        f"| {name} | {v['peak_bytes'] / 1e9:.2f} | {margin(24):+.2f} | "
        f"{margin(12):+.2f} | {host_bytes(v) / 1e9:.2f} | "
        f"{v['step_s'] * 1e3:.0f} | {v['ratio']:.2f}x | "
        f"{v['ratio'] * v['loop_floor_s'] / v['step_s']:.2f}x | "
        f"{v['h2d_bytes'] / 1e9:.1f} ({hidden(v['h2d_hidden'])}) | "
        f"{v['d2h_bytes'] / 1e9:.1f} ({hidden(v['d2h_hidden'])}) |")
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
                      help="for each card, the setup and batch (1, 2, 4) "
                      "with the lowest modeled time per sample, to "
                      "results/streaming_cards")
  parser.add_argument("--batch", type=int, action="append",
                      help="with --cards or --activations: this batch "
                      "only (repeat for more; default 1, 2 and 4, and 2 "
                      "and 4)")
  parser.add_argument("--card", type=int, action="append", metavar="GIB",
                      help="with --cards: this card only (repeat for more; "
                      f"default {CARDS})")
  parser.add_argument("--max-host", type=float, metavar="GB",
                      default=math.inf,
                      help="with --cards: only setups whose host memory is "
                      "at most GB (1e9 bytes)")
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
                      "results/streaming_interleave")
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
  batches = (1, 2) if args.quick else tuple(args.batch or (1, 2, 4))
  if args.cards:
    rows = card_rows(cfg, args.target, batches, tuple(args.card or CARDS),
                     tuple(b for b in batches if b >= 4),
                     spare=not args.one_buffer, max_host=args.max_host * 1e9)
  elif args.activations:
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
  name = ("streaming_cards" if args.cards else
          "streaming_activations" if args.activations else
          "streaming_residuals_on_device" if args.residuals_on_device else
          "streaming_interleave" if args.interleave else
          f"streaming_fit{args.fit:g}" if args.fit else "streaming")
  r["batches"] = list(batches) if args.cards else None
  r["max_host_gb"] = (args.max_host if args.cards and math.isfinite(
      args.max_host) else None)
  report.save(name + (f"_{args.tag}" if args.tag else ""),
              cards_markdown(r) if args.cards else to_markdown(r), r,
              args.quick)
  return r


if __name__ == "__main__":
  main()

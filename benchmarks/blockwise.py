"""FLUX.1-dev's full training step, ordinary and blockwise, compiled for the CPU and an H200.

    pip install -e ".[gpu-aot]"      # jax's CUDA plugin: XLA's GPU compiler
    python -m benchmarks.blockwise [--target h200] [--quick]
    python -m benchmarks.blockwise --quick --check \
        --optimizers "kahan(prodigy_factored(state_dtype=bf16))"   # CI

Nothing runs: each step is compiled from abstract arguments (no weights are
allocated) for the CPU and, deviceless, for an H200 (``benchmarks.gpu_compile``
describes the target). The model is ``benchmarks.flux_model`` at FLUX.1-dev's
real dimensions (11.9B params; 19 double- and 38 single-stream blocks of
width 3072), batch 1 at 1024x1024 (4096 image tokens, 512 text tokens), each
block rematerialized, attention two heads at a time.

Steps:

* ordinary: ``jax.value_and_grad(blockwise_loss)`` (a ``lax.scan`` per stack,
  ``jax.checkpoint`` per block), ``tx.update`` on the whole tree,
  ``optax.apply_updates``;
* blockwise: ``optax_kahan.blockwise.blockwise_step``, each block's update inside the
  backward loop.

Optimizers: ``optax.adamw`` on float32 master weights (the forward pass casts
them to bf16), ``optax.adamw`` on bf16 weights, ``kahan(optax.adamw)``,
``kahan(prodigy_factored())`` (residuals in host memory) and the same with ``state_dtype=jnp.bfloat16``;
blockwise Prodigy uses ``lagged_d=True``. Params and state are donated.

Read from each compiled program: the device peak (arguments + outputs -
aliased + temporaries, ``memory_analysis()``) on the CPU and on the H200, and,
for the H200, the gradients alive at the peak, from XLA's buffer assignment
(dumped with ``--xla_dump_to``): the temporaries' live ranges give the
heap's peak, and the live values there whose dtype is the gradients' and
whose shape is a stack leaf's (whole stacks' gradients) or one block's
leaf's (an upper bound on one block's gradients; its sliced and updated
weights have the same shapes) are reported, next to one block's weights.
``--quick`` compiles a 4 + 4 block model of width 256 with 512 + 64 tokens.

Writes ``benchmarks/results/blockwise{,_quick}.{md,json}``.
"""

from __future__ import annotations

import os

if __name__ == "__main__":  # before jax is imported: no CUDA driver is touched
  os.environ["JAX_PLATFORMS"] = "cpu"

import argparse
import dataclasses
import datetime
import glob
import math
import re
import shutil
import tempfile
import time
from typing import Any, Callable

import jax
import jax.numpy as jnp
import optax

import optax_kahan as ok
from optax_kahan import flux
from benchmarks import gpu_compile
from benchmarks import report
from optax_kahan import blockwise as bw

DUMP = os.path.join(tempfile.gettempdir(), "optax_kahan_blockwise_dump")


def _dump_flags() -> None:
  """Asks XLA for its buffer assignment of each step (read by ``peak``)."""
  flags = os.environ.get("XLA_FLAGS", "")
  if "--xla_dump_to" not in flags:
    os.environ["XLA_FLAGS"] = (
        f"{flags} --xla_dump_to={DUMP} --xla_dump_hlo_as_text "
        "--xla_dump_hlo_module_re=jit_(ordinary|blockwise)").strip()


def optimizers() -> dict[str, tuple[Callable[[bool], Any], bool]]:
  """name -> (make(blockwise), master weights)."""
  pf = lambda blockwise, **kw: ok.kahan(ok.prodigy_factored(
      lagged_d=blockwise, **kw))
  return {
      "optax.adamw, float32 master": (lambda b: optax.adamw(1e-5), True),
      "optax.adamw, bf16": (lambda b: optax.adamw(1e-5), False),
      "kahan(optax.adamw)": (lambda b: ok.kahan(optax.adamw(1e-5)), False),
      "kahan(prodigy_factored())": (pf, False),
      "kahan(prodigy_factored(state_dtype=bf16))": (
          lambda b: pf(b, state_dtype=jnp.bfloat16), False),
  }


def _bf16_forward(model: bw.BlockwiseModel) -> bw.BlockwiseModel:
  """The model on float32 master weights: each part casts them to bf16."""
  cast = lambda fn: (lambda p, *a: fn(flux.to_dtype(p, jnp.bfloat16),
                                      *a))
  return model._replace(embed=cast(model.embed),
                        blocks=tuple(cast(b) for b in model.blocks),
                        head=cast(model.head))


def _state(tx, params, blockwise: bool, device, host) -> Any:
  """The abstract state; kahan's residuals in host memory."""
  init = (lambda p: bw.blockwise_init(tx, p)) if blockwise else tx.init
  abstract = jax.tree.map(
      lambda x: jax.ShapeDtypeStruct(x.shape, x.dtype, sharding=device),
      jax.eval_shape(init, params))

  def place(group):
    try:
      residuals = ok.kahan_residuals(group)
    except ValueError:  # no kahan
      return group
    return ok.kahan_replace_residuals(group, jax.tree.map(
        lambda r: jax.ShapeDtypeStruct(r.shape, r.dtype, sharding=host),
        residuals))

  if blockwise:
    return bw.BlockwiseState(place(abstract.embed),
                             tuple(place(s) for s in abstract.stacks),
                             place(abstract.head))
  return place(abstract)


def _steps(model, tx):
  def ordinary(params, state, batch):
    loss, grads = jax.value_and_grad(bw.blockwise_loss, argnums=1)(
        model, params, batch)
    updates, state = tx.update(grads, state, params)
    return loss, optax.apply_updates(params, updates), state

  def blockwise(params, state, batch):
    return bw.blockwise_step(model, tx, params, state, batch)

  return {"ordinary": ordinary, "blockwise": blockwise}


# -- XLA's buffer assignment -------------------------------------------------
_VALUE = re.compile(
    r"^ value: <\d+ (\S+) @\d+> \(size=(\d+),offset=(\d+)\): (\w+)\[([\d,]*)\]")
_RANGE = re.compile(r"^\s+(\S+):(\d+)-(\d+)$")


def _dims(shape: tuple[int, ...]) -> tuple[int, ...]:
  """The shape with its leading 1s dropped."""
  dims = tuple(shape)
  while dims and dims[0] == 1:
    dims = dims[1:]
  return dims


def peak(dump: str, stack_shapes: set[tuple[int, ...]],
         block_shapes: set[tuple[int, ...]], grad_dtype: str
         ) -> dict[str, Any]:
  """The temporaries at the heap's peak, from XLA's buffer assignment.

  Args:
    dump: the step's ``*gpu_after_optimizations-buffer-assignment.txt``; its
      ``-live-range.txt`` sibling gives each value's live range in the
      (flattened) schedule.
    stack_shapes: shapes of the stacks' leaves (with the block axis).
    block_shapes: shapes of one block's leaves, with their leading 1s
      dropped.
    grad_dtype: the gradients' HLO dtype (``bf16``, ``f32``).

  Returns:
    ``temp_peak_bytes``, the temporaries' address ranges in use at the peak;
    of those, ``stack_shaped_bytes``, the ones holding a value of
    ``grad_dtype`` in a stack leaf's shape (the weights and the state are
    arguments, not temporaries: these are whole stacks' gradients), and
    ``block_shaped_bytes``, in a block's leaf shape: that block's gradients,
    but also its weights sliced out of the stack and its updated weights, so
    an upper bound on the gradients.
  """
  values, temp = [], False
  with open(dump) as f:
    for line in f:
      if line.startswith("allocation "):
        temp = "preallocated-temp" in line
      elif temp:
        m = _VALUE.match(line)
        if m:
          name, size, offset, dtype, shape = m.groups()
          if "{" not in name:  # the live ranges name it with its index
            name += "{}"
          values.append((name, int(size), int(offset), dtype,
                         _dims(int(d) for d in shape.split(",") if d)))
  ranges = {}
  with open(dump.replace("buffer-assignment.txt", "live-range.txt")) as f:
    for line in f:
      m = _RANGE.match(line)
      if m:
        ranges[m.group(1)] = (int(m.group(2)), int(m.group(3)))
  live = [(v, ranges[v[0]]) for v in values if v[0] in ranges]

  def in_use(vals):
    spans = sorted((o, o + s) for _, s, o, _, _ in vals)
    total, end = 0, -1
    for lo, hi in spans:
      if hi > end:
        total += hi - max(lo, end)
        end = hi
    return total

  best, best_t = -1, 0
  for t in sorted({t for _, (t, _) in live}):
    used = in_use([v for v, (a, b) in live if a <= t <= b])
    if used > best:
      best, best_t = used, t
  here = [v for v, (a, b) in live if a <= best_t <= b and v[3] == grad_dtype]
  return {"temp_peak_bytes": best,
          "stack_shaped_bytes": in_use([v for v in here
                                        if v[4] in stack_shapes]),
          "block_shaped_bytes": in_use([v for v in here
                                        if v[4] in block_shapes])}


def compile_row(name: str, step: str, cfg, target: str,
                tokens: tuple[int, int]) -> dict[str, Any]:
  make, master = optimizers()[name]
  blockwise = step == "blockwise"
  tx = make(blockwise)
  dtype = jnp.float32 if master else jnp.bfloat16
  model = flux.abstract_model(cfg)
  if master:
    model = _bf16_forward(model)
  abstract = flux.abstract_params(cfg, dtype)
  n = flux.num_params(abstract)
  block = max(flux.num_params(s) // bw.num_blocks(s)
              for s in abstract.stacks)
  stack_shapes = {_dims(x.shape) for x in jax.tree.leaves(abstract.stacks)}
  block_shapes = {_dims(x.shape[1:]) for x in jax.tree.leaves(abstract.stacks)}
  fn = _steps(model, tx)[step]
  leaf = max(math.prod(x.shape[1:]) for x in jax.tree.leaves(abstract.stacks))
  row = {"params": n, "largest_block_params": block,
         "largest_block_leaf_params": leaf}
  for where in ("cpu", target):
    mesh = (jax.sharding.Mesh(jax.devices("cpu")[:1], ("x",))
            if where == "cpu" else gpu_compile.gpu_mesh(target))
    device = jax.NamedSharding(mesh.abstract_mesh, jax.P())
    host = jax.NamedSharding(mesh.abstract_mesh, jax.P(),
                             memory_kind="pinned_host")
    sds = lambda x: jax.ShapeDtypeStruct(x.shape, x.dtype, sharding=device)
    params = jax.tree.map(sds, abstract)
    batch = jax.tree.map(sds, flux.batch_spec(cfg, 1, *tokens))
    state = _state(tx, params, blockwise, device, host)
    shutil.rmtree(DUMP, ignore_errors=True)
    t0 = time.perf_counter()
    compiled = gpu_compile.compile_step(fn, (params, state, batch), mesh)
    m = compiled.memory_analysis()
    peak_bytes = (m.argument_size_in_bytes + m.output_size_in_bytes
                  - m.alias_size_in_bytes + m.temp_size_in_bytes)
    row[where] = {"peak_bytes": peak_bytes, "peak_B_per_param": peak_bytes / n,
                  "args_bytes": m.argument_size_in_bytes,
                  "temp_bytes": m.temp_size_in_bytes,
                  "host_bytes": m.host_argument_size_in_bytes,
                  "compile_s": time.perf_counter() - t0}
    if where != "cpu":
      dumps = glob.glob(os.path.join(
          DUMP, "*gpu_after_optimizations-buffer-assignment.txt"))
      if dumps:
        row[where].update(peak(dumps[0], stack_shapes, block_shapes,
                               "f32" if master else "bf16"))
    print(f"  {step} {name} {where}: {peak_bytes / 1e9:.2f} GB "
          f"({row[where]['compile_s']:.0f} s)", flush=True)
  return row


def to_markdown(r: dict) -> str:
  t = r["target"]
  lines = [
      f"Compiled, not run ({r['date']}, jax {r['jax']}): {r['model']}. "
      f"Device peak = arguments + outputs - aliased + temporaries; GB = "
      f"1e9 bytes. Gradients at the peak: from the {r['target_name']} "
      "program's buffer assignment: the temporaries live at the heap's peak "
      "that hold a value of the gradients' dtype in a stack leaf's shape "
      "(whole stacks' gradients) or in one block's leaf shape (that block's "
      "gradients, its weights sliced from the stack, its updated weights: an "
      "upper bound on its gradients).", "",
      f"| step | optimizer | CPU peak GB | CPU temporaries GB | {t} peak GB | "
      f"{t} B/param | "
      f"{t} temporaries GB | stack-shaped at the peak GB | block-shaped at "
      "the peak GB | host GB |",
      "|---|---|---|---|---|---|---|---|---|---|"]
  for key, row in r["rows"].items():
    step, name = key.split(" | ")
    g = row[t]
    lines.append(
        f"| {step} | {name} | {row['cpu']['peak_bytes'] / 1e9:.2f} | "
        f"{row['cpu']['temp_bytes'] / 1e9:.2f} | "
        f"{g['peak_bytes'] / 1e9:.2f} | {g['peak_B_per_param']:.2f} | "
        f"{g['temp_bytes'] / 1e9:.2f} | "
        f"{g.get('stack_shaped_bytes', float('nan')) / 1e9:.2f} | "
        f"{g.get('block_shaped_bytes', float('nan')) / 1e9:.2f} | "
        f"{g['host_bytes'] / 1e9:.2f} |")
  one = 2 * next(iter(r["rows"].values()))["largest_block_params"]
  lines += ["", f"One double-stream block's bf16 weights (so its bf16 "
            f"gradients): {one / 1e9:.2f} GB."]
  return "\n".join(lines) + "\n"


def check(r: dict) -> list[str]:
  """What the README promises of each blockwise row, against its ordinary
  twin: no whole stack's gradients alive at the peak, at most two blocks'
  worth of block-shaped values (one block's gradients and its sliced
  weights; four with float32 master weights, whose moments count too) and
  one leaf's (the update in flight: ``kahan`` updates the block leaf by
  leaf), and lower device temporaries and peak; on the CPU program, no
  more temporaries than the ordinary step."""
  t, failures = r["target"], []
  for key, row in r["rows"].items():
    step, name = key.split(" | ")
    if step != "blockwise":
      continue
    g, o = row[t], r["rows"][f"ordinary | {name}"][t]
    itemsize = 4 if "float32" in name else 2
    block = row["largest_block_params"] * itemsize
    leaf = row.get("largest_block_leaf_params", 0) * itemsize
    # With float32 master weights the block's Adam moments, sliced from
    # their stacks, also have the gradients' dtype and shapes.
    worth = 4 if "float32" in name else 2
    if g.get("stack_shaped_bytes", 1) != 0:
      failures.append(f"{name}: {g.get('stack_shaped_bytes')} bytes of "
                      "whole-stack values at the peak")
    if g.get("block_shaped_bytes", 1e30) > worth * block + leaf:
      failures.append(f"{name}: {g.get('block_shaped_bytes')} bytes of "
                      f"block-shaped values at the peak, over {worth} x "
                      f"{block} + {leaf}")
    if o.get("stack_shaped_bytes", 0) < 0.5 * (row["params"] * itemsize):
      failures.append(f"{name}: the ordinary step holds only "
                      f"{o.get('stack_shaped_bytes')} bytes of stacks' "
                      "gradients: the reading is off")
    for where in (t, "cpu"):
      if row[where]["temp_bytes"] > r["rows"][f"ordinary | {name}"][where][
          "temp_bytes"]:
        failures.append(f"{name}: blockwise temporaries on {where} over the "
                        "ordinary step's")
    if g["peak_bytes"] >= o["peak_bytes"]:
      failures.append(f"{name}: blockwise peak {g['peak_bytes']} >= "
                      f"ordinary {o['peak_bytes']}")
  return failures


def main(argv=None) -> dict:
  parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
  parser.add_argument("--quick", action="store_true",
                      help="4 + 4 blocks of width 256, 512 + 64 tokens")
  parser.add_argument("--target", default="h200",
                      choices=sorted(gpu_compile.TARGETS))
  parser.add_argument("--optimizers", nargs="+", default=list(optimizers()),
                      choices=list(optimizers()), metavar="NAME",
                      help=f"a subset of {list(optimizers())}")
  parser.add_argument("--check", action="store_true",
                      help="exit 1 if a blockwise row breaks a promise")
  args = parser.parse_args(argv)
  _dump_flags()
  cfg = flux.FluxConfig.dev()
  if args.quick:
    cfg = dataclasses.replace(cfg, hidden=256, heads=2, double_blocks=4,
                              single_blocks=4, context_dim=256, vec_dim=64)
  cfg = dataclasses.replace(cfg, heads_per_chunk=min(2, cfg.heads))
  # Quick: more tokens than the width, so that no activation has a weight's
  # shape and the block-shaped reading stays the weights'.
  tokens = (512, 64) if args.quick else (4096, 512)
  rows = {}
  for name in args.optimizers:
    for step in ("ordinary", "blockwise"):
      rows[f"{step} | {name}"] = compile_row(name, step, cfg, args.target,
                                             tokens)
  n = next(iter(rows.values()))["params"]
  r = {"target": args.target,
       "target_name": gpu_compile.gpu_mesh(args.target).devices.flat[0]
       .device_kind,
       "date": datetime.date.today().isoformat(), "jax": jax.__version__,
       "model": (f"FLUX-shaped MMDiT, {cfg.double_blocks} + "
                 f"{cfg.single_blocks} blocks of width {cfg.hidden} "
                 f"({n / 1e9:.2f}B params), batch 1, {tokens[0]} + "
                 f"{tokens[1]} tokens, block remat, attention "
                 f"{cfg.heads_per_chunk} heads at a time"), "rows": rows}
  report.save("blockwise", to_markdown(r), r, args.quick)
  failures = check(r)
  for f in failures:
    print("FAIL:", f)
  if args.check and failures:
    raise SystemExit(1)
  return r


if __name__ == "__main__":
  main()

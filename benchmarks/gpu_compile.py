"""The GPU programs of the optimizer steps, compiled for an H200 or H100 here.

    pip install -e ".[gpu-aot]"      # jax's CUDA plugin: XLA's GPU compiler
    python -m benchmarks.gpu_compile [--quick] [--target h200 h100]
    python -m benchmarks.gpu_compile --full --target h200   # FLUX.1-dev
    python -m benchmarks.gpu_compile --quick --check   # what CI asserts

Nothing runs on a GPU: XLA's GPU compiler compiles each jitted step for a
Hopper target described by its specification (deviceless compilation, with
``JAX_PLATFORMS=cpu``, so no CUDA driver is needed). What is read from each
compiled program:

* device peak = arguments + outputs - aliased + temporaries, from
  ``compiled.memory_analysis()``, in GB and bytes per parameter;
* host bytes (the residuals' arguments in ``pinned_host`` memory);
* the number of ``conditional`` instructions (on a GPU each one copies its
  predicate to the host and waits for the device to drain);
* host-to-device and device-to-host copies;
* the most residual bytes staged on the device at once, read from the
  schedule: a host-to-device copy's buffer lives from its ``copy-start`` to
  the last instruction that reads it (through tuples), a device-to-host
  copy's source from its producer to its ``copy-done``;
* overlap: the share of host-to-device copies that start before the
  previous copy's last reader, i.e. while the previous leaf is being updated;
* both ways: the share of device-to-host copies during which a
  host-to-device copy starts (both PCIe directions busy at once);
* for the optimizer steps, an estimated step time: the bytes its kernels
  read and write over the HBM bandwidth, plus the host copies' bytes over the
  PCIe bandwidth (constants below). ``cost_analysis()`` needs a device, so
  the bytes are summed from the compiled program (operands and outputs of
  each fusion, library call and copy; a buffer a kernel receives twice,
  before and after an optimization barrier, read once); matmul FLOPs are not
  counted and no overlap is assumed: a rough figure for the memory-bound
  optimizer step only;
* for the whole training steps, the step on ``benchmarks.timeline``'s model
  instead (each loop run its trip count; gemms at 700 TFLOP/s, every other
  kernel its bytes over the HBM bandwidth, host copies at the PCIe bandwidth
  per direction), beside its floors: the gemms' time, and the larger
  direction's host bytes over the PCIe bandwidth. Also the rows ``+ one 2 KB
  host copy`` (an unused host-to-device copy in a plain bf16 step) and ``...
  in a loop`` (the same copy in a ``fori_loop`` body): what the program's
  schedule does when its entry holds a host copy, or not; and the ``kahan``
  rows ``..., latency-hiding scheduler off``, compiled with
  ``NO_LATENCY_HIDING`` (the remedy ``kahan``'s warning names for unrolled
  rematerialized blocks; jax 0.12.1's XLA honours it, jax 0.10.2's not).

Steps: the optimizer step alone (``tx.update`` + ``optax.apply_updates``,
params and state donated, bf16 gradients) for the optax anchors and each
named optimizer, plain, in ``kahan`` and in ``kahan(..., offload=False)``,
on the FLUX.1-dev transformer's shapes with 2 double- and 2 single-stream
blocks (1.03B params, 112 leaves) and on 24 equal leaves of 1024 x 1024;
and a whole training step (forward, backward with block
remat, update, apply) of a DiT-like model, 8 blocks of width 1024 (151M
params), its blocks stacked and run by ``lax.scan`` or unrolled, and of
FLUX.1-dev's layers with 2 + 2 blocks unrolled (each block's weights leaves of
their own, under Flax's key paths; 1.03B params). ``--quick``
(for CI): width 256, 1 + 1 FLUX blocks, 24 leaves of 256 x 256, the
adamw, both clip-chains and prodigy_factored families, the scanned DiT's
kahan rows (the scheduler's) and the unrolled DiT's ``kahan(optax.adamw)``
rows only.
``--full`` compiles instead the full FLUX.1-dev (11.9B params, 1,160 leaves)
optimizer steps of ``kahan(optax.adamw)`` and ``kahan(prodigy_factored())`` (minutes each),
into ``results/gpu_compile_full``.

``--check`` asserts what the README promises: no conditional in any step;
for every ``kahan`` optimizer step with host residuals, residual
staging at most two of the largest leaf's residuals and an offload saving
at the device peak of at least 2 B/param less those two, less 0.05; and in
the whole training step with scanned blocks, a saving of at least 1.9
B/param; with unrolled rematerialized blocks, where host residuals cost
memory instead, ``kahan``'s warning while the step is traced, and (on jax
0.12 and later) a saving of at least 1.7 B/param with the latency-hiding
scheduler off.

``--training``: only the whole training steps. Writes
``benchmarks/results/gpu_compile{,_quick,_full,_training}.{md,json}``, or
``--name``'s.
"""

from __future__ import annotations

import os

if __name__ == "__main__":  # before jax is imported: no CUDA driver is touched
  os.environ["JAX_PLATFORMS"] = "cpu"

import argparse
import datetime
import math
import re
import sys
import time
import warnings
from typing import Any, Callable, NamedTuple, Optional

import jax
import jax.numpy as jnp
import optax

import optax_kahan as ok
from optax_kahan._src import gpu_targets
from optax_kahan._src import kahan as kahan_module
from optax_kahan import flux as flux_model
from benchmarks import model_shapes
from benchmarks import report
from benchmarks import timeline

HBM = gpu_targets.HBM
PCIE = gpu_targets.PCIE
TARGETS = gpu_targets.TARGETS


def gpu_mesh(target: str) -> jax.sharding.Mesh:
  """``gpu_targets.gpu_mesh``, or the command to install XLA's GPU compiler."""
  try:
    return gpu_targets.gpu_mesh(target)
  except RuntimeError as e:
    raise SystemExit(f'{e}: pip install -e ".[gpu-aot]"') from e


# -- reading a compiled program ----------------------------------------------
_BYTES = {"pred": 1, "s8": 1, "u8": 1, "bf16": 2, "f16": 2, "s16": 2,
          "u16": 2, "f32": 4, "s32": 4, "u32": 4, "f64": 8, "s64": 8,
          "u64": 8}
_INSTR = re.compile(
    r"\s*(?:ROOT )?%?([\w.\-]+) = (.*?) ([a-z][\w\-]*)\((.*?)\)(?:,|$)")


def _nbytes(shape: str) -> int:
  m = re.match(r"(\w+)\[([\d,]*)\]", shape)
  dims = [int(d) for d in m.group(2).split(",") if d]
  return _BYTES[m.group(1)] * math.prod(dims)


def hlo_entry(hlo: str) -> list[tuple[str, str, str, list[str], str]]:
  """The entry computation, in schedule order: (name, type, op, operands)."""
  body = hlo[hlo.index("\nENTRY"):]
  body = body[:body.index("\n}\n")]
  out = []
  for line in body.splitlines()[1:]:
    m = _INSTR.match(line)
    if m:
      operands = re.findall(r"%([\w.\-]+)", m.group(4))
      index = re.search(r"index=(\d+)", line)
      out.append((m.group(1), m.group(2), m.group(3), operands,
                  index.group(1) if index else ""))
  return out


def _last_reader(entry, start: int, name: str) -> int:
  """Position of the last instruction reading ``name``, through tuples."""
  held = {(name, None)}  # (value, tuple index it sits at) pairs
  last = start
  for i in range(start + 1, len(entry)):
    n, _, op, operands, index = entry[i]
    if op == "tuple":
      for k, o in enumerate(operands):
        if (o, None) in held:
          held.add((n, k))
    elif op == "get-tuple-element" and (operands[0], int(index)) in held:
      held.add((n, None))
    elif any((o, None) in held for o in operands):
      last = i
  return last


def schedule_report(hlo: str) -> dict[str, Any]:
  """Residual copies, their staging and overlap, from the scheduled HLO."""
  entry = hlo_entry(hlo)
  where = {n: i for i, (n, *_) in enumerate(entry)}
  events, h2d, d2h = [], [], []
  for i, (name, typ, op, operands, _) in enumerate(entry):
    if op != "copy-start":
      continue
    dest = re.match(r"\((\w+\[[\d,]*\]\{[^}]*\})", typ).group(1)
    done = next(j for j in range(i + 1, len(entry))
                if entry[j][2] == "copy-done" and name in entry[j][3])
    size = _nbytes(dest)
    if "S(5)" in dest:  # device -> host: the source waits on the device
      events += [(where.get(operands[0], i), size), (done + 1, -size)]
      d2h.append((i, done))
    else:
      end = _last_reader(entry, done, entry[done][0])
      h2d.append((i, end))
      events += [(i, size), (end + 1, -size)]
  live = peak = 0
  for _, size in sorted(events):
    live += size
    peak = max(peak, live)
  overlapped = sum(1 for a, b in zip(h2d, h2d[1:]) if b[0] < a[1])
  both_ways = sum(1 for a, b in d2h if any(a < s < b for s, _ in h2d))
  return {"staging_peak": peak, "h2d_copies": len(h2d),
          "d2h_copies": len(d2h),
          "overlap": overlapped / max(1, len(h2d) - 1),
          "both_ways": both_ways / max(1, len(d2h)),
          "conditionals": len(re.findall(r"\sconditional\(", hlo))}


def type_bytes(typ: str) -> int:
  """Bytes of every array in an HLO type (a tuple's elements summed)."""
  return sum(_nbytes(a) for a in re.findall(r"\w+\[[\d,]*\]", typ)
             if a.split("[")[0] in _BYTES)


def _buffers(entry) -> dict[str, str]:
  """The value each tuple element read back stands for: a get-tuple-element
  of a ``tuple`` (a compiled optimization barrier is one) is the operand
  the tuple holds, the same buffer."""
  tuples = {n: operands for n, _, op, operands, _ in entry if op == "tuple"}
  same = {}
  for n, _, op, operands, index in entry:
    if op == "get-tuple-element" and operands[0] in tuples:
      held = tuples[operands[0]][int(index)]
      same[n] = same.get(held, held)
  return same


def bytes_accessed(hlo: str) -> int:
  """HBM traffic of the entry's kernels: each reads its operands, writes
  its outputs (``compiled.cost_analysis()`` is not available without a
  device). A buffer a kernel receives twice (before and after an
  optimization barrier) is read once: the same elements at the same time,
  the second load from cache. Host copies are counted separately."""
  entry = hlo_entry(hlo)
  types = {n: typ for n, typ, *_ in entry}
  same = _buffers(entry)
  total = 0
  for _, typ, op, operands, _ in entry:
    if op in ("fusion", "custom-call", "copy"):
      reads = {same.get(o, o) for o in operands}
      total += type_bytes(typ) + sum(type_bytes(types.get(o, ""))
                                      for o in reads)
  return total


def compile_step(step: Callable, args: tuple, mesh, donate=(0, 1),
                 compiler_options: Optional[dict[str, Any]] = None):
  with jax.set_mesh(mesh):
    return jax.jit(step, donate_argnums=donate,
                   compiler_options=compiler_options).lower(*args).compile()


def report_of(compiled, n: int, target: str, largest: int) -> dict[str, Any]:
  m = compiled.memory_analysis()
  peak = (m.argument_size_in_bytes + m.output_size_in_bytes
          - m.alias_size_in_bytes + m.temp_size_in_bytes)
  sched = schedule_report(compiled.as_text())
  accessed = bytes_accessed(compiled.as_text())
  host = 2 * m.host_argument_size_in_bytes  # in and back out
  return {
      "params": n, "largest_leaf_bytes": largest, "peak_bytes": peak,
      "peak_B_per_param": peak / n,
      "temp_B_per_param": m.temp_size_in_bytes / n,
      "host_bytes": m.host_argument_size_in_bytes,
      "staging_B_per_param": sched["staging_peak"] / n,
      "staging_in_largest_leaves": sched["staging_peak"] / max(1, largest),
      "estimated_ms": 1e3 * (accessed / HBM[target] + host / PCIE),
      **sched}


# -- the steps ----------------------------------------------------------------
def decay_mask(params: Any) -> Any:
  """No weight decay on biases and norm scales, by the leaf's key."""
  return jax.tree_util.tree_map_with_path(
      lambda path, _: not str(path[-1].key).endswith(("bias", "scale")),
      params)


def optimizers() -> dict[str, Callable[[], optax.GradientTransformation]]:
  return {
      "optax.adamw": lambda: optax.adamw(1e-5),
      "optax.adamw(mask=decay_mask)": lambda: optax.adamw(
          1e-5, weight_decay=0.1, mask=decay_mask),
      "optax.adafactor": lambda: optax.adafactor(1e-5),
      "optax.lion": lambda: optax.lion(1e-6),
      "chain(clip_by_global_norm, optax.adamw)": lambda: ok.per_leaf.chain(
          ok.per_leaf.clip_by_global_norm(1.0), optax.adamw(1e-5)),
      "optax.chain(optax.clip_by_global_norm, optax.adamw)": lambda:
          optax.chain(optax.clip_by_global_norm(1.0), optax.adamw(1e-5)),
      "prodigy()": ok.prodigy,
      "prodigy_factored()": ok.prodigy_factored,
      "stable_adamw()": lambda: ok.stable_adamw(1e-5),
  }


def configurations(quick: bool = False) -> dict[str, Callable]:
  """Each optimizer plain, in kahan and in kahan on device.

  ``quick``: only the optax.adamw (and with a decay mask), clip-chain (both
  ways) and prodigy_factored() families, and of optax's own optimizers only
  their ``kahan`` forms (what the check is about; optax's plain program is
  not this package's).
  """
  out = {}
  for name, make in optimizers().items():
    if quick and name not in (
        "optax.adamw", "optax.adamw(mask=decay_mask)", "prodigy_factored()",
        "chain(clip_by_global_norm, optax.adamw)",
        "optax.chain(optax.clip_by_global_norm, optax.adamw)"):
      continue
    if not (quick and name.startswith("optax.")):
      out[name] = make
    out[f"kahan({name})"] = lambda make=make: ok.kahan(make())
    out[f"kahan({name}), offload=False"] = (
        lambda make=make: ok.kahan(make(), offload=False))
  return out


def optimizer_step(make: Callable, shapes: model_shapes.Shapes, mesh,
                   offload: bool, target: str) -> dict[str, Any]:
  tx = make()
  device = jax.NamedSharding(mesh.abstract_mesh, jax.P())
  params = {k: jax.ShapeDtypeStruct(v, jnp.bfloat16, sharding=device)
            for k, v in shapes.items()}
  state = _placed_state(tx, params, mesh, offload)

  def step(params, state, grads):
    updates, state = tx.update(grads, state, params)
    return optax.apply_updates(params, updates), state

  t0 = time.perf_counter()
  compiled = compile_step(step, (params, state, params), mesh)
  row = report_of(compiled, model_shapes.num_params(shapes), target,
                  2 * max(math.prod(s) for s in shapes.values()))
  row["compile_s"] = time.perf_counter() - t0
  return row


def _placed_state(tx, params, mesh, offload: bool) -> Any:
  """``tx.init``'s shapes on ``mesh``; kahan's residuals in host memory
  when ``offload``.

  Compile-only devices expose no memories, so a sharding on the concrete
  mesh drops ``memory_kind``; one on the mesh's abstract twin keeps it (the
  step is lowered under ``jax.set_mesh`` of the concrete mesh).
  """
  device = jax.NamedSharding(mesh.abstract_mesh, jax.P())
  host = jax.NamedSharding(mesh.abstract_mesh, jax.P(),
                           memory_kind="pinned_host")
  state = jax.tree.map(
      lambda x: jax.ShapeDtypeStruct(x.shape, x.dtype, sharding=device),
      jax.eval_shape(tx.init, params))
  if not offload:
    return state
  try:
    residuals = ok.kahan_residuals(state)
  except ValueError:  # no kahan in this optimizer
    return state
  return ok.kahan_replace_residuals(state, jax.tree.map(
      lambda r: jax.ShapeDtypeStruct(r.shape, r.dtype, sharding=host),
      residuals))


# -- a whole training step ----------------------------------------------------
def dit_shapes(width: int, blocks: int, scan: bool,
               patch_dim: int = 64) -> dict:
  """A DiT-like model: patch embedding, adaLN blocks (attention + MLP), head.

  With ``scan`` the blocks' weights are stacked on a leading axis (one leaf
  per kind of weight, run by ``lax.scan``, as in MaxText or MaxDiffusion);
  otherwise each block's weights are leaves of their own (``block{i}.*``), as
  in FLUX's checkpoints, and the blocks are unrolled.
  """
  s = {"embed": (patch_dim, width), "time": (256, width),
       "head": (width, patch_dim)}
  block = {"ada": (width, 6 * width), "qkv": (width, 3 * width),
           "out": (width, width), "mlp_in": (width, 4 * width),
           "mlp_out": (4 * width, width), "norm": (width,)}
  for k, shape in block.items():
    if scan:
      s[k] = (blocks, *shape)
    else:
      s.update({f"block{i}.{k}": shape for i in range(blocks)})
  return s


def dit_loss(params: dict, x: jax.Array, t: jax.Array, heads: int) -> jax.Array:
  """Flow-matching-style regression of a DiT-like model (bf16 compute), each
  block rematerialized in the backward pass (``jax.checkpoint``)."""
  h = x @ params["embed"]
  c = jax.nn.silu(t @ params["time"])

  def block(h, p):
    b, n, w = h.shape
    shift1, scale1, gate1, shift2, scale2, gate2 = jnp.split(
        c @ p["ada"], 6, axis=-1)
    norm = lambda z: z * jax.lax.rsqrt(
        jnp.mean(jnp.square(z.astype(jnp.float32)), -1, keepdims=True)
        + 1e-6).astype(z.dtype) * p["norm"]
    z = norm(h) * (1 + scale1[:, None]) + shift1[:, None]
    q, k, v = jnp.split(z @ p["qkv"], 3, axis=-1)
    split = lambda a: a.reshape(b, n, heads, w // heads)
    a = jax.nn.dot_product_attention(split(q), split(k), split(v))
    h = h + gate1[:, None] * (a.reshape(b, n, w) @ p["out"])
    z = norm(h) * (1 + scale2[:, None]) + shift2[:, None]
    return h + gate2[:, None] * (jax.nn.gelu(z @ p["mlp_in"]) @ p["mlp_out"])

  block = jax.checkpoint(block)
  if "ada" in params:  # stacked
    stacked = {k: v for k, v in params.items()
               if k not in ("embed", "time", "head")}
    h, _ = jax.lax.scan(lambda h, p: (block(h, p), None), h, stacked)
  else:
    i = 0
    while f"block{i}.ada" in params:
      h = block(h, {k.split(".", 1)[1]: v for k, v in params.items()
                    if k.startswith(f"block{i}.")})
      i += 1
  out = h @ params["head"]
  return jnp.mean(jnp.square((out - x).astype(jnp.float32)))


class Model(NamedTuple):
  """A model for a whole training step: its bf16 params
  (``jax.ShapeDtypeStruct`` leaves), ``loss(params, *batch)`` and the
  batch's shapes."""
  params: Any
  loss: Callable[..., jax.Array]
  batch: tuple[jax.ShapeDtypeStruct, ...]


def dit_model(width: int, blocks: int, scan: bool, batch: int,
              tokens: int) -> Model:
  """The DiT-like model of ``dit_shapes`` and ``dit_loss``."""
  shapes = dit_shapes(width, blocks, scan)
  heads = max(1, width // 128)
  return Model(
      {k: jax.ShapeDtypeStruct(v, jnp.bfloat16) for k, v in shapes.items()},
      lambda params, x, t: dit_loss(params, x, t, heads),
      (jax.ShapeDtypeStruct((batch, tokens, shapes["embed"][0]), jnp.bfloat16),
       jax.ShapeDtypeStruct((batch, 256), jnp.bfloat16)))


def flux_unrolled_model(blocks: int, image_tokens: int,
                        text_tokens: int) -> Model:
  """FLUX.1-dev's layers (width 3072) with ``blocks`` double- and single-stream
  blocks, each block's weights leaves of their own (Flax's key paths, as in
  the checkpoints), the blocks run one after the other, each rematerialized
  (``jax.checkpoint``) in the backward pass; batch 1. Its loss is
  ``ok.blockwise.blockwise_loss`` with each stack's ``lax.scan`` unrolled
  (which that function, taking stacks, cannot express)."""
  cfg = flux_model.FluxConfig(double_blocks=blocks, single_blocks=blocks)
  model = flux_model.abstract_model(cfg)
  stacked = flux_model.abstract_params(cfg, jnp.bfloat16)
  one_block = lambda stack: jax.tree.map(  # a stack's block, by its shapes
      lambda x: jax.ShapeDtypeStruct(x.shape[1:], x.dtype), stack)
  names = ("double_blocks", "single_blocks")
  params = {"embed": stacked.embed, "head": stacked.head,
            **{name: [one_block(stack) for _ in range(blocks)]
               for name, stack in zip(names, stacked.stacks)}}

  def loss(params, batch):
    carry, consts = model.embed(params["embed"], batch)
    for s, name in enumerate(names):
      for block_params in params[name]:
        carry = jax.checkpoint(model.blocks[s])(block_params, carry, consts)
      if model.transition(s) is not None and not model.joins(s):
        carry = model.transition(s)(carry, consts)
    return model.head(params["head"], carry, consts, batch)

  return Model(params, loss, (flux_model.batch_spec(cfg, 1, image_tokens,
                                                    text_tokens),))


def training_program(name: str, make: Callable, model: Model, mesh,
                     offload: bool = True) -> tuple[Callable, tuple]:
  """Row ``name``'s whole training step of ``model`` with the optimizer
  ``make()`` on ``mesh``, and its abstract arguments (params, state, batch
  and a 2 KB host array)."""
  device = jax.NamedSharding(mesh.abstract_mesh, jax.P())

  def placed(x, dtype=None):
    return jax.ShapeDtypeStruct(x.shape, dtype or x.dtype, sharding=device)

  master = name == "float32 master adamw"
  params = jax.tree.map(lambda p: placed(p, jnp.float32 if master else None),
                        model.params)
  tx = make()
  state = _placed_state(tx, params, mesh, offload)
  batch = jax.tree.map(placed, model.batch)
  host = jax.ShapeDtypeStruct((1024,), jnp.uint16, sharding=jax.NamedSharding(
      mesh.abstract_mesh, jax.P(), memory_kind="pinned_host"))
  probe = "one 2 KB host copy" in name
  in_loop = name.endswith("in a loop")

  def step(params, state, batch, host):
    compute = jax.tree.map(lambda p: p.astype(jnp.bfloat16), params)
    grads = jax.grad(model.loss)(compute, *batch)
    if master:
      grads = jax.tree.map(lambda g: g.astype(jnp.float32), grads)
    updates, state = tx.update(grads, state, params)
    params = optax.apply_updates(params, updates)
    if probe:  # one tiny host -> device copy, its value unused but kept
      copy = lambda: jax.device_put(host, jax.memory.Space.Device)[:1]
      if in_loop:  # the same copy in a loop body: not in the entry's schedule
        value = jax.lax.fori_loop(0, 2, lambda i, acc: acc + copy(),
                                  jnp.zeros((1,), jnp.uint16))
      else:
        value = copy()
      leaves, treedef = jax.tree.flatten(params)
      leaves[0] = leaves[0] + 0 * value.astype(leaves[0].dtype)
      params = treedef.unflatten(leaves)
    return params, state

  return step, (params, state, batch, host)


def training_step(name: str, make: Callable, model: Model, mesh, target: str,
                  offload: bool = True,
                  compiler_options: Optional[dict[str, Any]] = None) -> dict:
  """``training_program``'s step compiled for ``target``: its report, the
  timeline model's figures and what ``kahan`` warned while it was traced."""
  t0 = time.perf_counter()
  with warnings.catch_warnings(record=True) as caught:
    warnings.simplefilter("always", ok.OptaxKahanWarning)
    compiled = compile_step(*training_program(name, make, model, mesh,
                                              offload), mesh,
                            compiler_options=compiler_options)
  largest = max(math.prod(x.shape) for x in jax.tree.leaves(model.params))
  row = report_of(compiled, flux_model.num_params(model.params), target,
                  2 * largest)
  row.update(modelled(compiled.as_text(), target))
  row["warned"] = [str(w.message) for w in caught
                   if issubclass(w.category, ok.OptaxKahanWarning)]
  row["compile_s"] = time.perf_counter() - t0
  return row


def modelled(hlo: str, target: str) -> dict[str, float]:
  """The whole program on ``benchmarks.timeline``'s model (loops run their
  trip count): gemms at ``timeline.GEMM_FLOPS``, every other kernel its
  bytes over the target's HBM bandwidth, host copies at ``PCIE`` per
  direction; beside it the floors: the gemms' time and the larger
  direction's host bytes over ``PCIE``."""
  t = timeline.model(hlo, pcie=PCIE, hbm_bytes_per_s=HBM[target])
  return {"modelled_ms": 1e3 * t.step_s, "gemm_ms": 1e3 * t.gemm_s,
          "pcie_floor_ms": 1e3 * max(t.h2d_bytes, t.d2h_bytes) / PCIE}


# XLA:GPU's latency-hiding scheduler off: the program keeps the order of its
# memory-minimizing scheduler (a jit compiler option; jax 0.12.1 honours it,
# jax 0.10.2's XLA runs the scheduler whatever it says).
NO_LATENCY_HIDING = {"xla_gpu_enable_latency_hiding_scheduler": False}
SCHEDULER_OFF = ", latency-hiding scheduler off"


def training_configurations() -> dict[str, tuple[Callable, bool,
                                                 Optional[dict[str, Any]]]]:
  """Each row: the optimizer, whether its residuals are in host memory, and
  the compiler options of its step."""
  adamw = lambda: optax.adamw(1e-5)
  kahan_adamw = lambda **kw: lambda: ok.kahan(optax.adamw(1e-5), **kw)
  kahan_prodigy = lambda **kw: lambda: ok.kahan(ok.prodigy_factored(), **kw)
  return {
      "bf16 optax.adamw": (adamw, True, None),
      "bf16 optax.adamw + one 2 KB host copy": (adamw, True, None),
      "bf16 optax.adamw + one 2 KB host copy in a loop": (adamw, True, None),
      "float32 master adamw": (adamw, True, None),
      "kahan(optax.adamw)": (kahan_adamw(), True, None),
      "kahan(optax.adamw)" + SCHEDULER_OFF: (kahan_adamw(), True,
                                              NO_LATENCY_HIDING),
      "kahan(optax.adamw), offload=False": (
          kahan_adamw(offload=False), False, None),
      "kahan(optax.adamw), offload=False" + SCHEDULER_OFF: (
          kahan_adamw(offload=False), False, NO_LATENCY_HIDING),
      "kahan(prodigy_factored())": (kahan_prodigy(), True, None),
      "kahan(prodigy_factored())" + SCHEDULER_OFF: (
          kahan_prodigy(), True, NO_LATENCY_HIDING),
      "kahan(prodigy_factored()), offload=False": (
          kahan_prodigy(offload=False), False, None),
      "kahan(prodigy_factored()), offload=False" + SCHEDULER_OFF: (
          kahan_prodigy(offload=False), False, NO_LATENCY_HIDING),
  }


# -- tables and checks ------------------------------------------------------
def to_markdown(r: dict) -> str:
  whole = all("modelled_ms" in v for v in r["rows"].values())
  times = ("modelled ms | gemm ms | PCIe floor ms" if whole else "est. ms")
  lines = [f"Compiled for {r['target_name']}, not run ({r['date']}, jax "
           f"{r['jax']}). {r['shapes']}.", "",
           "| step | peak GB | B/param | temp B/param | host GB | conds | "
           "H2D / D2H | staging B/param (leaves) | overlapped | both ways "
           f"| {times} |",
           "|---|---|---|---|---|---|---|---|---|---|" +
           ("---|---|---|" if whole else "---|")]
  for name, v in r["rows"].items():
    time_cells = (f"{v['modelled_ms']:.1f} | {v['gemm_ms']:.1f} | "
                  f"{v['pcie_floor_ms']:.1f}" if whole
                  else f"{v['estimated_ms']:.1f}")
    staged = (f"{v['staging_B_per_param']:.3f} "
              f"({v['staging_in_largest_leaves']:.1f})"
              if v["h2d_copies"] else "-")
    overlap = f"{100 * v['overlap']:.0f}%" if v["h2d_copies"] > 1 else "-"
    both = (f"{100 * v['both_ways']:.0f}%" if v["d2h_copies"] else "-")
    lines.append(
        f"| {name} | {v['peak_bytes'] / 1e9:.2f} | "
        f"{v['peak_B_per_param']:.2f} | {v['temp_B_per_param']:.3f} | "
        f"{v['host_bytes'] / 1e9:.2f} | {v['conditionals']} | "
        f"{v['h2d_copies']} / {v['d2h_copies']} | {staged} | {overlap} | "
        f"{both} | {time_cells} |")
  lines.append("")
  for name, saving in r.get("offload_saving", {}).items():
    lines.append(f"- offload saves {saving:.2f} B/param at the device peak "
                 f"for {name}")
  return "\n".join(lines) + "\n"


def offload_pairs(rows: dict) -> dict[str, dict]:
  """Each ``kahan(tx)`` row's ``kahan(tx), offload=False`` twin, compiled
  with the same options (the latency-hiding scheduler off changes the
  scanned DiT's step without host copies too, on jax 0.12.1)."""
  out = {}
  for name in rows:
    suffix = SCHEDULER_OFF if name.endswith(SCHEDULER_OFF) else ""
    off = rows.get(f"{name.removesuffix(suffix)}, offload=False{suffix}")
    if name.startswith("kahan(") and off is not None:
      out[name] = off
  return out


def offload_savings(rows: dict) -> dict[str, float]:
  """Device peak of ``kahan(tx), offload=False`` minus that of ``kahan(tx)``."""
  return {name: off["peak_B_per_param"] - rows[name]["peak_B_per_param"]
          for name, off in offload_pairs(rows).items()}


# Host residuals whose copies hide: a whole step modelled at most this many
# times the larger of its offload=False twin's time and the residuals' PCIe
# floor. No ordinary step gets there (the copies run after the backward
# pass), so kahan warns where the floor is material.
TIME_BOUND = 1.15


def honours_scheduler_option(jax_version: str) -> bool:
  """Whether the XLA of this jax compiles ``NO_LATENCY_HIDING`` without its
  latency-hiding scheduler: jax 0.12.1 does (a whole training step with host
  copies then keeps its memory-minimizing order), jax 0.10.2 does not (the
  same peak, option or not); versions between are untested, taken as not."""
  major, minor = (int(x) for x in jax_version.split(".")[:2])
  return (major, minor) >= (0, 12)


def check(r: dict) -> list[str]:
  """What the README promises of the library's GPU steps; the failures.

  Every step: no conditional. Every ``kahan`` step with host residuals, in
  an optimizer step:
  residual staging at most two of the largest leaf's residuals, and
  offloading lowers the device peak by at least 2 B/param less those two
  leaves' bytes per param, less 0.05; in the whole training step with
  scanned blocks, by at least 1.9 B/param. With unrolled rematerialized
  blocks, where host residuals raise the peak (any host copy makes XLA's
  latency-hiding scheduler reorder the program), ``kahan`` warned while the
  step was traced: the loss is never silent; and on a jax whose XLA honours
  ``NO_LATENCY_HIDING`` (0.12 and later, as measured), the step compiled
  with it saves at least 1.7 B/param (the remedy that warning names).
  Where a whole step with host residuals is modelled at more than
  ``TIME_BOUND`` times the larger of its ``offload=False`` twin's and its
  PCIe floor, and that floor is at least ``kahan.COPY_WARNING_S``, ``kahan``
  warned of the copies' time.
  """
  failures = []
  savings = r["offload_saving"]
  pairs = offload_pairs(r["rows"])
  optimizer_step_only = r["shapes"].startswith("Optimizer step")
  for name, v in r["rows"].items():
    if v["conditionals"]:
      failures.append(f"{r['shapes']}: {name} has {v['conditionals']} "
                      "conditionals")
    if not name.startswith("kahan(") or name not in savings:
      continue
    if "lax.scan" in r["shapes"] and savings[name] < 1.9:
      failures.append(f"{r['shapes']}: offload saves {savings[name]:.2f} "
                      f"B/param for {name}, less than 1.9")
    if (savings[name] < 0 and "unrolled" in r["shapes"]
        and not any("rematerializes" in w for w in v.get("warned", ()))):
      failures.append(f"{r['shapes']}: offload costs {-savings[name]:.2f} "
                      f"B/param for {name}, and kahan did not warn")
    if (name.endswith(SCHEDULER_OFF) and honours_scheduler_option(r["jax"])
        and savings[name] < 1.7):
      failures.append(f"{r['shapes']}: offload saves {savings[name]:.2f} "
                      f"B/param for {name}, less than 1.7")
    if not optimizer_step_only:
      floor = v["pcie_floor_ms"]
      bound = TIME_BOUND * max(pairs[name]["modelled_ms"], floor)
      if (floor >= 1e3 * kahan_module.COPY_WARNING_S
          and v["modelled_ms"] > bound
          and not any("ms or more to the step" in w
                      for w in v.get("warned", ()))):
        failures.append(
            f"{r['shapes']}: {name} is modelled at {v['modelled_ms']:.1f} "
            f"ms, more than {bound:.1f}, and kahan did not warn of the "
            "copies' time")
      continue
    if v["staging_in_largest_leaves"] > 2.01:
      failures.append(f"{r['shapes']}: {name} stages "
                      f"{v['staging_in_largest_leaves']:.1f} largest leaves")
    bound = 2.0 - 2 * v["largest_leaf_bytes"] / v["params"] - 0.05
    if savings[name] < bound:
      failures.append(f"{r['shapes']}: offload saves {savings[name]:.2f} "
                      f"B/param for {name}, less than {bound:.2f}")
  return failures


def run_target(target: str, quick: bool, full: bool,
               training: bool = False) -> list[dict]:
  if full:
    return [full_flux_table(target)]
  mesh = gpu_mesh(target)
  name = mesh.devices.flat[0].device_kind
  stamp = {"target": target, "target_name": name, "jax": jax.__version__,
           "date": datetime.date.today().isoformat()}
  tables = [] if training else optimizer_tables(target, quick, mesh, stamp)
  return tables + training_tables(target, quick, mesh, stamp)


def optimizer_tables(target: str, quick: bool, mesh, stamp: dict) -> list:
  width, blocks = (256, 1) if quick else (3072, 2)
  side = 256 if quick else 1024
  tables = []
  flux = model_shapes.flux_dev_shapes(hidden=width, double_blocks=blocks,
                                      single_blocks=blocks,
                                      head_dim=min(128, width // 2))
  equal = {f"w{i}": (side, side) for i in range(24)}
  for shapes, what in (
      (flux, f"FLUX.1-dev shapes, width {width}, {blocks} + {blocks} blocks"),
      (equal, f"24 equal leaves of {side} x {side}")):
    rows = {}
    for cfg, make in configurations(quick).items():
      rows[cfg] = optimizer_step(make, shapes, mesh,
                                 not cfg.endswith("offload=False"), target)
      print(f"  {target} {what}: {cfg}: {rows[cfg]['compile_s']:.0f} s",
            flush=True)
    n = model_shapes.num_params(shapes)
    tables.append({**stamp, "rows": rows,
                   "offload_saving": offload_savings(rows),
                   "shapes": (f"Optimizer step on {what} ({n / 1e6:.0f}M "
                              f"params, {len(shapes)} leaves)")})
  return tables


def training_tables(target: str, quick: bool, mesh, stamp: dict) -> list:
  tables = []
  width = 256 if quick else 1024
  batch, tokens = (2, 256) if quick else (4, 1024)
  models = [(dit_model(width, 8, scan, batch, tokens), scan, (
      f"a DiT-like model, 8 blocks of width {width} "
      f"{'stacked, lax.scan' if scan else 'unrolled'}"),
                f"{batch} x {tokens} tokens") for scan in (True, False)]
  if not quick:
    models.append((flux_unrolled_model(2, 1024, 512), False,
                   "FLUX.1-dev's layers, 2 + 2 blocks unrolled",
                   "1 x (1024 image + 512 text) tokens"))
  for model, scan, what, batch_size in models:
    rows = {}
    quick_rows = (("kahan(optax.adamw)", "kahan(prodigy_factored())") if scan
                  else ("kahan(optax.adamw)",))
    for cfg, (make, offload, options) in training_configurations().items():
      if quick and (not cfg.startswith(quick_rows)
                    or scan and cfg.endswith(SCHEDULER_OFF)):
        continue
      rows[cfg] = training_step(cfg, make, model, mesh, target, offload,
                                options)
      print(f"  {target} {what}: {cfg}: {rows[cfg]['compile_s']:.0f} s",
            flush=True)
    n = flux_model.num_params(model.params)
    tables.append({
        **stamp, "rows": rows, "offload_saving": offload_savings(rows),
        "shapes": (f"Whole training step (forward, backward with block "
                   f"remat, update, apply) of {what} ({n / 1e6:.0f}M params, "
                   f"{len(jax.tree.leaves(model.params))} leaves), batch "
                   f"{batch_size}")})
  return tables


def full_flux_table(target: str) -> dict:
  """The full FLUX.1-dev (11.9B params, 1,160 leaves) optimizer steps of
  ``kahan(optax.adamw)`` and ``kahan(prodigy_factored())``, with and without
  offload (minutes each)."""
  mesh = gpu_mesh(target)
  shapes = model_shapes.flux_dev_shapes()
  rows = {}
  for cfg in ("kahan(optax.adamw)", "kahan(optax.adamw), offload=False",
              "kahan(prodigy_factored())",
              "kahan(prodigy_factored()), offload=False"):
    rows[cfg] = optimizer_step(configurations()[cfg], shapes, mesh,
                               not cfg.endswith("offload=False"), target)
    print(f"  {target} {cfg}: {rows[cfg]['compile_s']:.0f} s", flush=True)
  n = model_shapes.num_params(shapes)
  return {"target": target, "target_name": mesh.devices.flat[0].device_kind,
          "jax": jax.__version__, "date": datetime.date.today().isoformat(),
          "rows": rows, "offload_saving": offload_savings(rows),
          "shapes": (f"Optimizer step on the full FLUX.1-dev ({n / 1e9:.1f}B "
                     f"params, {len(shapes)} leaves)")}


def main(argv=None) -> dict:
  parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
  parser.add_argument("--quick", action="store_true")
  parser.add_argument("--full", action="store_true",
                      help="only the full FLUX.1-dev steps (minutes each), "
                      "to results/gpu_compile_full.md")
  parser.add_argument("--training", action="store_true",
                      help="only the whole training steps, to "
                      "results/gpu_compile_training.md")
  parser.add_argument("--name", default=None,
                      help="the results' file name (default gpu_compile, "
                      "gpu_compile_full or gpu_compile_training)")
  parser.add_argument("--target", nargs="+", default=["h200", "h100"],
                      choices=sorted(TARGETS))
  parser.add_argument("--check", action="store_true",
                      help="exit 1 if a library step breaks a promise")
  args = parser.parse_args(argv)
  tables = []
  for target in args.target:
    tables += run_target(target, args.quick, args.full, args.training)
  markdown = "\n".join(to_markdown(t) for t in tables)
  name = args.name or ("gpu_compile_full" if args.full else
                       "gpu_compile_training" if args.training else
                       "gpu_compile")
  report.save(name, markdown, {"tables": tables}, args.quick)
  failures = [f for t in tables for f in check(t)]
  for f in failures:
    print("FAIL:", f)
  if args.check and failures:
    sys.exit(1)
  return {"tables": tables}


if __name__ == "__main__":
  main()

"""Host buffers of a streamed stack: what XLA:GPU's schedule makes of each
layout, without a GPU.

    pip install -e ".[gpu-aot]"
    python -m benchmarks.host_buffers [--target h200] [--tag quick]

``stream_blocks`` gives every stacked leaf in host memory a spare buffer
(``ok.blockwise.DoubleBuffer``): the backward loop reads from one and writes
into the other, so its copies hide behind the compute, at twice the host
memory. This asks whether another layout keeps that speed with one copy of
the stack. A loop shaped like ``blockwise_step``'s backward loop over ``n``
blocks of 4096 x 4096 bfloat16 weights: each iteration computes with the
block fetched one iteration earlier (a chain of gemms, 1.4 ms), fetches the
next block from host memory and writes the block computed one iteration
earlier back (one behind). The layouts:

* ``spare``: read one host array, write the other (what ``stream_blocks``
  does);
* ``one buffer, fetch after the write``: one host array; the fetch reads
  the array the write-back produced (``stream_blocks(...,
  spare_buffers=False)``);
* ``one buffer, fetch before the write``: the fetch reads the array as it
  was before the iteration's write-back;
* ``three interleaved arrays``: block ``i`` in array ``i % 3``, the loop
  unrolled by three, so a fetch and a write-back never touch one array in
  one iteration; one copy of the stack;
* ``three arrays rotated``: the same three arrays, not unrolled: the loop
  carries them rotated by one each iteration;
* ``one buffer, the write after the fetch completes``: the fetch before the
  write-back, which an ``optimization_barrier`` orders after it.

And the handoff between a streamed step's loops: two stacks' spare-buffer
loops one after the other, as written (each loop's first fetch and last
write-back outside it) and with each loop's first and last iterations
peeled out of the while loop.

Compiled deviceless (nothing runs), with the streamed step's compiler
options. Read from each program: host memory (arguments and temporaries),
the ``benchmarks.timeline`` model (gemms at 700 TFLOP/s, PCIe at 50 GB/s per
direction, other kernels free; copies of host arrays on the compute stream
at the PCIe rate), the share of each direction hidden behind compute, and
the bytes of host arrays XLA copies whole. Estimates from the schedule, not
measurements. Writes ``benchmarks/results/host_buffers{,_<tag>}.{md,json}``.
"""

from __future__ import annotations

import os

if __name__ == "__main__":  # before jax is imported: no CUDA driver is touched
  os.environ["JAX_PLATFORMS"] = "cpu"

import argparse
import datetime
from typing import Any, Callable

import jax
import jax.numpy as jnp
from jax import lax

import optax_kahan as ok
from benchmarks import gpu_compile
from benchmarks import report
from benchmarks import timeline

GEMMS = 7  # per block


def _host(x):
  return jax.device_put(x, jax.memory.Space.Host)


def _device(x):
  return jax.device_put(x, jax.memory.Space.Device)


def _block(w, a):
  """A block's compute (a chain of gemms) and its new weights."""
  for _ in range(GEMMS - 1):
    a = jnp.tanh(a @ w)
  return w + 0.1 * (a.T @ a).astype(w.dtype), a


def _at(x, i):
  return lax.dynamic_index_in_dim(x, i, keepdims=False)


def _put(x, v, i):
  return lax.dynamic_update_index_in_dim(x, _host(v), i, 0)


def _one_array(n: int, spare: bool, fetch_first: bool, ordered: bool = False,
               peel: bool = False) -> Callable:
  """The loop over one host array, or a read array and a spare; ``ordered``:
  the write-back waits for the fetch (an ``optimization_barrier``); ``peel``:
  the first iteration (no write-back) and the last (no fetch) outside the
  while loop, which otherwise writes back block ``n - 1``'s old values
  first and fetches block 0 twice."""
  last = n - 1

  def loop(read, written, a):
    def body(j, carry, write=True, fetch=True):
      written, a, staged, pending = carry
      i = last - j
      ahead = staged
      get = lambda x: _device(_at(x, jnp.maximum(i - 1, 0)))
      if fetch_first and fetch:
        ahead = get(read if spare else written)
        if ordered:
          written, ahead = lax.optimization_barrier((written, ahead))
      if write:
        written = _put(written, pending, jnp.minimum(i + 1, last))
      if not fetch_first and fetch:
        ahead = get(read if spare else written)
      new, a = _block(staged, a)
      return written, a, ahead, new

    staged = _device(read[last])  # also the first write-back's old values
    carry = (written, a, staged, staged)
    if peel:
      carry = body(0, carry, write=False)
      carry = lax.fori_loop(1, last, body, carry)
      carry = body(last, carry, fetch=False)
    else:
      carry = lax.fori_loop(0, n, body, carry)
    written, a, _, pending = carry
    return _put(written, pending, 0), a

  if spare:  # both buffers come back, as blockwise_step returns a pair
    return lambda read, written, a: (read, *loop(read, written, a))
  return lambda w, a: loop(w, w, a)


def _lane_row(i: int, g: Any) -> tuple[int, Any]:
  """Block ``3 g + i`` (``i`` static): its array and row."""
  return i % 3, g + i // 3


def _interleaved(n: int) -> Callable:
  """Block ``i`` in array ``i % 3``, row ``i // 3``; the loop unrolled by
  three, the last three blocks (the first of the backward loop, with no
  write-back before it) outside it."""

  def sub(lanes, a, staged, pending, i, g):
    if pending is not None:
      r, k = _lane_row(i + 1, g)
      lanes = [_put(x, pending, k) if q == r else x
               for q, x in enumerate(lanes)]
    r, k = _lane_row(i - 1, g)
    ahead = _device(_at(lanes[r], jnp.maximum(k, 0)))
    new, a = _block(staged, a)
    return lanes, a, ahead, new

  def loop(l0, l1, l2, a):
    lanes, groups = [l0, l1, l2], n // 3 - 1
    staged, pending = _device(_at(l2, groups)), None
    for r in (2, 1, 0):
      lanes, a, staged, pending = sub(lanes, a, staged, pending, r, groups)

    def body(k, carry):
      for r in (2, 1, 0):
        carry = sub(*carry, r, groups - 1 - k)
      return carry

    lanes, a, _, pending = lax.fori_loop(0, groups, body,
                                         (lanes, a, staged, pending))
    return (_put(lanes[0], pending, 0), lanes[1], lanes[2], a)

  return loop


def _rotated(n: int) -> Callable:
  """The three arrays carried as (block i - 1's, i's, i + 1's), rotated by
  one each iteration; not unrolled."""
  last = n - 1

  def loop(l0, l1, l2, a):
    lanes = (l0, l1, l2)
    carried = tuple(lanes[(last - 1 + p) % 3] for p in range(3))

    def body(j, carry):
      (before, here, behind), a, staged, pending = carry
      i = last - j
      behind = _put(behind, pending, jnp.minimum((i + 1) // 3, n // 3 - 1))
      ahead = _device(_at(before, jnp.maximum(i - 1, 0) // 3))
      new, a = _block(staged, a)
      return (behind, before, here), a, ahead, new

    # the first write-back (block n, none) rewrites block n - 3's values
    old = _device(_at(carried[2], n // 3 - 1))
    staged = _device(_at(carried[1], last // 3))
    carried, a, _, pending = lax.fori_loop(0, n, body,
                                           (carried, a, staged, old))
    lanes = {(last - 1 + p - n) % 3: x for p, x in enumerate(carried)}
    lanes[0] = _put(lanes[0], pending, 0)
    return (lanes[0], lanes[1], lanes[2], a)

  return loop


def layouts(n: int) -> dict[str, tuple[Callable, int, int]]:
  """name: (loop, host arrays of the whole stack, of a third of it)."""
  return {
      "spare": (_one_array(n, True, False), 2, 0),
      "one buffer, fetch after the write": (_one_array(n, False, False), 1, 0),
      "one buffer, fetch before the write": (_one_array(n, False, True), 1, 0),
      "one buffer, the write after the fetch completes": (
          _one_array(n, False, True, ordered=True), 1, 0),
      "three interleaved arrays, unrolled by three": (_interleaved(n), 0, 3),
      "three arrays rotated in the loop": (_rotated(n), 0, 3),
  }


def two_stacks(n: int) -> dict[str, Callable]:
  """name: two stacks' spare-buffer loops, one after the other, as a
  streamed step's parts (each loop's first fetch and last write-back are
  outside it), or with each loop's first and last iterations peeled."""
  def twice(loop):
    def both(r1, w1, r2, w2, a):
      r1, w1, a = loop(r1, w1, a)
      return (r1, w1, *loop(r2, w2, a))
    return both
  return {"two loops": twice(_one_array(n, True, False)),
          "two loops, first and last iterations peeled": twice(
              _one_array(n, True, False, peel=True))}


def compile_layout(mesh, loop: Callable, whole: int, thirds: int, n: int,
                   d: int) -> dict[str, Any]:
  device = jax.NamedSharding(mesh.abstract_mesh, jax.P())
  host = jax.NamedSharding(mesh.abstract_mesh, jax.P(),
                           memory_kind="pinned_host")
  stack = lambda rows: jax.ShapeDtypeStruct((rows, d, d), jnp.bfloat16,
                                            sharding=host)
  args = ([stack(n)] * whole + [stack(n // 3)] * thirds
          + [jax.ShapeDtypeStruct((d, d), jnp.bfloat16, sharding=device)])
  compiled = gpu_compile.compile_step(
      loop, tuple(args), mesh, donate=tuple(range(len(args) - 1)),
      compiler_options=ok.blockwise.STREAMING_COMPILER_OPTIONS)
  m = compiled.memory_analysis()
  t = timeline.model(compiled.as_text())
  return {"host_bytes": m.host_argument_size_in_bytes
                        + m.host_temp_size_in_bytes,
          "stack_bytes": n * d * d * 2, **t.as_dict()}


def to_markdown(r: dict) -> str:
  lines = [
      f"Compiled for {r['target_name']}, not run ({r['date']}, jax "
      f"{r['jax']}): a loop over {r['n']} blocks of {r['d']} x {r['d']} "
      f"bfloat16 weights in host memory, {GEMMS} gemms per block, each block "
      "fetched one iteration ahead and written back one behind, with "
      "`ok.blockwise.STREAMING_COMPILER_OPTIONS`. Modeled by "
      "`benchmarks.timeline` (gemms at "
      f"{timeline.GEMM_FLOPS / 1e12:.0f} TFLOP/s, PCIe "
      f"{timeline.PCIE / 1e9:.0f} GB/s per direction, copies of host arrays "
      "on the compute stream at the PCIe rate): an estimate. Host memory: "
      "arguments and temporaries, over the stack's bytes.", "",
      "| layout | host memory | modeled ms | over the gemms | H2D hidden | "
      "D2H hidden | host arrays copied, GB |", "|---|---|---|---|---|---|---|"]
  for name, v in r["rows"].items():
    lines.append(
        f"| {name} | {v['host_bytes'] / v['stack_bytes']:.2f}x | "
        f"{v['step_s'] * 1e3:.1f} | {v['step_s'] / v['gemm_s']:.2f}x | "
        f"{round(100 * v['h2d_hidden'])}% | {round(100 * v['d2h_hidden'])}% | "
        f"{v['host_copy_bytes'] / 1e9:.1f} |")
  lines += [
      "", f"Two stacks of {r['n'] // 2} blocks, one loop after the other (a "
      "streamed step's parts), spare buffers: each loop's first fetch and "
      "last write-back lie outside it. Waits: the compute stream's, at each "
      "direction's transfers.", "",
      "| loops | modeled ms | over the gemms | H2D waits ms | D2H waits ms | "
      "H2D GB | D2H GB |", "|---|---|---|---|---|---|---|"]
  for name, v in r["handoff"].items():
    lines.append(
        f"| {name} | {v['step_s'] * 1e3:.2f} | "
        f"{v['step_s'] / v['gemm_s']:.2f}x | {v['h2d_wait_s'] * 1e3:.2f} | "
        f"{v['d2h_wait_s'] * 1e3:.2f} | {v['h2d_bytes'] / 1e9:.2f} | "
        f"{v['d2h_bytes'] / 1e9:.2f} |")
  return "\n".join(lines) + "\n"


def main(argv=None) -> dict:
  parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
  parser.add_argument("--tag", default="",
                      help="a suffix for the results' names")
  parser.add_argument("--target", default="h200",
                      choices=sorted(gpu_compile.TARGETS))
  parser.add_argument("--n", type=int, default=12,
                      help="blocks (a multiple of 3)")
  args = parser.parse_args(argv)
  if args.n % 3 or args.n < 6:
    parser.error("--n must be a multiple of 3, at least 6")
  d = 4096
  mesh = gpu_compile.gpu_mesh(args.target)
  rows, handoff = {}, {}
  for name, (loop, whole, thirds) in layouts(args.n).items():
    rows[name] = compile_layout(mesh, loop, whole, thirds, args.n, d)
    print(f"  {name}: {rows[name]['step_s'] * 1e3:.1f} ms", flush=True)
  for name, loop in two_stacks(args.n // 2).items():
    handoff[name] = compile_layout(mesh, loop, 4, 0, args.n // 2, d)
    print(f"  {name}: {handoff[name]['step_s'] * 1e3:.1f} ms", flush=True)
  r = {"target_name": mesh.devices.flat[0].device_kind,
       "jax": jax.__version__, "date": datetime.date.today().isoformat(),
       "n": args.n, "d": d, "rows": rows, "handoff": handoff}
  report.save("host_buffers" + (f"_{args.tag}" if args.tag else ""),
              to_markdown(r), r)
  return r


if __name__ == "__main__":
  main()

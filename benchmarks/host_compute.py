"""Does XLA's GPU compiler run an update on the host inside the jitted step?

    pip install -e ".[gpu-aot]"
    python -m benchmarks.host_compute [--target h200] [--n 4096]

A spike for updating streamed blocks in host memory (ZeRO-Offload's CPU
step): one step that computes a gradient on the device (a gemm), sends it to
host memory, runs an Adam update there on weights and moments that live in
host memory (``jax.experimental.compute_on.compute_on("device_host")``), and
then computes more on the device (an independent gemm, standing in for the
next block's backward). Compiled for an H200 without a GPU (deviceless),
nothing run. Two variants: the update's hyperparameters as Python floats
(constants) and as a small array in host memory. What is read from each
compiled program:

* whether it compiles, and how the host computation appears (an
  asynchronous call on the host execution thread: ``call-start`` /
  ``call-done``);
* its operands in device memory (which the host would have to read over
  PCIe), with their bytes;
* the copies of its outputs inside host memory, with their bytes;
* the schedule: where the independent device gemm sits against the host
  call (before its start, between start and done, or after its done: on a
  GPU a ``*-done`` is where the device stream waits);
* the device peak (``compiled.memory_analysis()``).

Writes ``benchmarks/results/host_compute.{md,json}``.
"""

from __future__ import annotations

import argparse
import datetime
import json
import os
import pathlib

os.environ.setdefault("JAX_PLATFORMS", "cpu")

import inspect  # noqa: E402

import jax  # noqa: E402
import jax.numpy as jnp  # noqa: E402
from jax.experimental.compute_on import compute_on  # noqa: E402

from benchmarks import gpu_compile  # noqa: E402

RESULTS = pathlib.Path(__file__).parent / "results"
HYPER = (0.9, 0.1, 0.999, 0.001, 1e-3, 1e-8)  # b1, 1-b1, b2, 1-b2, lr, eps


def _adam(w, m, v, g, c):
  m = c[0] * m + c[1] * g
  v = c[2] * v + c[3] * g * g
  return w - c[4] * m / (jnp.sqrt(v) + c[5]), m, v


def _on_host(fn, *args):
  """``fn(*args)`` computed on the host, its outputs in host memory: jax >=
  0.12's ``compute_on`` wraps a function and names the outputs' memory,
  earlier ones' is a context."""
  if "out_memory_spaces" in inspect.signature(compute_on).parameters:
    return compute_on(compute_type="device_host",
                      out_memory_spaces=jax.memory.Space.Host)(fn)(*args)
  with compute_on("device_host"):
    return fn(*args)


def _step(hyper_on_host: bool):
  host = jax.memory.Space.Host

  def step(w, m, v, x, a, c):
    g = jax.device_put(x @ a, host)  # this block's gradient, sent out
    w, m, v = _on_host(_adam, w, m, v, g, c if hyper_on_host else HYPER)
    y = jnp.tanh(x @ a) @ a  # the next block's backward, independent
    return w, m, v, y

  return step


def read_program(hlo: str) -> dict:
  """The host call, its device operands, its output copies and the
  schedule, from the compiled entry computation."""
  entry = gpu_compile.hlo_entry(hlo)  # (name, type, op, operands, index)
  types = {name: typ for name, typ, *_ in entry}
  order = {name: i for i, (name, *_) in enumerate(entry)}
  starts = [e for e in entry  # an asynchronous call that is not a copy
            if e[2].endswith("-start") and e[2] != "copy-start"]
  row = {"host_calls": len(starts),
         "host_execute": hlo.count('"HostExecute"')}
  if not starts:
    return row
  start = starts[0]
  done = next(e for e in entry if e[2].endswith("-done")
              and start[0] in e[3])
  device_ops = [o for o in start[3] if "S(5)" not in types.get(o, "S(5)")]
  row["device_operands"] = len(device_ops)
  row["device_operand_bytes"] = sum(gpu_compile.type_bytes(types[o])
                                    for o in device_ops)
  outs = {e[0] for e in entry if e[2] == "get-tuple-element"
          and done[0] in e[3]}
  copies = [e for e in entry if e[2] == "copy" and set(e[3]) & outs]
  row["host_output_copies"] = len(copies)
  row["host_output_copy_bytes"] = sum(gpu_compile.type_bytes(e[1])
                                      for e in copies)
  gemms = [e for e in entry if "gemm" in e[0] or "dot" in e[0]]
  last = gemms[-1] if gemms else None
  if last is None:
    row["independent_gemm"] = "none"
  elif order[last[0]] < order[start[0]]:
    row["independent_gemm"] = "before the call's start"
  elif order[last[0]] < order[done[0]]:
    row["independent_gemm"] = "between start and done"
  else:
    row["independent_gemm"] = "after the call's done"
  row["d2h_copies"] = sum(1 for e in entry if e[2] == "copy-start")
  return row


def compile_variant(mesh, n: int, hyper_on_host: bool) -> dict:
  device = jax.NamedSharding(mesh.abstract_mesh, jax.P())
  host = jax.NamedSharding(mesh.abstract_mesh, jax.P(),
                           memory_kind="pinned_host")
  big = lambda s: jax.ShapeDtypeStruct((n, n), jnp.float32, sharding=s)
  hyper = jax.ShapeDtypeStruct((len(HYPER),), jnp.float32, sharding=host)
  with jax.set_mesh(mesh):
    jitted = jax.jit(_step(hyper_on_host),
                     out_shardings=(host, host, host, device),
                     donate_argnums=(0, 1, 2))
    try:
      compiled = jitted.lower(big(host), big(host), big(host), big(device),
                              big(device), hyper).compile()
    except Exception as e:  # report what XLA says, do not hide it
      return {"compiles": False, "error": f"{type(e).__name__}: {e}"[:500]}
  mem = compiled.memory_analysis()
  row = {"compiles": True, **read_program(compiled.as_text())}
  row["device_peak_bytes"] = (mem.argument_size_in_bytes
                              + mem.output_size_in_bytes
                              - mem.alias_size_in_bytes
                              + mem.temp_size_in_bytes)
  return row


def to_markdown(r: dict) -> str:
  lines = [f"Compiled for {r['target_name']}, not run ({r['date']}, jax "
           f"{r['jax']}). One step: a gemm's result ({r['n']} x {r['n']} "
           "float32) sent to host memory, an Adam update of host weights "
           "and moments under `compute_on(\"device_host\")`, an independent "
           "gemm on the device.", "",
           "| hyperparameters | compiles | host calls | device operands "
           "(MB) | host output copies (MB) | independent gemm | device "
           "peak MB |", "|---|---|---|---|---|---|---|"]
  for name, v in r["rows"].items():
    if not v["compiles"]:
      lines.append(f"| {name} | no: {v['error'][:80]} | | | | | |")
      continue
    lines.append(
        f"| {name} | yes | {v['host_calls']} | {v['device_operands']} "
        f"({v['device_operand_bytes'] / 1e6:.0f}) | "
        f"{v['host_output_copies']} ({v['host_output_copy_bytes'] / 1e6:.0f})"
        f" | {v['independent_gemm']} | {v['device_peak_bytes'] / 1e6:.0f} |")
  return "\n".join(lines) + "\n"


def main(argv=None) -> dict:
  parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
  parser.add_argument("--target", default="h200",
                      choices=sorted(gpu_compile.TARGETS))
  parser.add_argument("--n", type=int, default=4096)
  parser.add_argument("--tag", default="")
  args = parser.parse_args(argv)
  mesh = gpu_compile.gpu_mesh(args.target)
  rows = {"Python floats": compile_variant(mesh, args.n, False),
          "an array in host memory": compile_variant(mesh, args.n, True)}
  r = {"target_name": mesh.devices.flat[0].device_kind, "jax": jax.__version__,
       "date": datetime.date.today().isoformat(), "n": args.n, "rows": rows}
  md = to_markdown(r)
  print(md)
  name = "host_compute" + (f"_{args.tag}" if args.tag else "")
  (RESULTS / f"{name}.md").write_text(md)
  (RESULTS / f"{name}.json").write_text(json.dumps(r, indent=1))
  return r


if __name__ == "__main__":
  main()

"""Where a backend's ``kahan`` step departs from the CPU's, part by part, leaf by leaf.

The H200 run of 2026-12-04 (jax 0.11.2) returned every ``kahan`` leaf's bf16
weight right and its residual lost. This diagnosis separates the causes in
one call. For each variant (a child process each):

- ``default``: the program as users run it;
- ``command buffers off``: ``XLA_FLAGS=--xla_gpu_enable_command_buffer=``
  (XLA:GPU runs the step as kernels, not as one CUDA graph);
- ``split apart``: an optimization barrier between each new float32 weight
  and its split, so that no fusion has both uint16 and float32 outputs;

it runs a teacher-forced first step of a few corpus programs on the default
device and on the CPU, residuals in host memory and on the device, and
compares, for every leaf, each of

- ``split`` / ``split (jit)``: ``kahan_from_float32`` of optax's float32
  weights, eager and jitted;
- ``update``, ``residual``, ``state``: the jitted ``kahan(tx).update``'s
  outputs (its per-leaf rows), from the same (CPU-made) inputs;
- ``apply``: the eager ``optax.apply_updates`` of the bf16 weights;
- ``merge`` / ``merge (jit)``: ``kahan_to_float32`` of the CPU's own
  outputs, eager and jitted;
- ``whole tree``: the residuals of ``kahan``'s whole-tree program (merge
  all, ``tx.update`` on the tree, split all) against the CPU's;
- ``vs optax``: the merged weight against optax's float32 weight (ulps),
  for the rows and for the whole-tree program.

It prints one line per variant, program and memory with the first leaf each
part differs at, jax's version and the device first, and saves what it
printed to ``benchmarks/results/exactness_<date>_<device>_jax<version>.txt``.
``--hlo-dir`` writes each compiled step's HLO for the default device.

Run: ``python -m benchmarks.exactness [--hlo-dir DIR] [--variant NAME]``
"""
from __future__ import annotations

import argparse
import datetime
import functools
import os
import re
import subprocess
import sys

import jax
import jax.numpy as jnp
import optax

import optax_kahan as ok
from optax_kahan._src import kahan as kahan_module
from optax_kahan._src.known_answer import _first_difference  # bit for bit
from optax_kahan._src.known_answer import _ulps  # of |old| + |new|
from benchmarks import corpus

PROGRAMS = ["adamw(mask by path)", "ok.prodigy_factored", "sgd"]
VARIANTS = {
    "default": {},
    "command buffers off": {"XLA_FLAGS": "--xla_gpu_enable_command_buffer="},
    "split apart": {},  # sets kahan's _SPLIT_APART in the child
}
PARTS = ("split", "split (jit)", "update", "residual", "state", "apply",
         "merge", "merge (jit)", "whole tree")
RESULTS = os.path.join(os.path.dirname(__file__), "results")


def _on(device, tree):
  """``tree`` on ``device``, each array in the memory it was in."""
  def put(a):
    kind = getattr(getattr(a, "sharding", None), "memory_kind", None)
    return jax.device_put(a, jax.sharding.SingleDeviceSharding(
        device, memory_kind=kind))
  return jax.tree.map(put, tree)


def _inputs(name):
  """Optax's float32 weights, gradients and inner state, made on the CPU."""
  with jax.default_device(jax.devices("cpu")[0]):
    x = jax.tree.map(lambda p: p.astype(jnp.float32), corpus.params())
    return x, corpus.grads(0), corpus.PROGRAMS[name]().init(x)


def _parts(name, offload, device, cpu_parts=None):
  """The step's parts, each computed on ``device`` from the CPU's inputs
  (the merges from ``cpu_parts``' outputs when given)."""
  x, g, inner = _inputs(name)
  with jax.default_device(device):
    tx = ok.kahan(corpus.PROGRAMS[name](), offload=offload)
    split = ok.kahan_from_float32(_on(device, x), offload=offload)
    split_jit = jax.jit(functools.partial(ok.kahan_from_float32,
                                          offload=offload))(_on(device, x))
    p_d, res_d = split
    state = ok.KahanState(res_d, _on(device, inner))
    step = jax.jit(tx.update)
    u, new = step(_on(device, g), state, p_d)
    applied = optax.apply_updates(p_d, u)
    src = cpu_parts or {"apply": applied, "residual": new.residuals}
    outs = (_on(device, src["apply"]), _on(device, src["residual"]))
    whole = jax.jit(functools.partial(
        kahan_module._whole_tree, optax.with_extra_args_support(
            corpus.PROGRAMS[name]()), "nearest", offload))
    wu, wnew = whole(_on(device, g), state, p_d)
    whole_merged = ok.kahan_to_float32(optax.apply_updates(p_d, wu),
                                       wnew.residuals)
    return {"split": split, "split (jit)": split_jit, "update": u,
            "residual": new.residuals, "state": new.inner_state,
            "apply": applied, "merge": ok.kahan_to_float32(*outs),
            "merge (jit)": jax.jit(ok.kahan_to_float32)(*outs),
            "whole tree": wnew.residuals, "_merged": ok.kahan_to_float32(
                applied, new.residuals), "_whole_merged": whole_merged,
            "_step": step, "_args": (_on(device, g), state, p_d)}


def _hlo_file(hlo_dir, variant, name, offload):
  stem = re.sub(r"[^A-Za-z0-9]+", "_", f"{variant}_{name}_{offload}")
  return os.path.join(hlo_dir, f"{stem.strip('_')}.hlo.txt")


def run_variant(variant, hlo_dir=""):
  """The lines of one variant, in this process."""
  if variant == "split apart":
    kahan_module._SPLIT_APART = True
  device, cpu = jax.devices()[0], jax.devices("cpu")[0]
  lines = []
  for name in PROGRAMS:
    for offload in (False, True):
      there = _parts(name, offload, cpu)
      here = _parts(name, offload, device, there)
      x, g, inner = _inputs(name)
      u, _ = jax.jit(corpus.PROGRAMS[name]().update)(g, inner, x)
      want = optax.apply_updates(x, u)
      line = []
      for part in PARTS:
        diff = _first_difference(here[part], there[part])
        line.append(f"{part} " + ("same" if diff is None else
                                  f"DIFFERS at {diff}"))
      ulps = lambda merged: _ulps(merged, want, x)[0]
      line.append(f"vs optax {ulps(here['_merged']):.1f} ulps, whole tree "
                  f"{ulps(here['_whole_merged']):.1f} (cpu "
                  f"{ulps(there['_merged']):.1f})")
      lines.append(f"{variant} | {name}, offload={offload}: "
                   + "; ".join(line))
      print(lines[-1], flush=True)
      if hlo_dir:
        os.makedirs(hlo_dir, exist_ok=True)
        with open(_hlo_file(hlo_dir, variant, name, offload), "w") as f:
          f.write(here["_step"].lower(*here["_args"]).compile().as_text())
  return lines


def _child(variant, hlo_dir):
  """One variant in a child process (XLA reads its flags at start)."""
  env = dict(os.environ)
  for key, value in VARIANTS[variant].items():
    env[key] = f"{env[key]} {value}" if env.get(key) else value
  args = [sys.executable, "-m", "benchmarks.exactness", "--variant", variant]
  out = subprocess.run(args + (["--hlo-dir", hlo_dir] if hlo_dir else []),
                       env=env, capture_output=True, text=True, timeout=600,
                       cwd=os.path.dirname(os.path.dirname(__file__)))
  lines = [l for l in out.stdout.splitlines() if l.startswith(variant)]
  if out.returncode:
    lines.append(f"{variant} | FAILED (exit {out.returncode}): "
                 + " / ".join(out.stderr.strip().splitlines()[-3:]))
  return lines


def main(argv=None):
  parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
  parser.add_argument("--hlo-dir", default="")
  parser.add_argument("--variant", choices=list(VARIANTS), default=None,
                      help="run one variant in this process")
  parser.add_argument("--out", default=None, help="the results file (default:"
                      " benchmarks/results/exactness_<date>_<device>_jax<v>"
                      ".txt; '' for none)")
  args = parser.parse_args(argv)
  if args.variant:
    run_variant(args.variant, args.hlo_dir)
    return
  device = jax.devices()[0]
  head = (f"{datetime.date.today()}: jax {jax.__version__}, optax "
          f"{optax.__version__}, {device.device_kind} "
          f"({jax.default_backend()}) against the CPU")
  print(head, flush=True)
  lines = [head]
  for variant in VARIANTS:
    for line in _child(variant, args.hlo_dir):
      print(line, flush=True)
      lines.append(line)
  out = args.out
  if out is None:
    kind = re.sub(r"[^A-Za-z0-9]+", "_", device.device_kind).strip("_")
    out = os.path.join(RESULTS, f"exactness_{datetime.date.today()}_{kind}_"
                       f"jax{jax.__version__}.txt")
  if out:
    with open(out, "w") as f:
      f.write("\n".join(lines) + "\n")
    print(f"saved {out}")


if __name__ == "__main__":
  main()

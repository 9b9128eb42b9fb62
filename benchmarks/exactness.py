"""Where a backend's ``kahan`` step departs from the CPU's, leaf by leaf.

``tests/test_same_answer.py`` checks ``kahan(tx)`` against optax's float32
program on whatever backend runs it. When it fails on a GPU and passes on the
CPU, this script says which part differs: it runs the same teacher-forced
first step of a few corpus programs on the default device and on the CPU and
compares, for every leaf, each of

- ``split``: the eager ``kahan_from_float32`` of optax's float32 weights;
- ``update``, ``residual``, ``state``: the jitted ``kahan(tx).update``'s
  outputs, from the same (CPU-made) inputs;
- ``apply``: the eager ``optax.apply_updates`` of the bf16 weights;
- ``merge``: the eager ``kahan_to_float32`` of the CPU's own outputs;
- ``vs optax``: the merged weight against optax's float32 weight (ulps).

It prints one line per program, memory and part, with the first leaf that
differs, and writes the compiled step's HLO for the default device to
``--hlo-dir`` for a look at what ran.

Run: ``python -m benchmarks.exactness [--hlo-dir DIR]``
"""
from __future__ import annotations

import argparse
import os

import jax
import jax.numpy as jnp
import numpy as np
import optax

import optax_kahan as ok
from benchmarks import corpus

PROGRAMS = ["adamw(mask by path)", "ok.prodigy_factored", "sgd"]


def _on(device, tree):
  return jax.tree.map(lambda a: jax.device_put(a, device), tree)


def _first_difference(a, b):
  """``(path, count)`` of the first leaf where ``a`` and ``b`` differ."""
  for (path, x), y in zip(jax.tree_util.tree_flatten_with_path(a)[0],
                          jax.tree.leaves(b)):
    x, y = (np.asarray(t).reshape(-1) for t in (x, y))  # bit for bit
    bytes_of = lambda t: t.view(np.uint8).reshape(t.size, -1)
    differ = (bytes_of(x) != bytes_of(y)).any(axis=1)
    if differ.any():
      return jax.tree_util.keystr(path), int(differ.sum())
  return None


def _parts(name, offload, device):
  """The step's parts, each computed on ``device`` from the CPU's inputs."""
  cpu = jax.devices("cpu")[0]
  with jax.default_device(cpu):
    x = jax.tree.map(lambda p: p.astype(jnp.float32), corpus.params())
    g = corpus.grads(0)
    inner = corpus.PROGRAMS[name]().init(x)
  with jax.default_device(device):
    tx = ok.kahan(corpus.PROGRAMS[name](), offload=offload)
    split = ok.kahan_from_float32(_on(device, x), offload=offload)
    p_d, res_d = split
    state = ok.KahanState(res_d, _on(device, inner))
    step = jax.jit(tx.update)
    u, new = step(_on(device, g), state, p_d)
    applied = optax.apply_updates(p_d, u)
    merged = ok.kahan_to_float32(applied, new.residuals)
  return {"split": split, "update": u, "residual": new.residuals,
          "state": new.inner_state, "apply": applied, "merge": merged,
          "_step": step, "_args": (_on(device, g), state, p_d),
          "_x": x, "_g": g, "_inner": inner}


def _ulps(got, want, old):
  """The largest error in ulps of ``|old| + |want|`` over the leaves."""
  worst = 0.0
  for g, w, o in zip(*(jax.tree.leaves(t) for t in (got, want, old))):
    g, w, o = (np.asarray(a, np.float32) for a in (g, w, o))
    scale = np.spacing(np.abs(w) + np.abs(o))
    worst = max(worst, float(np.max(np.abs(g - w) / scale)))
  return worst


def main(argv=None):
  parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
  parser.add_argument("--hlo-dir", default="")
  args = parser.parse_args(argv)
  device = jax.devices()[0]
  cpu = jax.devices("cpu")[0]
  print(f"jax {jax.__version__}, {device.device_kind} against the CPU")
  for name in PROGRAMS:
    for offload in (False, True):
      here = _parts(name, offload, device)
      there = _parts(name, offload, cpu)
      tx = corpus.PROGRAMS[name]()
      u, _ = jax.jit(tx.update)(here["_g"], here["_inner"], here["_x"])
      want = optax.apply_updates(here["_x"], u)
      line = []
      for part in ("split", "update", "residual", "state", "apply",
                   "merge"):
        diff = _first_difference(here[part], there[part])
        line.append(f"{part} " + ("same" if diff is None else
                                  f"DIFFERS at {diff[0]} ({diff[1]})"))
      line.append(f"vs optax {_ulps(here['merge'], want, here['_x']):.1f} "
                  f"ulps (cpu {_ulps(there['merge'], want, here['_x']):.1f})")
      print(f"{name}, offload={offload}: " + "; ".join(line))
      if args.hlo_dir:
        os.makedirs(args.hlo_dir, exist_ok=True)
        text = here["_step"].lower(*here["_args"]).compile().as_text()
        file = f"{name.replace(' ', '_').replace('(', '').replace(')', '')}"
        with open(os.path.join(args.hlo_dir, f"{file}_{offload}.hlo.txt"),
                  "w") as f:
          f.write(text)


if __name__ == "__main__":
  main()

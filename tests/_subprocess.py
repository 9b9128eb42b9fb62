"""Runs JAX code in a fresh Python process with N fake CPU devices.

The pytest process keeps its single device: XLA reads
``--xla_force_host_platform_device_count`` once, at backend start-up, so
multi-device code runs in a child process. ``PRELUDE`` holds the small FSDP
training set-up the child scripts share (shapes, gradients, shardings, a
jitted step); a script prints one JSON line last, which ``run`` returns.
"""

from __future__ import annotations

import json
import os
import pathlib
import socket
import subprocess
import sys

ROOT = pathlib.Path(__file__).resolve().parents[1]


def env_for(devices: int) -> dict[str, str]:
  env = dict(os.environ)
  flags = [f for f in env.get("XLA_FLAGS", "").split()
           if not f.startswith("--xla_force_host_platform_device_count")]
  # XLA:CPU ends a process whose devices wait over 40 s at a collective; on a
  # loaded 2-core machine 8 fake devices' threads can lag that much, so the
  # limit is the test's own timeout instead.
  env["XLA_FLAGS"] = " ".join(
      flags + [f"--xla_force_host_platform_device_count={devices}",
               "--xla_cpu_collective_call_warn_stuck_timeout_seconds=120",
               "--xla_cpu_collective_call_terminate_timeout_seconds=900"])
  env["JAX_PLATFORMS"] = "cpu"
  env["PYTHONPATH"] = os.pathsep.join(
      [str(ROOT)] + [p for p in [env.get("PYTHONPATH")] if p])
  return env


def start(script: str, *args: str, devices: int = 8) -> subprocess.Popen:
  """Starts ``python -c PRELUDE + script args...``; see ``finish``."""
  return subprocess.Popen(
      [sys.executable, "-c", PRELUDE + script, *map(str, args)],
      env=env_for(devices), cwd=ROOT, stdout=subprocess.PIPE,
      stderr=subprocess.PIPE, text=True)


def finish(proc: subprocess.Popen, timeout: float = 120) -> dict:
  """Waits for ``proc``; returns its last stdout line parsed as JSON."""
  try:
    out, err = proc.communicate(timeout=timeout)
  except subprocess.TimeoutExpired:
    proc.kill()
    out, err = proc.communicate()
    raise AssertionError(f"child timed out\n{out[-3000:]}\n{err[-3000:]}")
  if proc.returncode != 0:
    raise AssertionError(
        f"child failed ({proc.returncode})\n{out[-3000:]}\n{err[-5000:]}")
  return json.loads(out.strip().splitlines()[-1])


def run(script: str, *args: str, devices: int = 8, timeout: float = 120
        ) -> dict:
  return finish(start(script, *args, devices=devices), timeout)


def free_port() -> int:
  with socket.socket() as s:
    s.bind(("127.0.0.1", 0))
    return s.getsockname()[1]


PRELUDE = r'''
import json, re, sys
import numpy as np
import jax, jax.numpy as jnp, optax
from jax.sharding import NamedSharding, PartitionSpec as P, AxisType
import optax_kahan as ok

SHAPES = {"w1": (256, 128), "b1": (128,), "w2": (128, 64), "scale": (64,)}
WIDE = ("scale",)  # a float32 leaf: no residual


def host_params(seed=0):
  rng = np.random.default_rng(seed)
  return {k: (rng.standard_normal(s) * 0.5).astype(np.float32)
          for k, s in SHAPES.items()}


def host_grads(steps, seed=1):
  rng = np.random.default_rng(seed)
  return [{k: (rng.standard_normal(s) * 10.0 ** rng.uniform(-3, 0)
               ).astype(np.float32) for k, s in SHAPES.items()}
          for _ in range(steps)]


def make_tx(name):
  if name == "adamw":
    return ok.kahan(optax.adamw(1e-3, weight_decay=1e-2))
  if name == "prodigy":
    return ok.kahan(ok.prodigy_factored())
  raise ValueError(name)


def make_mesh(mode, n=None):
  if mode == "single":
    return None
  n = n or jax.device_count()
  axis = AxisType.Explicit if mode == "explicit" else AxisType.Auto
  return jax.make_mesh((n,), ("fsdp",), axis_types=(axis,))


def spec(shape):
  return P("fsdp", *([None] * (len(shape) - 1)))


def place(tree, mesh, cast=True):
  """Host numpy tree -> arrays, FSDP-sharded on the leading axis (bf16 but WIDE)."""
  def one(k, a):
    a = a.astype(np.float32 if k in WIDE or not cast else jnp.bfloat16)
    if mesh is None:
      return jnp.asarray(a)
    return jax.make_array_from_callback(
        a.shape, NamedSharding(mesh, spec(a.shape)), lambda i: a[i])
  return {k: one(k, a) for k, a in tree.items()}


def _step(tx):
  def step(params, state, grads):
    updates, state = tx.update(grads, state, params)
    return optax.apply_updates(params, updates), state
  return step


def init_and_step(tx, params, mesh, mode):
  """The state and the jitted step for a mode: single, explicit or auto.

  auto: the state is made eagerly (zeros_like keeps each param's sharding;
  jax.jit(tx.init) would return it replicated) and the step's out_shardings
  are pinned to the inputs', so it compiles once.
  """
  if mode == "auto":
    state = tx.init(params)
    shard = lambda t: jax.tree.map(lambda x: x.sharding, t)
    step = jax.jit(_step(tx), out_shardings=(shard(params), shard(state)))
  else:
    state = jax.jit(tx.init)(params)
    step = jax.jit(_step(tx))
  return state, step


def exact(params, state):
  """float32 weights, gathered to numpy on every process."""
  w = ok.kahan_to_float32(params, ok.kahan_residuals(state))
  if jax.process_count() > 1:
    from jax.experimental import multihost_utils
    return {k: np.asarray(multihost_utils.process_allgather(v, tiled=True))
            for k, v in w.items()}
  return {k: np.asarray(v) for k, v in w.items()}


def collectives(hlo):
  """(op, dtype, element count) of every all-gather / all-to-all in ``hlo``."""
  out = []
  for m in re.finditer(
      r"= \(?([^=]*?)\)? (all-gather|all-to-all|collective-permute)"
      r"(?:-start)?\(", hlo):
    for dt, dims in re.findall(r"([a-z]+[0-9]+)\[([0-9,]*)\]", m.group(1)):
      n = int(np.prod([int(d) for d in dims.split(",") if d] or [1]))
      out.append((m.group(2), dt, n))
  return out


def emit(obj):
  print(json.dumps(obj))
'''

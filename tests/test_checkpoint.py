"""orbax-checkpoint round trips of params + optimizer state, residuals included.

A child process (8 devices, FSDP, Explicit mesh) trains K steps, saves params
and the whole optimizer state (the residuals are read from pinned host
memory), trains on to N and records the uninterrupted weights. New processes
restore onto 8 devices, onto 4, and onto 1, continue to N, and must match bit
for bit. Restoring with target ``ShapeDtypeStruct``s whose sharding carries
``memory_kind="pinned_host"`` puts the residuals straight back in host memory.
"""

import pytest

from _subprocess import run

K, N = 2, 4

COMMON = r'''
import orbax.checkpoint as ocp
K, N = KN
grads_np = host_grads(N)


def abstract(tree):
  """Restore targets: shape, dtype and sharding (memory kind included)."""
  return jax.tree.map(
      lambda x: jax.ShapeDtypeStruct(x.shape, x.dtype, sharding=x.sharding),
      tree)


def finish_run(params, state, step, mesh, out):
  for g in grads_np[K:]:
    params, state = step(params, state, place(g, mesh))
  np.savez(out, **exact(params, state))
'''.replace("KN", f"{K}, {N}")

SAVE = COMMON + r'''
ckpt, out = sys.argv[1], sys.argv[2]
mesh = make_mesh("explicit")
with jax.set_mesh(mesh):
  tx = make_tx("adamw")
  params = place(host_params(), mesh)
  state, step = init_and_step(tx, params, mesh, "explicit")
  for g in grads_np[:K]:
    params, state = step(params, state, place(g, mesh))
  mngr = ocp.StandardCheckpointer()
  mngr.save(f"{ckpt}/step", {"params": params, "opt_state": state})
  mngr.save(f"{ckpt}/f32", ok.kahan_to_float32(params, ok.kahan_residuals(state)))
  mngr.save(f"{ckpt}/bf16", params)   # a plain bf16 checkpoint, no residuals
  mngr.wait_until_finished()
  finish_run(params, state, step, mesh, f"{out}/uninterrupted.npz")
emit({"saved_kind": ok.kahan_residuals(state)["w1"].sharding.memory_kind})
'''

RESTORE = COMMON + r'''
ckpt, out = sys.argv[1], sys.argv[2]
mngr = ocp.StandardCheckpointer()
report = {}
for n in [int(a) for a in sys.argv[3:]]:
  mesh = make_mesh("explicit", n) if n > 1 else None
  with jax.set_mesh(mesh) if mesh is not None else _nullcontext():
    tx = make_tx("adamw")
    fresh = place(host_params(seed=9), mesh)  # only shapes and shardings
    state0, step = init_and_step(tx, fresh, mesh, "explicit" if mesh else "single")
    got = mngr.restore(f"{ckpt}/step",
                       abstract({"params": fresh, "opt_state": state0}))
    params, state = got["params"], got["opt_state"]
    res = ok.kahan_residuals(state)
    report[n] = {k: [r.sharding.memory_kind, len(r.sharding.device_set)]
                 for k, r in res.items() if r is not None}
    finish_run(params, state, step, mesh, f"{out}/restored_{n}.npz")
emit(report)
'''

IMPORT = r'''
like = place(host_params(), None)
tx = make_tx("adamw")
dev = jax.sharding.SingleDeviceSharding(jax.devices()[0])
# A float32 checkpoint: split it, no bit lost.
w32 = mngr.restore(f"{ckpt}/f32",
                   jax.tree.map(lambda x: jax.ShapeDtypeStruct(x.shape, jnp.float32, sharding=dev), like))
params, res = ok.kahan_from_float32({k: v for k, v in w32.items()})
# kahan_from_float32 also splits the float32 'scale' leaf: keep it float32.
params["scale"], res["scale"] = w32["scale"], None
state = ok.kahan_replace_residuals(tx.init(params), res)
back = ok.kahan_to_float32(params, ok.kahan_residuals(state))
f32_exact = all(bool(np.array_equal(np.asarray(back[k]).view(np.uint32),
                                    np.asarray(w32[k]).view(np.uint32))) for k in w32)
# A bf16 checkpoint has no residuals: they start at zero (kahan_init).
p16 = mngr.restore(f"{ckpt}/bf16", jax.tree.map(
    lambda x: jax.ShapeDtypeStruct(x.shape, x.dtype, sharding=dev), like))
state16 = tx.init(p16)
print("restored a bfloat16 checkpoint without residuals: the float32 weights "
      "start at their bfloat16 values (residuals = kahan_init(params))",
      file=sys.stderr)
x16 = ok.kahan_to_float32(p16, ok.kahan_residuals(state16))
bf16_zero = all(bool(np.all(np.asarray(r) == 0))
                for r in jax.tree.leaves(ok.kahan_residuals(state16)))
bf16_is_upcast = all(bool(np.array_equal(np.asarray(x16[k]),
                                         np.asarray(p16[k], np.float32))) for k in p16)
lost = float(np.max(np.abs(np.asarray(x16["w1"]) - np.asarray(w32["w1"]))))
emit({"restore": report, "f32_exact": f32_exact, "bf16_zero": bf16_zero,
      "bf16_is_upcast": bf16_is_upcast, "bf16_lost": lost,
      "kind": ok.kahan_residuals(state)["w1"].sharding.memory_kind})
'''

NULLCTX = "from contextlib import nullcontext as _nullcontext\n"


@pytest.fixture(scope="module")
def saved(tmp_path_factory):
  ckpt = tmp_path_factory.mktemp("ckpt")
  out = tmp_path_factory.mktemp("out")
  report = run(SAVE, ckpt, out, devices=8, timeout=300)
  assert report["saved_kind"] == "pinned_host"
  return ckpt, out


def _bits_equal(a_path, b_path):
  import numpy as np
  with np.load(a_path) as a, np.load(b_path) as b:
    assert sorted(a.files) == sorted(b.files)
    for k in a.files:
      np.testing.assert_array_equal(a[k].view(np.uint32), b[k].view(np.uint32),
                                    err_msg=k)


def test_restore_on_8_and_4_devices_continues_bit_for_bit(saved):
  ckpt, out = saved
  report = run(NULLCTX + RESTORE, ckpt, out, 8, 4, devices=8, timeout=300)
  for n in ("8", "4"):
    for k, (kind, ndev) in report[n].items():
      assert kind == "pinned_host", (n, k)
      assert ndev == int(n)
    _bits_equal(out / f"restored_{n}.npz", out / "uninterrupted.npz")


@pytest.fixture(scope="module")
def one_device(saved):
  """A 1-device process: the 8-device checkpoint, then the import recipes."""
  ckpt, out = saved
  script = NULLCTX + RESTORE.replace("emit(report)", "") + IMPORT
  return run(script, ckpt, out, 1, devices=1, timeout=300)


def test_restore_in_a_one_device_process(saved, one_device):
  _, out = saved
  assert all(kind == "pinned_host"
             for kind, _ in one_device["restore"]["1"].values())
  _bits_equal(out / "restored_1.npz", out / "uninterrupted.npz")


def test_float32_and_bf16_checkpoints_import(one_device):
  r = one_device
  assert r["f32_exact"] and r["kind"] == "pinned_host"
  assert r["bf16_zero"] and r["bf16_is_upcast"]
  assert r["bf16_lost"] > 0  # what a residual-free checkpoint drops


def test_package_does_not_import_orbax():
  import subprocess
  import sys
  code = "import sys, optax_kahan; print('orbax' in ' '.join(sys.modules))"
  out = subprocess.run([sys.executable, "-c", code], capture_output=True,
                       text=True, check=True).stdout.strip()
  assert out == "False"

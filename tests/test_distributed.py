"""Two JAX processes on localhost (4 CPU devices each, gloo collectives).

``jax.distributed.initialize`` with the coordinator on 127.0.0.1; the mesh
spans the 8 devices of both processes, each process holds (and parks in its
own pinned host memory) only its shards of params, state and residuals. The
weights must agree with the same training in one process with 8 devices.
"""

import numpy as np
import pytest

from _subprocess import finish, free_port, start

SCRIPT = r'''
out, pid, nproc, port = sys.argv[1], int(sys.argv[2]), int(sys.argv[3]), sys.argv[4]
if nproc > 1:
  jax.config.update("jax_cpu_collectives_implementation", "gloo")
  jax.distributed.initialize(f"127.0.0.1:{port}", num_processes=nproc,
                             process_id=pid, initialization_timeout=60)
mesh = make_mesh("explicit")
report = {"processes": jax.process_count(), "devices": jax.device_count(),
          "local": jax.local_device_count()}
grads_np = host_grads(3)
with jax.set_mesh(mesh):
  for name in ("adamw", "prodigy"):
    tx = make_tx(name)
    params = place(host_params(), mesh)
    state, step = init_and_step(tx, params, mesh, "explicit")
    for g in grads_np:
      params, state = step(params, state, place(g, mesh))
    res = ok.kahan_residuals(state)["w1"]
    report[name] = {
        "memory_kind": res.sharding.memory_kind,
        "local_shards": len(res.addressable_shards),
        "local_rows": sorted(s.index[0].start for s in res.addressable_shards)}
    w = exact(params, state)  # a collective: every process takes part
    if pid == 0:
      np.savez(f"{out}/{name}_{nproc}.npz", **w)
if nproc > 1:
  jax.distributed.shutdown()
emit(report)
'''


def _two_processes(tmp_path):
  port = free_port()
  procs = [start(SCRIPT, tmp_path, pid, 2, port, devices=4) for pid in (0, 1)]
  try:
    return [finish(p, timeout=120) for p in procs]
  finally:
    for p in procs:
      if p.poll() is None:
        p.kill()
        p.communicate()


@pytest.mark.slow  # 15 s: three child processes
def test_two_processes_agree_with_one(tmp_path):
  """Once in some fifteen runs on a 2-core machine, the pair hung in gloo
  (connected, then no progress) and was killed; it then gets one more try
  on a fresh port. The reference runs after the pair, not beside it."""
  try:
    reports = _two_processes(tmp_path)
  except AssertionError as e:
    if "timed out" not in str(e):
      raise
    reports = _two_processes(tmp_path)
  ref = finish(start(SCRIPT, tmp_path, 0, 1, 0, devices=8), timeout=180)
  assert ref["processes"] == 1 and ref["devices"] == 8
  for pid, r in enumerate(reports):
    assert (r["processes"], r["devices"], r["local"]) == (2, 8, 4)
    for name in ("adamw", "prodigy"):
      assert r[name]["memory_kind"] == "pinned_host"
      assert r[name]["local_shards"] == 4  # only this process's residuals
      assert r[name]["local_rows"] == [32 * (4 * pid + i) for i in range(4)]
  for name in ("adamw", "prodigy"):
    with np.load(tmp_path / f"{name}_2.npz") as a, \
         np.load(tmp_path / f"{name}_1.npz") as b:
      for k in b.files:
        if name == "adamw":
          np.testing.assert_array_equal(a[k].view(np.uint32),
                                        b[k].view(np.uint32), err_msg=k)
        else:
          np.testing.assert_allclose(a[k], b[k], rtol=1e-5, atol=1e-7,
                                     err_msg=k)

"""FSDP over 8 fake CPU devices: exactness, residual placement, compiled HLO.

One child process (8 devices) trains the same small model for a few steps on
fixed gradients, single-device, under ``jax.set_mesh`` with an Explicit axis,
and with an Auto axis, for ``kahan(optax.adamw)`` and
``kahan(prodigy_factored())``. The tests read its report and weights.
"""

import numpy as np
import pytest

from _subprocess import run

STEPS = 4

SCRIPT = r'''
out = sys.argv[1]
report = {}
sp = lambda x: str(getattr(x.sharding, "spec", None))
grads_np = host_grads(STEPS)
for name in ("adamw", "prodigy"):
  for mode in ("single", "explicit", "auto"):
    mesh = make_mesh(mode)
    tx = make_tx(name)
    with jax.set_mesh(mesh) if mesh is not None else _nullcontext():
      params = place(host_params(), mesh)
      state, step = init_and_step(tx, params, mesh, mode)
      grads = [place(g, mesh) for g in grads_np]
      compiled = step.lower(params, state, grads[0]).compile()
      for g in grads:
        params, state = step(params, state, g)
      res = ok.kahan_residuals(state)
      nu = jax.tree.leaves(state, is_leaf=lambda x: hasattr(x, "nu"))
      info = {
          "cache_size": step._cache_size(),
          "residuals": {k: [sp(r), r.sharding.memory_kind,
                            r.sharding.with_memory_kind("device")
                            .is_equivalent_to(params[k].sharding, r.ndim)]
                        for k, r in res.items() if r is not None},
          "params": {k: sp(p) for k, p in params.items()},
          "collectives": collectives(compiled.as_text()),
      }
      inner = state.inner_state
      if name == "adamw":
        info["nu"] = {k: inner[0].nu[k].sharding.is_equivalent_to(
            params[k].sharding, params[k].ndim) for k in params}
      else:
        info["s"] = {k: [list(v.shape), sp(v)]
                     for k, v in inner.s.items()}
        info["row"] = {k: sp(r) for k, r in
                       inner.preconditioner_state[0].row.items()
                       if r.shape != (1,)}
      info["moved"] = bool(np.any(exact(params, state)["w1"] != host_params()["w1"]))
      report[f"{name}/{mode}"] = info
      np.savez(f"{out}/{name}_{mode}.npz", **exact(params, state))
emit(report)
'''.replace("STEPS", str(STEPS))

NULLCTX = "from contextlib import nullcontext as _nullcontext\n"


@pytest.fixture(scope="module")
def child(tmp_path_factory):
  out = tmp_path_factory.mktemp("sharding")
  report = run(NULLCTX + SCRIPT, str(out), devices=8, timeout=300)
  return report, out


def _load(out, name, mode):
  with np.load(out / f"{name}_{mode}.npz") as f:
    return {k: f[k] for k in f.files}


def test_main_process_is_unaffected():
  import jax
  assert jax.device_count() == 1


@pytest.mark.parametrize("mode", ["explicit", "auto"])
def test_adamw_is_bitwise_the_single_device_run(child, mode):
  report, out = child
  want, got = _load(out, "adamw", "single"), _load(out, "adamw", mode)
  for k in want:
    np.testing.assert_array_equal(got[k].view(np.uint32),
                                  want[k].view(np.uint32), err_msg=k)
  assert report[f"adamw/{mode}"]["moved"]


@pytest.mark.parametrize("mode", ["explicit", "auto"])
def test_prodigy_factored_agrees_within_1e_5(child, mode):
  report, out = child
  want, got = _load(out, "prodigy", "single"), _load(out, "prodigy", mode)
  for k in want:
    np.testing.assert_allclose(got[k], want[k], rtol=1e-5, atol=1e-7,
                               err_msg=k)


@pytest.mark.parametrize("name", ["adamw", "prodigy"])
@pytest.mark.parametrize("mode", ["explicit", "auto"])
def test_residuals_keep_param_sharding_in_pinned_host(child, name, mode):
  report, _ = child
  info = report[f"{name}/{mode}"]
  assert set(info["residuals"]) == {"w1", "b1", "w2"}  # not the float32 leaf
  for k, (spec, kind, same) in info["residuals"].items():
    assert kind == "pinned_host", (k, kind)
    assert same, (k, spec, info["params"][k])
    assert "fsdp" in spec
  assert info["cache_size"] == 1  # compiled once: the state's layout is stable
  if name == "adamw":
    assert all(info["nu"].values())  # second moments sharded like params


@pytest.mark.parametrize("mode", ["explicit", "auto"])
def test_hlo_gathers_no_full_leaf(child, mode):
  """No all-gather of a residual (u16) or of anything near a full leaf.

  adamw is elementwise: no collective at all. prodigy_factored needs global
  sums (all-reduce of scalars and of the factored row/column means) and
  gathers only 1/slice_p of a leaf: the strided slice ``x.reshape(-1)[::11]``
  of a sharded leaf becomes a halo exchange (collective-permute of the few
  entries near shard boundaries) plus an all-gather of the sliced
  gradient/params into the replicated ``s`` and ``x0`` state.
  """
  report, _ = child
  assert report[f"adamw/{mode}"]["collectives"] == []
  ops = report[f"prodigy/{mode}"]["collectives"]
  full = 256 * 128
  assert all(dt != "u16" for _, dt, _ in ops), ops
  gathers = [n for op, _, n in ops if op == "all-gather"]
  assert gathers and max(gathers) <= -(-full // 11) + 8, ops  # 1/11 + padding
  assert all(n < full // 8 for op, _, n in ops if op == "collective-permute")


def test_prodigy_slices_and_rows_layout(child):
  """Explicit mode: the sliced s/x0 (1/11 of each leaf) stay replicated; the
  factored rows are sharded like the leaf's leading axis."""
  report, _ = child
  info = report["prodigy/explicit"]
  assert info["s"]["w1"] == [[-(-256 * 128 // 11)], "P(None,)"]
  assert "fsdp" in info["row"]["w1"], info["row"]


def test_sharded_training_example_runs():
  import pathlib
  import subprocess
  import sys
  script = pathlib.Path(__file__).parent.parent / "examples" / "sharded_training.py"
  out = subprocess.run([sys.executable, str(script)], capture_output=True,
                       text=True, check=True, timeout=120).stdout
  assert "devices: 8" in out
  assert "P('fsdp', None), memory kind: pinned_host" in out
  assert "bf16 weight: 1.0, exact float32 weight: 0.9996999" in out

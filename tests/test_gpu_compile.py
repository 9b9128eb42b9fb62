"""The GPU programs' promises, checked by compiling for an H200 here.

Runs ``python -m benchmarks.gpu_compile --quick --check --target h200`` in a
child process (the compiler needs ``JAX_PLATFORMS=cpu`` set before jax is
imported): no conditional in any step, and bounded residual staging with
the offload saving for every kahan step, the default one included. Needs the ``gpu-aot`` extra (jax's
CUDA plugin); without it the test is skipped, unless
``OPTAX_KAHAN_REQUIRE_GPU_AOT=1`` (CI sets it) makes that a failure.
"""

import importlib.util
import json
import os
import subprocess
import sys

import pytest

from benchmarks import gpu_compile

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


def _need_plugin() -> None:
  """Skips without jax's CUDA plugin; fails instead when CI requires it."""
  if importlib.util.find_spec("jax_cuda12_plugin") is None:
    if os.environ.get("OPTAX_KAHAN_REQUIRE_GPU_AOT") == "1":
      pytest.fail('jax\'s CUDA plugin is missing: pip install -e ".[gpu-aot]"')
    pytest.skip('needs pip install -e ".[gpu-aot]"')


def _run_module(module: str, *args: str) -> subprocess.CompletedProcess:
  """``python -m module args`` in a child (the compiler needs
  ``JAX_PLATFORMS=cpu`` before jax is imported); fails on its failure."""
  _need_plugin()
  out = subprocess.run([sys.executable, "-m", module, *args], cwd=ROOT,
                       capture_output=True, text=True, timeout=1200)
  assert out.returncode == 0, out.stdout[-4000:] + out.stderr[-4000:]
  return out


@pytest.mark.slow
def test_gpu_programs_keep_their_promises():
  out = _run_module("benchmarks.gpu_compile", "--quick", "--check",
                    "--target", "h200")
  assert "| kahan(chain(clip_by_global_norm, optax.adamw)) |" in out.stdout
  # optax's own clip chain is checked too (it keeps its per-leaf form)
  assert ("| kahan(optax.chain(optax.clip_by_global_norm, optax.adamw)) |"
          in out.stdout)


def _row(**kw):
  base = {"conditionals": 0, "h2d_copies": 0, "staging_in_largest_leaves": 0,
          "largest_leaf_bytes": 100, "params": 1000, "peak_B_per_param": 10}
  return {**base, **kw}


def test_check_fails_on_conditionals_staging_and_a_small_saving():
  rows = {"kahan(prodigy())": _row(
              conditionals=3, h2d_copies=9, staging_in_largest_leaves=3,
              peak_B_per_param=13.0),
          "kahan(prodigy()), offload=False": _row(peak_B_per_param=14.0),
          # bound: 2 - 2 * 100 / 1000 - 0.05 = 1.75 B/param; saves 1.80
          "kahan(optax.adamw)": _row(h2d_copies=9,
                                     staging_in_largest_leaves=2.0,
                                     peak_B_per_param=12.2),
          "kahan(optax.adamw), offload=False": _row(peak_B_per_param=14.0)}
  table = {"shapes": "Optimizer step on test shapes", "rows": rows,
           "offload_saving": gpu_compile.offload_savings(rows)}
  failures = gpu_compile.check(table)
  assert len(failures) == 3, failures
  assert "conditionals" in failures[0]
  assert "stages 3.0" in failures[1]
  assert "saves 1.00" in failures[2]
  assert "for kahan(optax.adamw)" not in " ".join(failures)
  rows["kahan(optax.adamw)"] = _row(h2d_copies=9, peak_B_per_param=12.5)
  table["offload_saving"] = gpu_compile.offload_savings(rows)
  assert any("saves 1.50 B/param for kahan(optax.adamw)" in f
             for f in gpu_compile.check(table))
  scanned = {**table, "shapes": "Whole training step, stacked, lax.scan"}
  assert [f for f in gpu_compile.check(scanned) if "less than 1.9" in f]


def test_schedule_report_reads_staging_through_tuples():
  hlo = """
ENTRY %main (p: u16[8], q: u16[8]) -> u16[8] {
  %p = u16[8]{0:S(5)} parameter(0)
  %cs = (u16[8]{0}, u16[8]{0:S(5)}, u32[]) copy-start(%p)
  %cd = u16[8]{0} copy-done(%cs)
  %t = (u16[8]{0}, u32[]) tuple(%cd, %cd)
  %g = u16[8]{0} get-tuple-element(%t), index=0
  %cs2 = (u16[8]{0}, u16[8]{0:S(5)}, u32[]) copy-start(%p)
  %f = u16[8]{0} fusion(%g), kind=kLoop
  %cd2 = u16[8]{0} copy-done(%cs2)
  ROOT %f2 = u16[8]{0} fusion(%cd2, %f), kind=kLoop
}
"""
  r = gpu_compile.schedule_report(hlo)
  assert r["h2d_copies"] == 2 and r["d2h_copies"] == 0 and r["both_ways"] == 0
  assert r["staging_peak"] == 32  # both 16-byte copies live at %f
  assert r["overlap"] == 1.0  # the second starts before the first's reader


def test_schedule_report_sees_both_copy_directions_at_once():
  hlo = """
ENTRY %main (p: u16[8], q: u16[8]) -> u16[8] {
  %p = u16[8]{0:S(5)} parameter(0)
  %q = u16[8]{0} parameter(1)
  %out = (u16[8]{0:S(5)}, u16[8]{0}, u32[]) copy-start(%q)
  %in = (u16[8]{0}, u16[8]{0:S(5)}, u32[]) copy-start(%p)
  %outd = u16[8]{0:S(5)} copy-done(%out)
  %ind = u16[8]{0} copy-done(%in)
  ROOT %f = u16[8]{0} fusion(%ind), kind=kLoop
}
"""
  r = gpu_compile.schedule_report(hlo)
  assert r["h2d_copies"] == 1 and r["d2h_copies"] == 1
  assert r["both_ways"] == 1.0


@pytest.mark.slow
def test_blockwise_step_holds_one_blocks_gradients():
  # benchmarks.blockwise at 4 + 4 blocks of width 256, read from the H200
  # program's buffer assignment: no whole-stack gradient alive at the peak,
  # at most two blocks' worth of block-shaped values, a lower peak.
  _need_plugin()
  out = subprocess.run(
      [sys.executable, "-m", "benchmarks.blockwise", "--quick", "--check",
       "--optimizers", "kahan(prodigy_factored(state_dtype=bf16))"],
      cwd=ROOT, capture_output=True, text=True, timeout=1200)
  assert out.returncode == 0, out.stdout[-4000:] + out.stderr[-4000:]
  assert "| blockwise | kahan(prodigy_factored(state_dtype=bf16)) |" in (
      out.stdout)


@pytest.mark.slow
def test_streaming_quick_models_every_setup():
  # benchmarks.streaming at 2 + 4 FLUX.1-dev blocks: each setup compiled for
  # the H200 and replayed by benchmarks.timeline
  _need_plugin()
  out = subprocess.run([sys.executable, "-m", "benchmarks.streaming",
                        "--quick"], cwd=ROOT, capture_output=True, text=True,
                       timeout=1200)
  assert out.returncode == 0, out.stdout[-4000:] + out.stderr[-4000:]
  with open(os.path.join(ROOT, "benchmarks", "results",
                         "streaming_quick.json")) as f:
    rows = json.load(f)["rows"]
  ref = rows["residuals on the device, batch 1"]
  assert ref["ratio"] == 1.0 and ref["h2d_bytes"] == 0
  for name, row in rows.items():
    assert row["step_s"] >= row["gemm_s"] > 0, name
    assert row["gemm_flops"] == pytest.approx(ref["gemm_flops"], rel=1e-9)
  streamed = rows["1 + 2 blocks streamed, spare buffers, batch 1"]
  plain = rows["residuals in host memory, spare buffers, batch 1"]
  one = rows["residuals in host memory, one buffer per leaf, batch 1"]
  assert streamed["host_bytes"] > plain["host_bytes"] > 0
  # a spare for each stacked residual leaf (the embedding's and the head's,
  # updated once outside the loop, have none)
  assert one["host_bytes"] < plain["host_bytes"] < 2 * one["host_bytes"]
  assert streamed["h2d_bytes"] > plain["h2d_bytes"]


@pytest.mark.slow
def test_host_compute_spike_reads_the_host_call(tmp_path):
  _run_module("benchmarks.host_compute", "--n", "256", "--tag", "quick")
  with open(os.path.join(ROOT, "benchmarks", "results",
                         "host_compute_quick.json")) as f:
    rows = json.load(f)["rows"]
  for name, row in rows.items():
    assert row["compiles"] and row["host_calls"] == 1, (name, row)
  # with its hyperparameters in host memory, the host reads no device memory
  assert rows["an array in host memory"]["device_operands"] == 0

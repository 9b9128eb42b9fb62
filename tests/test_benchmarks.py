"""CI smoke runs of the benchmarks (--quick, tiny shapes): rows and relations."""

import json
import math
import warnings

import numpy as np

import pytest

from benchmarks import (compile_time, gpu_step, memory, prodigy_clip, quality,
                        report, speed, step_memory)

pytestmark = [
    pytest.mark.slow,  # minutes: run with pytest -m slow
    # The benchmarks time and size plain Prodigy on bf16 params on purpose
    # (not a training run): its stall warning is right and expected there.
    pytest.mark.filterwarnings(
        "ignore:scale_by_prodigy on bfloat16:optax_kahan.OptaxKahanWarning"),
]


def test_memory_quick_has_every_row():
  results = memory.main(["--quick"])
  (model, r), = results.items()
  rows = r["rows"]
  assert len(rows) == len(memory.setups())
  assert rows["optax.adamw, float32 master weights (mixed precision)"][
      "device_total_B_per_param"] == pytest.approx(14.0, abs=0.05)
  kahan = rows["kahan(optax.adamw) on bf16"]
  assert kahan["host_B_per_param"] == pytest.approx(2.0, abs=1e-6)
  assert kahan["device_total_B_per_param"] == pytest.approx(10.0, abs=0.05)
  assert (rows["prodigy_factored() on bf16"]["device_state_B_per_param"]
          < rows["prodigy() on bf16"]["device_state_B_per_param"] / 10)
  md = (report.RESULTS / "memory_quick.md").read_text()
  assert "kahan(prodigy_factored()) on bf16" in md


def test_compile_time_quick_times_every_step():
  results = compile_time.main(["--quick"])
  assert set(results["seconds"]) == set(compile_time.OPTIMIZERS)
  assert all(s > 0 for s in results["seconds"].values())
  assert results["ratio_to_kahan_adamw"]["kahan(optax.adamw)"] == 1.0
  assert "kahan(prodigy_factored())" in (
      report.RESULTS / "compile_time_quick.md").read_text()


def test_speed_quick_reports_every_ratio():
  results = speed.main(["--quick", "--reps", "3"])
  assert set(results["ratios"]) == {c[0] for c in speed.COMPARISONS}
  for v in results["ratios"].values():
    assert v["ratio"] > 0
  assert results["copy_GBps"] > 0
  saved = json.loads((report.RESULTS / "speed_quick.json").read_text())
  assert saved["ratios"].keys() == results["ratios"].keys()


def test_quality_quick_has_every_task_and_kahan_is_exact():
  results = quality.main(["--quick", "--seeds", "1"])
  assert set(results["tasks"]) == {"digits-logreg", "digits-mlp",
                                   "diffusion-polish"}
  for task, r in results["tasks"].items():
    assert r["kahan"]["distance"]["values"] == [0.0], task
    assert r["nearest"]["distance"]["mean"] > 0, task
  assert "digits-mlp" in (report.RESULTS / "quality_quick.md").read_text()
  compact = (report.RESULTS / "quality_compact_state_quick.md").read_text()
  assert "| bf16 state |" in compact and "nan" not in compact


def test_step_memory_quick_bounds_every_leafwise_step():
  results = step_memory.main(["--quick"])
  (model, r), = results["models"].items()
  assert set(r["temp_B_per_param"]) == set(step_memory.CONFIGS)
  for name, row in r["temp_B_per_param"].items():
    if row["leafwise"] is not None:
      assert row["leafwise"] <= r["bound_B_per_param"], name
    if row["leafwise"] is not None and row["default"] is not None:
      assert results["time_ratio_leafwise_over_default"][name] > 0
  # A whole-tree program keeps every leaf's temporaries; its rows do not.
  contrib = r["temp_B_per_param"]["optax.contrib.prodigy"]
  assert contrib["default"] > 4 * contrib["leafwise"] > 0, contrib
  assert "leaf-by-leaf step time" in (
      report.RESULTS / "step_memory_quick.md").read_text()


def test_gpu_step_quick_runs_every_configuration_on_cpu():
  results = gpu_step.main(["--quick", "--reps", "1"])
  assert set(results["rows"]) == set(gpu_step.CONFIGS)
  for name, row in results["rows"].items():
    if name.startswith("kahan"):
      assert row["residual_memory_kinds"] == ["pinned_host"], name


@pytest.mark.slow
def test_gpu_step_runs_the_dit_steps_with_residuals_where_asked():
  filters = list(warnings.filters)
  results = gpu_step.main(["--quick", "--reps", "1", "--model",
                           "dit-unrolled"])
  assert warnings.filters == filters  # its ignored warning stays inside
  assert (results["width"], results["batch"]) == gpu_step.dit_sizes(True)[:2]
  with pytest.raises(SystemExit):  # the UNet's sizes: refused, not ignored
    gpu_step.main(["--quick", "--model", "dit-unrolled", "--width", "64"])
  rows = results["rows"]
  assert set(rows) == set(gpu_step.DIT_CONFIGS)
  assert rows["kahan(adamw)"]["residual_memory_kinds"] == ["pinned_host"]
  assert rows["kahan(adamw), offload=False"]["residual_memory_kinds"] == [
      "device"]


def test_prodigy_clip_reproduces_the_stall_and_its_fix():
  """The text-encoder-like model on bf16 weights stepped directly: with the
  raw update clipped, d stays within 10x of d0 for 100 steps; without the
  clip, and with the bias-corrected clip, it leaves within them."""
  results = prodigy_clip.main(["--quick", "--models", "encoder", "--steps",
                               "100", "--seeds", "1"])
  bf16 = results["runs"]["encoder"]["bf16"]
  last_d = {rule: runs[0]["d"][-1] for rule, runs in bf16.items()}
  assert last_d["clip on"] < 10e-6, last_d
  assert last_d["clip off"] > 10e-6, last_d
  assert last_d["clip on, bias-corrected"] > 10e-6, last_d
  moved = {rule: runs[0]["moved"][9] for rule, runs in bf16.items()}
  assert moved["clip on"] < moved["clip on, bias-corrected"] / 4, moved
  for runs in results["runs"]["encoder"]["kahan"].values():
    assert all(map(math.isfinite, runs[0]["d"]))
  assert "bias-corrected" in (report.RESULTS / "prodigy_clip_quick.md"
                              ).read_text()


def test_stream_gpu_tiny_runs_every_setup_on_cpu():
  from benchmarks import stream_gpu
  # one step each: one role of the spare buffers compiled (the CPU's compile
  # of the step is most of the time); at batch 2, every setup named as
  # gpu.sh's batch-8 run names its two
  only = [a for setup in stream_gpu.SETUPS for a in ("--only", setup)]
  r = stream_gpu.main(["--tiny", "--steps", "1", "--warmup", "0", "--batch",
                       "2", *only])
  assert [row["setup"] for row in r["rows"]] == list(stream_gpu.SETUPS)
  assert [row["batch"] for row in r["rows"]] == [2] * len(stream_gpu.SETUPS)
  # Prodigy's lagged sums add the streamed stacks' parts in another order:
  # the same training within float32 rounding
  losses = [row["loss"] for row in r["rows"]]
  np.testing.assert_allclose(losses, losses[0], rtol=1e-4)


def test_exactness_compares_every_part_in_every_variant(capsys, tmp_path):
  from benchmarks import exactness
  out = tmp_path / "exactness.txt"
  exactness.main(["--out", str(out)])
  lines = capsys.readouterr().out.splitlines()[1:-1]
  assert len(lines) == len(exactness.VARIANTS) * 2 * len(exactness.PROGRAMS)
  assert out.read_text().splitlines()[1:] == lines
  for line in lines:  # the CPU against itself: nothing differs
    assert line.split(" | ")[0] in exactness.VARIANTS, line
    assert "DIFFERS" not in line and "FAILED" not in line, line
    assert line.count(" same") == len(exactness.PARTS), line
    rows, whole = line.split("vs optax ")[1].split(" ulps, whole tree ")
    assert float(rows) <= 4 and float(whole.split()[0]) <= 4, line

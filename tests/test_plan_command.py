"""``python -m optax_kahan.plan``: the command's arguments, its model's
shapes and its table (the search itself: tests/test_plan.py)."""

import subprocess
import sys

import pytest

from optax_kahan import flux
from optax_kahan import plan as ok_plan
from optax_kahan.blockwise import Layout
from optax_kahan.blockwise import Plan
from optax_kahan._src import plan_command
from optax_kahan._src.blockwise.plan import Figures
from tests.test_gpu_compile import ROOT
from tests.test_gpu_compile import _need_plugin


def test_image_tokens_are_the_latent_patches():
  assert ok_plan.image_tokens(1024) == 4096  # FLUX.1-dev's 1024x1024
  assert ok_plan.image_tokens(512) == 1024
  with pytest.raises(ValueError, match="resolution 1000"):
    ok_plan.image_tokens(1000)


def test_flux_dev_is_the_published_model_with_chunked_attention():
  cfg = ok_plan.MODELS["flux-dev"]
  assert flux.num_params(flux.abstract_params(cfg)) == 11_901_408_320
  assert cfg.heads_per_chunk == 2


@pytest.mark.slow
def test_a_budget_nothing_fits_is_a_row_with_plans_reason():
  # In a child, as users run it (the command sets jax's platforms before
  # the deviceless compile). It reaches the deviceless target (jax's CUDA
  # plugin: slow, where CI installs it) but compiles nothing: with no host
  # memory every layout's host arguments (kahan's residuals) are over it.
  _need_plugin()
  out = subprocess.run(
      [sys.executable, "-m", "optax_kahan.plan", "--model", "flux-tiny",
       "--card", "4", "--card", "8", "--host-ram", "0", "--batch", "1"],
      cwd=ROOT, capture_output=True, text=True, check=True).stdout
  assert "flux-tiny (0.00B params), 1024x1024 (4096 + 512 tokens)" in out
  assert "compiled for h200: 0 compiles" in out
  rows = [line for line in out.splitlines() if line.startswith("| 4 |")
          or line.startswith("| 8 |")]
  assert len(rows) == 2, out
  for row in rows:
    assert "| 0 | plan: no layout fits 0.00 GB of host memory" in row, row


def test_summary_gives_each_budgets_choice():
  layout = Layout(batch=4, num_streamed=(15, 38), spare_buffers=False,
                  residuals_on_device=True, offload_activations=True)
  figures = Figures(peak_bytes=15.61e9, host_bytes=52.33e9, step_s=2.527,
                    floor_s=1.742, h2d_hidden=0.58, d2h_hidden=0.9,
                    compile_s=40.0)
  p = Plan(layout, figures, 16.18e9, 64e9, "h200", 1, ())
  table = ok_plan.summary({(16.0, 64.0): p, (16.0, None): p})
  rows = table.splitlines()[2:]
  assert rows[0] == (f"| 16 | 64 | {layout.describe()} | 15.61 | 52.3 | 632 "
                     "| 436 | 58% / 90% |")
  assert rows[1].startswith("| 16 | no cap | ")


def test_host_ram_none_is_no_cap():
  assert plan_command._ram("none") is None
  assert plan_command._ram("64") == 64.0

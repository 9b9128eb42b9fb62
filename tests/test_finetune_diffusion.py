"""Smoke test of examples/finetune_diffusion.py at a tiny size (well under 40 s)."""

from __future__ import annotations

import json

import pytest

from benchmarks import example as example_module

pytestmark = pytest.mark.slow  # minutes: run with pytest -m slow


def test_finetune_diffusion_smoke(tmp_path):
  example = example_module.load()
  argv = ["--pretrain-steps", "30", "--steps", "20", "--width", "8",
          "--batch-size", "16", "--eval-every", "10", "--num-samples", "4",
          "--sample-steps", "4", "--out", str(tmp_path), "--no-progress",
          # stochastic rounding is left out: its step alone takes ~6 s to
          # compile here.
          "--rules", "float32,nearest,kahan"]
  results = example.main(argv)

  for name in ("loss_curves.png", "samples.png", "results.json"):
    assert (tmp_path / name).stat().st_size > 0, name
  saved = json.loads((tmp_path / "results.json").read_text())
  table = saved["table"]
  assert set(table) == {"pretrained", "float32", "nearest", "kahan"}
  assert table == json.loads(json.dumps(results["table"]))

  # Kahan-compensated bf16 updates follow the float32 master bit for bit.
  assert table["kahan"]["max_abs_diff_to_float32"] == 0.0
  assert table["kahan"]["bits_differ_from_float32"] == 0
  # ...and the float32 polish itself moved the weights and the loss (the
  # reference every rule is measured against is not the pretrained model).
  assert table["float32"]["changed_fraction"] > 0.0
  assert table["float32"]["heldout_delta"] != 0.0
  # Plain bf16 updates (round to nearest) drop most of the small updates.
  assert (table["nearest"]["changed_fraction"] <
          table["kahan"]["changed_fraction"])
  assert table["nearest"]["max_abs_diff_to_float32"] > 0.0
  # Residuals live in host memory: 2 bytes per parameter.
  assert table["kahan"]["host_bytes_per_param"] == 2.0
  assert table["nearest"]["host_bytes_per_param"] == 0.0
  for rule in ("float32", "nearest", "kahan"):
    curve = saved["curves"][rule]
    assert len(curve["train_loss"]) == 20
    assert curve["eval_steps"] == [0, 10, 20]

  # The pretrained weights are cached under --out, keyed by their config.
  cfg = example.PretrainConfig(**saved["pretrain"]["config"])
  train, _ = example.load_digits_split()
  _, info = example.pretrain(cfg, train, tmp_path, progress=False)
  assert info["cached"] and not saved["pretrain"]["cached"]
  other = example.PretrainConfig(**{**saved["pretrain"]["config"], "lr": 1.0})
  assert other.cache_key() != cfg.cache_key()


def test_finetune_diffusion_blockwise_smoke(tmp_path):
  # The polish through ok.blockwise.blockwise_step (encoder, a stack of one middle
  # block, decoder): Kahan still follows the float32 master bit for bit; the
  # nearest rule's weights are the ordinary step's, and the float32 and Kahan
  # rules' within float32 rounding (each block's rows compile inside the
  # backward loop, where XLA may round a few operations differently).
  example = example_module.load()
  argv = ["--pretrain-steps", "30", "--steps", "12", "--width", "8",
          "--batch-size", "16", "--eval-every", "6", "--num-samples", "4",
          "--sample-steps", "4", "--out", str(tmp_path), "--no-progress",
          "--rules", "float32,nearest,kahan"]
  ordinary = example.main(argv)["table"]
  table = example.main(argv + ["--blockwise"])["table"]
  assert table["kahan"]["bits_differ_from_float32"] == 0
  assert table["nearest"]["max_abs_diff_to_float32"] > 0.0
  assert table["kahan"]["host_bytes_per_param"] == 2.0
  assert table["nearest"]["heldout_loss"] == ordinary["nearest"]["heldout_loss"]
  for rule in ("float32", "kahan"):
    assert table[rule]["heldout_loss"] == pytest.approx(
        ordinary[rule]["heldout_loss"], rel=1e-5), rule


def test_blockwise_leaves_out_the_stochastic_rule_and_says_so(capsys):
  example = example_module.load()
  assert example.parse_args(["--blockwise"]).rules == [
      "float32", "nearest", "kahan"]
  assert "the stochastic rule is left out" in capsys.readouterr().out
  assert "stochastic" in example.parse_args([]).rules

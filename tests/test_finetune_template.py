"""examples/finetune_template.py: resume bit for bit, residuals in host memory.

Tiny runs (K + K steps of the digits MLP, a few seconds each, one compile per
run). The suite turns OptaxKahanWarning into errors, so a step that saw its
residuals in device memory (a restore that lost the memory kind) fails here.
"""

from __future__ import annotations

import os

import jax
import numpy as np
import pytest
from flax import nnx

import optax_kahan as ok
from examples import finetune_template as ft

K = 3


def compiles() -> int:
  """Entries in the jitted step's cache (one per compilation)."""
  return ft.train_step.jitted_fn._cache_size()


def run(ckpt: os.PathLike, steps: int, out: os.PathLike) -> tuple[dict, int]:
  """``main`` on a tiny config; its result and the compilations it added."""
  before = compiles()
  got = ft.main(["--steps", str(steps), "--batch", "16", "--hidden", "16",
                 "--save-every", str(K), "--ckpt-dir", str(ckpt),
                 "--out", str(out)])
  return got, compiles() - before


def assert_same(a: dict[str, np.ndarray], b: dict[str, np.ndarray]) -> None:
  assert sorted(a) == sorted(b)
  for k in a:
    assert a[k].dtype == b[k].dtype, k
    np.testing.assert_array_equal(a[k], b[k], err_msg=k)


def assert_in_host_memory(optimizer: nnx.Optimizer) -> None:
  for r in jax.tree.leaves(ok.kahan_residuals(optimizer.opt_state)):
    assert r.dtype == np.uint16
    assert r.sharding.memory_kind == "pinned_host"
    assert jax.typeof(r).memory_space == jax.memory.Space.Host


@pytest.fixture(scope="module")
def runs(tmp_path_factory) -> dict[str, tuple[dict, int]]:
  d = tmp_path_factory.mktemp("finetune_template")
  return {
      "straight": run(d / "a", 2 * K, d / "a.npz"),
      "first": run(d / "b", K, d / "b1.npz"),
      "restored": run(d / "b", K, d / "b2.npz"),   # restores, trains nothing
      "resumed": run(d / "b", 2 * K, d / "b3.npz"),
      "dir": d,
  }


def test_resume_is_bit_for_bit(runs):
  straight, resumed = runs["straight"][0], runs["resumed"][0]
  assert straight["start"] == 0 and resumed["start"] == K
  for part in ("params", "residuals", "float32"):
    assert_same(straight[part], resumed[part])
  # The whole optimizer state too: Prodigy's d, its sums, the step count.
  assert_same(ft.flat(nnx.state(straight["optimizer"])),
              ft.flat(nnx.state(resumed["optimizer"])))
  assert ok.prodigy_d(resumed["optimizer"].opt_state)[...] > 1e-6  # d moved
  # Restoring alone gives back exactly the state that was saved.
  first, restored = runs["first"][0], runs["restored"][0]
  assert restored["start"] == K
  for part in ("params", "residuals", "float32"):
    assert_same(first[part], restored[part])
  assert sorted(os.listdir(runs["dir"] / "b")) == [str(K), str(2 * K)]


def test_residuals_restored_to_host_and_hold_the_low_bits(runs):
  assert_in_host_memory(runs["restored"][0]["optimizer"])  # just restored
  assert_in_host_memory(runs["resumed"][0]["optimizer"])   # and K steps later
  res = runs["resumed"][0]["residuals"]
  assert all(r.dtype == np.uint16 for r in res.values())
  assert any(np.any(r != 0) for r in res.values())


def test_float32_export_rounds_to_the_bf16_params(runs):
  got = runs["resumed"][0]
  for k, w32 in got["float32"].items():
    p = got["params"][k]
    assert w32.dtype == np.float32 and p.dtype == jax.numpy.bfloat16
    np.testing.assert_array_equal(np.asarray(ok.split_float32(w32)[0]), p,
                                  err_msg=k)
  assert any(np.any(w32 != got["params"][k].astype(np.float32))
             for k, w32 in got["float32"].items())  # the low bits are there
  with np.load(runs["dir"] / "b3.npz") as saved:
    assert_same(dict(saved), got["float32"])


def test_each_run_compiles_the_step_once(runs):
  # A new optimizer (a new tx) is a new static argument: one entry per run,
  # none for a run that only restores. Two for a run means the step
  # compiled again on its second call (an uncommitted or moved leaf).
  assert runs["straight"][1] == 1
  assert runs["first"][1] == 1
  assert runs["restored"][1] == 0
  assert runs["resumed"][1] == 1


def test_progress_bar_shows_loss_and_d_and_the_end_what_was_written(
    tmp_path, capsys):
  got, _ = run(tmp_path / "c", 2, tmp_path / "c.npz")
  out, err = capsys.readouterr()
  assert "loss=" in err and "d=" in err and "2/2" in err
  assert 0.0 <= got["accuracy"] <= 1.0 and np.isfinite(got["loss"])
  assert (f"step 2: loss {got['loss']:.4f}, accuracy {got['accuracy']:.2%}"
          in out)
  assert f"wrote the float32 weights to {tmp_path / 'c.npz'}" in out

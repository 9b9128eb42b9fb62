"""The known-answer check passes where kahan is exact and fails where a
residual is lost (the H200 run of 2026-12-04 lost them all)."""

import jax.numpy as jnp
import numpy as np
import pytest

import optax_kahan as ok
from optax_kahan._src import kahan as kahan_module
from optax_kahan._src import known_answer


def test_the_check_passes_on_the_cpu():
  lines = ok.known_answer_check(report=lambda line: None)
  assert len(lines) == 6 and all("on the CPU" in line for line in lines)
  assert any("streamed" in line for line in lines)


def test_the_check_fails_when_the_residual_output_is_dropped(monkeypatch):
  # Every new residual zero, on the CPU and the checked device alike: only
  # optax's float32 answer can tell, and it does.
  add = kahan_module._add

  def dropped(p, lo, x, u, rounding):
    hi, new_lo = add(p, lo, x, u, rounding)
    return hi, None if new_lo is None else jnp.zeros_like(new_lo)

  monkeypatch.setattr(kahan_module, "_add", dropped)
  with pytest.raises(AssertionError) as e:
    ok.known_answer_check(steps=1, report=lambda line: None)
  message = str(e.value)
  for case in ("kahan(adamw), residuals in host memory, step 0",
               "kahan(prodigy_factored), residuals on the device, step 0",
               "blockwise_step(kahan(adamw)), residuals in host memory, "
               "last block streamed"):
    assert f"{case}: the float32 weights are" in message, message


def test_a_bit_that_differs_from_the_cpus_is_named():
  tree = {"a": np.arange(4, dtype=np.uint16), "b": np.ones(3, np.uint16)}
  other = {"a": tree["a"].copy(), "b": tree["b"].copy()}
  other["b"][2] ^= 1
  run = {"weights": tree, "residuals": other,
         "merged": {"a": np.zeros(4, np.float32), "b": np.ones(3, np.float32)}}
  cpu = {"weights": tree, "residuals": tree}
  failures = []
  known_answer._check("case", run, cpu, run["merged"], run["merged"],
                      failures)
  assert failures == [
      "case: the residuals differ from the CPU's at ['b'] (1 elements)"]

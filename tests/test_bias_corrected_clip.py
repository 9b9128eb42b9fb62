"""clip_by_bias_corrected_rms: optax's block-RMS clip on the bias-corrected update."""

import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest

import optax_kahan as ok


def _updates(scale):
  k1, k2 = jax.random.split(jax.random.key(0))
  return {"w": scale * jax.random.normal(k1, (6, 5)),
          "b": scale * jax.random.normal(k2, (5,)), "none": None}


@pytest.mark.parametrize("b1", [0.0, 0.9])
def test_clips_the_bias_corrected_rms_at_each_step(b1):
  tau, b2 = 0.5, 0.999
  tx = ok.clip_by_bias_corrected_rms(tau, b1, b2)
  state = tx.init(_updates(1.0))
  for n in range(1, 4):
    u = _updates(100.0 * n)  # bias-corrected RMS above tau
    out, state = jax.jit(tx.update)(u, state)
    assert out["none"] is None
    c = np.sqrt(1 - b2**n) / (1 - b1**n)
    for k in ("w", "b"):
      x = np.asarray(u[k], np.float64)
      rms = np.sqrt(np.mean(x**2))
      assert rms * c > tau
      # rtol: float32's 1 - b2^n loses about 1e-5 relative to cancellation
      np.testing.assert_allclose(out[k], x / max(1.0, rms * c / tau),
                                 rtol=1e-4)
      # the bias-corrected RMS is the threshold: the clip acted
      assert np.sqrt(np.mean(np.asarray(out[k], np.float64)**2)) * c == (
          pytest.approx(tau, rel=1e-4))


def test_changes_nothing_where_optax_clip_by_block_rms_does_not_act():
  u = _updates(0.01)  # RMS far below the threshold
  plain, _ = optax.clip_by_block_rms(1.0).update(u, None)
  tx = ok.clip_by_bias_corrected_rms(1.0, 0.0, 0.999)
  out, _ = tx.update(u, tx.init(u))
  for k in ("w", "b"):
    np.testing.assert_array_equal(out[k], u[k])
    np.testing.assert_array_equal(plain[k], u[k])


def test_keeps_the_dtype_and_has_a_per_leaf_form():
  u = jax.tree.map(lambda x: None if x is None else x.astype(jnp.bfloat16),
                   _updates(10.0))
  tx = ok.clip_by_bias_corrected_rms(1.0, 0.0, 0.999)
  out, _ = tx.update(u, tx.init(u))
  assert out["w"].dtype == jnp.bfloat16 and out["b"].dtype == jnp.bfloat16
  stages, reason = ok.per_leaf.stages_of(tx, u, tx.init(u), None)
  assert stages is not None and not stages.rounds, reason


@pytest.mark.parametrize("kwargs, arg", [
    ({"threshold": 0.0, "b1": 0.0, "b2": 0.9}, "threshold"),
    ({"threshold": 1.0, "b1": 1.0, "b2": 0.9}, "b1"),
    ({"threshold": 1.0, "b1": 0.0, "b2": 1.0}, "b2")])
def test_bad_arguments_name_the_argument(kwargs, arg):
  with pytest.raises(ValueError, match=arg):
    ok.clip_by_bias_corrected_rms(**kwargs)

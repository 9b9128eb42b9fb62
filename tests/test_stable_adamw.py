"""StableAdamW against torch-optimi's StableAdamW (fixtures), teacher-forced."""

import json
import pathlib

import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest

import optax_kahan as ok
from test_prodigy import step_errors

FIXTURES = pathlib.Path(__file__).parent / "fixtures"


@pytest.mark.parametrize("name", ["defaults", "no_wd_spikes", "wd_spikes"])
def test_matches_optimi_stable_adamw(name):
  f = np.load(FIXTURES / "stable_adamw_reference.npz")
  cfg = json.loads(str(f[f"{name}/config"]))
  xs = {k: f[f"{name}/x_{k}"] for k in ("w", "b", "z")}
  gs = {k: jnp.asarray(f[f"{name}/g_{k}"]) for k in ("w", "b", "z")}
  assert f[f"{name}/rms_scale"].max() > 1.3, "the clip must fire in the data"
  tx = ok.stable_adamw(cfg["lr"], b1=cfg["betas"][0], b2=cfg["betas"][1],
                       eps=cfg["eps"], weight_decay=cfg["weight_decay"])

  def body(state, xg):
    u, state = tx.update(xg[1], state, xg[0])
    return state, optax.apply_updates(xg[0], u)

  x0 = {k: jnp.asarray(v[0]) for k, v in xs.items()}
  inputs = ({k: jnp.asarray(v[:-1]) for k, v in xs.items()}, gs)
  _, pred = jax.jit(lambda s: jax.lax.scan(body, s, inputs))(tx.init(x0))
  assert step_errors(pred, xs).max() < 1e-5


def test_clip_scales_the_weight_decay_too():
  tx = ok.scale_by_stable_adamw(b1=0.0, b2=0.5, eps=1e-8, weight_decay=1.0)
  params = {"w": jnp.ones(4)}
  state = tx.init(params)
  _, state = tx.update({"w": jnp.full(4, 1e-3)}, state, params)
  u, _ = tx.update({"w": jnp.full(4, 1.0)}, state, params)  # a spike
  # v^ = (0.5 * 1e-6 + 0.5) / 0.75, RMS = 1 / sqrt(v^) = 1.2247...
  v_hat = (0.25 * 1e-6 + 0.5) / 0.75
  rms = 1 / np.sqrt(v_hat)
  want = (1 / (np.sqrt(v_hat) + 1e-8) + 1.0) / rms
  np.testing.assert_allclose(u["w"], want, rtol=1e-5)

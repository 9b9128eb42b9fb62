"""Prodigy's d-estimation: parity with prodigyopt 1.1.2 and optax.contrib.prodigy.

Free-running trajectories of adaptive optimizers amplify rounding (1e-7 can
grow to 1e-1 in 200 steps), so the comparison is teacher-forced: at each step
our update is fed the reference's own params and gradient, and the step it
proposes is compared with the step the reference took.
"""

import inspect
import json
import pathlib

import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest

import optax_kahan as ok

FIXTURES = pathlib.Path(__file__).parent / "fixtures"
LEAVES = ("w", "b", "z")
RTOL = 1e-4


def _load(name):
  f = np.load(FIXTURES / "prodigy_reference.npz")
  cfg = json.loads(str(f[f"{name}/config"]))
  xs = {k: f[f"{name}/x_{k}"] for k in LEAVES}
  gs = {k: f[f"{name}/g_{k}"] for k in LEAVES}
  return cfg, xs, gs, f[f"{name}/d"], f[f"{name}/lr"]


def _from_config(cfg, steps):
  if cfg["lr_schedule"] == "linear":
    lr = optax.linear_schedule(cfg["lr"], 0.1 * cfg["lr"], steps)
  else:
    lr = cfg["lr"]
  return ok.prodigy(
      learning_rate=lr, b1=cfg["betas"][0], b2=cfg["betas"][1],
      b3=cfg["beta3"], eps=cfg["eps"], weight_decay=cfg["weight_decay"],
      decouple=cfg["decouple"], use_bias_correction=cfg["use_bias_correction"],
      safeguard_warmup=cfg["safeguard_warmup"], d0=cfg["d0"],
      d_coef=cfg["d_coef"], growth_rate=cfg["growth_rate"],
      slice_p=cfg["slice_p"])


def teacher_forced_steps(tx, xs, gs):
  """Runs ``tx`` on the reference's params/grads; returns x_k + u_k and d."""
  x0 = jax.tree.map(lambda x: jnp.asarray(x[0]), xs)
  inputs = (jax.tree.map(lambda x: jnp.asarray(x[:-1]), xs),
            jax.tree.map(jnp.asarray, gs))

  def body(state, xg):
    x, g = xg
    u, state = tx.update(g, state, x)
    return state, (optax.apply_updates(x, u), ok.prodigy_d(state))

  _, (pred, d) = jax.jit(lambda s, i: jax.lax.scan(body, s, i))(
      tx.init(x0), inputs)
  return pred, np.asarray(d)


def step_errors(pred, xs):
  """Per step and leaf: ||pred_k - x_{k+1}|| / ||x_{k+1} - x_k||.

  Element errors within the float32 rounding of the stored params (4 ulp)
  are not counted, so that tiny early steps are not judged by it.
  """
  worst = []
  for k in xs:
    ref_next = xs[k][1:].astype(np.float64)
    step = ref_next - xs[k][:-1]
    err = np.abs(np.asarray(pred[k], np.float64) - ref_next)
    err = np.maximum(err - 4 * np.finfo(np.float32).eps * np.abs(ref_next), 0)
    axes = tuple(range(1, step.ndim))
    num = np.sqrt(np.sum(err**2, axis=axes))
    den = np.sqrt(np.sum(step**2, axis=axes))
    worst.append(np.where(den > 0, num / np.where(den > 0, den, 1), num))
  return np.max(worst, axis=0)


def assert_steps_match(pred, xs, rtol=RTOL):
  errors = step_errors(pred, xs)
  assert errors.max() <= rtol, (
      f"step {errors.argmax()} off by {errors.max():.3g} relative")


PRODIGYOPT_RUNS = [
    "defaults", "b1_0", "slice_p_11", "safeguard_warmup",
    "safeguard_warmup_linear_lr", "bias_correction", "wd_decoupled",
    "wd_coupled", "growth_rate", "d_coef_2", "linear_lr", "zero_grads",
    "all_options",
]


@pytest.mark.parametrize("name", PRODIGYOPT_RUNS)
def test_matches_prodigyopt_step_by_step(name):
  cfg, xs, gs, d_ref, lr_ref = _load(name)
  steps = len(lr_ref)
  assert steps >= 200
  if cfg["lr_schedule"] == "linear":
    sched = optax.linear_schedule(1.0, 0.1, steps)
    np.testing.assert_allclose([sched(k) for k in range(steps)], lr_ref,
                               rtol=1e-6)
  pred, d = teacher_forced_steps(_from_config(cfg, steps), xs, gs)
  assert_steps_match(pred, xs)
  np.testing.assert_allclose(d, d_ref[1:], rtol=RTOL)
  assert d_ref[-1] > 100 * cfg["d0"] or name == "growth_rate", "d must move"


def test_the_comparison_can_tell_options_apart():
  cfg, xs, gs, _, _ = _load("growth_rate")
  pred, _ = teacher_forced_steps(_from_config(dict(cfg, growth_rate=1.1), 200),
                                 xs, gs)
  assert step_errors(pred, xs).max() > 100 * RTOL


def test_zero_gradient_steps_skip_like_the_reference():
  cfg, xs, gs, d_ref, _ = _load("zero_grads")
  pred, d = teacher_forced_steps(_from_config(cfg, 200), xs, gs)
  for k in LEAVES:  # the first two (all-zero) steps do not move anything
    np.testing.assert_array_equal(np.asarray(pred[k][:2]), xs[k][:2])
  assert np.isfinite(d).all() and d[0] == d[1] == cfg["d0"]


def _quadratic_trajectory(tx, steps, seed=0):
  """Runs ``tx`` freely on a noisy quadratic; returns params and grads."""
  rng = np.random.default_rng(seed)
  target = {"w": rng.standard_normal((6, 5)), "b": rng.standard_normal(5)}
  x = {"w": 0.3 * rng.standard_normal((6, 5)), "b": np.zeros(5)}
  x = jax.tree.map(lambda a: jnp.asarray(a, jnp.float32), x)
  target = jax.tree.map(lambda a: jnp.asarray(a, jnp.float32), target)

  def body(carry, key):
    x, state = carry
    noise = jax.tree.map(
        lambda a, k: 0.1 * jax.random.normal(k, a.shape),
        x, {"w": jax.random.fold_in(key, 0), "b": jax.random.fold_in(key, 1)})
    g = jax.tree.map(lambda a, t, n: a - t + n, x, target, noise)
    u, state = tx.update(g, state, x)
    return (optax.apply_updates(x, u), state), (x, g)

  keys = jax.random.split(jax.random.key(seed), steps)
  (x_last, _), (xs, gs) = jax.jit(lambda c: jax.lax.scan(body, c, keys))(
      (x, tx.init(x)))
  xs = jax.tree.map(lambda a, b: np.concatenate([a, b[None]]), xs, x_last)
  return xs, jax.tree.map(np.asarray, gs)


@pytest.mark.parametrize("kwargs", [
    {}, {"weight_decay": 0.1}, {"safeguard_warmup": True},
    {"learning_rate": 0.5},
])
def test_matches_optax_contrib_prodigy(kwargs):
  ref = optax.contrib.prodigy(**kwargs)
  xs, gs = _quadratic_trajectory(ref, 200)
  mine = ok.prodigy(use_bias_correction=True, **kwargs)
  x0 = jax.tree.map(lambda a: jnp.asarray(a[0]), xs)

  def body(state, xg):
    u, state = mine.update(xg[1], state, xg[0])
    return state, optax.apply_updates(xg[0], u)

  inputs = (jax.tree.map(lambda a: jnp.asarray(a[:-1]), xs), gs)
  _, pred = jax.jit(lambda s: jax.lax.scan(body, s, inputs))(mine.init(x0))
  errors = step_errors(pred, xs)
  assert errors.max() <= RTOL, errors.max()


def test_all_zero_gradients_give_no_nan():
  tx = ok.prodigy()
  params = {"w": jnp.ones((3, 4)), "b": jnp.zeros(4)}
  state = tx.init(params)
  zeros = jax.tree.map(jnp.zeros_like, params)
  for _ in range(3):
    u, state = jax.jit(tx.update)(zeros, state, params)
    assert all(bool(jnp.all(v == 0)) for v in jax.tree.leaves(u))
  assert ok.prodigy_d(state) == jnp.float32(1e-6)
  assert int(state.k) == 0 and int(state.count) == 3


def test_zero_learning_rate_freezes_the_state():
  tx = ok.prodigy(learning_rate=optax.constant_schedule(0.0))
  params = {"w": jnp.ones(5)}
  state = tx.init(params)
  u, new = tx.update({"w": jnp.ones(5)}, state, params)
  assert float(jnp.max(jnp.abs(u["w"]))) == 0.0
  assert int(new.count) == 1  # the schedule moves on
  for a, b in zip(jax.tree.leaves(new._replace(count=0)),
                  jax.tree.leaves(state._replace(count=0))):
    np.testing.assert_array_equal(a, b)


def test_scalars_are_float32_state_follows_params():
  params = {"w": jnp.ones((11, 3), jnp.bfloat16)}
  state = ok.prodigy().init(params)
  assert state.d.dtype == state.numerator.dtype == jnp.float32
  assert state.s["w"].dtype == jnp.bfloat16
  # slice_p = 1: no flattening, the leaf's own shape (and sharding).
  assert state.s["w"].shape == state.params0["w"].shape == (11, 3)
  sliced = ok.prodigy(slice_p=11).init(params)  # every 11th of 33 entries
  assert sliced.s["w"].shape == sliced.params0["w"].shape == (3,)


def test_prodigy_d_reads_through_wrappers():
  params = jax.device_put({"w": jnp.ones(4, jnp.bfloat16)}, jax.devices()[0])
  tx = optax.MultiSteps(ok.kahan(optax.chain(
      optax.clip_by_global_norm(1.0), ok.prodigy())), every_k_schedule=2)
  state = tx.init(params)
  assert float(ok.prodigy_d(state)) == pytest.approx(1e-6)
  with pytest.raises(ValueError, match="ScaleByProdigyState"):
    ok.prodigy_d(optax.adam(1e-3).init(params))


def test_prodigy_d_of_an_nnx_optimizer_is_an_array():
  from flax import nnx
  model = nnx.Linear(4, 2, param_dtype=jnp.bfloat16, rngs=nnx.Rngs(0))
  optimizer = ok.kahan_nnx_optimizer(model, ok.kahan(ok.prodigy()),
                                     wrt=nnx.Param)
  d = ok.prodigy_d(optimizer.opt_state)  # its arrays are nnx variables
  assert isinstance(d, jax.Array) and float(d) == pytest.approx(1e-6)


def test_x64_scalars_follow_float64_params():
  with jax.enable_x64(True):
    params = {"w": jnp.ones(4, jnp.float64)}
    tx = ok.prodigy()
    state = tx.init(params)
    assert state.d.dtype == jnp.float64
    u, state = jax.jit(tx.update)({"w": jnp.ones(4, jnp.float64)}, state,
                                  params)
    assert u["w"].dtype == jnp.float64
    params32 = {"w": jnp.ones(4, jnp.float32)}
    assert tx.init(params32).d.dtype == jnp.float32


def test_b1_zero_survives_inject_hyperparams():
  # An injected b1 is an array: the reference's b1 = 0 numerator
  # (d_{k+1} g, not the moment) must hold whatever b1's type.
  params = {"w": jnp.linspace(-1.0, 1.0, 12).reshape(3, 4)}
  fixed = ok.prodigy(b1=0.0, d0=1e-3)
  injected = optax.inject_hyperparams(
      ok.prodigy, static_args=("slice_p",),
      hyperparam_dtype=jnp.float32)(b1=0.0, d0=1e-3)
  # Eager init sees a concrete 0: no first-moment buffer, as with a float.
  assert injected.init(params).inner_state.preconditioner_state.mu is None
  for init in (injected.init, jax.jit(injected.init)):  # jit: a buffer
    sa, sb = fixed.init(params), init(params)
    pa = pb = params
    for i in range(7):
      g = {"w": jnp.cos(pa["w"] * (i + 1))}
      ua, sa = fixed.update(g, sa, pa)
      ub, sb = jax.jit(injected.update)(g, sb, pb)
      np.testing.assert_allclose(ub["w"], ua["w"], rtol=1e-5, atol=1e-12)
      pa = pb = optax.apply_updates(pa, ua)


def test_plain_bf16_params_warn_of_the_stall_and_kahan_does_not():
  params = {"w": jnp.ones((4, 4), jnp.bfloat16)}
  grads = {"w": jnp.full((4, 4), 0.1, jnp.bfloat16)}
  tx = ok.prodigy_factored()
  state = tx.init(params)
  step = jax.jit(tx.update)
  with pytest.warns(ok.OptaxKahanWarning, match="stalls"):
    step(grads, state, params)
  # What the warning says: 30 steps, the weights stay and d stays at d0.
  p = params
  for _ in range(30):
    updates, state = step(grads, state, p)
    p = optax.apply_updates(p, updates)
  np.testing.assert_array_equal(np.asarray(p["w"], np.float32), 1.0)
  assert float(ok.prodigy_d(state)) == pytest.approx(1e-6)
  import warnings  # pylint: disable=g-import-not-at-top
  with warnings.catch_warnings():
    warnings.simplefilter("error")
    params = jax.device_put(params, jax.devices()[0])
    k = ok.kahan(ok.prodigy_factored())
    k.update(grads, k.init(params), params)


def test_compiled_step_grows_linearly_with_the_leaf_count():
  # Prodigy sums one scalar per leaf. As a chain of adds, XLA copied that
  # chain into every leaf's fused step: a program quadratic in the number of
  # leaves, and a compile several times longer (benchmarks/compile_time.py).
  def compiled_adds(num_leaves):
    params = {f"w{i}": jnp.zeros((4, 3)) for i in range(num_leaves)}
    tx = ok.prodigy()
    state = tx.init(params)
    step = jax.jit(lambda p, s: tx.update(p, s, p))
    return step.lower(params, state).compile().as_text().count(" add(")

  # 4x the leaves: linear is about 4x (measured 4.4x); the chain gave 10.7x.
  few, many = compiled_adds(16), compiled_adds(64)
  assert many < 6 * few, (few, many)


def _reference_gradients(name="defaults", steps=60):
  """The prodigyopt fixture's params and gradients, as a teacher-forcing
  sequence (three leaves: a matrix, a vector and an all-zero leaf)."""
  _, xs, gs, _, _ = _load(name)
  return ({k: v[:steps + 1] for k, v in xs.items()},
          {k: v[:steps] for k, v in gs.items()})


@pytest.mark.parametrize("lagged_d", [False, True])
def test_bias_corrected_clip_changes_nothing_while_the_clip_is_idle(lagged_d):
  """With a threshold no update reaches, the bias-corrected clip, the plain
  clip and no clip give the same d, bit for bit, and the same steps to within
  two float32 ulps of the step's largest element: dividing by 1 is exact,
  but XLA:CPU (jax >= 0.12.1) contracts a multiply-add into an FMA in one
  program and not the other (1.26 ulps measured, on the all-zero leaf; none
  with --xla_cpu_max_isa=SSE4_2, which has no FMA)."""
  xs, gs = _reference_gradients()
  runs = [teacher_forced_steps(ok.prodigy_factored(
      update_clip=clip, bias_corrected_clip=corrected, lagged_d=lagged_d,
      slice_p=3), xs, gs)
          for clip, corrected in ((None, False), (1e6, False), (1e6, True))]
  (pred0, d0), *others = runs
  assert d0[-1] > 100 * 1e-6  # d moved
  eps = np.finfo(np.float32).eps
  for pred, d in others:
    np.testing.assert_array_equal(d, d0)
    for k in xs:
      a, b = (np.asarray(p[k], np.float64) for p in (pred, pred0))
      steps = np.abs(b - xs[k][:-1]).reshape(len(b), -1).max(axis=1)
      diffs = np.abs(a - b).reshape(len(b), -1).max(axis=1)
      assert np.all(diffs <= 2 * eps * steps), (k, np.max(diffs / steps) / eps)


@pytest.mark.parametrize("b1", [0.0, 0.9])
@pytest.mark.parametrize("corrected", [False, True])
def test_the_first_step_is_clipped_at_the_bias_corrected_threshold(b1,
                                                                    corrected):
  """A steady gradient's first raw direction has RMS ``(1 - b1) /
  sqrt(1 - b2)``; the plain clip cuts it to ``tau``, the bias-corrected one
  to ``tau (1 - b1) / sqrt(1 - b2)``."""
  tau, b2, d0 = 0.1, 0.999, 1e-6
  params = {"w": jnp.zeros((4, 6))}
  grads = {"w": jnp.linspace(-1.0, 1.0, 24).reshape(4, 6) + 0.01}
  tx = ok.prodigy(b1=b1, b2=b2, d0=d0, update_clip=tau,
                  bias_corrected_clip=corrected)
  updates, _ = tx.update(grads, tx.init(params), params)
  rms = float(jnp.sqrt(jnp.mean(updates["w"]**2)))
  expected = d0 * tau * ((1 - b1) / np.sqrt(1 - b2) if corrected else 1.0)
  assert rms == pytest.approx(expected, rel=1e-5)


def test_bias_corrected_clip_is_the_factored_default():
  assert (inspect.signature(ok.prodigy_factored)
          .parameters["bias_corrected_clip"].default is True)
  assert (inspect.signature(ok.prodigy)
          .parameters["bias_corrected_clip"].default is False)

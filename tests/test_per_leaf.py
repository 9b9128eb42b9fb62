"""The per-leaf contract: rows, their two lowerings, chains, refusals, scratch."""

import warnings

import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest

import optax_kahan as ok
from optax_kahan._src import traced
from benchmarks import step_memory
import _steps
from _matrix import sampled

SHAPES = {"a": (33, 17), "b": (17,), "c": (8, 5, 6), "d": (40, 24)}
STEPS = 3


def _params(dtype, wide=None):
  key = jax.random.key(0)
  params = {n: jax.random.normal(jax.random.fold_in(key, i), s).astype(dtype)
            for i, (n, s) in enumerate(SHAPES.items())}
  if wide:
    params[wide] = params[wide].astype(jnp.float32)  # no residual for it
  return jax.device_put(params, jax.devices()[0])


@jax.jit
def _grads(params, i):
  return jax.tree.map(
      lambda p: (jnp.sin(p.astype(jnp.float32) * (i + 3.0)) + 0.1 * i
                 ).astype(p.dtype), params)


def _bits(tree):
  return [np.atleast_1d(np.asarray(x)).view(np.uint8)
          for x in jax.tree.leaves(tree)]


def _assert_bitwise_equal(a, b, what):
  for x, y in zip(_bits(a), _bits(b), strict=True):
    np.testing.assert_array_equal(x, y, err_msg=what)


def _ulps(a, b):
  """The largest distance in float32 ulps between two trees of arrays."""
  worst = 0
  for x, y in zip(jax.tree.leaves(a), jax.tree.leaves(b), strict=True):
    x, y = np.asarray(x), np.asarray(y)
    if x.dtype != np.float32:
      np.testing.assert_array_equal(x, y)
      continue
    ix = x.view(np.int32).astype(np.int64)
    iy = y.view(np.int32).astype(np.int64)
    ix = np.where(ix < 0, -(ix & 0x7FFFFFFF), ix)
    iy = np.where(iy < 0, -(iy & 0x7FFFFFFF), iy)
    worst = max(worst, int(np.max(np.abs(ix - iy), initial=0)))
  return worst


def _force_gpu_form(monkeypatch):
  monkeypatch.setattr(jax.lax, "platform_dependent",
                      lambda *args, cpu, default: default(*args))


def _run(tx, params, steps=STEPS):
  """Updates of each step (update jitted alone) and the final state."""
  state = tx.init(params)
  update = jax.jit(tx.update)
  out = []
  for i in range(steps):
    updates, state = update(_grads(params, i), state, params)
    out.append(updates)
    params = jax.jit(optax.apply_updates)(params, updates)
  return out, state


NAMED = {
    "prodigy": ok.prodigy,
    "prodigy(b1=0, slice_p=3, bias correction, decay, clip)": lambda:
        ok.prodigy(b1=0.0, slice_p=3, use_bias_correction=True,
                   weight_decay=0.1, update_clip=1.0),
    "prodigy(coupled decay)": lambda: ok.prodigy(weight_decay=0.1,
                                                 decouple=False),
    "prodigy_factored": ok.prodigy_factored,
    "stable_adamw": lambda: ok.stable_adamw(1e-2),
    "chain(clip_by_global_norm, adam)": lambda: ok.per_leaf.chain(
        ok.per_leaf.clip_by_global_norm(0.5), optax.adam(1e-2)),
}


@pytest.mark.parametrize("name", sampled(list(NAMED), 0, every=2,
                                         ids=list(NAMED)))
def test_rows_give_the_whole_tree_programs_updates(name):
  """The same stages, run as one program and row by row (islands here)."""
  params = _params(jnp.float32)
  want, want_state = _run(NAMED[name](), params)
  got, got_state = _run(ok.leafwise(NAMED[name]()), params)
  for step, (w, g) in enumerate(zip(want, got)):
    _assert_bitwise_equal(w, g, f"{name}, step {step}")
  _assert_bitwise_equal(want_state, got_state, name)
  assert all(np.any(np.asarray(u) != 0) for u in jax.tree.leaves(want[-1]))


INNER = {
    "optax.adamw": lambda: optax.adamw(1e-2, weight_decay=0.1),
    "optax.adafactor": lambda: optax.adafactor(1e-2),
    "prodigy_factored": ok.prodigy_factored,
    "prodigy(decay, bias correction)": lambda: ok.prodigy(
        weight_decay=0.1, use_bias_correction=True),
    "stable_adamw": lambda: ok.stable_adamw(1e-2),
    "ok.per_leaf.chain(ok.per_leaf.clip_by_global_norm, adam)": lambda: ok.per_leaf.chain(
        ok.per_leaf.clip_by_global_norm(0.1), optax.adam(1e-2)),
    "ok.per_leaf.apply_if_finite(adamw)": lambda: ok.per_leaf.apply_if_finite(
        optax.adamw(1e-2), 3),
}


@pytest.mark.parametrize("name", sampled(list(INNER), 0, every=2,
                                         ids=list(INNER)))
def test_the_gpu_form_of_kahan_computes_the_same_values(name, monkeypatch):
  """for_each_leaf lowers a barrier chain (no conditionals) for GPUs and
  lax.cond islands for the CPU; the chain, forced here on the CPU, evaluates
  the same functions: the same weights, residuals and state, and the
  residuals stay on the host. The bf16 weights and the residuals bit for
  bit; float32 state to within one ulp, because XLA:CPU compiles the two
  programs apart: it sums optax.adafactor's RMS in another order (one ulp,
  measured), and jax >= 0.12.1 contracts a multiply-add into an FMA in one
  program and not the other (one ulp in ok.per_leaf.apply_if_finite(adamw)'s
  state; none with --xla_cpu_max_isa=SSE4_2, which has no FMA)."""
  train = lambda: _steps.train(ok.kahan(INNER[name]()), _params(
      jnp.bfloat16, wide="b"), _grads, STEPS)
  want = train()
  _force_gpu_form(monkeypatch)
  got = train()
  assert _ulps(want, got) <= 1, name


def test_per_leaf_adamw_is_optax_adamw_on_each_leaf_alone():
  """optax.adamw divides by its bias correction 1 - b^t; XLA rewrites that
  division as a multiplication by the reciprocal where the scalar has one
  user, i.e. in a one-leaf row but not in a many-leaf program. So the
  per-leaf step equals optax.adamw run on each leaf alone, bit for bit, and
  the whole-tree program to within an ulp or so."""
  params = _params(jnp.float32)
  got, _ = _run(ok.leafwise(optax.adamw(1e-2)), params)
  for name in SHAPES:
    alone, _ = _run(optax.adamw(1e-2), {name: params[name]})
    for g, a in zip(got, alone):
      _assert_bitwise_equal(a[name], g[name], name)
  whole, _ = _run(optax.adamw(1e-2), params)
  for g, w in zip(got, whole):
    for name in SHAPES:
      np.testing.assert_allclose(g[name], w[name], rtol=1e-5, atol=1e-9)


def _grad_of_apply(params, updates, residuals):
  def f(p, u):
    new, _ = ok.kahan_apply_updates(p, u, residuals)
    return sum(jnp.sum(x.astype(jnp.float32) * (i + 1))
               for i, x in enumerate(jax.tree.leaves(new)))
  return jax.jit(jax.grad(f, argnums=(0, 1)))(params, updates)


def _grad_of_update(tx, params, state, grads):
  def f(g):
    u, _ = tx.update(g, state, params)
    return sum(jnp.sum(x * (i + 1)) for i, x in enumerate(jax.tree.leaves(u)))
  return jax.jit(jax.grad(f))(grads)


def test_both_forms_have_the_same_gradients_and_vmap(monkeypatch):
  params = _params(jnp.bfloat16, wide="b")
  residuals = ok.kahan_init(params)
  updates = jax.tree.map(lambda p: jnp.full(p.shape, 1e-3, jnp.float32),
                         params)
  tx = ok.kahan(optax.sgd(0.5, momentum=0.9))
  state = tx.init(params)
  grads = jax.tree.map(lambda g: g.astype(jnp.float32), _grads(params, 1))
  batched = jax.tree.map(lambda u: jnp.stack([u, 2 * u, -u]), updates)
  vmapped = jax.jit(jax.vmap(
      lambda u: ok.kahan_apply_updates(params, u, residuals)[0]))

  def everything():
    return (_grad_of_apply(params, updates, residuals),
            _grad_of_update(tx, params, state, grads), vmapped(batched))

  cpu = everything()
  _force_gpu_form(monkeypatch)
  gpu = everything()
  (d_params, d_updates), d_grads, out = cpu
  _assert_bitwise_equal(cpu, gpu, "cpu and gpu forms")
  # Straight through the split and merge: d new / d p = d new / d u = 1.
  for i, (dp, du) in enumerate(zip(jax.tree.leaves(d_params),
                                   jax.tree.leaves(d_updates))):
    np.testing.assert_array_equal(np.asarray(dp, np.float32), i + 1)
    np.testing.assert_array_equal(du, i + 1)
  # Through the update: the split's rule, d hi / d (x + u) = 1, rounded to
  # bf16 like the value, and zero where the weight did not move.
  for a in jax.tree.leaves(d_grads):
    assert np.all(np.isfinite(a)) and np.any(np.asarray(a) != 0)
  for k, u in enumerate((1, 2, -1)):
    one, _ = ok.kahan_apply_updates(params, jax.tree.map(
        lambda x: u * x, updates), residuals)
    _assert_bitwise_equal(jax.tree.map(lambda x: x[k], out), one, f"vmap {k}")


# -- transformations that couple leaves in ways no per-leaf form may hide -----
def _coupling(kind):
  """A transformation whose update of leaf "b" reads leaf "a"."""

  def couple(a, b):
    total = jnp.sum(a)
    if kind == "scan carry":  # reaches b in the second iteration only
      def body(c, _):
        return (total, c[0]), None
      (_, late), _ = jax.lax.scan(body, (jnp.zeros(()), jnp.zeros(())), None,
                                  length=2)
      return b + late
    if kind == "while_loop":
      _, late, _ = jax.lax.while_loop(
          lambda c: c[2] < 2, lambda c: (total, c[0], c[2] + 1),
          (jnp.zeros(()), jnp.zeros(()), 0))
      return b + late
    if kind == "cond":
      return jax.lax.cond(total > 0, lambda: b, lambda: -b)
    if kind == "custom_vjp":
      @jax.custom_vjp
      def f(a, b):
        return b + jnp.sum(a)
      f.defvjp(lambda a, b: (f(a, b), None), lambda _, ct: (None, ct))
      return f(a, b)
    raise ValueError(kind)

  def update(updates, state, params=None):
    del params
    return {"a": updates["a"], "b": couple(updates["a"], updates["b"])}, state

  return optax.GradientTransformation(lambda params: optax.EmptyState(),
                                      update)


COUPLINGS = ["scan carry", "while_loop", "cond", "custom_vjp"]


@pytest.mark.parametrize("kind", COUPLINGS)
def test_couplings_are_refused_or_run_whole_tree_in_every_path(kind):
  # b is larger than a value two leaves may share: its update, which reads
  # leaf a, cannot be computed between the passes.
  params = {"a": jnp.linspace(-1, 2, 6, dtype=jnp.bfloat16),
            "b": jnp.linspace(0, 1, traced.MAX_SHARED + 1,
                              dtype=jnp.bfloat16)}
  grads = jax.tree.map(lambda p: p.astype(jnp.float32) * 1e-2, params)
  tx = _coupling(kind)
  want, _ = tx.update(grads, tx.init(params), params)
  st, reason = ok.per_leaf.stages_of(tx, grads, optax.EmptyState(), params)
  assert st is None and "['a'] and ['b'] meet in one array" in reason, reason
  # kahan: the whole-tree step, with a warning that says why.
  k = ok.kahan(tx, offload=False)
  with pytest.warns(UserWarning, match="no per-leaf form"):
    u, state = jax.jit(k.update)(grads, k.init(params), params)
  exact = ok.kahan_to_float32(optax.apply_updates(params, u), state.residuals)
  _assert_bitwise_equal(exact, jax.tree.map(
      lambda p, w: p.astype(jnp.float32) + w, params, want), kind)
  # A chain holding it has no per-leaf form either; it runs as optax.chain.
  c = ok.per_leaf.chain(optax.scale(1.0), tx)
  assert ok.per_leaf.stages_of(c, grads, c.init(params), params)[0] is None
  _assert_bitwise_equal(c.update(grads, c.init(params), params)[0], want,
                        kind)
  # leafwise, Prodigy's preconditioner and blockwise refuse it.
  with pytest.raises(ValueError, match="no per-leaf form"):
    ok.leafwise(tx).update(grads, optax.EmptyState(), params)
  p = ok.scale_by_prodigy(tx)
  with pytest.raises(ValueError, match="no per-leaf form.*meet in one array"):
    p.update(grads, p.init(grads), grads)
  model = ok.blockwise.BlockwiseModel(
      embed=lambda p, x: (x * p["e"], ()),
      blocks=(lambda p, h, _: h * p["w"],),
      head=lambda p, h, _, x: jnp.sum(h * p["b"][:1]) + jnp.sum(p["a"]))
  bparams = ok.blockwise.BlockwiseParams({"e": jnp.ones(4)}, ({"w": jnp.ones((2, 4))},),
                               grads)
  with pytest.raises(ValueError, match="not tx on the whole tree"):
    ok.blockwise.blockwise_step(model, tx, bparams, ok.blockwise.blockwise_init(tx, bparams),
                      jnp.ones(4))


@pytest.mark.parametrize("kind", COUPLINGS)
def test_a_small_coupling_is_computed_between_the_passes(kind):
  # b's update reads a sum of leaf a through a scan, a loop, a cond or a
  # custom_vjp: as a value shared by the leaves, computed after the pass that
  # computes a's sum, from the program's own equations.
  params = {"a": jnp.linspace(-1, 2, 6), "b": jnp.linspace(0, 1, 4)}
  grads = jax.tree.map(lambda p: p * 1e-2, params)
  tx = _coupling(kind)
  want, _ = jax.jit(tx.update)(grads, optax.EmptyState(), params)
  st, reason = ok.per_leaf.stages_of(tx, grads, optax.EmptyState(), params)
  assert st is not None and len(st.rounds) == 1, reason
  got, _ = jax.jit(ok.leafwise(tx).update)(grads, optax.EmptyState(), params)
  _assert_bitwise_equal(got, want, kind)


def test_a_scan_that_keeps_leaves_apart_is_proved_per_leaf():
  def update(updates, state, params=None):
    del params
    def per_leaf(g):
      out, _ = jax.lax.scan(lambda c, _: (c * 0.5, None), g, None, length=3)
      return out
    return jax.tree.map(per_leaf, updates), state
  tx = optax.GradientTransformation(lambda p: optax.EmptyState(), update)
  grads = {"a": jnp.ones(3), "b": jnp.ones(2)}
  st, reason = ok.per_leaf.stages_of(tx, grads, optax.EmptyState(), None)
  assert st is not None, reason
  u, _ = ok.leafwise(tx).update(grads, optax.EmptyState())
  np.testing.assert_array_equal(u["a"], 0.125)


# -- scratch memory -----------------------------------------------------------
def _temp_bytes(make, num_leaves, side=128):
  # On bf16 params: plain Prodigy warns of its stall (d0 = 1e-6), rightly.
  stall = "prodigy" in make.__name__ and "kahan" not in make.__name__
  with pytest.warns(ok.OptaxKahanWarning, match="stalls") if stall else (
      warnings.catch_warnings()):
    return step_memory.temp_bytes(
        make, {f"w{i}": (side, side) for i in range(num_leaves)})


def kahan_adamw():
  return ok.kahan(optax.adamw(1e-4))


def kahan_prodigy():
  return ok.kahan(ok.prodigy())


def leafwise_prodigy_factored():
  return ok.leafwise(ok.prodigy_factored())


def stable_adamw():
  return ok.stable_adamw(1e-4)


@pytest.mark.parametrize("name, make", [
    ("kahan(optax.adamw)", kahan_adamw), ("kahan(prodigy)", kahan_prodigy),
    ("leafwise(prodigy_factored)", leafwise_prodigy_factored),
    # This package's optimizers run row by row bare too.
    ("prodigy", ok.prodigy), ("prodigy_factored", ok.prodigy_factored),
    ("stable_adamw", stable_adamw)])
def test_row_scratch_is_one_leaf_whatever_the_leaf_count(name, make):
  leaf = 128 * 128
  few, many = _temp_bytes(make, 3), _temp_bytes(make, 9)
  assert many <= 16 * leaf + 2**20, name
  # Six more leaves add at most small per-leaf bookkeeping, not leaf data.
  assert many - few < 6 * 1024, (name, few, many)


def whole_tree_prodigy():
  """Prodigy's estimator run as one whole-tree program (not leafwise)."""
  return ok.scale_by_prodigy(ok.scale_by_second_moment(0.9, 0.999))


def test_whole_tree_scratch_grows_with_the_leaf_count():
  # The contrast that makes rows worth having (benchmarks/step_memory.py).
  few = _temp_bytes(whole_tree_prodigy, 3)
  many = _temp_bytes(whole_tree_prodigy, 9)
  assert many - few >= 6 * 4 * 128 * 128


def test_extra_args_reach_every_row_and_the_state_keeps_its_layout():

  def scale_by_value():
    def update(updates, state, params=None, *, value=1.0, **extra):
      del params, extra
      return jax.tree.map(lambda g: value * g, updates), state
    return optax.GradientTransformationExtraArgs(
        lambda params: optax.EmptyState(), update)

  tx = ok.leafwise(scale_by_value())
  params = _params(jnp.float32)
  updates, _ = jax.jit(tx.update)(params, tx.init(params), value=3.0)
  for n in SHAPES:
    np.testing.assert_array_equal(updates[n], 3.0 * params[n])
  for inner in (optax.sgd(0.5, momentum=0.9), optax.adamw(1e-3),
                ok.scale_by_factored_second_moment()):
    tx = ok.leafwise(inner)
    state = tx.init(params)
    _, state = tx.update(params, state, params)
    assert jax.tree.structure(state) == jax.tree.structure(
        inner.init(params))
    mapped = optax.tree.map_params(tx, lambda v: v, state)
    assert jax.tree.structure(mapped) == jax.tree.structure(state)


def test_errors_name_the_problem():
  tx = ok.leafwise(optax.adam(1e-3))
  state = tx.init({"a": jnp.ones(3)})
  with pytest.raises(ValueError, match="could not be traced.*pytree"):
    tx.update({"a": jnp.ones(3), "b": jnp.ones(2)}, state)
  with pytest.raises(ValueError, match="needs params"):
    p = ok.prodigy()
    p.update({"a": jnp.ones(3)}, p.init({"a": jnp.ones(3)}))
  params = {"a": jnp.ones(3), "b": jnp.ones(traced.MAX_SHARED + 1)}
  coupled = optax.chain(optax.adam(1e-3), _coupling("cond"))
  with pytest.raises(ValueError,
                     match="no per-leaf form: its values for leaves .'a'. and "
                     ".'b'. meet in one array of 16385 elements"):
    ok.leafwise(coupled).update(params, coupled.init(params), params)
  # Per-leaf clipping is proved fine.
  clip = optax.chain(optax.clip_by_block_rms(1.0), optax.adam(1e-3))
  ok.leafwise(clip).update(params, clip.init(params), params)


SHARDED = r'''
report = {}
grads_np = host_grads(3)
for name in ("adamw", "prodigy"):
  for mode in ("single", "explicit", "auto"):
    mesh = make_mesh(mode)
    with jax.set_mesh(mesh) if mesh is not None else _nullcontext():
      params = place(host_params(), mesh)
      state, step = init_and_step(make_tx(name), params, mesh, mode)
      grads = [place(g, mesh) for g in grads_np]
      compiled = step.lower(params, state, grads[0]).compile()
      for g in grads:
        params, state = step(params, state, g)
      report[f"{name}/{mode}"] = {
          "w": {k: v.tolist() for k, v in exact(params, state).items()},
          "kinds": sorted({r.sharding.memory_kind for r in
                           jax.tree.leaves(ok.kahan_residuals(state))}),
          "collectives": collectives(compiled.as_text())}
emit(report)
'''


@pytest.mark.slow
@pytest.mark.parametrize("form", ["cpu", "gpu"])
def test_rows_under_fsdp_sharding_match_the_single_device_run(form):
  """8 fake devices, Explicit and Auto FSDP axes, in both forms:
  kahan(adamw) is its single-device run bit for bit in the CPU form and
  within a float32 ulp in the GPU form (measured: one element of one leaf
  under Explicit axes; XLA compiles the partitioned chain differently),
  kahan(prodigy_factored()) within 1e-5 (its sums are reduced across devices
  in another order); no residual is gathered."""
  from _subprocess import run
  force = ("jax.lax.platform_dependent = "
           "lambda *a, cpu, default: default(*a)\n" if form == "gpu" else "")
  report = run("from contextlib import nullcontext as _nullcontext\n"
               + force + SHARDED, devices=8, timeout=300)
  for name, tol in (("adamw", 0.0 if form == "cpu" else 1.2e-7),
                    ("prodigy", 1e-5)):
    want = report[f"{name}/single"]["w"]
    for mode in ("explicit", "auto"):
      got = report[f"{name}/{mode}"]
      assert got["kinds"] == ["pinned_host"], (name, mode)
      assert all(dt != "u16" for _, dt, _ in got["collectives"]), (name, mode)
      for k in want:
        np.testing.assert_allclose(got["w"][k], want[k], rtol=tol,
                                   atol=1e-7 if tol else 0,
                                   err_msg=f"{name}/{mode}/{k}")


def test_for_each_leaf_orders_rows_without_conditionals_on_gpus(monkeypatch):
  rows = [jnp.ones(3), jnp.ones(4)]
  fn = lambda x, k: (x * k, jnp.sum(x))
  cpu = jax.jit(lambda r: ok.per_leaf.for_each_leaf(fn, r, [2.0, 3.0])).lower(
      rows).as_text()
  _force_gpu_form(monkeypatch)
  gpu = jax.jit(lambda r: ok.per_leaf.for_each_leaf(fn, r, [2.0, 3.0])).lower(
      rows).as_text()
  assert "stablehlo.case" in cpu or "stablehlo.if" in cpu
  assert "stablehlo.case" not in gpu and "stablehlo.if" not in gpu
  assert gpu.count("optimization_barrier") >= 4
  out = ok.per_leaf.for_each_leaf(fn, rows, [2.0, 3.0])
  np.testing.assert_array_equal(out[1][0], 3.0)
  assert float(out[1][1]) == 4.0


def test_the_gpu_form_runs_rows_in_ascending_order_of_host_bytes(monkeypatch):
  """On a GPU row i's host inputs come in while row i-1's outputs go out, so
  the rows run sorted by their bytes in host memory (stable: rows of equal
  bytes, and rows with none, keep their order); the outputs come back in
  the rows' order."""
  host = lambda n: jax.device_put(jnp.arange(n, dtype=jnp.uint16),
                                  jax.memory.Space.Host)
  rows = [host(8), jnp.ones(100), host(2), host(8), host(4)]
  ran = []

  def fn(x, i):
    ran.append((x.shape[0], i))
    return jnp.sum(x.astype(jnp.float32)) + i, x[:1]
  _force_gpu_form(monkeypatch)
  out = jax.jit(lambda r: ok.per_leaf.for_each_leaf(fn, r, list(range(5))))(
      rows)
  assert ran == [(100, 1), (2, 2), (4, 4), (8, 0), (8, 3)]
  for i, row in enumerate(rows):
    np.testing.assert_array_equal(
        out[i][0], np.sum(np.asarray(row, np.float32)) + i)


def test_warning_free_kahan_steps():
  # The package's own steps raise none of its warnings on committed params.
  with warnings.catch_warnings():
    warnings.simplefilter("error")
    for make in INNER.values():
      _steps.train(ok.kahan(make()), _params(jnp.bfloat16, wide="b"), _grads,
                   1)


def test_a_custom_rule_coupling_two_leaves_keeps_its_gradient():
  # The norm's custom derivative is twice the true one: a per-leaf form that
  # inlined the call would differentiate its body instead, and differ.
  @jax.custom_jvp
  def norm(a, b):
    return jnp.sqrt(jnp.sum(a * a) + jnp.sum(b * b))

  @norm.defjvp
  def _(primals, tangents):
    (a, b), (ta, tb) = primals, tangents
    n = norm(a, b)
    return n, 2.0 * (jnp.sum(a * ta) + jnp.sum(b * tb)) / n

  def update(g, state, params=None):
    del params
    n = norm(g["a"], g["b"])
    return jax.tree.map(lambda x: x / (1.0 + n), g), state

  tx = optax.GradientTransformation(lambda p: optax.EmptyState(), update)
  g = {"a": jnp.arange(3.0), "b": jnp.ones(2)}

  def loss(t):
    return lambda g: jnp.sum(t.update(g, optax.EmptyState())[0]["a"])

  want = jax.grad(loss(tx))(g)
  got = jax.grad(loss(ok.leafwise(tx)))(g)
  for k in g:
    np.testing.assert_allclose(got[k], want[k], rtol=1e-6, err_msg=k)

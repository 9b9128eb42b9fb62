"""Streaming blocks through the device: ``stream_blocks`` and the pipelined
blockwise step.

On the CPU, host memory (``pinned_host``) is bookkeeping, but the program
is the streaming one: host stacks are fetched one block ahead and written
back one block behind. It must compute what the step without streaming
computes, bit for bit, and leave every streamed leaf in host memory.
"""

import json
import os
import subprocess
import sys

import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest

import optax_kahan as ok
from optax_kahan import blockwise as bw
from optax_kahan._src import interleaved
from optax_kahan._src import placement
from optax_kahan._src.blockwise import pipeline
from tests.test_blockwise import JOINED
from tests.test_blockwise import MODEL
from tests.test_blockwise import batch
from tests.test_blockwise import init_params
from tests.test_gpu_compile import ROOT
from tests.test_gpu_compile import _need_plugin


def _joined(model, tree):
  """The stacks of a stream_blocks layout joined back, as numpy arrays."""
  return [jax.tree.map(np.asarray, stack)
          for stack in ok.blockwise.join_stacks(model, tree)[1].stacks]


def _assert_stacks_equal(model, got, want):
  """The streamed run's stacks and residuals, joined back, equal the plain
  run's bit for bit."""
  for streamed, plain in ((got[1], want[1]), (ok.kahan_residuals(got[2]),
                                              ok.kahan_residuals(want[2]))):
    for a, b in zip(_joined(model, streamed), plain.stacks, strict=True):
      for x, y in zip(jax.tree.leaves(a), jax.tree.leaves(b), strict=True):
        np.testing.assert_array_equal(x, np.asarray(y))


def _doubles(tree):
  return [x for x in jax.tree.leaves(tree, is_leaf=_is_double)
          if _is_double(x)]


def _is_double(x):
  return isinstance(x, ok.blockwise.DoubleBuffer)


def _run(model, tx, params, state, steps, dtype, activations=False):
  # the options the README gives (XLA:GPU's; the CPU accepts them)
  step = jax.jit(lambda p, s, b: bw.blockwise_step(
      model, tx, p, s, b, offload_activations=activations),
                 donate_argnums=(0, 1),
                 compiler_options=ok.blockwise.STREAMING_COMPILER_OPTIONS)
  doubles = bool(_doubles((params, state)))
  losses = []
  for i in range(steps):
    loss, params, state = step(params, state, batch(i, dtype))
    losses.append(float(loss))
    # the spares swap roles: front in b after odd steps, in a after even
    assert all(d.front_is_a == (i % 2 == 1) for d in _doubles((params,
                                                                state)))
  # one program per role of the buffers (which one is front is static)
  assert step._cache_size() == (2 if doubles and steps > 1 else 1)
  return losses, params, state


@pytest.mark.parametrize("model", [
    pytest.param(MODEL, id="two stacks"),
    pytest.param(JOINED, id="transition", marks=pytest.mark.slow)])  # 10 s
def test_streamed_steps_equal_the_plain_steps_bit_for_bit(model):
  tx = ok.kahan(optax.adamw(1e-3))
  dtype = jnp.bfloat16
  params = init_params(dtype)
  state = ok.blockwise.blockwise_init(tx, params)
  want = _run(model, tx, jax.tree.map(jnp.copy, params),
              jax.tree.map(jnp.copy, state), 4, dtype)
  # the double stack split (1 on the device, 2 streamed), the other all on
  # the host
  smodel, sparams, sstate = ok.blockwise.stream_blocks(model, params, state, (2, 2))
  # the double stack: block 0 on the device (its residuals in host memory),
  # blocks 1 and 2 streamed; the single stack's two blocks streamed
  assert [ok.blockwise.num_blocks(x) for x in sparams.stacks] == [1, 2, 2]
  join = model.transitions[0] if model.transitions else None
  assert smodel.transitions == (bw.continue_stack, join)
  for part, host in zip(sstate.stacks, (False, True, True)):
    kinds = {x.sharding.memory_kind for x in jax.tree.leaves(part)}
    assert kinds == ({"pinned_host"} if host else {"device", "pinned_host"})
    # every leaf in host memory has its spare, the others none
    assert all(_is_double(x) == (x.a.sharding.memory_kind == "pinned_host"
                                 if _is_double(x) else
                                 x.sharding.memory_kind == "pinned_host")
               for x in jax.tree.leaves(part, is_leaf=_is_double))
  got = _run(smodel, tx, sparams, sstate, 4, dtype)
  assert got[0] == want[0]
  for part, host in zip(got[1].stacks, (False, True, True)):
    assert all((x.sharding.memory_kind == "pinned_host") == host
               for x in jax.tree.leaves(part))
  _assert_stacks_equal(smodel, got, want)
  np.testing.assert_array_equal(
      np.asarray(got[1].head["w"]), np.asarray(want[1].head["w"]))
  assert ok.blockwise.join_stacks(smodel, got[1])[0].blocks == model.blocks


@pytest.mark.parametrize("num_streamed, spare", [
    pytest.param((0, 0), True, marks=pytest.mark.slow),  # 10 s each
    pytest.param((3, 0), True, marks=pytest.mark.slow),
    pytest.param((1, 1), True, marks=pytest.mark.slow),
    pytest.param((2, 2), False, marks=pytest.mark.slow)])
def test_every_layout_of_a_stack_trains_the_same(num_streamed, spare):
  """A whole stack streamed, a part of one block, nothing streamed (the
  residuals alone with spares), one buffer per leaf."""
  tx = ok.kahan(optax.adamw(1e-3))
  params = init_params(jnp.bfloat16)
  state = ok.blockwise.blockwise_init(tx, params)
  want = _run(MODEL, tx, jax.tree.map(jnp.copy, params),
              jax.tree.map(jnp.copy, state), 3, jnp.bfloat16)
  smodel, sparams, sstate = ok.blockwise.stream_blocks(
      MODEL, params, state, num_streamed, spare_buffers=spare)
  assert bool(_doubles((sparams, sstate))) == spare
  got = _run(smodel, tx, sparams, sstate, 3, jnp.bfloat16)
  assert got[0] == want[0]
  _assert_stacks_equal(smodel, got, want)


@pytest.mark.slow  # 10 s
def test_residuals_kept_on_the_device_for_the_blocks_not_streamed():
  """``kahan(..., offload=False)``: the device blocks keep their residuals
  on the device, the streamed blocks' go to host memory with them."""
  tx = ok.kahan(optax.adamw(1e-3), offload=False)
  params = init_params(jnp.bfloat16)
  state = ok.blockwise.blockwise_init(tx, params)
  want = _run(MODEL, tx, jax.tree.map(jnp.copy, params),
              jax.tree.map(jnp.copy, state), 3, jnp.bfloat16)
  smodel, sparams, sstate = ok.blockwise.stream_blocks(MODEL, params, state, (2, 0))
  kinds = lambda t: {x.sharding.memory_kind for x in jax.tree.leaves(t)}
  assert kinds(ok.kahan_residuals(sstate.stacks[0])) == {"device"}
  assert kinds(ok.kahan_residuals(sstate.stacks[1])) == {"pinned_host"}
  got = _run(smodel, tx, sparams, sstate, 3, jnp.bfloat16)
  assert got[0] == want[0]
  _assert_stacks_equal(smodel, got, want)


def test_residuals_on_device_keeps_the_first_blocks_state_on_the_device():
  """``residuals_on_device``: the first blocks of a stack keep their
  residuals on the device, the next ones in host memory (with spares), the
  streamed ones with their weights; the same step, bit for bit."""
  tx = ok.kahan(optax.adamw(1e-3))
  params = init_params(jnp.bfloat16)
  state = ok.blockwise.blockwise_init(tx, params)
  with pytest.raises(ValueError, match=r"residuals_on_device\[0\] = 3, but "
                     "stack 0 has 2 blocks not streamed"):
    ok.blockwise.stream_blocks(MODEL, params, state, (1, 0),
                               residuals_on_device=(3, 0))
  with pytest.raises(ValueError, match=r"residuals_on_device must be a tuple "
                     "of 2 ints"):
    ok.blockwise.stream_blocks(MODEL, params, state, (1, 0),
                               residuals_on_device=(True, 0))
  on_device = ok.kahan(optax.adamw(1e-3), offload=False)
  with pytest.warns(UserWarning, match=r"residuals_on_device\[1\] = 1 moves "
                    "nothing"):
    ok.blockwise.stream_blocks(
        MODEL, params, ok.blockwise.blockwise_init(on_device, params), (1, 0),
        residuals_on_device=(0, 1))
  want = _run(MODEL, tx, jax.tree.map(jnp.copy, params),
              jax.tree.map(jnp.copy, state), 3, jnp.bfloat16)
  smodel, sparams, sstate = ok.blockwise.stream_blocks(
      MODEL, params, state, (1, 0), residuals_on_device=(1, 2))
  # double stack: block 0 all on the device, block 1 its residuals in host
  # memory, block 2 streamed; the single stack all on the device
  assert [ok.blockwise.num_blocks(x) for x in sparams.stacks] == [1, 1, 1, 2]
  kinds = lambda t: {x.sharding.memory_kind for x in jax.tree.leaves(t)}
  assert [kinds(ok.blockwise.front_buffers(ok.kahan_residuals(x)))
          for x in sstate.stacks] == [{"device"}, {"pinned_host"},
                                      {"pinned_host"}, {"device"}]
  assert [kinds(x) for x in sparams.stacks] == [
      {"device"}, {"device"}, {"pinned_host"}, {"device"}]
  got = _run(smodel, tx, sparams, sstate, 3, jnp.bfloat16)
  assert got[0] == want[0]
  _assert_stacks_equal(smodel, got, want)


@pytest.mark.slow  # 15 s each
@pytest.mark.parametrize("num_streamed, kept", [((3, 1), None),
                                                ((1, 0), (1, 1))])
def test_streamed_prodigy_keeps_its_lagged_d(num_streamed, kept):
  tx = ok.kahan(ok.prodigy_factored(lagged_d=True))
  params = init_params(jnp.bfloat16)
  state = ok.blockwise.blockwise_init(tx, params)
  want = _run(MODEL, tx, jax.tree.map(jnp.copy, params),
              jax.tree.map(jnp.copy, state), 3, jnp.bfloat16)
  smodel, sparams, sstate = ok.blockwise.stream_blocks(
      MODEL, params, state, num_streamed, residuals_on_device=kept)
  got = _run(smodel, tx, sparams, sstate, 3, jnp.bfloat16)
  assert got[0] == want[0]
  np.testing.assert_array_equal(ok.prodigy_d(got[2].head),
                                ok.prodigy_d(want[2].head))


@pytest.mark.parametrize("make, layout", [
    pytest.param(lambda: ok.kahan(optax.adamw(1e-3)), (2, 2), id="adamw"),
    pytest.param(lambda: ok.kahan(ok.prodigy_factored(lagged_d=True)), None,
                 id="prodigy_factored", marks=pytest.mark.slow)])  # 10 s
def test_activations_in_host_memory_train_as_the_plain_step(make, layout):
  """``offload_activations``: the blocks' saved inputs cross to host memory
  and back; the same arithmetic, bit for bit (streamed blocks or not)."""
  tx = make()
  params = init_params(jnp.bfloat16)
  state = ok.blockwise.blockwise_init(tx, params)
  want = _run(MODEL, tx, jax.tree.map(jnp.copy, params),
              jax.tree.map(jnp.copy, state), 3, jnp.bfloat16)
  model = MODEL
  if layout is not None:
    model, params, state = ok.blockwise.stream_blocks(MODEL, params, state,
                                                      layout)
  got = _run(model, tx, params, state, 3, jnp.bfloat16, activations=True)
  assert got[0] == want[0]
  _assert_stacks_equal(model, got, want)
  np.testing.assert_array_equal(ok.kahan_residuals(got[2].head)["w"],
                                ok.kahan_residuals(want[2].head)["w"])
  with pytest.raises(TypeError, match="offload_activations must be True or"):
    bw.blockwise_step(model, tx, got[1], got[2], batch(0, jnp.bfloat16),
                      offload_activations=1)


def test_offloaded_activations_are_saved_in_host_memory():
  stack = {"w": jnp.ones((3, 4, 4)) / 4}
  block = lambda p, c, _: jnp.tanh(c @ p["w"])
  for offload, space in ((False, jax.memory.Space.Device),
                         (True, jax.memory.Space.Host)):
    _, saved = pipeline.forward_stack(block, stack, jnp.ones((2, 4)), (),
                                      offload)
    assert jax.typeof(saved).memory_space == space
    assert saved.shape == (3, 2, 4)


def test_a_double_buffer_keeps_its_arrays_in_place_and_flips_its_front():
  a, b, new = jnp.zeros(2), jnp.ones(2), jnp.full(2, 2.0)
  d = ok.blockwise.DoubleBuffer(a, b)
  assert d.front is a and d.back is b
  e = d.flip(new)  # written into the back buffer, which becomes the front
  assert e.a is a and e.b is new and e.front is new and e.back is a
  f = e.flip(b)
  assert f.a is b and f.b is new and f.front is b
  leaves, treedef = jax.tree.flatten(e)
  assert leaves == [a, new]
  # which buffer is front is static: a jitted step retraces when it flips
  assert treedef != jax.tree.structure(d)
  values = ok.blockwise.front_buffers({"x": e, "y": a})
  assert values["x"] is new and values["y"] is a


def test_with_front_buffers_puts_values_back_keeping_spares_and_roles():
  host = lambda x: jax.device_put(x, jax.memory.Space.Host)
  a, b, new = host(jnp.zeros(2)), host(jnp.ones(2)), host(jnp.full(2, 2.0))
  layout = {"x": ok.blockwise.DoubleBuffer(a, b, front_is_a=False), "y": jnp.zeros(3)}
  y = jnp.ones(3)
  tree = ok.blockwise.with_front_buffers(layout, {"x": new, "y": y})
  # the same structure (roles included): a jitted step does not retrace
  assert jax.tree.structure(tree) == jax.tree.structure(layout)
  assert tree["x"].a is a and tree["x"].front is new and tree["y"] is y
  # a host leaf restored into device memory would silently stop streaming
  with pytest.raises(ValueError, match=r"\['x'\] is in host memory in the "
                     "layout but not in values"):
    ok.blockwise.with_front_buffers(layout, {"x": jnp.zeros(2), "y": y})
  # a layout an earlier donating step consumed: its spare is gone
  a.delete()
  with pytest.raises(ValueError, match=r"spare buffer of \['x'\] in layout "
                     "was deleted"):
    ok.blockwise.with_front_buffers(layout, {"x": new, "y": y})


def test_stream_blocks_names_a_count_that_does_not_fit():
  tx = optax.adamw(1e-3)
  params = init_params(jnp.float32)
  state = ok.blockwise.blockwise_init(tx, params)
  with pytest.raises(ValueError, match=r"num_streamed\[1\] = 3, but stack 1 "
                     "has 2 blocks"):
    ok.blockwise.stream_blocks(MODEL, params, state, (0, 3))
  for wrong in ((1,), 3, (1.0, 0)):
    with pytest.raises(ValueError, match=r"num_streamed must be a tuple of 2 "
                       r"ints, one per stack \(blocks per stack: \(\d+, 2\)\)"):
      ok.blockwise.stream_blocks(MODEL, params, state, wrong)
  model, params, state = ok.blockwise.stream_blocks(MODEL, params, state, (1, 0))
  # streaming twice would nest the spares; initializing on spares would
  # give the state of both buffers
  with pytest.raises(ValueError, match=r"\.stacks\[1\]\['mod'\] is a "
                     "DoubleBuffer .*join_stacks"):
    ok.blockwise.stream_blocks(model, params, state, (1, 0, 0))
  with pytest.raises(ValueError, match="blockwise_init: .* DoubleBuffer"):
    ok.blockwise.blockwise_init(tx, params)


def test_stream_blocks_places_abstract_leaves_for_compiling_ahead():
  tx = ok.kahan(optax.adamw(1e-3))
  params = init_params(jnp.bfloat16)
  state = ok.blockwise.blockwise_init(tx, params)
  sds = lambda x: jax.ShapeDtypeStruct(x.shape, x.dtype, sharding=x.sharding)
  _, p, s = ok.blockwise.stream_blocks(MODEL, jax.tree.map(sds, params),
                             jax.tree.map(sds, state), (1, 0))
  # the double stack: blocks 0, 1 on the device, block 2 streamed; the
  # single stack whole on the device
  assert [jax.tree.leaves(x)[0].shape[0] for x in p.stacks] == [2, 1, 2]
  assert {x.sharding.memory_kind for x in jax.tree.leaves(p.stacks[1])} == {
      "pinned_host"}
  assert all(isinstance(x, ok.blockwise.DoubleBuffer) for x in jax.tree.leaves(
      p.stacks[1], is_leaf=_is_double))
  # the residuals of the device part have their spares
  assert _doubles(ok.kahan_residuals(s.stacks[0]))


def test_stream_blocks_puts_weights_loaded_into_host_memory_on_the_device():
  # a model too large for the device is loaded into host memory first: the
  # blocks not streamed go to the device, as num_streamed says
  tx = ok.kahan(optax.adamw(1e-3))
  params = init_params(jnp.bfloat16)
  state = ok.blockwise.blockwise_init(tx, params)
  loaded = params._replace(stacks=jax.device_put(params.stacks,
                                                 jax.memory.Space.Host))
  _, p, s = ok.blockwise.stream_blocks(MODEL, loaded, state, (1, 2))
  kinds = lambda t: {x.sharding.memory_kind for x in jax.tree.leaves(t)}
  assert [kinds(x) for x in p.stacks] == [{"device"}, {"pinned_host"},
                                          {"pinned_host"}]
  # the state stays where blockwise_init put it: residuals in host memory
  assert kinds(ok.kahan_residuals(s.stacks[0])) == {"pinned_host"}
  assert kinds(s.stacks[0]) == {"device", "pinned_host"}


# -- FSDP over 8 CPU devices ---------------------------------------------------
SHARDED = r'''
from tests.test_blockwise import MODEL, batch, init_params
out, devices = sys.argv[1], int(sys.argv[2])
mesh = jax.make_mesh((devices,), ("fsdp",), axis_types=(AxisType.Explicit,))
report = {}


def fsdp(x):  # the last axis sharded (FSDP), the block axis never
  spec = [None] * x.ndim
  if x.ndim and x.shape[-1] % devices == 0:
    spec[-1] = "fsdp"
  return jax.device_put(np.asarray(x), NamedSharding(mesh, P(*spec)))


with jax.set_mesh(mesh):
  for name, tx in (("adamw", ok.kahan(optax.adamw(1e-3))),
                   ("prodigy", ok.kahan(ok.prodigy_factored(lagged_d=True)))):
    # one device: only the streamed layout is compared with
    for streamed in ((2, 2), (0, 0)) if devices > 1 else ((2, 2),):
      params = jax.tree.map(fsdp, init_params(jnp.bfloat16))
      state = ok.blockwise.blockwise_init(tx, params)
      model, params, state = ok.blockwise.stream_blocks(MODEL, params, state, streamed)
      step = jax.jit(lambda p, s, b: ok.blockwise.blockwise_step(model, tx, p, s, b),
                     donate_argnums=(0, 1))
      for i in range(3):
        _, params, state = step(params, state, batch(i, jnp.bfloat16))
      _, joined = ok.blockwise.join_stacks(model, params)
      _, res = ok.blockwise.join_stacks(model, ok.kahan_residuals(state))
      w = [np.asarray(x) for x in jax.tree.leaves(
          ok.kahan_to_float32(joined, res))]
      np.savez(f"{out}/{name}_{devices}_{sum(streamed)}.npz", *w)
      stack = jax.tree.leaves(params.stacks[-1])
      report[f"{name}/{sum(streamed)}"] = {
          "cache_size": step._cache_size(),
          "memory": sorted({x.sharding.memory_kind for x in stack}),
          "shards": len(stack[0].addressable_shards),
          "spec": str(stack[0].sharding.spec)}
emit(report)
'''


@pytest.mark.slow  # 40 s: two child processes
def test_the_streamed_step_under_fsdp_on_8_devices_matches_one_device(
    tmp_path):
  from tests._subprocess import run
  reports = {n: run(SHARDED, str(tmp_path), str(n), devices=n, timeout=300)
             for n in (8, 1)}
  for name in ("adamw", "prodigy"):
    for streamed, memory in ((4, "pinned_host"), (0, "device")):
      r = reports[8][f"{name}/{streamed}"]
      # one program per role of the spare buffers
      assert r["cache_size"] == 2 and r["memory"] == [memory]
      assert r["shards"] == 8 and "fsdp" in r["spec"]
    load = lambda n, k: np.load(tmp_path / f"{name}_{n}_{k}.npz")
    with load(8, 4) as a, load(8, 0) as b, load(1, 4) as c:
      assert len(a.files) == len(b.files) == len(c.files) == 11
      for k in b.files:
        # streaming changes nothing, under FSDP too; Prodigy adds the split
        # stack's sums of <g, x0 - x> part by part (another order)
        if name == "adamw":
          np.testing.assert_array_equal(a[k].view(np.uint32),
                                        b[k].view(np.uint32), err_msg=k)
        else:
          np.testing.assert_allclose(a[k], b[k], rtol=1e-6, err_msg=k)
        # 8 devices against 1: the sharded matmuls' gradients add their
        # partial sums in another order (a few float32 ulps). Adam's first
        # steps divide g by |g|, so where a gradient is near zero that moves
        # the update by a fraction of the learning rate (1e-3): within 1e-4.
        np.testing.assert_allclose(a[k], c[k], rtol=2e-5, atol=1e-4,
                                   err_msg=k)


def test_residual_helpers_refuse_a_streamed_layout_naming_front_buffers():
  params = {"w": ok.blockwise.DoubleBuffer(jnp.ones((2, 3), jnp.bfloat16),
                                 jnp.zeros((2, 3), jnp.bfloat16))}
  residuals = {"w": ok.blockwise.DoubleBuffer(jnp.zeros((2, 3), jnp.uint16),
                                    jnp.zeros((2, 3), jnp.uint16))}
  plain_p = ok.blockwise.front_buffers(params)
  for p, r in ((params, residuals), (plain_p, residuals), (params,
                                                           ok.blockwise.front_buffers(
                                                               residuals))):
    with pytest.raises(ValueError, match=r"kahan_to_float32: \w+ leaf "
                       r"\['w'\] is a DoubleBuffer.*front_buffers"):
      ok.kahan_to_float32(p, r)
  with pytest.raises(ValueError, match="kahan_apply_updates.*front_buffers"):
    ok.kahan_apply_updates(params, plain_p, residuals)
  w32 = ok.kahan_to_float32(plain_p, ok.blockwise.front_buffers(residuals))
  np.testing.assert_array_equal(w32["w"], 1.0)


# -- interleave=True: each streamed leaf dealt into three host arrays --------

def _chain(n, width=8):
  """A stack of ``n`` blocks of one matrix and one bias each, bf16."""
  k = jax.random.split(jax.random.key(n), 3)
  model = bw.BlockwiseModel(
      embed=lambda p, x: (x * p["w"], ()),
      blocks=(lambda p, h, _: jnp.tanh(h @ p["w"]) + p["b"],),
      head=lambda p, h, _, x: jnp.mean((h @ p["w"] - x) ** 2))
  params = jax.device_put(bw.BlockwiseParams(
      embed={"w": jnp.ones(width, jnp.bfloat16)},
      stacks=({"w": (jax.random.normal(k[0], (n, width, width))
                     / width ** 0.5).astype(jnp.bfloat16),
               "b": (0.1 * jax.random.normal(k[1], (n, width))
                     ).astype(jnp.bfloat16)},),
      head={"w": jnp.eye(width, dtype=jnp.bfloat16)}), jax.devices()[0])
  return model, params


def _chain_steps(model, tx, params, state, activations, steps=2):
  step = jax.jit(lambda p, s, b: bw.blockwise_step(
      model, tx, p, s, b, offload_activations=activations),
                 donate_argnums=(0, 1))
  losses = []
  for i in range(steps):
    loss, params, state = step(params, state,
                               jnp.arange(8.0, dtype=jnp.bfloat16) + i)
    losses.append(float(loss))
  return losses, params, state


# The loop runs three blocks per iteration after the top 1, 2 or 3 blocks:
# every top count, with and without a loop, parts of 0 rows, part of a
# stack streamed, activations on either side.
@pytest.mark.parametrize("n, k, activations", [
    (7, 4, False), (6, 6, True)] + [
    pytest.param(n, k, a, marks=pytest.mark.slow)  # 5 s each
    for n, k, a in ((1, 1, False), (2, 2, True), (3, 3, True), (4, 4, False),
                    (5, 5, True), (7, 7, True), (8, 8, False), (8, 1, True),
                    (6, 0, False), (9, 9, True))])
def test_interleaved_layouts_train_as_the_plain_step(n, k, activations):
  tx = ok.kahan(optax.adamw(1e-2))
  model, params = _chain(n)
  state = bw.blockwise_init(tx, params)
  want = _chain_steps(model, tx, jax.tree.map(jnp.copy, params),
                      jax.tree.map(jnp.copy, state), activations)
  smodel, sparams, sstate = bw.stream_blocks(model, params, state, (k,),
                                             interleave=True)
  assert not _doubles((sparams, sstate))
  # every stacked leaf in host memory is dealt three ways: the streamed
  # part's weights and state, the other part's residuals
  leaves = jax.tree.leaves((sparams.stacks, sstate.stacks),
                           is_leaf=_is_interleaved)
  assert not any(map(placement.in_host_memory, leaves))
  dealt = [x for x in leaves if _is_interleaved(x)]
  assert len(dealt) == 9 * (k > 0) + 2 * (k < n)  # w, b; mu, nu, residuals
  got = _chain_steps(smodel, tx, sparams, sstate, activations)
  # The same arithmetic: bit for bit with jax 0.10.2. XLA:CPU compiles the
  # two programs apart, and jax >= 0.12.1 contracts a multiply-add into an
  # FMA in one and not the other (none with --xla_cpu_max_isa=SSE4_2, which
  # has no FMA): one ulp of a float32 master weight after the first step,
  # up to 8 after the second (through Adam's moments), in 7 of these 12
  # cases. A block read from another row or part is off by far more.
  np.testing.assert_allclose(got[0], want[0], rtol=1e-6)
  masters = [ok.kahan_to_float32(
      bw.join_stacks(smodel, run[1])[1] if run is got else run[1],
      bw.join_stacks(smodel, ok.kahan_residuals(run[2]))[1]
      if run is got else ok.kahan_residuals(run[2])).stacks
             for run in (got, want)]
  assert _ulps(*masters) <= 16
  for x in jax.tree.leaves(got[1:], is_leaf=_is_interleaved):
    if _is_interleaved(x):  # still in host memory, dealt the same way
      assert {p.sharding.memory_kind for p in x.parts} == {"pinned_host"}
      assert x.num_blocks in (k, n - k)


def _ulps(a, b):
  """The largest distance in float32 ulps between two trees of arrays."""
  worst = 0
  for x, y in zip(jax.tree.leaves(a), jax.tree.leaves(b), strict=True):
    ix, iy = (np.asarray(v, np.float32).view(np.int32).astype(np.int64)
              for v in (x, y))
    ix, iy = (np.where(i < 0, -(i & 0x7FFFFFFF), i) for i in (ix, iy))
    worst = max(worst, int(np.max(np.abs(ix - iy), initial=0)))
  return worst


def _is_interleaved(x):
  return isinstance(x, ok.blockwise.Interleaved)


def test_interleave_deals_block_b_to_row_b_div_3_of_part_b_mod_3():
  x = jnp.arange(7 * 2).reshape(7, 2)
  d = interleaved.interleave(x)
  assert d.num_blocks == 7 and d.block_shape == (2,)
  for b in range(7):
    np.testing.assert_array_equal(d.parts[b % 3][b // 3], x[b])
  np.testing.assert_array_equal(interleaved.deinterleave(d), x)
  sds = interleaved.interleave(jax.ShapeDtypeStruct((7, 2), jnp.bfloat16))
  assert [p.shape for p in sds.parts] == [(3, 2), (2, 2), (2, 2)]


def test_interleave_is_one_choice_beside_spare_buffers():
  tx = ok.kahan(optax.adamw(1e-3))
  model, params = _chain(4)
  state = bw.blockwise_init(tx, params)
  with pytest.raises(ValueError, match="spare_buffers=True and "
                     "interleave=True .* choose one"):
    bw.stream_blocks(model, params, state, (2,), spare_buffers=True,
                     interleave=True)
  with pytest.raises(TypeError, match="interleave must be True or False"):
    bw.stream_blocks(model, params, state, (2,), interleave=1)
  smodel, sparams, sstate = bw.stream_blocks(model, params, state, (2,),
                                             interleave=True)
  # one host copy: the streamed bytes once, not twice
  assert placement.host_bytes((sparams, sstate)) == placement.host_bytes(
      bw.stream_blocks(model, params, state, (2,), spare_buffers=False)[1:])
  # the forward pass reads the parts in block order
  x = jnp.arange(8.0, dtype=jnp.bfloat16)
  assert float(bw.blockwise_loss(model, params, x)) == float(
      bw.blockwise_loss(smodel, sparams, x))
  # a checkpoint of the values restores into the layout as it is
  values = bw.front_buffers((sparams, sstate))
  again = bw.with_front_buffers((sparams, sstate), values)
  assert jax.tree.structure(again) == jax.tree.structure((sparams, sstate))
  # what takes plain arrays names the layout and the way back
  with pytest.raises(ValueError, match=r"kahan_to_float32: params leaf "
                     r"\.stacks\[1\]\['b'\] is Interleaved.*join_stacks"):
    ok.kahan_to_float32(sparams, ok.kahan_residuals(sstate))


@pytest.mark.slow  # about 1 min (4 with jax 0.12.1): the oldest stack's CI
def test_interleaved_host_arrays_keep_one_copy_and_beat_one_buffer():
  # benchmarks.streaming --interleave at 2 + 4 FLUX.1-dev blocks, compiled
  # for the H200: stream_blocks(..., interleave=True) against one buffer per
  # leaf, every block streamed, activations in host memory
  _need_plugin()
  out = subprocess.run([sys.executable, "-m", "benchmarks.streaming",
                        "--interleave", "--quick"], cwd=ROOT,
                       capture_output=True, text=True, timeout=1200)
  assert out.returncode == 0, out.stdout[-4000:] + out.stderr[-4000:]
  with open(os.path.join(ROOT, "benchmarks", "results",
                         "streaming_interleave_quick.json")) as f:
    rows = json.load(f)["rows"]
  one, dealt = (rows[f"`(2, 4)` streamed, {how}, activations in host "
                     "memory, batch 2"] for how in (
                         "one buffer per leaf",
                         "interleaved (three host arrays per leaf)"))
  # the same weights and state in host memory, once; the same gemms; no
  # weight or state array copied whole in host memory (XLA copies a few
  # per-block scalars: the late sums' f32[1, 2] parts, 24 bytes in all)
  assert dealt["host_bytes"] == one["host_bytes"] > 0
  assert dealt["gemm_flops"] == one["gemm_flops"]
  assert one["host_copy_bytes"] == 0 and dealt["host_copy_bytes"] <= 1000
  # the fetches no longer wait for the write-backs
  assert dealt["step_s"] < one["step_s"]

"""benchmarks.host_buffers: the host layouts of a streamed stack.

Each layout's loop is run on the CPU (host memory is bookkeeping there) and
must compute what the spare-buffer loop computes, bit for bit; the compiled
H200 programs (deviceless) must show what the docs say of them.
"""

import json
import os

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from benchmarks import host_buffers
from benchmarks import timeline
from tests.test_gpu_compile import ROOT
from tests.test_gpu_compile import _run_module


def test_every_layout_computes_what_the_spare_buffers_compute():
  n, d = 9, 8
  key = jax.random.key(0)
  w = jax.random.normal(key, (n, d, d), jnp.bfloat16) / 4
  a = jax.random.normal(jax.random.key(1), (d, d), jnp.bfloat16)
  host = lambda x: jax.device_put(x, jax.memory.Space.Host)
  thirds = lambda x: [host(x[r::3]) for r in range(3)]
  results = {}
  for name, (loop, whole, parts) in host_buffers.layouts(n).items():
    args = ([host(w)] * whole + thirds(w) * (parts // 3)) + [a]
    out = jax.jit(loop)(*args)
    if whole == 2:  # the read buffer, the written one, a
      stack = out[1]
    elif whole == 1:
      stack = out[0]
    else:  # blocks i in array i % 3
      stack = np.empty((n, d, d), np.float32)
      for r in range(3):
        stack[r::3] = np.asarray(out[r], np.float32)
    results[name] = (np.asarray(stack, np.float32),
                     np.asarray(out[-1], np.float32))
  want = results["spare"]
  assert not np.array_equal(want[0], np.asarray(w, np.float32))
  for name, (stack, act) in results.items():
    np.testing.assert_array_equal(stack, want[0], err_msg=name)
    np.testing.assert_array_equal(act, want[1], err_msg=name)
  # two stacks' loops, as written and peeled: the spare loop run twice
  half = host(w[:4]), host(w[4:8])
  once = jax.jit(host_buffers.layouts(4)["spare"][0])
  r1, first, act = once(half[0], half[0], a)
  expected_all = (r1, first, *once(half[1], half[1], act))
  for name, loop in host_buffers.two_stacks(4).items():
    out = jax.jit(loop)(half[0], half[0], half[1], half[1], a)
    for got, expected in zip(out, expected_all, strict=True):
      np.testing.assert_array_equal(np.asarray(got, np.float32),
                                    np.asarray(expected, np.float32),
                                    err_msg=name)


@pytest.mark.slow  # 15 s
def test_only_the_spare_buffers_hide_both_directions_in_the_gpu_program():
  _run_module("benchmarks.host_buffers", "--tag", "quick")
  with open(os.path.join(ROOT, "benchmarks", "results",
                         "host_buffers_quick.json")) as f:
    r = json.load(f)
  rows = r["rows"]
  ram = {k: v["host_bytes"] / v["stack_bytes"] for k, v in rows.items()}
  spare = rows["spare"]
  assert ram["spare"] == 2 and spare["host_copy_bytes"] == 0
  assert min(spare["h2d_hidden"], spare["d2h_hidden"]) > 0.9
  # one buffer: the write-back waits for nothing, the fetch after it is
  # not hidden ...
  after = rows["one buffer, fetch after the write"]
  assert ram["one buffer, fetch after the write"] == 1
  assert after["d2h_hidden"] < 0.1 and after["step_s"] > 1.3 * spare["step_s"]
  # ... or XLA copies the whole array to keep the old one
  assert rows["one buffer, fetch before the write"]["host_copy_bytes"] > (
      spare["stack_bytes"])
  assert rows["three arrays rotated in the loop"]["host_copy_bytes"] > (
      spare["stack_bytes"])
  # three arrays unrolled: one copy, no array copied, but the fetches run
  # late in the unrolled body
  lanes = rows["three interleaved arrays, unrolled by three"]
  assert ram["three interleaved arrays, unrolled by three"] == 1
  assert lanes["host_copy_bytes"] == 0
  assert lanes["h2d_hidden"] < 0.5 and lanes["step_s"] > 1.2 * spare["step_s"]
  # one buffer, the write-back ordered after the fetch: no array copied, but
  # now the fetch is not hidden
  ordered = rows["one buffer, the write after the fetch completes"]
  assert ram["one buffer, the write after the fetch completes"] == 1
  assert ordered["host_copy_bytes"] == 0 and ordered["h2d_hidden"] < 0.1
  assert ordered["step_s"] > 1.3 * spare["step_s"]
  # between two loops no transfer is in flight: the second loop's first
  # fetch waits, unless the first loop's last iteration is out of its loop
  plain = r["handoff"]["two loops"]
  peeled = r["handoff"]["two loops, first and last iterations peeled"]
  block = r["d"] ** 2 * 2 / timeline.PCIE  # a block's fetch, as modeled
  assert plain["h2d_wait_s"] > 1.9 * block
  assert peeled["h2d_wait_s"] < 1.1 * block
  assert peeled["step_s"] < plain["step_s"] - 0.8 * block

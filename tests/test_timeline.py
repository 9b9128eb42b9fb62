"""benchmarks.timeline: the schedule replay, on a small hand-written program.

The program: a loop of 3 iterations, each copying a 2 MB host slice in
(``copy-start``/``copy-done``) around a 1024^3 gemm, then one 2 MB copy
back to the host. Every figure below is computed by hand from the model's
rules, so the replay is checked, not just run.
"""

import pytest

from optax_kahan._src import timeline

HLO = """HloModule m, is_scheduled=true

%dot_comp (p0: bf16[1024,1024], p1: bf16[1024,1024]) -> bf16[1024,1024] {
  %p0 = bf16[1024,1024]{1,0} parameter(0)
  %p1 = bf16[1024,1024]{1,0} parameter(1)
  ROOT %d = bf16[1024,1024]{1,0} dot(%p0, %p1), lhs_contracting_dims={1}, rhs_contracting_dims={0}
}

%body (t: (s32[], bf16[1024,1024], u16[1024,1024])) -> (s32[], bf16[1024,1024], u16[1024,1024]) {
  %t = (s32[], bf16[1024,1024]{1,0}, u16[1024,1024]{1,0:S(5)}) parameter(0)
  %i = s32[] get-tuple-element(%t), index=0
  %x = bf16[1024,1024]{1,0} get-tuple-element(%t), index=1
  %h = u16[1024,1024]{1,0:S(5)} get-tuple-element(%t), index=2
  %cs = (u16[1024,1024]{1,0}, u16[1024,1024]{1,0:S(5)}, u32[]) copy-start(%h)
  %g = bf16[1024,1024]{1,0} fusion(%x, %x), kind=kCustom, calls=%dot_comp
  %cd = u16[1024,1024]{1,0} copy-done(%cs)
  ROOT %r = (s32[], bf16[1024,1024]{1,0}, u16[1024,1024]{1,0:S(5)}) tuple(%i, %g, %h)
}

%cond (t: (s32[], bf16[1024,1024], u16[1024,1024])) -> pred[] {
  %t = (s32[], bf16[1024,1024]{1,0}, u16[1024,1024]{1,0:S(5)}) parameter(0)
  ROOT %p = pred[] constant(true)
}

ENTRY %main (x: bf16[1024,1024], h: u16[1024,1024]) -> u16[1024,1024] {
  %x = bf16[1024,1024]{1,0} parameter(0)
  %h = u16[1024,1024]{1,0:S(5)} parameter(1)
  %z = s32[] constant(0)
  %t = (s32[], bf16[1024,1024]{1,0}, u16[1024,1024]{1,0:S(5)}) tuple(%z, %x, %h)
  %w = (s32[], bf16[1024,1024]{1,0}, u16[1024,1024]{1,0:S(5)}) while(%t), condition=%cond, body=%body, backend_config={"known_trip_count":{"n":"3"}}
  %y = bf16[1024,1024]{1,0} get-tuple-element(%w), index=1
  %b = u16[1024,1024]{1,0} bitcast(%y)
  %os = (u16[1024,1024]{1,0:S(5)}, u16[1024,1024]{1,0}, u32[]) copy-start(%b)
  ROOT %od = u16[1024,1024]{1,0:S(5)} copy-done(%os)
}
"""

FLOPS = 2.0 * 1024**3  # one gemm
BYTES = 2 * 1024**2  # one copy


def test_the_replay_follows_the_schedule():
  # gemm 1 s, copy 0.5 s: each copy in hides behind its iteration's gemm;
  # the copy out waits for the loop, runs alone and is exposed
  t = timeline.model(HLO, gemm_flops=FLOPS, pcie=2 * BYTES)
  assert t.gemm_flops == 3 * FLOPS and t.gemm_s == pytest.approx(3.0)
  assert (t.h2d_bytes, t.d2h_bytes, t.transfers) == (3 * BYTES, BYTES, 4)
  assert t.h2d_s == pytest.approx(1.5) and t.h2d_hidden == pytest.approx(1)
  assert t.d2h_hidden == pytest.approx(0)
  assert t.step_s == pytest.approx(3.5)


def test_a_copy_longer_than_its_gemm_is_partly_exposed():
  # copy 4 s against a 1 s gemm: each iteration waits 3 s at copy-done
  t = timeline.model(HLO, gemm_flops=FLOPS, pcie=BYTES / 4)
  assert t.h2d_wait_s == pytest.approx(9.0)
  assert t.h2d_hidden == pytest.approx(1 - 9 / 12)
  assert t.step_s == pytest.approx(3 * 4.0 + 4.0)


def test_a_copy_of_a_host_array_blocks_the_compute_stream():
  # XLA's copy of a whole host array (to keep a value it updates in place):
  # 2 MB at the PCIe rate, on the compute stream, reported apart
  hlo = """HloModule c, is_scheduled=true

ENTRY %main (h: u16[1024,1024]) -> u16[1024,1024] {
  %h = u16[1024,1024]{1,0:S(5)} parameter(0)
  ROOT %c = u16[1024,1024]{1,0:S(5)} copy(%h)
}
"""
  t = timeline.model(hlo, gemm_flops=FLOPS, pcie=2 * BYTES)
  assert t.host_copy_bytes == BYTES and t.transfers == 0
  assert t.step_s == pytest.approx(0.5)
  assert timeline.model(HLO, gemm_flops=FLOPS, pcie=2 * BYTES
                        ).host_copy_bytes == 0


def test_the_loop_floor_takes_each_iteration_at_its_longest_part():
  # gemm 1 s, copy in 0.5 s per iteration: 3 s, the copy out (outside the
  # loop) hidden; copy in 4 s: 12 s, below the modeled 16 s
  assert timeline.model(HLO, gemm_flops=FLOPS, pcie=2 * BYTES
                        ).loop_floor_s == pytest.approx(3.0)
  assert timeline.model(HLO, gemm_flops=FLOPS, pcie=BYTES / 4
                        ).loop_floor_s == pytest.approx(12.0)

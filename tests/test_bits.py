"""split_float32 / merge_float32 on a dense strided sample of all 2**32 bit patterns."""

import functools

import jax
import jax.numpy as jnp
import numpy as np
import pytest

import optax_kahan as ok

# Stride 4093 (prime) visits ~1.05M patterns spread over the whole space, plus
# dense windows around the interesting boundaries.
_WINDOWS = [0x00000000, 0x00800000, 0x3F800000, 0x7F7F0000, 0x7F7F8000,
            0x7F800000, 0x7FC00000]


def _sample_bits() -> np.ndarray:
  strided = np.arange(0, 2**32, 4093, dtype=np.uint64)
  windows = [np.arange(w - 2**12, w + 2**12, dtype=np.int64) % 2**31
             for w in _WINDOWS]
  mags = np.concatenate([strided] + [w.astype(np.uint64) for w in windows])
  signs = np.array([0, 2**31], np.uint64)
  both = (mags[None, :] % 2**31 | signs[:, None]).reshape(-1)
  return np.unique(np.concatenate([strided, both])).astype(np.uint32)


BITS = _sample_bits()
X = BITS.view(np.float32)
IS_NAN = np.isnan(X)
MAG = BITS & 0x7FFFFFFF
SATURATION_BAND = (MAG >= 0x7F7F8000) & (MAG <= 0x7F7FFFFF)


@functools.partial(jax.jit, static_argnums=1)
def _roundtrip(x, rounding):
  hi, lo = ok.split_float32(x, rounding)
  return hi, lo, ok.merge_float32(hi, lo, rounding)


@pytest.mark.parametrize("rounding", ["nearest", "truncate"])
def test_roundtrip_is_bit_exact(rounding):
  hi, lo, back = (np.asarray(a) for a in _roundtrip(jnp.asarray(X), rounding))
  assert hi.dtype == jnp.bfloat16 and lo.dtype == np.uint16
  same = back.view(np.uint32) == BITS
  assert np.isnan(back[IS_NAN]).all(), "NaN must stay NaN"
  exempt = IS_NAN | (SATURATION_BAND if rounding == "nearest" else False)
  bad = ~same & ~exempt
  assert not bad.any(), f"{bad.sum()} patterns not exact, e.g. {BITS[bad][:5]}"
  if rounding == "nearest":
    # The documented band merges to one bf16 ulp (2**120) below.
    band = SATURATION_BAND & ~IS_NAN
    assert band.sum() > 0
    expected = X[band].astype(np.float64) - np.sign(X[band]) * 2.0**120
    np.testing.assert_array_equal(back[band].astype(np.float64), expected)


@pytest.mark.parametrize("rounding", ["nearest", "truncate"])
def test_hi_is_the_right_bfloat16(rounding):
  hi, _, _ = _roundtrip(jnp.asarray(X), rounding)
  hi = np.asarray(hi).astype(np.float64)
  finite = np.isfinite(X)
  assert np.isfinite(hi[finite]).all(), "a finite value became Inf"
  assert np.isnan(hi[IS_NAN]).all()
  assert (hi[np.isinf(X)] == X[np.isinf(X)]).all()
  x = X[finite].astype(np.float64)
  h = hi[finite]
  down = (BITS[finite] & 0xFFFF0000).view(np.float32).astype(np.float64)
  if rounding == "truncate":
    np.testing.assert_array_equal(h, down)
    return
  # Nearest, ties away from zero, between the two bfloat16 neighbours; a value
  # whose upper neighbour would be Inf saturates to the largest bfloat16.
  up_bits = (BITS[finite] & 0xFFFF0000) + np.uint32(0x10000)
  up = up_bits.view(np.float32).astype(np.float64)
  want = np.where(np.abs(x - down) >= np.abs(up - x), up, down)
  want = np.where(np.isinf(up), down, want)
  wrong = h != want
  assert not wrong.any(), f"wrong rounding for {X[finite][wrong][:5]}"


def test_signed_zero_and_subnormals_exact():
  x = jnp.array([0.0, -0.0, 1e-45, -1e-45, 1.1754942e-38, 1e-40], jnp.float32)
  for rounding in ("nearest", "truncate"):
    _, _, back = _roundtrip(x, rounding)
    assert (np.asarray(back).view(np.uint32) ==
            np.asarray(x).view(np.uint32)).all()


def test_a_zero_beside_a_rounded_up_residual_stays_finite():
  """A split never pairs +-0 with lo >= 0x8000 ("hi was rounded up"), but a
  zeroed weight beside a stale residual, or an XLA program that computes the
  split's two halves from differently rounded sums (seen on XLA:CPU, an FMA
  in one fusion and not in the other), can. The merge then gives a subnormal
  of hi's sign, not a borrow across the sign bit into a NaN."""
  lo = jnp.arange(0x8000, 0x10000, 7, dtype=jnp.uint32).astype(jnp.uint16)
  for sign in (0x0000, 0x8000):
    hi = jnp.full(lo.shape, sign, jnp.uint16).view(jnp.bfloat16)
    back = np.asarray(ok.merge_float32(hi, lo))
    assert np.isfinite(back).all()
    assert (np.abs(back) < np.finfo(np.float32).smallest_normal).all()
    assert (np.signbit(back) == bool(sign)).all()
  # A split never makes such a pair: every value with lo >= 0x8000 has hi != 0.
  hi, lo = ok.split_float32(jnp.asarray(X))
  assert not np.any((np.asarray(lo) >= 0x8000)
                    & ((np.asarray(hi).view(np.uint16) & 0x7FFF) == 0))


def test_bad_input():
  with pytest.raises(ValueError, match="rounding"):
    ok.split_float32(jnp.ones(3), "stochastic")
  with pytest.raises(ValueError, match="rounding"):
    ok.merge_float32(jnp.ones(3, jnp.bfloat16), jnp.zeros(3, jnp.uint16), "up")
  with pytest.raises(TypeError, match="float32"):
    ok.split_float32(jnp.ones(3, jnp.bfloat16))
  with pytest.raises(TypeError, match="uint16"):
    ok.merge_float32(jnp.ones(3, jnp.bfloat16), jnp.zeros(3, jnp.int32))


@pytest.mark.parametrize("rounding", ["nearest", "truncate"])
def test_gradients_go_straight_through_hi(rounding):
  w32 = jnp.linspace(-2.0, 2.0, 7, dtype=jnp.float32)
  loss = lambda hi: jnp.sum(jnp.sin(hi.astype(jnp.float32)))
  got = jax.grad(lambda w: loss(ok.split_float32(w, rounding)[0]))(w32)
  hi, lo = ok.split_float32(w32, rounding)
  want = jax.grad(loss)(hi).astype(jnp.float32)
  assert got.dtype == jnp.float32
  np.testing.assert_array_equal(got, want)
  assert bool(jnp.all(got != 0))
  through_merge = jax.grad(
      lambda h: jnp.sum(ok.merge_float32(h, lo, rounding)))(hi)
  np.testing.assert_array_equal(through_merge.astype(jnp.float32),
                                np.ones(7, np.float32))

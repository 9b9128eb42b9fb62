"""Exact split of a float32 into a bfloat16 and a uint16 residual, and back.

A bfloat16 is the upper 16 bits of a float32; the residual is the lower 16::

    bits(x) = hi_bits << 16 | lo        (truncate mode)

Bit operations only (XLA cannot fold them); see docs/guides/technique.md.

References:
  sd-scripts PR #2159, "Kahan summation for Adafactor-optimized Flux FFT"
  (https://github.com/kohya-ss/sd-scripts/pull/2159).
"""

import functools
from typing import Literal

import jax
import jax.numpy as jnp
import numpy as np
from jax import lax

Rounding = Literal["nearest", "truncate"]
ROUNDING_MODES: tuple[str, ...] = ("nearest", "truncate")
_SIGN = 0x80000000
_MAG = 0x7FFFFFFF
_INF = 0x7F800000
_ROUND_HALF = 0x8000
_MAX_BF16_MAG = 0x7F7F
_QUIET_BIT = 0x0040


def check_rounding(rounding: str) -> None:
  """Raises ValueError unless ``rounding`` is a known mode."""
  if rounding not in ROUNDING_MODES:
    raise ValueError(f"unknown rounding mode {rounding!r}; expected one of "
                     f"{ROUNDING_MODES}")


def split_float32(
    x: jax.Array, rounding: Rounding = "nearest"
) -> tuple[jax.Array, jax.Array]:
  """Splits float32 ``x`` into a bfloat16 ``hi`` and a uint16 residual ``lo``.

  ``lo`` is the low 16 bits of ``x``. ``"truncate"``: ``hi = bits >> 16``,
  exact for every bit pattern. ``"nearest"`` (sd-scripts PR #2159): ``hi`` is
  ``(|bits| + 0x8000) >> 16``, ties away from zero, so ``lo >= 0x8000`` says
  exactly that ``hi`` was rounded up. Finite values saturate at the largest
  bfloat16 (``0x7F7F``, 3.3895e38), never Inf: the band ``|bits|`` in
  ``[0x7F7F8000, 0x7F7FFFFF]`` (``|x|`` in [3.3961776e38, 3.4028235e38],
  65,536 patterns) merges to ``x - sign(x) * 2**120``. Every other finite
  float32, +-0, subnormals and +-Inf come back bit for bit; NaN stays NaN
  (payload lost). Gradients: ``d hi / d x = 1``, as ``x.astype(jnp.bfloat16)``.

  Args:
    x: a float32 array.
    rounding: ``"nearest"`` or ``"truncate"``.

  Returns:
    ``(hi, lo)``, bfloat16 and uint16 arrays of ``x``'s shape.

  Example:
    >>> hi, lo = split_float32(jnp.float32(1.0 + 2**-20))
    >>> merge_float32(hi, lo) == jnp.float32(1.0 + 2**-20)
    Array(True, dtype=bool)
  """
  check_rounding(rounding)
  x = jnp.asarray(x)
  if x.dtype != jnp.float32:
    raise TypeError(f"split_float32 expects float32, got {x.dtype}")
  return _split(x, rounding)


@functools.partial(jax.custom_jvp, nondiff_argnums=(1,))
def _split(x: jax.Array, rounding: Rounding) -> tuple[jax.Array, jax.Array]:
  bits = lax.bitcast_convert_type(x, jnp.uint32)
  mag = bits & jnp.uint32(_MAG)
  lo = (bits & jnp.uint32(0xFFFF)).astype(jnp.uint16)
  if rounding == "truncate":
    hi_bits = bits >> 16
  else:
    finite = mag < jnp.uint32(_INF)
    rounded = jnp.minimum((mag + jnp.uint32(_ROUND_HALF)) >> 16,
                          jnp.uint32(_MAX_BF16_MAG))
    hi_mag = jnp.where(finite, rounded, mag >> 16)
    hi_bits = ((bits & jnp.uint32(_SIGN)) >> 16) | hi_mag
  # A NaN whose upper mantissa bits are all zero would truncate to Inf.
  hi_bits = jnp.where(mag > jnp.uint32(_INF), hi_bits | jnp.uint32(_QUIET_BIT),
                      hi_bits)
  hi = lax.bitcast_convert_type(hi_bits.astype(jnp.uint16), jnp.bfloat16)
  return hi, lo


@_split.defjvp
def _split_jvp(rounding, primals, tangents):
  (x,), (t,) = primals, tangents
  hi, lo = _split(x, rounding)
  return (hi, lo), (t.astype(jnp.bfloat16),
                    np.zeros(lo.shape, jax.dtypes.float0))


def merge_float32(
    hi: jax.Array, lo: jax.Array, rounding: Rounding = "nearest"
) -> jax.Array:
  """Rebuilds the float32 that ``split_float32`` split into ``(hi, lo)``.

  A pair no split makes, +-0 beside ``lo >= 0x8000``, merges to a subnormal
  (no borrow, which would cross the sign bit into a NaN). Gradients: straight
  through ``hi``, none through ``lo``.

  Args:
    hi: a bfloat16 array.
    lo: a uint16 array of the same shape (the residual).
    rounding: the mode ``hi`` was made with.

  Returns:
    The float32 array ``hi << 16 | lo`` (truncate), or in nearest mode the same
    on the magnitude minus ``0x10000`` when ``lo >= 0x8000``.
  """
  check_rounding(rounding)
  hi = jnp.asarray(hi)
  lo = jnp.asarray(lo)
  if hi.dtype != jnp.bfloat16:
    raise TypeError(f"merge_float32 expects bfloat16 hi, got {hi.dtype}")
  if lo.dtype != jnp.uint16:
    raise TypeError(f"merge_float32 expects uint16 lo, got {lo.dtype}")
  if hi.shape != lo.shape:
    raise ValueError(f"merge_float32: hi has shape {list(hi.shape)} and lo "
                     f"{list(lo.shape)}; a residual has its weight's shape")
  return _merge(hi, lo, rounding)


@functools.partial(jax.custom_jvp, nondiff_argnums=(2,))
def _merge(hi: jax.Array, lo: jax.Array, rounding: Rounding) -> jax.Array:
  hi_bits = lax.bitcast_convert_type(hi, jnp.uint16).astype(jnp.uint32)
  lo = lo.astype(jnp.uint32)
  if rounding == "truncate":
    bits = (hi_bits << 16) | lo
  else:
    sign = (hi_bits & jnp.uint32(0x8000)) << 16
    mag = ((hi_bits & jnp.uint32(0x7FFF)) << 16) | lo
    rounded_up = ((lo >= jnp.uint32(_ROUND_HALF)) & (mag < jnp.uint32(_INF))
                  & (hi_bits & jnp.uint32(0x7FFF) != 0))
    mag = jnp.where(rounded_up, mag - jnp.uint32(0x10000), mag)
    bits = sign | mag
  return lax.bitcast_convert_type(bits, jnp.float32)


@_merge.defjvp
def _merge_jvp(rounding, primals, tangents):
  hi, lo = primals
  t_hi, _ = tangents
  return _merge(hi, lo, rounding), t_hi.astype(jnp.float32)

"""Exact split of a float32 into a bfloat16 and a uint16 residual, and back.

A float32 is 32 bits: sign (1), exponent (8), mantissa (23). A bfloat16 has the
same sign and exponent and the top 7 mantissa bits, i.e. it is exactly the upper
16 bits of a float32. Keeping the lower 16 bits as a ``uint16`` "residual"
therefore loses nothing::

    bits(x) = hi_bits << 16 | lo        (truncate mode)

Everything here is integer bit arithmetic on ``lax.bitcast_convert_type``
views, so XLA cannot raise precision or fold a cast pair away.

Two rounding modes decide which bfloat16 the forward pass sees:

``"truncate"``
  ``hi = bits >> 16`` and ``lo = bits & 0xFFFF``. Exact for every bit pattern
  (NaN stays NaN). The forward pass sees weights rounded toward zero, biased by
  up to one bfloat16 ulp.

``"nearest"`` (default)
  ``hi`` is the magnitude rounded to the nearest bfloat16 with ties away from
  zero, i.e. ``(|bits| + 0x8000) >> 16``; ``lo`` is still the truncated low 16
  bits. ``lo >= 0x8000`` says exactly that ``hi`` was rounded up, so the merge
  rebuilds ``(|hi| << 16 | lo) - 0x10000`` in that case. Ties must go away from
  zero: with ties-to-even, ``lo == 0x8000`` would not say which way ``hi`` went.
  This is the final algorithm of sd-scripts PR #2159 (``copy_kahan_``).

  A finite value never becomes Inf: magnitudes that would round past the largest
  bfloat16 (``0x7F7F0000`` = 3.3895e38) saturate to it. That band,
  ``|bits| in [0x7F7F8000, 0x7F7FFFFF]`` (|x| in [3.3961776e38, 3.4028235e38],
  2 * 2**15 = 65,536 bit patterns out of 2**32), is the only one not restored
  bit for bit: it merges to ``x - sign(x) * 2**120`` (one bfloat16 ulp lower).
  Every other finite float32, +-0, subnormals and +-Inf are exact; NaN stays NaN
  (its payload is not kept: ``hi`` is forced to a quiet NaN). A pair no split
  makes, +-0 beside ``lo >= 0x8000``, merges to a subnormal without the borrow
  (which would cross the sign bit into a NaN).

References:
  sd-scripts PR #2159, "Kahan summation for Adafactor-optimized Flux FFT"
  (https://github.com/kohya-ss/sd-scripts/pull/2159).
"""

from __future__ import annotations

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
    raise ValueError(
        f"unknown rounding mode {rounding!r}; expected one of {ROUNDING_MODES}"
    )


def split_float32(
    x: jax.Array, rounding: Rounding = "nearest"
) -> tuple[jax.Array, jax.Array]:
  """Splits float32 ``x`` into a bfloat16 ``hi`` and a uint16 residual ``lo``.

  Args:
    x: a float32 array.
    rounding: ``"nearest"`` (ties away from zero) or ``"truncate"``; see the
      module docstring for the bit layout of each.

  Returns:
    ``(hi, lo)``: ``hi`` is bfloat16 with ``x``'s shape, ``lo`` uint16 holding
    the low 16 bits of ``x``. ``merge_float32(hi, lo, rounding)`` gives ``x``
    back bit for bit, except in the saturation band named in the module
    docstring (nearest mode only).

  Gradients: bit operations have none, so ``hi`` is given the straight-through
  derivative ``d hi / d x = 1`` (the gradient reaches ``x``, cast back to
  float32): differentiating a loss of ``split_float32(w32)[0]``, the bf16
  forward value of float32 master weights, gives the bf16 forward pass's
  gradient, as ``w32.astype(jnp.bfloat16)`` would. ``lo`` is an integer and
  carries no gradient.

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

  Args:
    hi: a bfloat16 array.
    lo: a uint16 array of the same shape (the residual).
    rounding: the mode ``hi`` was made with.

  Returns:
    The float32 array ``hi << 16 | lo`` (truncate), or in nearest mode the same
    on the magnitude minus ``0x10000`` when ``lo >= 0x8000``.

  Gradients: straight through ``hi`` (``d out / d hi = 1``), none through the
  integer ``lo``.
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
    # lo >= 0x8000 says hi was rounded up, which a split never does to +-0:
    # an hi of +-0 with such an lo (a pair no split makes, e.g. a stale
    # residual beside a zeroed weight) merges without the borrow, to a
    # subnormal, instead of borrowing across the sign bit into a NaN.
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

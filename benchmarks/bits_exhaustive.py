"""Checks merge(split(x)) == x for all 2**32 float32 bit patterns, in both modes.

    python -m benchmarks.bits_exhaustive [--chunk-log2 24]

Prints, per rounding mode, how many patterns round-trip bit for bit, how many
do not (nearest mode: the saturation band documented in ``optax_kahan.bits``),
how many are NaN (NaN stays NaN; the payload is not kept), and checks that no
finite value became Inf in ``hi``. Writes ``benchmarks/results/bits.{md,json}``.
Takes about a minute per mode on 2 CPU cores.
"""

from __future__ import annotations

import argparse
import time

import jax
import jax.numpy as jnp
from jax import lax

import optax_kahan as ok
from benchmarks import report


def count_chunk(start: jax.Array, size: int, rounding: str) -> jax.Array:
  """[exact, not exact, NaN in, NaN out, finite-to-Inf, band] for one chunk."""
  bits = start + lax.iota(jnp.uint32, size)
  x = lax.bitcast_convert_type(bits, jnp.float32)
  hi, lo = ok.split_float32(x, rounding)
  back = ok.merge_float32(hi, lo, rounding)
  same = lax.bitcast_convert_type(back, jnp.uint32) == bits
  nan_in = jnp.isnan(x)
  mag = bits & jnp.uint32(0x7FFFFFFF)
  band = (mag >= 0x7F7F8000) & (mag <= 0x7F7FFFFF)
  to_inf = jnp.isfinite(x) & jnp.isinf(hi.astype(jnp.float32))
  counts = [same & ~nan_in, ~same & ~nan_in, nan_in, nan_in & jnp.isnan(back),
            to_inf, ~same & ~nan_in & ~band]
  return jnp.stack([jnp.sum(c, dtype=jnp.uint32) for c in counts])


def check_mode(rounding: str, chunk_log2: int) -> dict[str, int]:
  size = 1 << chunk_log2
  fn = jax.jit(lambda s: count_chunk(s, size, rounding))
  total = [0] * 6
  for i in range(1 << (32 - chunk_log2)):
    counts = fn(jnp.uint32(i * size))
    total = [t + int(c) for t, c in zip(total, counts)]
  names = ["exact", "not_exact", "nan", "nan_kept", "finite_to_inf",
           "not_exact_outside_band"]
  return dict(zip(names, total))


def main(argv=None) -> dict:
  parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
  parser.add_argument("--chunk-log2", type=int, default=24)
  args = parser.parse_args(argv)
  results = {}
  for rounding in ("nearest", "truncate"):
    t0 = time.perf_counter()
    results[rounding] = check_mode(rounding, args.chunk_log2)
    results[rounding]["seconds"] = round(time.perf_counter() - t0, 1)
  lines = ["| mode | exact | not exact | NaN (all stay NaN) | finite -> Inf |",
           "|---|---|---|---|---|"]
  for mode, r in results.items():
    lines.append(f"| {mode} | {r['exact']:,} | {r['not_exact']:,} | "
                 f"{r['nan']:,} ({r['nan_kept']:,} kept) | "
                 f"{r['finite_to_inf']} |")
  table = "\n".join(lines) + "\n"
  for mode, r in results.items():
    assert r["exact"] + r["not_exact"] + r["nan"] == 2**32
    assert r["nan_kept"] == r["nan"] and r["finite_to_inf"] == 0
    assert r["not_exact_outside_band"] == 0, (mode, r)
  report.save("bits", table, results)
  return results


if __name__ == "__main__":
  main()

"""``python -m optax_kahan.plan`` for FLUX.1-dev, saved with its reference:
which streamed layout, at which batch, fits the card and the host RAM
fastest, without a GPU.

    pip install -e ".[gpu-aot]"      # jax's CUDA plugin: XLA's GPU compiler
    python -m benchmarks.plan --card 16 --host-ram 64 [--batch 1 --batch 2]

Nothing runs. ``optax_kahan.plan.model_plans`` compiles ``blockwise_step``
of ``kahan(prodigy_factored(lagged_d=True, state_dtype=bf16))`` on
``optax_kahan.flux`` at FLUX.1-dev's real dimensions (11.9B params,
1024x1024: 4096 + 512 tokens, block remat), deviceless for the target, for
the candidate layouts ``ok.blockwise.plan``'s search needs, and returns the
fastest per sample (``timeline``'s model of the compiled schedule: an
estimate) whose peak leaves ``plan``'s context and margin (0.5 GB each) on a
card of ``--card`` GiB and whose host memory is at most ``--host-ram`` GB.
Saved beside what the command prints: the chosen layout's ratio per sample
to the step with the residuals on the device (``kahan(..., offload=False)``,
nothing streamed) at batch 1, the reference of the README's ratios.
``python -m benchmarks.streaming --cards`` saves the command's output for
several cards and budgets at once.

``--quick``: 2 + 4 blocks of width 256 (for a smoke run). Writes
``benchmarks/results/plan_<card>gib_<ram>gb{,_quick}.{md,json}``.
"""

from __future__ import annotations

import os

if __name__ == "__main__":  # before jax is imported: no CUDA driver is touched
  os.environ["JAX_PLATFORMS"] = "cpu"

import argparse
import dataclasses
import datetime
import math
import time

import jax

from optax_kahan import plan as ok_plan
from optax_kahan import flux
from benchmarks import gpu_compile
from benchmarks import report
from benchmarks import streaming


def main(argv=None) -> dict:
  parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
  parser.add_argument("--card", type=float, default=16, metavar="GIB")
  parser.add_argument("--host-ram", type=float, default=math.inf,
                      metavar="GB",
                      help="the most host memory (1e9 bytes; default: no cap)")
  parser.add_argument("--batch", type=int, action="append",
                      help="a batch size to try (repeat; default 1, 2, 4)")
  parser.add_argument("--target", default="h200",
                      choices=sorted(gpu_compile.TARGETS))
  parser.add_argument("--quick", action="store_true",
                      help="2 + 4 blocks of width 256")
  args = parser.parse_args(argv)
  cfg = ok_plan.MODELS["flux-dev"]
  if args.quick:
    cfg = dataclasses.replace(cfg, hidden=256, heads=2, double_blocks=2,
                              single_blocks=4, context_dim=256, vec_dim=64)
  batches = tuple(args.batch or (1, 2, 4))
  ram_gb = args.host_ram if math.isfinite(args.host_ram) else None
  t0 = time.perf_counter()
  p = ok_plan.model_plans(cfg, [args.card], [ram_gb], batches=batches,
                          target=args.target)[args.card, ram_gb]
  if isinstance(p, str):
    raise SystemExit(p)
  wall = time.perf_counter() - t0
  ref = streaming.compile_row(cfg, args.target, 1, False, None)
  ratio = p.per_sample_s / ref["step_s"]
  n = flux.num_params(flux.abstract_params(cfg))
  ram = (f"{args.host_ram:g} GB of host memory" if math.isfinite(
      args.host_ram) else "no cap on host memory")
  lines = [
      f"`ok.blockwise.plan` for a {args.card:g} GiB card and {ram}, compiled "
      f"for {args.target} without a GPU, not run ({datetime.date.today()}, "
      f"jax {jax.__version__}): FLUX-shaped MMDiT, {cfg.double_blocks} + "
      f"{cfg.single_blocks} blocks of width {cfg.hidden} ({n / 1e9:.2f}B "
      f"params), 4096 + 512 tokens, block remat, `{ok_plan.OPTIMIZER}`, "
      f"batches {list(batches)}. Device budget {p.device_budget / 1e9:.2f} GB "
      "(the card less 0.5 GB of CUDA context and a 0.5 GB margin), host "
      f"budget {p.host_budget / 1e9:.1f} GB. Modeled: the timeline model of "
      "each compiled schedule (gemms at 700 TFLOP/s, PCIe 50 GB/s per "
      "direction, other kernels free; an estimate).", "",
      f"**Chosen:** {p.layout.describe()}: peak "
      f"{p.figures.peak_bytes / 1e9:.2f} GB, host "
      f"{p.figures.host_bytes / 1e9:.1f} GB, "
      f"{p.per_sample_s * 1e3:.0f} ms per sample modeled (floor "
      f"{p.figures.floor_s / p.layout.batch * 1e3:.0f} ms), {ratio:.2f}x the "
      "residuals-on-device step at batch 1 "
      f"({ref['step_s'] * 1e3:.0f} ms, peak {ref['peak_bytes'] / 1e9:.2f} GB)."
      f" The search compiled {p.compiles} candidates of "
      f"{len(p.candidates)} it looked at, in {wall / 60:.0f} min.", "",
      p.table()]
  r = {"target": args.target, "date": datetime.date.today().isoformat(),
       "jax": jax.__version__, "card_gib": args.card,
       "host_ram_gb": args.host_ram if math.isfinite(args.host_ram) else None,
       "batches": list(batches), "compiles": p.compiles, "wall_s": wall,
       "device_budget": p.device_budget, "host_budget": p.host_budget,
       "chosen": dataclasses.asdict(p.layout),
       "figures": dataclasses.asdict(p.figures), "ratio": ratio,
       "reference": ref,
       "candidates": [{**dataclasses.asdict(c.layout),
                       **dataclasses.asdict(c.figures), "verdict": c.verdict}
                      for c in p.candidates]}
  ram_tag = f"{args.host_ram:g}gb" if math.isfinite(args.host_ram) else "nocap"
  report.save(f"plan_{args.card:g}gib_{ram_tag}", "\n".join(lines) + "\n", r,
              args.quick)
  return r


if __name__ == "__main__":
  main()

"""``python -m optax_kahan.plan``: the streamed layout for a card, from a
named model's shapes (no weights).

    python -m optax_kahan.plan --model flux-dev --card 16 --host-ram 64
    python -m optax_kahan.plan --model flux-dev --card 8 --card 12 \\
        --card 16 --card 24 --host-ram 64 --host-ram none --batch 4

``plan`` compiles the blockwise step of the model at its real dimensions
(built under ``jax.eval_shape``: nothing is allocated, nothing downloaded)
for candidate layouts and prints, for each card and host budget, the
fastest layout per sample that fits, and with one card and one budget every
candidate it compiled with its verdict. With several, the compiled
candidates are shared: each is compiled once. See docs/guides/flux.md.
"""

import argparse
import dataclasses
import math
import time
from typing import Optional, Sequence, Union

import jax
import jax.numpy as jnp
import optax

from optax_kahan._src import gpu_targets
from optax_kahan._src.alias import prodigy_factored
from optax_kahan._src.blockwise.plan import NoLayoutFits
from optax_kahan._src.blockwise.plan import Plan
from optax_kahan._src.blockwise.plan import plan
from optax_kahan._src.flux import abstract_model
from optax_kahan._src.flux import abstract_params
from optax_kahan._src.flux import batch_spec
from optax_kahan._src.flux import FluxConfig
from optax_kahan._src.flux import num_params
from optax_kahan._src.kahan import kahan

#: The models the command knows, by name: FLUX.1-dev (11.9B params) and a
#: FLUX-shaped model of 482k params (a smoke run), both with attention run
#: two heads at a time, as docs/guides/flux.md trains them.
MODELS: dict[str, FluxConfig] = {
    "flux-dev": dataclasses.replace(FluxConfig.dev(), heads_per_chunk=2),
    "flux-tiny": dataclasses.replace(FluxConfig.tiny(), heads_per_chunk=2),
}
#: What the command's step applies (the FLUX guide's optimizer).
OPTIMIZER = "kahan(prodigy_factored(lagged_d=True, state_dtype=bf16))"


def default_tx(offload: bool = True) -> optax.GradientTransformation:
  """``OPTIMIZER``: Prodigy with a factored second moment and bf16 state,
  float32-exact updates of bf16 weights, residuals in host memory (or on
  the device: ``offload=False``)."""
  return kahan(prodigy_factored(lagged_d=True, state_dtype=jnp.bfloat16),
               offload=offload)


def image_tokens(resolution: int) -> int:
  """FLUX's image tokens at ``resolution`` pixels square: an 8x smaller
  latent in 2x2 patches, ``(resolution / 16) ** 2``."""
  if resolution <= 0 or resolution % 16:
    raise ValueError(f"resolution {resolution} is not a positive multiple "
                     "of 16 (8x latent downsampling, 2x2 patches)")
  return (resolution // 16) ** 2


def model_plans(
    config: FluxConfig,
    cards_gib: Sequence[float],
    host_rams_gb: Sequence[Optional[float]] = (None,),
    *,
    resolution: int = 1024,
    text_tokens: int = 512,
    batches: Sequence[int] = (1, 2, 4),
    target: Optional[str] = "h200",
    interleave: bool = False,
    tx: Optional[optax.GradientTransformation] = None,
    progress: bool = True,
) -> dict[tuple[float, Optional[float]], Union[Plan, str]]:
  """``ok.blockwise.plan`` of a FLUX-shaped model's blockwise step, from its
  shapes, for each card and host budget (the candidates compiled once).

  Args:
    config: the model's dimensions (``MODELS[name]``).
    cards_gib: the cards' memory, GiB.
    host_rams_gb: the most host memory the step may take, GB (1e9 bytes);
      None: no cap.
    resolution: the images' side in pixels (``image_tokens``).
    text_tokens: T5 tokens per example.
    batches: the batch sizes to try.
    target: ``"h100"`` or ``"h200"``: compile for it without a GPU; None:
      for this machine's GPU.
    interleave: also try interleaved host arrays (``plan``'s ``interleave``).
    tx: what the step applies (default ``default_tx()``).
    progress: print each compile.

  Returns:
    By ``(card, host RAM)``: ``plan``'s ``Plan`` (what ``Plan.stream`` and
    ``Plan.jit_step`` take), or why no layout fits (``plan``'s error).
  """
  model = abstract_model(config)
  params = abstract_params(config, jnp.bfloat16)
  batch = batch_spec(config, 1, image_tokens(resolution), text_tokens)
  tx = default_tx() if tx is None else tx
  plans = {}
  for card in cards_gib:
    for ram in host_rams_gb:
      try:
        plans[card, ram] = plan(
            model, params, tx, batch, device_memory=card * 2**30,
            host_memory=math.inf if ram is None else ram * 1e9,
            batches=tuple(batches), target=target, interleave=interleave,
            progress=progress)
      except NoLayoutFits as e:
        plans[card, ram] = str(e)
  return plans


def _ram(text: str) -> Optional[float]:
  """``--host-ram``: GB, or ``none`` for no cap."""
  return None if text.lower() in ("none", "inf") else float(text)


def summary(plans: dict[tuple[float, Optional[float]], Union[Plan, str]]
            ) -> str:
  """One row per card and host budget: the chosen layout and its figures,
  with the share of each PCIe direction's time its schedule runs beside
  compute (``Figures.hidden``)."""
  lines = ["| card GiB | host RAM GB | layout | device peak GB | host GB "
           "| modeled ms per sample | floor ms per sample "
           "| PCIe hidden (H2D / D2H) |",
           "|---|---|---|---|---|---|---|---|"]
  for (card, ram), p in plans.items():
    head = f"| {card:g} | {'no cap' if ram is None else f'{ram:g}'} | "
    if isinstance(p, str):
      lines.append(head + p + " | | | | | |")
      continue
    f, b = p.figures, p.layout.batch
    lines.append(
        head + f"{p.layout.describe()} | {f.peak_bytes / 1e9:.2f} | "
        f"{f.host_bytes / 1e9:.1f} | {f.step_s / b * 1e3:.0f} | "
        f"{f.floor_s / b * 1e3:.0f} | {f.hidden()} |")
  return "\n".join(lines)


def main(argv: Optional[Sequence[str]] = None
         ) -> dict[tuple[float, Optional[float]], Plan]:
  """The command: parses ``argv``, plans, prints; returns the plans by
  ``(card GiB, host RAM GB or None)``. With an H100 or H200 target it sets
  jax's platforms to the CPU first (the compile is deviceless: no GPU is
  touched), so call it before anything starts jax's backends, as
  ``python -m optax_kahan.plan`` does."""
  parser = argparse.ArgumentParser(
      prog="python -m optax_kahan.plan",
      description="The fastest streamed layout per sample that fits a card "
                  "and the host RAM, from compiled candidates.")
  parser.add_argument("--model", default="flux-dev", choices=sorted(MODELS))
  parser.add_argument("--card", type=float, action="append", metavar="GIB",
                      help="the card's memory (repeat for several; "
                           "default 16)")
  parser.add_argument("--host-ram", type=_ram, action="append", metavar="GB",
                      help="the most pinned host memory, GB, or none for no "
                           "cap (repeat for several; default none)")
  parser.add_argument("--resolution", type=int, default=1024)
  parser.add_argument("--text-tokens", type=int, default=512)
  parser.add_argument("--batch", type=int, action="append",
                      help="a batch size to try (repeat; default 1, 2, 4)")
  parser.add_argument("--target", default="h200",
                      choices=[*sorted(gpu_targets.TARGETS), "this-gpu"],
                      help="compile for an H100 or H200 without a GPU "
                           "(default h200), or for this machine's GPU")
  parser.add_argument("--interleave", action="store_true",
                      help="also try interleaved host arrays")
  args = parser.parse_args(argv)
  target = None if args.target == "this-gpu" else args.target
  if target is not None:  # a deviceless compile: no GPU is touched
    jax.config.update("jax_platforms", "cpu")
    try:
      gpu_targets.gpu_mesh(target)
    except RuntimeError as e:
      parser.exit(2, f"{parser.prog}: {e}; or --target this-gpu on a "
                  "machine with a GPU\n")
  config = MODELS[args.model]
  t0 = time.perf_counter()
  plans = model_plans(
      config, args.card or [16.0], args.host_ram or [None],
      resolution=args.resolution, text_tokens=args.text_tokens,
      batches=args.batch or (1, 2, 4), target=target,
      interleave=args.interleave)
  compiles = sum(p.compiles for p in plans.values() if isinstance(p, Plan))
  print(f"{args.model} ({num_params(abstract_params(config)) / 1e9:.2f}B "
        f"params), {args.resolution}x{args.resolution} "
        f"({image_tokens(args.resolution)} + {args.text_tokens} tokens), "
        f"{OPTIMIZER}, compiled for {args.target}: {compiles} compiles "
        "(those of the budgets something fits) in "
        f"{(time.perf_counter() - t0) / 60:.1f} min. Modeled: the timeline "
        "model of each compiled schedule (an estimate; the floor is the "
        "gemms or the PCIe bytes, whichever is longer).\n")
  only = next(iter(plans.values()))
  if len(plans) == 1 and isinstance(only, Plan):
    print(only.table() + "\n")
  print(summary(plans))
  return plans

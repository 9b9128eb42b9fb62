"""Train a Flax linen MMDiT in MaxDiffusion's layout with the blockwise step.

    python -m examples.blockwise_linen

The model (``benchmarks/flux_linen.py``, a small FLUX-like MMDiT) runs its
blocks under ``nn.scan``, so each stack's params are linen's own, with a
leading block axis. ``adapt`` is the whole adaptation a user writes.
"""
import jax
import jax.numpy as jnp
import optax

import optax_kahan as ok
from benchmarks.flux_linen import (Config, DoubleBlock, Embed, Flux, Head,
                                   SingleBlock, random_batch)


def adapt(cfg: Config, params: dict) -> tuple[ok.blockwise.BlockwiseModel,
                                              ok.blockwise.BlockwiseParams]:
  """The linen model's parts and params for ``ok.blockwise.blockwise_step``."""
  model = ok.blockwise.BlockwiseModel(
      embed=ok.blockwise.linen_apply(Embed(cfg)),
      blocks=(ok.blockwise.linen_apply(DoubleBlock(cfg), lambda m, c, temb: m(c, temb)[0]),
              ok.blockwise.linen_apply(SingleBlock(cfg), lambda m, x, temb: m(x, temb)[0])),
      head=ok.blockwise.linen_apply(Head(cfg), lambda m, x, temb, b: m(
          x[:, b["txt"].shape[1]:], temb, b)),  # the split
      transitions=(lambda carry, temb: jnp.concatenate(carry[::-1], 1),))  # join
  return model, ok.blockwise.BlockwiseParams(
      params["embed"], (params["double_blocks"], params["single_blocks"]),
      params["head"])


def main(steps: int = 5) -> list[float]:
  cfg = Config()
  batch = random_batch(jax.random.key(1), cfg)
  params = Flux(cfg).init(jax.random.key(0), batch)["params"]
  model, params = adapt(cfg, jax.device_put(
      jax.tree.map(lambda x: x.astype(jnp.bfloat16), params), jax.devices()[0]))
  tx = ok.kahan(optax.adamw(3e-3))
  state = ok.blockwise.blockwise_init(tx, params)
  step = jax.jit(lambda p, s: ok.blockwise.blockwise_step(model, tx, p, s, batch),
                 donate_argnums=(0, 1))
  losses = []
  for i in range(steps):
    loss, params, state = step(params, state)
    losses.append(float(loss))
    print(f"step {i}: loss {losses[-1]:.4f}")
  assert step._cache_size() == 1  # one compilation
  return losses


if __name__ == "__main__":
  main()

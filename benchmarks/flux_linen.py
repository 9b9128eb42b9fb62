"""A small FLUX-like MMDiT in Flax linen, in MaxDiffusion's layout.

The blocks run under ``nn.scan`` (``variable_axes={"params": 0}``), so every
weight of a stack already has a leading block axis, as MaxDiffusion's FLUX
and MaxText write them. The double-stream blocks take their inputs as keyword
arguments and return ``(carry, None)``; between the two stacks the text and
image tokens are joined, and the head splits them again::

    img, txt, temb = Embed(batch)
    (img, txt) = scan(DoubleBlock)((img, txt), temb=temb)
    x = concat(txt, img)                        # the join
    x = scan(SingleBlock)(x, temb=temb)
    loss = Head(x[:, n_txt:], temb, batch)      # the split

``examples/blockwise_linen.py`` adapts it for ``optax_kahan.blockwise.blockwise_step``
(its ``adapt``) and trains it.
Written here from FLUX's structure (shift/scale modulation from the
conditioning vector, joint attention over text and image tokens), not
copied; the sizes are tiny.
"""

from __future__ import annotations

import dataclasses

import jax
import jax.numpy as jnp
from flax import linen as nn


@dataclasses.dataclass(frozen=True)
class Config:
  width: int = 32
  heads: int = 2
  double: int = 2
  single: int = 3
  in_dim: int = 8
  txt_dim: int = 12


def _attention(q, k, v, heads):
  b, n, d = q.shape
  split = lambda x: x.reshape(b, -1, heads, d // heads)
  w = jnp.einsum("bqhd,bkhd->bhqk", split(q), split(k)) / (d // heads) ** 0.5
  out = jnp.einsum("bhqk,bkhd->bqhd", jax.nn.softmax(w, axis=-1), split(v))
  return out.reshape(b, n, d)


class Modulated(nn.Module):
  """LayerNorm, shift and scale from ``temb``, then attention and an MLP."""
  cfg: Config

  @nn.compact
  def __call__(self, x, temb, context=None):
    d = self.cfg.width
    shift, scale, gate = jnp.split(nn.Dense(3 * d)(nn.silu(temb)), 3, -1)
    h = nn.LayerNorm(use_bias=False, use_scale=False)(x)
    h = h * (1 + scale[:, None]) + shift[:, None]
    ctx = h if context is None else jnp.concatenate([context, h], axis=1)
    q = nn.Dense(d)(h)
    k, v = jnp.split(nn.Dense(2 * d)(ctx), 2, -1)
    h = h + _attention(q, k, v, self.cfg.heads)
    return x + gate[:, None] * nn.Dense(d)(nn.gelu(nn.Dense(2 * d)(h)))


class DoubleBlock(nn.Module):
  cfg: Config

  @nn.compact
  def __call__(self, carry, temb):
    img, txt = carry
    img2 = Modulated(self.cfg, name="img")(img, temb, context=txt)
    txt2 = Modulated(self.cfg, name="txt")(txt, temb, context=img)
    return (img2, txt2), None


class SingleBlock(nn.Module):
  cfg: Config

  @nn.compact
  def __call__(self, x, temb):
    return Modulated(self.cfg)(x, temb), None


class Embed(nn.Module):
  cfg: Config

  @nn.compact
  def __call__(self, batch):
    d = self.cfg.width
    t = batch["t"][:, None] * jnp.arange(1, d + 1, dtype=jnp.float32)
    temb = nn.Dense(d)(nn.silu(nn.Dense(d)(jnp.sin(t))))
    return (nn.Dense(d, name="img_in")(batch["img"]),
            nn.Dense(d, name="txt_in")(batch["txt"])), temb


class Head(nn.Module):
  cfg: Config

  @nn.compact
  def __call__(self, img, temb, batch):
    shift, scale = jnp.split(nn.Dense(2 * self.cfg.width)(nn.silu(temb)), 2,
                             -1)
    h = nn.LayerNorm(use_bias=False, use_scale=False)(img)
    out = nn.Dense(self.cfg.in_dim)(h * (1 + scale[:, None]) + shift[:, None])
    return jnp.mean(jnp.square(out - batch["target"]))


def _scan(block, length):
  return nn.scan(block, variable_axes={"params": 0},
                 split_rngs={"params": True}, in_axes=nn.broadcast,
                 length=length)


class Flux(nn.Module):
  """The whole model: ``Flux(cfg).apply(variables, batch)`` is the loss."""
  cfg: Config

  @nn.compact
  def __call__(self, batch):
    (img, txt), temb = Embed(self.cfg, name="embed")(batch)
    (img, txt), _ = _scan(DoubleBlock, self.cfg.double)(
        self.cfg, name="double_blocks")((img, txt), temb)
    x = jnp.concatenate([txt, img], axis=1)
    x, _ = _scan(SingleBlock, self.cfg.single)(
        self.cfg, name="single_blocks")(x, temb)
    return Head(self.cfg, name="head")(x[:, txt.shape[1]:], temb, batch)


def random_batch(key: jax.Array, cfg: Config, batch: int = 2, n_img: int = 6,
                 n_txt: int = 4) -> dict[str, jax.Array]:
  ks = jax.random.split(key, 4)
  return {"img": jax.random.normal(ks[0], (batch, n_img, cfg.in_dim)),
          "txt": jax.random.normal(ks[1], (batch, n_txt, cfg.txt_dim)),
          "t": jax.random.uniform(ks[2], (batch,)),
          "target": jax.random.normal(ks[3], (batch, n_img, cfg.in_dim))}


"""The FLUX.1-dev transformer (an MMDiT) in Flax NNX, for blockwise training.

The model is FLUX.1-dev's flow transformer (black-forest-labs/flux,
``src/flux/model.py`` and ``src/flux/modules/layers.py``) with its real
dimensions: hidden 3072 (24 heads x 128), 19 double-stream and 38
single-stream blocks, MLP ratio 4, 64 input channels (2x2 patches of a
16-channel latent), 4096-d T5 context, 768-d pooled CLIP vector, guidance
embedding, rotary embeddings over three position axes of (16, 56, 56) dims.

It is written as three parts, so that a training step can run it one block at a
time (``optax_kahan.blockwise``)::

    carry, consts = embed(embed_params, batch)      # carry = (img, txt)
    for each stack in (double, single):             # consts = (vec, pe)
      for block_params in stack:
        carry = block(block_params, carry, consts)
    loss = head(head_params, carry, consts, batch)

* ``carry``: ``Carry(img, txt)``, the hidden states ``(B, N_img, hidden)`` and
  ``(B, N_txt, hidden)`` in the params' dtype. Both stacks read and write this
  same structure: the single-stream block concatenates ``[txt, img]``, runs on
  the joint sequence and splits it back.
* ``consts``: ``Consts(vec, pe)``, read by every block and changed by none:
  ``vec`` the ``(B, hidden)`` conditioning vector (params' dtype) and ``pe``
  the rotary tables ``(B, N_txt + N_img, 1, head_dim // 2, 2, 2)`` in float32,
  ordered text first, as the joint sequence is.

``Flux`` holds the four parts as NNX modules; each stack is built by
``nnx.vmap`` over a block constructor, so every leaf of a stack has a leading
block axis, and ``Flux.__call__`` runs embed, ``nnx.scan`` over each stack and
the head. ``flux_blockwise`` splits a ``Flux`` into the pure functions and the
params triple ``(embed_params, (double_params, single_params), head_params)``.

Parameter count of ``FluxConfig.dev()`` (the published 11.9B):

=============  ================  =================
part           per block         total
=============  ================  =================
embed                            45,047,808
double x 19    339,831,296       6,456,794,624
single x 38    141,591,808       5,380,488,704
head                             19,077,184
all                              11,901,408,320
=============  ================  =================

Dense kernels use Flax's ``(in_features, out_features)`` layout. Compute runs
in the params' dtype (bf16 in use); norms, the rotary embedding and the loss
run in float32. ``Embed`` casts the batch's features to its params' dtype and
the carry stays in it, so keep every part in one dtype (``to_dtype``):
``nnx.Linear`` computes in the promoted dtype of its input and params.
"""

from __future__ import annotations

import dataclasses
import math
from typing import Any, Mapping, NamedTuple

import jax
import jax.numpy as jnp
from flax import nnx

from optax_kahan._src.blockwise.flax_adapters import nnx_blockwise
from optax_kahan._src.blockwise.model import BlockwiseModel
from optax_kahan._src.blockwise.model import BlockwiseParams

Batch = Mapping[str, jax.Array]
Params = Any  # a pytree of arrays: an ``nnx.State`` here


@dataclasses.dataclass(frozen=True)
class FluxConfig:
  """Dimensions of a FLUX transformer; the defaults are FLUX.1-dev's.

  Attributes:
    hidden: width of the hidden states, ``heads * head_dim``.
    heads: attention heads.
    mlp_ratio: MLP hidden width over ``hidden``.
    double_blocks: double-stream (separate weights for text and image) blocks.
    single_blocks: single-stream (joint sequence) blocks.
    in_channels: channels of an image token (and of the prediction).
    context_dim: width of the text tokens (T5 features).
    vec_dim: width of the pooled text vector ``y`` (CLIP features).
    axes_dim: rotary dims of the three position axes; sums to ``head_dim``.
    theta: rotary base.
    qkv_bias: whether the qkv projections have a bias.
    guidance: whether the model embeds a guidance strength (FLUX.1-dev does).
    heads_per_chunk: run attention this many heads at a time (0: all at
      once); see ``attention``. The weights do not depend on it.
  """
  hidden: int = 3072
  heads: int = 24
  mlp_ratio: float = 4.0
  double_blocks: int = 19
  single_blocks: int = 38
  in_channels: int = 64
  context_dim: int = 4096
  vec_dim: int = 768
  axes_dim: tuple[int, ...] = (16, 56, 56)
  theta: int = 10000
  qkv_bias: bool = True
  guidance: bool = True
  heads_per_chunk: int = 0

  def __post_init__(self):
    if self.hidden % self.heads:
      raise ValueError(f"hidden {self.hidden} is not a multiple of heads "
                       f"{self.heads}")
    if sum(self.axes_dim) != self.head_dim:
      raise ValueError(f"axes_dim {self.axes_dim} does not sum to head_dim "
                       f"{self.head_dim}")
    if any(d % 2 for d in self.axes_dim):
      raise ValueError(f"axes_dim {self.axes_dim} has an odd entry")

  @property
  def head_dim(self) -> int:
    return self.hidden // self.heads

  @property
  def mlp_hidden(self) -> int:
    return int(self.hidden * self.mlp_ratio)

  @classmethod
  def dev(cls) -> FluxConfig:
    """FLUX.1-dev: 11,901,408,320 params."""
    return cls()

  @classmethod
  def tiny(cls) -> FluxConfig:
    """A FLUX-shaped model small enough for tests on a CPU: 482,448 params."""
    return cls(hidden=64, heads=2, double_blocks=2, single_blocks=2,
               in_channels=16, context_dim=32, vec_dim=16,
               axes_dim=(8, 12, 12))


class Carry(NamedTuple):
  """The hidden states that flow from block to block.

  Attributes:
    img: image tokens, ``(B, N_img, hidden)``.
    txt: text tokens, ``(B, N_txt, hidden)``.
  """
  img: jax.Array
  txt: jax.Array


class Consts(NamedTuple):
  """What every block reads and none changes.

  Attributes:
    vec: the conditioning vector, ``(B, hidden)``.
    pe: rotary tables of the joint ``[txt, img]`` sequence, float32,
      ``(B, N_txt + N_img, 1, head_dim // 2, 2, 2)``.
  """
  vec: jax.Array
  pe: jax.Array


# -----------------------------------------------------------------------------
# Functions without parameters.
# -----------------------------------------------------------------------------


def timestep_embedding(t: jax.Array, dim: int = 256,
                       max_period: float = 10000.0,
                       time_factor: float = 1000.0) -> jax.Array:
  """Sinusoidal embedding of a scalar per example, as FLUX's.

  With ``s = time_factor * t`` and ``f_i = max_period ** (-i / (dim / 2))``
  for ``i < dim / 2``, the embedding is ``[cos(s f), sin(s f)]``.

  Args:
    t: ``(B,)`` timesteps in [0, 1] (or guidance strengths).
    dim: embedding width (even).
    max_period: the longest period.
    time_factor: scale applied to ``t`` first.

  Returns:
    ``(B, dim)`` float32.
  """
  half = dim // 2
  freqs = jnp.exp(-math.log(max_period)
                  * jnp.arange(half, dtype=jnp.float32) / half)
  args = (time_factor * t.astype(jnp.float32))[:, None] * freqs[None]
  return jnp.concatenate([jnp.cos(args), jnp.sin(args)], axis=-1)


def rope(pos: jax.Array, dim: int, theta: int) -> jax.Array:
  """Rotation matrices of one position axis.

  For ``omega_i = theta ** (-2 i / dim)``, ``i < dim / 2``, the matrix of
  position ``p`` and frequency ``i`` is ``[[cos a, -sin a], [sin a, cos a]]``
  with ``a = p * omega_i``.

  Args:
    pos: ``(..., N)`` positions along the axis.
    dim: rotary dims of the axis (even).
    theta: rotary base.

  Returns:
    ``(..., N, dim // 2, 2, 2)`` float32.
  """
  scale = jnp.arange(0, dim, 2, dtype=jnp.float32) / dim
  omega = 1.0 / (theta ** scale)
  a = pos.astype(jnp.float32)[..., None] * omega
  out = jnp.stack([jnp.cos(a), -jnp.sin(a), jnp.sin(a), jnp.cos(a)], axis=-1)
  return out.reshape(*out.shape[:-1], 2, 2)


def embed_nd(ids: jax.Array, axes_dim: tuple[int, ...],
             theta: int) -> jax.Array:
  """FLUX's ``EmbedND``: the rotary tables of multi-axis position ids.

  Args:
    ids: ``(B, N, len(axes_dim))`` positions.
    axes_dim: rotary dims per axis, summing to ``head_dim``.
    theta: rotary base.

  Returns:
    ``(B, N, 1, head_dim // 2, 2, 2)`` float32; the singleton axis broadcasts
    over heads in the ``(B, T, heads, head_dim)`` layout.
  """
  emb = jnp.concatenate(
      [rope(ids[..., i], d, theta) for i, d in enumerate(axes_dim)], axis=-3)
  return emb[:, :, None]


def apply_rope(x: jax.Array, pe: jax.Array) -> jax.Array:
  """Rotates consecutive pairs of ``x``'s features by ``pe``, in float32.

  Each pair ``(x_0, x_1)`` becomes ``R (x_0, x_1)`` for its matrix ``R``.

  Args:
    x: ``(B, T, heads, head_dim)``.
    pe: ``(B, T, 1, head_dim // 2, 2, 2)`` from ``embed_nd``.

  Returns:
    ``x`` rotated, in ``x``'s dtype.
  """
  x_ = x.astype(jnp.float32).reshape(*x.shape[:-1], -1, 1, 2)
  out = pe[..., 0] * x_[..., 0] + pe[..., 1] * x_[..., 1]
  return out.reshape(x.shape).astype(x.dtype)


def attention(q: jax.Array, k: jax.Array, v: jax.Array, pe: jax.Array,
              heads_per_chunk: int = 0) -> jax.Array:
  """Softmax attention with rotary embeddings, heads merged on output.

  ``softmax(q k^T / sqrt(head_dim)) v`` per head, by
  ``jax.nn.dot_product_attention`` (its default implementation: XLA's,
  which holds the ``(B, heads, T, T)`` scores). With ``heads_per_chunk``,
  the heads run in groups of that many, one after the other (``lax.map``),
  each group rematerialized in the backward pass: the same values, with the
  scores of one group alive at a time (at 4608 tokens, all 24 heads' float32
  scores are 2 GB).

  Args:
    q: queries ``(B, T, heads, head_dim)``.
    k: keys, same shape.
    v: values, same shape.
    pe: rotary tables of the ``T`` positions.
    heads_per_chunk: heads per group (a divisor of ``heads``); 0 for all.

  Returns:
    ``(B, T, heads * head_dim)`` in ``v``'s dtype.
  """
  q, k = apply_rope(q, pe), apply_rope(k, pe)
  b, t, heads, dim = q.shape
  if not heads_per_chunk or heads_per_chunk >= heads:
    x = jax.nn.dot_product_attention(q, k, v)
    return x.reshape(b, t, heads * dim)
  if heads % heads_per_chunk:
    raise ValueError(f"heads_per_chunk {heads_per_chunk} does not divide "
                     f"heads {heads}")
  chunks = heads // heads_per_chunk
  split = lambda x: jnp.moveaxis(
      x.reshape(b, t, chunks, heads_per_chunk, dim), 2, 0)
  x = jax.lax.map(jax.checkpoint(
      lambda qkv: jax.nn.dot_product_attention(*qkv)),
                  (split(q), split(k), split(v)))
  return jnp.moveaxis(x, 0, 2).reshape(b, t, heads * dim)


def layer_norm(x: jax.Array, eps: float = 1e-6) -> jax.Array:
  """LayerNorm over the last axis without affine params, in float32.

  ``(x - mean(x)) / sqrt(var(x) + eps)``, cast back to ``x``'s dtype.
  """
  x32 = x.astype(jnp.float32)
  mean = jnp.mean(x32, axis=-1, keepdims=True)
  var = jnp.mean(jnp.square(x32 - mean), axis=-1, keepdims=True)
  return ((x32 - mean) * jax.lax.rsqrt(var + eps)).astype(x.dtype)


def modulate(x: jax.Array, shift: jax.Array, scale: jax.Array) -> jax.Array:
  """adaLN: ``(1 + scale) * layer_norm(x) + shift``."""
  return (1 + scale) * layer_norm(x) + shift


def _dtype(linear: nnx.Linear) -> jnp.dtype:
  """The dtype a linear layer's params are stored (and computed) in."""
  return linear.kernel.dtype


# -----------------------------------------------------------------------------
# Layers.
# -----------------------------------------------------------------------------


class MLPEmbedder(nnx.Module):
  """``out_layer(silu(in_layer(x)))``: FLUX's embedder of t, guidance and y."""

  def __init__(self, in_dim: int, hidden: int, *, param_dtype: jnp.dtype,
               rngs: nnx.Rngs):
    self.in_layer = nnx.Linear(in_dim, hidden, param_dtype=param_dtype,
                               rngs=rngs)
    self.out_layer = nnx.Linear(hidden, hidden, param_dtype=param_dtype,
                                rngs=rngs)

  def __call__(self, x: jax.Array) -> jax.Array:
    x = x.astype(_dtype(self.in_layer))
    return self.out_layer(jax.nn.silu(self.in_layer(x)))


class RMSNorm(nnx.Module):
  """``x / sqrt(mean(x^2) + 1e-6) * scale``: normalized in float32, then cast
  back to ``x``'s dtype and scaled by the learnable ``scale`` (ones at init)."""

  def __init__(self, dim: int, *, param_dtype: jnp.dtype):
    self.scale = nnx.Param(jnp.ones((dim,), param_dtype))

  def __call__(self, x: jax.Array) -> jax.Array:
    x32 = x.astype(jnp.float32)
    rrms = jax.lax.rsqrt(jnp.mean(jnp.square(x32), axis=-1, keepdims=True)
                         + 1e-6)
    return (x32 * rrms).astype(x.dtype) * self.scale[...]


class QKNorm(nnx.Module):
  """RMSNorms of queries and keys over ``head_dim`` (shared by the heads)."""

  def __init__(self, head_dim: int, *, param_dtype: jnp.dtype):
    self.query_norm = RMSNorm(head_dim, param_dtype=param_dtype)
    self.key_norm = RMSNorm(head_dim, param_dtype=param_dtype)

  def __call__(self, q: jax.Array, k: jax.Array,
               v: jax.Array) -> tuple[jax.Array, jax.Array]:
    """Returns the normalized ``q`` and ``k`` in ``v``'s dtype."""
    return (self.query_norm(q).astype(v.dtype),
            self.key_norm(k).astype(v.dtype))


class SelfAttention(nnx.Module):
  """The attention weights of one stream: ``qkv``, QK norm and ``proj``.

  The streams of a double block attend jointly, so the attention itself is
  run by the block (``qkv_heads``, then ``attention``, then ``proj``).
  """

  def __init__(self, cfg: FluxConfig, *, param_dtype: jnp.dtype,
               rngs: nnx.Rngs):
    self.heads = cfg.heads
    self.qkv = nnx.Linear(cfg.hidden, 3 * cfg.hidden, use_bias=cfg.qkv_bias,
                          param_dtype=param_dtype, rngs=rngs)
    self.norm = QKNorm(cfg.head_dim, param_dtype=param_dtype)
    self.proj = nnx.Linear(cfg.hidden, cfg.hidden, param_dtype=param_dtype,
                           rngs=rngs)

  def qkv_heads(self, x: jax.Array) -> tuple[jax.Array, jax.Array, jax.Array]:
    """Normalized queries, keys and values ``(B, T, heads, head_dim)``."""
    return split_qkv(self.qkv(x), self.heads, self.norm)


def split_qkv(qkv: jax.Array, heads: int,
              norm: QKNorm) -> tuple[jax.Array, jax.Array, jax.Array]:
  """``(B, T, 3 * hidden)`` into q, k, v of ``(B, T, heads, head_dim)``, with
  q and k normalized (FLUX's ``B L (K H D) -> K B H L D``, heads kept third)."""
  b, t, _ = qkv.shape
  qkv = qkv.reshape(b, t, 3, heads, -1)
  q, k, v = qkv[:, :, 0], qkv[:, :, 1], qkv[:, :, 2]
  q, k = norm(q, k, v)
  return q, k, v


class Modulation(nnx.Module):
  """``lin(silu(vec))`` split into ``n`` chunks of ``hidden``, each with a
  token axis to broadcast over: (shift, scale, gate) once or twice."""

  def __init__(self, hidden: int, n: int, *, param_dtype: jnp.dtype,
               rngs: nnx.Rngs):
    self.n = n
    self.lin = nnx.Linear(hidden, n * hidden, param_dtype=param_dtype,
                          rngs=rngs)

  def __call__(self, vec: jax.Array) -> list[jax.Array]:
    """Returns ``n`` arrays of ``(B, 1, hidden)``."""
    out = self.lin(jax.nn.silu(vec))[:, None, :]
    return jnp.split(out, self.n, axis=-1)


class MLP(nnx.Module):
  """``fc2(gelu_tanh(fc1(x)))``, ``hidden -> mlp_hidden -> hidden``."""

  def __init__(self, hidden: int, mlp_hidden: int, *, param_dtype: jnp.dtype,
               rngs: nnx.Rngs):
    self.fc1 = nnx.Linear(hidden, mlp_hidden, param_dtype=param_dtype,
                          rngs=rngs)
    self.fc2 = nnx.Linear(mlp_hidden, hidden, param_dtype=param_dtype,
                          rngs=rngs)

  def __call__(self, x: jax.Array) -> jax.Array:
    return self.fc2(jax.nn.gelu(self.fc1(x), approximate=True))


# -----------------------------------------------------------------------------
# The four parts.
# -----------------------------------------------------------------------------


class Embed(nnx.Module):
  """Inputs to hidden states and conditioning: FLUX's model before its blocks.

  * ``img = img_in(batch["img"])``, ``txt = txt_in(batch["txt"])``;
  * ``vec = time_in(emb(t)) + guidance_in(emb(g)) + vector_in(y)``, with
    ``emb`` the 256-d ``timestep_embedding`` (which scales its input by 1000);
  * ``pe = embed_nd([txt_ids, img_ids])``.
  """

  def __init__(self, cfg: FluxConfig, *, param_dtype: jnp.dtype,
               rngs: nnx.Rngs):
    self.axes_dim = tuple(cfg.axes_dim)
    self.theta = cfg.theta
    self.img_in = nnx.Linear(cfg.in_channels, cfg.hidden,
                             param_dtype=param_dtype, rngs=rngs)
    self.time_in = MLPEmbedder(256, cfg.hidden, param_dtype=param_dtype,
                               rngs=rngs)
    self.vector_in = MLPEmbedder(cfg.vec_dim, cfg.hidden,
                                 param_dtype=param_dtype, rngs=rngs)
    self.guidance_in = (MLPEmbedder(256, cfg.hidden, param_dtype=param_dtype,
                                    rngs=rngs) if cfg.guidance else None)
    self.txt_in = nnx.Linear(cfg.context_dim, cfg.hidden,
                             param_dtype=param_dtype, rngs=rngs)

  def __call__(self, batch: Batch) -> tuple[Carry, Consts]:
    """Args:
      batch: the keys of ``batch_spec``.

    Returns:
      ``(Carry(img, txt), Consts(vec, pe))``.
    """
    dtype = _dtype(self.img_in)
    img = self.img_in(batch["img"].astype(dtype))
    txt = self.txt_in(batch["txt"].astype(dtype))
    vec = self.time_in(timestep_embedding(batch["timesteps"]))
    if self.guidance_in is not None:
      vec = vec + self.guidance_in(timestep_embedding(batch["guidance"]))
    vec = vec + self.vector_in(batch["y"])
    ids = jnp.concatenate([batch["txt_ids"], batch["img_ids"]], axis=1)
    pe = embed_nd(ids, self.axes_dim, self.theta)
    return Carry(img, txt), Consts(vec, pe)


class DoubleBlock(nnx.Module):
  """FLUX's ``DoubleStreamBlock``: two streams with their own weights, one
  joint attention.

  For each stream ``s`` in (img, txt), with ``(a1, b1, g1, a2, b2, g2)`` its
  modulation (shift, scale, gate twice) of ``vec``::

      q_s, k_s, v_s = qkv_s(modulate(x_s, a1, b1))       # QK RMS-normed
      o_txt, o_img = attention([q_txt, q_img], [k..], [v..], pe)
      x_s = x_s + g1 * proj_s(o_s)
      x_s = x_s + g2 * mlp_s(modulate(x_s, a2, b2))
  """

  def __init__(self, cfg: FluxConfig, *, param_dtype: jnp.dtype,
               rngs: nnx.Rngs):
    kw = dict(param_dtype=param_dtype, rngs=rngs)
    self.heads_per_chunk = cfg.heads_per_chunk
    self.img_mod = Modulation(cfg.hidden, 6, **kw)
    self.img_attn = SelfAttention(cfg, **kw)
    self.img_mlp = MLP(cfg.hidden, cfg.mlp_hidden, **kw)
    self.txt_mod = Modulation(cfg.hidden, 6, **kw)
    self.txt_attn = SelfAttention(cfg, **kw)
    self.txt_mlp = MLP(cfg.hidden, cfg.mlp_hidden, **kw)

  def __call__(self, carry: Carry, consts: Consts) -> Carry:
    img, txt = carry
    i_shift1, i_scale1, i_gate1, i_shift2, i_scale2, i_gate2 = (
        self.img_mod(consts.vec))
    t_shift1, t_scale1, t_gate1, t_shift2, t_scale2, t_gate2 = (
        self.txt_mod(consts.vec))
    iq, ik, iv = self.img_attn.qkv_heads(modulate(img, i_shift1, i_scale1))
    tq, tk, tv = self.txt_attn.qkv_heads(modulate(txt, t_shift1, t_scale1))
    o = attention(jnp.concatenate([tq, iq], axis=1),
                  jnp.concatenate([tk, ik], axis=1),
                  jnp.concatenate([tv, iv], axis=1), consts.pe,
                  self.heads_per_chunk)
    n_txt = txt.shape[1]
    t_o, i_o = o[:, :n_txt], o[:, n_txt:]
    img = img + i_gate1 * self.img_attn.proj(i_o)
    img = img + i_gate2 * self.img_mlp(modulate(img, i_shift2, i_scale2))
    txt = txt + t_gate1 * self.txt_attn.proj(t_o)
    txt = txt + t_gate2 * self.txt_mlp(modulate(txt, t_shift2, t_scale2))
    return Carry(img, txt)


class SingleBlock(nnx.Module):
  """FLUX's ``SingleStreamBlock`` on the joint sequence ``x = [txt, img]``.

  With ``(a, b, g)`` the modulation of ``vec``::

      qkv, h = split(linear1(modulate(x, a, b)), [3 hidden, mlp_hidden])
      x = x + g * linear2([attention(qkv, pe), gelu_tanh(h)])

  The carry stays ``(img, txt)``: the block joins and splits it.
  """

  def __init__(self, cfg: FluxConfig, *, param_dtype: jnp.dtype,
               rngs: nnx.Rngs):
    self.hidden = cfg.hidden
    self.heads = cfg.heads
    self.heads_per_chunk = cfg.heads_per_chunk
    self.linear1 = nnx.Linear(cfg.hidden, 3 * cfg.hidden + cfg.mlp_hidden,
                              param_dtype=param_dtype, rngs=rngs)
    self.linear2 = nnx.Linear(cfg.hidden + cfg.mlp_hidden, cfg.hidden,
                              param_dtype=param_dtype, rngs=rngs)
    self.norm = QKNorm(cfg.head_dim, param_dtype=param_dtype)
    self.modulation = Modulation(cfg.hidden, 3, param_dtype=param_dtype,
                                 rngs=rngs)

  def __call__(self, carry: Carry, consts: Consts) -> Carry:
    img, txt = carry
    n_txt = txt.shape[1]
    x = jnp.concatenate([txt, img], axis=1)
    shift, scale, gate = self.modulation(consts.vec)
    h = self.linear1(modulate(x, shift, scale))
    qkv, mlp = h[..., :3 * self.hidden], h[..., 3 * self.hidden:]
    o = attention(*split_qkv(qkv, self.heads, self.norm), consts.pe,
                  self.heads_per_chunk)
    x = x + gate * self.linear2(
        jnp.concatenate([o, jax.nn.gelu(mlp, approximate=True)], axis=-1))
    return Carry(x[:, n_txt:], x[:, :n_txt])


class Head(nnx.Module):
  """FLUX's ``LastLayer`` on the image tokens, and the loss.

  ``pred = linear((1 + scale) * layer_norm(img) + shift)`` with
  ``(shift, scale) = adaLN_modulation(silu(vec))``; the loss is
  ``mean((pred - target)^2)`` in float32.
  """

  def __init__(self, cfg: FluxConfig, *, param_dtype: jnp.dtype,
               rngs: nnx.Rngs):
    self.adaLN_modulation = nnx.Linear(cfg.hidden, 2 * cfg.hidden,
                                       param_dtype=param_dtype, rngs=rngs)
    self.linear = nnx.Linear(cfg.hidden, cfg.in_channels,
                             param_dtype=param_dtype, rngs=rngs)

  def predict(self, img: jax.Array, vec: jax.Array) -> jax.Array:
    """The prediction ``(B, N_img, in_channels)`` in the params' dtype."""
    shift, scale = jnp.split(self.adaLN_modulation(jax.nn.silu(vec)), 2,
                             axis=-1)
    return self.linear(modulate(img, shift[:, None], scale[:, None]))

  def __call__(self, carry: Carry, consts: Consts, batch: Batch) -> jax.Array:
    """Returns the scalar float32 loss against ``batch["target"]``."""
    pred = self.predict(carry.img, consts.vec).astype(jnp.float32)
    return jnp.mean(jnp.square(pred - batch["target"].astype(jnp.float32)))


def _stack(block: type[nnx.Module], n: int, cfg: FluxConfig,
           param_dtype: jnp.dtype, rngs: nnx.Rngs) -> nnx.Module:
  """``n`` blocks as one module whose leaves have a leading axis of ``n``,
  each block initialized from its own split of ``rngs``."""

  @nnx.split_rngs(splits=n)
  @nnx.vmap(in_axes=(0,), out_axes=0)
  def make(rngs: nnx.Rngs) -> nnx.Module:
    return block(cfg, param_dtype=param_dtype, rngs=rngs)

  return make(rngs)


def _scan(stack: nnx.Module, carry: Carry, consts: Consts) -> Carry:
  """Runs the blocks of a stacked module in order over ``carry``."""

  @nnx.scan(in_axes=(0, nnx.Carry, None), out_axes=nnx.Carry)
  def step(block: nnx.Module, carry: Carry, consts: Consts) -> Carry:
    return block(carry, consts)

  return step(stack, carry, consts)


class Flux(nnx.Module):
  """The FLUX transformer: ``embed``, two stacks of blocks, ``head``.

  ``double_blocks`` and ``single_blocks`` are stacked modules (``nnx.vmap``
  of ``DoubleBlock`` and ``SingleBlock``): each leaf has a leading axis of
  ``cfg.double_blocks`` or ``cfg.single_blocks``.
  """

  def __init__(self, cfg: FluxConfig, *, rngs: nnx.Rngs,
               param_dtype: jnp.dtype = jnp.float32):
    self.embed = Embed(cfg, param_dtype=param_dtype, rngs=rngs)
    self.double_blocks = _stack(DoubleBlock, cfg.double_blocks, cfg,
                                param_dtype, rngs)
    self.single_blocks = _stack(SingleBlock, cfg.single_blocks, cfg,
                                param_dtype, rngs)
    self.head = Head(cfg, param_dtype=param_dtype, rngs=rngs)

  def __call__(self, batch: Batch) -> jax.Array:
    """The loss of ``batch``: embed, ``nnx.scan`` over each stack, head."""
    carry, consts = self.embed(batch)
    carry = _scan(self.double_blocks, carry, consts)
    carry = _scan(self.single_blocks, carry, consts)
    return self.head(carry, consts, batch)


# -----------------------------------------------------------------------------
# Pure functions over param trees.
# -----------------------------------------------------------------------------


def flux_blockwise(model: Flux) -> tuple[BlockwiseModel, BlockwiseParams]:
  """Splits a ``Flux`` into pure functions and their params.

  ``optax_kahan.blockwise.nnx_blockwise`` of its parts: ``embed``, then each
  stack's blocks in order, then ``head`` compute ``model(batch)``.

  Args:
    model: the model (concrete, or abstract from ``nnx.eval_shape``).

  Returns:
    ``(BlockwiseModel(embed_fn, (double_fn, single_fn), head_fn),
    BlockwiseParams(embed_params, (double_params, single_params),
    head_params))``, the params ``nnx.State`` pytrees whose leaves are arrays;
    the leaves of ``double_params`` and ``single_params`` have a leading
    block axis.
  """
  return nnx_blockwise(model.embed, (model.double_blocks, model.single_blocks),
                       model.head)


def to_dtype(params: Params, dtype: jnp.dtype) -> Params:
  """Casts the floating leaves of ``params`` (arrays or
  ``jax.ShapeDtypeStruct``) to ``dtype``; other leaves are kept."""

  def cast(x: Any) -> Any:
    if not jnp.issubdtype(x.dtype, jnp.floating):
      return x
    if isinstance(x, jax.ShapeDtypeStruct):
      return jax.ShapeDtypeStruct(x.shape, dtype, sharding=x.sharding)
    return x.astype(dtype)

  return jax.tree.map(cast, params)


def abstract_params(cfg: FluxConfig,
                    dtype: jnp.dtype = jnp.bfloat16) -> Params:
  """The params triple of ``flux_blockwise``, its leaves
  ``jax.ShapeDtypeStruct``.

  The model is built under ``jax.eval_shape``: nothing is allocated.
  """

  def build() -> Params:
    model = Flux(cfg, rngs=nnx.Rngs(0), param_dtype=dtype)
    return flux_blockwise(model)[1]

  return jax.eval_shape(build)


def abstract_model(cfg: FluxConfig) -> BlockwiseModel:
  """The functions of ``flux_blockwise``, of a model built under
  ``nnx.eval_shape`` (nothing allocated): with ``abstract_params``, what
  ``ok.blockwise.plan`` and a deviceless compile of the step take."""
  return BlockwiseModel(*flux_blockwise(
      nnx.eval_shape(lambda: Flux(cfg, rngs=nnx.Rngs(0))))[0])


def num_params(params: Params) -> int:
  """The number of scalars in the leaves of ``params``."""
  return sum(math.prod(x.shape) for x in jax.tree.leaves(params))


# -----------------------------------------------------------------------------
# Batches.
# -----------------------------------------------------------------------------


def batch_spec(cfg: FluxConfig, batch: int = 1, image_tokens: int = 4096,
               text_tokens: int = 512,
               dtype: jnp.dtype = jnp.bfloat16
               ) -> dict[str, jax.ShapeDtypeStruct]:
  """Shapes and dtypes of a training batch.

  The defaults are a 1024x1024 image (a 128x128 latent in 2x2 patches: 4096
  tokens) and 512 T5 tokens.

  Args:
    cfg: the model's config.
    batch: examples, ``B``.
    image_tokens: ``N_img``.
    text_tokens: ``N_txt``.
    dtype: dtype of the features (the position ids, timesteps and guidance
      are float32).

  Returns:
    ``img``, ``target`` ``(B, N_img, in_channels)``; ``img_ids``
    ``(B, N_img, 3)``; ``txt`` ``(B, N_txt, context_dim)``; ``txt_ids``
    ``(B, N_txt, 3)``; ``y`` ``(B, vec_dim)``; ``timesteps``, ``guidance``
    ``(B,)``.
  """
  f32 = jnp.float32
  n_axes = len(cfg.axes_dim)
  s = jax.ShapeDtypeStruct
  return {
      "img": s((batch, image_tokens, cfg.in_channels), dtype),
      "img_ids": s((batch, image_tokens, n_axes), f32),
      "txt": s((batch, text_tokens, cfg.context_dim), dtype),
      "txt_ids": s((batch, text_tokens, n_axes), f32),
      "y": s((batch, cfg.vec_dim), dtype),
      "timesteps": s((batch,), f32),
      "guidance": s((batch,), f32),
      "target": s((batch, image_tokens, cfg.in_channels), dtype),
  }


def _grid(n: int) -> tuple[int, int]:
  """The most nearly square ``(h, w)`` with ``h * w = n``, ``h <= w``."""
  h = math.isqrt(n)
  while n % h:
    h -= 1
  return h, n // h


def image_ids(batch: int, image_tokens: int, n_axes: int = 3) -> jax.Array:
  """FLUX's image position ids: ``(0, row, column)`` of each token of an
  ``(h, w)`` token grid, row-major; ``(batch, h * w, n_axes)`` float32."""
  h, w = _grid(image_tokens)
  rows, cols = jnp.meshgrid(jnp.arange(h, dtype=jnp.float32),
                            jnp.arange(w, dtype=jnp.float32), indexing="ij")
  ids = jnp.zeros((h, w, n_axes), jnp.float32)
  ids = ids.at[..., 1].set(rows).at[..., 2].set(cols)
  return jnp.broadcast_to(ids.reshape(1, h * w, n_axes),
                          (batch, h * w, n_axes))


def random_batch(key: jax.Array, cfg: FluxConfig, batch: int = 1,
                 image_tokens: int = 4096, text_tokens: int = 512,
                 dtype: jnp.dtype = jnp.bfloat16) -> dict[str, jax.Array]:
  """A batch of ``batch_spec``'s shapes: normal features and targets,
  timesteps uniform in [0, 1), guidance uniform in [1, 5), image ids on an
  ``(h, w)`` grid and zero text ids, as FLUX's sampler makes them."""
  spec = batch_spec(cfg, batch, image_tokens, text_tokens, dtype)
  k = dict(zip(("img", "txt", "y", "target", "timesteps", "guidance"),
               jax.random.split(key, 6)))
  out = {name: jax.random.normal(k[name], spec[name].shape, spec[name].dtype)
         for name in ("img", "txt", "y", "target")}
  out["timesteps"] = jax.random.uniform(k["timesteps"], (batch,), jnp.float32)
  out["guidance"] = jax.random.uniform(k["guidance"], (batch,), jnp.float32,
                                       1.0, 5.0)
  out["img_ids"] = image_ids(batch, image_tokens, len(cfg.axes_dim))
  out["txt_ids"] = jnp.zeros(spec["txt_ids"].shape, jnp.float32)
  return out

"""Parameter shapes of real models, built from their published configurations.

Only shapes (``jax.ShapeDtypeStruct``), never weights: memory figures come from
``jax.eval_shape`` and allocate nothing. Dense kernels use Flax's
``(in_features, out_features)`` layout, convolutions ``(kh, kw, in, out)``.

* ``flux_dev``: the FLUX.1-dev transformer (black-forest-labs/FLUX.1-dev,
  ``transformer/config.json``): hidden 3072 (24 heads x 128), 19 double-stream
  and 38 single-stream blocks, MLP ratio 4, 64 input channels, 4096-d T5
  context, 768-d pooled CLIP vector, guidance embedding. About 11.9B params.
* ``sdxl_unet``: the SDXL base UNet (``unet/config.json``): channels
  (320, 640, 1280), transformer depth (0, 2, 10), 2048-d cross-attention,
  addition embeddings 2816-d. About 2.6B params.
* ``llama3_8b``: a Llama-3-8B-style decoder: 32 layers, hidden 4096, 32
  query / 8 key-value heads, MLP 14336, vocabulary 128256, untied embeddings.
  About 8.0B params.
"""

from __future__ import annotations

import math
from typing import Callable

import jax
import jax.numpy as jnp

Shapes = dict[str, tuple[int, ...]]


def _linear(out: Shapes, name: str, fan_in: int, fan_out: int,
            bias: bool = True) -> None:
  out[f"{name}.kernel"] = (fan_in, fan_out)
  if bias:
    out[f"{name}.bias"] = (fan_out,)


def flux_dev_shapes(hidden: int = 3072, double_blocks: int = 19,
                    single_blocks: int = 38, head_dim: int = 128) -> Shapes:
  """The FLUX.1-dev transformer's parameter shapes (diffusers naming)."""
  s: Shapes = {}
  mlp = 4 * hidden
  _linear(s, "x_embedder", 64, hidden)
  _linear(s, "context_embedder", 4096, hidden)
  for emb, fan_in in (("timestep", 256), ("guidance", 256), ("text", 768)):
    _linear(s, f"time_text_embed.{emb}.linear_1", fan_in, hidden)
    _linear(s, f"time_text_embed.{emb}.linear_2", hidden, hidden)
  for i in range(double_blocks):
    b = f"transformer_blocks.{i}"
    _linear(s, f"{b}.norm1.linear", hidden, 6 * hidden)
    _linear(s, f"{b}.norm1_context.linear", hidden, 6 * hidden)
    for proj in ("to_q", "to_k", "to_v", "add_q_proj", "add_k_proj",
                 "add_v_proj", "to_out", "to_add_out"):
      _linear(s, f"{b}.attn.{proj}", hidden, hidden)
    for norm in ("norm_q", "norm_k", "norm_added_q", "norm_added_k"):
      s[f"{b}.attn.{norm}.scale"] = (head_dim,)
    for ff in ("ff", "ff_context"):
      _linear(s, f"{b}.{ff}.proj_in", hidden, mlp)
      _linear(s, f"{b}.{ff}.proj_out", mlp, hidden)
  for i in range(single_blocks):
    b = f"single_transformer_blocks.{i}"
    _linear(s, f"{b}.norm.linear", hidden, 3 * hidden)
    _linear(s, f"{b}.proj_mlp", hidden, mlp)
    for proj in ("to_q", "to_k", "to_v"):
      _linear(s, f"{b}.attn.{proj}", hidden, hidden)
    for norm in ("norm_q", "norm_k"):
      s[f"{b}.attn.{norm}.scale"] = (head_dim,)
    _linear(s, f"{b}.proj_out", hidden + mlp, hidden)
  _linear(s, "norm_out.linear", hidden, 2 * hidden)
  _linear(s, "proj_out", hidden, 64)
  return s


def llama3_8b_shapes(layers: int = 32, hidden: int = 4096, heads: int = 32,
                     kv_heads: int = 8, mlp: int = 14336,
                     vocab: int = 128256) -> Shapes:
  """A Llama-3-8B-style decoder's parameter shapes."""
  s: Shapes = {"embed": (vocab, hidden)}
  head_dim = hidden // heads
  for i in range(layers):
    b = f"layers.{i}"
    s[f"{b}.attn_norm.scale"] = (hidden,)
    _linear(s, f"{b}.q", hidden, heads * head_dim, bias=False)
    _linear(s, f"{b}.k", hidden, kv_heads * head_dim, bias=False)
    _linear(s, f"{b}.v", hidden, kv_heads * head_dim, bias=False)
    _linear(s, f"{b}.o", heads * head_dim, hidden, bias=False)
    s[f"{b}.mlp_norm.scale"] = (hidden,)
    _linear(s, f"{b}.gate", hidden, mlp, bias=False)
    _linear(s, f"{b}.up", hidden, mlp, bias=False)
    _linear(s, f"{b}.down", mlp, hidden, bias=False)
  s["final_norm.scale"] = (hidden,)
  s["lm_head"] = (hidden, vocab)
  return s


def _resnet(s: Shapes, name: str, cin: int, cout: int, temb: int) -> None:
  s[f"{name}.norm1.scale"] = (cin,)
  s[f"{name}.norm1.bias"] = (cin,)
  s[f"{name}.conv1.kernel"] = (3, 3, cin, cout)
  s[f"{name}.conv1.bias"] = (cout,)
  _linear(s, f"{name}.time_emb_proj", temb, cout)
  s[f"{name}.norm2.scale"] = (cout,)
  s[f"{name}.norm2.bias"] = (cout,)
  s[f"{name}.conv2.kernel"] = (3, 3, cout, cout)
  s[f"{name}.conv2.bias"] = (cout,)
  if cin != cout:
    s[f"{name}.conv_shortcut.kernel"] = (1, 1, cin, cout)
    s[f"{name}.conv_shortcut.bias"] = (cout,)


def _transformer(s: Shapes, name: str, ch: int, depth: int,
                 context: int) -> None:
  s[f"{name}.norm.scale"] = (ch,)
  s[f"{name}.norm.bias"] = (ch,)
  _linear(s, f"{name}.proj_in", ch, ch)
  for d in range(depth):
    b = f"{name}.blocks.{d}"
    for n in ("norm1", "norm2", "norm3"):
      s[f"{b}.{n}.scale"] = (ch,)
      s[f"{b}.{n}.bias"] = (ch,)
    for attn, kv in (("attn1", ch), ("attn2", context)):
      _linear(s, f"{b}.{attn}.to_q", ch, ch, bias=False)
      _linear(s, f"{b}.{attn}.to_k", kv, ch, bias=False)
      _linear(s, f"{b}.{attn}.to_v", kv, ch, bias=False)
      _linear(s, f"{b}.{attn}.to_out", ch, ch)
    _linear(s, f"{b}.ff.proj_in", ch, 8 * ch)  # GEGLU: 2 x 4ch
    _linear(s, f"{b}.ff.proj_out", 4 * ch, ch)
  _linear(s, f"{name}.proj_out", ch, ch)


def sdxl_unet_shapes() -> Shapes:
  """The SDXL base UNet's parameter shapes (diffusers' block layout)."""
  s: Shapes = {}
  chans, depths, context, temb = (320, 640, 1280), (0, 2, 10), 2048, 1280
  s["conv_in.kernel"] = (3, 3, 4, 320)
  s["conv_in.bias"] = (320,)
  _linear(s, "time_embedding.linear_1", 320, temb)
  _linear(s, "time_embedding.linear_2", temb, temb)
  _linear(s, "add_embedding.linear_1", 2816, temb)
  _linear(s, "add_embedding.linear_2", temb, temb)
  cin = 320
  skips = [320]
  for i, (ch, depth) in enumerate(zip(chans, depths)):
    for j in range(2):
      _resnet(s, f"down.{i}.resnets.{j}", cin, ch, temb)
      if depth:
        _transformer(s, f"down.{i}.attentions.{j}", ch, depth, context)
      cin = ch
      skips.append(ch)
    if i < len(chans) - 1:
      s[f"down.{i}.downsample.kernel"] = (3, 3, ch, ch)
      s[f"down.{i}.downsample.bias"] = (ch,)
      skips.append(ch)
  _resnet(s, "mid.resnets.0", 1280, 1280, temb)
  _transformer(s, "mid.attentions.0", 1280, 10, context)
  _resnet(s, "mid.resnets.1", 1280, 1280, temb)
  for i, (ch, depth) in enumerate(zip(chans[::-1], depths[::-1])):
    for j in range(3):
      skip = skips.pop()
      _resnet(s, f"up.{i}.resnets.{j}", cin + skip, ch, temb)
      if depth:
        _transformer(s, f"up.{i}.attentions.{j}", ch, depth, context)
      cin = ch
    if i < len(chans) - 1:
      s[f"up.{i}.upsample.kernel"] = (3, 3, ch, ch)
      s[f"up.{i}.upsample.bias"] = (ch,)
  s["conv_norm_out.scale"] = (320,)
  s["conv_norm_out.bias"] = (320,)
  s["conv_out.kernel"] = (3, 3, 320, 4)
  s["conv_out.bias"] = (4,)
  return s


MODELS: dict[str, Callable[[], Shapes]] = {
    "FLUX.1-dev transformer": flux_dev_shapes,
    "SDXL UNet": sdxl_unet_shapes,
    "Llama-3-8B": llama3_8b_shapes,
}


def as_params(shapes: Shapes, dtype=jnp.bfloat16) -> dict:
  """``{name: jax.ShapeDtypeStruct}`` for ``jax.eval_shape``."""
  return {k: jax.ShapeDtypeStruct(v, dtype) for k, v in shapes.items()}


def num_params(shapes: Shapes) -> int:
  return sum(math.prod(v) for v in shapes.values())


def tree_bytes(tree) -> int:
  """Bytes of every array (or ShapeDtypeStruct) leaf of ``tree``."""
  return sum(math.prod(x.shape) * jnp.dtype(x.dtype).itemsize
             for x in jax.tree.leaves(tree))

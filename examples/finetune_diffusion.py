"""Polish a pretrained diffusion model in bfloat16: Kahan updates work, plain ones stall.

The claim
---------
A polishing pass (fine-tuning an already-trained model at a low learning rate)
with bfloat16 weights does nothing when each update is rounded to bfloat16,
because the updates are smaller than half a bfloat16 ulp of the weights they
are added to. ``optax_kahan.kahan`` keeps the 16 bits that bfloat16 drops as a
``uint16`` residual in host memory, so the same bfloat16 weights follow the
float32 trajectory bit for bit. This script shows it in a few minutes on a CPU::

    python examples/finetune_diffusion.py

(``pip install -e ".[examples]"`` first; run from the repository root.
Outputs go to ``outputs/finetune_diffusion``.) On 2 idle CPU cores a first
run took 107 s on Python 3.11, 95 s on 3.13 (2026-12-06, the README's figures), its pretraining included,
which later runs read from a cache; ``--optimizer adafactor|prodigy|prodigy_factored`` swaps
the polish optimizer. ``--blockwise`` runs the polish through
``optax_kahan.blockwise.blockwise_step``: the UNet as an encoder, a stack of one middle
block and a decoder, each part updated inside the backward pass (Prodigy with
``lagged_d=True``). Every rule steps bf16 weights (the float32 rule's master
weights are state of ``master_weights``), so all of them take their
gradients from the same program.

The model and the math
----------------------
Data: scikit-learn's 1797 handwritten digits (8x8, grey levels 0..16), scaled
to [-1, 1]; a fixed 297-image split is held out for evaluation.

Model: a small UNet (Flax NNX): 8x8 and 4x4 levels, residual blocks with
GroupNorm and a sinusoidal time embedding, a skip connection per level.

Objective: flow matching (rectified flow). With ``x0`` an image,
``eps ~ N(0, I)`` and ``t ~ U[0, 1]``::

    x_t = (1 - t) x0 + t eps                    (straight path, noise at t = 1)
    L(theta) = E || v_theta(x_t, t) - (eps - x0) ||^2

The minimiser is the velocity ``E[eps - x0 | x_t]``; samples follow
``dx/dt = v_theta(x, t)`` from ``t = 1`` (pure noise) to ``t = 0``, integrated
here with Euler steps. The held-out loss is ``L`` on the held-out images with
fixed ``(eps, t)`` draws, identical for every model.

The flow
--------
1. Pretrain in float32 with AdamW (the weights are cached with orbax under
   ``--out/pretrained/<config hash>``; ``--retrain`` forces a fresh run).
2. Polish the pretrained weights ``w0`` under four update rules, with the same
   batches, noise, timesteps and optimizer. The forward pass always sees
   bfloat16 weights (activations are float32), so only the update differs:

   ``float32``    master weights ``m`` in float32 (the reference); the forward
                  pass sees ``hi(m)``, the library's round-to-nearest (ties
                  away from zero, ``optax_kahan.split_float32(m)[0]``), and
                  the bfloat16 gradient, cast to float32, updates ``m``.
   ``nearest``    bfloat16 weights, optimizer run directly on bfloat16 params
                  and gradients, ``optax.apply_updates`` (round to nearest
                  even): ``p <- bf16(p + u)``.
   ``stochastic`` ``p <- stochastic_round(p + u)`` (unbiased, noisy), with
                  ``optax_kahan.stochastic_rounding``.
   ``kahan``      ``x = merge(p, lo); p, lo <- split(x + u)`` with
                  ``optax_kahan.kahan`` (residuals ``lo`` in host memory).

   The bfloat16 rules start from ``hi(w0)``; ``float32`` and ``kahan`` from
   ``w0`` itself. ``kahan`` then equals ``float32`` bit for bit:
   ``kahan_to_float32(p, lo) == m`` after every step (the table's max distance
   is exactly 0).

The regime
----------
A bfloat16 weight ``w`` has 8 significant bits: a change smaller than half an
ulp, about ``|w| * 2**-9``, rounds away. Adam-type steps are at most about
``lr`` in size, so with the default AdamW ``lr = 5e-6`` the ``nearest`` rule
can only move weights with ``|w| < ~256 * lr = 1.3e-3`` (about 1% of them;
the pretrained weights have a median magnitude of 0.06, 90% are above 0.01):
a relative step of ~1e-4 to 1e-5 per update, far below bfloat16's 2**-9.
Pretraining ends at ``--pretrain-lr / 10 = 3e-4`` (cosine decay); the polish
continues 60x lower, the way a final low-learning-rate pass is run on a large
model. Float32 (and Kahan) weights move there, and the held-out loss drops;
round-to-nearest bfloat16 weights barely move. The printed table
reports, per rule: the held-out loss, the largest distance to the float32
master weights, the fraction of weights whose bfloat16 value (the one the
forward pass sees) ever left its pretrained value, and the bytes per
parameter of the training state (weights + optimizer state + residuals),
measured on the arrays, host memory told from device memory by
``x.sharding.memory_kind``. On a CPU both memories are the same RAM; the split
shows what a GPU would hold.

Bit-identity notes (what it takes for ``kahan`` to match ``float32`` exactly):

* the gradient is computed by one jitted function shared by all rules (same
  executable, same bfloat16 inputs, same result); a second jit per rule
  applies the update;
* ``kahan``'s inner optimizer state is initialised from the float32 weights
  ``w0``, as the float32 rule's is: ``kahan(tx).init`` only sees the bfloat16
  params and would hand Prodigy (which stores the initial point ``x0``) the
  rounded weights;
* the float32 rule runs the optimizer's per-leaf stages row by row, as
  ``kahan`` does (``master_weights``), each leaf's ``m + u`` inside its row:
  XLA then rounds both rules' updates alike (a whole-tree program may round
  ``optax.adamw``'s bias correction and the final add differently). Where
  the optimizer sums over the weights (Adafactor's RMS, Prodigy's dot
  products), XLA may fuse ``kahan``'s ``merge(p, lo)`` into the sum and add
  in another order: the table then shows an ulp-sized difference.

Outputs (under ``--out``): ``loss_curves.png``, ``samples.png``,
``results.json`` (every figure of the table, and the curves).
"""

from __future__ import annotations

import argparse
import dataclasses
import functools
import hashlib
import inspect
import json
import math
import pathlib
import shutil
import sys
import time
from typing import Any, Callable, NamedTuple, Optional, Sequence

import jax
import jax.numpy as jnp
import numpy as np
import optax
from flax import nnx

import optax_kahan as ok

Params = Any  # a nested dict of arrays (nnx.to_pure_dict of the nnx.Param state)

RULES: tuple[str, ...] = ("float32", "nearest", "stochastic", "kahan")
OPTIMIZERS: tuple[str, ...] = ("adamw", "adafactor", "prodigy",
                               "prodigy_factored")
DEFAULT_LR: dict[str, float] = {
    "adamw": 5e-6,
    "adafactor": 1e-5,  # relative to each weight block's RMS
    "prodigy": 1.0,  # multiplier of Prodigy's own step size d
    "prodigy_factored": 1.0,
}
HOLDOUT = 297  # held-out digits (1797 - 297 = 1500 for training)
EVAL_REPEATS = 4  # held-out noise draws per image
_F32 = jnp.float32
_HOST_KINDS = ("pinned_host", "unpinned_host")


# ----------------------------------------------------------------------------
# Data


def load_digits_split() -> tuple[np.ndarray, np.ndarray]:
  """The 8x8 digits in [-1, 1], shape (n, 8, 8, 1): (train, held-out).

  The split is fixed (it does not depend on ``--seed``).
  """
  from sklearn.datasets import load_digits  # pylint: disable=g-import-not-at-top
  images = load_digits().images.astype(np.float32) / 8.0 - 1.0
  perm = np.random.default_rng(0).permutation(len(images))
  images = images[perm][..., None]
  return images[HOLDOUT:], images[:HOLDOUT]


def eval_set(heldout: np.ndarray) -> tuple[jax.Array, jax.Array, jax.Array]:
  """Held-out ``(x0, eps, t)``: every image ``EVAL_REPEATS`` times, fixed draws.

  The draws use a fixed key (not ``--seed``) and stratified timesteps, so the
  held-out loss of different runs and rules is measured on the same problem.
  """
  x0 = jnp.tile(jnp.asarray(heldout), (EVAL_REPEATS, 1, 1, 1))
  k_eps, k_t = jax.random.split(jax.random.key(20240601))
  n = x0.shape[0]
  t = (jax.random.permutation(k_t, n) + 0.5) / n
  return x0, jax.random.normal(k_eps, x0.shape), t.astype(_F32)


# ----------------------------------------------------------------------------
# Model


def _groups(channels: int) -> int:
  return math.gcd(channels, 8)


def time_embedding(t: jax.Array, dim: int) -> jax.Array:
  """Sinusoidal embedding of ``t`` in [0, 1] (scaled to [0, 1000])."""
  half = dim // 2
  freqs = jnp.exp(-jnp.log(10000.0) * jnp.arange(half, dtype=_F32) / half)
  angles = 1000.0 * t[:, None] * freqs[None]
  return jnp.concatenate([jnp.sin(angles), jnp.cos(angles)], axis=-1)


class ResBlock(nnx.Module):
  """GroupNorm-SiLU-conv, plus the time embedding, twice; residual connection."""

  def __init__(self, c_in: int, c_out: int, emb_dim: int, *, rngs: nnx.Rngs):
    self.norm1 = nnx.GroupNorm(c_in, num_groups=_groups(c_in), dtype=_F32,
                               rngs=rngs)
    self.conv1 = nnx.Conv(c_in, c_out, (3, 3), dtype=_F32, rngs=rngs)
    self.emb = nnx.Linear(emb_dim, c_out, dtype=_F32, rngs=rngs)
    self.norm2 = nnx.GroupNorm(c_out, num_groups=_groups(c_out), dtype=_F32,
                               rngs=rngs)
    self.conv2 = nnx.Conv(c_out, c_out, (3, 3), dtype=_F32, rngs=rngs)
    self.skip = (nnx.Conv(c_in, c_out, (1, 1), dtype=_F32, rngs=rngs)
                 if c_in != c_out else None)

  def __call__(self, x: jax.Array, emb: jax.Array) -> jax.Array:
    h = self.conv1(nnx.silu(self.norm1(x)))
    h = h + self.emb(emb)[:, None, None, :]
    h = self.conv2(nnx.silu(self.norm2(h)))
    return h + (x if self.skip is None else self.skip(x))


class UNet(nnx.Module):
  """Velocity model ``v_theta(x_t, t)`` for 8x8 images: two levels, skips.

  ``dtype`` of every layer is float32: parameters stored in bfloat16 are
  upcast exactly, so "forward pass on bfloat16 weights" means the weights'
  values are bfloat16 while activations stay float32.
  """

  def __init__(self, width: int, *, rngs: nnx.Rngs):
    c, e = width, 4 * width
    self.width = width
    self.t1 = nnx.Linear(c, e, dtype=_F32, rngs=rngs)
    self.t2 = nnx.Linear(e, e, dtype=_F32, rngs=rngs)
    self.conv_in = nnx.Conv(1, c, (3, 3), dtype=_F32, rngs=rngs)
    self.down1 = ResBlock(c, c, e, rngs=rngs)
    self.downsample = nnx.Conv(c, 2 * c, (3, 3), strides=2, dtype=_F32,
                               rngs=rngs)
    self.down2 = ResBlock(2 * c, 2 * c, e, rngs=rngs)
    self.mid = ResBlock(2 * c, 2 * c, e, rngs=rngs)
    self.up2 = ResBlock(4 * c, 2 * c, e, rngs=rngs)
    self.upsample = nnx.Conv(2 * c, c, (3, 3), dtype=_F32, rngs=rngs)
    self.up1 = ResBlock(2 * c, c, e, rngs=rngs)
    self.norm_out = nnx.GroupNorm(c, num_groups=_groups(c), dtype=_F32,
                                  rngs=rngs)
    self.conv_out = nnx.Conv(c, 1, (3, 3), dtype=_F32, rngs=rngs)

  def __call__(self, x: jax.Array, t: jax.Array) -> jax.Array:
    part = lambda name: getattr(self, name)
    h2, (emb, h1, _) = encode(part, x, t, self.width)
    return decode(part, self.mid(h2, emb), (emb, h1, h2))


# The UNet as embed -> blocks -> head, for ``--blockwise``: the encoder and
# the decoder around the middle block, which is a stack of one block.
ENCODER = ("t1", "t2", "conv_in", "down1", "downsample", "down2")
DECODER = ("up2", "upsample", "up1", "norm_out", "conv_out")


def encode(part: Callable[[str], Any], x: jax.Array, t: jax.Array,
           width: int) -> tuple[jax.Array, tuple[jax.Array, ...]]:
  """Time embedding and the down path: ``(h2, (emb, h1, h2))``."""
  emb = part("t2")(nnx.silu(part("t1")(time_embedding(t, width))))
  h1 = part("down1")(part("conv_in")(x), emb)
  h2 = part("down2")(part("downsample")(h1), emb)
  return h2, (emb, h1, h2)


def decode(part: Callable[[str], Any], h: jax.Array,
           skips: tuple[jax.Array, ...]) -> jax.Array:
  """The up path from the middle block's output and the skips."""
  emb, h1, h2 = skips
  h = part("up2")(jnp.concatenate([h, h2], axis=-1), emb)
  b, hh, ww, ch = h.shape
  h = jax.image.resize(h, (b, 2 * hh, 2 * ww, ch), "nearest")
  h = part("up1")(jnp.concatenate([part("upsample")(h), h1], axis=-1), emb)
  return part("conv_out")(nnx.silu(part("norm_out")(h)))


def model_def(width: int) -> tuple[nnx.GraphDef, Params]:
  """The model's graph definition and its params' shapes (nothing computed)."""
  model = nnx.eval_shape(lambda: UNet(width, rngs=nnx.Rngs(0)))
  graphdef, state = nnx.split(model, nnx.Param)
  return graphdef, nnx.to_pure_dict(state)


@functools.partial(jax.jit, static_argnums=(0, 1))
def init_params(width: int, seed: int) -> Params:
  """Float32 initial parameters (one compiled program, not one per shape).

  The key is an "rbg" one: threefry draws for every leaf take several
  seconds to compile on CPU.
  """
  rngs = nnx.Rngs(jax.random.key(seed, impl="rbg"))
  return nnx.to_pure_dict(nnx.split(UNet(width, rngs=rngs), nnx.Param)[1])


def commit(tree: Any) -> Any:
  """Commits every array to its current sharding (memory kind included).

  jit keys its cache on whether an argument is committed; committing the
  arrays a loop starts from lets each function compile once, not twice.
  """
  return jax.tree.map(lambda x: jax.device_put(x, x.sharding), tree)


def count_params(params: Params) -> int:
  return int(sum(x.size for x in jax.tree.leaves(params)))


# ----------------------------------------------------------------------------
# Loss, gradient, evaluation, sampling (jitted once per graphdef and dtype)


def flow_matching_loss(graphdef: nnx.GraphDef, params: Params, x0: jax.Array,
                       eps: jax.Array, t: jax.Array) -> jax.Array:
  """``mean || v(x_t, t) - (eps - x0) ||^2`` with ``x_t = (1 - t) x0 + t eps``."""
  tt = t[:, None, None, None]
  x_t = (1.0 - tt) * x0 + tt * eps
  v = nnx.merge(graphdef, params)(x_t, t)
  return jnp.mean(jnp.square(v - (eps - x0)))


def draw_batch(key: jax.Array, train: jax.Array,
               batch_size: int) -> tuple[jax.Array, jax.Array, jax.Array]:
  """A batch ``(x0, eps, t)``: images drawn with replacement, noise, times."""
  k_idx, k_eps, k_t = jax.random.split(key, 3)
  idx = jax.random.randint(k_idx, (batch_size,), 0, train.shape[0])
  x0 = train[idx]
  return (x0, jax.random.normal(k_eps, x0.shape, _F32),
          jax.random.uniform(k_t, (batch_size,), _F32))


@functools.partial(jax.jit, static_argnames=("graphdef", "batch_size"))
def loss_and_grad(params: Params, train: jax.Array, key: jax.Array,
                  step: jax.Array, *, graphdef: nnx.GraphDef,
                  batch_size: int) -> tuple[jax.Array, Params]:
  """Loss and gradient on the batch of ``step`` (``fold_in(key, step)``).

  Gradients have the params' dtype (bfloat16 params give bfloat16 grads).
  One executable serves every polish rule, so identical bfloat16 weights give
  identical gradients whatever the rule.
  """
  x0, eps, t = draw_batch(jax.random.fold_in(key, step), train, batch_size)
  return jax.value_and_grad(
      lambda p: flow_matching_loss(graphdef, p, x0, eps, t))(params)


@functools.partial(jax.jit, static_argnames=("graphdef",))
def heldout_loss(params: Params, x0: jax.Array, eps: jax.Array, t: jax.Array,
                 *, graphdef: nnx.GraphDef) -> jax.Array:
  return flow_matching_loss(graphdef, params, x0, eps, t)


@functools.partial(jax.jit, static_argnames=("graphdef", "num_steps"))
def sample(params: Params, noise: jax.Array, *, graphdef: nnx.GraphDef,
           num_steps: int) -> jax.Array:
  """Euler integration of ``dx/dt = v(x, t)`` from ``t = 1`` to ``t = 0``."""
  model = nnx.merge(graphdef, params)
  dt = 1.0 / num_steps

  def body(i, x):
    t = jnp.full((x.shape[0],), 1.0 - i * dt, _F32)
    return x - dt * model(x, t)

  return jax.lax.fori_loop(0, num_steps, body, noise)


@jax.jit
def to_bf16(params_f32: Params) -> Params:
  """bfloat16 weights the forward pass sees: the library's nearest rounding.

  ``split_float32(w, "nearest")[0]`` rounds ties away from zero (Kahan's
  ``hi``); ``w.astype(bfloat16)`` would round ties to even.
  """
  return jax.tree.map(lambda w: ok.split_float32(w, "nearest")[0], params_f32)


# ----------------------------------------------------------------------------
# Pretraining (float32), cached with orbax


@dataclasses.dataclass(frozen=True)
class PretrainConfig:
  """Everything the pretrained weights depend on (hashed into the cache key)."""
  width: int = 16
  steps: int = 2500
  lr: float = 3e-3
  batch_size: int = 64
  seed: int = 0

  def cache_key(self) -> str:
    """Hash of this config and of the model/loss/pretrain source code."""
    src = "".join(inspect.getsource(f) for f in (
        _groups, time_embedding, ResBlock, UNet, encode, decode, model_def,
        init_params,
        flow_matching_loss, draw_batch, loss_and_grad, load_digits_split,
        _pretrain_optimizer, _pretrain_run))
    blob = json.dumps(dataclasses.asdict(self), sort_keys=True) + src
    return hashlib.sha256(blob.encode()).hexdigest()[:16]


def _pretrain_optimizer(cfg: PretrainConfig) -> optax.GradientTransformation:
  """AdamW, warm-up then cosine decay to ``lr / 10``; global-norm clip 1."""
  schedule = optax.warmup_cosine_decay_schedule(
      0.0, cfg.lr, warmup_steps=min(100, cfg.steps // 10 + 1),
      decay_steps=max(cfg.steps, 2), end_value=cfg.lr / 10)
  return optax.chain(optax.clip_by_global_norm(1.0),
                     optax.adamw(schedule, weight_decay=1e-4))


def _pretrain_run(cfg: PretrainConfig, train: np.ndarray,
                  progress: bool) -> tuple[Params, list[float]]:
  graphdef, _ = model_def(cfg.width)
  params = commit(init_params(cfg.width, cfg.seed))
  tx = _pretrain_optimizer(cfg)
  key = jax.random.key(cfg.seed + 1)
  train = jnp.asarray(train)

  @functools.partial(jax.jit, donate_argnums=(0, 1))
  def step(params, opt_state, i):
    loss, grads = loss_and_grad(params, train, key, i, graphdef=graphdef,
                                batch_size=cfg.batch_size)
    updates, opt_state = tx.update(grads, opt_state, params)
    return optax.apply_updates(params, updates), opt_state, loss

  opt_state = commit(tx.init(params))
  losses = []
  bar = _tqdm(range(cfg.steps), "pretrain (float32)", progress)
  for i in bar:
    params, opt_state, loss = step(params, opt_state, jnp.int32(i))
    losses.append(loss)
    if i % 50 == 0 or i == cfg.steps - 1:
      bar.set_postfix(loss=f"{float(loss):.4f}")
  return params, [float(x) for x in jax.device_get(losses)]


def pretrain(cfg: PretrainConfig, train: np.ndarray, out: pathlib.Path, *,
             retrain: bool = False,
             progress: bool = True) -> tuple[Params, dict[str, Any]]:
  """Float32 pretrained weights, from the orbax cache when it has them.

  The cache is ``out/pretrained/<cfg.cache_key()>``: a changed config or model
  code gives a new key, so stale weights are never loaded.

  Returns:
    ``(params_f32, info)``: ``info`` has ``cached`` (bool), ``losses`` (the
    pretraining loss curve), ``seconds`` and ``cache_dir``.
  """
  import orbax.checkpoint as ocp  # pylint: disable=g-import-not-at-top
  cache = (out / "pretrained" / cfg.cache_key()).absolute()
  ckpt_dir = cache / "params"
  meta_file = cache / "pretrain.json"
  _, template = model_def(cfg.width)
  t0 = time.perf_counter()
  if not retrain and meta_file.exists() and ckpt_dir.exists():
    try:
      params = commit(ocp.StandardCheckpointer().restore(ckpt_dir, template))
      meta = json.loads(meta_file.read_text())
      print(f"pretrained weights loaded from {cache}", flush=True)
      return params, {"cached": True, "losses": meta["losses"],
                      "seconds": time.perf_counter() - t0,
                      "cache_dir": str(cache)}
    except Exception as e:  # pylint: disable=broad-except
      print(f"cache at {cache} unreadable ({e!r}); retraining", flush=True)
  params, losses = _pretrain_run(cfg, train, progress)
  if cache.exists():
    shutil.rmtree(cache)
  cache.mkdir(parents=True)
  ckptr = ocp.StandardCheckpointer()
  ckptr.save(ckpt_dir, params)
  ckptr.wait_until_finished()
  meta_file.write_text(json.dumps(
      {"config": dataclasses.asdict(cfg), "losses": losses}))
  return params, {"cached": False, "losses": losses,
                  "seconds": time.perf_counter() - t0, "cache_dir": str(cache)}


# ----------------------------------------------------------------------------
# The four update rules


def make_optimizer(name: str, lr: float,
                   lagged_d: bool = False) -> optax.GradientTransformation:
  """The polish optimizer: ``adamw``, ``adafactor``, ``prodigy(_factored)``.

  ``lagged_d``: Prodigy's ``d`` one step late, as the blockwise step needs.
  """
  if name == "adamw":
    return optax.adamw(lr)
  if name == "adafactor":
    return optax.adafactor(lr)
  if name == "prodigy":
    return ok.prodigy(lr, lagged_d=lagged_d)
  if name == "prodigy_factored":
    return ok.prodigy_factored(lr, lagged_d=lagged_d)
  raise ValueError(f"unknown optimizer {name!r}; expected one of {OPTIMIZERS}")


class Rule(NamedTuple):
  """An update rule as four pure functions of its training state.

  ``init(w0)``: training state from float32 pretrained weights.
  ``update(state, grads)``: one step from the bfloat16 gradients.
  ``forward(state)``: the bfloat16 weights the forward pass sees.
  ``exact(state)``: the float32 value of the weights (the rule's own
  precision: for the bfloat16 rules, the bfloat16 value; for ``kahan``,
  ``kahan_to_float32``).
  """
  init: Callable[[Params], Any]
  update: Callable[[Any, Params], Any]
  forward: Callable[[Any], Params]
  exact: Callable[[Any], Params]


def make_rule(rule: str, tx: optax.GradientTransformation,
              key: jax.Array) -> Rule:
  """The update rule ``rule`` (one of ``RULES``) around the optimizer ``tx``.

  ``key`` seeds stochastic rounding (unused by the other rules).
  """
  f32 = lambda tree: jax.tree.map(lambda x: x.astype(_F32), tree)

  if rule == "float32":
    wrapped = master_weights(tx)

    def update(state, grads):
      params, opt_state = state
      updates, opt_state = wrapped.update(grads, opt_state, params)
      return optax.apply_updates(params, updates), opt_state
    return Rule(init=lambda w0: (to_bf16(w0), wrapped.init(to_bf16(w0), w0)),
                update=update, forward=lambda s: s[0],
                exact=lambda s: s[1].master)

  if rule in ("nearest", "stochastic"):
    wrapped = tx if rule == "nearest" else ok.stochastic_rounding(tx, key)

    def init(w0):
      params = to_bf16(w0)
      return params, wrapped.init(params)

    def update(state, grads):
      params, opt_state = state
      updates, opt_state = wrapped.update(grads, opt_state, params)
      return optax.apply_updates(params, updates), opt_state
    return Rule(init=init, update=update, forward=lambda s: s[0],
                exact=lambda s: f32(s[0]))

  if rule == "kahan":
    wrapped = ok.kahan(tx)  # offload=True: residuals in host memory

    def init(w0):
      # Start exactly where the float32 rule starts: the residuals hold the
      # low bits of w0, and the inner state is initialised from w0 itself
      # (Prodigy stores it as x0).
      params, residuals = ok.kahan_from_float32(w0)
      return params, wrapped.init(params, residuals)

    def update(state, grads):
      params, opt_state = state
      updates, opt_state = wrapped.update(grads, opt_state, params)
      return optax.apply_updates(params, updates), opt_state

    def exact(state):
      params, opt_state = state
      return ok.kahan_to_float32(params, ok.kahan_residuals(opt_state))
    return Rule(init=init, update=update, forward=lambda s: s[0], exact=exact)

  raise ValueError(f"unknown rule {rule!r}; expected one of {RULES}")


def to_groups(params: Params) -> ok.blockwise.BlockwiseParams:
  """The UNet's params as encoder, a stack of one middle block, decoder."""
  return ok.blockwise.BlockwiseParams(
      embed={k: params[k] for k in ENCODER},
      stacks=(jax.tree.map(lambda x: x[None], params["mid"]),),
      head={k: params[k] for k in DECODER})


def from_groups(groups: ok.blockwise.BlockwiseParams) -> Params:
  return {**groups.embed, **groups.head,
          "mid": jax.tree.map(lambda x: x[0], groups.stacks[0])}


def blockwise_model(width: int) -> ok.blockwise.BlockwiseModel:
  """The UNet's loss as ``encode -> mid -> decode``, each on its own params.

  The batch is ``(x_t, t, target)``; the loss is ``flow_matching_loss``'s.
  """
  model = nnx.eval_shape(lambda: UNet(width, rngs=nnx.Rngs(0)))
  defs = {k: nnx.split(getattr(model, k), nnx.Param)[0]
          for k in (*ENCODER, "mid", *DECODER)}
  parts = lambda p: (lambda k: nnx.merge(defs[k], p[k]))

  def embed(p, batch):
    x_t, t, _ = batch
    return encode(parts(p), x_t, t, width)

  def mid(p, h, skips):
    return nnx.merge(defs["mid"], p)(h, skips[0])

  def head(p, h, skips, batch):
    return jnp.mean(jnp.square(decode(parts(p), h, skips) - batch[2]))

  return ok.blockwise.BlockwiseModel(embed, (mid,), head)


class BlockwiseRule(NamedTuple):
  """An update rule run by ``ok.blockwise.blockwise_step``: ``step(state, batch) ->
  (loss, state)``, the gradient and the update in one program; the other
  fields as in ``Rule``."""
  init: Callable[[Params], Any]
  step: Callable[[Any, Any], tuple[jax.Array, Any]]
  forward: Callable[[Any], Params]
  exact: Callable[[Any], Params]


class MasterState(NamedTuple):
  master: Params  # float32
  inner: optax.OptState


def master_weights(tx: optax.GradientTransformation
                   ) -> optax.GradientTransformationExtraArgs:
  """The ``float32`` rule as a transformation of the bf16 weights it shows.

  The state holds the float32 master ``m``; an update steps it with ``tx`` on
  the float32 gradients and returns the delta that lands the bf16 weights on
  ``hi(m)``. It runs ``tx``'s per-leaf stages row by row, as ``ok.kahan``
  runs them, each leaf's ``m + u`` inside its row (where ``kahan`` forms
  ``merge(p, lo) + u``): the same program shape, so XLA rounds both alike.
  The ``float32`` and ``kahan`` rules step bf16 weights this way, so their
  gradients come from the same program (one compiled with a float32 forward
  cast would fuse, and round, differently).
  """
  tx = optax.with_extra_args_support(tx)

  def init(params, master):
    return MasterState(master, tx.init(master))

  def stages(grads, state, params, **extra):
    grads = jax.tree.map(lambda g: g.astype(_F32), grads)
    st, reason = ok.per_leaf.stages_of(tx, grads, state.inner, state.master, **extra)
    if st is None:
      raise ValueError(f"master_weights: {reason}")

    def update(g, s, p, shared, **extra):
      m, s = s
      u, s = st.update(g.astype(_F32), s, m, shared, **extra)
      m = m + u
      hi = to_bf16(m)
      return jnp.where(hi == p, 0.0, hi.astype(_F32) - p.astype(_F32)), (m, s)

    def round_(rnd):
      def statistic(g, s, p, shared, **extra):
        stat, inner = rnd.statistic(g.astype(_F32), s[1], s[0], shared,
                                    **extra)
        return stat, (s[0], inner)
      return rnd._replace(statistic=statistic)

    treedef = jax.tree.structure(grads)
    return ok.per_leaf.LeafStages(
        list(zip(treedef.flatten_up_to(state.master), st.leaf_states)),
        st.shared, tuple(round_(r) for r in st.rounds), update,
        lambda states, shared: MasterState(
            treedef.unflatten([m for m, _ in states]),
            st.finish([s for _, s in states], shared)))

  return ok.per_leaf.transformation(init, stages, ordered=True)


def make_blockwise_rule(rule: str, tx: optax.GradientTransformation,
                        key: jax.Array, width: int) -> BlockwiseRule:
  """``make_rule``'s rules through the blockwise step (``--blockwise``).

  Every rule steps bf16 weights (the ``float32`` rule's master weights are
  state of ``master_weights``), so that all take their gradients from the
  same program.
  """
  model = blockwise_model(width)
  wrapped = {"float32": master_weights(tx), "nearest": tx,
             "kahan": ok.kahan(tx),
             "stochastic": ok.stochastic_rounding(tx, key)}.get(rule)
  if wrapped is None:
    raise ValueError(f"unknown rule {rule!r}; expected one of {RULES}")

  def init(w0):
    if rule in ("float32", "kahan"):  # from the exact w0, as in make_rule
      params, residuals = ok.kahan_from_float32(w0)
      extra = w0 if rule == "float32" else residuals
      params = to_groups(params)
      return params, ok.blockwise.blockwise_init(wrapped, params, to_groups(extra))
    params = to_groups(to_bf16(w0))
    return params, ok.blockwise.blockwise_init(wrapped, params)

  def step(state, batch):
    loss, params, opt_state = ok.blockwise.blockwise_step(model, wrapped, *state, batch)
    return loss, (params, opt_state)

  def exact(state):
    params, opt_state = state
    if rule == "float32":
      return from_groups(ok.blockwise.BlockwiseParams(
          opt_state.embed.master, (opt_state.stacks[0].master,),
          opt_state.head.master))
    if rule == "kahan":
      residuals = ok.blockwise.BlockwiseParams(
          ok.kahan_residuals(opt_state.embed),
          (ok.kahan_residuals(opt_state.stacks[0]),),
          ok.kahan_residuals(opt_state.head))
      return ok.kahan_to_float32(from_groups(params), from_groups(residuals))
    return jax.tree.map(lambda x: x.astype(_F32), from_groups(params))

  return BlockwiseRule(init, step, lambda s: from_groups(s[0]), exact)


def state_bytes(state: Any) -> tuple[int, int]:
  """(device bytes, host bytes) of every array in ``state``.

  Host means ``x.sharding.memory_kind`` is ``pinned_host``/``unpinned_host``.
  """
  device = host = 0
  for x in jax.tree.leaves(state):
    if not isinstance(x, jax.Array):
      continue
    if x.sharding.memory_kind in _HOST_KINDS:
      host += x.nbytes
    else:
      device += x.nbytes
  return device, host


@dataclasses.dataclass
class PolishSetup:
  """What every rule shares: model, data, pretrained weights, schedule."""
  graphdef: nnx.GraphDef
  pretrained: Params  # float32
  train: jax.Array
  heldout: tuple[jax.Array, jax.Array, jax.Array]
  optimizer: str
  lr: float
  steps: int
  batch_size: int
  seed: int
  eval_every: int = 20
  blockwise: bool = False
  width: int = 16


@dataclasses.dataclass
class PolishResult:
  rule: str
  exact: Params  # float32 value of the final weights
  forward: Params  # final bfloat16 weights the forward pass sees
  train_loss: list[float]
  eval_steps: list[int]
  eval_loss: list[float]
  changed_fraction: float
  device_bytes: int
  host_bytes: int
  seconds: float


def polish(rule: str, setup: PolishSetup, *,
           progress: bool = True) -> PolishResult:
  """Runs the polish under ``rule`` and returns its weights and curves.

  The batches (``fold_in(key, step)``), noise, timesteps and the optimizer are
  those of every other rule with the same ``setup``; so are the gradient
  function and the held-out set.
  """
  t0 = time.perf_counter()
  tx = make_optimizer(setup.optimizer, setup.lr, lagged_d=setup.blockwise)
  batch_key = jax.random.key(setup.seed + 1000)
  # An "rbg" key: the library draws stochastic-rounding bits leaf by leaf, and
  # ~50 threefry draws take ~10 s to compile on CPU (rbg: ~4 s).
  sr_key = jax.random.key(setup.seed + 2000, impl="rbg")
  r = (make_blockwise_rule(rule, tx, sr_key, setup.width) if setup.blockwise
       else make_rule(rule, tx, sr_key))

  # jit(init) puts every array where the step will return it (the Kahan
  # residuals in host memory); committed, they let the step compile once.
  def start(w0):
    state = r.init(w0)
    fwd0 = r.forward(state)
    return state, fwd0, jax.tree.map(lambda x: jnp.zeros(x.shape, bool), fwd0)

  state, fwd0, changed = commit(jax.jit(start)(setup.pretrained))

  def track(state, changed, fwd0):
    fwd = r.forward(state)
    changed = jax.tree.map(lambda c, a, b: c | (a != b), changed, fwd, fwd0)
    return state, changed, fwd

  @functools.partial(jax.jit, donate_argnums=(0, 1))
  def step(state, changed, grads, fwd0):
    return track(r.update(state, grads), changed, fwd0)

  @functools.partial(jax.jit, donate_argnums=(0, 1))
  def blockwise_step(state, changed, fwd0, i):
    # The batch of step i, as loss_and_grad draws it, and the loss's inputs.
    x0, eps, t = draw_batch(jax.random.fold_in(batch_key, i), setup.train,
                            setup.batch_size)
    tt = t[:, None, None, None]
    loss, state = r.step(state, ((1.0 - tt) * x0 + tt * eps, t, eps - x0))
    return loss, *track(state, changed, fwd0)

  grad_kw = dict(graphdef=setup.graphdef, batch_size=setup.batch_size)
  eval_kw = dict(graphdef=setup.graphdef)
  fwd = fwd0
  losses, eval_steps, eval_losses = [], [0], [
      heldout_loss(fwd0, *setup.heldout, **eval_kw)]
  bar = _tqdm(range(setup.steps), f"polish {rule:>10}", progress)
  for i in bar:
    if setup.blockwise:
      loss, state, changed, fwd = blockwise_step(state, changed, fwd0,
                                                 jnp.int32(i))
    else:
      loss, grads = loss_and_grad(fwd, setup.train, batch_key, jnp.int32(i),
                                  **grad_kw)
      state, changed, fwd = step(state, changed, grads, fwd0)
    losses.append(loss)
    if (i + 1) % setup.eval_every == 0 or i + 1 == setup.steps:
      eval_steps.append(i + 1)
      eval_losses.append(heldout_loss(fwd, *setup.heldout, **eval_kw))
      bar.set_postfix(heldout=f"{float(eval_losses[-1]):.5f}")
  n_changed = int(_count_true(changed))
  device, host = state_bytes(state)
  exact = jax.jit(r.exact)(state)
  result = PolishResult(
      rule=rule, exact=exact, forward=fwd,
      train_loss=[float(x) for x in jax.device_get(losses)],
      eval_steps=eval_steps,
      eval_loss=[float(x) for x in jax.device_get(eval_losses)],
      changed_fraction=n_changed / count_params(fwd),
      device_bytes=device, host_bytes=host, seconds=0.0)
  result.seconds = time.perf_counter() - t0
  return result


@jax.jit
def _count_true(tree: Any) -> jax.Array:
  return sum(jnp.sum(x, dtype=jnp.int32) for x in jax.tree.leaves(tree))


@jax.jit
def _max_abs_diff(a: Params, b: Params) -> jax.Array:
  return jnp.max(jnp.stack([
      jnp.max(jnp.abs(x.astype(_F32) - y.astype(_F32)))
      for x, y in zip(jax.tree.leaves(a), jax.tree.leaves(b))]))


@jax.jit
def _bits_differ(a: Params, b: Params) -> jax.Array:
  as_bits = lambda x: jax.lax.bitcast_convert_type(x.astype(_F32), jnp.uint32)
  return sum(jnp.sum(as_bits(x) != as_bits(y), dtype=jnp.int32)
             for x, y in zip(jax.tree.leaves(a), jax.tree.leaves(b)))


def max_abs_diff(a: Params, b: Params) -> float:
  """``max |a - b|`` over all weights, in float32."""
  return float(_max_abs_diff(a, b))


def bits_differ(a: Params, b: Params) -> int:
  """How many float32 weights of ``a`` and ``b`` differ in any bit."""
  return int(_bits_differ(a, b))


# ----------------------------------------------------------------------------
# Figures


def plot_loss_curves(path: pathlib.Path, results: dict[str, PolishResult],
                     pretrained_loss: float, title: str) -> None:
  """Held-out loss per rule, and each rule's training loss minus float32's."""
  import matplotlib  # pylint: disable=g-import-not-at-top
  matplotlib.use("Agg")
  import matplotlib.pyplot as plt  # pylint: disable=g-import-not-at-top

  colors = {"float32": "black", "nearest": "tab:red",
            "stochastic": "tab:orange", "kahan": "tab:blue"}
  styles = {"float32": "-", "nearest": "-", "stochastic": "-", "kahan": "--"}
  ref_res = results.get("float32")
  # A rule whose curves are float32's, value for value, hides under its line:
  # the legend says so.
  identical = {rule for rule, res in results.items()
               if rule != "float32" and ref_res is not None
               and np.array_equal(res.train_loss, ref_res.train_loss)
               and np.array_equal(res.eval_loss, ref_res.eval_loss)}
  label = lambda rule: (f"{rule} (identical to float32)" if rule in identical
                        else rule)

  fig, (ax1, ax2) = plt.subplots(1, 2, figsize=(13, 5.2),
                                 layout="constrained")
  for rule, res in results.items():
    ax1.plot(res.eval_steps, res.eval_loss, styles[rule], color=colors[rule],
             label=label(rule), lw=2 if rule == "kahan" else 1.5)
  ax1.axhline(pretrained_loss, color="grey", lw=0.8, ls=":",
              label="pretrained (step 0)")
  ax1.set_xlabel("polish step")
  ax1.set_ylabel("held-out flow-matching loss\n"
                 r"(mean squared velocity error, fixed noise and $t$)")
  ax1.set_title("held-out loss during the polish (bf16 forward; lower is "
                "better)")
  ax1.ticklabel_format(axis="y", useOffset=False)
  ax1.grid(alpha=0.3)
  ax1.legend(title="update rule", fontsize=9)
  # Every rule sees the same batches, so batch-to-batch noise cancels in the
  # difference to the float32 rule's training loss.
  window = 25
  ref = np.asarray(ref_res.train_loss) if ref_res is not None else None
  for rule, res in results.items():
    y = np.asarray(res.train_loss)
    if ref is not None:
      y = y - ref
    if len(y) >= window:
      y = np.convolve(y, np.ones(window) / window, mode="valid")
    x = np.arange(len(res.train_loss) - len(y) + 1, len(res.train_loss) + 1)
    ax2.plot(x, y, styles[rule], color=colors[rule], label=label(rule),
             lw=2 if rule == "kahan" else 1.5)
  ax2.set_xlabel("polish step")
  n_steps = max(len(res.train_loss) for res in results.values())
  mean = f"{window}-step running mean" if n_steps >= window else "per step"
  if ref is not None:
    ax2.axhline(0.0, color="grey", lw=0.8, ls=":")
    ax2.set_title("training loss: difference from float32 master weights\n"
                  "(same batches and noise; > 0: worse than float32)")
    ax2.set_ylabel("training loss − float32 rule's"
                   + f"\n({mean})")
  else:
    ax2.set_title("training loss (same batches and noise)")
    ax2.set_ylabel(f"training loss\n({mean})")
  ax2.grid(alpha=0.3)
  ax2.legend(title="update rule", fontsize=9)
  fig.suptitle(title)
  fig.savefig(path, dpi=110)
  plt.close(fig)


def plot_samples(path: pathlib.Path, samples: dict[str, np.ndarray],
                 title: str) -> None:
  """Samples per model (same noise), their change, and their gap to float32.

  Row 1: the samples. Row 2: ``|sample - sample_pretrained|``, what the polish
  changed. Row 3: ``sample - sample_float32``, where each rule's samples part
  from the float32 master weights' (absent without a float32 rule). Rows 2
  and 3 each share one colour scale across the models, a square-root one (a
  few pixels change by far the most).
  """
  import matplotlib  # pylint: disable=g-import-not-at-top
  matplotlib.use("Agg")
  import matplotlib.pyplot as plt  # pylint: disable=g-import-not-at-top

  def grid(x: np.ndarray, cols: int) -> np.ndarray:
    n, h, w = x.shape[:3]
    rows = n // cols
    x = np.pad(x[: rows * cols, :, :, 0], ((0, 0), (1, 1), (1, 1)),
               constant_values=np.nan)
    return x.reshape(rows, cols, h + 2, w + 2).transpose(0, 2, 1, 3).reshape(
        rows * (h + 2), cols * (w + 2))

  def cmap(name: str, bad: str):
    # bad: the colour of the gaps (NaN) between the digits.
    return matplotlib.colormaps[name].with_extremes(bad=bad)

  def ticks(top: float, signed: bool) -> list[float]:
    # Square-root scale: ticks spread over the decades, not bunched at the top.
    t = [x for x in ((0.05,) if signed else (0.01, 0.05)) + (0.2, 0.5, 1, 2)
         if x <= top * 1.001]
    return ([-x for x in reversed(t)] if signed else []) + [0.0] + t

  def signed_sqrt(x):
    return np.sign(x) * np.sqrt(np.abs(x))

  def reference(ax, text: str) -> None:
    ax.text(0.5, 0.5, text, ha="center", va="center", fontsize=10,
            color="0.35", transform=ax.transAxes, wrap=True)
    for s in ax.spines.values():
      s.set_visible(False)

  names = list(samples)
  base = samples["pretrained"]
  ref = samples.get("float32")
  cols = int(math.sqrt(base.shape[0]))
  n_rows = 3 if ref is not None else 2
  fig, axes = plt.subplots(n_rows, len(names),
                           figsize=(2.9 * len(names) + 1.6, 3.2 * n_rows + 0.8),
                           squeeze=False, layout="constrained")
  change = {k: np.abs(v - base) for k, v in samples.items()}
  change_max = max(float(d.max()) for d in change.values()) or 1.0
  gap = ({k: v - ref for k, v in samples.items()} if ref is not None else {})
  gap_max = max((float(np.abs(d).max()) for d in gap.values()),
                default=0.0) or 1.0
  for j, name in enumerate(names):
    im0 = axes[0, j].imshow(grid(np.clip(samples[name], -1, 1), cols),
                            cmap=cmap("gray_r", "white"), vmin=-1, vmax=1,
                            interpolation="nearest")
    axes[0, j].set_title(name, fontsize=12, fontweight="bold")
    if name == "pretrained":
      reference(axes[1, j], "reference\nfor this row")
    else:
      d = change[name]
      im1 = axes[1, j].imshow(grid(d, cols), cmap=cmap("magma", "0.75"),
                              norm=matplotlib.colors.PowerNorm(
                                  0.5, vmin=0, vmax=change_max),
                              interpolation="nearest")
      axes[1, j].set_title(f"max {d.max():.3g}, mean {d.mean():.3g}",
                           fontsize=9)
    if ref is not None:
      if name == "float32":
        reference(axes[2, j], "reference\nfor this row")
      else:
        d = gap[name]
        m = float(np.abs(d).max())
        im2 = axes[2, j].imshow(grid(d, cols), cmap=cmap("RdBu_r", "0.75"),
                                norm=matplotlib.colors.FuncNorm(
                                    (signed_sqrt, lambda y: np.sign(y) * y**2),
                                    vmin=-gap_max, vmax=gap_max),
                                interpolation="nearest")
        axes[2, j].set_title(
            "max |diff| = 0: identical" if m == 0 else
            f"max |diff| {m:.3g}, mean {np.abs(d).mean():.3g}", fontsize=9,
            fontweight="bold" if m == 0 else "normal")
    for ax in axes[:, j]:
      ax.set_xticks([])
      ax.set_yticks([])
  axes[0, 0].set_ylabel("samples", fontsize=11)
  axes[1, 0].set_ylabel("|sample − pretrained's|\n(what the polish changed)",
                        fontsize=11)
  fig.colorbar(im0, ax=axes[0, :], shrink=0.9, pad=0.01,
               label="pixel value\n(-1 blank, 1 ink)")
  fig.colorbar(im1, ax=axes[1, :], shrink=0.9, pad=0.01,
               ticks=ticks(change_max, signed=False),
               label="|sample − pretrained's|\n(pixel values, square-root "
               "scale)")
  if ref is not None:
    axes[2, 0].set_ylabel("sample − float32's\n(gap to float32 master "
                          "weights)", fontsize=11)
    fig.colorbar(im2, ax=axes[2, :], shrink=0.9, pad=0.01,
                 ticks=ticks(gap_max, signed=True),
                 label="sample − float32's (pixel values,\nsigned "
                 "square-root scale; red: more ink)")
  fig.suptitle(title + "\nsame noise for every model; rows 2 and 3 each on "
               "one colour scale shared by all its panels", fontsize=12)
  fig.savefig(path, dpi=110)
  plt.close(fig)


# ----------------------------------------------------------------------------
# Driver


def _tqdm(it, desc: str, enabled: bool):
  from tqdm.auto import tqdm  # pylint: disable=g-import-not-at-top
  return tqdm(it, desc=desc, disable=not enabled, dynamic_ncols=True,
              leave=True)


def parse_args(argv: Optional[Sequence[str]] = None) -> argparse.Namespace:
  p = argparse.ArgumentParser(
      description=__doc__.split("\n\n")[0],
      formatter_class=argparse.ArgumentDefaultsHelpFormatter)
  p.add_argument("--optimizer", default="adamw", choices=OPTIMIZERS)
  p.add_argument("--lr", type=float, default=None,
                 help="polish learning rate (prodigy: multiplier of d); "
                 f"default per optimizer: {DEFAULT_LR}")
  p.add_argument("--steps", type=int, default=400, help="polish steps")
  p.add_argument("--pretrain-steps", type=int, default=2500)
  p.add_argument("--pretrain-lr", type=float, default=3e-3)
  p.add_argument("--batch-size", type=int, default=64,
                 help="batch size of pretraining and polish")
  p.add_argument("--width", type=int, default=16,
                 help="UNet base channels (the 4x4 level has twice as many)")
  p.add_argument("--rules", default=",".join(RULES),
                 help="comma-separated subset of " + ",".join(RULES))
  p.add_argument("--out", default="outputs/finetune_diffusion")
  p.add_argument("--seed", type=int, default=0)
  p.add_argument("--retrain", action="store_true",
                 help="pretrain even if cached weights exist")
  p.add_argument("--eval-every", type=int, default=20,
                 help="held-out loss every this many polish steps")
  p.add_argument("--num-samples", type=int, default=36)
  p.add_argument("--sample-steps", type=int, default=40,
                 help="Euler steps of the sampler")
  p.add_argument("--no-progress", action="store_true")
  p.add_argument("--blockwise", action="store_true",
                 help="polish with ok.blockwise.blockwise_step: each part's update "
                 "inside the backward pass (Prodigy with lagged_d)")
  args = p.parse_args(argv)
  rules = [r.strip() for r in args.rules.split(",") if r.strip()]
  bad = [r for r in rules if r not in RULES]
  if bad or not rules:
    p.error(f"--rules: unknown {bad}; choose from {','.join(RULES)}")
  args.rules = [r for r in RULES if r in rules]  # canonical order
  if args.blockwise and "stochastic" in args.rules:
    # Its noise keys are folded in per leaf of the whole tree: a group's own
    # leaf indices would draw another noise stream, which blockwise_step
    # refuses as another optimizer.
    args.rules.remove("stochastic")
    print("--blockwise: the stochastic rule is left out (its noise keys are "
          "drawn per leaf of the whole tree; blockwise_step updates groups "
          "of leaves, which would draw others)")
  if args.lr is None:
    args.lr = DEFAULT_LR[args.optimizer]
  return args


def _fmt(x: Optional[float], spec: str) -> str:
  return "n/a" if x is None else format(x, spec)


def format_table(rows: dict[str, dict[str, Any]]) -> str:
  head = (f"{'rule':<11} {'held-out loss':>13} {'vs pretrained':>13} "
          f"{'max|w-w_f32|':>12} {'changed':>8} {'device B/p':>10} "
          f"{'host B/p':>8}")
  lines = [head, "-" * len(head)]
  for name, r in rows.items():
    lines.append(
        f"{name:<11} {r['heldout_loss']:>13.6f} "
        f"{_fmt(r.get('heldout_delta'), '+13.2e'):>13} "
        f"{_fmt(r.get('max_abs_diff_to_float32'), '12.3e'):>12} "
        f"{_fmt(r.get('changed_fraction'), '8.2%'):>8} "
        f"{_fmt(r.get('device_bytes_per_param'), '10.2f'):>10} "
        f"{_fmt(r.get('host_bytes_per_param'), '8.2f'):>8}")
  return "\n".join(lines)


def main(argv: Optional[Sequence[str]] = None) -> dict[str, Any]:
  """Pretrains (or loads), polishes under each rule, writes the outputs.

  Returns:
    The results dict also written to ``results.json``.
  """
  args = parse_args(argv)
  t_start = time.perf_counter()
  out = pathlib.Path(args.out)
  out.mkdir(parents=True, exist_ok=True)
  progress = not args.no_progress
  dev = jax.devices()[0]
  print(f"device: {dev.platform} ({dev.device_kind}); optimizer "
        f"{args.optimizer}, lr {args.lr:g}, {args.steps} polish steps, "
        f"rules {','.join(args.rules)}"
        f"{', blockwise step' if args.blockwise else ''}", flush=True)

  train_np, heldout_np = load_digits_split()
  cfg = PretrainConfig(width=args.width, steps=args.pretrain_steps,
                       lr=args.pretrain_lr, batch_size=args.batch_size,
                       seed=args.seed)
  pretrained, pre_info = pretrain(cfg, train_np, out, retrain=args.retrain,
                                  progress=progress)
  graphdef, _ = model_def(args.width)
  n_params = count_params(pretrained)
  setup = PolishSetup(
      graphdef=graphdef, pretrained=pretrained, train=jnp.asarray(train_np),
      heldout=eval_set(heldout_np), optimizer=args.optimizer, lr=args.lr,
      steps=args.steps, batch_size=args.batch_size, seed=args.seed,
      eval_every=args.eval_every, blockwise=args.blockwise, width=args.width)

  pre_bf16 = to_bf16(pretrained)
  pre_loss = float(heldout_loss(pre_bf16, *setup.heldout, graphdef=graphdef))
  pre_loss_f32 = float(heldout_loss(pretrained, *setup.heldout,
                                    graphdef=graphdef))

  results: dict[str, PolishResult] = {}
  for rule in args.rules:
    results[rule] = polish(rule, setup, progress=progress)

  # Table.
  master = results["float32"].exact if "float32" in results else None
  rows: dict[str, dict[str, Any]] = {
      "pretrained": {"heldout_loss": pre_loss, "heldout_delta": 0.0}}
  for rule, res in results.items():
    rows[rule] = {
        "heldout_loss": res.eval_loss[-1],
        "heldout_delta": res.eval_loss[-1] - pre_loss,
        "max_abs_diff_to_float32": (None if master is None else
                                    max_abs_diff(res.exact, master)),
        "bits_differ_from_float32": (None if master is None else
                                     bits_differ(res.exact, master)),
        "changed_fraction": res.changed_fraction,
        "device_bytes_per_param": res.device_bytes / n_params,
        "host_bytes_per_param": res.host_bytes / n_params,
        "seconds": res.seconds,
    }
  table = format_table(rows)

  # Samples: same noise for every model.
  noise = jax.random.normal(jax.random.key(args.seed + 3000),
                            (args.num_samples, 8, 8, 1), _F32)
  sample_kw = dict(graphdef=graphdef, num_steps=args.sample_steps)
  samples = {"pretrained": np.asarray(sample(pre_bf16, noise, **sample_kw))}
  for rule, res in results.items():
    samples[rule] = np.asarray(sample(res.forward, noise, **sample_kw))

  run = (f"{args.optimizer} lr={args.lr:g}, {args.steps} steps, batch "
         f"{args.batch_size}; bf16 forward pass under every rule")
  plot_loss_curves(
      out / "loss_curves.png", results, pre_loss,
      f"Polish of a pretrained flow-matching UNet ({n_params:,} params) on "
      f"8x8 digits under {len(results)} update rule"
      f"{'s' if len(results) > 1 else ''}\n{run}")
  plot_samples(
      out / "samples.png", samples,
      f"{args.num_samples} samples ({args.sample_steps} Euler steps) of the "
      f"pretrained and polished UNets ({n_params:,} params)\n{run}")

  summary = {
      "command": "python examples/finetune_diffusion.py " + " ".join(
          argv if argv is not None else sys.argv[1:]),
      "args": {k: v for k, v in vars(args).items()},
      "device": f"{dev.platform} ({dev.device_kind})",
      "num_params": n_params,
      "pretrain": {"config": dataclasses.asdict(cfg),
                   "cached": pre_info["cached"],
                   "seconds": pre_info["seconds"],
                   "losses": pre_info["losses"],
                   "heldout_loss_bf16": pre_loss,
                   "heldout_loss_float32": pre_loss_f32},
      "table": rows,
      "curves": {rule: {"train_loss": res.train_loss,
                        "eval_steps": res.eval_steps,
                        "eval_loss": res.eval_loss}
                 for rule, res in results.items()},
      "samples_mean_abs_change_vs_pretrained": {
          k: float(np.mean(np.abs(v - samples["pretrained"])))
          for k, v in samples.items()},
      "seconds_total": time.perf_counter() - t_start,
  }
  (out / "results.json").write_text(json.dumps(summary, indent=1))

  print()
  print(f"{n_params:,} parameters; {args.optimizer} lr={args.lr:g}, "
        f"{args.steps} steps, batch {args.batch_size}; held-out loss with "
        f"bf16 weights (pretrained in float32 forward: {pre_loss_f32:.6f})")
  print(table)
  if "kahan" in rows and master is not None:
    k = rows["kahan"]
    verdict = ("bit-identical to the float32 master weights"
               if k["bits_differ_from_float32"] == 0 else
               f"NOT identical: {k['bits_differ_from_float32']} weights "
               "differ from the float32 master")
    print(f"kahan: {verdict}")
  print("changed = fraction of weights whose bf16 forward value left its "
        "pretrained value at some step; B/p = bytes per parameter of "
        "weights + optimizer state + residuals (host: pinned_host memory)")
  print(f"wrote {out / 'loss_curves.png'}, {out / 'samples.png'}, "
        f"{out / 'results.json'} ({summary['seconds_total']:.0f} s)")
  return summary


if __name__ == "__main__":
  main()

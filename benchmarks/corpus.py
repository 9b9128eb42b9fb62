"""A corpus of optax programs users write around a Flax model.

Optax's aliases, its wrappers with masks and labels given as callables of
the params tree (Flax key paths such as ``['encoder']['dense']['bias']``)
and as trees, global statistics (``clip_by_global_norm``), randomness
(``noisy_sgd``, ``add_noise``), ``optax.contrib``, and this package's
optimizers; a tree to run them on and its gradients. ``tests/
test_same_answer.py`` checks every path of the package against optax's own
program on them; ``benchmarks/exactness.py`` compares a backend with the CPU.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp
import optax

import optax_kahan as ok


def params():
  """A Flax-like tree: an encoder's bf16 dense kernel and bias, norm scale and
  3-D conv kernel, and a float32 head."""
  k = iter(jax.random.split(jax.random.key(3), 8))
  bf = jnp.bfloat16
  return {
      "encoder": {
          "dense": {"kernel": jax.random.normal(next(k), (6, 8), bf),
                    "bias": 0.1 * jax.random.normal(next(k), (8,), bf)},
          "norm": {"scale": 1 + 0.1 * jax.random.normal(next(k), (8,), bf)},
          "conv": {"kernel": jax.random.normal(next(k), (3, 2, 4), bf)},
      },
      "head": {"kernel": jax.random.normal(next(k), (8, 2), jnp.float32),
               "bias": jnp.zeros((2,), jnp.float32)},
  }


def grads(step):
  """Float32 gradients of step ``step``, shaped as ``params()``."""
  return jax.tree.map(
      lambda p: jax.random.normal(jax.random.fold_in(jax.random.key(7), step),
                                  p.shape, jnp.float32) * 0.3, params())


def leaf_name(path):
  """The leaf's name: its last dict key (a stacked leaf unstacked by
  ``per_block`` ends in a tuple index)."""
  return [k.key for k in path if isinstance(k, jax.tree_util.DictKey)][-1]


def decay_mask(params):
  """The usual Flax recipe: no decay on biases and norm scales."""
  return jax.tree_util.tree_map_with_path(
      lambda path, _: leaf_name(path) not in ("bias", "scale"), params)


def by_shape(params):
  return jax.tree.map(lambda p: p.ndim > 1, params)


def labels(params):
  return jax.tree_util.tree_map_with_path(
      lambda path, _: "encoder" if path[0].key == "encoder" else "head",
      params)


BOOL_TREE = jax.tree.map(lambda p: p.ndim > 1, params())
LABEL_TREE = labels(params())

# name -> factory (called fresh for each use)
PROGRAMS = {
    # optax's aliases
    "sgd": lambda: optax.sgd(0.1),
    "sgd(momentum, nesterov)": lambda: optax.sgd(0.1, 0.9, nesterov=True),
    "adam": lambda: optax.adam(1e-2),
    "adamw": lambda: optax.adamw(1e-2, weight_decay=0.1),
    "adamw(mask by path)": lambda: optax.adamw(1e-2, weight_decay=0.5,
                                               mask=decay_mask),
    "adamw(mask by shape)": lambda: optax.adamw(1e-2, weight_decay=0.5,
                                                mask=by_shape),
    "adamw(bool tree)": lambda: optax.adamw(1e-2, weight_decay=0.5,
                                            mask=BOOL_TREE),
    "adamax": lambda: optax.adamax(1e-2),
    "adabelief": lambda: optax.adabelief(1e-2),
    "adadelta": lambda: optax.adadelta(1.0),
    "adafactor": lambda: optax.adafactor(1e-2),
    "adagrad": lambda: optax.adagrad(1e-2),
    "adan": lambda: optax.adan(1e-2),
    "amsgrad": lambda: optax.amsgrad(1e-2),
    "lamb": lambda: optax.lamb(1e-2),
    "lars": lambda: optax.lars(1e-2),
    "lion": lambda: optax.lion(1e-3, weight_decay=0.1),
    "lion(mask by path)": lambda: optax.lion(1e-3, weight_decay=0.5,
                                             mask=decay_mask),
    "nadamw": lambda: optax.nadamw(1e-2),
    "novograd": lambda: optax.novograd(1e-2),
    "radam": lambda: optax.radam(1e-2),
    "rmsprop": lambda: optax.rmsprop(1e-2, momentum=0.9),
    "sm3": lambda: optax.sm3(1e-2),
    "yogi": lambda: optax.yogi(1e-2),
    "noisy_sgd": lambda: optax.noisy_sgd(0.1, key=0),
    # wrappers
    "masked(adam, callable)": lambda: optax.masked(optax.adam(1e-2),
                                                   decay_mask),
    "masked(adam, bool tree)": lambda: optax.masked(optax.adam(1e-2),
                                                    BOOL_TREE),
    "multi_transform(label fn)": lambda: optax.multi_transform(
        {"encoder": optax.adam(1e-2), "head": optax.sgd(0.1)}, labels),
    "multi_transform(label tree)": lambda: optax.multi_transform(
        {"encoder": optax.adam(1e-2), "head": optax.sgd(0.1)}, LABEL_TREE),
    "partition(label fn)": lambda: optax.partition(
        {"encoder": optax.adamw(1e-2), "head": optax.lion(1e-3)}, labels),
    "inject_hyperparams(adamw)": lambda: optax.inject_hyperparams(
        optax.adamw)(learning_rate=1e-2, weight_decay=0.1),
    "MultiSteps(adam, 2)": lambda: optax.MultiSteps(optax.adam(1e-2), 2),
    "apply_if_finite(adam)": lambda: optax.apply_if_finite(optax.adam(1e-2),
                                                           2),
    "named_chain": lambda: optax.named_chain(
        ("clip", optax.clip(1.0)), ("adam", optax.adam(1e-2))),
    "add_decayed_weights(mask) + sgd": lambda: optax.chain(
        optax.add_decayed_weights(0.5, mask=decay_mask), optax.sgd(1.0)),
    # global statistics and randomness
    "clip_by_global_norm + adamw": lambda: optax.chain(
        optax.clip_by_global_norm(0.5), optax.adamw(1e-2)),
    "clip_by_block_rms + adam": lambda: optax.chain(
        optax.clip_by_block_rms(0.1), optax.adam(1e-2)),
    "add_noise + sgd": lambda: optax.chain(optax.add_noise(0.01, 0.55, 0),
                                           optax.sgd(0.1)),
    # contrib
    "contrib.prodigy": lambda: optax.contrib.prodigy(),
    "contrib.schedule_free_adamw": lambda: optax.contrib.schedule_free_adamw(
        1e-2),
    # this package's
    "ok.prodigy": lambda: ok.prodigy(d0=1e-3),
    "ok.prodigy_factored": lambda: ok.prodigy_factored(d0=1e-3),
    "ok.stable_adamw": lambda: ok.stable_adamw(1e-2),
    "ok.per_leaf.chain(ok.per_leaf.clip_by_global_norm, adamw)": lambda: ok.per_leaf.chain(
        ok.per_leaf.clip_by_global_norm(0.5), optax.adamw(1e-2)),
}

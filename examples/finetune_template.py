"""A fine-tuning template: bf16 Flax NNX model, Kahan + Prodigy, orbax resume.

    python examples/finetune_template.py --steps 200 --ckpt-dir /tmp/ft

Trains a small MLP (bfloat16 params) on scikit-learn's bundled digits with
``ok.kahan(ok.prodigy_factored())`` through ``nnx.Optimizer``. Every
``--save-every`` steps (and at the end) orbax saves the params and the whole
optimizer state, the uint16 Kahan residuals (the low 16 bits of the float32
weights) included. Run it again with the same ``--ckpt-dir`` and a larger
``--steps`` and it resumes from the latest checkpoint, bit for bit where an
uninterrupted run would be: restore targets carry each leaf's sharding, memory
kind included, so the residuals go straight back to pinned_host. The batch of
step ``i`` depends only on ``(--seed, i)``. At the end the exact float32
weights, ``kahan_to_float32(params, residuals)``, go to ``--out`` (``.npz``).
Copy it, and swap in your model, data and loss.

Prodigy's first steps: its step size ``d`` starts at ``d0`` (1e-6) and grows
with its estimate of the distance to a solution, by up to ``growth_rate`` a
step (unbounded by default). With the defaults here the loss goes from about
2.4 to about 21 near step 10 while ``d`` overshoots, then falls to about 0.1
by step 200 (the progress bar shows both). To damp the jump, warm the
learning rate up, ``ok.prodigy_factored(learning_rate=optax.linear_schedule(
0.0, 1.0, 50))`` (a lower peak, a similar end), or cap the growth,
``ok.prodigy_factored(growth_rate=1.02)`` (no jump, but ``d`` then needs
hundreds of steps to grow and the descent is slower).
"""

from __future__ import annotations

import argparse
import os
from typing import Any, Optional, Sequence

import jax
import jax.numpy as jnp
import numpy as np
import optax
import orbax.checkpoint as ocp
from flax import nnx
from sklearn.datasets import load_digits
from tqdm import tqdm

import optax_kahan as ok


class MLP(nnx.Module):
  """64 pixels -> hidden -> 10 classes, params and matmuls in bfloat16."""

  def __init__(self, hidden: int, rngs: nnx.Rngs):
    kw = dict(param_dtype=jnp.bfloat16, dtype=jnp.bfloat16, rngs=rngs)
    self.hidden = nnx.Linear(64, hidden, **kw)
    self.out = nnx.Linear(hidden, 10, **kw)

  def __call__(self, x: jax.Array) -> jax.Array:
    return self.out(jax.nn.gelu(self.hidden(x)))


@nnx.jit
def train_step(model: MLP, optimizer: nnx.Optimizer, x: jax.Array,
               y: jax.Array) -> jax.Array:
  def loss_fn(model: MLP) -> jax.Array:
    logits = model(x).astype(jnp.float32)
    return optax.softmax_cross_entropy_with_integer_labels(logits, y).mean()

  loss, grads = nnx.value_and_grad(loss_fn)(model)
  optimizer.update(model, grads)
  return loss


def batch_of(step: int, x: np.ndarray, y: np.ndarray, size: int,
             seed: int) -> tuple[np.ndarray, np.ndarray]:
  """The batch of ``step``: the same in a straight and in a resumed run."""
  idx = np.random.default_rng((seed, step)).integers(0, len(x), size)
  return x[idx], y[idx]


def flat(tree: Any) -> dict[str, np.ndarray]:
  """An NNX state (or any tree) as ``{"hidden/kernel": array}``, on the host."""
  leaves = jax.tree_util.tree_leaves_with_path(nnx.to_pure_dict(tree))
  return {"/".join(str(getattr(k, "key", k)) for k in path):
          np.asarray(jax.device_get(v)) for path, v in leaves}


def abstract(tree: Any) -> Any:
  """Restore targets: shape, dtype and sharding (with its memory kind)."""
  return jax.tree.map(
      lambda a: jax.ShapeDtypeStruct(a.shape, a.dtype, sharding=a.sharding),
      tree)


def parse_args(argv: Optional[Sequence[str]] = None) -> argparse.Namespace:
  p = argparse.ArgumentParser(
      description=__doc__.splitlines()[0],
      formatter_class=argparse.ArgumentDefaultsHelpFormatter)
  p.add_argument("--steps", type=int, default=200, help="total steps")
  p.add_argument("--batch", type=int, default=64)
  p.add_argument("--hidden", type=int, default=64)
  p.add_argument("--seed", type=int, default=0)
  p.add_argument("--ckpt-dir", default="outputs/finetune_template/ckpt")
  p.add_argument("--save-every", type=int, default=50)
  p.add_argument("--out", default="outputs/finetune_template/float32.npz")
  return p.parse_args(argv)


def main(argv: Optional[Sequence[str]] = None) -> dict[str, Any]:
  """Trains (resuming if it can); returns the state and the float32 export."""
  args = parse_args(argv)
  digits = load_digits()
  x_all = (digits.data / 16.0).astype(np.float32)
  y_all = digits.target.astype(np.int32)

  model = MLP(args.hidden, nnx.Rngs(args.seed))
  # nnx.Optimizer with the model's state and its step counter committed to
  # the device (kahan's residuals are committed): the step compiles once.
  optimizer = ok.kahan_nnx_optimizer(model, ok.kahan(ok.prodigy_factored()),
                                     wrt=nnx.Param)

  mngr = ocp.CheckpointManager(
      os.path.abspath(args.ckpt_dir),
      options=ocp.CheckpointManagerOptions(max_to_keep=2))
  state = lambda: {"model": nnx.state(model), "optimizer": nnx.state(optimizer)}
  start = mngr.latest_step() or 0
  if start:  # resume: params and the whole optimizer state, residuals included
    got = mngr.restore(start, args=ocp.args.StandardRestore(abstract(state())))
    # orbax makes its arrays with jax.make_array_from_callback, whose type says
    # device memory even under a pinned_host sharding: place them once more,
    # or the step sees device residuals (warns, and keeps them there).
    got = jax.tree.map(lambda a: jax.device_put(a, jax.memory.Space.Host)
                       if a.sharding.memory_kind == "pinned_host" else a, got)
    nnx.update(model, got["model"])
    nnx.update(optimizer, got["optimizer"])

  bar = tqdm(range(start, args.steps), initial=start, total=args.steps)
  for step in bar:
    loss = train_step(model, optimizer,
                      *batch_of(step, x_all, y_all, args.batch, args.seed))
    bar.set_postfix(loss=f"{float(loss):.4f}",
                    d=f"{float(ok.prodigy_d(optimizer.opt_state)):.3g}")
    done = step + 1
    if done % args.save_every == 0 or done == args.steps:
      mngr.save(done, args=ocp.args.StandardSave(state()))
  mngr.wait_until_finished()
  mngr.close()

  params = nnx.state(model, nnx.Param)
  residuals = ok.kahan_residuals(optimizer.opt_state)
  export = flat(ok.kahan_to_float32(params, residuals))
  os.makedirs(os.path.dirname(os.path.abspath(args.out)), exist_ok=True)
  np.savez(args.out, **export)
  logits = model(jnp.asarray(x_all)).astype(jnp.float32)
  loss = float(optax.softmax_cross_entropy_with_integer_labels(
      logits, y_all).mean())
  accuracy = float(jnp.mean(jnp.argmax(logits, -1) == y_all))
  print(f"step {args.steps}: loss {loss:.4f}, accuracy {accuracy:.2%} on "
        f"all {len(y_all)} digits (the training set); wrote the float32 "
        f"weights to {os.path.abspath(args.out)}")
  return {"model": model, "optimizer": optimizer, "start": start,
          "params": flat(params), "residuals": flat(residuals),
          "float32": export, "loss": loss, "accuracy": accuracy}


if __name__ == "__main__":
  main()

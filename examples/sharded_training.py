"""FSDP-style training with Kahan residuals sharded like their params.

    python examples/sharded_training.py

Runs on 8 fake CPU devices (set below, before JAX starts); on a machine with
8 accelerators, drop the XLA_FLAGS line. Each residual takes its bf16 param's
sharding and lives in the host memory (pinned_host) of the device that owns
that shard; ``kahan(optax.adamw)`` is elementwise, so the step needs no
collective and gives bit for bit the single-device result.
"""

import os

os.environ.setdefault("XLA_FLAGS", "--xla_force_host_platform_device_count=8")

import jax  # noqa: E402
import jax.numpy as jnp  # noqa: E402
import optax  # noqa: E402
from jax.sharding import AxisType, NamedSharding, PartitionSpec as P  # noqa: E402

import optax_kahan as ok  # noqa: E402


def main() -> None:
  mesh = jax.make_mesh((jax.device_count(),), ("fsdp",),
                       axis_types=(AxisType.Explicit,))
  with jax.set_mesh(mesh):
    shard = lambda x: jax.device_put(x, NamedSharding(mesh, P("fsdp")))
    params = {"w": shard(jnp.ones((256, 128), jnp.bfloat16)),
              "b": shard(jnp.zeros(128, jnp.bfloat16))}
    tx = ok.kahan(optax.adamw(1e-4))
    opt_state = jax.jit(tx.init)(params)

    @jax.jit
    def train_step(params, opt_state, grads):
      updates, opt_state = tx.update(grads, opt_state, params)
      return optax.apply_updates(params, updates), opt_state

    grads = jax.tree.map(lambda p: jnp.full_like(p, 1e-3), params)
    for _ in range(3):
      params, opt_state = train_step(params, opt_state, grads)
    residual = ok.kahan_residuals(opt_state)["w"]
    exact = ok.kahan_to_float32(params, ok.kahan_residuals(opt_state))["w"]
    print(f"devices: {jax.device_count()}")
    print(f"residual sharding: {residual.sharding.spec}, "
          f"memory kind: {residual.sharding.memory_kind}")
    w, x = jax.device_get((params["w"], exact))  # to numpy, off the mesh
    print(f"bf16 weight: {float(w[0, 0])}, exact float32 weight: "
          f"{float(x[0, 0]):.9f}")


if __name__ == "__main__":
  main()

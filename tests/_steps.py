"""A few donated, jitted kahan steps on host residuals, shared by the tests
that compare the GPU form of a chain, forced on the CPU, with the CPU form."""

import functools

import jax
import optax

import optax_kahan as ok


def commit(tree):
  """``tree`` committed to the first device, as restored or sharded params
  are (``kahan``'s offloaded residuals are committed arrays; with
  uncommitted params a jitted step compiles twice, and ``kahan`` warns)."""
  return jax.device_put(tree, jax.devices()[0])


def train(tx, params, grads_fn, steps):
  """``steps`` jitted update + apply steps with params and state donated.

  Asserts that the residuals end in host memory; returns the exact float32
  weights and the final state.
  """
  state = tx.init(params)

  @functools.partial(jax.jit, donate_argnums=(0, 1))
  def step(params, state, grads):
    updates, state = tx.update(grads, state, params)
    return optax.apply_updates(params, updates), state

  for i in range(steps):
    params, state = step(params, state, grads_fn(params, i))
  residuals = ok.kahan_residuals(state)
  assert all(r.sharding.memory_kind == "pinned_host"
             for r in jax.tree.leaves(residuals))
  return ok.kahan_to_float32(params, residuals), state

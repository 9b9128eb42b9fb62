"""A known-answer check of ``kahan`` on the backend that runs it.

The only GPU run so far (an H200, jax 0.11.2) moved every bf16 weight and
dropped every residual: plain bf16 training, silently. Run this first on a
new backend; see docs/guides/troubleshooting.md.
"""

from typing import Any, Callable, Optional

import jax
import jax.numpy as jnp
import numpy as np
import optax

from optax_kahan._src.alias import prodigy_factored
from optax_kahan._src.blockwise.model import BlockwiseModel
from optax_kahan._src.blockwise.model import BlockwiseParams
from optax_kahan._src.blockwise.model import num_blocks
from optax_kahan._src.blockwise.step import blockwise_init
from optax_kahan._src.blockwise.step import blockwise_loss
from optax_kahan._src.blockwise.step import blockwise_step
from optax_kahan._src.blockwise.streaming import join_stacks
from optax_kahan._src.blockwise.streaming import stream_blocks
from optax_kahan._src.blockwise.streaming import STREAMING_COMPILER_OPTIONS
from optax_kahan._src.kahan import kahan
from optax_kahan._src.kahan import kahan_from_float32
from optax_kahan._src.kahan import kahan_residuals
from optax_kahan._src.kahan import kahan_to_float32

# The bound against optax's float32 program: ulps of |old| + |new| (the rows
# are compiled apart from it); a lost residual misses by about 2**16.
ULPS = 4
PROGRAMS = {"adamw": lambda: optax.adamw(1e-2, weight_decay=0.1),
            "prodigy_factored": lambda: prodigy_factored(d0=1e-3)}


def _normal(key: int, *shape: int) -> np.ndarray:
  """Made on the CPU (another backend may round ``erf_inv`` otherwise)."""
  with jax.default_device(jax.devices("cpu")[0]):
    return np.asarray(jax.random.normal(jax.random.key(key), shape))


def _float32_tree() -> dict[str, Any]:
  """Float32 weights of mixed shapes: 1-D bias and scale, 2-D kernel, 4-D
  conv kernel, and a head that stays float32."""
  return {"conv": {"kernel": _normal(1, 3, 3, 2, 4)},
          "dense": {"kernel": _normal(2, 8, 6), "bias": 0.1 * _normal(3, 6)},
          "norm": {"scale": 1 + 0.1 * _normal(4, 6)},
          "head": {"kernel": _normal(5, 6, 2)}}


def _grads(step: int, like: Any) -> Any:
  return jax.tree.map(lambda x: 0.3 * _normal(100 + step, *x.shape), like)


def _split(x32: Any, offload: bool) -> tuple[Any, Any]:
  """bf16 weights with non-zero residuals; the head float32, no residual."""
  params, residuals = kahan_from_float32(x32, offload=offload)
  params["head"], residuals["head"] = x32["head"], {"kernel": None}
  return params, residuals


def _first_difference(got: Any, want: Any) -> Optional[str]:
  """The first leaf whose bits differ, with how many elements do."""
  for (path, a), b in zip(jax.tree_util.tree_flatten_with_path(got)[0],
                          jax.tree.leaves(want), strict=True):
    a, b = (np.asarray(t).reshape(-1) for t in (a, b))
    bytes_of = lambda t: t.view(np.uint8).reshape(t.size, -1)
    differ = (bytes_of(a) != bytes_of(b)).any(axis=1)
    if differ.any():
      return f"{jax.tree_util.keystr(path)} ({int(differ.sum())} elements)"
  return None


def _ulps(got: Any, want: Any, old: Any) -> tuple[float, str]:
  """The largest error in float32 ulps of ``|old| + |want|``, and its leaf."""
  worst, where = 0.0, ""
  for (path, g), w, o in zip(jax.tree_util.tree_flatten_with_path(got)[0],
                             jax.tree.leaves(want), jax.tree.leaves(old)):
    g, w, o = (np.asarray(a, np.float32) for a in (g, w, o))
    err = float(np.max(np.abs(g - w) / np.spacing(np.abs(w) + np.abs(o))))
    if not err <= worst:
      worst, where = err, jax.tree_util.keystr(path)
  return worst, where


def _tree_steps(name: str, offload: bool, steps: int, device: Any
                ) -> list[dict]:
  """``steps`` of ``kahan`` on ``device``: each step's bf16 weights and
  residuals, its merged weights, and its inputs' merged weights and state."""
  tx = kahan(PROGRAMS[name](), offload=offload)
  with jax.default_device(device):
    params, residuals = _split(jax.device_put(_float32_tree(), device),
                               offload)
    state = tx.init(params, residuals)
    step = jax.jit(tx.update)
    out = []
    for i in range(steps):
      x_old = kahan_to_float32(params, kahan_residuals(state))
      inner_old = state.inner_state
      u, state = step(jax.device_put(_grads(i, params), device), state,
                      params)
      params = optax.apply_updates(params, u)
      out.append({"weights": params, "residuals": kahan_residuals(state),
                  "merged": kahan_to_float32(params, kahan_residuals(state)),
                  "x_old": x_old, "inner_old": inner_old})
  return jax.tree.map(np.asarray, out)


def _model() -> tuple[BlockwiseModel, Any]:
  """Two blocks of width 8, an embedding and a head; float32 weights."""
  model = BlockwiseModel(
      embed=lambda p, x: (jnp.tanh(x @ p["w"] + p["b"]), ()),
      blocks=(lambda p, h, _: h + jnp.tanh(h @ p["w"] * p["scale"]),),
      head=lambda p, h, _, x: jnp.mean(
          ((h @ p["w"]).astype(jnp.float32) - x[:, :2]) ** 2))
  return model, BlockwiseParams(
      embed={"w": 0.5 * _normal(6, 4, 8), "b": 0.5 * _normal(7, 8)},
      stacks=({"w": 0.5 * _normal(8, 2, 8, 8),
               "scale": 1 + 0.5 * _normal(9, 2, 8)},),
      head={"w": 0.5 * _normal(10, 8, 2)})


def _blockwise_step(streamed: bool, device: Any) -> dict:
  """One ``blockwise_step`` of ``kahan(adamw)``, residuals in host memory
  (and the last block's weights and state streamed): new bf16 weights,
  residuals and merged weights, stacks joined back."""
  model, x32 = _model()
  tx = kahan(PROGRAMS["adamw"]())
  batch = _normal(19, 3, 4)
  with jax.default_device(device):
    params, residuals = kahan_from_float32(jax.device_put(x32, device))
    state = blockwise_init(tx, params, residuals)
    run = model
    if streamed:
      run, params, state = stream_blocks(model, params, state, (1,))
    step = jax.jit(blockwise_step, static_argnums=(0, 1),
                   compiler_options=STREAMING_COMPILER_OPTIONS)
    _, params, state = step(run, tx, params, state,
                            jax.device_put(batch, device))
    residuals = kahan_residuals(state)
    if streamed:
      params, residuals = (join_stacks(run, t)[1] for t in (params,
                                                             residuals))
    out = {"weights": params, "residuals": residuals,
           "merged": kahan_to_float32(params, residuals)}
  return jax.tree.map(np.asarray, out)


def _unstacked(tree: BlockwiseParams) -> BlockwiseParams:
  return tree._replace(stacks=tuple(
      tuple(jax.tree.map(lambda x, b=b: x[b], s) for b in range(num_blocks(s)))
      for s in tree.stacks))


def _blockwise_optax() -> tuple[Any, Any]:
  """optax's float32 answer to ``_blockwise_step``, on the CPU: the blocks as
  separate leaves, the gradients of the bf16 forward pass."""
  model, x32 = _model()
  batch = _normal(19, 3, 4)
  with jax.default_device(jax.devices("cpu")[0]):
    params, residuals = kahan_from_float32(x32, offload=False)
    x = kahan_to_float32(params, residuals)
    grads = jax.grad(lambda p: blockwise_loss(model, p, batch))(params)
    tx = PROGRAMS["adamw"]()
    u, _ = tx.update(_unstacked(jax.tree.map(lambda g: g.astype(
        jnp.float32), grads)), tx.init(_unstacked(x)), _unstacked(x))
    return optax.apply_updates(_unstacked(x), u), _unstacked(x)


def _check(case: str, got: dict, cpu: dict, want: Any, old: Any,
           failures: list[str]) -> float:
  """Compares one step with the CPU's (bit for bit) and with optax's (in
  ulps); the failures named in ``failures``; returns the ulps."""
  for part in ("weights", "residuals"):
    diff = _first_difference(got[part], cpu[part])
    if diff:
      failures.append(f"{case}: the {part} differ from the CPU's at {diff}")
  ulps, where = _ulps(got["merged"], want, old)
  if not ulps <= ULPS:
    failures.append(f"{case}: the float32 weights are {ulps:.3g} ulps from "
                    f"optax's at {where} (at most {ULPS}; a lost residual: "
                    "about 65536)")
  return ulps


def known_answer_check(
    device: Optional[Any] = None, *, steps: int = 2,
    report: Callable[[str], None] = print,
) -> list[str]:
  """Runs ``kahan`` steps on ``device`` and checks them against known answers.

  On a small tree of mixed shapes (bf16 1-D bias and scale, 2-D kernel, 4-D
  conv kernel, a float32 head), starting from float32 weights with non-zero
  residuals, ``steps`` steps of ``kahan(optax.adamw)`` and
  ``kahan(prodigy_factored())``, residuals in host memory and on the device;
  and one ``blockwise_step`` of ``kahan(optax.adamw)`` on a two-block model,
  residuals in host memory, and with its last block streamed
  (``stream_blocks``). Each step's bf16 weights and uint16 residuals must
  equal, bit for bit, the same step computed on the CPU in this process, and
  its exact float32 weights ``merge(p, lo)`` must be within ``ULPS`` float32
  ulps of ``|old| + |new|`` of optax's own float32 step from the same
  weights and state (teacher-forced), which a dropped residual misses by
  about ``2**16``. Under a minute on 2 CPU cores, mostly compiling.

  Args:
    device: the device to check (default: ``jax.devices()[0]``).
    steps: steps of each tree case.
    report: called with each case's line as it is checked.

  Returns:
    One line per case.

  Raises:
    AssertionError: naming every case, part and first leaf that differs.

  Example:
    >>> lines = known_answer_check(report=lambda line: None)
    >>> len(lines)
    6
  """
  device = jax.devices()[0] if device is None else device
  cpu = jax.devices("cpu")[0]
  # On the CPU itself, its run is the CPU's: only optax's answer is checked.
  devices = [device] if device == cpu else [device, cpu]
  lines, failures = [], []

  def done(case, ulps):
    same = "on the CPU" if device == cpu else "bits as the CPU's"
    lines.append(f"{case}: {same}, at most {max(ulps):.1f} ulps from optax")
    report(lines[-1])

  for name in PROGRAMS:
    for offload in (True, False):
      runs = [_tree_steps(name, offload, steps, d) for d in devices]
      case = (f"kahan({name}), residuals "
              f"{'in host memory' if offload else 'on the device'}")
      ref = jax.jit(PROGRAMS[name]().update)  # on the CPU's arrays
      ulps = []
      for i, (got, cpu_step) in enumerate(zip(runs[0], runs[-1])):
        x, s = (jax.device_put(cpu_step[k], cpu)
                for k in ("x_old", "inner_old"))
        u, _ = ref(jax.device_put(_grads(i, x), cpu), s, x)
        ulps.append(_check(f"{case}, step {i}", got, cpu_step,
                           optax.apply_updates(x, u), x, failures))
      done(case, ulps)
  want, old = _blockwise_optax()
  for streamed in (False, True):
    case = ("blockwise_step(kahan(adamw)), residuals in host memory"
            + (", last block streamed" if streamed else ""))
    runs = [{k: _unstacked(v) for k, v in run.items()}
            for run in (_blockwise_step(streamed, d) for d in devices)]
    done(case, [_check(case, runs[0], runs[-1], want, old, failures)])
  if failures:
    raise AssertionError(
        f"kahan on {device.device_kind} ({jax.default_backend()}, jax "
        f"{jax.__version__}) is not exact:\n  " + "\n  ".join(failures))
  return lines

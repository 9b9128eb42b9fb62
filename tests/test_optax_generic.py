"""optax's own generic optimizer tests, imported from the installed wheel.

An integration test pinned to the optax release it was written for
(``OPTAX_VERSION``): it reads optax's private test module and replaces its
private ``_get_opt_factory``, which another release may change; with any
other optax it is skipped, saying so, or fails where
``OPTAX_KAHAN_REQUIRE_OPTAX_TESTS=1`` (CI sets it).

``optax/contrib/_common_test.py`` checks every contributed optimizer the same
way: extra arguments and no recompilation, ``tree_map_params``, convergence on
four small problems (30,000 steps), ``inject_hyperparams``, dtype
preservation, ``MultiSteps`` and dtype/shape stability under ``lax.cond``. The
tests are not copied: absl's ``parameterized`` keeps each undecorated test
function as ``__wrapped__`` of its generated cases, and this module calls it
with this package's optimizers in place of optax's (by patching the module's
``_get_opt_factory``, which maps a name to a factory).

Where an assumption does not apply:

* ``kahan(...)`` and ``stochastic_rounding(...)`` return float32 deltas on
  bf16 params (so that ``optax.apply_updates`` lands exactly; see ``kahan``),
  so ``test_preserve_dtype`` on bf16 and ``test_state_shape_dtype_shard_
  stability`` (whose ``lax.cond`` returns the params in place of the updates)
  are run for the named optimizers only. ``kahan`` also refuses float16
  params by design.
* The convergence test's problems are float32: inside ``kahan`` every leaf
  is then a wide leaf with no residual, so that test checks the wrapper's
  plumbing, not the bf16 arithmetic (``test_kahan.py`` does that).
* ``slice_p`` sets the state's shapes, so it cannot be injected, and the
  ``inject_hyperparams`` test injects every numeric argument of the factory's
  signature, defaults included. ``b1 = 0`` leaves the first-moment buffer
  out, which an injected ``b1`` traced by ``jax.jit(init)`` cannot (the step
  is still the reference's, but the state has one more buffer than the
  plain optimizer's, which the test compares). It gets the factory with both
  left out of its signature (fixed at their defaults), as a user passes
  ``static_args=("slice_p", "b1")``.
* ``prodigy_factored`` has no first moment and clips each leaf's update to
  RMS 1: with a constant rate its steps stay about ``d`` long and circle the
  minimum of optax's tiny problems instead of settling within 3e-2. Its
  rows run with a cosine decay of the rate (a schedule, which the factory
  accepts). So do ``prodigy``'s: with a constant rate it circles
  Rosenbrock's minimum too, and whether it ends within 3e-2 after 30,000
  steps depends on the last bit of one step (measured: a one-ulp change of
  ``d`` near step 1,000, from XLA fusing the sums differently, moved the end
  point from y = 0.997 to 0.914).
"""

from __future__ import annotations

import inspect
import os
from unittest import mock

import jax
import jax.numpy as jnp
import optax
import pytest
from absl.testing import parameterized

OPTAX_VERSION = "0.2.8"
if optax.__version__ != OPTAX_VERSION:
  _why = (f"optax's private generic tests are read as of optax "
          f"{OPTAX_VERSION}, not {optax.__version__}")
  if os.environ.get("OPTAX_KAHAN_REQUIRE_OPTAX_TESTS") == "1":  # CI sets it
    raise RuntimeError(_why + ": update OPTAX_VERSION and the adapter")
  pytest.skip(_why, allow_module_level=True)

from optax.contrib import _common_test as common  # noqa: E402

import optax_kahan as ok  # noqa: E402

# optax's tests make uncommitted params (kahan warns: a second compilation)
# and run Prodigy on bf16 params with d0 = 1e-6 (it warns: the run stalls,
# which these dtype and plumbing checks do not mind).
# An integration test: in the slow suite (pytest -m slow), with CI.
pytestmark = [pytest.mark.slow, pytest.mark.filterwarnings(
    "ignore::optax_kahan.OptaxKahanWarning")]

FACTORIES = {
    "prodigy": ok.prodigy,
    "prodigy_factored": ok.prodigy_factored,
    "stable_adamw": ok.stable_adamw,
    "kahan_prodigy_factored":
        lambda learning_rate=1.0: ok.kahan(ok.prodigy_factored(learning_rate)),
    "stochastic_rounding_adamw": lambda learning_rate=1e-2: (
        ok.stochastic_rounding(optax.adamw(learning_rate),
                               jax.random.key(0))),
}
NAMED = ("prodigy", "prodigy_factored", "stable_adamw")
DECAY = optax.cosine_decay_schedule(1.0, 30_000)
KWARGS = {"prodigy": {"learning_rate": DECAY},
          "prodigy_factored": {"learning_rate": DECAY},
          "stable_adamw": {"learning_rate": 1e-2},
          "kahan_prodigy_factored": {"learning_rate": DECAY},
          "stochastic_rounding_adamw": {"learning_rate": 1e-2}}


def _static(factory, names=("slice_p", "b1")):
  """``factory`` with ``names`` out of its signature (for inject tests)."""
  sig = inspect.signature(factory)

  def wrapped(*args, **kwargs):
    return factory(*args, **kwargs)

  wrapped.__signature__ = sig.replace(
      parameters=[p for p in sig.parameters.values() if p.name not in names])
  return wrapped


def _factory(name):
  return FACTORIES[name] if name in FACTORIES else common._get_opt_factory(
      name)


def _original(test_name):
  """The undecorated optax test ``test_name`` (absl keeps it as __wrapped__)."""
  for attr in dir(common.ContribTest):
    fn = getattr(common.ContribTest, attr)
    wrapped = getattr(fn, "__wrapped__", None)
    if wrapped is not None and wrapped.__name__ == test_name:
      return wrapped
  raise LookupError(f"optax's ContribTest has no {test_name}")


def _case(name, **extra):
  return dict(opt_name=name, opt_kwargs=KWARGS[name], wrapper_name=None,
              wrapper_kwargs=None, **extra)


class OptaxGenericTest(parameterized.TestCase):
  """optax's ContribTest bodies, run on this package's optimizers."""

  def run_optax_test(self, test_name, factory=_factory, **kwargs):
    with mock.patch.object(common, "_get_opt_factory", factory):
      _original(test_name)(self, **kwargs)

  @parameterized.product(name=sorted(FACTORIES), wrap=[False])
  def test_optimizers_accept_extra_args(self, name, wrap):
    self.run_optax_test("test_optimizers_accept_extra_args",
                        **_case(name, wrap=wrap))

  @parameterized.product(
      name=sorted(FACTORIES),
      target=("_setup_parabola", "_setup_rosenbrock",
              "_setup_matrix_parabola", "_setup_mixed_tensor_target"))
  def test_optimizers(self, name, target):
    self.run_optax_test("test_optimizers", **_case(
        name, target=getattr(common, target), dtype="float32"))

  @parameterized.product(name=sorted(FACTORIES))
  def test_optimizers_can_be_wrapped_in_inject_hyperparams(self, name):
    self.run_optax_test(
        "test_optimizers_can_be_wrapped_in_inject_hyperparams",
        factory=lambda n: _static(_factory(n)),
        opt_name=name, opt_kwargs=KWARGS[name])

  @parameterized.product(name=NAMED, dtype=("bfloat16", "float32"))
  def test_preserve_dtype(self, name, dtype):
    self.run_optax_test("test_preserve_dtype", opt_name=name,
                        opt_kwargs=KWARGS[name], dtype=dtype)

  @parameterized.product(name=sorted(FACTORIES), dtype=("bfloat16",
                                                        "float32"))
  def test_gradient_accumulation(self, name, dtype):
    self.run_optax_test("test_gradient_accumulation", opt_name=name,
                        opt_kwargs=KWARGS[name], dtype=dtype)

  @parameterized.product(name=NAMED, dtype=(jnp.float16, jnp.bfloat16,
                                            jnp.float32, jnp.float64))
  def test_state_shape_dtype_shard_stability(self, name, dtype):
    self.run_optax_test("test_state_shape_dtype_shard_stability",
                        **_case(name, dtype=dtype))

  @parameterized.product(name=NAMED)
  def test_optimizers_accept_learning_rate_schedule_if_type_annotated_as_such(
      self, name):
    self.run_optax_test(
        "test_optimizers_accept_learning_rate_schedule_if_type_annotated_as_"
        "such", **_case(name))


def test_named_optimizers_are_annotated_for_schedules():
  # optax's schedule test above skips itself unless it sees the annotation.
  for name in NAMED:
    ann = inspect.signature(FACTORIES[name]).parameters["learning_rate"]
    assert ann.annotation is optax.ScalarOrSchedule, name


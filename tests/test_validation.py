"""The shared checks: each names the argument, leaf or path at fault."""

import jax
import jax.numpy as jnp
import optax
import pytest
from flax.core import FrozenDict

import optax_kahan as ok
from optax_kahan._src import validation


def test_tree_mismatch_names_the_first_path_and_the_node_types():
  a = {"enc": {"w": jnp.ones(2), "b": jnp.ones(2)}, "dec": {"w": jnp.ones(2)}}
  assert validation.tree_mismatch(a, a) is None
  frozen = {"enc": FrozenDict(a["enc"]), "dec": a["dec"]}
  assert validation.tree_mismatch(a, frozen, names=("p", "q")) == (
      "at ['enc']: p has a dict with ['b'], ['w'], q has a FrozenDict with "
      "['b'], ['w']")
  missing = {"enc": {"w": jnp.ones(2)}, "dec": a["dec"]}
  assert "at ['enc']" in validation.tree_mismatch(a, missing)
  leaf_vs_node = {"enc": jnp.ones(2), "dec": a["dec"]}
  assert "a leaf" in validation.tree_mismatch(a, leaf_vs_node)


def test_check_real_names_the_complex_leaf():
  validation.check_real("f", {"x": jnp.ones(2)})
  with pytest.raises(TypeError, match=r"f: leaf \['z'\] is complex64"):
    validation.check_real("f", {"x": jnp.ones(2), "z": jnp.ones(2, "complex64")})


def test_check_state_says_to_pass_the_whole_state():
  validation.check_state("tx", (1,), tuple)
  with pytest.raises(TypeError, match="tx.update got a state of type list"):
    validation.check_state("tx", [1], tuple)


def test_static_zero_sees_python_and_concrete_zeros_only():
  assert validation.is_static_zero(0) and validation.is_static_zero(0.0)
  assert validation.is_static_zero(jnp.asarray(0.0))
  assert not validation.is_static_zero(0.9)
  seen = []
  jax.jit(lambda b: seen.append(validation.is_static_zero(b)))(0.0)
  assert seen == [False]  # traced: unknown


def test_low_precision_hyperparameters_warn_by_name():
  assert validation.is_narrow_float(jnp.bfloat16)
  assert not validation.is_narrow_float(jnp.float32)
  assert not validation.is_narrow_float(jnp.int8)
  validation.warn_low_precision_hyperparams("f", b2=0.999,
                                            eps=jnp.float32(1e-8))
  with pytest.warns(UserWarning, match="hyperparameter b2 is bfloat16"):
    validation.warn_low_precision_hyperparams("f", b2=jnp.bfloat16(0.999))


def test_range_checks_name_the_argument():
  with pytest.raises(ValueError, match="b1 must be in"):
    validation.check_beta("b1", 1.0)
  with pytest.raises(ValueError, match="d0 must be > 0"):
    validation.check_positive("d0", 0.0)
  validation.check_positive("wd", 0.0, allow_zero=True)
  validation.check_beta("b1", jnp.asarray(2.0))  # arrays: not checkable here


P = {"w": jnp.ones((4, 4), jnp.bfloat16)}

# A mistake at a public entry point -> (exception, what the message says).
MISTAKES = {
    "kahan(optax.adamw)": (lambda: ok.kahan(optax.adamw), TypeError,
                           r"kahan: inner must be .* call it"),
    "kahan(None)": (lambda: ok.kahan(None), TypeError,
                    "kahan: inner must be an optax GradientTransformation"),
    "kahan(offload='yes')": (
        lambda: ok.kahan(optax.sgd(1.0), offload="yes"), TypeError,
        "kahan: offload must be True or False"),
    "leafwise(optax.adamw)": (lambda: ok.leafwise(optax.adamw), TypeError,
                              r"leafwise: tx must be .* call it"),
    "stochastic_rounding(key=42)": (
        lambda: ok.stochastic_rounding(optax.sgd(1.0), 42), TypeError,
        r"stochastic_rounding: key must be a JAX PRNG key, e\.g\."),
    "stochastic_round(key=None)": (
        lambda: ok.stochastic_round(jnp.ones(3), None), TypeError,
        "stochastic_round: key must be a JAX PRNG key"),
    "merge_float32(shapes)": (
        lambda: ok.merge_float32(jnp.ones(3, jnp.bfloat16),
                                 jnp.zeros(4, jnp.uint16)), ValueError,
        r"merge_float32: hi has shape \[3\] and lo \[4\]"),
    "kahan_to_float32(params, state)": (
        lambda: ok.kahan_to_float32(
            P, ok.kahan(optax.sgd(1.0), offload=False).init(P)),
        ValueError, r"optimizer state .* ok\.kahan_residuals\(opt_state\)"),
    "num_blocks({})": (lambda: ok.blockwise.num_blocks({}), ValueError,
                       "num_blocks: a stack is a tree .* no leaves"),
    "join_stacks(None, params)": (
        lambda: ok.blockwise.join_stacks(None, P), TypeError,
        "join_stacks: model must be the BlockwiseModel"),
    "blockwise_init(tx=optax.adamw)": (
        lambda: ok.blockwise.blockwise_init(optax.adamw, None), TypeError,
        r"blockwise_init: tx must be .* call it"),
    "per_block(optax.adamw, 0)": (
        lambda: ok.blockwise.per_block(optax.adamw, 0), TypeError,
        r"per_block: tx must be .* call it"),
    "stream_blocks(state={})": (
        lambda: ok.blockwise.stream_blocks(*_blockwise()[:2], {}, (1,)),
        TypeError, "stream_blocks: state must be the BlockwiseState"),
    "with_front_buffers(other tree)": (
        lambda: ok.blockwise.with_front_buffers({"w": jnp.ones(2)},
                                                {"v": jnp.ones(2)}),
        ValueError, r"values must be laid out as front_buffers\(layout\); "
        r"at <root>: layout has a dict with \['w'\]"),
    "nnx_blockwise(1, ...)": (
        lambda: ok.blockwise.nnx_blockwise(1, (), 3), TypeError,
        "nnx_blockwise: embed must be an nnx.Module, got int"),
    "linen_apply(3)": (lambda: ok.blockwise.linen_apply(3), TypeError,
                       "linen_apply: module must be a flax.linen Module"),
    "kahan_nnx_optimizer(3, ...)": (
        lambda: ok.kahan_nnx_optimizer(3, ok.kahan(optax.sgd(1.0)), wrt=None),
        TypeError, "kahan_nnx_optimizer: model must be an nnx.Module"),
    "prodigy_factored(state_dtype='x')": (
        lambda: ok.prodigy_factored(state_dtype="x"), TypeError,
        "state_dtype must be a floating dtype"),
    "stochastic_round_apply_updates(other tree)": (
        lambda: ok.stochastic_round_apply_updates(
            P, {"v": jnp.ones((4, 4))}, jax.random.key(0)), ValueError,
        r"updates do not match the params' tree: at <root>"),
}


def _blockwise():
  model = ok.blockwise.BlockwiseModel(
      embed=lambda p, x: (x * p["w"], ()),
      blocks=(lambda p, h, _: jnp.tanh(h @ p["w"]),),
      head=lambda p, h, _, x: jnp.mean((h @ p["w"] - x) ** 2))
  params = ok.blockwise.BlockwiseParams(
      embed={"w": jnp.ones(4)}, stacks=({"w": jnp.ones((3, 4, 4)) / 4},),
      head={"w": jnp.eye(4)})
  return model, params


@pytest.mark.parametrize("name", sorted(MISTAKES))
def test_public_entry_points_name_the_argument(name):
  fn, error, message = MISTAKES[name]
  with pytest.raises(error, match=message):
    fn()

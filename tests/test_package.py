"""The package's layout: layers that only look down, no cycle, no side channel.

Each module of ``optax_kahan/_src`` (and of its ``blockwise`` subpackage)
has a layer; a module imports only modules of lower layers (read from its ``import`` statements, so the check is
about the code as written). The public modules (``optax_kahan``,
``optax_kahan.blockwise``, ``optax_kahan.per_leaf``) only re-export.
"""

import ast
import importlib.metadata
import re
import pathlib

from packaging.requirements import Requirement

SRC = pathlib.Path(__file__).resolve().parents[1] / "optax_kahan" / "_src"

# Lower first: the bits and the checks; where arrays live and what reads
# leaves; the per-leaf contract; the traced cut; the transformations; kahan
# and the named optimizers; the blockwise model, its pipelined copies, its
# streamed layout and late sums, its residual accessors, its step; the Flax
# adapters, the train state and the NNX optimizer; the known-answer check
# and the FLUX model; the planning command.
LAYERS = [
    {"bits", "validation", "interleaved", "gpu_targets", "timeline"},
    {"placement", "leaves", "double_buffer"},
    {"per_leaf"},
    {"traced"},
    {"second_moment", "bias_corrected_clip", "stochastic_rounding",
     "coupled", "leafwise", "per_block", "prodigy"},
    {"factored_second_moment", "stable_adamw"},
    {"kahan", "alias"},
    {"blockwise.model"},
    {"blockwise.pipeline", "blockwise.streaming", "blockwise.late_sums",
     "blockwise.residuals"},
    {"blockwise.step"},
    {"blockwise.flax_adapters", "blockwise.plan", "train_state",
     "nnx_optimizer"},
    {"known_answer", "flux"},
    {"plan_command"},
]
LAYER = {m: i for i, layer in enumerate(LAYERS) for m in layer}


def _name(path: pathlib.Path) -> str:
  """``kahan`` for ``_src/kahan.py``, ``blockwise.step`` for
  ``_src/blockwise/step.py``."""
  return ".".join(path.relative_to(SRC).with_suffix("").parts)


MODULES = {_name(p): p for p in sorted(SRC.rglob("*.py"))
           if p.stem != "__init__"}


def _imports(path: pathlib.Path) -> tuple[set[str], set[str]]:
  """The ``_src`` modules and the other top-level modules ``path`` imports."""
  own, other = set(), set()
  for node in ast.walk(ast.parse(path.read_text())):
    if isinstance(node, ast.ImportFrom) and node.module:
      if node.module.startswith("optax_kahan._src"):
        base = node.module[len("optax_kahan._src"):].lstrip(".")
        if base in MODULES:
          own.add(base)
        else:  # from a package: its modules
          own.update(f"{base}.{a.name}".lstrip(".") for a in node.names)
      else:
        other.add(node.module.split(".")[0])
    elif isinstance(node, ast.Import):
      other.update(a.name.split(".")[0] for a in node.names)
  return own, other


def test_every_module_has_a_layer():
  assert set(MODULES) == set(LAYER), (set(MODULES) ^ set(LAYER))


def test_imports_only_look_down():
  upward = []
  for name, path in MODULES.items():
    own, _ = _imports(path)
    assert own <= set(LAYER), (name, own - set(LAYER))
    upward += [f"{name} -> {m}" for m in own if LAYER[m] >= LAYER[name]]
  assert not upward, upward


def test_no_context_variable_channel():
  for name, path in MODULES.items():
    _, other = _imports(path)
    assert "contextvars" not in other, name


# jax's program representation (jaxprs, primitives, equation parameters)
# changes between releases: one module reads it, and tests/test_traced.py runs
# on the oldest and the newest jax CI installs.
_JAX_INTERNALS = re.compile(
    r"jax\.extend|jax\._src|make_jaxpr|jaxpr|\.eqns\b|jax\.core\.(?!Tracer\b)")


def test_one_module_reads_jaxs_internals():
  readers = {name for name, path in MODULES.items()
             if _JAX_INTERNALS.search(path.read_text())}
  assert readers == {"traced"}, readers


def test_installed_versions_are_in_the_stated_range():
  # CI's newest stack installs the newest jax, jaxlib, optax and flax the
  # registry serves, whatever pyproject.toml says: a release past its range
  # is noticed here instead of silently run.
  for text in importlib.metadata.requires("optax-kahan"):
    requirement = Requirement(text)
    if requirement.marker is not None:  # an extra's
      continue
    have = importlib.metadata.version(requirement.name)
    assert requirement.specifier.contains(have, prereleases=True), (
        f"{requirement.name} {have} is outside the range pyproject.toml "
        f"states ({requirement.specifier}). A newer release: run .ci/run "
        "(both stacks) with it, mend what fails (tests/test_traced.py first: "
        "optax_kahan/_src/traced.py reads jax's programs), then raise the "
        "bound in pyproject.toml and the README's tested versions. An older "
        "one: pip install -e '.[test]' again")


def _code_lines(fn: ast.AST, lines: list[str]) -> int:
  """Lines of code of a function: its body without the docstring, blank
  lines and comment lines."""
  body = fn.body
  if (body and isinstance(body[0], ast.Expr)
      and isinstance(body[0].value, ast.Constant)
      and isinstance(body[0].value.value, str)):
    body = body[1:]
  if not body:
    return 0
  span = lines[body[0].lineno - 1:fn.end_lineno]
  return sum(1 for line in span
             if line.strip() and not line.strip().startswith("#"))


def test_no_function_over_60_lines_of_code():
  long = []
  for path in sorted(SRC.parent.rglob("*.py")):
    source = path.read_text()
    lines = source.splitlines()
    for node in ast.walk(ast.parse(source)):
      if isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef)):
        n = _code_lines(node, lines)
        if n > 60:
          long.append(f"{path.name}:{node.lineno} {node.name}: {n}")
  assert not long, long


ROOT = SRC.parents[1]
_PUBLIC_USE = r"\bok\.((?:blockwise\.|per_leaf\.)?)([A-Za-z_]\w*)"


def _user_code() -> dict[str, str]:
  """The examples, and the Python blocks of the README and the docs."""
  out = {str(p.relative_to(ROOT)): p.read_text()
         for p in sorted((ROOT / "examples").glob("*.py"))}
  for page in [ROOT / "README.md", *sorted((ROOT / "docs").rglob("*.md"))]:
    if "_build" in page.parts:
      continue
    blocks = re.findall(r"```python\n(.*?)```", page.read_text(), re.S)
    out[str(page.relative_to(ROOT))] = "\n".join(blocks)
  return out


def test_readme_docs_and_examples_use_only_public_names():
  import optax_kahan as ok
  spaces = {"": ok, "blockwise.": ok.blockwise, "per_leaf.": ok.per_leaf}
  private = []
  for where, code in _user_code().items():
    if "_src" in code:
      private.append(f"{where}: imports optax_kahan._src")
    for space, name in re.findall(_PUBLIC_USE, code):
      if name in ("blockwise", "per_leaf") and not space:
        continue
      if name not in spaces[space].__all__:
        private.append(f"{where}: ok.{space}{name}")
  assert not private, private

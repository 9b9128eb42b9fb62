"""The package's layout: layers that only look down, no cycle, no side channel.

Each module of ``optax_kahan/_src`` has a layer; a module imports only
modules of lower layers (read from its ``import`` statements, so the check is
about the code as written). The public modules (``optax_kahan``,
``optax_kahan.blockwise``, ``optax_kahan.per_leaf``) only re-export.
"""

import ast
import pathlib

SRC = pathlib.Path(__file__).resolve().parents[1] / "optax_kahan" / "_src"

# Lower first: the bits and the checks; where arrays live and what reads
# leaves; the per-leaf contract; the traced cut; the transformations; kahan
# and the named optimizers; the blockwise step and the Flax train state.
LAYERS = [
    {"bits", "validation", "double_buffer"},
    {"placement", "leaves"},
    {"per_leaf"},
    {"traced"},
    {"second_moment", "bias_corrected_clip", "stochastic_rounding",
     "coupled", "leafwise", "per_block", "prodigy"},
    {"factored_second_moment", "stable_adamw"},
    {"kahan", "alias"},
    {"blockwise", "train_state"},
]
LAYER = {m: i for i, layer in enumerate(LAYERS) for m in layer}


def _imports(path: pathlib.Path) -> tuple[set[str], set[str]]:
  """The ``_src`` modules and the other top-level modules ``path`` imports."""
  own, other = set(), set()
  for node in ast.walk(ast.parse(path.read_text())):
    if isinstance(node, ast.ImportFrom) and node.module:
      if node.module == "optax_kahan._src":
        own.update(a.name for a in node.names)
      elif node.module.startswith("optax_kahan._src."):
        own.add(node.module.split(".")[2])
      else:
        other.add(node.module.split(".")[0])
    elif isinstance(node, ast.Import):
      other.update(a.name.split(".")[0] for a in node.names)
  return own, other


def test_every_module_has_a_layer():
  modules = {p.stem for p in SRC.glob("*.py")} - {"__init__"}
  assert modules == set(LAYER), (modules ^ set(LAYER))


def test_imports_only_look_down():
  upward = []
  for path in sorted(SRC.glob("*.py")):
    if path.stem == "__init__":
      continue
    own, _ = _imports(path)
    upward += [f"{path.stem} -> {m}" for m in own
               if LAYER[m] >= LAYER[path.stem]]
  assert not upward, upward


def test_no_context_variable_channel():
  for path in SRC.glob("*.py"):
    _, other = _imports(path)
    assert "contextvars" not in other, path.name

"""Imports ``examples/finetune_diffusion.py`` (examples/ is not a package)."""

import importlib.util
import pathlib
import sys
from types import ModuleType

PATH = pathlib.Path(__file__).parent.parent / "examples" / "finetune_diffusion.py"


def load() -> ModuleType:
  """The diffusion example as a module (loaded once)."""
  name = "finetune_diffusion"
  if name not in sys.modules:
    spec = importlib.util.spec_from_file_location(name, PATH)
    module = importlib.util.module_from_spec(spec)
    sys.modules[name] = module  # dataclasses look their module up here
    spec.loader.exec_module(module)
  return sys.modules[name]

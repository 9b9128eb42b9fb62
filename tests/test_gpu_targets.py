"""The compile-only GPU targets: a mesh to compile for an H100 or H200."""

import json
import os
import subprocess
import sys

import pytest

from tests import _subprocess
from tests.test_gpu_compile import _need_plugin

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))

_MESH = """
import json
import jax
from optax_kahan._src import gpu_targets
try:
  mesh = gpu_targets.gpu_mesh("h200")
  print(json.dumps({"devices": mesh.devices.size,
                    "backend": jax.default_backend()}))
except RuntimeError as e:
  print(json.dumps({"error": str(e)}))
"""


def _mesh_in_child(**env: str) -> dict:
  environ = _subprocess.env_for(1)
  del environ["JAX_PLATFORMS"]
  out = subprocess.run([sys.executable, "-c", _MESH], cwd=ROOT, text=True,
                       capture_output=True, timeout=300,
                       env={**environ, **env})
  assert out.returncode == 0, out.stdout[-3000:] + out.stderr[-3000:]
  return json.loads(out.stdout.strip().splitlines()[-1])


@pytest.mark.slow  # needs jax's CUDA plugin, which CI installs for the slow suite
def test_a_deviceless_target_compiles_with_the_cpu_platform_or_says_so():
  _need_plugin()
  assert _mesh_in_child(JAX_PLATFORMS="cpu") == {"devices": 1,
                                                 "backend": "cpu"}
  # Without it, on a machine without a GPU the plugin looks for CUDA and
  # does not start: the error says what to set (with a GPU it compiles).
  got = _mesh_in_child()
  if "error" in got:
    assert "JAX_PLATFORMS=cpu" in got["error"], got
    assert 'pip install -e ".[gpu-aot]"' in got["error"], got
  else:
    assert got == {"devices": 1, "backend": "gpu"}, got

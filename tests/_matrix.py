"""Parameter matrices split between the default suite and the slow one.

A test run over many optimizers (rows) compiles a step per row. The default
suite runs every ``every``-th row of each such test, starting at a different
row for each test (its ``offset``), so that every row runs in some test of
the default suite; ``pytest -m slow`` runs the rest. Together the two suites
run every case.
"""

from typing import Any, Sequence

import pytest


def quick_only(values: Sequence[Any], quick: Sequence[Any]) -> list[Any]:
  """``values`` as ``pytest.param``s, those not in ``quick`` marked slow."""
  return [pytest.param(v, marks=() if v in quick else pytest.mark.slow)
          for v in values]


def sampled(values: Sequence[Any], offset: int, every: int = 3,
            ids: Sequence[str] | None = None) -> list[Any]:
  """``values`` as ``pytest.param``s, all but every ``every``-th (from
  ``offset``) marked slow. A tuple value is the arguments of one case."""
  ids = list(ids) if ids is not None else [None] * len(values)
  return [pytest.param(*(v if isinstance(v, tuple) else (v,)), id=i,
                       marks=() if (k - offset) % every == 0
                       else pytest.mark.slow)
          for k, (v, i) in enumerate(zip(values, ids))]

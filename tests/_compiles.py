"""The names of the functions jax compiles, read from ``jax.log_compiles``."""

import contextlib
import logging
import re

import jax


class _Compiles(logging.Handler):
  """Collects the names ``jax.log_compiles`` says it compiles."""

  def __init__(self):
    super().__init__(logging.DEBUG)
    self.names: list[str] = []

  def emit(self, record: logging.LogRecord) -> None:
    m = re.match(r"Compiling jit\((\w+)\)", record.getMessage())
    if m:
      self.names.append(m.group(1))


@contextlib.contextmanager
def counting_compiles():
  """Yields a list that fills with the name of each function jax compiles
  inside the block (one entry per compilation)."""
  handler, logger = _Compiles(), logging.getLogger("jax")
  old_level = logger.level
  logger.addHandler(handler)
  logger.setLevel(logging.DEBUG)
  try:
    with jax.log_compiles():
      yield handler.names
  finally:
    logger.removeHandler(handler)
    logger.setLevel(old_level)


def run_counting_compiles(source: str) -> list[str]:
  """Runs ``source`` as a program of its own (``__name__ == "__main__"``);
  the names of the functions jax compiled."""
  with counting_compiles() as names:
    exec(compile(source, "<block>", "exec"), {"__name__": "__main__"})
  return names

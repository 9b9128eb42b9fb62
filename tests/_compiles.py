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

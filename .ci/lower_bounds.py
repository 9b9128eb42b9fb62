"""Prints pip constraints pinning pyproject.toml's lower bounds (``name==v``
for each runtime dependency given as ``name>=v``): the oldest stack CI tests."""
import re
import sys
import tomllib

with open(sys.argv[1], "rb") as f:
  dependencies = tomllib.load(f)["project"]["dependencies"]
for requirement in dependencies:
  match = re.match(r"([A-Za-z0-9_.\-]+)\s*>=\s*([^,\s]+)", requirement)
  if match:
    print(f"{match[1]}=={match[2]}")

"""Writes a benchmark's Markdown and JSON under ``benchmarks/results/``."""

import json
import pathlib

RESULTS = pathlib.Path(__file__).parent / "results"


def save(name: str, markdown: str, data: dict, quick: bool = False) -> None:
  """Prints the table and writes ``results/<name>[_quick].{md,json}``."""
  print(markdown)
  RESULTS.mkdir(exist_ok=True)
  stem = f"{name}_quick" if quick else name
  (RESULTS / f"{stem}.md").write_text(markdown)
  (RESULTS / f"{stem}.json").write_text(json.dumps(data, indent=2) + "\n")

"""Prints the first ```python block after a heading of a Markdown file."""
import sys

path, heading = sys.argv[1], sys.argv[2]
text = open(path, encoding="utf-8").read()
after = text[text.index(heading):]
start = after.index("```python\n") + len("```python\n")
print(after[start:after.index("```", start)])

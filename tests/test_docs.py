"""The documentation: the site builds, covers the API, links resolve, code runs.

* The Sphinx site (``docs/``) builds with warnings as errors, as in
  ``python -m sphinx -W -b html docs docs/_build/html``.
* Its API reference has an entry for every name in ``optax_kahan.__all__``
  and in its namespaces' (``optax_kahan.blockwise``, ``optax_kahan.per_leaf``).
* Every page has a body, the search index lists every page, and every
  internal link (file and anchor) of the built site resolves.
* Every ``python`` block of the README and of the docs runs as a complete
  program, in a namespace of its own, with the package's warnings as errors,
  and every function it defines compiles at most once. A block preceded by
  ``<!-- test: slow -->`` runs in the slow suite, in a child process started
  with ``JAX_PLATFORMS=cpu``, as the docs say to run a program that compiles
  for a GPU on a machine without one.
* The docstrings' examples run (doctest), with their output checked.
* Where headless Chromium is installed: offline, at 1280 and 1024 px, every
  page's math is typeset by the site's own MathJax and no table or code block
  is wider than its box.
"""

from __future__ import annotations

import ast
import doctest
import html
import html.parser
import json
import pathlib
import re
import shutil
import subprocess
import sys
import urllib.parse

import jax
import optax
import pytest

import optax_kahan as ok
from _compiles import run_counting_compiles
from tests import _subprocess

ROOT = pathlib.Path(__file__).resolve().parents[1]
DOCS = ROOT / "docs"
PAGES = sorted([ROOT / "README.md"] + [p for p in DOCS.rglob("*.md")
                                       if "_build" not in p.parts])
_BLOCK = re.compile(r"(<!-- test: slow -->\n)?^```python\n(.*?)^```", re.S | re.M)


def _blocks() -> list:
  params = []
  for page in PAGES:
    text = page.read_text()
    for m in _BLOCK.finditer(text):
      line = text.count("\n", 0, m.start(2))
      name = f"{page.relative_to(ROOT)}:{line}"
      slow = bool(m.group(1))
      params.append(pytest.param(m.group(2), slow, id=name,
                                 marks=[pytest.mark.slow] if slow else []))
  return params


# A child's program: the block from stdin, the package's warnings as errors
# (as pyproject.toml's filterwarnings makes them here); the names jax
# compiled, as JSON, last.
_CHILD = """
import json, sys, warnings
import optax_kahan
from tests._compiles import run_counting_compiles
warnings.simplefilter("error", optax_kahan.OptaxKahanWarning)
print(json.dumps(run_counting_compiles(sys.stdin.read())))
"""


def _run_alone_counting_compiles(source: str) -> list[str]:
  """``run_counting_compiles`` in a child started with ``JAX_PLATFORMS=cpu``."""
  out = subprocess.run([sys.executable, "-c", _CHILD], input=source,
                       env=_subprocess.env_for(1), cwd=ROOT,
                       capture_output=True, text=True, timeout=1800)
  assert out.returncode == 0, out.stdout[-3000:] + out.stderr[-5000:]
  return json.loads(out.stdout.strip().splitlines()[-1])


@pytest.mark.parametrize("source, alone", _blocks())
def test_code_block_runs_and_compiles_its_steps_once(source, alone,
                                                     monkeypatch):
  monkeypatch.chdir(ROOT)
  defined = {node.name for node in ast.walk(ast.parse(source))
             if isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef))}
  compiled = (_run_alone_counting_compiles if alone
              else run_counting_compiles)(source)
  for name in defined:
    assert compiled.count(name) <= 1, (
        f"{name} compiled {compiled.count(name)} times")


def test_the_compile_count_sees_a_second_compilation():
  # The count above reads jax.log_compiles' messages: if their wording
  # changed, it would see nothing and pass for anything. It must see this.
  compiled = run_counting_compiles(
      "import jax, jax.numpy as jnp\n"
      "@jax.jit\n"
      "def step(x):\n"
      "  return x + 1\n"
      "step(jnp.ones(3))\n"
      "step(jnp.ones(4))\n")
  assert compiled.count("step") == 2


def test_blocks_were_found():
  ids = [p.id for p in _blocks()]
  assert any(i.startswith("README.md") for i in ids)
  assert sum(i.startswith("docs") for i in ids) >= 10


def test_readme_is_short_and_answers_the_card_question():
  text = (ROOT / "README.md").read_text()
  assert len(text.splitlines()) <= 200
  assert "Which setup for my card" in text
  for card in ("12 GB", "16 GB", "24 GB", "32 GB", "48 GB", "80 GB"):
    assert f"| {card} |" in text


NAMESPACES = {"optax_kahan": ok, "optax_kahan.blockwise": ok.blockwise,
              "optax_kahan.per_leaf": ok.per_leaf}
PUBLIC = [(prefix, name) for prefix, space in NAMESPACES.items()
          for name in space.__all__]


def _public_docstring_examples() -> list:
  finder = doctest.DocTestFinder(recurse=False)
  tests = []
  for prefix, name in PUBLIC:
    obj = getattr(NAMESPACES[prefix], name)
    if not hasattr(obj, "__module__"):  # a constant: no docstring of its own
      continue
    # The names an example may use unimported, as docs/api.md says: its
    # namespace's and the usual aliases.
    space = NAMESPACES[prefix]
    globs = {**{n: getattr(space, n) for n in space.__all__},
             "jax": jax, "jnp": jax.numpy, "ok": ok, "optax": optax}
    for t in finder.find(obj, name, globs=globs):
      if t.examples:
        tests.append(pytest.param(t, id=f"{prefix}.{name}"))
  return tests


# The docstrings' examples are short and run eagerly, on params they do not
# commit: the warning that a jitted step would compile twice does not apply.
@pytest.mark.filterwarnings("ignore:.*params are not committed")
@pytest.mark.parametrize("test", _public_docstring_examples())
def test_docstring_example_runs(test):
  runner = doctest.DocTestRunner(optionflags=doctest.ELLIPSIS
                                 | doctest.NORMALIZE_WHITESPACE)
  runner.run(test)
  assert runner.failures == 0, f"{test.name}: see the doctest output above"


# -- the built site ---------------------------------------------------------


@pytest.fixture(scope="module")
def site(tmp_path_factory) -> pathlib.Path:
  out = tmp_path_factory.mktemp("html")
  done = subprocess.run(
      [sys.executable, "-m", "sphinx", "-W", "--keep-going", "-q", "-b",
       "html", str(DOCS), str(out)], capture_output=True, text=True,
      cwd=ROOT)
  assert done.returncode == 0, done.stdout + done.stderr
  return out


class _Page(html.parser.HTMLParser):
  """The ids, the links and the text of the main content of a built page."""

  def __init__(self):
    super().__init__()
    self.ids: set[str] = set()
    self.links: list[str] = []
    self.text: list[str] = []
    self._in_article = 0

  def handle_starttag(self, tag, attrs):
    attrs = dict(attrs)
    if "id" in attrs:
      self.ids.add(attrs["id"])
    if tag == "a" and attrs.get("href"):
      self.links.append(attrs["href"])
    if tag == "article":
      self._in_article += 1

  def handle_endtag(self, tag):
    if tag == "article":
      self._in_article -= 1

  def handle_data(self, data):
    if self._in_article:
      self.text.append(data)


def _parse(path: pathlib.Path) -> _Page:
  page = _Page()
  page.feed(path.read_text())
  return page


def test_api_reference_covers_all_public_names(site):
  ids = _parse(site / "api.html").ids
  missing = [f"{prefix}.{n}" for prefix, n in PUBLIC
             if f"{prefix}.{n}" not in ids]
  assert not missing, f"no API entry for {missing}"


def test_pages_render_and_are_searchable(site):
  sources = [p.relative_to(DOCS).with_suffix("") for p in DOCS.rglob("*.md")
             if "_build" not in p.parts]
  index = (site / "searchindex.js").read_text()
  for source in sources:
    page = _parse(site / source.with_suffix(".html"))
    assert len("".join(page.text).split()) > 50, f"{source}: nearly empty"
    assert f'"{source.as_posix()}"' in index, f"{source}: not in the search index"


def test_internal_links_resolve(site):
  pages = {p: _parse(p) for p in site.rglob("*.html")}
  broken = []
  for path, page in pages.items():
    for href in page.links:
      url = urllib.parse.urlparse(href)
      if url.scheme or url.netloc:
        continue
      target = (path.parent / url.path).resolve() if url.path else path
      if target.is_dir():
        target = target / "index.html"
      if not target.exists():
        broken.append(f"{path.relative_to(site)} -> {href}")
        continue
      if url.fragment and target.suffix == ".html":
        ids = pages[target].ids if target in pages else _parse(target).ids
        if url.fragment not in ids:
          broken.append(f"{path.relative_to(site)} -> {href}")
  assert not broken, broken


def _slug(heading: str) -> str:
  """GitHub's anchor of a Markdown heading (MyST's ``myst_heading_anchors``)."""
  text = re.sub(r"[^\w\- ]", "", heading.strip().lower())
  return text.replace(" ", "-")


def test_readme_links_resolve():
  text = (ROOT / "README.md").read_text()
  broken = []
  for href in re.findall(r"\]\(([^)\s]+)\)", text):
    url = urllib.parse.urlparse(href)
    if url.scheme or url.netloc:
      continue
    target = ROOT / url.path if url.path else ROOT / "README.md"
    if not target.exists():
      broken.append(href)
    elif url.fragment:
      headings = re.findall(r"^#+ (.*)$", target.read_text(), re.M)
      if url.fragment not in {_slug(h) for h in headings}:
        broken.append(href)
  assert not broken, broken


# In a page, after MathJax has run: the tables and code blocks wider than
# their box, and how many formulas MathJax typeset.
_FIT_PROBE = """<script>window.addEventListener("load", () => setTimeout(() => {
  const wide = [...document.querySelectorAll("article table, article pre")]
    .filter(e => e.scrollWidth > e.clientWidth + 1)
    .map(e => e.tagName + ": " + e.innerText.slice(0, 60).replace(/\\s+/g, " "));
  const math = document.querySelectorAll("mjx-container").length;
  document.body.setAttribute("data-fit", JSON.stringify({wide, math}));
}, 3000));</script>"""


@pytest.mark.skipif(shutil.which("chromium") is None,
                    reason="needs headless Chromium (Debian: apt install chromium)")
@pytest.mark.parametrize("width", [
    1280, pytest.param(1024, marks=pytest.mark.slow)])
def test_pages_fit_and_math_renders_offline(site, tmp_path, width):
  copy = tmp_path / "site"
  shutil.copytree(site, copy)
  pages = [p for p in copy.rglob("*.html") if "_static" not in p.parts
           and p.name not in ("genindex.html", "search.html")]
  for page in pages:
    text = page.read_text()
    assert "cdn.jsdelivr.net" not in text, f"{page.name} loads MathJax online"
    page.write_text(text.replace("</body>", _FIT_PROBE + "</body>"))
    out = subprocess.run(
        ["chromium", "--headless", "--no-sandbox", "--disable-gpu",
         "--no-first-run", "--disable-background-networking",
         "--disable-component-update", "--disable-sync",
         f"--user-data-dir={tmp_path / 'profile'}",
         f"--window-size={width},2000", "--virtual-time-budget=20000",
         "--dump-dom", page.as_uri()],
        capture_output=True, text=True, timeout=120).stdout
    found = re.search(r'data-fit="([^"]*)"', out)
    assert found, f"{page.relative_to(copy)}: the probe did not run"
    fit = json.loads(html.unescape(found.group(1)))
    assert not fit["wide"], (page.relative_to(copy), width, fit["wide"])
    source = (DOCS / page.relative_to(copy)).with_suffix(".md")
    if source.exists() and re.search(r"\$\$|{math}|\.\. math::",
                                     source.read_text()):
      assert fit["math"] > 0, f"{source.name}: its math was not typeset"


# -- figures -------------------------------------------------------------------
RESULTS = ROOT / "benchmarks" / "results"
# A figure: a signed decimal with its unit.
_FIGURE = re.compile(r"(?<![\w.])([-−]?\d+\.(\d+))\s?"
                     r"(GB|GiB|MiB|KiB|ms|×|%|B/param)(?!\w)")
GIB = 2**30 / 1e9
# Figures the prose derives from held ones: the formula, from those figures.
DERIVED = {
    "25.77 GB": 24 * GIB,  # a 24 GiB card, in GB
    "34.4 GB": 32 * GIB,  # a 32 GiB card
    "28.16 GB": 23.80 + 4.36,  # the bf16 weights plus the inner state
    "13.6 ms": 680e6 / 50e9 * 1e3,  # a double-stream block over 50 GB/s
    "5.7 ms": 4e12 / 700e12 * 1e3,  # a block's 4 TFLOP at 700 TFLOP/s
    # a card's margin: its GiB, less 0.5 GB of CUDA context, less the peak
    "2.13 GB": 32 * GIB - 0.5 - 31.73,
    "17.65 GB": 48 * GIB - 0.5 - 33.39,
    "10.49 GB": 48 * GIB - 0.5 - 40.55,
    "29.70 GB": 80 * GIB - 0.5 - 55.70,
    # plan's device budget for a 16 GiB card (context and margin, 0.5 GB
    # each) against the interleaved all-streamed batch-8 peak
    "0.56 GB": 16.74 - (16 * GIB - 0.5 - 0.5),
    # the saved activations' bytes over PCIe, in and out (batch 4)
    "6.7 GB": 85.2 - 78.5,
    "6.5 GB": 60.4 - 53.9,
}


def _held_numbers() -> list[float]:
  text = "\n".join(p.read_text() for p in RESULTS.rglob("*")
                   if p.suffix in (".md", ".json", ".txt")
                   and not p.stem.endswith("_quick"))  # the smoke runs' own
  return sorted(abs(float(x)) for x in
                re.findall(r"\d+\.\d+(?:e[-+]?\d+)?", text))


def _held(value: float, decimals: int, numbers: list[float]) -> bool:
  """Some result rounds to ``value`` at the figure's precision (signs aside:
  the prose says "saves" or "costs")."""
  tol = 0.5 * 10.0**-decimals * (1 + 1e-9)
  return any(abs(n - value) <= tol for n in numbers)


def test_every_figure_comes_from_a_committed_result():
  """Each figure of the README and the docs (a decimal with a unit) is one
  that a committed results file holds, at the figure's precision, or one of
  ``DERIVED``, computed from held figures."""
  numbers = _held_numbers()
  for figure, value in DERIVED.items():
    decimals = len(figure.split()[0].split(".")[1])
    assert abs(round(value, decimals) - float(figure.split()[0])) < 1e-9, (
        figure, value)
  missing = []
  for source in [ROOT / "README.md", *sorted(DOCS.rglob("*.md"))]:
    if "_build" in source.parts:
      continue
    for m in _FIGURE.finditer(source.read_text()):
      value = abs(float(m.group(1).replace("−", "-")))
      decimals = len(m.group(2))
      held = _held(value, decimals, numbers) or (  # a percentage of a fraction
          m.group(3) == "%" and _held(value / 100, decimals + 2, numbers))
      if m.group(0) not in DERIVED and not held:
        missing.append(f"{source.relative_to(ROOT)}: {m.group(0)}")
  assert not missing, "figures no results file holds:\n" + "\n".join(missing)

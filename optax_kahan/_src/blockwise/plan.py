"""Choosing the streamed layout for a card: the fastest compiled candidate
that fits. See docs/guides/flux.md.

References:
  sd-scripts (kohya-ss) ``--blocks_to_swap``, found there by trial.
"""

import concurrent.futures
import dataclasses
import functools
import hashlib
import itertools
import math
import os
import time
from typing import Any, Callable, Iterable, Optional, Sequence

import jax
import jax.numpy as jnp
import numpy as np
import optax

from optax_kahan._src import gpu_targets
from optax_kahan._src import placement
from optax_kahan._src import timeline
from optax_kahan._src import validation
from optax_kahan._src.blockwise.model import BlockwiseModel
from optax_kahan._src.blockwise.model import BlockwiseParams
from optax_kahan._src.blockwise.model import BlockwiseState
from optax_kahan._src.blockwise.model import check_params
from optax_kahan._src.blockwise.model import num_blocks
from optax_kahan._src.blockwise.step import blockwise_init
from optax_kahan._src.blockwise.step import blockwise_step
from optax_kahan._src.blockwise.streaming import STREAMING_COMPILER_OPTIONS
from optax_kahan._src.blockwise.streaming import stream_blocks
from optax_kahan._src.kahan import kahan_replace_residuals
from optax_kahan._src.kahan import kahan_residuals

#: Device memory a CUDA context and cuBLAS/cuDNN workspaces take, about.
CONTEXT = 0.5e9
#: Device memory left free beside a step's compiled peak, by default.
MARGIN = 0.5e9

# Every candidate compiled in this process, by its program (see _key).
_RECORDS: dict[str, "Figures"] = {}
# The candidates of each model, optimizer, shapes and target (see _candidates).
_SEARCHES: dict[tuple, "_Candidates"] = {}


class NoLayoutFits(ValueError):
  """``plan`` found no candidate layout within the device and host budgets;
  the message gives the budgets and the smallest peak compiled."""


@dataclasses.dataclass(frozen=True)
class Layout:
  """Where a blockwise step's blocks live, and its batch.

  Attributes:
    batch: the batch size.
    num_streamed: per stack, how many of its last blocks live in host memory
      (``stream_blocks``' ``num_streamed``).
    spare_buffers: a spare host buffer per streamed leaf (``stream_blocks``).
    residuals_on_device: the blocks not streamed keep their whole state,
      ``kahan``'s residuals included, on the device.
    offload_activations: the blocks' saved inputs in host memory
      (``blockwise_step``'s ``offload_activations``).
    interleave: each streamed leaf dealt into three host arrays
      (``stream_blocks``' ``interleave``; no spare buffers).
  """
  batch: int
  num_streamed: tuple[int, ...]
  spare_buffers: bool
  residuals_on_device: bool
  offload_activations: bool
  interleave: bool = False

  def describe(self) -> str:
    buffers = ("spare buffers" if self.spare_buffers else
               "interleaved host arrays" if self.interleave else
               "one buffer per leaf")
    parts = [f"batch {self.batch}", f"{self.num_streamed} streamed", buffers]
    if self.residuals_on_device:
      parts.append("residuals of the blocks not streamed on the device")
    if self.offload_activations:
      parts.append("activations in host memory")
    return ", ".join(parts)


def hidden_share(x: float) -> str:
  """A share of PCIe time hidden behind compute as a whole percent, ``-``
  for NaN (nothing moved that way)."""
  return "-" if math.isnan(x) else f"{x:.0%}"


@dataclasses.dataclass(frozen=True)
class Figures:
  """A compiled candidate's figures (bytes and seconds).

  Attributes:
    peak_bytes: device peak: arguments + outputs - aliased + temporaries.
    host_bytes: its arguments and temporaries in host memory.
    step_s: the ``timeline`` model of its schedule: an estimate.
    floor_s: the longest of its matrix multiplies and each PCIe direction's
      bytes, at the model's rates.
    h2d_hidden: the share of host-to-device time beside compute (NaN: none).
    d2h_hidden: the same, device to host.
    compile_s: how long it took to compile.
  """
  peak_bytes: int
  host_bytes: int
  step_s: float
  floor_s: float
  h2d_hidden: float
  d2h_hidden: float
  compile_s: float

  def hidden(self) -> str:
    """The hidden shares as ``"73% / 96%"`` (host to device / device to
    host; ``-`` where nothing moves that way)."""
    return " / ".join(map(hidden_share, (self.h2d_hidden, self.d2h_hidden)))


@dataclasses.dataclass(frozen=True)
class Candidate:
  """A layout the search compiled (or found compiled), and its verdict:
  ``"chosen"``, ``"over the device budget"``, ``"over the host budget"`` or
  ``"fits, slower per sample"``."""
  layout: Layout
  figures: Figures
  verdict: str


@dataclasses.dataclass(frozen=True)
class Plan:
  """The fastest layout per sample that fits the budgets, and the search.

  Attributes:
    layout: the chosen ``Layout``.
    figures: its ``Figures``.
    device_budget: the largest device peak allowed (bytes).
    host_budget: the most host memory allowed (bytes).
    target: what was compiled for (``"h100"``, ``"h200"`` or the device).
    compiles: how many candidates this call compiled (0: all were compiled
      before, in this process).
    candidates: every candidate the search looked at, in order.
  """
  layout: Layout
  figures: Figures
  device_budget: float
  host_budget: float
  target: str
  compiles: int
  candidates: tuple[Candidate, ...]

  @property
  def per_sample_s(self) -> float:
    return self.figures.step_s / self.layout.batch

  def stream(self, model: BlockwiseModel, params: BlockwiseParams,
             state: BlockwiseState
             ) -> tuple[BlockwiseModel, BlockwiseParams, BlockwiseState]:
    """``stream_blocks`` with this layout: ``(model, params, state)``."""
    return stream_blocks(model, params, state, self.layout.num_streamed,
                         spare_buffers=self.layout.spare_buffers,
                         interleave=self.layout.interleave,
                         residuals_on_device=_kept(self.layout, params))

  def jit_step(self, model: BlockwiseModel,
               tx: optax.GradientTransformation) -> Callable:
    """The jitted ``blockwise_step`` of ``self.stream``'s model: params and
    state donated, ``STREAMING_COMPILER_OPTIONS``, this layout's
    ``offload_activations``; called as ``step(params, state, batch)``."""
    act = self.layout.offload_activations
    return jax.jit(
        lambda p, s, x: blockwise_step(model, tx, p, s, x,
                                       offload_activations=act),
        donate_argnums=(0, 1), compiler_options=STREAMING_COMPILER_OPTIONS)

  def table(self) -> str:
    """The candidates as a markdown table."""
    lines = ["| layout | device peak GB | host GB | modeled ms per sample "
             "| floor ms per sample | PCIe hidden (H2D / D2H) | verdict |",
             "|---|---|---|---|---|---|---|"]
    for c in self.candidates:
      f, b = c.figures, c.layout.batch
      lines.append(
          f"| {c.layout.describe()} | {f.peak_bytes / 1e9:.2f} | "
          f"{f.host_bytes / 1e9:.2f} | {f.step_s / b * 1e3:.1f} | "
          f"{f.floor_s / b * 1e3:.1f} | {f.hidden()} | {c.verdict} |")
    return "\n".join(lines)


def _kept(layout: Layout, params: BlockwiseParams
          ) -> Optional[tuple[int, ...]]:
  """``stream_blocks``' ``residuals_on_device`` for ``layout``."""
  if not layout.residuals_on_device:
    return None
  kept = tuple(num_blocks(stack) - k
               for stack, k in zip(params.stacks, layout.num_streamed))
  return kept if any(kept) else None


def _streamed(counts: Sequence[int], k: int) -> tuple[int, ...]:
  """``k`` blocks streamed: the last stack's last blocks first, then the
  stack before it's, and so on."""
  out = []
  for n in reversed(counts):
    out.append(min(k, n))
    k -= out[-1]
  return tuple(reversed(out))


def _residuals_in_host_memory(tx: optax.GradientTransformation) -> bool:
  """Whether ``tx`` (``kahan(..., offload=True)`` of something) keeps
  residuals in host memory: asked of its ``init`` on a one-weight tree."""
  try:
    probe = jax.device_put(jnp.zeros((1,), jnp.bfloat16), jax.devices()[0])
    residuals = kahan_residuals(tx.init({"w": probe}))
  except ValueError:  # no kahan in tx
    return False
  return any(placement.on_host(r) for r in jax.tree.leaves(residuals))


def _abstract_state(tx, params, device, host) -> BlockwiseState:
  """``blockwise_init(tx, params)``'s shapes, on the device but ``kahan``'s
  residuals where ``tx`` puts them."""
  state = jax.tree.map(
      lambda x: jax.ShapeDtypeStruct(x.shape, x.dtype, sharding=device),
      jax.eval_shape(lambda p: blockwise_init(tx, p), params))
  if not _residuals_in_host_memory(tx):
    return state

  def place(group):
    return kahan_replace_residuals(group, jax.tree.map(
        lambda r: jax.ShapeDtypeStruct(r.shape, r.dtype, sharding=host),
        kahan_residuals(group)))
  return BlockwiseState(place(state.embed),
                        tuple(place(s) for s in state.stacks),
                        place(state.head))


def _key(lowered, target: str) -> str:
  """A compiled candidate's key: its program, target, options and jax."""
  text = "\n".join((lowered.as_text(), target, jax.__version__,
                    repr(sorted(STREAMING_COMPILER_OPTIONS.items()))))
  return hashlib.sha256(text.encode()).hexdigest()


def _figures(compiled, compile_s: float) -> Figures:
  m = compiled.memory_analysis()
  t = timeline.model(compiled.as_text())
  return Figures(
      peak_bytes=(m.argument_size_in_bytes + m.output_size_in_bytes
                  - m.alias_size_in_bytes + m.temp_size_in_bytes),
      host_bytes=m.host_argument_size_in_bytes + m.host_temp_size_in_bytes,
      step_s=t.step_s,
      floor_s=max(t.gemm_s, t.h2d_bytes / timeline.PCIE,
                  t.d2h_bytes / timeline.PCIE),
      h2d_hidden=t.h2d_hidden, d2h_hidden=t.d2h_hidden, compile_s=compile_s)


def _budgets(target: Optional[str], device_memory, host_memory, margin
             ) -> tuple[float, float]:
  """(largest device peak, most host bytes) in bytes."""
  if device_memory is not None:
    device = device_memory - CONTEXT - margin
  elif target is not None:
    device = gpu_targets.MEMORY[target] - CONTEXT - margin
  else:  # XLA's allocator's limit: the context is outside it
    stats = jax.devices()[0].memory_stats() or {}
    if "bytes_limit" not in stats:
      raise ValueError("plan: the device does not report its memory; give "
                       "device_memory (bytes)")
    device = stats["bytes_limit"] - margin
  if host_memory is None:
    host_memory = os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES")
  return device, host_memory


def plan(
    model: BlockwiseModel,
    params: BlockwiseParams,
    tx: optax.GradientTransformation,
    batch: Any,
    *,
    device_memory: Optional[float] = None,
    host_memory: Optional[float] = None,
    batches: Sequence[int] = (1, 2, 4, 8),
    target: Optional[str] = None,
    margin: float = MARGIN,
    interleave: bool = False,
    progress: bool = True,
    workers: Optional[int] = None,
) -> Plan:
  r"""The streamed layout with the fastest modeled step per sample that fits.

  Compiles ``blockwise_step(model, tx, ...)`` for candidate layouts, for
  this machine's GPU or, with ``target``, for an H100 or H200 without one
  (deviceless, as XLA's GPU compiler allows on any machine with jax's CUDA
  plugin). A candidate is a ``Layout``: the batch, how many blocks are
  streamed (``stream_blocks``; the last stack's last blocks first), spare
  host buffers or one, the residuals of the blocks not streamed on the
  device or in host memory, the activations in host memory or not. It fits
  when its compiled device peak (arguments + outputs - aliased +
  temporaries) is at most

  .. math::  \text{device\_memory} - \text{CONTEXT} - \text{margin}

  (the device's own allocator limit less ``margin`` when neither
  ``device_memory`` nor ``target`` is given) and its host arguments and
  temporaries at most ``host_memory``. Of those that fit it returns the one
  whose step, on ``timeline``'s model of the compiled schedule (gemms at
  700 TFLOP/s, PCIe at 50 GB/s per direction, other kernels free: an
  estimate), takes least time per sample.

  The search compiles few candidates. It takes, within a family (the layout
  but the streamed count ``k``), the device peak not to rise with ``k`` but
  at the first two blocks streamed of each stack (they add their staging
  buffers), and the host bytes and the modeled time not to fall: the best
  of a family is then its fewest streamed blocks that fit, found by
  bisection within a stack (guesses interpolated between the peaks
  compiled). It also takes each stack's last count to have its lowest
  peak: a family none of whose stack ends fits is dropped after compiling
  them (and ``k = 0``), as is one once a count below the one it needs is
  no faster per sample than the best so far. Where it needs several
  candidates at once (each family's ``k = 0``, a stack's first counts and
  its end) it compiles them ``workers`` at a time. Whatever it returns was
  compiled and fits; on a model that breaks those assumptions it may miss a
  faster layout that fits (``tests/test_plan.py`` checks the search against
  brute force). Compiled candidates are kept for the process, by their program
  (the lowered text, target, options and jax version), and the layouts
  looked at by the model and optimizer objects and the shapes: a second
  call with the same ones neither traces nor compiles, whatever its
  budgets.

  Example:
    >>> import optax, optax_kahan as ok
    >>> p = ok.blockwise.plan(model, params, ok.kahan(optax.adamw(1e-4)),
    ...                       batch, device_memory=16 * 2**30,
    ...                       host_memory=64e9, target="h200")  # doctest: +SKIP
    >>> model, params, state = p.stream(model, params, state)  # doctest: +SKIP
    >>> step = p.jit_step(model, tx)  # doctest: +SKIP

  Args:
    model: the model's functions (not streamed).
    params: its ``BlockwiseParams``, arrays or ``jax.ShapeDtypeStruct``.
    tx: the transformation ``blockwise_step`` will apply.
    batch: an example batch, arrays or ``jax.ShapeDtypeStruct``; the leading
      axis of each leaf is the batch axis, replaced by each of ``batches``.
    device_memory: the card's memory in bytes (default: ``target``'s, or
      this device's allocator limit).
    host_memory: the most host memory (bytes) the step may take (default:
      this machine's RAM).
    batches: the batch sizes to try.
    target: ``"h100"`` or ``"h200"``: compile for it without a GPU (on a
      machine without one, start the program with ``JAX_PLATFORMS=cpu``:
      jax's CUDA plugin looks for CUDA otherwise). None: for this
      machine's GPU.
    margin: device memory left free beside the peak (bytes).
    interleave: also try each streamed leaf dealt into three host arrays
      (``stream_blocks(..., interleave=True)``): one buffer's host bytes,
      the copies independent, at a higher compiled peak; a third of the
      families more to compile.
    progress: print a line per compile (30 to 60 s each at FLUX.1-dev's
      size, deviceless on a CPU).
    workers: how many candidates may compile at once, where the search
      needs several (default: the CPUs, at most 4; each FLUX.1-dev compile
      takes about 3 GB of RAM).

  Returns:
    A ``Plan``: ``plan.stream(model, params, state)`` lays out the blocks,
    ``plan.jit_step(model, tx)`` is the step to call on them.

  Raises:
    NoLayoutFits: when no candidate fits (a ``ValueError``; the smallest
      peak compiled is given).
    ValueError: on XLA:CPU without ``target`` (host memory is bookkeeping
      there: nothing to choose), for an unknown target or a batch size below
      1.
    RuntimeError: for a ``target`` jax's CUDA plugin cannot compile for
      here (the plugin missing, or not started: see ``target``).
  """
  check_params(model, params)
  if target is None and jax.default_backend() == "cpu":
    raise ValueError(
        "plan: XLA:CPU keeps host memory as bookkeeping, so no layout saves "
        "device memory there; compile for a GPU without one: "
        "target='h100' or target='h200'")
  if target is not None and target not in gpu_targets.TARGETS:
    raise ValueError(f"plan: unknown target {target!r}: one of "
                     f"{sorted(gpu_targets.TARGETS)}")
  if not batches or any(int(b) != b or b < 1 for b in batches):
    raise ValueError(f"plan: batches must be positive integers, got "
                     f"{tuple(batches)}")
  device_budget, host_budget = _budgets(target, device_memory, host_memory,
                                        margin)
  search = _candidates(model, params, tx, batch, target)
  search.progress, search.looked = progress, {}
  search.workers = workers or min(4, os.cpu_count() or 1)
  compiled_before = search.compiles
  validation.check_bool("plan", "interleave", interleave)
  families = _families(batches, search.host_state, interleave)
  best = _search(search, families, device_budget, host_budget)
  seen = {layout: search.seen[layout] for layout in search.looked}
  if best is None and not seen:  # no candidate's host arguments fit
    least = min(search.host_argument_bytes(search.at(f, 0)) for f in families)
    raise NoLayoutFits(
        f"plan: no layout fits {host_budget / 1e9:.2f} GB of host memory: "
        f"the params and state take at least {least / 1e9:.2f} GB there")
  if best is None:
    smallest = min(seen.items(), key=lambda kv: kv[1].peak_bytes)
    raise NoLayoutFits(
        f"plan: no layout fits {device_budget / 1e9:.2f} GB of device "
        f"memory and {host_budget / 1e9:.2f} GB of host memory; the smallest "
        f"peak compiled: {smallest[1].peak_bytes / 1e9:.2f} GB "
        f"({smallest[0].describe()}, host {smallest[1].host_bytes / 1e9:.2f} "
        "GB)")

  def verdict(layout: Layout, f: Figures) -> str:
    if layout == best:
      return "chosen"
    if f.peak_bytes > device_budget:
      return "over the device budget"
    if f.host_bytes > host_budget:
      return "over the host budget"
    return "fits, slower per sample"
  return Plan(best, seen[best], device_budget, host_budget,
              search.name, search.compiles - compiled_before,
              tuple(Candidate(c, f, verdict(c, f)) for c, f in seen.items()))


def _candidates(model, params, tx, batch, target) -> "_Candidates":
  """The ``_Candidates`` of these arguments, made once per process: keyed by
  the model's and optimizer's objects, the shapes and dtypes, the target."""
  shapes = lambda tree: (jax.tree.structure(tree), tuple(
      (tuple(x.shape), jnp.dtype(x.dtype)) for x in jax.tree.leaves(tree)))
  key = (model, tx, shapes(params), shapes(batch), target)
  if key not in _SEARCHES:
    _SEARCHES[key] = _Candidates(model, params, tx, batch, target)
  return _SEARCHES[key]


class _Candidates:
  """The candidate layouts of one model, optimizer and batch, compiled on
  demand for one target (``_RECORDS`` keeps them for the process)."""

  def __init__(self, model, params, tx, batch, target, progress=False):
    if target is None:
      mesh = jax.sharding.Mesh(np.asarray(jax.devices()[:1]), ("x",))
      self.name = jax.devices()[0].device_kind
    else:
      mesh, self.name = gpu_targets.gpu_mesh(target), target
    device = jax.NamedSharding(mesh.abstract_mesh, jax.P())
    host = jax.NamedSharding(mesh.abstract_mesh, jax.P(),
                             memory_kind="pinned_host")
    self.mesh, self.model, self.tx, self.progress = mesh, model, tx, progress
    self.params = jax.tree.map(
        lambda x: jax.ShapeDtypeStruct(x.shape, x.dtype, sharding=device),
        params)
    self.batch = lambda b: jax.tree.map(lambda y: jax.ShapeDtypeStruct(
        (b, *y.shape[1:]), y.dtype, sharding=device), batch)
    self.state = _abstract_state(tx, self.params, device, host)
    self.counts = [num_blocks(stack) for stack in self.params.stacks]
    self.total = sum(self.counts)
    self.ends = tuple(itertools.accumulate(reversed(self.counts)))
    self.host_state = any(placement.in_host_memory(x)
                          for x in jax.tree.leaves(self.state))
    self.seen: dict[Layout, Figures] = {}  # every layout, once compiled
    self.looked: dict[Layout, None] = {}  # those of the current search
    self.compiles = 0
    self.workers = 1
    self._host_bytes: dict[tuple, int] = {}

  def at(self, family: Layout, k: int) -> Layout:
    """``family`` with ``k`` blocks streamed (with every block streamed,
    no residuals are left to keep on the device: the same layout as the
    family without them, compiled once)."""
    layout = dataclasses.replace(family,
                                 num_streamed=_streamed(self.counts, k))
    if layout.residuals_on_device and _kept(layout, self.params) is None:
      layout = dataclasses.replace(layout, residuals_on_device=False)
    return layout

  def stream(self, layout: Layout):
    return stream_blocks(self.model, self.params, self.state,
                         layout.num_streamed,
                         spare_buffers=layout.spare_buffers,
                         interleave=layout.interleave,
                         residuals_on_device=_kept(layout, self.params))

  def host_argument_bytes(self, layout: Layout) -> int:
    """Its params' and state's bytes in host memory (no compile)."""
    key = (layout.num_streamed, layout.spare_buffers, layout.interleave,
           layout.residuals_on_device)
    if key not in self._host_bytes:
      self._host_bytes[key] = placement.host_bytes(self.stream(layout)[1:])
    return self._host_bytes[key]

  def figures(self, layout: Layout) -> Figures:
    """The compiled ``layout``'s figures (compiled once per process)."""
    self.looked[layout] = None
    if layout not in self.seen:
      self.prefetch([layout])
    return self.seen[layout]

  def prefetch(self, layouts: Iterable[Layout]) -> None:
    """Compiles those of ``layouts`` not compiled yet, up to ``workers`` at
    once (XLA compiles outside Python's lock; each is lowered here, while
    the ones before it compile), for ``figures`` to find. The search calls
    it where it will need all of ``layouts``, or nearly."""
    jobs = {}  # program key: (its layouts, its compile)
    with concurrent.futures.ThreadPoolExecutor(self.workers) as pool:
      for layout in layouts:
        if layout in self.seen:
          continue
        m, p, s = self.stream(layout)
        tx, act = self.tx, layout.offload_activations
        with jax.set_mesh(self.mesh):
          lowered = jax.jit(
              lambda p, s, x: blockwise_step(m, tx, p, s, x,
                                             offload_activations=act),
              donate_argnums=(0, 1),
              compiler_options=STREAMING_COMPILER_OPTIONS).lower(
                  p, s, self.batch(layout.batch))
        key = _key(lowered, self.name)
        if key in _RECORDS:
          self.seen[layout] = _RECORDS[key]
        elif key in jobs:
          jobs[key][0].append(layout)
        else:
          jobs[key] = ([layout], pool.submit(_compile, lowered))
      for key, (same, job) in jobs.items():
        _RECORDS[key] = _figures(*job.result())
        self.compiles += 1
        for layout in same:
          self.seen[layout] = _RECORDS[key]
        if self.progress:
          f = _RECORDS[key]
          print(f"plan: compiled {self.compiles} ({same[0].describe()}): "
                f"peak {f.peak_bytes / 1e9:.2f} GB, host "
                f"{f.host_bytes / 1e9:.2f} GB, "
                f"{f.step_s / same[0].batch * 1e3:.1f} ms per sample "
                f"modeled, PCIe hidden {f.hidden()}, in {f.compile_s:.0f} s",
                flush=True)


def _compile(lowered) -> tuple[Any, float]:
  """``lowered`` compiled, and the seconds it took."""
  t0 = time.perf_counter()
  compiled = lowered.compile()
  return compiled, time.perf_counter() - t0


def _families(batches: Sequence[int], host_state: bool,
              interleave: bool = False) -> list[Layout]:
  """Every layout but its streamed count, in the order searched: larger
  batches first; then the activations on the device, spare buffers (then
  interleaved host arrays, if asked) and the residuals of the blocks not
  streamed on the device first (the faster ones where they fit: a best
  found early drops more families)."""
  buffers = [(True, False)] + [(False, True)] * interleave + [(False, False)]
  return [Layout(b, (), spare, kept, act, dealt)
          for b in sorted(set(batches), reverse=True)
          for act in (False, True)
          for spare, dealt in buffers
          for kept in ((True, False) if host_state else (False,))]


def _search(search: "_Candidates", families: Sequence[Layout],
            device_budget: float, host_budget: float) -> Optional[Layout]:
  """The fitting layout fastest per sample (the first family's on a tie),
  by ``_fewest_that_fit`` in each family; None if none fits."""
  best: Optional[tuple[float, Layout]] = None
  search.prefetch(search.at(f, 0) for f in families  # every one looked at
                  if search.host_argument_bytes(search.at(f, 0)) <= host_budget)
  for family in families:
    at = functools.partial(search.at, family)
    top = -1  # the most blocks streamed whose host arguments can fit
    for k in range(search.total + 1):
      if search.host_argument_bytes(at(k)) > host_budget:
        break
      top = k
    found = _fewest_that_fit(
        lambda k: search.figures(at(k)), top, family.batch, device_budget,
        math.inf if best is None else best[0], search.ends,
        lambda ks: search.prefetch(at(k) for k in ks))
    if found is None or search.figures(at(found)).host_bytes > host_budget:
      continue  # host bytes do not fall with more blocks streamed
    per_sample = search.figures(at(found)).step_s / family.batch
    if best is None or per_sample < best[0]:
      best = (per_sample, at(found))
  return None if best is None else best[1]


def _fewest_that_fit(figures: Callable[[int], Figures], top: int, batch: int,
                     budget: float, best: float, ends: Sequence[int],
                     prefetch: Callable[[Sequence[int]], None] = lambda ks: None
                     ) -> Optional[int]:
  """The fewest streamed blocks in ``0..top`` whose peak is at most
  ``budget``; None if none does, or if a count below it already takes at
  least ``best`` seconds per sample. ``ends``: the counts at which each
  stack is wholly streamed, ascending. Within a stack the first two blocks
  streamed may raise the peak (each adds its staging buffers); from there
  to the stack's end the peak is taken not to rise, and a stack's last count
  to have the lowest peak of the stack's counts: when none of those (nor,
  in a stack cut short at ``top``, its first two counts and ``top``) fits,
  no count does, and the family is dropped after them. ``prefetch(ks)``
  compiles counts together where all, or nearly, will be looked at."""
  fits = lambda k: figures(k).peak_bytes <= budget
  slow = lambda k: figures(k).step_s / batch >= best
  if top < 0 or slow(0):
    return None
  if fits(0):
    return 0
  if top == 0:
    return None
  lowest, start = [], 0  # the counts that may have a stack's lowest peak
  for end in ends:
    if start >= top:
      break
    lowest.append(min(end, top))
    if end > top:  # a stack cut short by the host budget: its first two too
      lowest += range(start + 1, min(start + 2, top - 1) + 1)
    start = end
  lowest.sort(reverse=True)  # the most streamed first: the likeliest to fit
  if not fits(lowest[0]):
    prefetch(lowest[1:])
    if not any(fits(k) for k in lowest[1:]):
      return None
  start = 0
  for end in ends:
    end = min(end, top)
    prefetch(sorted({*range(start + 1, min(start + 2, end) + 1), end}))
    for k in range(start + 1, min(start + 2, end) + 1):
      if fits(k):
        return k
      if slow(k):  # every count from k on is at least as slow
        return None
    below = min(start + 2, end)
    if end > below:
      if not fits(end):
        if slow(end):
          return None
      else:  # the peak falls from below to end: bisect, interpolating
        lo, hi = below + 1, end
        while lo < hi:
          over, under = figures(below).peak_bytes, figures(hi).peak_bytes
          k = below + math.ceil((over - budget) * (hi - below)
                                / max(1.0, over - under))
          k = min(max(k, lo), hi - 1)
          if fits(k):
            hi = k
          elif slow(k):
            return None
          else:
            lo, below = k + 1, k
        return hi
    if end == top:
      return None
    start = end
  return None

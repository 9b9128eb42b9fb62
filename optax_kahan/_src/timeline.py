"""A timeline model of a compiled GPU program: step time and hidden PCIe time.

Nothing runs on a GPU. The program is the scheduled HLO that XLA's GPU
compiler emits (``compiled.as_text()``, compiled for a GPU or deviceless for
an H100 or H200, ``gpu_targets``); the model replays its schedule:

* one compute stream runs the instructions in schedule order; a gemm (a
  fusion or library call whose computation holds a ``dot``) takes its FLOPs
  over ``gemm_flops`` (``2 * output elements * contracted size``), every
  other kernel is free unless ``hbm_bytes_per_s`` is given (then each kernel
  also takes its operands' and outputs' bytes over it);
* host transfers run on their own queue per PCIe direction, one at a time,
  at ``pcie_bytes_per_s``: ``copy-start`` / ``copy-done`` pairs and async
  fusions (``fusion-start`` / ``fusion-done``) that ``dynamic-slice`` out of
  a host (``S(5)``) array or ``dynamic-update-slice`` into one. A transfer
  starts when the compute stream reaches its ``*-start`` and the queue is
  free; the compute stream waits at its ``*-done`` until it has finished;
* a synchronous ``copy`` from or into host memory (XLA's copy of a whole
  host array, which it inserts to keep a value it is about to update in
  place) blocks the compute stream for its bytes at ``pcie_bytes_per_s``
  (an assumption: no faster than a transfer) and is reported apart;
* a ``while`` runs its body ``known_trip_count`` times, a ``call`` its
  computation, in place.

Reported: the modeled step time, the PCIe time per direction, and the share
of it hidden behind compute (1 - the compute stream's waits at that
direction's ``*-done`` over its transfer time); and the loop floor: the step
if each iteration of each loop (and the code outside loops, as one) took the
longest of its compute and its bytes in either direction, what any schedule
of these loops reaches while each iteration moves its own bytes. Constants
are stated with each figure: these are estimates from the schedule, not
measurements.

    from optax_kahan._src import timeline
    t = timeline.model(compiled.as_text())   # a Timeline

``ok.blockwise.plan`` ranks streamed layouts by it; the benchmarks report it.
"""

from __future__ import annotations

import dataclasses
import json
import math
import re
from typing import Optional

# The constants of the estimates (a Hopper card, PCIe 5.0 x16).
GEMM_FLOPS = 700e12
PCIE = 50e9

_BYTES = {"pred": 1, "s8": 1, "u8": 1, "bf16": 2, "f16": 2, "s16": 2,
          "u16": 2, "f32": 4, "s32": 4, "u32": 4, "f64": 8, "s64": 8,
          "u64": 8}
_COMP = re.compile(r"^(ENTRY )?%([\w.\-]+) \(.*\{$")
_INSTR = re.compile(r"^\s*(?:ROOT )?%([\w.\-]+) = (.*?) ([a-z][\w\-]*)\((.*)$")
_ARRAY = re.compile(r"(\w+)\[([\d,]*)\](\{[^}]*\})?")


@dataclasses.dataclass
class Instr:
  name: str
  type: str
  op: str
  operands: list[str]
  line: str


@dataclasses.dataclass
class Timeline:
  """The modeled step: times in seconds, bytes per PCIe direction."""
  step_s: float
  gemm_s: float
  gemm_flops: float
  h2d_bytes: int
  d2h_bytes: int
  h2d_s: float
  d2h_s: float
  h2d_wait_s: float
  d2h_wait_s: float
  transfers: int
  host_copy_bytes: int
  loop_floor_s: float

  @property
  def h2d_hidden(self) -> float:
    return 1 - self.h2d_wait_s / self.h2d_s if self.h2d_s else math.nan

  @property
  def d2h_hidden(self) -> float:
    return 1 - self.d2h_wait_s / self.d2h_s if self.d2h_s else math.nan

  def as_dict(self) -> dict:
    return {**dataclasses.asdict(self), "h2d_hidden": self.h2d_hidden,
            "d2h_hidden": self.d2h_hidden}


def _arrays(typ: str) -> list[tuple[str, tuple[int, ...], bool]]:
  """(dtype, dims, in host memory) of each array in an HLO type."""
  out = []
  for dtype, dims, layout in _ARRAY.findall(typ):
    if dtype in _BYTES:
      out.append((dtype, tuple(int(d) for d in dims.split(",") if d),
                  "S(5)" in (layout or "")))
  return out


def _nbytes(typ: str) -> int:
  return sum(_BYTES[d] * math.prod(s) for d, s, _ in _arrays(typ))


def parse(hlo: str) -> tuple[dict[str, list[Instr]], str]:
  """The module's computations (instructions in schedule order) and the
  entry computation's name."""
  comps, entry, current = {}, None, None
  for line in hlo.splitlines():
    m = _COMP.match(line)
    if m:
      current = comps.setdefault(m.group(2), [])
      if m.group(1):
        entry = m.group(2)
      continue
    if line.startswith("}"):
      current = None
      continue
    if current is None:
      continue
    m = _INSTR.match(line)
    if m:
      name, typ, op, rest = m.groups()
      args = rest.split("), ")[0] if "), " in rest else rest.rstrip(")")
      current.append(Instr(name, typ, op, re.findall(r"%([\w.\-]+)", args),
                           line))
  return comps, entry


def _called(line: str, key: str) -> Optional[str]:
  m = re.search(rf"\b{key}=%([\w.\-]+)", line)
  return m.group(1) if m else None


def _trips(i: Instr) -> int:
  m = re.search(r'"known_trip_count":\{"n":"(\d+)"', i.line)
  if not m:
    raise ValueError(f"while {i.name} has no known trip count")
  return int(m.group(1))


class _Model:

  def __init__(self, hlo: str, gemm_flops: float, pcie: float,
               hbm: Optional[float]):
    self.comps, self.entry = parse(hlo)
    self.types = {i.name: i.type for c in self.comps.values() for i in c}
    self.gemm_rate, self.pcie, self.hbm = gemm_flops, pcie, hbm
    self._flops: dict[str, float] = {}
    self.t = 0.0
    self.queue = {"h2d": 0.0, "d2h": 0.0}
    self.busy = {"h2d": 0.0, "d2h": 0.0}
    self.wait = {"h2d": 0.0, "d2h": 0.0}
    self.nbytes = {"h2d": 0, "d2h": 0}
    self.gemm_s = self.flops_total = 0.0
    self.transfers = self.host_copy_bytes = 0
    self.pending: dict[str, tuple[str, float]] = {}

  def flops(self, comp: str) -> float:
    """FLOPs of the dots in a fused computation (and those it calls)."""
    if comp in self._flops:
      return self._flops[comp]
    total = 0.0
    for i in self.comps.get(comp, []):
      if i.op == "dot":
        out = _arrays(i.type)[0][1]
        lhs = _arrays(self.types[i.operands[0]])[0][1]
        dims = re.search(r"lhs_contracting_dims=\{([\d,]*)\}", i.line)
        k = math.prod(lhs[int(d)] for d in dims.group(1).split(",") if d)
        total += 2.0 * math.prod(out) * k
      for key in ("calls", "to_apply"):
        callee = _called(i.line, key)
        if callee and callee != comp:
          total += self.flops(callee)
    self._flops[comp] = total
    return total

  def transfer(self, i: Instr) -> Optional[tuple[str, int]]:
    """(direction, bytes) of a host transfer's ``*-start``, else None."""
    if i.op == "copy-start":
      dest, src = _arrays(i.type)[:2]
      if dest[2] == src[2]:
        return None
      return ("d2h" if dest[2] else "h2d",
              _BYTES[dest[0]] * math.prod(dest[1]))
    if i.op == "fusion-start":
      body = self.comps.get(_called(i.line, "calls"), [])
      ops = {b.op for b in body}
      operands = [self.types.get(o, "") for o in i.operands]
      if "dynamic-slice" in ops and any("S(5)" in t for t in operands[:1]):
        out = re.search(r"\), (\w+\[[\d,]*\](\{[^}]*\})?)", i.type)
        return "h2d", _nbytes(out.group(1))
      if "dynamic-update-slice" in ops and "S(5)" in operands[0]:
        return "d2h", _nbytes(operands[1])
    return None

  def run(self, comp: str) -> None:
    for i in self.comps[comp]:
      if i.op.endswith("-start"):
        moved = self.transfer(i)
        if moved:
          way, size = moved
          begin = max(self.t, self.queue[way])
          self.queue[way] = begin + size / self.pcie
          self.busy[way] += size / self.pcie
          self.nbytes[way] += size
          self.transfers += 1
          self.pending[i.name] = (way, self.queue[way])
      elif i.op.endswith("-done"):
        if i.operands and i.operands[0] in self.pending:
          way, end = self.pending.pop(i.operands[0])
          if end > self.t:
            self.wait[way] += end - self.t
            self.t = end
      elif i.op == "while":
        for _ in range(_trips(i)):
          self.run(_called(i.line, "body"))
      elif i.op == "call":
        self.run(_called(i.line, "to_apply"))
      elif i.op == "conditional":
        raise ValueError(f"conditional {i.name}: not modeled")
      elif i.op == "copy":
        kernel = self._kernel_s(i)
        if kernel is not None:  # a host array's
          self.host_copy_bytes += _nbytes(i.type)
          self.t += kernel
      elif i.op in ("fusion", "custom-call"):
        f = self._gemm_flops(i)
        self.flops_total += f
        self.gemm_s += f / self.gemm_rate
        self.t += self._kernel_s(i)

  def floor(self, comp: str) -> tuple[float, int, int]:
    """(seconds, H2D bytes, D2H bytes) of ``comp`` on the loop floor: its
    compute, and each loop's iterations at their longest part."""
    t, moved = 0.0, {"h2d": 0, "d2h": 0}
    for i in self.comps[comp]:
      kernel = self._kernel_s(i)
      transfer = self.transfer(i) if i.op.endswith("-start") else None
      if kernel is not None:
        t += kernel
      elif transfer:
        moved[transfer[0]] += transfer[1]
      elif i.op == "while":
        c, h2d, d2h = self.floor(_called(i.line, "body"))
        t += _trips(i) * max(c, h2d / self.pcie, d2h / self.pcie)
      elif i.op == "call":
        c, h2d, d2h = self.floor(_called(i.line, "to_apply"))
        t += c
        moved["h2d"] += h2d
        moved["d2h"] += d2h
    return t, moved["h2d"], moved["d2h"]

  def _kernel_s(self, i: Instr) -> Optional[float]:
    """The compute stream's time for a kernel or a host array's copy."""
    if i.op == "copy" and any(
        host for _, _, host in _arrays(i.type) + _arrays(
            self.types.get(i.operands[0], ""))):
      return _nbytes(i.type) / self.pcie
    if i.op not in ("fusion", "custom-call"):
      return None
    t = self._gemm_flops(i) / self.gemm_rate
    if self.hbm:
      t += (_nbytes(i.type) + sum(
          _nbytes(self.types.get(o, "")) for o in i.operands)) / self.hbm
    return t

  def _gemm_flops(self, i: Instr) -> float:
    """FLOPs of a fusion's or a library call's dots."""
    f = self.flops(_called(i.line, "calls")) if _called(
        i.line, "calls") else 0.0
    if f == 0.0 and i.op == "custom-call" and "gemm" in i.line:
      f = self._library_gemm(i)
    return f

  def _library_gemm(self, i: Instr) -> float:
    """FLOPs of a cuBLAS gemm custom call, from its dot dimensions."""
    cfg = re.search(r'"lhs_contracting_dimensions":\[([^\]]*)\]', i.line)
    out = _arrays(i.type)[0][1]
    lhs = _arrays(self.types[i.operands[0]])[0][1]
    dims = json.loads(f"[{cfg.group(1)}]") if cfg else []
    return 2.0 * math.prod(out) * math.prod(lhs[int(d)] for d in dims)


def model(hlo: str, *, gemm_flops: float = GEMM_FLOPS, pcie: float = PCIE,
          hbm_bytes_per_s: Optional[float] = None) -> Timeline:
  """Replays the scheduled ``hlo`` (``compiled.as_text()``) on the model.

  Args:
    hlo: the compiled module's text.
    gemm_flops: gemm throughput, FLOP/s.
    pcie: bytes/s of each PCIe direction.
    hbm_bytes_per_s: if given, every kernel also takes its operands' and
      outputs' bytes over this bandwidth (else non-gemm kernels are free).

  Returns:
    A ``Timeline``.
  """
  m = _Model(hlo, gemm_flops, pcie, hbm_bytes_per_s)
  m.run(m.entry)
  c, h2d, d2h = m.floor(m.entry)
  end = max([m.t, *m.queue.values()])
  return Timeline(step_s=end, gemm_s=m.gemm_s, gemm_flops=m.flops_total,
                  h2d_bytes=m.nbytes["h2d"], d2h_bytes=m.nbytes["d2h"],
                  h2d_s=m.busy["h2d"], d2h_s=m.busy["d2h"],
                  h2d_wait_s=m.wait["h2d"], d2h_wait_s=m.wait["d2h"],
                  transfers=m.transfers, host_copy_bytes=m.host_copy_bytes,
                  loop_floor_s=max(c, h2d / m.pcie, d2h / m.pcie))

"""A run's memory as measured, printed at the end of a fit beside the planned peak (:mod:`lightning_baoc.costs.peak`).

- **CPU**: the resident set (``/proc/self/statm`` at fit start; the whole run's peak from
  ``getrusage``'s ``ru_maxrss``, the kernel's high-water mark since the process started). Resident
  memory also holds what no plan counts: the code of the libraries a run first uses (mapped from
  disk) and the C allocator's cache of freed memory (glibc keeps up to twice the largest block it
  freed). Where glibc is the allocator, its allocated bytes (``mallinfo2``: in use, and mapped
  blocks) are read at fit start and at steps' ends, which the plan is comparable with. ``mallinfo2`` walks
  the heap's free lists (measured: 1.2 ms on a heap of 10,000 free blocks), so it is read at most 0.1% of the
  run's time: after a reading that took ``t``, not again for ``1000 t``.
- **CUDA**: ``torch.cuda.max_memory_allocated`` over ``memory_allocated`` at fit start (allocated
  storage: the caching allocator's reserve is not in it). When the peak since the process started
  (or the last ``reset_peak_memory_stats``) was reached before fit start, the run's own is unknown
  and is printed as such: BAOC does not reset the counters, which are the user's.

Nothing here synchronizes a device or allocates.
"""

from __future__ import annotations

import ctypes
import ctypes.util
import os
import sys
import time
from dataclasses import dataclass
from typing import Any

import torch

from lightning_baoc.config.budget import format_bytes
from lightning_baoc.costs.peak import PlannedPeak


class _MallInfo2(ctypes.Structure):
    _fields_ = [(name, ctypes.c_size_t) for name in
                ("arena", "ordblks", "smblks", "hblks", "hblkhd", "usmblks", "fsmblks", "uordblks", "fordblks", "keepcost")]


_MALLINFO: Any = None  # glibc's mallinfo2, resolved once (False: not available)


def glibc_allocated() -> int | None:
    """glibc's allocated bytes now (in use + mapped blocks), or ``None`` without glibc >= 2.33."""
    global _MALLINFO
    if _MALLINFO is None:
        _MALLINFO = False
        if sys.platform.startswith("linux"):
            try:
                info = ctypes.CDLL(ctypes.util.find_library("c") or "libc.so.6").mallinfo2
                info.restype = _MallInfo2
                _MALLINFO = info
            except (OSError, AttributeError):  # not glibc, or glibc < 2.33
                pass
    if _MALLINFO is False:
        return None
    m = _MALLINFO()
    return int(m.uordblks + m.hblkhd)


def resident_bytes() -> int | None:
    """The resident set now (Linux), else ``None``."""
    try:
        with open("/proc/self/statm") as f:
            return int(f.read().split()[1]) * os.sysconf("SC_PAGE_SIZE")
    except (OSError, ValueError, IndexError):
        return None


def peak_resident_bytes() -> int | None:
    """The process's peak resident set since it started (``ru_maxrss``: KiB on Linux, bytes on macOS)."""
    try:
        import resource
    except ImportError:  # Windows
        return None
    peak = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss
    return int(peak) if sys.platform == "darwin" else int(peak) * 1024


@dataclass
class MeasuredPeak:
    """What was measured (bytes; ``None``: not measurable here). ``growth`` is the peak over fit start."""

    kind: str  # "resident" (CPU) or "allocated" (CUDA)
    start: int | None
    peak: int | None
    growth: int | None
    allocated_growth: int | None = None  # CPU with glibc: the most allocated at a step's end, over fit start

    def to_dict(self) -> dict[str, Any]:
        return dict(self.__dict__)


class MemoryMeter:
    """Reads a run's memory at fit start, at every step's end and at the end (see the module docstring)."""

    def __init__(self) -> None:
        self.device: torch.device | None = None
        self._start: int | None = None
        self._peak_before: int | None = None
        self._allocated_start: int | None = None
        self._allocated_most: int | None = None
        self._next_reading = 0.0  # perf_counter time before which sample() reads nothing

    def start(self, device: torch.device) -> None:
        """Take the fit-start readings on the training ``device``."""
        self.device = device
        if device.type == "cuda":
            self._start, self._peak_before = torch.cuda.memory_allocated(device), torch.cuda.max_memory_allocated(device)
            return
        self._start, self._peak_before = resident_bytes(), peak_resident_bytes()
        self._allocated_start = self._allocated_most = glibc_allocated()

    def sample(self) -> None:
        """At a step's end: the most the C allocator has handed out so far (CPU with glibc; rate-limited, see the
        module docstring)."""
        if self._allocated_start is None:
            return
        began = time.perf_counter()
        if began < self._next_reading:
            return
        self._allocated_most = max(self._allocated_most or 0, glibc_allocated() or 0)
        done = time.perf_counter()
        self._next_reading = done + 1000 * (done - began)

    def measured(self) -> MeasuredPeak | None:
        """The readings so far; ``None`` before :meth:`start`."""
        if self.device is None:
            return None
        if self.device.type == "cuda":
            peak = torch.cuda.max_memory_allocated(self.device)
            kind = "allocated"
        else:
            peak, kind = peak_resident_bytes(), "resident"
        growth = None
        if peak is not None and self._start is not None and (self._peak_before is None or peak > self._peak_before):
            growth = peak - self._start
        allocated = (self._allocated_most - self._allocated_start
                     if self._allocated_most is not None and self._allocated_start is not None else None)
        return MeasuredPeak(kind, self._start, peak, growth, allocated)

    def line(self, planned: PlannedPeak | None) -> str:
        """The report's line: the planned peak and the measured one."""
        m = self.measured()
        plan = f"planned peak {planned.line()}" if planned is not None else "no planned peak"
        if m is None:
            return f"BAOC memory: {plan}"
        if m.kind == "allocated":
            seen = (f"measured: max allocated {format_bytes(m.peak)}, {format_bytes(m.growth)} over fit start"
                    if m.growth is not None else
                    f"measured: max allocated {format_bytes(m.peak)}, reached before fit start (the run's own peak is not known)")
        elif m.peak is None:
            seen = "measured: not on this platform"
        else:
            over = (f", {format_bytes(m.growth)} over fit start" if m.growth is not None else
                    ", reached before fit start (the run's own peak is not known)")
            seen = f"measured: peak resident {format_bytes(m.peak)}{over}"
            if m.allocated_growth is not None:
                seen += (f"; allocated at the steps' ends at most {format_bytes(m.allocated_growth)} over fit start "
                         "(resident memory also holds the libraries' code and the allocator's cache of freed memory)")
        return f"BAOC memory: {plan}; {seen}"


__all__ = ["MeasuredPeak", "MemoryMeter", "glibc_allocated", "peak_resident_bytes", "resident_bytes"]

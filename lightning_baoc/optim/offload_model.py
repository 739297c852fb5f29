"""How long the update of host-held (``offload``) states takes, by schedule: a performance model and a
discrete-event simulator of the update phase (Deep Optimizer States, arXiv 2410.21316).

Offloaded parameters are updated in **subgroups** of about :data:`DEFAULT_SUBGROUP_BYTES` of fp32
parameters each, by one of two paths:

- **host**: the gradient down (D2H, at its width; the weight too where the host holds no copy of it:
  ``Subgroup.weight_down``; the optimizer keeps one, as DeepSpeed keeps its fp32 master there), the CPU's AdamW
  over them and the moments held in host memory, the weight up (H2D, at its width);
- **device**: the subgroup's moments up (``offload`` holds fp32 ``m`` and ``v``: 8 bytes per element;
  12 where an fp32 master weight lives on the host too, as DeepSpeed keeps it), the GPU's AdamW, and
  the moments back down; the weight on the GPU is written by the step.

The resources are the H2D copy engine, the D2H copy engine (one shared engine where the profile has a
single one), the CPU (its AdamW threads, one task at a time) and the GPU's compute stream. Each path is a
chain of tasks; a task starts when the one before it in its chain has finished and its resource is free,
in the order the subgroups are listed (first come, first served, as CUDA streams and a host thread pool
run them). The **update phase** is the time from the first gradient ready to the last task done. The
device path needs a staging buffer of its subgroup's states, double-buffered, in the GPU
memory free during the update (activations are released by then); a schedule that does not fit leaves
those subgroups on the host.

:func:`choose` is the model: it simulates the host-only schedule and schedules with ``m`` subgroups
on the device spread evenly (every K-th at ``m = n / K``; Twin-Flow's fixed ratio is one of them), refines
the best, and keeps the shortest whose staging fits the free memory. :data:`PROFILES` name the rates of common machines so a plan can be made without a GPU;
:func:`calibrated` replaces a profile's rates by measured ones (CUDA event times, during training).

The model lives beside the schedule that runs it (:mod:`.offload_schedule` chooses each device's paths with
:func:`choose`), under the optimizer; ``lightning-baoc plan --hardware`` predicts with it (:func:`predict`).
"""

from __future__ import annotations

import heapq
import math
from collections.abc import Sequence
from dataclasses import dataclass, field, replace

from lightning_baoc.formats.offload import DEFAULT_SUBGROUP_BYTES, STATE_BYTES  # the format's own figures


@dataclass(frozen=True)
class Hardware:
    """The rates of one machine (one GPU and its share of the host).

    Attributes:
        name: the profile's name.
        h2d, d2h: pinned host-to-device and device-to-host bandwidth, bytes per second.
        cpu_adam: the CPU's AdamW over fp32 states, elements per second at its thread count.
        gpu_adam: the GPU's AdamW over fp32 states, elements per second.
        latency: seconds of set-up per task (a launch, a copy's submission, a thread pool's wake-up).
        gpu_memory: the GPU's memory in bytes.
        duplex: two copy engines (H2D and D2H at once); ``False``: one engine takes both directions.
        source: where the figures come from.
    """

    name: str
    h2d: float
    d2h: float
    cpu_adam: float
    gpu_adam: float
    latency: float = 10e-6
    gpu_memory: int = 80 << 30
    duplex: bool = True
    source: str = ""

    def __post_init__(self) -> None:
        for key in ("h2d", "d2h", "cpu_adam", "gpu_adam"):
            value = getattr(self, key)
            if not (isinstance(value, (int, float)) and math.isfinite(value) and value > 0):
                raise ValueError(f"Hardware({self.name!r}).{key}={value!r}: expected a positive rate")
        if not (math.isfinite(self.latency) and self.latency >= 0):
            raise ValueError(f"Hardware({self.name!r}).latency={self.latency!r}: expected seconds >= 0")


_HOST = ("CPU AdamW: 16 host cores per GPU, a vectorized AdamW at about 90% of 25 GB/s of host memory bandwidth per "
         "4 cores over 28 bytes per element (DeepSpeed's CPU Adam is memory-bound)")
#: Named machines (one GPU each). Bandwidths are what pinned copies reach, below the links' peaks
#: (PCIe 5.0 x16: 64 GB/s, 4.0 x16: 32 GB/s, each way); the GPU's AdamW is its memory bandwidth over
#: 28 bytes per element (read p, g, m, v; write p, m, v) at 85%.
PROFILES: dict[str, Hardware] = {
    "h100-sxm": Hardware("h100-sxm", h2d=53e9, d2h=50e9, cpu_adam=3.2e9, gpu_adam=0.85 * 3.35e12 / 28,
                         gpu_memory=80 << 30, source="H100 SXM5 (HBM3 3.35 TB/s), PCIe 5.0 x16 host link; " + _HOST),
    "h100-pcie5": Hardware("h100-pcie5", h2d=50e9, d2h=48e9, cpu_adam=3.2e9, gpu_adam=0.85 * 2.0e12 / 28,
                           gpu_memory=80 << 30, source="H100 PCIe (HBM2e 2.0 TB/s), PCIe 5.0 x16; " + _HOST),
    "a100-pcie4": Hardware("a100-pcie4", h2d=24e9, d2h=23e9, cpu_adam=3.2e9, gpu_adam=0.85 * 1.94e12 / 28,
                           gpu_memory=80 << 30, source="A100 80GB PCIe (HBM2e 1.94 TB/s), PCIe 4.0 x16; " + _HOST),
    "h200": Hardware("h200", h2d=53e9, d2h=50e9, cpu_adam=3.2e9, gpu_adam=0.85 * 4.8e12 / 28,
                     gpu_memory=141 << 30, source="H200 SXM (HBM3e 4.8 TB/s), PCIe 5.0 x16 host link; " + _HOST),
}


def hardware(name: str) -> Hardware:
    """The profile ``name`` (one of :data:`PROFILES`)."""
    try:
        return PROFILES[name]
    except KeyError:
        raise ValueError(f"Unknown hardware profile {name!r}; allowed: {sorted(PROFILES)}") from None


def calibrated(base: Hardware, **rates: float) -> Hardware:
    """``base`` with measured rates (``h2d``, ``d2h``, ``cpu_adam``, ``gpu_adam``, ``latency``) replacing its own."""
    unknown = set(rates) - {"h2d", "d2h", "cpu_adam", "gpu_adam", "latency"}
    if unknown:
        raise ValueError(f"calibrated(): unknown rates {sorted(unknown)}")
    return replace(base, name=f"{base.name} (calibrated)", **rates)


@dataclass(frozen=True)
class Subgroup:
    """Offloaded parameters updated together: ``numel`` elements, gradients and weights of ``grad_bytes``
    and ``weight_bytes`` per element on the device, ``state_bytes`` per element held on the host (what the
    device path moves each way), gradients final at ``ready`` seconds; ``weight_down``: the host path copies
    the weight down too (no host copy of it is kept: ``OffloadSchedule(keep_host_weights=False)``)."""

    numel: int
    grad_bytes: int = 4
    weight_bytes: int = 4
    ready: float = 0.0
    state_bytes: int = STATE_BYTES
    weight_down: bool = False


def subgroups(numels: Sequence[int], subgroup_bytes: int = DEFAULT_SUBGROUP_BYTES, grad_bytes: int = 4,
              weight_bytes: int = 4, state_bytes: int = STATE_BYTES, weight_down: bool = False) -> list[Subgroup]:
    """Tensors of ``numels`` (in the order their gradients become final) packed into subgroups of at most
    ``subgroup_bytes`` of fp32 parameters (a larger tensor is split: its elements step independently)."""
    if subgroup_bytes < 4:
        raise ValueError(f"Invalid subgroup_bytes: {subgroup_bytes!r}; expected at least 4 (one fp32 element)")
    cap = subgroup_bytes // 4
    out: list[Subgroup] = []
    current = 0
    for n in numels:
        while n > 0:
            take = min(n, cap - current)
            current += take
            n -= take
            if current == cap:
                out.append(Subgroup(current, grad_bytes, weight_bytes, state_bytes=state_bytes, weight_down=weight_down))
                current = 0
    if current:
        out.append(Subgroup(current, grad_bytes, weight_bytes, state_bytes=state_bytes, weight_down=weight_down))
    return out


@dataclass
class Schedule:
    """A simulated update phase: which subgroups go to the device, its length and each resource's busy time."""

    on_device: list[bool]
    seconds: float
    busy: dict[str, float] = field(default_factory=dict)
    fits: bool = True

    @property
    def device_share(self) -> float:
        return sum(self.on_device) / len(self.on_device) if self.on_device else 0.0


def staging_bytes(groups: Sequence[Subgroup], on_device: Sequence[bool]) -> int:
    """GPU memory the device path stages: two buffers (double-buffered), each of its largest subgroup's states (one
    buffer where a single subgroup takes the device path), as the optimizer allocates them."""
    sizes = [g.numel * g.state_bytes for g, d in zip(groups, on_device) if d]
    return min(len(sizes), 2) * max(sizes, default=0)


def _chain(g: Subgroup, device: bool, hw: Hardware) -> list[tuple[str, float]]:
    """A subgroup's tasks in order: (resource, seconds)."""
    if device:
        return [("h2d", g.state_bytes * g.numel / hw.h2d), ("gpu", g.numel / hw.gpu_adam), ("d2h", g.state_bytes * g.numel / hw.d2h)]
    down = g.grad_bytes + (g.weight_bytes if g.weight_down else 0)
    return [("d2h", down * g.numel / hw.d2h), ("cpu", g.numel / hw.cpu_adam), ("h2d", g.weight_bytes * g.numel / hw.h2d)]


def simulate(groups: Sequence[Subgroup], on_device: Sequence[bool], hw: Hardware, free_memory: int | None = None) -> Schedule:
    """The update phase of ``groups`` with the given paths, event by event (the module docstring): each
    resource, when free, starts the ready task that became ready first (ties: the earlier subgroup)."""
    if len(on_device) != len(groups):
        raise ValueError(f"simulate(): {len(on_device)} paths for {len(groups)} subgroups")
    chains = [_chain(g, d, hw) for g, d in zip(groups, on_device)]
    engine = (lambda r: r) if hw.duplex else (lambda r: "copy" if r in ("h2d", "d2h") else r)
    busy = {"h2d": 0.0, "d2h": 0.0, "cpu": 0.0, "gpu": 0.0}
    queues: dict[str, list[tuple[float, int, int]]] = {}  # server -> heap of (ready time, subgroup, task index)
    idle_at: dict[str, float] = {}
    events: list[tuple[float, int, int]] = [(g.ready, i, 0) for i, g in enumerate(groups)]  # (time, subgroup, task) ready
    heapq.heapify(events)
    end = 0.0
    while events or any(queues.values()):
        # move every task ready by the next moment a server can act into its server's queue
        now = events[0][0] if events else math.inf
        for server, q in queues.items():
            if q:
                now = min(now, max(idle_at.get(server, -math.inf), q[0][0]))
        while events and events[0][0] <= now:
            ready, i, k = heapq.heappop(events)
            heapq.heappush(queues.setdefault(engine(chains[i][k][0]), []), (ready, i, k))
        for server, q in queues.items():
            if q and q[0][0] <= now and idle_at.get(server, -math.inf) <= now:
                ready, i, k = heapq.heappop(q)
                resource, seconds = chains[i][k]
                done = now + hw.latency + seconds
                idle_at[server] = done
                busy[resource] += hw.latency + seconds
                if k + 1 < len(chains[i]):
                    heapq.heappush(events, (done, i, k + 1))
                else:
                    end = max(end, done)
    first = min((g.ready for g in groups), default=0.0)
    fits = free_memory is None or not any(on_device) or staging_bytes(groups, on_device) <= free_memory
    return Schedule(list(on_device), max(end - first, 0.0), busy, fits)


def every_kth(n: int, k: int) -> list[bool]:
    """Every ``k``-th of ``n`` subgroups on the device (the first among them), the rest on the host."""
    return [i % k == 0 for i in range(n)]


def spread(n: int, m: int) -> list[bool]:
    """``m`` of ``n`` subgroups on the device, spread evenly (every K-th where ``n / m`` is a whole K)."""
    return [(i * m) // n != ((i + 1) * m) // n for i in range(n)] if m else [False] * n


#: Subgroups up to which :func:`choose` tries every count on the device and improves the best move by move.
EXHAUSTIVE = 64


def choose(groups: Sequence[Subgroup], hw: Hardware, free_memory: int | None = None) -> Schedule:
    """The shortest update phase found (the module docstring): host-only and ``m`` subgroups on the device
    spread evenly, for every ``m`` (of more than :data:`EXHAUSTIVE` subgroups: 64 shares, then every ``m``
    between the best one's neighbours), then, of at most :data:`EXHAUSTIVE` subgroups, single moves while one
    shortens the phase; only schedules whose staging fits ``free_memory`` (``None``: no limit)."""
    n = len(groups)
    if n == 0:
        return Schedule([], 0.0)
    tried: dict[int, Schedule] = {}

    def at(m: int) -> Schedule:
        if m not in tried:
            tried[m] = simulate(groups, spread(n, m), hw, free_memory)
        return tried[m]

    counts = range(n + 1) if n <= EXHAUSTIVE else sorted({round(n * j / 64) for j in range(65)})
    fitting = [m for m in counts if at(m).fits]
    best_m = min(fitting, key=lambda m: at(m).seconds)
    if n > EXHAUSTIVE:
        grid = sorted(counts)
        i = grid.index(best_m)
        lo, hi = grid[max(i - 1, 0)], grid[min(i + 1, len(grid) - 1)]
        best_m = min((m for m in range(lo, hi + 1) if at(m).fits), key=lambda m: at(m).seconds)
    best = at(best_m)
    improved = n <= EXHAUSTIVE
    while improved:
        improved = False
        for i in range(n):
            trial = list(best.on_device)
            trial[i] = not trial[i]
            s = simulate(groups, trial, hw, free_memory)
            if s.fits and s.seconds < best.seconds * (1 - 1e-9):
                best, improved = s, True
    return best


def host_only(groups: Sequence[Subgroup], hw: Hardware) -> Schedule:
    """Every subgroup on the host (static offload: ZeRO-Offload's)."""
    return simulate(groups, [False] * len(groups), hw)


@dataclass(frozen=True)
class OffloadPrediction:
    """The update phase of an allocation's offloaded states, host-only and interleaved (seconds)."""

    bytes: int
    host: float
    interleaved: float
    device_share: float
    subgroups: int

    def to_dict(self) -> dict[str, object]:
        return {"bytes": self.bytes, "update_s": {"host": self.host, "interleaved": self.interleaved},
                "device_share": self.device_share, "subgroups": self.subgroups}


def predict(numels: Sequence[int], hw: Hardware, free_memory: int | None = None,
            subgroup_bytes: int = DEFAULT_SUBGROUP_BYTES, grad_bytes: int = 4, weight_bytes: int = 4,
            state_bytes: int = STATE_BYTES, weight_down: bool = False) -> OffloadPrediction:
    """Host-only and interleaved update times of offloaded tensors of ``numels`` (all gradients final at
    once: the update phase after backward) on ``hw``; the offloaded bytes are ``state_bytes`` per element
    (``offload``'s 8 of host memory); ``weight_down``: :class:`Subgroup`'s."""
    groups = subgroups(numels, subgroup_bytes, grad_bytes, weight_bytes, state_bytes, weight_down)
    free = hw.gpu_memory // 4 if free_memory is None else free_memory
    host = host_only(groups, hw)
    inter = choose(groups, hw, free)
    total = sum(numels)
    return OffloadPrediction(state_bytes * total, host.seconds, inter.seconds, inter.device_share, len(groups))


__all__ = ["DEFAULT_SUBGROUP_BYTES", "PROFILES", "Hardware", "OffloadPrediction", "Schedule", "Subgroup", "calibrated",
           "choose", "every_kth", "hardware", "host_only", "predict", "simulate", "spread", "staging_bytes", "subgroups"]

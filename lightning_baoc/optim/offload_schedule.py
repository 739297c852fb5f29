"""The update of host-held (``offload``) states by subgroups, each on the path the model finds fastest
(Deep Optimizer States, arXiv 2410.21316; the model: :mod:`lightning_baoc.optim.offload_model`).

The offloaded parameters of a device are packed into **subgroups** of about
:attr:`OffloadSchedule.subgroup_bytes` of fp32 parameters (whole tensors, in the order backward makes their
gradients final: the optimizer's order reversed). Each step, each subgroup is updated by one of two paths:

- **host**: its gradients down (D2H, at their own width: a bf16 gradient moves 2 bytes an element; a weight too
  where its host copy no longer holds: :attr:`OffloadSchedule.keep_host_weights`), the compiled CPU AdamW over the
  host copies and the host-held ``m`` and ``v`` (multi-threaded; the same kernel as the CPU's ``fp32`` step), the
  new weights up (H2D, at their width);
- **device**: its ``m`` and ``v`` up into a staging buffer on the device, the device's fused fp32 AdamW
  (torch's ``_fused_adamw_``) over the weights, gradients and staged moments, the moments back down.

Which subgroups take the device path is :func:`~lightning_baoc.optim.offload_model.choose`'s answer (``"interleaved"``,
under the free device memory and :attr:`OffloadSchedule.staging_bytes`), none (``"host"``: static offload, as
ZeRO-Offload) or all (``"device"``). Each path runs on its own CUDA streams (host path: one down, one up; device
path: up, compute, down) with pinned double buffers, ordered by events: the host path's copies of the next
subgroup run while the CPU updates this one, and the device path runs beside both. On the CPU, the CPU stands in
for the device: the streams and events are a shim that runs each task at once, in order (:class:`Lane`), so the
whole schedule (subgroups, paths, buffers, prefetches) runs and is tested there, to the same numbers as the
``fp32`` step (``tests/optim/test_offload_schedule.py``); :class:`DeferredLanes` runs each lane's tasks later, as
a GPU runs its streams, so the tests there also hold every wait the schedule needs to be in place.

**Overlap with backward** (:attr:`OffloadSchedule.overlap`): a post-accumulate-grad hook on every scheduled
parameter counts the micro-batches of the window (:attr:`OffloadSchedule.accumulate_grad_batches`); on the last,
once every gradient of a subgroup is final, the subgroup's transfers start: a host-path subgroup's gradients (and
weights whose host copy no longer holds) go down into pinned buffers of its own, the first two device-path
subgroups' moments go up. ``step()`` does the rest: every update runs there, after
global-norm clipping and AMP's unscaling and skip test, so both stay correct without a condition: a copy whose
gradient or weight changed after it was taken (``clip_grad_norm_``, one more micro-batch: in-place writes that
advance the tensors' version counters; ``GradScaler.unscale_``, whose fused operation advances none: seen by the
gradients' norms, taken with the copy and compared bit for bit, one reduction per subgroup) is taken again; a
window that ``step()`` never closed (AMP's skipped step) drops its copies at the next backward. With
:attr:`OffloadSchedule.update_in_backward`, a host-path subgroup's whole update runs there as well (on CUDA in a
worker thread, so that backward goes on): for runs without clipping and loss scaling, and ``step()`` refuses,
naming the setting, a gradient written after its update and a window no ``step()`` closed.

Parameters this part does not serve stay with the optimizer's own step (:mod:`lightning_baoc.optim.stepping`):
those with a master-weight correction, sharded ones (FSDP2), non-contiguous ones, the steps of gradient release,
and every parameter of an optimizer built with ``atomic_step=True`` (its journal covers that step only).
"""

from __future__ import annotations

import time
import weakref
from concurrent.futures import Future, ThreadPoolExecutor
from contextlib import nullcontext
from dataclasses import dataclass, field
from typing import Any, Callable, ContextManager, Literal, Mapping, Sequence

import torch
from torch import Tensor
from torch.utils.hooks import RemovableHandle

from lightning_baoc.formats import StateFormat, StepHyper, StepItem
from lightning_baoc.formats.frames import framed
from lightning_baoc.formats.fused_adam import fused_dense_fp32
from lightning_baoc.formats.offload import DEFAULT_SUBGROUP_BYTES, STATE_BYTES
from lightning_baoc.kernels.compiled import KernelItem, compiled_step, kernel_serves
from lightning_baoc.optim.offload_model import (
    PROFILES, Hardware, Subgroup, calibrated, choose, hardware, simulate, staging_bytes,
)
from lightning_baoc.optim.pools import Record
from lightning_baoc.optim.sharding import is_sharded

#: The schedules: ``"interleaved"`` (the model chooses per subgroup), ``"host"`` (every subgroup on the host:
#: static offload), ``"device"`` (every subgroup on the device, where its staging fits: for measurements).
MODES = ("interleaved", "host", "device")
ScheduleMode = Literal["interleaved", "host", "device"]
#: Bytes between the starts of two tensors carved out of one staging buffer (a cache line; the kernels' vectors).
_ALIGN = 64


@dataclass(frozen=True)
class OffloadSchedule:
    """How ``offload`` states are updated (the module docstring).

    Attributes:
        mode: ``"interleaved"``, ``"host"`` or ``"device"`` (default: ``"interleaved"``).
        subgroup_bytes: fp32 parameter bytes per subgroup; a larger tensor is a subgroup of its own
            (default: 64 MiB, the paper's order of size).
        overlap: start each subgroup's transfers in backward, once its gradients are final (default: False).
        accumulate_grad_batches: micro-batches per optimizer step: the transfers start on the last one only
            (default: 1).
        hardware: the model's rates: a profile name of :data:`~lightning_baoc.optim.offload_model.PROFILES`, a
            :class:`~lightning_baoc.optim.offload_model.Hardware`, or ``None``: the profile that matches the GPU's
            name (else ``"h100-pcie5"``), recalibrated from the measured times as training runs (default: None).
        staging_bytes: device memory the device path may stage (its double buffers), at most; ``None``: the
            device's free memory at the step (on the CPU: no bound) (default: None).
        keep_host_weights: keep a host copy of each host-path weight (at its width, as DeepSpeed keeps its fp32
            master there), so only its gradient comes down; the copy is taken again whenever the weight was written
            by anything else (an in-place write advances its version counter; another step, its step count). A
            write through ``param.data`` bypasses both: set ``False`` to bring every weight down each step
            (default: True).
        update_in_backward: with ``overlap``, a host-path subgroup's whole update (the CPU's AdamW, the weights
            up) runs in backward too, on the gradients backward leaves: for runs without global-norm clipping and
            without a loss scaler. ``step()`` refuses, naming this setting, a gradient written after its update
            (clipping, ``GradScaler.unscale_``) and a window no ``step()`` closed (default: False).

    Example:
        >>> OffloadSchedule("host").mode
        'host'
        >>> OffloadSchedule(mode="sideways")
        Traceback (most recent call last):
        ...
        ValueError: Invalid offload_schedule mode: 'sideways'; allowed: 'interleaved', 'host', 'device'. ...
    """

    mode: ScheduleMode = "interleaved"
    subgroup_bytes: int = DEFAULT_SUBGROUP_BYTES
    overlap: bool = False
    accumulate_grad_batches: int = 1
    hardware: str | Hardware | None = None
    staging_bytes: int | None = None
    keep_host_weights: bool = True
    update_in_backward: bool = False

    def __post_init__(self) -> None:

        if self.mode not in MODES:
            raise ValueError(
                f"Invalid offload_schedule mode: {self.mode!r}; allowed: {', '.join(map(repr, MODES))}. "
                f"'interleaved' lets the model choose each subgroup's path, 'host' updates every subgroup on the CPU"
            )
        if not isinstance(self.subgroup_bytes, int) or isinstance(self.subgroup_bytes, bool) or self.subgroup_bytes < 4:
            raise ValueError(f"Invalid offload subgroup_bytes: {self.subgroup_bytes!r}; expected an int >= 4 "
                             f"(bytes of fp32 parameters per subgroup; default {DEFAULT_SUBGROUP_BYTES})")
        if not isinstance(self.overlap, bool):
            raise TypeError(f"Invalid offload overlap: {self.overlap!r}; expected True or False")
        n = self.accumulate_grad_batches
        if not isinstance(n, int) or isinstance(n, bool) or n < 1:
            raise ValueError(f"Invalid offload accumulate_grad_batches: {n!r}; expected an int >= 1 (the "
                             f"micro-batches of one optimizer step, Lightning's accumulate_grad_batches)")
        if isinstance(self.hardware, str):
            hardware(self.hardware)  # an unknown name fails here, naming the profiles
        elif self.hardware is not None and not isinstance(self.hardware, Hardware):
            raise TypeError(f"Invalid offload hardware: {self.hardware!r}; expected a profile name "
                            f"({sorted(PROFILES)}), an optim.offload_model.Hardware or None")
        if self.staging_bytes is not None and (not isinstance(self.staging_bytes, int) or self.staging_bytes < 0):
            raise ValueError(f"Invalid offload staging_bytes: {self.staging_bytes!r}; expected an int >= 0 or None")
        if not isinstance(self.keep_host_weights, bool):
            raise TypeError(f"Invalid offload keep_host_weights: {self.keep_host_weights!r}; expected True or False")
        if not isinstance(self.update_in_backward, bool):
            raise TypeError(f"Invalid offload update_in_backward: {self.update_in_backward!r}; expected True or False")
        if self.update_in_backward and not self.overlap:
            raise ValueError("Invalid offload settings: update_in_backward=True needs overlap=True (the update in "
                             "backward starts where the transfers do); set both, or neither")


#: The schedule of CUDA parameters where none is given (made once: it is asked for every parameter at every step).
_CUDA_DEFAULT = OffloadSchedule()


def resolve_schedule(value: Any) -> OffloadSchedule | None:
    """``BlockwiseAdamW``'s ``offload_schedule`` argument as settings: ``None`` (the default: interleaved for
    CUDA parameters, the optimizer's own step on the CPU), a mode name, or :class:`OffloadSchedule`.

    Example:
        >>> resolve_schedule("host").mode, resolve_schedule("host").subgroup_bytes
        ('host', 67108864)
        >>> resolve_schedule(3)
        Traceback (most recent call last):
        ...
        TypeError: Invalid offload_schedule: 3; expected 'interleaved', 'host', 'device', an OffloadSchedule or None
    """
    if value is None or isinstance(value, OffloadSchedule):
        return value
    if isinstance(value, str):
        if value not in MODES:
            raise ValueError(f"Invalid offload_schedule: {value!r}; allowed: {', '.join(map(repr, MODES))} "
                             f"(or an OffloadSchedule for the subgroup size, overlap and rates)")
        return OffloadSchedule(value)  # type: ignore[arg-type] - checked above
    raise TypeError(f"Invalid offload_schedule: {value!r}; expected {', '.join(map(repr, MODES))}, "
                    f"an OffloadSchedule or None")


# ---------------------------------------------------------------------------- streams


class Lane:
    """A CUDA stream of the schedule, or on the CPU its stand-in: every task runs at once, in order, so
    :meth:`record` gives no event and :meth:`wait` has nothing to wait for (:class:`DeferredLanes`: a stand-in
    whose tasks run later, for tests of the ordering)."""

    def __init__(self, device: torch.device) -> None:
        self.stream = torch.cuda.Stream(device) if device.type == "cuda" else None

    def __call__(self) -> ContextManager[Any]:
        """Enter the stream (what is allocated in it is allocated for it)."""
        return torch.cuda.stream(self.stream) if self.stream is not None else nullcontext()

    def run(self, task: Callable[[], None]) -> None:
        """Queue ``task``'s device work on the stream (on the CPU: run it now)."""
        with self():
            task()

    def keep(self, tensor: Tensor) -> None:
        """Tell the caching allocator that the stream uses ``tensor`` (made on another stream)."""
        if self.stream is not None:
            tensor.record_stream(self.stream)

    def finish(self) -> None:
        """Make the device's current stream wait for this one, and the host for both: the work queued is done."""
        if self.stream is not None:
            torch.cuda.current_stream(self.stream.device).wait_stream(self.stream)
            self.stream.synchronize()

    def record(self) -> Any:
        """An event after the work queued so far (``None`` on the CPU: it is done)."""
        if self.stream is None:
            return None
        event = torch.cuda.Event(enable_timing=True)
        event.record(self.stream)
        return event

    def wait(self, event: Any) -> None:
        """Queue the rest after ``event`` (device-side: the host does not wait)."""
        if self.stream is not None and event is not None:
            self.stream.wait_event(event)

    def wait_current(self) -> None:
        """Queue the rest after the work queued on the device's current stream (the gradients of backward)."""
        if self.stream is not None:
            self.stream.wait_stream(torch.cuda.current_stream(self.stream.device))


def synchronize(event: Any) -> None:
    """Wait on the host until ``event`` has happened (nothing on the CPU)."""
    if event is not None:
        event.synchronize()


class DeferredLanes:
    """Lanes whose tasks run later, as a GPU's streams run them: each lane in its own order, after the events it
    waits for, the lanes interleaved in a random order (``seed``), a task run when the host waits for an event
    that needs it. Tests set ``OffloadScheduler.lane_factory`` to one: a wait the schedule forgot shows as wrong
    numbers, a wait that can never end as an error."""

    def __init__(self, seed: int = 0) -> None:
        import random

        self.rng = random.Random(seed)
        self.lanes: list[_DeferredLane] = []

    def __call__(self, device: torch.device) -> "_DeferredLane":
        lane = _DeferredLane(self)
        self.lanes.append(lane)
        return lane

    def drive(self, done: Callable[[], bool]) -> None:
        """Run queued tasks, a random runnable lane at a time, until ``done()``."""
        while not done():
            runnable = [lane for lane in self.lanes if lane.runnable()]
            if not runnable:
                raise RuntimeError("deferred lanes: the host waits for an event no lane can reach (a wait cycle)")
            self.rng.choice(runnable).run_one()


class _Mark:
    """An event of a deferred lane: reached once the lane has run its first ``at`` entries."""

    def __init__(self, lane: "_DeferredLane", at: int) -> None:
        self.lane, self.at = lane, at

    def reached(self) -> bool:
        return self.lane.ran >= self.at

    def synchronize(self) -> None:
        self.lane.hub.drive(self.reached)


class _DeferredLane(Lane):
    def __init__(self, hub: DeferredLanes) -> None:
        self.stream = None
        self.hub = hub
        self.queue: list[tuple[str, Any]] = []  # ("task", fn) or ("wait", mark)
        self.ran = 0

    def run(self, task: Callable[[], None]) -> None:
        self.queue.append(("task", task))

    def record(self) -> _Mark:
        return _Mark(self, len(self.queue))

    def wait(self, event: Any) -> None:
        if event is not None:
            self.queue.append(("wait", event))

    def runnable(self) -> bool:
        if self.ran >= len(self.queue):
            return False
        kind, what = self.queue[self.ran]
        return kind == "task" or what.reached()

    def run_one(self) -> None:
        kind, what = self.queue[self.ran]
        if kind == "task":
            what()
        self.ran += 1

    def finish(self) -> None:
        self.hub.drive(lambda: all(lane.ran >= len(lane.queue) for lane in self.hub.lanes))


def _carve(buffer: Tensor, specs: Sequence[tuple[torch.dtype, int]]) -> list[Tensor]:
    """Flat tensors of ``specs`` (dtype, elements) carved out of the byte tensor ``buffer``, each aligned."""
    out, at = [], 0
    for dtype, n in specs:
        size = torch.empty((), dtype=dtype).element_size()
        out.append(buffer[at : at + n * size].view(dtype))
        at += -(-n * size // _ALIGN) * _ALIGN
    return out


def _carved_bytes(specs: Sequence[tuple[torch.dtype, int]]) -> int:
    return sum(-(-n * torch.empty((), dtype=d).element_size() // _ALIGN) * _ALIGN for d, n in specs)


# ---------------------------------------------------------------------------- the layout


@dataclass
class Layout:
    """The subgroups of one device's scheduled parameters, and the path the model chose for each."""

    key: tuple
    groups: list[list[Tensor]]  # each subgroup's parameters
    on_device: list[bool]
    predicted: dict[str, float]  # seconds of the update phase: the chosen schedule's and host-only's
    group_of: dict[Tensor, int] = field(default_factory=dict)

    def __post_init__(self) -> None:
        self.group_of = {p: i for i, ps in enumerate(self.groups) for p in ps}


def pack(params: Sequence[Tensor], subgroup_bytes: int) -> list[list[Tensor]]:
    """``params`` (in the order their gradients become final) in subgroups of at most ``subgroup_bytes`` of
    fp32 parameters; a larger tensor is a subgroup of its own (its step counts are one tensor's).

    Example:
        >>> ps = [torch.zeros(10), torch.zeros(30), torch.zeros(5)]
        >>> [[p.numel() for p in g] for g in pack(ps, 4 * 16)]
        [[10], [30], [5]]
        >>> [[p.numel() for p in g] for g in pack(ps, 4 * 40)]
        [[10, 30], [5]]
    """
    cap = max(subgroup_bytes // 4, 1)
    out: list[list[Tensor]] = []
    current: list[Tensor] = []
    size = 0
    for p in params:
        n = p.numel()
        if current and size + n > cap:
            out.append(current)
            current, size = [], 0
        current.append(p)
        size += n
    if current:
        out.append(current)
    return out


def _profile_for(device: torch.device) -> Hardware:
    """The profile matching a GPU's name (``h100-pcie5`` where none does, and on the CPU)."""
    if device.type == "cuda":
        name = torch.cuda.get_device_name(device).lower()
        if "h200" in name:
            return PROFILES["h200"]
        if "h100" in name:
            return PROFILES["h100-pcie5" if "pcie" in name else "h100-sxm"]
        if "a100" in name:
            return PROFILES["a100-pcie4"]
    return PROFILES["h100-pcie5"]


# ---------------------------------------------------------------------------- the part


class OffloadScheduler:
    """The scheduled update of an optimizer's ``offload`` parameters (the module docstring).

    Holds: the settings, each device's :class:`Layout` (rebuilt when the scheduled parameters change), the overlap
    hooks and the copies they made in this window, and the measured rates (:attr:`measured`).

    Needs: the records table, the optimizer's :class:`~lightning_baoc.optim.stepping.StepDispatcher` (its seed,
    skip test, rounding keys and warnings: one decision in one place), the format registry, and whether the
    optimizer's steps are atomic (then nothing is scheduled).

    Example:
        >>> opt = BlockwiseAdamW(model.named_parameters(), state_format="offload", offload_schedule="interleaved")  # doctest: +SKIP
        >>> opt._offload.last  # the last step's subgroups, paths, predicted and measured seconds  # doctest: +SKIP
    """

    def __init__(self, records: dict[Tensor, Record], stepper: Any, registry: Mapping[str, StateFormat],
                 settings: OffloadSchedule | None, atomic: bool, release: Any = None) -> None:
        self.records = records
        self.stepper = stepper
        self.registry = registry
        self.settings = settings
        self.atomic = atomic
        self.release = release  # the optimizer's gradient release (its ``enabled``): its hooks step the parameters
        self.worker: ThreadPoolExecutor | None = None  # the CPU's updates in backward, on CUDA
        self.hyper_of: Any = None  # the optimizer's hyperparameters of a group (a weak method: no cycle)
        self.groups: dict[int, Mapping[str, Any]] = {}  # the param groups of the last step, by index
        self.layouts: dict[torch.device, Layout] = {}
        self.stale: set[torch.device] = set()  # devices whose layout is chosen again at the next step (new rates)
        self.lanes: dict[torch.device, dict[str, Lane]] = {}
        #: makes each lane: :class:`Lane` (CUDA streams; on the CPU, at once), or a test's :class:`DeferredLanes`
        self.lane_factory: Callable[[torch.device], Lane] = Lane
        self.handles: dict[Tensor, RemovableHandle] = {}
        self.fired: dict[Tensor, int] = {}  # hook calls in this window, per parameter
        self.pending: dict[tuple[torch.device, int], int] = {}  # gradients a subgroup still waits for
        self.prefetched: dict[tuple[torch.device, int], _Copies] = {}  # copies made in backward
        self.host_buffers: dict[tuple[torch.device, Any], Tensor] = {}  # pinned buffers, kept across steps
        #: each host-path weight's host copy, and (version, storage, step count) of the weight it holds, if any
        self.mirrors: dict[Tensor, tuple[Tensor, tuple | None]] = {}
        self.measured: dict[str, float] = {}  # rates measured, EMA (h2d, d2h, cpu_adam, gpu_adam)
        #: the last step's figures, per device: subgroups, paths, predicted and measured seconds, copies reused
        self.last: dict[str, Any] = {}
        #: transfers started in backward, and what became of them (used, taken again, dropped: layout or window gone)
        self.counters = {"prefetched": 0, "reused": 0, "retaken": 0, "dropped": 0, "updated_in_backward": 0}

    # ------------------------------------------------------------------ which parameters

    def settings_for(self, device: torch.device) -> OffloadSchedule | None:
        """The settings of ``device``'s parameters: the given ones, or by default interleaved on CUDA and none
        (the optimizer's own step, as before) on the CPU."""
        if self.settings is not None:
            return self.settings
        return _CUDA_DEFAULT if device.type == "cuda" else None

    def serves(self, p: Tensor, rec: Record, hyper: StepHyper) -> bool:
        """Whether ``p`` (``rec``: its record) is updated here: a dense, contiguous parameter held in an
        offloaded AdamW format, without a master-weight correction, not sharded, of an optimizer whose steps are
        not atomic."""
        if self.atomic or rec.format is None or hyper.rule != "adamw":
            return False
        fmt = self.registry[rec.format]
        grad = p.grad
        return (fmt.offloaded and fmt.kernel_kinds is not None and rec.master_correction is None
                and not is_sharded(p) and not framed(rec.views) and p.is_contiguous() and p.numel() > 0
                and grad is not None and grad.is_contiguous() and grad.shape == p.shape
                and self.settings_for(p.device) is not None)

    # ------------------------------------------------------------------ the step

    @torch.no_grad()
    def step(self, batches: Sequence[tuple[int, Mapping[str, Any], list[Tensor]]],
             hyper_of: Callable[[Mapping[str, Any]], StepHyper],
             found_inf: Tensor | None = None) -> list[tuple[int, Mapping[str, Any], list[Tensor]]]:
        """Update the scheduled parameters of ``batches`` (per param group: its index, the group, its parameters
        with gradients) and return the batches of the others, for the optimizer's own step. ``found_inf``: AMP's
        scaler's (``amp_scaling``, :mod:`lightning_baoc.optim.amp`); where set, nothing is updated here and every
        parameter goes to the optimizer's own step, which skips the whole step."""
        if found_inf is not None and bool(found_inf):  # read on the host: the schedule's copies wait for it anyway
            self._collect_backward_updates()  # an update in backward on scaled gradients is refused there
            self.prefetched.clear()
            self._new_window()
            return list(batches)
        hypers: dict[int, StepHyper] = {}
        scheduled: dict[torch.device, list[Tensor]] = {}
        rest = []
        self.hyper_of = weakref.WeakMethod(hyper_of) if hasattr(hyper_of, "__self__") else lambda: hyper_of
        try:
            done = self._collect_backward_updates()  # refused, naming the setting, where they no longer hold
            for index, group, params in batches:
                self.groups[index] = group
                hyper = hypers[index] = hyper_of(group)
                left = []
                for p in params:
                    if self.serves(p, self.records[p], hyper):
                        scheduled.setdefault(p.device, []).append(p)
                    elif p not in done:
                        left.append(p)
                if left:
                    rest.append((index, group, left))
            for device, params in scheduled.items():
                unscheduled = self._step_device(device, params, hypers, done)
                for index, group, params in batches:  # a subgroup updated in backward in part: the rest goes on
                    left = [p for p in params if p in unscheduled]
                    if left:
                        rest.append((index, group, left))
        finally:
            self.prefetched.clear()  # what this window's step did not use is stale from now on
            self._new_window()
        return rest

    def _collect_backward_updates(self) -> set[Tensor]:
        """The parameters whose update ran in backward (:attr:`OffloadSchedule.update_in_backward`), once it is
        done and their weights are up; a gradient written after its update is refused, naming the setting."""
        done: set[Tensor] = set()
        devices = set()
        for (device, _), copies in list(self.prefetched.items()):
            if copies.update is None:
                continue
            copies.update.result()  # the worker's error, if any, is raised here
            changed = [self.records[p].name for p, before in zip(copies.group, copies.grad_versions)
                       if _grad_version_of(p) != before]
            if not changed and not copies.same_gradients():
                changed = [self.records[copies.group[0]].name]
            if changed:
                raise RuntimeError(
                    f"BlockwiseAdamW offload_schedule with update_in_backward=True: the gradient of {changed[0]!r} was "
                    f"written after its update ran in backward (global-norm clipping, AMP's GradScaler.unscale_, or "
                    f"more micro-batches than accumulate_grad_batches): that update used the gradient backward left. "
                    f"Set OffloadSchedule(update_in_backward=False) (the transfers still overlap backward and every "
                    f"update waits for step()), or train without clipping and loss scaling.")
            done.update(copies.group)
            devices.add(device)
        for device in devices:
            self._lanes(device)["host_h2d"].finish()  # the host copies are written again once their uploads are done
        return done

    def _step_device(self, device: torch.device, params: list[Tensor], hypers: dict[int, StepHyper],
                     done: set[Tensor]) -> set[Tensor]:
        """Update ``params`` of ``device`` (but the subgroups ``done`` in backward); returns the parameters of a
        subgroup done in part (a layout that changed since), for the optimizer's own step."""
        settings = self.settings_for(device)
        assert settings is not None  # serves() said so
        layout = self._layout(device, params[::-1], settings)  # backward makes the last layers' gradients first
        lanes = self._lanes(device)
        started = time.perf_counter()
        seconds: dict[str, float] = {}
        partial = {i for i, g in enumerate(layout.groups) if any(p in done for p in g)}
        unscheduled = {p for i in partial for p in layout.groups[i] if p not in done}
        device_groups = [i for i, d in enumerate(layout.on_device) if d and i not in partial]
        host_groups = [i for i, d in enumerate(layout.on_device) if not d and i not in partial]
        events: list[tuple[str, Any, Any, int]] = []  # (resource, start event, end event, elements) for the rates
        # the staging buffers stay referenced until every lane is done with them: freed earlier, the caching
        # allocator could hand their memory out again on the stream they were made on while another still reads them
        staging = self._device_path(device, layout, device_groups, hypers, lanes, events)
        self._host_path(device, layout, host_groups, hypers, lanes, events, seconds)
        for lane in lanes.values():  # the update phase ends here: the next forward reads the new weights
            lane.finish()
        wall = time.perf_counter() - started
        self._recalibrate(device, settings, events, seconds)
        self.last[str(device)] = {
            "subgroups": len(layout.groups), "on_device": list(layout.on_device),
            "elements": [sum(p.numel() for p in g) for g in layout.groups],
            "predicted_s": dict(layout.predicted), "measured_s": wall,
            # working memory of the update phase: the device path's staging (at most staging_bytes), the host's
            # copies of the weights and its pinned gradient buffers
            "staging_bytes": _staged_bytes(staging),
            "host_bytes": self.host_bytes(),
        }
        del staging
        if settings.overlap:
            self._attach(device, layout)
        return unscheduled

    # ------------------------------------------------------------------ layout and model

    def _layout(self, device: torch.device, params: list[Tensor], settings: OffloadSchedule) -> Layout:
        key = (settings, tuple((self.records[p].name, p.numel(), p.dtype, p.grad.dtype) for p in params))
        layout = self.layouts.get(device)
        if layout is not None and layout.key == key and device not in self.stale:
            return layout
        self.stale.discard(device)
        groups = pack(params, settings.subgroup_bytes)
        model = [Subgroup(sum(p.numel() for p in g), grad_bytes=g[0].grad.element_size(),
                          weight_bytes=g[0].element_size(), weight_down=not settings.keep_host_weights) for g in groups]
        hw = self.hardware(device, settings)
        free = self._free_memory(device, settings)
        host = simulate(model, [False] * len(model), hw)
        if settings.mode == "host":
            chosen = host
        elif settings.mode == "device":
            chosen = simulate(model, [True] * len(model), hw, free)
            if not chosen.fits:
                need = staging_bytes(model, chosen.on_device)
                raise RuntimeError(
                    f"offload_schedule='device': the device path stages {need} bytes (two subgroups' m and v), "
                    f"more than the {free} bytes free on {device}. Use a smaller subgroup_bytes, 'interleaved' "
                    f"(it keeps what does not fit on the host) or 'host'")
        else:
            chosen = choose(model, hw, free)
        self._drop_prefetched(device)
        self._detach(device)
        layout = self.layouts[device] = Layout(key, groups, list(chosen.on_device),
                                               {"chosen": chosen.seconds, "host": host.seconds})
        return layout

    def hardware(self, device: torch.device, settings: OffloadSchedule) -> Hardware:
        """The rates the model plans with: the settings' profile, else the device's, with the rates measured in
        training in place of the profile's where no profile was named (:meth:`_recalibrate`)."""
        if isinstance(settings.hardware, Hardware):
            return settings.hardware
        if isinstance(settings.hardware, str):
            return hardware(settings.hardware)
        base = _profile_for(device)
        return calibrated(base, **self.measured) if self.measured else base

    def _free_memory(self, device: torch.device, settings: OffloadSchedule) -> int | None:
        """Device memory the device path may stage: the settings' bound, and on CUDA the memory free now plus what
        the caching allocator holds unused (activations are gone by the update phase)."""
        bound = settings.staging_bytes
        if device.type != "cuda":
            return bound
        free, _ = torch.cuda.mem_get_info(device)
        free += torch.cuda.memory_reserved(device) - torch.cuda.memory_allocated(device)
        return free if bound is None else min(free, bound)

    def _recalibrate(self, device: torch.device, settings: OffloadSchedule, events: list[tuple[str, Any, Any, int]],
                     seconds: dict[str, float]) -> None:
        """Fold this step's measured rates into :attr:`measured` (an average over steps: each step weighs 1/4):
        the CUDA events' times of each resource's tasks, and the CPU's wall time of its AdamW. A rate that moved
        by more than a quarter makes the next step choose again (interleaved, at the rates measured: no profile
        named); the hooks of overlap keep the layout until then."""
        totals: dict[str, list[float]] = {}
        for resource, start, end, amount in events:
            if not (isinstance(start, torch.cuda.Event) and isinstance(end, torch.cuda.Event)):
                continue  # the CPU's stand-ins time nothing
            ms = start.elapsed_time(end)
            if ms > 0:
                t = totals.setdefault(resource, [0.0, 0.0])
                t[0] += ms / 1e3
                t[1] += amount
        if "cpu" in seconds and seconds["cpu"] > 0:
            totals["cpu_adam"] = [seconds["cpu"], seconds["cpu_elements"]]
        moved = False
        for resource, (s, amount) in totals.items():
            if s <= 0 or amount <= 0:
                continue
            rate = amount / s
            old = self.measured.get(resource)
            new = rate if old is None else 0.75 * old + 0.25 * rate
            self.measured[resource] = new
            moved |= old is None or abs(new - old) > 0.25 * old
        if moved and settings.mode == "interleaved" and settings.hardware is None:
            self.stale.add(device)

    # ------------------------------------------------------------------ the device path

    def _device_path(self, device: torch.device, layout: Layout, indices: list[int], hypers: dict[int, StepHyper],
                     lanes: dict[str, Lane], events: list) -> list[Any]:
        """State up, the device's fused fp32 step, state down, for the subgroups ``indices``: each stages its
        ``m`` and ``v`` in one of two buffers (the subgroup two before it in the same buffer is down first).
        Returns the staging buffers (and the moments staged in backward), to be kept until the lanes are done."""
        keep: list[Any] = []
        if not indices:
            return keep
        params = [p for i in indices for p in layout.groups[i]]
        finite = iter(self.stepper.finite_mask(params))  # one read of the gradients' finiteness per step
        up, compute, down = lanes["dev_h2d"], lanes["dev_compute"], lanes["dev_d2h"]
        compute.wait_current()
        freed: list[Any] = [None, None]  # per buffer: the event after its last moments went down
        slots: list[Tensor | None] = [None, None]
        numel = max(sum(p.numel() for p in layout.groups[i]) for i in indices)
        width = -(-numel // 16) * 16  # v starts on a 64-byte boundary: each buffer is the model's m and v (staging_bytes)
        for k, i in enumerate(indices):
            group = layout.groups[i]
            slot = k % 2
            for p in group:  # stepped on the device: a host copy of its weight would be stale
                self.mirrors.pop(p, None)
            prefetched = self.prefetched.pop((device, i), None)
            keep.append(prefetched)
            staged = prefetched.staged if prefetched is not None and prefetched.valid(self.records) else None
            if staged is None:
                if slots[slot] is None:
                    with up():
                        slots[slot] = torch.empty(2 * width, dtype=torch.float32, device=device)
                m_all, v_all = slots[slot][:numel], slots[slot][width : width + numel]
                staged, at = [], 0
                for p in group:
                    n = p.numel()
                    staged.append({"exp_avg": m_all[at : at + n], "exp_avg_sq": v_all[at : at + n]})
                    at += n
                up.wait(freed[slot])
                start = up.record()
                up.run(_copier([(s[k], self.records[p].views[k]) for p, s in zip(group, staged)
                                for k in ("exp_avg", "exp_avg_sq")]))
                events.append(("h2d", start, up.record(), STATE_BYTES * at))
                if prefetched is not None:
                    self.counters["retaken"] += 1
            else:
                self.counters["reused"] += 1
            compute.wait(up.record())
            by_group: dict[int, list[StepItem]] = {}
            skipped = []
            for p, views in zip(group, staged):
                rec = self.records[p]
                if not next(finite):
                    rec.nonfinite += 1
                    skipped.append(rec)
                    continue
                hyper = hypers[rec.group]
                step, m_step = rec.advance(True)
                bc1 = 1.0 - hyper.beta1**m_step
                bc2 = 1.0 - hyper.beta2**step
                by_group.setdefault(rec.group, []).append(StepItem(
                    p.detach(), p.grad, views, bc1, bc2, step if step == m_step else None,
                    self.stepper.noise_key(rec, step=step), m_step))
            if skipped:
                self.stepper.warn_skipped(skipped)
            start = compute.record()
            compute.run(lambda by_group=by_group: [_fp32_step(items, hypers[index]) for index, items in by_group.items()])
            stepped = compute.record()
            events.append(("gpu_adam", start, stepped, sum(p.numel() for p in group)))
            down.wait(stepped)
            start = down.record()
            down.run(_copier([(self.records[p].views[k], views[k]) for p, views in zip(group, staged)
                              for k in ("exp_avg", "exp_avg_sq")]))
            freed[slot] = down.record()
            events.append(("d2h", start, freed[slot], STATE_BYTES * sum(p.numel() for p in group)))
        keep.extend(slots)
        return keep

    # ------------------------------------------------------------------ the host path

    def _host_path(self, device: torch.device, layout: Layout, indices: list[int], hypers: dict[int, StepHyper],
                   lanes: dict[str, Lane], events: list, seconds: dict[str, float]) -> None:
        """Weights and gradients down, the CPU's AdamW, weights up, for the subgroups ``indices``: the copies down
        of the next subgroup are queued before the CPU updates this one (double buffers)."""
        if not indices:
            return
        down, up = lanes["host_d2h"], lanes["host_h2d"]
        down.wait_current()
        up.wait_current()  # the weights are written after whatever backward queued that reads them
        uploaded: list[Any] = [None, None]  # per buffer: the event after its weights went up
        copies: dict[int, _Copies] = {}

        def issue(k: int) -> None:
            i = indices[k]
            prefetched = self.prefetched.pop((device, i), None)
            if prefetched is not None and prefetched.valid(self.records):
                self.counters["reused"] += 1
                copies[k] = prefetched
                return
            if prefetched is not None:
                self.counters["retaken"] += 1
            down.wait(uploaded[k % 2])
            copies[k] = self._copy_down(device, layout.groups[i], ("slot", k % 2), down, events)

        cpu_s, cpu_n = 0.0, 0
        issue(0)
        for k, i in enumerate(indices):
            if k + 1 < len(indices):
                issue(k + 1)
            held = copies.pop(k)
            synchronize(held.ready)
            t0 = time.perf_counter()
            self._cpu_adam(layout.groups[i], held, hypers)
            cpu_s += time.perf_counter() - t0
            cpu_n += sum(p.numel() for p in layout.groups[i])
            start = up.record()
            up.run(self._uploader(layout.groups[i], held.weights))
            uploaded[k % 2] = up.record()
            events.append(("h2d", start, uploaded[k % 2], sum(p.numel() * p.element_size() for p in layout.groups[i])))
        seconds["cpu"], seconds["cpu_elements"] = cpu_s, cpu_n

    def _copy_down(self, device: torch.device, group: list[Tensor], buffer: Any, lane: Lane, events: list) -> _Copies:
        """Host copies of ``group``'s gradients (at their widths) in the pinned buffer named ``buffer``, and of the
        weights whose host copy (:meth:`_mirror`) no longer holds, queued on ``lane``."""
        specs = [(p.grad.dtype, p.numel()) for p in group]
        size = _carved_bytes(specs)
        key = (device, buffer)
        held = self.host_buffers.get(key)
        if held is None or held.numel() < size:
            held = self.host_buffers[key] = torch.empty(size, dtype=torch.uint8, pin_memory=device.type == "cuda")
        grads = _carve(held, specs)
        weights = []
        pairs = []  # (host copy, device tensor)
        moved = size
        for p, g in zip(group, grads):
            mirror, holds = self._mirror(p)
            if not holds:
                pairs.append((mirror, p.detach().view(-1)))
                moved += p.numel() * p.element_size()
            weights.append(mirror)
            pairs.append((g, p.grad.view(-1)))
            lane.keep(p.grad)
        start = lane.record()
        lane.run(_copier(pairs))
        ready = lane.record()
        events.append(("d2h", start, ready, moved))
        return _Copies(group, weights, grads, ready, None)

    def _mirror(self, p: Tensor) -> tuple[Tensor, bool]:
        """``p``'s host copy (pinned, its width; made on first use) and whether it holds ``p``'s value: it does while
        ``p`` is as this part's last upload left it (its storage, version counter and step count unchanged; a
        write through ``p.data`` is not seen: :attr:`OffloadSchedule.keep_host_weights`)."""
        rec = self.records[p]
        known = self.mirrors.get(p)
        if known is None or known[0].dtype != p.dtype or known[0].numel() != p.numel():
            known = self.mirrors[p] = (torch.empty(p.numel(), dtype=p.dtype, pin_memory=p.device.type == "cuda"), None)
        settings = self.settings_for(p.device)
        holds = settings is not None and settings.keep_host_weights and known[1] == (p._version, p.data_ptr(), rec.step)
        return known[0], holds

    def _uploader(self, group: list[Tensor], weights: list[Tensor]) -> Callable[[], None]:
        """The task that writes ``group``'s weights from their host copies (the copies then hold: :meth:`_mirror`)."""
        def upload() -> None:
            for p, copy in zip(group, weights):
                p.detach().view(-1).copy_(copy, non_blocking=True)
                self._mirrored(p)
        return upload

    def _mirrored(self, p: Tensor) -> None:
        """``p`` was just written from its host copy: the copy holds its value (:meth:`_mirror`)."""
        self.mirrors[p] = (self.mirrors[p][0], (p._version, p.data_ptr(), self.records[p].step))

    def working_bytes(self, format_of: Callable[[Tensor, Record], str | None] | None = None) -> int:
        """The device memory the update phase works in, at most, over the devices (the report's working memory):
        a device's staging at its last step, or before one the most it may stage (two buffers of the largest
        subgroup's moments, 8 bytes per element, within ``staging_bytes``; none under the ``"host"`` schedule).
        ``format_of(p, rec)``: each parameter's format (by default the one it holds; before its first step the
        optimizer's target)."""
        largest: dict[torch.device, int] = {}
        for p, rec in self.records.items():
            fmt = rec.format if format_of is None else format_of(p, rec)
            if fmt is not None and self.registry[fmt].offloaded:
                largest[p.device] = max(largest.get(p.device, 0), p.numel())
        total = 0
        for device, numel in largest.items():
            settings = self.settings_for(device)
            if settings is None or settings.mode == "host":
                continue
            last = self.last.get(str(device))
            if last is not None:
                total += int(last["staging_bytes"])
                continue
            bound = 2 * 8 * max(numel, settings.subgroup_bytes // 4)
            total += bound if settings.staging_bytes is None else min(bound, settings.staging_bytes)
        return total

    def host_bytes(self) -> int:
        """Host memory this part holds: the weights' host copies and the gradients' pinned buffers."""
        return (sum(m.numel() * m.element_size() for m, _ in self.mirrors.values())
                + sum(b.numel() for b in self.host_buffers.values()))

    def _cpu_adam(self, group: list[Tensor], held: _Copies, hypers: dict[int, StepHyper]) -> None:
        """The CPU's AdamW over ``held``'s host copies and the host-held moments: the compiled kernel (it tests
        the gradients, advances the counts, says which it skipped), else the fused step after the host's test."""
        by_group: dict[int, list[int]] = {}
        for k, p in enumerate(group):
            by_group.setdefault(self.records[p].group, []).append(k)
        for index, members in by_group.items():
            hyper = hypers[index]
            recs = [self.records[group[k]] for k in members]
            fmt = self.registry[recs[0].format]  # type: ignore[index] - serves() checked it
            if all(kernel_serves(self.registry[r.format], held.weights[k], r.views, self.stepper.kernels)  # type: ignore[index]
                   and r.format == recs[0].format for r, k in zip(recs, members)):
                for r in recs:
                    r.apply_device_skip()
                items = [KernelItem(held.weights[k], held.grads[k], r.views, r.counts, self.stepper.salt(r))
                         for r, k in zip(recs, members)]
                skipped = compiled_step(fmt, items, hyper, self.stepper.seed, self.stepper.skip_nonfinite)
                if skipped:
                    self.stepper.warn_skipped([recs[j] for j in skipped])
                continue
            finite = self.stepper.finite_mask([_Grad(held.grads[k]) for k in members])
            items, skipped = [], []
            for r, k, ok in zip(recs, members, finite):
                if not ok:
                    r.nonfinite += 1
                    skipped.append(r)
                    continue
                step, m_step = r.advance(True)
                items.append(StepItem(held.weights[k], held.grads[k], r.views, 1.0 - hyper.beta1**m_step,
                                      1.0 - hyper.beta2**step, step if step == m_step else None,
                                      self.stepper.noise_key(r, step=step), m_step))
            if skipped:
                self.stepper.warn_skipped(skipped)
            _fp32_step(items, hyper)

    # ------------------------------------------------------------------ overlap with backward

    def _lanes(self, device: torch.device) -> dict[str, Lane]:
        lanes = self.lanes.get(device)
        if lanes is None:
            lanes = self.lanes[device] = {k: self.lane_factory(device) for k in ("host_d2h", "host_h2d", "dev_h2d", "dev_compute",
                                                                     "dev_d2h")}
        return lanes

    def _attach(self, device: torch.device, layout: Layout) -> None:
        """Hooks on the layout's parameters (those without one): a subgroup's transfers start once its
        gradients are final (:meth:`_hook`)."""
        for group in layout.groups:
            for p in group:
                if p not in self.handles and p.requires_grad:
                    self.handles[p] = p.register_post_accumulate_grad_hook(self._hook)

    def _detach(self, device: torch.device | None = None) -> None:
        for p in [p for p in self.handles if device is None or p.device == device]:
            self.handles.pop(p).remove()

    def detach(self) -> None:
        """Remove every overlap hook and drop the copies made in backward."""
        self._detach()
        self.prefetched.clear()
        self._new_window()

    def _drop_prefetched(self, device: torch.device) -> None:
        for key in [k for k in self.prefetched if k[0] == device]:
            del self.prefetched[key]
            self.counters["dropped"] += 1

    def _new_window(self) -> None:
        self.fired.clear()
        self.pending.clear()

    @torch.no_grad()
    def _hook(self, p: Tensor) -> None:
        """``p``'s gradient has accumulated: on the window's last micro-batch, count it; the subgroup's last
        gradient starts its transfers. A window ``step()`` never closed (AMP's skipped step) starts over."""
        layout = self.layouts.get(p.device)
        settings = self.settings_for(p.device)
        if layout is None or settings is None or not settings.overlap or p.grad is None:
            return
        if self.release is not None and self.release.enabled:  # release steps each parameter in its own hook
            return
        i = layout.group_of.get(p)
        if i is None:
            return
        fired = self.fired[p] = self.fired.get(p, 0) + 1
        if fired > settings.accumulate_grad_batches:  # step() was skipped: a new window
            if any(c.update is not None for c in self.prefetched.values()):
                raise RuntimeError(
                    f"BlockwiseAdamW offload_schedule with update_in_backward=True: {self.records[p].name!r} received "
                    f"a gradient again before step() was called, after subgroups were updated in backward on the "
                    f"last (AMP's GradScaler skipped the step, or accumulate_grad_batches="
                    f"{settings.accumulate_grad_batches} is fewer than the micro-batches of a step, or reentrant "
                    f"activation checkpointing delivered the gradient in parts). Set "
                    f"OffloadSchedule(update_in_backward=False), or accumulate_grad_batches to the run's.")
            self._drop_prefetched(p.device)
            self._new_window()
            fired = self.fired[p] = 1
        if fired != settings.accumulate_grad_batches:
            return
        key = (p.device, i)
        left = self.pending.get(key, len(layout.groups[i])) - 1
        self.pending[key] = left
        if left == 0:
            self._prefetch(p.device, layout, i)

    def _update_in_backward(self, group: list[Tensor], copies: _Copies, up: Lane) -> None:
        """A host-path subgroup's update in backward, once its copies are down: the CPU's AdamW at the group's
        hyperparameters now (an LR scheduler steps after ``step()``), the weights up."""
        hyper_of = self.hyper_of() if self.hyper_of is not None else None
        if hyper_of is None:
            raise RuntimeError("the optimizer of this offload schedule is gone")
        hypers = {index: hyper_of(self.groups[index]) for index in {self.records[p].group for p in group}}
        synchronize(copies.ready)
        self._cpu_adam(group, copies, hypers)
        up.wait_current()
        up.run(self._uploader(group, copies.weights))

    def _prefetch(self, device: torch.device, layout: Layout, i: int) -> None:
        """Start subgroup ``i``'s transfers: a host-path subgroup's weights and gradients down into buffers of
        its own; a device-path one's moments up, where one of the two staging buffers is free."""
        group = layout.groups[i]
        lanes = self._lanes(device)
        if not layout.on_device[i]:
            lanes["host_d2h"].wait_current()
            copies = self._copy_down(device, group, ("prefetch", i), lanes["host_d2h"], []).fingerprint()
            self.prefetched[(device, i)] = copies
            self.counters["prefetched"] += 1
            settings = self.settings_for(device)
            if settings is not None and settings.update_in_backward:
                copies.grad_versions = tuple(_grad_version_of(p) for p in group)
                self.counters["updated_in_backward"] += 1
                if device.type == "cuda":  # the CPU's AdamW off the autograd thread, while backward goes on
                    if self.worker is None:
                        self.worker = ThreadPoolExecutor(1, thread_name_prefix="offload-update")
                    copies.update = self.worker.submit(self._update_in_backward, group, copies, lanes["host_h2d"])
                else:
                    copies.update = Future()
                    self._update_in_backward(group, copies, lanes["host_h2d"])
                    copies.update.set_result(None)
            return
        order = [j for j, d in enumerate(layout.on_device) if d]
        if order.index(i) >= 2:  # the double buffers hold the first two; the others go up in step()
            return
        numel = sum(p.numel() for p in group)
        up = lanes["dev_h2d"]
        with up():
            buffer = torch.empty(2 * numel, dtype=torch.float32, device=device)
        staged, at = [], 0
        for p in group:
            n = p.numel()
            staged.append({"exp_avg": buffer[at : at + n], "exp_avg_sq": buffer[numel + at : numel + at + n]})
            at += n
        up.run(_copier([(s[k], self.records[p].views[k]) for p, s in zip(group, staged) for k in ("exp_avg", "exp_avg_sq")]))
        self.prefetched[(device, i)] = _Copies(group, [], [], up.record(), staged).taken_from(self.records)
        self.counters["prefetched"] += 1


def _copier(pairs: list[tuple[Tensor, Tensor]]) -> Callable[[], None]:
    """The task that copies each pair's source into its destination (asynchronously between pinned host memory and
    the device)."""
    def copy() -> None:
        for destination, source in pairs:
            destination.copy_(source, non_blocking=True)
    return copy


def _staged_bytes(kept: list[Any]) -> int:
    """Bytes of device storage among the device path's kept buffers and staged copies (each storage once)."""
    storages: dict[int, int] = {}
    for item in kept:
        tensor = item if isinstance(item, Tensor) else (
            item.staged[0]["exp_avg"] if isinstance(item, _Copies) and item.staged else None)
        if tensor is not None:
            storage = tensor.untyped_storage()
            storages[storage.data_ptr()] = storage.nbytes()
    return sum(storages.values())


def _norms(group: list[Tensor]) -> Tensor:
    """The 2-norms of ``group``'s gradients, fp32, stacked on their device (the same bits for the same gradients)."""
    return torch.stack(torch._foreach_norm([p.grad for p in group], 2, dtype=torch.float32))


def _grad_version_of(p: Tensor) -> tuple | None:
    g = p.grad
    return None if g is None else (g.data_ptr(), g._version)


def _fp32_step(items: list[StepItem], hyper: StepHyper) -> None:
    """torch's fused fp32 AdamW over ``items`` (the foreach step where it does not serve); a 16-bit weight or
    gradient through fp32 working copies, the weight written back (rounded to nearest) once stepped."""
    direct = [it for it in items if it.param.dtype == torch.float32 and it.grad.dtype == torch.float32]
    if direct:
        fused_dense_fp32(direct, hyper, "exp_avg", "exp_avg_sq")
    for it in items:
        if it.param.dtype != torch.float32 or it.grad.dtype != torch.float32:
            work = StepItem(it.param.float(), it.grad.float(), it.views, it.bias_correction1, it.bias_correction2,
                            it.step_count, it.noise_key, it.momentum_step)
            fused_dense_fp32([work], hyper, "exp_avg", "exp_avg_sq")
            if work.param.data_ptr() != it.param.data_ptr():
                it.param.copy_(work.param)


class _Grad:
    """A stand-in parameter whose ``grad`` is a host copy (for :meth:`StepDispatcher.finite_mask`)."""

    def __init__(self, grad: Tensor) -> None:
        self.grad = grad


@dataclass
class _Copies:
    """Copies of a subgroup's tensors: host copies of its weights and gradients, or its moments staged on the
    device, with the event after them and what they were taken from (to tell whether they still hold)."""

    group: list[Tensor]
    weights: list[Tensor]
    grads: list[Tensor]
    ready: Any
    staged: list[dict[str, Tensor]] | None
    versions: tuple = ()
    states: tuple = ()
    grad_versions: tuple = ()  # of the gradients an update in backward used
    update: Future | None = None  # that update (OffloadSchedule.update_in_backward)
    norms: Tensor | None = None  # the gradients' norms when copied (fingerprint)

    def __post_init__(self) -> None:
        self.versions = tuple(_version_of(p) for p in self.group)
        self.states = ()

    def taken_from(self, records: dict[Tensor, Record]) -> "_Copies":
        """Remember the state tensors the staged moments were copied from."""
        self.states = tuple(_states_of(records[p]) for p in self.group)
        return self

    def valid(self, records: dict[Tensor, Record]) -> bool:
        """Whether every tensor copied is as it was. Staged moments: the same state tensors (a step or a conversion
        changes them; the gradients are read in ``step()``). Host copies: the same weights and gradients, by their
        version counters (clipping, a further micro-batch) and by the gradients' norms (``GradScaler.unscale_``
        writes in place without advancing the counters)."""
        if self.staged is not None:
            return self.states == tuple(_states_of(records[p]) for p in self.group)
        return self.versions == tuple(_version_of(p) for p in self.group) and self.same_gradients()

    def fingerprint(self) -> "_Copies":
        """Remember the gradients' norms (fp32, on their device; read when :meth:`same_gradients` compares)."""
        self.norms = _norms(self.group)
        return self

    def same_gradients(self) -> bool:
        """Whether the gradients' norms are as :meth:`fingerprint` found them (no fingerprint: yes)."""
        # compared bit for bit: a NaN norm (a gradient holding NaN, skipped alike) equals itself
        return self.norms is None or bool(torch.equal(self.norms.view(torch.int32), _norms(self.group).view(torch.int32)))


def _states_of(rec: Record) -> tuple:
    """Which moments a record holds: their storages (a conversion replaces them; their version counters are the
    pool's, which every parameter's step in it advances, so they cannot tell)."""
    views = rec.views or {}
    return tuple(t.data_ptr() for t in (views.get("exp_avg"), views.get("exp_avg_sq")) if t is not None)


def _version_of(p: Tensor) -> tuple:
    """What tells a weight's and gradient's contents apart over time: their storages and version counters."""
    g = p.grad
    return (p._version, p.data_ptr(), None if g is None else (g.data_ptr(), g._version))


__all__ = ["MODES", "DeferredLanes", "Lane", "Layout", "OffloadSchedule", "OffloadScheduler", "pack", "resolve_schedule", "synchronize"]

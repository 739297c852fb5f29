"""The :class:`GradientSampler` class: the hot path, the ring buffer, statistics and state.

How it samples, and where to call it, is in the docstring of :mod:`lightning_baoc.sampling`.
"""

from __future__ import annotations

import math
import queue
import threading
import time
import weakref
from dataclasses import dataclass, field
from typing import Any, Mapping, NamedTuple, Sequence

import torch
import torch.distributed as dist
from torch import Tensor, nn

from lightning_baoc.optim.sharding import is_sharded, local, shard_group, whole_numel
from lightning_baoc.sampling import statistics as S
from lightning_baoc.sampling.blocks import partition
from lightning_baoc.sampling.gather import _gather, _merge
from lightning_baoc.sampling.layout import _Block, _check_blocks, _check_int, _plan_blocks
from lightning_baoc.sampling.reduce import (
    COSINE_SLICE,
    _anisotropy,
    _block_slices,
    _cosines,
    _ReductionMaps,
    _valid_blocks,
)
from lightning_baoc.sampling.state import STATE_VERSION, SamplerStateMixin  # noqa: F401 - STATE_VERSION: its public path

#: Staging buffers in flight between the hot path and the worker. Two let the hot path fill one
#: while the worker reduces the other; the hot path waits (a "stall", counted) only if the worker
#: is a whole sampling interval behind, so no sample is ever dropped and results stay deterministic.
STAGING_SLOTS = 2

#: Defaults, from benchmarks/sampler_overhead.py (README, "Gradient sampler overhead"): at these
#: values sampling costs about 1% of a training step of a 1.2M-parameter GPT on a 2-core CPU (at
#: every step it costs about 5%, over the 3% budget), and the ring covers ``10 * 32 = 320`` steps,
#: a typical warm-up.
DEFAULT_SAMPLE_EVERY = 10
DEFAULT_CAPACITY = 32
DEFAULT_MAX_ELEMENTS = 4096
DEFAULT_MAX_ROWS = 256


class BlockHistory(NamedTuple):
    """A block's valid samples in the ring buffer, oldest first (:meth:`GradientSampler.history`).

    Attributes:
        samples: ``(n, k)`` float32, the sampled gradient elements (loss scale divided out).
        anisotropy: ``(n,)`` float64, the CV of row norms of each sample.
        cosine: ``(n,)`` float64, cosine with the next step's gradient (nan if not sampled).
        steps: ``(n,)`` int64, the step of each sample.
    """

    samples: Tensor
    anisotropy: Tensor
    cosine: Tensor
    steps: Tensor


@dataclass
class _OpenSample:
    """A sample gathered one parameter at a time (:meth:`GradientSampler.begin` ... ``finish``)."""

    step: int
    slot: int  # the staging buffer it fills
    follower: bool  # elements only, for the cosine with the step before
    scale: float | None  # the loss scale the gradients carry
    done: set[int] = field(default_factory=set)  # ids of the segments gathered
    seen: set[int] = field(default_factory=set)  # blocks with a gradient
    copies: dict[torch.device, list[tuple[int, int]]] = field(default_factory=dict)  # ranges to copy to the host


class GradientSampler(SamplerStateMixin):
    """Samples per-block gradients every ``sample_every`` steps into a bounded ring buffer.

    Args:
        model: the model whose gradients are sampled.
        blocks: block name -> parameter names, as from :func:`~lightning_baoc.partition` (default:
            ``partition(model)``). Every name must be a trainable parameter of ``model``.
        sample_every: sample when ``step % sample_every == 0`` (default: 10). When it is more
            than 1, the step after (``step % sample_every == 1``) is sampled too, elements only, for
            the cosine of consecutive gradients (``stability``), which then does not depend on the
            interval.
        capacity: sampling steps kept in the ring buffer, oldest dropped first (default: 32).
        max_elements: gradient elements sampled per block, at most (default: 4096).
        max_rows: row norms per tensor, at most; taller tensors get every ``s``-th row from a
            random offset (default: 256).
        seed: seed of the index draws; the same seed gives the same statistics (default: 0).

    Memory is bounded by ``capacity * (4 * elements + 17 * blocks + 8)`` bytes of ring buffer, with
    ``elements <= blocks * max_elements``, plus the staging buffers; :meth:`buffer_bytes` reports
    what is allocated.

    Example:
        >>> model = torch.nn.Sequential(torch.nn.Linear(8, 8), torch.nn.Linear(8, 1))
        >>> sampler = GradientSampler(model, sample_every=1)
        >>> for step in range(4):
        ...     model.zero_grad()
        ...     model(torch.randn(16, 8)).square().mean().backward()
        ...     _ = sampler.sample(step)
        >>> stats = sampler.statistics()
        >>> {key: stats["0"][key] for key in ("samples", "elements", "numel")}
        {'samples': 4, 'elements': 72, 'numel': 72}
        >>> 0.0 <= stats["0"]["noise_fraction"] <= 1.0
        True
        >>> sampler.close()
    """

    def __init__(
        self,
        model: nn.Module,
        blocks: Mapping[str, Sequence[str]] | None = None,
        sample_every: int = DEFAULT_SAMPLE_EVERY,
        capacity: int = DEFAULT_CAPACITY,
        max_elements: int = DEFAULT_MAX_ELEMENTS,
        max_rows: int = DEFAULT_MAX_ROWS,
        seed: int = 0,
    ) -> None:
        if not isinstance(model, nn.Module):
            raise TypeError(f"model must be a torch.nn.Module, got {type(model).__name__}")
        self.sample_every = _check_int("sample_every", sample_every, 1, "sample every N-th step, N >= 1")
        self.capacity = _check_int("capacity", capacity, 2, "two samples are the least a cosine or SNR needs")
        self.max_elements = _check_int("max_elements", max_elements, 1, "at least one element per block")
        self.max_rows = _check_int("max_rows", max_rows, 2, "a coefficient of variation needs two rows")
        self.seed = _check_int("seed", seed, 0, "a non-negative integer seed")
        if blocks is None:
            blocks = partition(model)
        checked = _check_blocks(model, blocks)
        self._blocks = _plan_blocks(model, checked, self.max_elements, self.max_rows, self.seed)
        nb = len(self._blocks)
        self._elements = self._blocks[-1].elem_stop
        self._slot_len = self._blocks[-1].row_stop
        self._maps = _ReductionMaps.build(self._blocks)
        self._cosine_slices = _block_slices([b.elements for b in self._blocks], COSINE_SLICE)

        # Pinned host memory makes the device-to-host copy truly asynchronous.
        pin = torch.cuda.is_available()
        self._slots = [torch.zeros(self._slot_len, dtype=torch.float32, pin_memory=pin) for _ in range(STAGING_SLOTS)]
        self._device_buffers: dict[torch.device, Tensor] = {}
        # The ring: one row per sampling step, all blocks side by side, so the worker stores a
        # sample with one copy; a block skipped at a step (non-finite, no gradient) is marked invalid.
        self._ring = torch.zeros(self.capacity, self._elements, dtype=torch.float32)
        self._ring_valid = torch.zeros(self.capacity, nb, dtype=torch.bool)
        self._ring_anisotropy = torch.full((self.capacity, nb), math.nan, dtype=torch.float64)
        # Cosine of each ring row's gradient with the next step's (lag 1), per block.
        self._ring_cosine = torch.full((self.capacity, nb), math.nan, dtype=torch.float64)
        self._ring_steps = torch.full((self.capacity,), -1, dtype=torch.int64)
        self._written = 0  # sampling steps written since the last reset
        self._prev_row: tuple[int, int] | None = None  # (step, ring row) of the newest ring sample

        self._free: queue.Queue[int] = queue.Queue()
        for i in range(STAGING_SLOTS):
            self._free.put(i)
        self._queue: queue.Queue[Any] = queue.Queue()
        self._lock = threading.Lock()
        self._thread: threading.Thread | None = None
        self._finalizer: weakref.finalize | None = None
        self._error: BaseException | None = None
        self._last_step: int | None = None
        # the sample being gathered: (step, slot, follower, scale, segments done, blocks seen, copies)
        self._open: _OpenSample | None = None  # the sample being gathered (begin ... finish)
        self._segments_of: dict[Tensor, list[tuple[int, Any]]] = {}
        for bi, block in enumerate(self._blocks):
            for seg in block.segments:
                self._segments_of.setdefault(seg.param, []).append((bi, seg))
        # sharded parameters (FSDP2's rows, DeepSpeed's fragments): each rank gathers its part and a sum over
        # the ranks assembles the sample; a parameter held whole on every rank is gathered on the group's
        # first rank only
        self._shard_group = shard_group(list(self._segments_of))
        self._replica_zeros = self._shard_group is not None and dist.get_rank(self._shard_group) != 0
        # a piece whose ranks cut its rows gives its rows' parts' squared norms: rooted after the sum
        self._squared_rows = [(seg.row_offset, seg.row_offset + seg.row_count) for block in self._blocks
                              for seg in block.segments if seg.row_count and seg.piece is not None and seg.piece.cuts_rows]
        self._timing: dict[str, float | int] = {"sample_calls": 0, "hot_path_s": 0.0, "worker_s": 0.0, "stalls": 0}

    # ------------------------------------------------------------------ hot path

    @torch.no_grad()
    def sample(self, step: int, grad_scale: float | None = None) -> bool:
        """Sample the current gradients if ``step`` is a sampling step; call after backward.

        Does only gathers and row-norm reductions into a preallocated buffer (and, on an
        accelerator, one non-blocking copy to pinned host memory); everything else happens on the
        worker thread. Call it on every optimizer step: it returns at once on the steps it skips. A step already sampled
        is not sampled again, so calling it on every micro-batch with the optimizer step takes the
        first micro-batch only: call it where the gradient is complete (see
        :mod:`lightning_baoc.sampling`).

        Args:
            step: the optimizer step (``trainer.global_step`` in Lightning).
            grad_scale: loss scale the gradients still carry (fp16 AMP before unscaling), divided
                out on the worker (default: ``None``, unscaled).

        Returns:
            ``True`` if this call took a sample (on ``step % sample_every`` in ``{0, 1}``, or every
            step when ``sample_every`` is 1).
        """
        if not self.begin(step, grad_scale):
            return False
        t0 = time.perf_counter()
        for bi, block in enumerate(self._blocks):
            for seg in block.segments:
                self._gather_segment(bi, seg, seg.param.grad)
        self._timing["hot_path_s"] += time.perf_counter() - t0
        return self.finish()

    def is_sampling_step(self, step: int) -> bool:
        """Whether :meth:`sample` (or :meth:`begin`) takes a sample at ``step``."""
        phase = step % self.sample_every
        follower = self.sample_every > 1 and phase == 1
        return (phase == 0 or follower) and step != self._last_step

    @torch.no_grad()
    def begin(self, step: int, grad_scale: float | None = None) -> bool:
        """Open a sample of ``step`` gathered one parameter at a time (:meth:`gather_param`, then
        :meth:`finish`): the path of gradient release, where each gradient lives only inside its
        hook. :meth:`sample` is ``begin``, a gather of every parameter and ``finish``; the two paths
        store the same numbers. Returns whether ``step`` is sampled (as :meth:`sample`)."""
        if self._open is not None:
            raise RuntimeError(f"GradientSampler: the sample of step {self._open.step} is still open; finish() or abort() it first")
        if not self.is_sampling_step(step):
            return False
        if grad_scale is not None and not (math.isfinite(grad_scale) and grad_scale > 0):
            raise ValueError(f"grad_scale must be a finite number > 0 (the loss scale), got {grad_scale!r}")
        self._raise_worker_error()
        self._ensure_worker()
        t0 = time.perf_counter()  # wall time: the hot path holds up training for all of it
        try:
            slot = self._free.get_nowait()
        except queue.Empty:
            self._timing["stalls"] += 1
            slot = self._free.get()
        follower = self.sample_every > 1 and step % self.sample_every == 1
        self._open = _OpenSample(int(step), slot, follower, None if grad_scale is None else float(grad_scale))
        self._timing["hot_path_s"] += time.perf_counter() - t0
        return True

    @torch.no_grad()
    def gather_param(self, param: Tensor, grad: Tensor | None = None) -> None:
        """Gather ``param``'s segments from ``grad`` (default: ``param.grad``) into the open sample;
        a parameter no block holds, or one gathered already, is ignored."""
        if self._open is None:
            return
        t0 = time.perf_counter()
        grad = param.grad if grad is None else grad
        for bi, seg in self._segments_of.get(param, ()):
            if id(seg) not in self._open.done:
                self._gather_segment(bi, seg, grad)
        self._timing["hot_path_s"] += time.perf_counter() - t0

    def _gather_segment(self, bi: int, seg: Any, grad: Tensor | None) -> None:
        sample = self._open
        assert sample is not None
        device = torch.device("cpu") if grad is None else grad.device
        if grad is not None or (seg.piece is not None and not seg.param.numel()):
            sample.seen.add(bi)  # a piece with no elements here: the ranks holding the rest gather it
            if seg.piece is None and self._replica_zeros and (not is_sharded(grad) or local(grad).shape == grad.shape):
                grad = None  # another rank gathers this replicated gradient: zeros here
        sample.done.add(id(seg))
        if device.type == "cpu":
            _gather(seg, grad, self._slots[sample.slot], device, with_rows=not sample.follower)
        else:
            _gather(seg, grad, self._device_buffer(device), device, with_rows=not sample.follower)
            ranges = sample.copies.setdefault(device, [])
            ranges.append((seg.elem_offset, seg.elem_offset + seg.elem_count))
            if not sample.follower:
                ranges.append((seg.row_offset, seg.row_offset + seg.row_count))

    @torch.no_grad()
    def finish(self) -> bool:
        """Close the open sample and hand it to the worker: segments not gathered yet are gathered
        from their parameters' current gradients (zeros where there is none, the block counted
        missing if none of its segments had one). Returns whether a sample was taken."""
        if self._open is None:
            return False
        t0 = time.perf_counter()
        for bi, block in enumerate(self._blocks):
            for seg in block.segments:
                if id(seg) not in self._open.done:
                    self._gather_segment(bi, seg, seg.param.grad)
        sample, self._open = self._open, None
        step, slot, follower, scale = sample.step, sample.slot, sample.follower, sample.scale
        host = self._slots[slot]
        if self._shard_group is not None:  # one sum over the ranks: every rank holds the whole sample
            stop = self._elements if follower else self._slot_len  # a follower gathers no rows
            buffers = [host] if not sample.copies else [self._device_buffers[d] for d in sample.copies]
            for buf in buffers:
                dist.all_reduce(buf[:stop], group=self._shard_group)
                for a, b in self._squared_rows if not follower else ():
                    buf[a:b].sqrt_()
        missing = [bi for bi in range(len(self._blocks)) if bi not in sample.seen]
        events = []
        for device, ranges in sample.copies.items():
            for a, b in _merge(ranges):
                host[a:b].copy_(self._device_buffers[device][a:b], non_blocking=True)
            if device.type == "cuda":
                event = torch.cuda.Event()
                event.record(torch.cuda.current_stream(device))
                events.append(event)
        self._queue.put((slot, step, follower, scale, missing, events))
        self._last_step = step
        self._timing["sample_calls"] += 1
        self._timing["hot_path_s"] += time.perf_counter() - t0
        return True

    def abort(self) -> None:
        """Drop the open sample, if any (a step that ran no backward): nothing is stored."""
        if self._open is not None:
            self._free.put(self._open.slot)
            self._open = None

    def _device_buffer(self, device: torch.device) -> Tensor:
        buf = self._device_buffers.get(device)
        if buf is None:
            buf = self._device_buffers[device] = torch.zeros(self._slot_len, dtype=torch.float32, device=device)
        return buf

    # ------------------------------------------------------------------ worker

    def _ensure_worker(self) -> None:
        if self._thread is not None and self._thread.is_alive():
            return
        # The thread holds only a weak reference to the sampler, so a sampler dropped without
        # close() is still collected; the finalizer then stops the thread. It also runs at the
        # interpreter's exit, where it lets the thread finish the samples it holds and joins it: a
        # daemon thread still inside torch's C++ code while the process exits can abort it.
        self._thread = threading.Thread(
            target=_worker_loop, args=(weakref.ref(self), self._queue), name="baoc-gradient-sampler", daemon=True
        )
        self._thread.start()
        self._finalizer = weakref.finalize(self, _stop_worker, self._queue, self._thread)

    def _reduce(self, item: tuple[int, int, bool, float | None, list[int], list[Any]]) -> None:
        """Worker side: check one staging buffer; store it as a ring row, or (a follower) its cosines."""
        slot, step, follower, scale, missing, events = item
        t0 = time.thread_time()  # CPU time: waiting for the GIL or an event costs nothing
        try:
            for event in events:
                event.synchronize()
            host = self._slots[slot]
            # A follower carries elements only (its cosine needs no row norms).
            valid, hit = self._valid_blocks(host[: self._elements] if follower else host, missing)
            with self._lock:
                prev = self._prev_row
                if prev is not None and prev[0] == step - 1:
                    self._ring_cosine[prev[1]] = self._cosines(prev[1], host, valid)
                if follower:  # only its cosine with the ring row before it is kept
                    self._prev_row = None
                else:
                    pos = self._written % self.capacity
                    row = self._ring[pos]
                    row.copy_(host[: self._elements])
                    if scale is not None:
                        row.div_(scale)
                    self._ring_valid[pos] = valid
                    self._ring_anisotropy[pos] = self._anisotropy(host[self._elements :])
                    self._ring_cosine[pos] = math.nan
                    self._ring_steps[pos] = step
                    self._written += 1
                    self._prev_row = (step, pos)
                for bi in missing:
                    self._blocks[bi].missing += 1
                for bi in hit:
                    self._blocks[bi].nonfinite += 1
        finally:
            self._free.put(slot)
            self._timing["worker_s"] += time.thread_time() - t0

    def _valid_blocks(self, host: Tensor, missing: list[int]) -> tuple[Tensor, list[int]]:
        """Blocks with a finite, present sample, and the blocks with a non-finite value."""
        return _valid_blocks(host, missing, self._maps, len(self._blocks), self._elements)

    def _cosines(self, pos: int, host: Tensor, valid: Tensor) -> Tensor:
        """Per block: cosine of ring row ``pos`` with the sample in ``host`` (nan where undefined)."""
        return _cosines(self._ring[pos], host[: self._elements], valid & self._ring_valid[pos], self._maps.elem_lengths,
                        self._cosine_slices)

    def _anisotropy(self, rows: Tensor) -> Tensor:
        """Per block: numel-weighted mean over its row tensors of CV(row norms) (nan if none)."""
        return _anisotropy(rows, self._maps, len(self._blocks))

    def _raise_worker_error(self) -> None:
        if self._error is not None:
            error, self._error = self._error, None
            raise RuntimeError("GradientSampler's worker thread failed; see the cause above") from error

    # ------------------------------------------------------------------ public API

    @property
    def blocks(self) -> dict[str, list[str]]:
        """Block name -> parameter names, in the order the sampler uses."""
        return {b.name: [s.name for s in b.segments] for b in self._blocks}

    @property
    def nonfinite_count(self) -> dict[str, int]:
        """Block name -> sampling steps skipped because a sampled value was not finite."""
        self.flush()
        return {b.name: b.nonfinite for b in self._blocks}

    def indices(self, block: str) -> dict[str, Tensor]:
        """Parameter name -> the flat element indices sampled from it, in sample order.

        The elements of a block's sample are these, parameter after parameter (a reference for
        tests and tools).
        """
        b = self._block(block)
        return {
            s.name: torch.arange(whole_numel(s.param)) if s.elem_index is None else s.elem_index.clone()
            for s in b.segments
            if s.elem_count
        }

    def flush(self) -> None:
        """Wait until the worker has reduced every sample handed to it; re-raise its error if any."""
        if self._thread is not None:
            self._queue.join()
        self._raise_worker_error()

    def close(self) -> None:
        """Flush and stop the worker thread. Statistics stay available; sampling restarts it."""
        if self._thread is None:
            return
        try:
            self.flush()
        finally:
            if self._finalizer is not None:
                self._finalizer()  # _stop_worker, once: the sentinel and the join
            self._thread = None

    def __enter__(self) -> GradientSampler:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

    def reset(self) -> None:
        """Forget all samples (fresh statistics for a re-evaluation); sampling goes on as before.

        Clears the ring buffer and the non-finite and missing counts; keeps the indices and timings.
        A sample still open (:meth:`begin`) is dropped.
        """
        self.abort()
        self.flush()
        with self._lock:
            self._clear_ring()
            for b in self._blocks:
                b.nonfinite = b.missing = 0
        self._last_step = None

    def _clear_ring(self) -> None:
        self._ring.zero_()
        self._ring_valid.zero_()
        self._ring_anisotropy.fill_(math.nan)
        self._ring_cosine.fill_(math.nan)
        self._ring_steps.fill_(-1)
        self._written = 0
        self._prev_row = None

    def history(self, block: str) -> BlockHistory:
        """The valid samples of ``block`` in the ring, oldest first (see :class:`BlockHistory`)."""
        b = self._block(block)
        self.flush()
        with self._lock:
            return self._history(b, self._blocks.index(b))

    def _history(self, b: _Block, bi: int) -> BlockHistory:
        order = self._order()
        order = order[self._ring_valid[order, bi]]
        return BlockHistory(
            samples=self._ring[order, b.elem_start : b.elem_stop].clone(),
            anisotropy=self._ring_anisotropy[order, bi].clone(),
            cosine=self._ring_cosine[order, bi].clone(),
            steps=self._ring_steps[order].clone(),
        )

    def statistics(self) -> dict[str, dict[str, float | int]]:
        """Per-block statistics over the ring buffer (flushes first).

        Keys of each block's dict (numbers only, JSON-ready; ``nan`` where undefined):

        - ``samples``: valid samples of the block in the ring; ``elements``: elements per sample;
          ``numel``: elements of the block;
        - ``stability``: directional stability at lag 1, the mean cosine similarity of the
          gradients of consecutive optimizer steps (each ring sample with the step after it, see
          ``sample_every``); ``persistence``: the same at lag ``sample_every``,
          :func:`~lightning_baoc.sampling.statistics.directional_stability` of consecutive ring samples;
        - ``anisotropy``: :func:`~lightning_baoc.sampling.statistics.scale_anisotropy`, the mean over
          samples of the CV of row norms (numel-weighted over the block's matrices);
        - ``snr``: :func:`~lightning_baoc.sampling.statistics.gradient_snr`, the gradient
          **signal-to-noise ratio** over the ring (higher = less noise; its former name ``noise``
          is still read from older reports, see :data:`lightning_baoc.report.allocation.RENAMED_STATS`), and
          ``noise_fraction = 1 / (1 + snr)`` in ``[0, 1]``, the share of the gradient's power
          that is noise;
        - ``nonfinite``, ``missing``: sampling steps skipped for non-finite values / absent
          gradients (since the last reset);
        - ``first_step``, ``last_step``: steps of the oldest and newest valid sample (-1 if none).
        """
        self.flush()
        out: dict[str, dict[str, float | int]] = {}
        with self._lock:
            for bi, b in enumerate(self._blocks):
                h = self._history(b, bi)
                x, steps = h.samples, h.steps
                cv = h.anisotropy[~torch.isnan(h.anisotropy)]
                cos = h.cosine[~torch.isnan(h.cosine)]
                snr = S.gradient_snr(x)
                out[b.name] = {
                    "samples": int(x.shape[0]),
                    "stability": float(cos.mean()) if cos.numel() else math.nan,
                    "persistence": S.directional_stability(x),
                    "anisotropy": float(cv.mean()) if cv.numel() else math.nan,
                    "snr": snr,
                    "noise_fraction": S.noise_fraction(snr),
                    "nonfinite": b.nonfinite,
                    "missing": b.missing,
                    "elements": b.elements,
                    "numel": b.numel,
                    "first_step": int(steps[0]) if steps.numel() else -1,
                    "last_step": int(steps[-1]) if steps.numel() else -1,
                }
        return out

    def buffer_bytes(self) -> int:
        """Bytes the sampler holds: ring buffer, staging buffers (host and device), index tensors.

        Bounded by construction, independent of the model's size beyond its number of blocks: the
        ring is ``capacity * (4 * elements + 17 * blocks + 8)`` bytes with ``elements <= blocks *
        max_elements``; each staging buffer (two on the host, one per accelerator in use) is
        ``4 * (elements + row norms)`` bytes with at most ``max_rows`` row norms per tensor.
        """
        tensors = [*self._slots, *self._device_buffers.values(), self._ring, self._ring_valid]
        tensors += [self._ring_anisotropy, self._ring_cosine, self._ring_steps, *self._maps.tensors()]
        for b in self._blocks:
            for s in b.segments:
                tensors += [t for t in (s.elem_index,) if t is not None]
                tensors += [t for t in s._on.values() if t is not None and t.device.type != "cpu"]
        return sum(t.numel() * t.element_size() for t in tensors)

    def timings(self) -> dict[str, float | int]:
        """Cumulative cost: sampling calls, seconds on the hot path and on the worker, stalls."""
        return dict(self._timing)

    def _order(self) -> Tensor:
        """Ring rows oldest first."""
        n = min(self._written, self.capacity)
        start = self._written % self.capacity if self._written > self.capacity else 0
        return (torch.arange(n) + start) % self.capacity

    def _block(self, name: str) -> _Block:
        for b in self._blocks:
            if b.name == name:
                return b
        raise KeyError(f"unknown block {name!r}; blocks: {[b.name for b in self._blocks][:10]}")

    def __repr__(self) -> str:
        return (
            f"GradientSampler(blocks={len(self._blocks)}, sample_every={self.sample_every}, "
            f"capacity={self.capacity}, max_elements={self.max_elements}, max_rows={self.max_rows}, seed={self.seed})"
        )


def _worker_loop(ref: weakref.ReferenceType[GradientSampler], work: queue.Queue[Any]) -> None:
    """Reduce staging buffers until the sentinel ``None`` (or the sampler is collected): the worker
    thread's loop, each buffer handed to :meth:`GradientSampler._reduce`."""
    while True:
        item = work.get()
        try:
            if item is None:
                return
            sampler = ref()
            if sampler is None:
                return
            try:
                sampler._reduce(item)
            except BaseException as error:  # handed to the caller on the next flush or sample
                sampler._error = error
            del sampler
        finally:
            work.task_done()


def _stop_worker(work: queue.Queue[Any], thread: threading.Thread) -> None:
    """Stop a sampler's worker thread (the sampler was collected, or the interpreter exits): the
    sentinel after the samples it holds, then a join, unless the sampler was collected on that
    thread itself (it then returns at the sentinel)."""
    work.put(None)
    if thread is not threading.current_thread():
        thread.join()

"""GradientSampler: per-block gradient samples, handed off the hot path, reduced in the background.

Every ``sample_every`` steps (and, when that is more than 1, on the step right after, for the
lag-1 cosine), :meth:`GradientSampler.sample` takes from each block

- a fixed random subsample of at most ``max_elements`` gradient elements (indices drawn once per
  block from a ``torch.Generator`` seeded with ``seed``, so the cost and the memory do not grow
  with the model), and
- the norms of the rows (first dimension) of each of the block's matrices, at most ``max_rows``
  rows per tensor (for taller ones every ``s``-th row from a random offset: a strided view, so no
  copy, that still spans the whole tensor, e.g. the q, k and v parts of a fused projection),

with gathers into one preallocated staging buffer and, for gradients on an accelerator, one
non-blocking copy into pinned host memory. A background thread takes the staging buffer from a
queue, checks it for non-finite values, reduces the row norms to one coefficient of variation per
block and the pair of consecutive steps to one cosine per block, and writes the sample into a ring
buffer holding the last ``capacity`` sampling steps.
:meth:`GradientSampler.statistics` reduces the ring buffer with the pure functions of
:mod:`lightning_baoc.statistics`.

Where to call it: once per optimizer step, where the gradients are final. In Lightning that is
``on_before_optimizer_step``: gradients there are accumulated over the whole accumulation window,
all-reduced under DDP (so every rank samples the same synchronized gradient and computes the same
statistics; rank 0 can decide alone), unscaled under fp16 AMP, and not yet clipped. In
``on_after_backward`` they are per micro-batch and carry the loss scale: if you sample there,
sample once per window and pass ``grad_scale`` (the statistics are invariant to a scale that is
constant over the ring buffer, not to one that changes inside it).
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
from torch import Tensor, nn

from . import statistics as S
from .blocks import partition

#: Format version of :meth:`GradientSampler.state_dict`.
STATE_VERSION = 1

_FP32_MAX = torch.finfo(torch.float32).max

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


def draw_indices(n: int, k: int, generator: torch.Generator) -> Tensor:
    """``min(k, n)`` distinct indices out of ``range(n)``, uniformly at random, sorted (int64, CPU).

    Memory is ``O(k)`` for ``n >> k`` (no ``randperm(n)`` of a billion-element tensor): draws with
    replacement, deduplicates, and trims the surplus at random.

    Example:
        >>> draw_indices(10**9, 3, torch.Generator().manual_seed(0)).shape
        torch.Size([3])
        >>> draw_indices(4, 10, torch.Generator())
        tensor([0, 1, 2, 3])
    """
    if k >= n:
        return torch.arange(n, dtype=torch.int64)
    if n <= 4 * k:
        return torch.randperm(n, generator=generator)[:k].sort().values
    chosen = torch.empty(0, dtype=torch.int64)
    while chosen.numel() < k:
        extra = torch.randint(n, (2 * k,), generator=generator, dtype=torch.int64)
        chosen = torch.unique(torch.cat([chosen, extra]))
    keep = torch.randperm(chosen.numel(), generator=generator)[:k]
    return chosen[keep].sort().values


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
class _Segment:
    """One parameter of a block: what is sampled from it and where it goes in the staging buffer."""

    name: str
    param: nn.Parameter
    elem_offset: int
    elem_count: int
    elem_index: Tensor | None  # local flat indices; None = every element, in order
    row_offset: int = 0
    row_count: int = 0  # 0: the tensor gives no row norms
    row_start: int = 0  # rows row_start, row_start + row_step, ... (row_count of them)
    row_step: int = 1
    _on: dict[torch.device, Tensor | None] = field(default_factory=dict, repr=False)

    def indices_on(self, device: torch.device) -> Tensor | None:
        """The element indices on ``device`` (copied there once)."""
        if device not in self._on:
            self._on[device] = None if self.elem_index is None else self.elem_index.to(device)
        return self._on[device]


@dataclass
class _Block:
    """A block's segments and its ranges in the staging buffer and the ring."""

    name: str
    numel: int
    segments: list[_Segment]
    elem_start: int  # elements of all blocks come first in the staging buffer, block after block
    elem_stop: int
    row_start: int  # then the row norms of all blocks, block after block
    row_stop: int
    nonfinite: int = 0
    missing: int = 0  # sampling steps where no parameter of the block had a gradient

    @property
    def elements(self) -> int:
        return self.elem_stop - self.elem_start


class GradientSampler:
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
        self._blocks = self._plan(model, _check_blocks(model, blocks))
        nb = len(self._blocks)
        self._elements = self._blocks[-1].elem_stop
        self._slot_len = self._blocks[-1].row_stop
        self._build_reduction_maps()

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
        self._timing: dict[str, float | int] = {"sample_calls": 0, "hot_path_s": 0.0, "worker_s": 0.0, "stalls": 0}

    # ------------------------------------------------------------------ set-up

    def _plan(self, model: nn.Module, blocks: dict[str, list[str]]) -> list[_Block]:
        """Draw every block's indices (in block order, so the seed fixes them) and lay out the buffer."""
        params = dict(model.named_parameters())
        generator = torch.Generator().manual_seed(self.seed)
        plan: list[_Block] = []
        elem_offset = 0
        for name, names in blocks.items():
            ps = [params[n] for n in names]
            sizes = [p.numel() for p in ps]
            numel = sum(sizes)
            flat = draw_indices(numel, self.max_elements, generator)
            segments: list[_Segment] = []
            start = 0
            for pname, p, size in zip(names, ps, sizes):
                lo = int(torch.searchsorted(flat, start))
                hi = int(torch.searchsorted(flat, start + size))
                local = flat[lo:hi] - start
                every = local.numel() == size
                segments.append(_Segment(pname, p, elem_offset + lo, hi - lo, None if every else local))
                start += size
            # Rows come from the block's matrices; a block of vectors only (LayerNorm, a lone bias)
            # uses their elements as rows, so it still has a scale anisotropy.
            matrices = [p.dim() >= 2 for p in ps]
            use_rows = matrices if any(matrices) else [p.dim() == 1 for p in ps]
            for seg, use in zip(segments, use_rows):
                rows = int(seg.param.shape[0]) if seg.param.dim() >= 1 else 0
                if use and rows >= 2:
                    seg.row_step = -(-rows // self.max_rows)
                    offset = int(torch.randint(seg.row_step, (1,), generator=generator)) if seg.row_step > 1 else 0
                    seg.row_start = offset
                    seg.row_count = len(range(offset, rows, seg.row_step))
            k = flat.numel()
            plan.append(_Block(name, numel, segments, elem_offset, elem_offset + k, 0, 0))
            elem_offset += k
        row_offset = elem_offset
        for block in plan:
            block.row_start = row_offset
            for seg in block.segments:
                if seg.row_count:
                    seg.row_offset = row_offset
                    row_offset += seg.row_count
            block.row_stop = row_offset
        return plan

    def _build_reduction_maps(self) -> None:
        """Index maps that let the worker reduce all blocks' row norms with a handful of ops."""
        block_of_seg: list[int] = []
        weight: list[float] = []
        count: list[float] = []
        for bi, block in enumerate(self._blocks):
            for seg in block.segments:
                if seg.row_count:
                    block_of_seg.append(bi)
                    # A tensor's CV counts in proportion to its size in the block's anisotropy.
                    weight.append(float(seg.param.numel()))
                    count.append(float(seg.row_count))
        self._row_lengths = torch.tensor(count, dtype=torch.int64)
        self._elem_lengths = torch.tensor([b.elements for b in self._blocks], dtype=torch.int64)
        self._block_of_seg = torch.tensor(block_of_seg, dtype=torch.int64)
        self._seg_weight = torch.tensor(weight, dtype=torch.float64)
        self._seg_rows = torch.tensor(count, dtype=torch.float64)
        self._elem_bounds = torch.tensor([b.elem_stop for b in self._blocks], dtype=torch.int64)
        self._row_bounds = torch.tensor([b.row_stop for b in self._blocks], dtype=torch.int64)

    # ------------------------------------------------------------------ hot path

    @torch.no_grad()
    def sample(self, step: int, grad_scale: float | None = None) -> bool:
        """Sample the current gradients if ``step`` is a sampling step; call after backward.

        Does only gathers and row-norm reductions into a preallocated buffer (and, on an
        accelerator, one non-blocking copy to pinned host memory); everything else happens on the
        worker thread. Call it on every optimizer step: it returns at once on the steps it skips. A step already sampled
        is not sampled again, so calling it on every micro-batch with the optimizer step takes the
        first micro-batch only: call it where the gradient is complete (see the module docstring).

        Args:
            step: the optimizer step (``trainer.global_step`` in Lightning).
            grad_scale: loss scale the gradients still carry (fp16 AMP before unscaling), divided
                out on the worker (default: ``None``, unscaled).

        Returns:
            ``True`` if this call took a sample (on ``step % sample_every`` in ``{0, 1}``, or every
            step when ``sample_every`` is 1).
        """
        phase = step % self.sample_every
        follower = self.sample_every > 1 and phase == 1
        if (phase != 0 and not follower) or step == self._last_step:
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
        host = self._slots[slot]
        missing: list[int] = []
        copies: dict[torch.device, list[tuple[int, int]]] = {}
        cpu = torch.device("cpu")
        for bi, block in enumerate(self._blocks):
            seen = False
            for seg in block.segments:
                grad = seg.param.grad
                device = cpu if grad is None else grad.device
                seen = seen or grad is not None
                if device.type == "cpu":
                    _gather(seg, grad, host, device, with_rows=not follower)
                else:
                    _gather(seg, grad, self._device_buffer(device), device, with_rows=not follower)
                    ranges = copies.setdefault(device, [])
                    ranges.append((seg.elem_offset, seg.elem_offset + seg.elem_count))
                    if not follower:
                        ranges.append((seg.row_offset, seg.row_offset + seg.row_count))
            if not seen:
                missing.append(bi)
        events = []
        for device, ranges in copies.items():
            for a, b in _merge(ranges):
                host[a:b].copy_(self._device_buffers[device][a:b], non_blocking=True)
            if device.type == "cuda":
                event = torch.cuda.Event()
                event.record(torch.cuda.current_stream(device))
                events.append(event)
        scale = None if grad_scale is None else float(grad_scale)
        self._queue.put((slot, int(step), follower, scale, missing, events))
        self._last_step = step
        self._timing["sample_calls"] += 1
        self._timing["hot_path_s"] += time.perf_counter() - t0
        return True

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
        # close() is still collected; the finalizer then stops the thread.
        self._thread = threading.Thread(
            target=_worker_loop, args=(weakref.ref(self), self._queue), name="baoc-gradient-sampler", daemon=True
        )
        self._thread.start()
        self._finalizer = weakref.finalize(self, self._queue.put, None)

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
        valid = torch.ones(len(self._blocks), dtype=torch.bool)
        if missing:
            valid[missing] = False
        # One sum says whether any value is inf/nan (a finite sum of ~1e5 gradient values cannot
        # overflow fp32 unless they are ~1e33): the per-value search runs only then.
        if math.isfinite(float(host.sum())):
            return valid, []
        bad = torch.nonzero(~torch.isfinite(host)).flatten()
        in_rows = bad >= self._elements
        hit = torch.cat(
            [
                torch.searchsorted(self._elem_bounds, bad[~in_rows], right=True),
                torch.searchsorted(self._row_bounds, bad[in_rows], right=True),
            ]
        ).unique()
        hit_list = sorted(set(hit.tolist()) - set(missing))
        valid[hit] = False
        return valid, hit_list

    def _cosines(self, pos: int, host: Tensor, valid: Tensor) -> Tensor:
        """Per block: cosine of ring row ``pos`` with the sample in ``host`` (nan where undefined)."""
        x = self._ring[pos]
        y = host[: self._elements]
        # One segmented reduction for all blocks (a Python loop over blocks costs ~10x more).
        # float64 products: the square of a finite gradient of 1e20 is past float32's maximum
        x, y = x.to(torch.float64), y.to(torch.float64)
        sums = torch.segment_reduce(torch.stack([x * y, x * x, y * y], dim=1), "sum", lengths=self._elem_lengths)
        denom = (sums[:, 1] * sums[:, 2]).sqrt()
        ok = valid & self._ring_valid[pos] & (denom > 0)
        return torch.where(ok, sums[:, 0] / denom, torch.full_like(denom, math.nan))

    def _anisotropy(self, rows: Tensor) -> Tensor:
        """Per block: numel-weighted mean over its row tensors of CV(row norms) (nan if none)."""
        nb = len(self._blocks)
        if rows.numel() == 0:
            return torch.full((nb,), math.nan, dtype=torch.float64)
        r = rows.to(torch.float64)
        sums = torch.segment_reduce(torch.stack([r, r * r], dim=1), "sum", lengths=self._row_lengths)
        mean = sums[:, 0] / self._seg_rows
        var = (sums[:, 1] / self._seg_rows - mean * mean).clamp_(min=0.0)
        cv = var.sqrt() / mean  # population std / mean, as statistics.coefficient_of_variation
        ok = torch.isfinite(cv)
        w = torch.where(ok, self._seg_weight, torch.zeros_like(cv))
        num = torch.zeros(nb, dtype=torch.float64).index_add_(0, self._block_of_seg, torch.where(ok, cv, 0.0) * w)
        den = torch.zeros(nb, dtype=torch.float64).index_add_(0, self._block_of_seg, w)
        return torch.where(den > 0, num / den, torch.full_like(num, math.nan))

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
            s.name: torch.arange(s.param.numel()) if s.elem_index is None else s.elem_index.clone()
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
            self._queue.put(None)
            self._thread.join()
            if self._finalizer is not None:
                self._finalizer.detach()
            self._thread = None

    def __enter__(self) -> GradientSampler:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

    def reset(self) -> None:
        """Forget all samples (fresh statistics for a re-evaluation); sampling goes on as before.

        Clears the ring buffer and the non-finite and missing counts; keeps the indices and timings.
        """
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
          :func:`~lightning_baoc.statistics.directional_stability` of consecutive ring samples;
        - ``anisotropy``: :func:`~lightning_baoc.statistics.scale_anisotropy`, the mean over
          samples of the CV of row norms (numel-weighted over the block's matrices);
        - ``noise``: :func:`~lightning_baoc.statistics.gradient_snr`, the gradient
          **signal-to-noise ratio** over the ring (higher = less noise), and
          ``noise_fraction = 1 / (1 + noise)`` in ``[0, 1]``;
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
                    "noise": snr,
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
        tensors += [self._ring_anisotropy, self._ring_cosine, self._ring_steps, self._row_lengths, self._block_of_seg]
        tensors += [self._seg_weight, self._seg_rows, self._elem_bounds, self._row_bounds, self._elem_lengths]
        for b in self._blocks:
            for s in b.segments:
                tensors += [t for t in (s.elem_index,) if t is not None]
                tensors += [t for t in s._on.values() if t is not None and t.device.type != "cpu"]
        return sum(t.numel() * t.element_size() for t in tensors)

    def timings(self) -> dict[str, float | int]:
        """Cumulative cost: sampling calls, seconds on the hot path and on the worker, stalls."""
        return dict(self._timing)

    def state_dict(self) -> dict[str, Any]:
        """The ring buffer and counts, as tensors and primitives (loads with ``weights_only=True``).

        Indices are not stored: they follow from ``seed``, ``max_elements``, ``max_rows`` and the
        blocks, which are stored and checked on load. Size: about the ring's bytes.
        """
        self.flush()
        with self._lock:
            order = self._order()
            return {
                "version": STATE_VERSION,
                "seed": self.seed,
                "max_elements": self.max_elements,
                "max_rows": self.max_rows,
                "sample_every": self.sample_every,
                "capacity": self.capacity,
                "last_step": -1 if self._last_step is None else int(self._last_step),
                "blocks": {
                    b.name: {
                        "params": [s.name for s in b.segments],
                        "numel": b.numel,
                        "elements": b.elements,
                        "nonfinite": b.nonfinite,
                        "missing": b.missing,
                    }
                    for b in self._blocks
                },
                "samples": self._ring[order].clone(),
                "valid": self._ring_valid[order].clone(),
                "anisotropy": self._ring_anisotropy[order].clone(),
                "cosine": self._ring_cosine[order].clone(),
                "steps": self._ring_steps[order].clone(),
            }

    def load_state_dict(self, state_dict: Mapping[str, Any]) -> None:
        """Restore what :meth:`state_dict` saved; the sampler must be built the same way.

        A smaller ``capacity`` keeps the newest samples. Raises ``ValueError`` if the seed, the
        sampling bounds or the blocks differ (the saved samples would come from other indices).
        """
        if not isinstance(state_dict, Mapping) or state_dict.get("version") != STATE_VERSION:
            got = state_dict.get("version") if isinstance(state_dict, Mapping) else type(state_dict).__name__
            raise ValueError(
                f"state_dict is not a GradientSampler state of version {STATE_VERSION} (version {got!r}); "
                "pass what GradientSampler.state_dict() returned"
            )
        for key in ("seed", "max_elements", "max_rows"):
            if state_dict[key] != getattr(self, key):
                raise ValueError(
                    f"state_dict was saved with {key}={state_dict[key]!r}, this sampler has "
                    f"{key}={getattr(self, key)!r}; build the sampler with the saved value to load it"
                )
        saved = state_dict["blocks"]
        names = [b.name for b in self._blocks]
        if list(saved) != names:
            raise ValueError(
                f"state_dict has blocks {list(saved)[:8]}, this sampler {names[:8]}; "
                "build the sampler from the same partition to load it"
            )
        for b in self._blocks:
            s = saved[b.name]
            if list(s["params"]) != [seg.name for seg in b.segments] or int(s["numel"]) != b.numel:
                raise ValueError(
                    f"block {b.name!r} was saved with parameters {list(s['params'])} ({s['numel']} elements), "
                    f"here it has {[seg.name for seg in b.segments]} ({b.numel}); use the same partition"
                )
        n = min(int(state_dict["steps"].shape[0]), self.capacity)
        self.flush()
        with self._lock:
            self._clear_ring()
            if n:
                self._ring[:n] = state_dict["samples"][-n:]
                self._ring_valid[:n] = state_dict["valid"][-n:]
                self._ring_anisotropy[:n] = state_dict["anisotropy"][-n:]
                self._ring_cosine[:n] = state_dict["cosine"][-n:]
                self._ring_steps[:n] = state_dict["steps"][-n:]
            self._written = n
            # A follower sampled right after the resume still finds the ring row it belongs to.
            self._prev_row = (int(self._ring_steps[n - 1]), n - 1) if n else None
            for b in self._blocks:
                b.nonfinite = int(saved[b.name]["nonfinite"])
                b.missing = int(saved[b.name]["missing"])
        last = int(state_dict["last_step"])
        self._last_step = None if last < 0 else last

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


def _gather(seg: _Segment, grad: Tensor | None, buf: Tensor, device: torch.device, with_rows: bool) -> None:
    """Write ``seg``'s sampled elements (and row norms) of ``grad`` into ``buf``; zeros if no grad."""
    elems = buf[seg.elem_offset : seg.elem_offset + seg.elem_count]
    rows = buf[seg.row_offset : seg.row_offset + seg.row_count] if with_rows else buf[:0]
    if grad is None:
        elems.zero_()
        rows.zero_()
        return
    if seg.elem_count:
        index = seg.indices_on(device)
        flat = grad.reshape(-1)
        if index is None:
            elems.copy_(flat)
        elif flat.dtype == torch.float32:
            torch.index_select(flat, 0, index, out=elems)
        else:
            elems.copy_(flat.index_select(0, index))
    if with_rows and seg.row_count:
        mat = grad.reshape(grad.shape[0], -1)[seg.row_start :: seg.row_step]
        # accumulated in float64: in float32 the squares of finite gradients of 1e19 sum past its
        # maximum and the sample would be dropped as non-finite. At most max_rows rows per tensor,
        # every sample_every steps. A norm beyond float32 itself saturates (it stays finite).
        if mat.device.type == "mps":  # no float64 there: scale each row by its largest value
            amax = mat.abs().amax(dim=1, keepdim=True).float().clamp_(min=torch.finfo(torch.float32).tiny)
            norms = torch.linalg.vector_norm(mat / amax, dim=1, dtype=torch.float32).mul_(amax.squeeze(1))
        else:
            norms = torch.linalg.vector_norm(mat, dim=1, dtype=torch.float64)
        rows.copy_(norms.clamp_(max=_FP32_MAX))


def _worker_loop(ref: weakref.ReferenceType[GradientSampler], work: queue.Queue[Any]) -> None:
    """Reduce staging buffers until the sentinel ``None`` (or the sampler is collected)."""
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


def _merge(ranges: list[tuple[int, int]]) -> list[tuple[int, int]]:
    """Merge touching ``[a, b)`` ranges (one copy when the blocks are laid out contiguously)."""
    out: list[tuple[int, int]] = []
    for a, b in sorted(r for r in ranges if r[1] > r[0]):
        if out and a <= out[-1][1]:
            out[-1] = (out[-1][0], max(out[-1][1], b))
        else:
            out.append((a, b))
    return out


def _check_int(name: str, value: object, minimum: int, meaning: str) -> int:
    if isinstance(value, bool) or not isinstance(value, int):
        raise TypeError(f"{name} must be an int, got {value!r} of type {type(value).__name__}")
    if value < minimum:
        raise ValueError(f"Invalid {name}={value!r}: must be >= {minimum} ({meaning})")
    return value


def _check_blocks(model: nn.Module, blocks: Mapping[str, Sequence[str]]) -> dict[str, list[str]]:
    """Validate ``blocks`` against ``model``: known trainable parameters, each in one block."""
    if not isinstance(blocks, Mapping) or not blocks:
        raise ValueError(
            f"blocks must be a non-empty mapping block name -> parameter names, got {blocks!r}; "
            "partition(model) gives one"
        )
    params = dict(model.named_parameters())
    owner: dict[str, str] = {}
    out: dict[str, list[str]] = {}
    for block, names in blocks.items():
        if isinstance(names, str) or not isinstance(names, Sequence) or not names:
            raise ValueError(f"blocks[{block!r}] must be a non-empty list of parameter names, got {names!r}")
        for n in names:
            if n not in params:
                raise ValueError(
                    f"blocks[{block!r}] names {n!r}, which is not a parameter of the model; "
                    "use names from model.named_parameters() (partition(model) gives valid blocks)"
                )
            if not params[n].requires_grad:
                raise ValueError(f"blocks[{block!r}] names {n!r}, which is frozen (requires_grad=False); drop it")
            if params[n].numel() == 0:
                raise ValueError(f"blocks[{block!r}] names {n!r}, which has zero elements; drop it")
            if n in owner:
                raise ValueError(f"Parameter {n!r} is in two blocks, {owner[n]!r} and {block!r}; keep it in one")
            owner[n] = block
        out[block] = list(names)
    return out

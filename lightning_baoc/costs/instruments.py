"""The memory of BAOC's own instruments, sized with the model: the sampler's ring and the shadow.

Besides the optimizer state, the controller holds two instruments on the host or the device:

- the :class:`~lightning_baoc.sampling.GradientSampler`'s buffers, ``4 * capacity`` bytes of ring per
  sampled element (plus staging and indices, about ``4 * capacity + 16`` in all) and at most
  ``max_elements`` sampled elements per block;
- the :class:`~lightning_baoc.risk.shadow.ShadowMoments`, 8 bytes per shadowed element and at most
  :data:`~lightning_baoc.risk.shadow.DEFAULT_SHADOW_ELEMENTS` per tensor.

Their defaults do not depend on the model's size: 40 blocks of 1M elements hold about 28 MiB of them,
9% of fp32 AdamW's state, and a 166K-parameter transformer 10 MiB, 8 times its state. A budget is a
cap on memory, so the instruments are sized from the state they watch: together they hold at most
:func:`instrument_allowance` bytes, ``max(instrument_share x`` the user's AdamW state,
:data:`INSTRUMENT_FLOOR` ``)`` (5% and 256 KiB by default). Below the floor nothing changes (a model
that small is sampled whole); above it the per-block sample and the per-tensor shadow shrink by one
common factor, never below :data:`MIN_SAMPLED` elements per block and one super-block (1024 elements)
per tensor, where the estimate may pass the allowance (the 166K-parameter transformer: 20% of its
fp32 state). The risk validation holds with instruments this small
(``docs/benchmarks/risk-validation.md``). The memory bound of a run (``docs/benchmarks/peak-memory.md``)
counts them, outside the state budget.

Example:
    >>> sizes = size_instruments({"a": [(1024, 1024)], "b": [(1024,)]}, capacity=32, max_elements=4096,
    ...                          shadow_elements=16384, allowance=2**19)
    >>> sizes.max_elements, sizes.shadow_elements, sizes.estimate_bytes <= 2**19
    (2065, 8192, True)
"""

from __future__ import annotations

import math
from collections.abc import Mapping, Sequence
from dataclasses import dataclass

from lightning_baoc.formats.quant import SUPER
from lightning_baoc.sampling import DEFAULT_MAX_ROWS, STAGING_SLOTS

#: Allowance of the instruments below which they keep their settings (bytes).
INSTRUMENT_FLOOR = 256 * 2**10

#: The default share of the user's AdamW state the instruments may hold above the floor.
DEFAULT_INSTRUMENT_SHARE = 0.05

#: Sampled gradient elements per block the sizing never goes below.
MIN_SAMPLED = 32


def instrument_allowance(baseline_state_bytes: int, share: float = DEFAULT_INSTRUMENT_SHARE) -> int:
    """Bytes the sampler and the shadow may hold together: ``max(share * baseline, INSTRUMENT_FLOOR)``.

    Example:
        >>> instrument_allowance(8 * 10**9) // 2**20  # a 1B-parameter model: 5% of 7.5 GiB
        381
        >>> instrument_allowance(8 * 10**5) == INSTRUMENT_FLOOR  # 100K parameters: 5% of 800 kB is below the floor
        True
    """
    if not (math.isfinite(share) and share >= 0.0):
        raise ValueError(f"instrument_share must be a finite number >= 0, got {share!r}")
    return max(int(share * baseline_state_bytes), INSTRUMENT_FLOOR)


def _numel(shape: Sequence[int]) -> int:
    return math.prod(int(d) for d in shape)


def sampler_bytes(shapes: Mapping[str, Sequence[Sequence[int]]], capacity: int, max_elements: int,
                  accelerator: bool = False) -> int:
    """An upper bound of :meth:`GradientSampler.buffer_bytes` over blocks of these tensor shapes.

    Per sampled element: the ring (``4 * capacity``), the staging buffers (``4`` each), its index
    (``8``) and, on an accelerator, the device buffer and the index there (``12``); per row norm
    (``max_rows`` per tensor at most) the staging and device buffers; per ring row ``17`` bytes a
    block and ``8``.
    """
    per_element = 4 * capacity + 4 * STAGING_SLOTS + 8 + (12 if accelerator else 0)
    elements = rows = 0
    for block_shapes in shapes.values():
        elements += min(sum(_numel(s) for s in block_shapes), max_elements)
        # row norms come from the block's matrices, or from its vectors when it has no matrix
        ranked = [s for s in block_shapes if len(s) >= 2] or [s for s in block_shapes if len(s) == 1]
        rows += sum(min(int(s[0]), DEFAULT_MAX_ROWS) for s in ranked)
    row_bytes = rows * (4 * STAGING_SLOTS + (4 if accelerator else 0))
    return elements * per_element + row_bytes + capacity * (17 * len(shapes) + 8) + 64 * len(shapes)


def shadow_bytes(shapes: Mapping[str, Sequence[Sequence[int]]], shadow_elements: int) -> int:
    """:meth:`ShadowMoments.nbytes` over these tensors: 8 bytes per shadowed element, 8 per super-block index."""
    out = 0
    for block_shapes in shapes.values():
        for s in block_shapes:
            n = _numel(s)
            if n <= shadow_elements:
                out += 8 * n
            else:
                k = min(max(1, shadow_elements // SUPER), n // SUPER)
                out += 8 * k * SUPER + 8 * k
    return out


@dataclass(frozen=True)
class InstrumentSizes:
    """The sampler's and the shadow's sizes for a model (:func:`size_instruments`).

    Attributes:
        max_elements: gradient elements sampled per block.
        shadow_elements: elements shadowed per tensor.
        estimate_bytes: upper bound of what they hold together.
        allowance: the bytes they may hold (:func:`instrument_allowance`).
        scaled: whether the settings were lowered to fit the allowance.
    """

    max_elements: int
    shadow_elements: int
    estimate_bytes: int
    allowance: int
    scaled: bool


def size_instruments(
    shapes: Mapping[str, Sequence[Sequence[int]]],
    capacity: int,
    max_elements: int,
    shadow_elements: int,
    allowance: int,
    accelerator: bool = False,
) -> InstrumentSizes:
    """The largest common fraction of ``max_elements`` and ``shadow_elements`` that fits ``allowance``.

    Args:
        shapes: block -> the shapes of its tensors.
        capacity: the sampler's ring capacity (kept: it is the statistics' window).
        max_elements: the sampler's setting (an upper bound here).
        shadow_elements: the shadow's elements per tensor (an upper bound here).
        allowance: bytes the two may hold (:func:`instrument_allowance`).
        accelerator: whether the gradients live on an accelerator (device buffers count too).

    Returns:
        The sizes; at :data:`MIN_SAMPLED` elements per block and one super-block per tensor the
        estimate may still exceed the allowance (a model of very many small blocks).
    """

    def sizes(f: float) -> tuple[int, int]:
        m = max(min(MIN_SAMPLED, max_elements), int(f * max_elements))
        s = max(SUPER, int(f * shadow_elements) // SUPER * SUPER) if shadow_elements > SUPER else shadow_elements
        return m, s

    def cost(m: int, s: int) -> int:
        return sampler_bytes(shapes, capacity, m, accelerator) + shadow_bytes(shapes, s)

    full = cost(max_elements, shadow_elements)
    if full <= allowance:
        return InstrumentSizes(max_elements, shadow_elements, full, allowance, scaled=False)
    lo, hi = 0.0, 1.0  # cost(sizes(lo)) fits or lo is the floor; cost(sizes(hi)) does not fit
    for _ in range(40):
        mid = 0.5 * (lo + hi)
        if cost(*sizes(mid)) <= allowance:
            lo = mid
        else:
            hi = mid
    m, s = sizes(lo)
    return InstrumentSizes(m, s, cost(m, s), allowance, scaled=True)


__all__ = [
    "DEFAULT_INSTRUMENT_SHARE",
    "INSTRUMENT_FLOOR",
    "InstrumentSizes",
    "MIN_SAMPLED",
    "instrument_allowance",
    "sampler_bytes",
    "shadow_bytes",
    "size_instruments",
]

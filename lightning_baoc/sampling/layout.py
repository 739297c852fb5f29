"""Layout of a sampler: which gradient elements and rows each block gives, and where they go.

:func:`draw_indices` draws a block's element subsample; :func:`_plan_blocks` lays every block's
parameters out as :class:`_Segment` s of one staging buffer (the sampled elements of all blocks
first, block after block, then the row norms); :func:`_check_blocks` and :func:`_check_int`
validate the sampler's arguments.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field

import torch
from torch import Tensor, nn

from lightning_baoc.optim.sharding import Piece, piece, whole_numel, whole_shape


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
    piece: Piece | None = None  # the parameter's part on this rank, where it is a piece (a DeepSpeed fragment)
    shard_offset: int | None = None  # where this rank's rows start in a sharded parameter (found at its first gather)
    # a sharded parameter's sampled indices in this rank's shard: (device, offset, numel) -> (lo, hi, positions)
    _shard_positions: dict[tuple, tuple[int, int, Tensor]] = field(default_factory=dict, repr=False)

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


def _plan_blocks(
    model: nn.Module, blocks: dict[str, list[str]], max_elements: int, max_rows: int, seed: int
) -> list[_Block]:
    """Draw every block's indices (in block order, so the seed fixes them) and lay out the buffer."""
    params = dict(model.named_parameters())
    generator = torch.Generator().manual_seed(seed)
    plan: list[_Block] = []
    elem_offset = 0
    for name, names in blocks.items():
        ps = [params[n] for n in names]
        sizes = [whole_numel(p) for p in ps]  # a part of a parameter (a piece): the whole's
        numel = sum(sizes)
        flat = draw_indices(numel, max_elements, generator)
        segments: list[_Segment] = []
        start = 0
        for pname, p, size in zip(names, ps, sizes):
            lo = int(torch.searchsorted(flat, start))
            hi = int(torch.searchsorted(flat, start + size))
            local = flat[lo:hi] - start
            every = local.numel() == size
            segments.append(_Segment(pname, p, elem_offset + lo, hi - lo, None if every else local, piece=piece(p)))
            start += size
        _plan_rows(segments, max_rows, generator)
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


def _plan_rows(segments: list[_Segment], max_rows: int, generator: torch.Generator) -> None:
    """Choose the rows whose norms each of a block's segments gives (at most ``max_rows``)."""
    # Rows come from the block's matrices; a block of vectors only (LayerNorm, a lone bias)
    # uses their elements as rows, so it still has a scale anisotropy.
    shapes = [whole_shape(seg.param) for seg in segments]
    matrices = [len(shape) >= 2 for shape in shapes]
    use_rows = matrices if any(matrices) else [len(shape) == 1 for shape in shapes]
    for seg, use, shape in zip(segments, use_rows, shapes):
        rows = int(shape[0]) if shape else 0
        if use and rows >= 2:
            seg.row_step = -(-rows // max_rows)
            offset = int(torch.randint(seg.row_step, (1,), generator=generator)) if seg.row_step > 1 else 0
            seg.row_start = offset
            seg.row_count = len(range(offset, rows, seg.row_step))


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
            if whole_numel(params[n]) == 0:
                raise ValueError(f"blocks[{block!r}] names {n!r}, which has zero elements; drop it")
            if n in owner:
                raise ValueError(f"Parameter {n!r} is in two blocks, {owner[n]!r} and {block!r}; keep it in one")
            owner[n] = block
        out[block] = list(names)
    return out

"""Where the tensors an optimizer steps lie in their parameters: the optimizer's :class:`Placements` part.

A blockwise optimizer decides a tensor's format on a shape, lays its 8-bit states out from an offset, and
orders its conversions by bytes that every rank agrees on. For a parameter held whole these are its own
shape, 0 and its own bytes; for a shard of FSDP2's ``DTensor`` they are read off the tensor
(:mod:`lightning_baoc.optim.sharding`: the global shape, the shard's offset, the largest shard's bytes, the
edges and rows shared with the other ranks). A fragment of DeepSpeed ZeRO's flat partitions is a plain
view that knows none of this: whoever made it says it, in a table (:class:`FragmentPlacements`).

The optimizer is built with one :class:`Placements` (``placements=``; default: every tensor read off
itself) and asks it, and only it: at ``add_param_group`` for each record's placement (:meth:`Placements.of`),
for the shape a format is decided on (:meth:`Placements.decided_shape`), and, through its pools, for the
shape that orders conversions (:meth:`Placements.ordering_shape`).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Mapping

from torch import Tensor

from lightning_baoc.optim.sharding import (
    FlatShards,
    RowShards,
    flat_shards,
    is_sharded,
    largest_shard_shape,
    local,
    row_shards,
    shard_offset,
)


@dataclass(frozen=True)
class Placement:
    """Where one tensor the optimizer steps lies in its parameter.

    Attributes:
        decided_shape: the shape its formats are decided on (the whole parameter's, or ``(numel,)`` where
            the ranks cut a row).
        shard_offset: its first element in the whole parameter's flat order (default: 0).
        frame: its 8-bit groups shared with other ranks' parts (default: ``None``, none shared).
        row_shards: its rows shared with other ranks' parts, summed by the factored formats (default: ``None``).
    """

    decided_shape: tuple[int, ...]
    shard_offset: int = 0
    frame: FlatShards | None = None
    row_shards: RowShards | None = None


class Placements:
    """Each tensor read off itself: a parameter held whole, or FSDP2's ``DTensor`` shard of one.

    Example:
        >>> w = nn.Parameter(torch.zeros(3, 4))
        >>> Placements().of(w)
        Placement(decided_shape=(3, 4), shard_offset=0, frame=None, row_shards=None)
    """

    def of(self, p: Tensor) -> Placement:
        """``p``'s placement, read when the optimizer records it."""
        return Placement(tuple(p.shape), shard_offset(p), flat_shards(p), row_shards(p))

    def decided_shape(self, p: Tensor) -> tuple[int, ...]:
        """The shape ``p``'s format is decided on: its own (a ``DTensor``'s is the whole parameter's)."""
        return p.shape

    def ordering_shape(self, p: Tensor) -> tuple[int, ...]:
        """The shape whose bytes order ``p``'s conversions, the same on every rank (a conversion of a shard
        may be a collective): the largest shard's for a ``DTensor``, else its own."""
        return largest_shard_shape(p) if is_sharded(p) else local(p).shape


class FragmentPlacements(Placements):
    """The placements of tensors made by the caller (DeepSpeed ZeRO's fragments, views into its flat
    partitions), given in a table; a tensor outside the table is read off itself.

    Example:
        >>> flat = torch.zeros(12)
        >>> view = nn.Parameter(flat[6:12])  # the second half of a 3 x 4 weight
        >>> placements = FragmentPlacements({view: Placement((3, 4), shard_offset=6)})
        >>> placements.decided_shape(view), placements.of(view).shard_offset
        ((3, 4), 6)
    """

    def __init__(self, table: Mapping[Tensor, Placement]) -> None:
        self.table = dict(table)

    def of(self, p: Tensor) -> Placement:
        given = self.table.get(p)
        return given if given is not None else super().of(p)

    def decided_shape(self, p: Tensor) -> tuple[int, ...]:
        given = self.table.get(p)
        return given.decided_shape if given is not None else p.shape

    def ordering_shape(self, p: Tensor) -> tuple[int, ...]:
        given = self.table.get(p)
        return given.decided_shape if given is not None else tuple(p.shape)


__all__ = ["FragmentPlacements", "Placement", "Placements"]

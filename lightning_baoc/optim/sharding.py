"""Parameters sharded across ranks: ``DTensor`` parameters, as FSDP2 (``fully_shard``) makes them.

A sharded parameter is a ``torch.distributed.tensor.DTensor`` whose local part, on this rank, is a
plain tensor sharing the parameter's storage. The optimizers keep the DTensor in their param groups
(what torch's schedulers, clipping and checkpoint helpers see) and do all their work on the local
part: each rank holds the state of its own shard, in the format chosen for the whole parameter.

- Placements: every mesh dimension ``Replicate()`` or ``Shard(0)`` (FSDP2 shards dim 0; HSDP
  replicates over one mesh dimension and shards over the other). The local part is then a run of
  whole rows of the global tensor, contiguous in its flat order from :func:`shard_offset`. Other
  placements (``Shard(d)`` for ``d > 0``, ``Partial``) are refused with the reason.
- Formats are decided on the global parameter (its shape and number of elements), never on the
  shard, so a rank holding few rows keeps the format of the whole.
- The states live on each rank's shard. The stochastic rounding of a shard draws the bits the
  whole parameter draws for the same elements (its keys shift by :func:`shard_offset`), so the
  element-wise formats round as in one process. The 8-bit formats' groups of 32 elements and
  super-blocks of 1024 are the whole parameter's wherever the shards start: where a shard starts
  or ends inside one (:class:`FlatShards`), its states are laid out from the whole parameter's
  (``formats.frames``), and a group or super-block split between shards takes the scale and the
  exponent of both parts: each write of such a parameter's 8-bit states exchanges the maxima at
  the shards' edges in one all-reduce of ``4 * moments * shards`` floats, so the codes, scales and
  exponents are the one-process ones, bit for bit. These parameters take the eager step; where
  every shard starts on a super-block (a row of a multiple of 1024 elements, or shards of whole
  super-blocks) nothing is exchanged and the kernels serve them.
- Factored second moments (``factored``, ``int8_factored``) of a parameter split by rows hold this
  rank's rows of the row statistics and the column statistics of the whole matrix, the same on every
  rank: each step sums the column sums of squares and the row mean over the shards in one all-reduce
  of ``cols + 1`` floats per parameter (:class:`RowShards`), and a conversion to or from them sums
  the same way, so the state is the one-process state (within float summation order).

DeepSpeed ZeRO's fragments are plain tensors that carry what a ``DTensor`` knows of its whole
(:class:`Piece`): under ZeRO 1 and 2 a rank may hold all of a parameter, a run of it cut mid-row, or none.

The step communicates nothing but the factored formats' sums and the 8-bit edges above: it is
otherwise local to each rank, as FSDP2 expects. ``to_adamw_state_dict``
gathers the whole fp32 moments (:func:`gather_full`, a collective), and a whole state loads into a
sharded run by taking each rank's part (:func:`this_shard`), so a state moves between world sizes.
"""

from __future__ import annotations

import functools
import math
from dataclasses import dataclass
from typing import Any

from torch import Tensor
from torch.nn import Parameter

from lightning_baoc.formats.base import ShardShape
from lightning_baoc.formats.quant import GROUP, SUPER

try:  # torch >= 2.4: the public path; absent from builds without distributed support
    from torch.distributed.tensor import DTensor, Replicate, Shard
except ImportError:  # pragma: no cover - torch built without torch.distributed
    DTensor = None  # type: ignore[assignment,misc]


#: The types that are never a ``DTensor``: tested first, a set lookup where ``isinstance`` against
#: ``DTensor`` takes about five times as long (the step asks for every parameter).
_PLAIN = frozenset((Tensor, Parameter))


def is_sharded(t: Any) -> bool:
    """Whether ``t`` is a ``DTensor`` (a parameter or gradient spread over a device mesh)."""
    return type(t) not in _PLAIN and DTensor is not None and isinstance(t, DTensor)


def local(t: Tensor) -> Tensor:
    """The part of ``t`` on this rank: the local tensor of a ``DTensor`` (it shares the storage, so
    writing it writes the parameter), ``t`` itself otherwise."""
    return t._local_tensor if is_sharded(t) else t  # noqa: SLF001  (to_local() makes a new view per call)


def check_placements(p: Tensor, name: str) -> None:
    """Refuse a ``DTensor`` parameter whose shard is not a run of whole rows (see the module)."""
    if not is_sharded(p):
        return
    for placement in p.placements:
        if isinstance(placement, Replicate) or (isinstance(placement, Shard) and placement.dim == 0):
            continue
        raise ValueError(
            f"parameter {name!r} is a DTensor placed {tuple(p.placements)}: the optimizer steps shards along "
            f"dimension 0 (FSDP2's fully_shard, HSDP) and replicas only; {placement} is not supported. Shard "
            f"this parameter on dim 0 (fully_shard's default) or leave it replicated."
        )
    if not local(p).is_contiguous():
        raise ValueError(f"parameter {name!r}: its local shard is not contiguous; the optimizer needs it flat")


def shard_offset(p: Tensor) -> int:
    """Where the local shard of ``p`` starts in the global tensor's flat order (0 if not sharded)."""
    if not is_sharded(p) or p.dim() == 0:
        return 0
    from torch.distributed.tensor._utils import compute_local_shape_and_global_offset

    _, offset = compute_local_shape_and_global_offset(p.shape, p.device_mesh, p.placements)
    return int(offset[0]) * math.prod(p.shape[1:])


def as_dtensor(t: Tensor, p: Tensor) -> Tensor:
    """``t``, a tensor shaped like this rank's shard of ``p``, as the ``DTensor`` placed like ``p``
    (no copy, no communication); ``t`` itself when ``p`` is not sharded."""
    if not is_sharded(p):
        return t
    return DTensor.from_local(t, p.device_mesh, p.placements, run_check=False, shape=p.shape, stride=p.stride())


def gather_full(t: Tensor, p: Tensor) -> Tensor:
    """The whole of ``t``, a tensor shaped like this rank's shard of ``p``, assembled from every rank's
    (a collective: every rank calls it, for the same parameters in the same order); ``t`` itself when
    ``p`` is not sharded."""
    return as_dtensor(t, p).full_tensor() if is_sharded(p) else t


def shard_count(p: Tensor) -> int:
    """How many shards ``p``'s rows are split into: the product of the sizes of its mesh dimensions
    placed ``Shard`` (1 when ``p`` is not sharded)."""
    if not is_sharded(p):
        return 1
    return math.prod(p.device_mesh.size(d) for d, placement in enumerate(p.placements) if isinstance(placement, Shard))


def this_shard(t: Tensor, p: Tensor) -> Tensor:
    """This rank's part of ``t`` when ``t`` has the whole shape of the sharded ``p`` (a full export
    loading into a sharded run); ``t`` itself otherwise."""
    shard = local(p)
    if not is_sharded(p) or tuple(t.shape) != tuple(p.shape) or tuple(shard.shape) == tuple(p.shape):
        return t
    start = shard_offset(p)
    return t.reshape(-1)[start : start + shard.numel()].view(shard.shape)


def largest_shard_shape(p: Tensor) -> tuple[int, ...]:
    """The shape of the largest shard of ``p`` on any rank (the first rank's: ``torch.chunk`` gives the
    first chunks the most rows); ``p``'s shape when it is not sharded. A budget per rank is met on
    every rank when it is met on this shape."""
    shape = tuple(p.shape)
    if not is_sharded(p) or not shape:
        return shape
    rows = shape[0]
    for dim, placement in enumerate(p.placements):
        if isinstance(placement, Shard):
            rows = -(-rows // p.device_mesh.size(dim)) if rows else 0
    return (rows, *shape[1:])


@dataclass(frozen=True)
class RowShards:
    """A parameter whose rows (dimension 0) are split among the ranks of ``group``: what a factored
    second moment needs to sum its column statistics and its row mean over every rank's rows."""

    rows: int  # the whole parameter's rows
    group: Any  # the process group of the shards (FSDP2's mesh dimension; HSDP: within a replica)

    def sum_(self, t: Tensor) -> Tensor:
        """``t`` <- its sum over the shards, in place (a collective: every rank of ``group`` calls it)."""
        import torch.distributed as dist

        dist.all_reduce(t, op=dist.ReduceOp.SUM, group=self.group)
        return t


@dataclass(frozen=True)
class Piece:
    """This rank's part of a parameter held as a plain tensor, the other parts on the other ranks of
    ``group``: a fragment of DeepSpeed ZeRO's flat partitions (``optim.deepspeed`` sets it on the
    fragment's view as ``baoc_piece``), which may hold any run of the whole's elements, or none. Where a
    ``DTensor`` knows its whole shape and where its rows start, a piece carries them, so that the
    gradient sampler gathers it into the whole parameter's sample and sums the sample over ``group``,
    and the risk scores sum every rank's terms, as for a ``DTensor``'s rows."""

    whole: tuple[int, ...]  # the parameter's shape
    decided: tuple[int, ...]  # the shape its formats are decided on: ``whole``, or (numel,) where the ranks cut a row
    offset: int  # where this rank's elements start in the whole's flat order
    group: Any  # the process group of the ranks holding the parts
    rows: RowShards | None  # whole rows split among ranks: the factored formats' sums over them

    @property
    def cuts_rows(self) -> bool:
        """Whether the ranks cut a row of the parameter (its row norms are then summed as squares)."""
        return self.decided != self.whole

    def sum_(self, t: Tensor) -> Tensor:
        """``t`` <- its sum over the ranks of ``group``, in place (a collective)."""
        import torch.distributed as dist

        dist.all_reduce(t, op=dist.ReduceOp.SUM, group=self.group)
        return t


def piece(p: Any) -> Piece | None:
    """The :class:`Piece` ``p`` is (``None`` for a ``DTensor`` or a parameter held whole)."""
    return getattr(p, "baoc_piece", None)


def whole_shape(p: Tensor) -> tuple[int, ...]:
    """The shape of the whole parameter ``p`` is part of: a :class:`Piece`'s, or ``p``'s (a ``DTensor``'s is
    the global one)."""
    held = piece(p)
    return held.whole if held is not None else tuple(p.shape)


def whole_numel(p: Tensor) -> int:
    """The elements of the whole parameter ``p`` is part of (:func:`whole_shape`)."""
    return math.prod(whole_shape(p))


def decided_shape(p: Tensor) -> tuple[int, ...]:
    """The shape ``p``'s formats are decided on: a :class:`Piece`'s ``decided``, else :func:`whole_shape`."""
    held = piece(p)
    return held.decided if held is not None else tuple(p.shape)


def row_shards(p: Tensor) -> RowShards | None:
    """:class:`RowShards` of ``p`` when its rows are split among ranks (:func:`splits_rows`, or a
    :class:`Piece`'s rows), else ``None``."""
    held = piece(p)
    if held is not None:
        return held.rows
    if not splits_rows(p):
        return None
    return RowShards(int(p.shape[0]), shard_group([p]))


def splits_rows(p: Tensor) -> bool:
    """Whether ``p``'s rows are split among ranks (a factored second moment would need all of them)."""
    return is_sharded(p) and largest_shard_shape(p)[:1] != tuple(p.shape[:1])


def _one_mesh(params: Any) -> Any:
    """The device mesh of the ``DTensor`` ``params`` (``None`` if none is one); several are refused."""
    meshes: list[Any] = []
    for p in params:  # equal meshes are one (fully_shard without a mesh makes a new, equal one per call)
        if is_sharded(p) and not any(p.device_mesh is m or p.device_mesh == m for m in meshes):
            meshes.append(p.device_mesh)
    if len(meshes) > 1:
        raise ValueError(
            f"the model's DTensor parameters live on {len(meshes)} different device meshes "
            f"({', '.join(str(m) for m in meshes[:3])}); shard them over one (pass the same mesh to every fully_shard)"
        )
    return meshes[0] if meshes else None


def mesh_min(t: Tensor, params: Any) -> None:
    """``t`` <- its minimum over every rank of the device mesh of the ``DTensor`` ``params`` (every
    dimension of it: the shards and, under HSDP, the replicas), in place; one mesh only."""
    import torch.distributed as dist

    mesh = _one_mesh(params)
    for dim in range(mesh.ndim if mesh is not None else 0):
            dist.all_reduce(t, op=dist.ReduceOp.MIN, group=mesh.get_group(dim))


def shard_group(params: Any) -> Any:
    """The process group over which ``params`` are sharded: the mesh dimension of their ``Shard(0)``
    (FSDP2's one dimension; HSDP's second, its replicas each summing their own shards), or the group of
    :class:`Piece` s; ``None`` when none is either. Several meshes, or parameters sharded over different mesh dimensions, are
    refused: the sampler sums its per-rank pieces over one group."""
    params = list(params)
    held = [h for h in map(piece, params) if h is not None]
    if held:  # DeepSpeed's fragments: every one is a part of its parameter on the ranks of one group
        return held[0].group
    sharded = [p for p in params if is_sharded(p)]
    mesh = _one_mesh(sharded)
    if mesh is None:
        return None
    dims = {d for p in sharded for d, placement in enumerate(p.placements) if isinstance(placement, Shard)}
    if len(dims) > 1:
        raise ValueError(f"the model's DTensor parameters are sharded over several mesh dimensions {sorted(dims)}; "
                         f"gradient sampling assembles shards over one")
    return mesh.get_group(dims.pop() if dims else 0)


@dataclass(frozen=True)
class FlatShards:
    """A parameter whose shards do not all start on an 8-bit super-block (1024 elements of its flat
    order): the place of this rank's shard among the shards, and the exchange of the maxima where a
    shard's edges cut a group or a super-block (the ``frame`` of ``formats.frames.FramedViews``)."""

    offset: int  # where this shard starts in the whole parameter's flat order
    numel: int  # this shard's elements
    starts: tuple[int, ...]  # every shard's first element, in shard order, then the whole numel
    index: int  # this shard's place in ``starts``
    group: Any  # the process group of the shards

    @property
    def lead(self) -> int:
        """Where this shard's first element sits in its super-block (0 for a shard without elements)."""
        return self.offset % SUPER if self.numel else 0

    @property
    def head_shared(self) -> bool:
        """Whether a shard before this one holds part of this one's first super-block."""
        return self.numel > 0 and self.lead != 0

    @property
    def tail_shared(self) -> bool:
        """Whether a shard after this one holds part of this one's last super-block."""
        end = self.offset + self.numel
        return self.numel > 0 and end % SUPER != 0 and end < self.starts[-1]

    def edges_max_(self, edges: Tensor) -> Tensor:
        """``edges`` (moments x 4: the maxima of this shard's first group, first super-block, last group
        and last super-block, ``formats.quant.edge_maxima``) <- the maxima of those groups and
        super-blocks over every shard holding part of them, in place: one all-reduce of every shard's
        four maxima per moment (a collective: every rank of ``group`` calls it, a shard without
        elements too)."""
        import torch
        import torch.distributed as dist

        shards = len(self.starts) - 1
        every = torch.zeros(edges.shape[0], shards, 4, dtype=edges.dtype, device=edges.device)
        every[:, self.index] = edges
        dist.all_reduce(every, op=dist.ReduceOp.SUM, group=self.group)  # one slot per shard: a gather
        for column, sources in enumerate(self._sources):
            for shard, col in sources:
                edges[:, column] = torch.maximum(edges[:, column], every[:, shard, col])
        return edges

    @functools.cached_property
    def _sources(self) -> list[list[tuple[int, int]]]:
        """For each of this shard's four edges (first group, first super-block, last group, last
        super-block): the (shard, edge) pairs of the other shards that hold part of it."""
        ids = []
        for a, b in zip(self.starts, self.starts[1:]):
            ids.append(None if b <= a else (a // GROUP, a // SUPER, (b - 1) // GROUP, (b - 1) // SUPER))
        own = ids[self.index]
        out: list[list[tuple[int, int]]] = []
        for column in range(4):
            target = None if own is None else own[column]
            kind = column % 2  # 0: a group, 1: a super-block
            sources = [(j, c) for j, other in enumerate(ids) if j != self.index and other is not None
                       for c in (kind, kind + 2) if other[c] == target]
            out.append(sources)
        return out


def shard_starts(p: Tensor) -> tuple[int, ...]:
    """Where every shard of ``p`` starts in its flat order, in shard order, then ``p.numel()``: rows
    split as ``torch.chunk`` splits them (FSDP2's ``fully_shard`` and ``DTensor``'s ``Shard(0)``)."""
    rows, cols = (int(p.shape[0]), math.prod(p.shape[1:])) if p.dim() else (1, 1)
    count = shard_count(p)
    per = -(-rows // count)
    return tuple(min(j * per, rows) * cols for j in range(count)) + (rows * cols,)


def shard_shape(p: Tensor) -> tuple[int, ...]:
    """The shape an allocation counts for ``p`` on each rank: :func:`largest_shard_shape`, as a
    ``formats.base.ShardShape`` when ``p``'s rows are split (its formats decided on the whole
    parameter, its bytes the most any shard holds); ``p``'s shape when it is not sharded. A fragment of a
    DeepSpeed partition carries its own (``baoc_counted_shape``, set by ``optim.deepspeed``)."""
    counted = getattr(p, "baoc_counted_shape", None)
    if counted is not None:
        return counted
    largest = largest_shard_shape(p)
    if not splits_rows(p):
        return largest
    starts, rest = shard_starts(p), tuple(p.shape[1:])
    cols = math.prod(rest)
    shards = [(((b - a) // cols, *rest), a) for a, b in zip(starts, starts[1:]) if b > a]
    return ShardShape(largest, tuple(p.shape), shards)


def flat_shards(p: Tensor) -> FlatShards | None:
    """:class:`FlatShards` of ``p`` when its rows are split among ranks and some shard starts off an
    8-bit super-block; ``None`` otherwise (a parameter not sharded, or sharded on super-blocks)."""
    if not splits_rows(p):
        return None
    starts = shard_starts(p)
    count = len(starts) - 1
    if all(a % SUPER == 0 for a in starts[1:-1] if a < starts[-1]):
        return None
    offset, numel = shard_offset(p), local(p).numel()
    # an empty shard (torch.chunk leaves the last ones empty) holds nothing to exchange: any empty slot
    index = next(j for j in range(count) if (starts[j] == offset or not numel) and starts[j + 1] - starts[j] == numel)
    return FlatShards(offset, numel, starts, index, shard_group([p]))

"""The 8-bit formats' tensors over a parameter's flat elements, and over a shard of one (FSDP2).

An 8-bit moment is three tensors (:func:`quant_specs`): one code per element, one fp16 scale per
group of 32 elements and one int8 exponent per super-block of 1024 (:mod:`.quant`). A chunk of
elements ``[start, stop)`` reads and writes the scales and exponents of its groups and super-blocks
(:func:`quant_args`), so chunks start on super-blocks.

A shard of a sharded parameter may start anywhere in the whole parameter's flat order (FSDP2 splits
rows; a row need not be a multiple of 32 elements). Its groups and super-blocks are the whole
parameter's, never counted from the shard's first element, so that sharding never changes the
quantization: :class:`FramedViews` carry the shard's place (``lead``), the layout holds every group
and super-block the shard touches (:func:`~.base.framed_specs`), and a group or super-block split between
two shards takes one scale and one exponent, from the maxima of both parts: the writers hold the
stores at a shard's shared edges (:func:`store_quantized`) and finish them once the edges' maxima are
exchanged (:func:`finish_stores`, one small collective per parameter and write).
"""

from __future__ import annotations

from typing import Any, Callable, Mapping

import torch
from torch import Tensor

from lightning_baoc.formats.base import TensorSpec
from lightning_baoc.formats.quant import (
    EXP_DTYPE,
    GROUP,
    SCALE_DTYPE,
    SUPER,
    edge_maxima,
    num_groups,
    num_supers,
    quantize_momentum,
    sqrt_rn,
)


def group_slice(start: int, stop: int, lead: int = 0) -> slice:
    """The scales covering elements ``[start, stop)``: ``start`` on a super-block boundary, or 0 for
    a shard whose first element sits ``lead`` elements into its super-block (:class:`FramedViews`)."""
    return slice((start + lead) // GROUP - lead // GROUP, -(-(stop + lead) // GROUP) - lead // GROUP)


def super_slice(start: int, stop: int, lead: int = 0) -> slice:
    """The exponents covering elements ``[start, stop)`` (``start`` and ``lead`` as :func:`group_slice`'s)."""
    return slice((start + lead) // SUPER, -(-(stop + lead) // SUPER))


def frame_lead(views: Mapping[str, Tensor]) -> int | None:
    """Where the first element of a shard's states sits in its super-block (:class:`FramedViews`);
    ``None`` for states laid out from their own first element."""
    frame = getattr(views, "frame", None)
    return None if frame is None else frame.lead


def framed(views: Mapping[str, Tensor]) -> bool:
    """Whether ``views`` are a shard's 8-bit states laid out in the whole parameter's groups
    (:class:`FramedViews`): the eager step's, which exchanges the shard's edges."""
    return getattr(views, "frame", None) is not None


def quant_args(views: dict[str, Tensor], key: str, start: int, stop: int) -> tuple[Tensor, Tensor, Tensor, int]:
    """Codes, scales and exponents of ``key``'s elements ``[start, stop)``, and where ``start`` sits in
    its super-block (the ``lead`` of :func:`~.quant.quantize_momentum`)."""
    lead = frame_lead(views) or 0
    return (
        views[key][start:stop],
        views[key + "_scale"][group_slice(start, stop, lead)],
        views[key + "_exp"][super_slice(start, stop, lead)],
        (start + lead) % SUPER,
    )


def quant_specs(key: str, code_dtype: torch.dtype, n: int) -> tuple[TensorSpec, TensorSpec, TensorSpec]:
    """The three tensors of one 8-bit moment: codes, fp16 group scales, int8 super-block exponents."""
    return (
        TensorSpec(key + "_scale", SCALE_DTYPE, num_groups(n)),
        TensorSpec(key, code_dtype, n),
        TensorSpec(key + "_exp", EXP_DTYPE, num_supers(n)),
    )


class FramedViews(dict):
    """The state tensors of a shard (FSDP2) of a parameter whose shards do not all start on an 8-bit
    super-block: its groups and super-blocks are the whole parameter's, as in one process.

    ``frame`` (``optim.sharding.FlatShards``) gives ``lead`` (where the shard's first element sits in
    its super-block), ``numel``, ``head_shared`` / ``tail_shared`` (whether a neighbour holds part of
    the first / last super-block) and ``edges_max_(t)``, which takes each row of the ``(moments, 4)``
    :func:`~.quant.edge_maxima` of this shard to the whole parameter's (a collective). A store that
    touches a shared edge is held (:func:`store_quantized`) until :func:`finish_stores`, which every
    writer calls once per parameter (on every rank, a shard without elements too): one exchange of
    the edges' maxima, then the held stores.
    """

    def __init__(self, frame: Any, tensors: Mapping[str, Tensor] | None = None) -> None:
        super().__init__(tensors or {})
        self.frame = frame
        self.held: list[tuple[Callable[..., None], Tensor, str, int, int]] = []


def store_quantized(quantize: Callable[..., None], x: Tensor, views: dict[str, Tensor], key: str, start: int, stop: int) -> None:
    """``quantize`` (:func:`~.quant.quantize_momentum` or :func:`~.quant.quantize_sqrt`) flat fp32 ``x``
    into ``key``'s elements ``[start, stop)``; held, ``x`` kept, where they reach a shard's shared edge."""
    frame = getattr(views, "frame", None)
    if frame is not None and ((start == 0 and frame.head_shared) or (stop == frame.numel and frame.tail_shared)):
        views.held.append((quantize, x, key, start, stop))  # type: ignore[attr-defined]
        return
    quantize(x, *quant_args(views, key, start, stop))


def finish_stores(views: dict[str, Tensor]) -> None:
    """Complete the stores :func:`store_quantized` held: exchange the maxima of the shard's edges with
    its neighbours (one collective of ``4 * moments * shards`` floats), then quantize with the whole
    parameter's. Nothing for states that are not a framed shard's."""
    frame = getattr(views, "frame", None)
    if frame is None:
        return
    held, views.held = views.held, []  # type: ignore[attr-defined]
    keys = sorted(k[: -len("_scale")] for k in views if k.endswith("_scale"))
    device = next(iter(views.values())).device
    edges = torch.zeros(len(keys), 4, dtype=torch.float32, device=device)
    for quantize, x, key, start, stop in held:
        values = x if quantize is quantize_momentum else sqrt_rn(x.clamp(min=0.0))
        found = edge_maxima(values, (start + frame.lead) % SUPER)
        row = edges[keys.index(key)]
        if start == 0:
            row[:2] = torch.maximum(row[:2], found[:2])
        if stop == frame.numel:
            row[2:] = torch.maximum(row[2:], found[2:])
    frame.edges_max_(edges)
    for quantize, x, key, start, stop in held:
        outer = edges[keys.index(key)].clone()
        if start != 0:
            outer[:2] = 0.0
        if stop != frame.numel:
            outer[2:] = 0.0
        codes, scales, exps, lead = quant_args(views, key, start, stop)
        quantize(x, codes, scales, exps, lead, outer)

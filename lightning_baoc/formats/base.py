"""The contract every optimizer-state format implements.

A format says three things about a parameter tensor of a given shape:

1. ``layout(shape)``: the exact compact tensors it stores (name, dtype, element count), from which
   ``state_bytes(shape)`` follows. The optimizer allocates exactly these bytes, so the number a
   format states is the number of bytes really allocated (tests hold the two equal).
2. ``encode`` / ``decode``: conversion between the compact tensors and a :class:`Canonical` fp32
   view of Adam's state. Every change of format (state inheritance) goes through it.
3. ``update``: one AdamW step for a list of parameters held in this format, written as a pure
   function of tensors: dequantize a chunk, do the math in fp32, write back through the format.

Formats never import Lightning.
"""

from __future__ import annotations

import math
from abc import ABC, abstractmethod
from dataclasses import dataclass, replace
from typing import Any, ClassVar, Sequence

import torch
from torch import Tensor

from lightning_baoc.formats.quant import GROUP, SUPER, num_groups, num_supers

#: Elements processed at once by chunked updates: large enough to amortize per-op overhead, small
#: enough that the fp32 working copies of a chunk stay in cache (measured: 2**17 was ~3x faster than
#: whole-tensor passes for int8 on a 2-core CPU, see benchmarks/step_time.py).
DEFAULT_CHUNK = 1 << 17
_FP32_MAX = torch.finfo(torch.float32).max

Shape = Sequence[int]


def numel_of(shape: Shape) -> int:
    """Number of elements of a tensor of ``shape``."""
    return int(math.prod(int(s) for s in shape))


def factor_view(shape: Shape) -> tuple[int, int] | None:
    """The ``(rows, cols)`` view a factored state of a tensor of ``shape`` is held over: as
    :func:`factor_dims`, but any number of rows (``None`` for 1-D tensors only). A shard of a
    sharded parameter (its rows on this rank: a few, one or none) keeps the format chosen for the
    whole parameter, which :func:`factor_dims` decided; its state is held over this view."""
    if len(shape) < 2:
        return None
    return int(shape[0]), numel_of(shape[1:])


def factor_dims(shape: Shape) -> tuple[int, int] | None:
    """Rows and columns a tensor of ``shape`` is factored over, or ``None`` if it has no factored form.

    Tensors with two or more dimensions are viewed as ``(shape[0], prod(shape[1:]))`` (a conv weight
    ``(out, in, kh, kw)`` becomes ``(out, in*kh*kw)``). Both sides must be at least 2, otherwise the
    factored form is no smaller than the tensor (1-D tensors have none: README.md, "State formats").
    """
    if len(shape) < 2:
        return None
    rows = int(shape[0])
    cols = numel_of(shape[1:])
    if rows < 2 or cols < 2:
        return None
    return rows, cols


class ShardShape(tuple):
    """The shape of the largest shard of a parameter sharded by rows (FSDP2), as an allocation counts
    it: a tuple of that shape, which also knows ``whole``, the parameter's shape (which formats it can
    hold: :meth:`StateFormat.accepts`, decided as the optimizer decides, on the whole parameter), and
    ``shards``, every shard's shape and flat offset (:meth:`StateFormat.state_bytes`: the most any
    rank holds, its 8-bit groups laid out in the whole parameter's: :meth:`StateFormat.shard_layout`).
    Equal to, and hashed as, the plain tuple; :func:`as_shape` keeps it where code copies shapes."""

    whole: tuple[int, ...]
    shards: tuple[tuple[tuple[int, ...], int], ...]

    def __new__(cls, shape: Shape, whole: Shape, shards: Sequence[tuple[Shape, int]]) -> "ShardShape":
        out = super().__new__(cls, (int(s) for s in shape))
        out.whole = tuple(int(s) for s in whole)
        out.shards = tuple((tuple(int(s) for s in sh), int(offset)) for sh, offset in shards)
        return out

    def __reduce__(self) -> Any:  # pickled (a report, a cache) as the plain shape
        return (tuple, (tuple(self),))


def as_shape(shape: Shape) -> tuple[int, ...]:
    """``shape`` as a tuple (a :class:`ShardShape` kept as it is)."""
    return shape if isinstance(shape, ShardShape) else tuple(shape)


@dataclass(frozen=True)
class TensorSpec:
    """One compact tensor a format stores for a parameter."""

    key: str
    dtype: torch.dtype
    numel: int

    @property
    def nbytes(self) -> int:
        return self.numel * _itemsize(self.dtype)


def _itemsize(dtype: torch.dtype) -> int:
    return torch.empty((), dtype=dtype).element_size()


def framed_specs(specs: tuple[TensorSpec, ...], n: int, lead: int) -> tuple[TensorSpec, ...]:
    """``specs`` (a format's layout of ``n`` elements) for a shard whose first element sits ``lead``
    elements into its super-block: the scales and exponents of every group and super-block of the
    whole parameter the shard touches (one group and one super-block more at most; the 8-bit
    formats' framing: :mod:`.frames`)."""
    if not lead or not n:
        return specs
    sizes = {"_scale": num_groups(n + lead % GROUP), "_exp": num_supers(n + lead)}
    return tuple(
        replace(spec, numel=sizes[spec.key[spec.key.rindex("_"):]]) if spec.key.endswith(("_scale", "_exp")) else spec
        for spec in specs
    )


@dataclass
class Canonical:
    """Adam's state of one parameter in fp32, the common ground of every format conversion.

    ``exp_avg`` is ``None`` where a format holds no momentum. The second moment is held dense
    (``exp_avg_sq``, parameter-shaped) or factored (``row``/``col``, see :func:`factor_dims`), or
    both; :meth:`dense_v` and :meth:`factored_v` produce whichever form is needed.
    """

    shape: tuple[int, ...]
    exp_avg: Tensor | None = None
    exp_avg_sq: Tensor | None = None
    row: Tensor | None = None
    col: Tensor | None = None
    #: Set when this is the state of one shard (a run of rows) of a parameter whose rows are split
    #: among ranks (FSDP2): an object with ``rows`` (the whole parameter's) and ``sum_(t)`` (``t``
    #: summed over the shards in place, a collective), so that the factored forms are the whole
    #: parameter's: ``row`` holds this shard's rows, ``col`` the columns over every rank's rows.
    shards: Any = None

    def dense_v(self) -> Tensor:
        """The dense second moment; expands a factored one (outer product over the row mean)."""
        if self.exp_avg_sq is not None:
            return self.exp_avg_sq
        if self.row is None or self.col is None:
            raise ValueError("Canonical state holds no second moment")
        return expand_factored(self.row, self.col, row_mean(self.row, self.shards)).reshape(self.shape)

    def factored_v(self) -> tuple[Tensor, Tensor]:
        """Row and column means of the second moment (computed from the dense form if needed)."""
        if self.row is not None and self.col is not None:
            return self.row, self.col
        dims = factor_dims(self.shape) if self.shards is None else factor_view(self.shape)
        if dims is None:
            raise ValueError(f"shape {self.shape} has no factored form")
        # Means as sums of v / n: a plain sum of moments near fp32's maximum (gradients of 1e19)
        # overflows; an overflowed (inf) v saturates, as the 8-bit formats store it.
        v = self.dense_v().reshape(-1)
        means = FactoredMeans(self.shape, v.device, self.shards)
        means.add(0, v)
        return means.reduced()


class FactoredMeans:
    """Row and column means of a dense ``v`` streamed in flat slices (whole rows at once, or any
    range): :meth:`Canonical.factored_v` adds the whole tensor, a streamed conversion one slice at a time."""

    def __init__(self, shape: tuple[int, ...], device: torch.device | None, shards: Any = None) -> None:
        self.rows, self.cols = factor_view(shape)  # type: ignore[misc]
        self.shards = shards  # a shard's rows (Canonical.shards): column means over every rank's rows
        self.row = torch.zeros(self.rows, dtype=torch.float32, device=device)
        self.col = torch.zeros(self.cols, dtype=torch.float32, device=device)
        self._col_rows = self.rows if shards is None else shards.rows  # what a column mean divides by

    def add(self, start: int, v: Tensor) -> None:
        """Add the flat elements ``[start, start + v.numel())`` of ``v``."""
        # means as sums of v / n: a plain sum of moments near fp32's maximum overflows
        v = v.clamp(max=_FP32_MAX)
        stop = start + v.numel()
        if start % self.cols == 0 and stop % self.cols == 0:  # whole rows: sum them directly
            block = v.view(-1, self.cols)
            self.row[start // self.cols : stop // self.cols] += block.div(self.cols).sum(dim=1)
            self.col += block.div_(self._col_rows).sum(dim=0)
            return
        index = torch.arange(start, stop, device=v.device)
        self.row.index_add_(0, index // self.cols, v.div(self.cols))
        self.col.index_add_(0, index % self.cols, v.div_(self._col_rows))

    def reduced(self) -> tuple[Tensor, Tensor]:
        """The row and column means once every slice is added (a shard's columns summed over the
        shards: a collective)."""
        if self.shards is not None:
            self.shards.sum_(self.col)
        return self.row, self.col


def row_mean(row: Tensor, shards: Any = None) -> Tensor:
    """The mean of ``row`` (one element), taken without a sum that can overflow; over every
    shard's rows when ``row`` is a shard's (``shards``: :attr:`Canonical.shards`; a collective)."""
    mean = row.div(row.numel() if shards is None else shards.rows).sum().reshape(1)
    if shards is not None:
        shards.sum_(mean)
    return mean


def factored_ratio(row: Tensor, mean: Tensor | None = None) -> Tensor:
    """``row / mean(row)`` (in ``[0, rows]``), 0 where the mean is 0: the row factor of Adafactor's
    rank-1 estimate (``mean``: the whole parameter's row mean, :func:`row_mean`, for a shard's rows)."""
    if mean is None:
        mean = row.div(row.numel()).sum()
    return torch.where(mean > 0, row / mean, torch.zeros_like(row))


def expand_factored(row: Tensor, col: Tensor, mean: Tensor | None = None) -> Tensor:
    """Adafactor's rank-1 estimate ``v[i, j] = row[i] * col[j] / mean(row)`` (exact for rank-1 v).

    Computed as ``(row[i] / mean(row)) * col[j]`` so that no product of two moments overflows; a
    row mean of 0 gives 0 without a division, and an estimate beyond fp32's range (up to ``rows``
    times the largest moment, for a v far from rank 1) saturates at fp32's maximum.
    """
    ratio = factored_ratio(row, mean)
    return torch.outer(ratio, col).clamp_(max=_FP32_MAX)


@dataclass
class StepItem:
    """One parameter in a step: its tensors and its own bias corrections.

    ``step_count`` is the one step count both corrections follow from (``bias_correction1 == 1 -
    beta1 ** step_count`` and ``bias_correction2 == 1 - beta2 ** step_count``), or ``None`` where
    the momentum counts its own steps (re-created by a conversion) or the count is not known; only
    items with a count can take torch's fused kernel (:mod:`lightning_baoc.formats.fused_adam`).
    """

    param: Tensor
    grad: Tensor
    views: dict[str, Tensor]
    bias_correction1: float  # 1 - beta1 ** (steps since momentum was created)
    bias_correction2: float  # 1 - beta2 ** step
    step_count: int | None = None
    #: Key of the stochastic rounding of this parameter's step (:func:`~.quant.stream_key`).
    noise_key: int = 0
    #: Steps of the momentum, this one included (1: its first step; SGD starts its buffer there).
    momentum_step: int = 0
    #: A shard's rows of a parameter split by rows (:attr:`Canonical.shards`): the factored formats
    #: sum their column statistics and row mean over the shards (one all-reduce per parameter).
    shards: Any = None
    #: Set where the device decides whether this step happens (a one-element fp32 tensor, nonzero
    #: where the gradient holds inf or NaN: the update is skipped there; ``None``: it happens). The
    #: kernels that serve such items read it themselves (``kernels/triton_step.py``; torch's fused AdamW
    #: reads the flag of any of its items as its ``found_inf``, and the Triton kernel then steps the ones
    #: whose own flag is clear), so the host reads nothing to launch them.
    skip_flag: Tensor | None = None


@dataclass
class StepHyper:
    """The group's hyperparameters for one step (plain floats)."""

    lr: float
    beta1: float
    beta2: float
    eps: float
    weight_decay: float
    decoupled_weight_decay: bool = True
    maximize: bool = False
    chunk: int = DEFAULT_CHUNK
    #: Key of the stochastic rounding of a conversion's stores (a step's keys are per item).
    noise_key: int = 0
    #: Which step runs: ``"auto"``, ``"compiled"`` or ``"eager"`` (:mod:`lightning_baoc.kernels`).
    kernels: str = "auto"
    #: The update rule: ``"adamw"`` (the AdamW formats), ``"sgd"`` or ``"lion"`` (the momentum
    #: formats, :mod:`lightning_baoc.formats.momentum`; ``beta1`` is SGD's momentum).
    rule: str = "adamw"
    #: SGD's dampening and Nesterov switch.
    dampening: float = 0.0
    nesterov: bool = False


def _fp32_view(fmt: "StateFormat", views: dict[str, Tensor], key: str) -> Tensor:
    tensor = views.get(key)
    if tensor is None or tensor.dtype != torch.float32:
        raise NotImplementedError(f"format {fmt.name!r} holds no fp32 {key!r}")
    return tensor.view(-1)


@dataclass(frozen=True)
class Agreement:
    """How a fast step (the compiled CPU kernels, the Triton kernels) agrees with the eager step.

    Attributes:
        kind: ``"bit-equal"`` (it computes the eager step's fp32 operations in its order), ``"ulps"``
            (each tensor within :attr:`bound` fp32 ulps of its largest magnitude) or ``"relative"`` (fp32
            tensors within :attr:`bound` of their norm, 8-bit codes within one in at most
            :attr:`code_share` of their elements) (default: ``"bit-equal"``).
        bound: the bound of ``"ulps"`` or ``"relative"`` (default: ``0.0``).
        code_share: the share of 8-bit codes that may differ by one, with ``"relative"`` (default: ``0.0``).
    """

    kind: str = "bit-equal"
    bound: float = 0.0
    code_share: float = 0.0


#: The fast step computes the eager step's operations in its order.
BIT_EQUAL = Agreement()
#: The compiled CPU step's own AdamW loop over fp32 moments orders a few operations otherwise than
#: torch's foreach step (measured: 0.81 ulps after 50 steps).
FP32_ULPS = Agreement("ulps", 2.0)
#: The factored row and column sums are ordered otherwise (measured: 7e-7 after 50 steps); a parameter an
#: ulp away moves an int8 momentum code across a boundary.
FACTORED_SUMS = Agreement("relative", 4e-6, 1e-4)
#: The device's route steps fp32 moments of fp32 parameters with torch's fused kernel reading the learning rate
#: as an fp32 tensor (what a CUDA graph replays: ``optim/graph_step.py``), so ``lr`` is rounded to fp32 where the
#: eager step takes it as a Python float (measured: 0.7 ulps after 5 steps and 1.4 after 50 at ``lr=1e-2``; the
#: same bits at an fp32-exact ``lr``: ``tests/optim/test_routes.py``).
FUSED_TENSOR_LR = Agreement("ulps", 2.0)


@dataclass(frozen=True)
class Parity:
    """How closely a format's steps agree: the bounds the shared test harness (``tests/support_formats.py``)
    reads for every backend, so that no test carries a copy.

    Attributes:
        reference: the largest relative difference (norm of the difference over the norm of the
            parameters' movement, and of each decoded moment) between the eager step and the readable
            reference (:mod:`lightning_baoc.formats.reference`): the eager step fuses and reorders fp32
            operations (torch's foreach order, chunked 8-bit updates, factored means as scaled sums), so
            they agree to fp32 rounding; ten times the largest measured (default: ``1e-5``).
        compiled: the compiled CPU step against the eager step (default: :data:`BIT_EQUAL`).
        triton: the Triton step against the eager step (default: :data:`BIT_EQUAL`).
    """

    reference: float = 1e-5
    compiled: Agreement = BIT_EQUAL
    triton: Agreement = BIT_EQUAL


class StateFormat(ABC):
    """Base class of the optimizer-state formats (one subclass per file)."""

    #: Public name, as in README.md's "State formats" table.
    name: ClassVar[str]
    #: Whether the format keeps a first moment.
    has_momentum: ClassVar[bool]
    #: Whether the format keeps a second moment (AdamW's do; SGD's and Lion's momentum formats not).
    has_second_moment: ClassVar[bool] = True
    #: Whether the format is 8-bit and so subject to the small-tensor threshold.
    quantized: ClassVar[bool] = False
    #: Whether the format needs a factorable (>= 2-D) shape.
    factored: ClassVar[bool] = False
    #: Whether states live in host memory rather than on the parameter's device.
    offloaded: ClassVar[bool] = False
    #: The format used for shapes this one cannot hold (1-D for factored, small for 8-bit).
    fallback: ClassVar[str | None] = None
    #: One line for tables and docs.
    summary: ClassVar[str] = ""
    #: The compiled kernel's momentum and second-moment kinds (:mod:`lightning_baoc.formats.kinds`), or
    #: ``None`` where the format has no compiled step.
    kernel_kinds: ClassVar[tuple[int, int] | None] = None
    #: How closely its steps agree: eager with the reference, fast backends with eager (:class:`Parity`).
    parity: ClassVar[Parity] = Parity()

    def accepts(self, shape: Shape, min_8bit_numel: int = 0) -> bool:
        """Whether this format can hold a tensor of ``shape`` (else :attr:`fallback` is used; a
        :class:`ShardShape`: whether it can hold the whole parameter, as every shard then does)."""
        shape = getattr(shape, "whole", shape)
        if self.factored and factor_dims(shape) is None:
            return False
        if self.quantized and numel_of(shape) < min_8bit_numel:
            return False
        return True

    @abstractmethod
    def layout(self, shape: Shape) -> tuple[TensorSpec, ...]:
        """The compact tensors stored for a parameter of ``shape``."""

    def state_bytes(self, shape: Shape) -> int:
        """Exact bytes of state for a parameter of ``shape`` held in this format (a :class:`ShardShape`:
        the most any of its shards holds)."""
        shards = getattr(shape, "shards", None)
        if shards:
            return max(sum(spec.nbytes for spec in self.shard_layout(sh, offset)) for sh, offset in shards)
        return sum(spec.nbytes for spec in self.layout(shape))

    def shard_layout(self, shape: Shape, offset: int = 0) -> tuple[TensorSpec, ...]:
        """The compact tensors stored for a shard of ``shape`` whose first element is element ``offset``
        of its parameter's flat order (FSDP2): :meth:`layout`, with the 8-bit formats' groups and
        super-blocks the whole parameter's (:func:`framed_specs`); :meth:`layout` itself at offset 0."""
        return framed_specs(self.layout(shape), numel_of(shape), offset % SUPER)

    @abstractmethod
    def encode(self, state: Canonical, views: dict[str, Tensor], hyper: StepHyper) -> None:
        """Write ``state`` into this format's compact tensors ``views`` (in place)."""

    @abstractmethod
    def decode(self, views: dict[str, Tensor], shape: Shape) -> Canonical:
        """Read the compact tensors back into fp32 (a new :class:`Canonical`)."""

    # Slice accessors: what a conversion streams through (:mod:`lightning_baoc.optim.convert`). The
    # defaults read and write moments stored as plain fp32 tensors ``exp_avg`` / ``exp_avg_sq``;
    # formats storing them otherwise override them (the element-wise 8-bit and bf16 formats).

    def load_m(self, views: dict[str, Tensor], start: int, stop: int) -> Tensor:
        """A new flat fp32 tensor of the momentum elements ``[start, stop)`` (formats with momentum)."""
        return _fp32_view(self, views, "exp_avg")[start:stop].clone()

    def store_m(self, m: Tensor, views: dict[str, Tensor], start: int, stop: int, hyper: StepHyper) -> None:
        """Store flat fp32 ``m`` (may be overwritten) as the momentum elements ``[start, stop)``."""
        _fp32_view(self, views, "exp_avg")[start:stop].copy_(m)

    def load_v(self, views: dict[str, Tensor], start: int, stop: int) -> Tensor:
        """A flat fp32 tensor of the second-moment elements ``[start, stop)`` (element-wise ``v``)."""
        return _fp32_view(self, views, "exp_avg_sq")[start:stop]

    def store_v(self, v: Tensor, views: dict[str, Tensor], start: int, stop: int, hyper: StepHyper) -> None:
        """Store flat fp32 ``v`` (may be overwritten) as the second-moment elements ``[start, stop)``."""
        _fp32_view(self, views, "exp_avg_sq")[start:stop].copy_(v)

    @abstractmethod
    def update(self, items: list[StepItem], hyper: StepHyper) -> None:
        """One AdamW step for every parameter in ``items`` (parameters and states in place)."""

    def __repr__(self) -> str:
        return f"<state format {self.name!r}>"

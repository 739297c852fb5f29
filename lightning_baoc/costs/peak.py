"""The memory a run adds at its peak beyond the weights it starts with, as BAOC plans it.

``lightning-baoc check`` and ``plan`` print it, and the callback prints it at the end of a run
beside what was measured (:mod:`lightning_baoc.report.memory`). Its terms:

- **gradients**: one per trainable parameter, in the parameter's dtype (a gradient is stored as it
  is computed: with ``zero_grad(set_to_none=True)``, Lightning's, there is no second copy; gradient
  accumulation adds each micro-batch's into it, one gradient's transient at a time, not counted);
- **state**: the optimizer state's most over the run's phases (:class:`~lightning_baoc.costs.StatePhases`:
  the conversion bound, master-weight corrections included);
- **instruments**: the sampler's buffers and the shadow moments (:mod:`lightning_baoc.costs.instruments`);
- **working memory**: BAOC's scratch, at most :func:`working_bytes` at any moment: a conversion's and a
  step's fp32 slices (``16 x chunk_size`` bytes) or the risk model's float64 terms over the sampled
  elements of one tensor (``96 x`` its ``max_elements``), one at a time.

Activations are not counted: they are the model's and the batch's, which a plan on the meta device
does not know.
"""

from __future__ import annotations

import math
from collections.abc import Mapping, Sequence
from dataclasses import asdict, dataclass

import torch

from lightning_baoc.config.budget import format_bytes
from lightning_baoc.formats.base import DEFAULT_CHUNK

#: Elements of one tensor the risk model scores at most (``risk.model.DEFAULT_MAX_ELEMENTS``).
RISK_ELEMENTS = 1 << 16
#: Bytes of fp32 scratch per element of a slice (a conversion's ``m``, ``v`` and their stores; a step's
#: working copies of a chunk).
SLICE_BYTES = 16
#: Bytes per scored element of the risk model's terms (about a dozen float64 arrays: moments, their
#: bias-corrected forms, the update, each format's round trip).
RISK_BYTES = 96


def working_bytes(chunk_size: int = DEFAULT_CHUNK, risk_elements: int = RISK_ELEMENTS) -> int:
    """BAOC's scratch at any moment: the larger of a slice's and the risk model's (they do not overlap).

    Measured on 10 x Linear(2048, 2048) (allocated bytes sampled every 0.3 ms): the allocation (risk
    scoring and conversion) held 6.9 MiB above what it kept in bf16-true, 8.2 MiB in fp32 (there with one
    parameter's conversion transient, which the state's conversion bound counts); this bound is 8 MiB.
    """
    return max(SLICE_BYTES * chunk_size, 0) + RISK_BYTES * risk_elements


@dataclass(frozen=True)
class PlannedPeak:
    """What a run adds to memory at its peak beyond its weights, by term (bytes; see the module docstring)."""

    gradients: int
    state: int
    instruments: int
    working: int
    staging: int = 0  # the offload schedule's device staging (optim/offload_schedule.py): BAOC's working memory too

    @property
    def total(self) -> int:
        return self.gradients + self.state + self.instruments + self.working + self.staging

    def line(self) -> str:
        """One line, e.g. ``139 MiB beyond the weights: gradients 80 MiB, ...``."""
        staging = f", offload staging <= {format_bytes(self.staging)}" if self.staging else ""
        return (f"{format_bytes(self.total)} beyond the weights: gradients {format_bytes(self.gradients)}, "
                f"optimizer state <= {format_bytes(self.state)}, "
                f"instruments {format_bytes(self.instruments)}, BAOC's working memory <= {format_bytes(self.working)}"
                f"{staging} (activations not counted)")

    def to_dict(self) -> dict[str, int]:
        return {**asdict(self), "total": self.total}


def gradient_bytes(shapes: Mapping[str, Sequence[Sequence[int]]], dtypes: Mapping[str, Sequence[torch.dtype]]) -> int:
    """The gradients of these tensors (block -> shapes) in their dtypes."""
    return sum(math.prod(s) * d.itemsize for b, row in shapes.items() for s, d in zip(row, dtypes[b]))


def planned_peak(
    shapes: Mapping[str, Sequence[Sequence[int]]], dtypes: Mapping[str, Sequence[torch.dtype]], state_bytes: int,
    instrument_bytes: int, chunk_size: int = DEFAULT_CHUNK, release: bool = False,
) -> PlannedPeak:
    """The :class:`PlannedPeak` of tensors of ``shapes`` (block -> shapes) training in ``dtypes`` with
    ``state_bytes`` of optimizer state at most and ``instrument_bytes`` of instruments; ``release``: gradient
    release (each parameter steps in backward and drops its gradient: none is held)."""
    grads = 0 if release else gradient_bytes(shapes, dtypes)
    return PlannedPeak(grads, int(state_bytes), int(instrument_bytes), working_bytes(chunk_size))


__all__ = ["PlannedPeak", "gradient_bytes", "planned_peak", "working_bytes"]

"""What training holds per parameter, measured from storages: weights, corrections, gradients, states.

:func:`training_memory` reads the storages of a model's parameters and gradients and of an
optimizer's state (BlockwiseAdamW, BlockwiseSGD, BlockwiseLion: their ``state_bytes()`` and
``weight_correction_bytes()``, which equal the storage they allocate; any other optimizer: the
storages of its ``state``). A storage shared by several tensors (tied weights, views) counts once.
Activations, the allocator's slack and the libraries are not in it: ``benchmarks/total_memory.py``
measures a whole run's peak beside it. Over sharded parameters (FSDP2's ``DTensor``) every figure is
this rank's: its shards' storages (FSDP2's padding included) and elements.

Example:
    >>> import torch
    >>> from lightning_baoc import BlockwiseAdamW, training_memory
    >>> model = torch.nn.Linear(64, 64).to(torch.bfloat16)
    >>> opt = BlockwiseAdamW(model.named_parameters(), state_format="int8", weight_correction="ecc8")
    >>> model(torch.randn(2, 64, dtype=torch.bfloat16)).float().sum().backward(); opt.step()
    >>> m = training_memory(model, opt)
    >>> m.per_param("weights"), m.per_param("corrections"), m.per_param("gradients")
    (2.0, 1.0, 2.0)
"""

from __future__ import annotations

from dataclasses import asdict, dataclass
from typing import Any, Iterable

import torch
from torch import Tensor, nn

from lightning_baoc.optim.sharding import local

PARTS = ("weights", "corrections", "gradients", "states")


@dataclass(frozen=True)
class TrainingMemory:
    """Bytes of storage per part, and the number of parameter elements they serve."""

    params: int
    weights: int
    corrections: int
    gradients: int
    states: int

    @property
    def total(self) -> int:
        """All four parts, in bytes."""
        return self.weights + self.corrections + self.gradients + self.states

    def per_param(self, part: str = "total") -> float:
        """Bytes per parameter element of ``part`` (one of :data:`PARTS`, or ``"total"``)."""
        if part != "total" and part not in PARTS:
            raise ValueError(f"unknown part {part!r}; choose one of {', '.join(PARTS)} or 'total'")
        value = self.total if part == "total" else getattr(self, part)
        return value / self.params if self.params else 0.0

    def to_dict(self) -> dict[str, Any]:
        """JSON-ready: the bytes of every part, the total and the parameter count."""
        return {**asdict(self), "total": self.total}


def _storage_bytes(tensors: Iterable[Tensor]) -> int:
    seen: dict[tuple[str, int], int] = {}
    for t in tensors:
        t = local(t)  # a sharded tensor: this rank's part (its storage)
        if t.device.type == "meta":
            seen[("meta", id(t))] = t.numel() * t.element_size()
            continue
        storage = t.untyped_storage()
        seen[(str(t.device), storage.data_ptr())] = storage.nbytes()
    return sum(seen.values())


def training_memory(model: nn.Module, optimizer: torch.optim.Optimizer | None = None) -> TrainingMemory:
    """The bytes ``model`` and ``optimizer`` hold now, from storages (see the module docstring).

    Gradients count where they exist (``None`` after ``zero_grad(set_to_none=True)`` or gradient
    release). An optimizer that is not one of the blockwise optimizers (BlockwiseAdamW, BlockwiseSGD,
    BlockwiseLion) holds no corrections.
    """
    params = [p for p in model.parameters()]
    unique = {id(p): p for p in params}.values()
    states = corrections = 0
    if optimizer is not None:
        if hasattr(optimizer, "weight_correction_bytes") and hasattr(optimizer, "state_bytes"):
            states = int(optimizer.state_bytes())
            corrections = int(optimizer.weight_correction_bytes())
        else:
            states = _storage_bytes(
                t for s in optimizer.state.values() for t in s.values() if isinstance(t, Tensor) and t.dim() > 0
            )
    return TrainingMemory(
        params=sum(local(p).numel() for p in unique),
        weights=_storage_bytes(unique),
        corrections=corrections,
        gradients=_storage_bytes(p.grad for p in unique if p.grad is not None),
        states=states,
    )


__all__ = ["PARTS", "TrainingMemory", "training_memory"]

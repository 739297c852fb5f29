"""Gradient release: each parameter steps as soon as backward has its gradient, which is then freed.

``BlockwiseAdamW.release_gradients()`` registers a post-accumulate-grad hook on every parameter
(as optimi and FlashOptim do). When backward finishes a parameter's gradient, the hook steps that
parameter, with its own format, correction and step counts, exactly as ``step()`` would, and sets
its ``.grad`` to ``None``: at most the gradients backward is still producing are alive, not the
model's (measured in ``benchmarks/total_memory.py``: 2 bytes per parameter of bf16 gradients gone).

The contract:

- Call ``step()`` once per iteration as usual (Lightning does): it steps whatever still holds a
  gradient (none, normally) and opens the next window.
- A parameter releases its gradient once per window. A second backward before ``step()``
  (gradient accumulation over micro-batches) would step each micro-batch on its own: the hook refuses
  it with an error that says so, before anything is stepped twice.
- Global-norm clipping (``clip_grad_norm_``, Lightning's ``gradient_clip_val``) needs every gradient
  before any step: it cannot combine with release (the gradients are gone when it runs; the Lightning
  callback :class:`lightning_baoc.GradientRelease` refuses the combination at setup).
- A parameter whose gradient holds inf or NaN is skipped as in ``step()``.
- Whatever must see the gradients before they go (BAOC's sampler and shadow moments) registers a
  gradient observer (:meth:`ReleaseMixin.add_gradient_observer`): the hook calls it with the
  parameter, its gradient complete, just before the parameter steps.

:class:`ReleaseMixin` expects the optimizer's ``_records``, ``_released``, ``_release_handles``,
``_rebuild``, ``target_format``, ``_sync_corrections`` and ``_step_params``.
"""

from __future__ import annotations

from collections import OrderedDict
from typing import Any, Callable

import torch
from torch import Tensor
from torch.utils.hooks import RemovableHandle

from lightning_baoc.optim.pools import Record
from lightning_baoc.optim.sharding import is_sharded


class GradientAccumulationError(RuntimeError):
    """A parameter released its gradient twice without a ``step()`` in between."""


class ReleaseMixin:
    """Gradient release of BlockwiseAdamW (see the module docstring)."""

    _records: dict[Tensor, Record]
    _released: set[Tensor]
    _release_handles: list[Any]
    _gradient_observers: OrderedDict[int, Callable[[Tensor], None]]
    param_groups: list[dict[str, Any]]

    def add_gradient_observer(self, observer: Callable[[Tensor], None]) -> RemovableHandle:
        """Call ``observer(param)`` in the release hook, with ``param.grad`` complete, before the
        parameter steps and its gradient is freed; returns a handle whose ``remove()`` ends it.

        Observers run in the order added, only while release is on, and are not copied with the
        optimizer (like torch's hooks)."""
        if not callable(observer):
            raise TypeError(f"observer must be callable, got {type(observer).__name__}")
        handle = RemovableHandle(self._gradient_observers)
        self._gradient_observers[handle.id] = observer
        return handle

    def release_gradients(self, enabled: bool = True) -> None:
        """Step each parameter in a post-accumulate-grad hook and free its gradient (``enabled``),
        or stop doing so (``False``). See :mod:`lightning_baoc.optim.gradient_release` for the contract."""
        for handle in self._release_handles:
            handle.remove()
        self._release_handles = []
        self._released.clear()
        if not enabled:
            return
        sharded = [self._records[p].name for g in self.param_groups for p in g["params"] if is_sharded(p)]
        if sharded:
            raise ValueError(
                f"gradient release over sharded parameters ({sharded[0]!r} is a DTensor): FSDP2 reduce-scatters "
                f"each gradient into its shard after backward, so no hook sees the sharded gradient in backward. "
                f"Train without release (FSDP2 already frees the unsharded gradients), or unshard the model."
            )
        for group in self.param_groups:
            for p in group["params"]:
                if p.requires_grad:
                    self._release_handles.append(p.register_post_accumulate_grad_hook(self._release_hook))

    @property
    def releases_gradients(self) -> bool:
        """Whether gradient release is on (:meth:`release_gradients`)."""
        return bool(self._release_handles)

    @torch.no_grad()
    def _release_hook(self, p: Tensor) -> None:
        rec = self._records[p]
        if p in self._released:
            raise GradientAccumulationError(
                f"BlockwiseAdamW with gradient release: {rec.name!r} received a second gradient before "
                f"step() was called. Gradient release steps every parameter during backward, so it cannot "
                f"accumulate gradients over micro-batches: call step() after every backward (Lightning: "
                f"accumulate_grad_batches=1), or turn release off with release_gradients(False)."
            )
        grad = p.grad
        if grad is None:
            return
        if grad.is_sparse:
            raise TypeError(f"BlockwiseAdamW does not support sparse gradients (parameter {rec.name!r})")
        self._released.add(p)
        for observer in list(self._gradient_observers.values()):
            observer(p)
        target = self.target_format(p)  # type: ignore[attr-defined]
        if rec.format is None:
            self._rebuild({p: target}, sources={p: None})  # type: ignore[attr-defined]
        elif target != rec.format:
            self._rebuild({p: target})  # type: ignore[attr-defined]
        self._sync_corrections([p])  # type: ignore[attr-defined]
        self._step_params([p])  # type: ignore[attr-defined]
        p.grad = None


__all__ = ["GradientAccumulationError", "ReleaseMixin"]

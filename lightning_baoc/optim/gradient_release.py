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
- Reentrant activation checkpointing (``torch.utils.checkpoint(..., use_reentrant=True)``) runs a
  backward of its own inside backward, so a module used in two places gets its gradient in parts: a
  parameter whose gradient arrives inside such a backward is not stepped in the hook but waits, its
  gradient accumulating, for ``step()`` (the whole gradient, as without release); it waits so from
  then on. A part that arrives from inside one after the parameter stepped on another use's part (its
  plain use came later in the forward) is refused with an error naming reentrant checkpointing
  (``use_reentrant=False`` gives one backward, and each gradient arrives whole).
- Whatever must see the gradients before they go (BAOC's sampler and shadow moments) registers a
  gradient observer (``BlockwiseAdamW.add_gradient_observer``): the hook calls it with the
  parameter, its gradient complete, just before the parameter steps.

:class:`ReleaseHooks` holds an optimizer's hooks, observers and the parameters released since the
last ``step()``.
"""

from __future__ import annotations

import sys
from collections import OrderedDict
from typing import Callable, Iterable

import torch
from torch import Tensor
from torch.utils.checkpoint import CheckpointFunction
from torch.utils.hooks import RemovableHandle

from lightning_baoc.optim.pools import Record
from lightning_baoc.optim.sharding import is_sharded


class GradientAccumulationError(RuntimeError):
    """A parameter released its gradient twice without a ``step()`` in between."""


class ReleaseHooks:
    """Gradient release of an optimizer (see the module docstring).

    Holds: the hooks registered on the parameters (:attr:`handles`), the parameters released since the
    last ``step()`` (:attr:`released`), and the gradient observers (:attr:`observers`).

    Needs: the records table (parameter -> :class:`~lightning_baoc.optim.pools.Record`, for the names in
    its messages). :meth:`enable` takes the parameters and ``step_one(p)``, which brings one parameter's
    state and correction to their targets and steps it (the optimizer's); it is held only while release
    is on.

    Example:
        >>> release = ReleaseHooks(records)  # doctest: +SKIP
        >>> release.enable(params, step_one)  # each parameter steps in backward  # doctest: +SKIP
        >>> release.new_window()  # at step(): each may release its gradient once again  # doctest: +SKIP
    """

    def __init__(self, records: dict[Tensor, Record]) -> None:
        self.records = records
        self.released: set[Tensor] = set()
        #: parameters whose gradient waits for ``step()`` in this window, and those that ever got a part of
        #: theirs inside reentrant checkpointing (they wait in every window; see the module docstring)
        self.waiting: dict[Tensor, None] = {}  # in arrival order (the observers see them in it)
        self.reentrant: set[Tensor] = set()
        self.handles: list[RemovableHandle] = []
        self.observers: OrderedDict[int, Callable[[Tensor], None]] = OrderedDict()
        self._step_one: Callable[[Tensor], None] | None = None

    def add_observer(self, observer: Callable[[Tensor], None]) -> RemovableHandle:
        """Call ``observer(param)`` in the hook, with ``param.grad`` complete, before the parameter steps;
        returns a handle whose ``remove()`` ends it."""
        if not callable(observer):
            raise TypeError(f"observer must be callable, got {type(observer).__name__}")
        handle = RemovableHandle(self.observers)
        self.observers[handle.id] = observer
        return handle

    def enable(self, params: Iterable[Tensor], step_one: Callable[[Tensor], None]) -> None:
        """Step each of ``params`` (those that require a gradient) through ``step_one`` in a
        post-accumulate-grad hook and free its gradient; sharded parameters are refused."""
        params = list(params)
        self._refuse_sharded(params)
        self.disable()
        self._step_one = step_one
        self._register(params)

    def extend(self, params: Iterable[Tensor]) -> None:
        """Release ``params`` too (a param group added while release is on: ``add_param_group``,
        ``BackboneFinetuning``); nothing while release is off."""
        if self._step_one is None:
            return
        params = list(params)
        self._refuse_sharded(params)
        self._register(params)

    def _register(self, params: list[Tensor]) -> None:
        for p in params:
            if p.requires_grad:
                self.handles.append(p.register_post_accumulate_grad_hook(self._hook))

    def _refuse_sharded(self, params: list[Tensor]) -> None:
        sharded = [self.records[p].name for p in params if is_sharded(p)]
        if sharded:
            raise ValueError(
                f"gradient release over sharded parameters ({sharded[0]!r} is a DTensor): FSDP2 reduce-scatters "
                f"each gradient into its shard after backward, so no hook sees the sharded gradient in backward. "
                f"Train without release (FSDP2 already frees the unsharded gradients), or unshard the model."
            )

    def disable(self) -> None:
        """Remove the hooks (the parameters' gradients stay until ``step()``)."""
        for handle in self.handles:
            handle.remove()
        self.handles = []
        self.released.clear()
        self.waiting.clear()
        self._step_one = None

    @property
    def enabled(self) -> bool:
        """Whether release is on (:meth:`enable` called, :meth:`disable` not since)."""
        return self._step_one is not None

    def new_window(self) -> list[Tensor]:
        """Open the next window (``step()``): each parameter may release its gradient once again. Returns the
        parameters that waited (their gradients, complete now, have gone to the observers): ``step()`` steps
        them and frees their gradients."""
        waited = [p for p in self.waiting if p.grad is not None]
        for p in waited:
            for observer in list(self.observers.values()):
                observer(p)
        self.waiting.clear()
        self.released.clear()
        return waited

    @torch.no_grad()
    def _hook(self, p: Tensor) -> None:
        rec = self.records[p]
        if p in self.released and _in_reentrant_backward():
            raise GradientAccumulationError(
                f"BlockwiseAdamW with gradient release: {rec.name!r} received a part of its gradient from inside "
                f"reentrant activation checkpointing (torch.utils.checkpoint(..., use_reentrant=True)) after it had "
                f"stepped on the part of another use in this backward: a module used in two places gets its "
                f"gradient in parts there. Use use_reentrant=False (one backward: each gradient arrives whole), or "
                f"train without release."
            )
        if p in self.released:
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
        if _in_reentrant_backward():
            self.reentrant.add(p)
        if p in self.reentrant:
            self.waiting[p] = None  # its gradient may come in parts: step() steps it whole
            return
        self.released.add(p)
        for observer in list(self.observers.values()):
            observer(p)
        assert self._step_one is not None  # set while the hooks are registered
        self._step_one(p)
        p.grad = None


def _in_reentrant_backward() -> bool:
    """Whether this runs inside the backward of a reentrant checkpoint: ``CheckpointFunction.backward`` runs a
    ``torch.autograd.backward`` of its own, on the thread that runs the outer one's nodes. Only the innermost
    ``torch.autograd.backward`` (a few frames up from the hook) and its caller are read, not the training
    loop's whole stack (7 us a hook at 60 frames)."""
    frame = sys._getframe(1)
    entry, checkpoint = torch.autograd.backward.__code__, CheckpointFunction.backward.__code__
    while frame is not None and frame.f_code is not entry:
        frame = frame.f_back
    return frame is not None and frame.f_back is not None and frame.f_back.f_code is checkpoint


__all__ = ["GradientAccumulationError", "ReleaseHooks"]

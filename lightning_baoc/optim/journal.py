"""The atomic step: what a step changes, copied before it writes and put back if it raises.

A step writes parameters, states, corrections and counts in place, tensor after tensor (and, in
the compiled and Triton kernels, many tensors in one call). A step that raises part-way (out of
memory in a temporary, an interrupt, a kernel's error) leaves some parameters stepped and others
not. With ``atomic_step=True`` the optimizer takes a :class:`StepJournal` before the first write:
a host copy of every parameter the step touches (this rank's part), its state tensors, its
master-weight correction and its counts. If the step raises, :meth:`StepJournal.restore` writes
them back, then the error goes on to the caller; if it completes, the journal is dropped.

Its cost is a transient of the stepped parameters' and states' bytes, held on the host (never on
the accelerator), and a copy of them each step: which is why it is an option, off by default.
Without it, a step validates everything it can before its first write (sparse gradients, the
kernels built and imported at construction), so the errors a step raises itself change nothing.

Example:
    >>> from lightning_baoc import BlockwiseAdamW
    >>> model = nn.Linear(8, 8)
    >>> opt = BlockwiseAdamW(model.named_parameters(), lr=1e-3, atomic_step=True)
    >>> model(torch.randn(2, 8)).sum().backward(); opt.step()
    >>> opt.atomic_step
    True
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import TYPE_CHECKING, Any, Iterable

import torch
from torch import Tensor

from lightning_baoc.optim.sharding import local

if TYPE_CHECKING:
    from lightning_baoc.optim.pools import Record

_HOST = torch.device("cpu")


def _copy(t: Tensor) -> Tensor:
    """A host copy of ``t`` (a clone on the host: never a view that the step would write through)."""
    return t.detach().to(_HOST, copy=True)


@dataclass
class _Entry:
    """One parameter's copies."""

    record: Record
    param: Tensor  # this rank's part of the parameter (written back in place)
    saved_param: Tensor
    views: list[tuple[Tensor, Tensor]]  # (a state tensor, its copy)
    correction: tuple[Tensor, Tensor] | None
    counts: Tensor
    unread_skip: Any


class StepJournal:
    """Host copies of what one step may change: parameters, states, corrections, counts, and the
    dispatcher's own book-keeping (the skips the device decided and the host has not read, the names
    warned of). Built by :meth:`take` before the step's first write; :meth:`restore` puts it back."""

    def __init__(self, entries: list[_Entry], dispatcher_state: dict[str, Any]) -> None:
        self.entries = entries
        self.dispatcher_state = dispatcher_state

    @classmethod
    def take(cls, params: Iterable[Tensor], records: dict[Tensor, Record], dispatcher: Any) -> "StepJournal":
        """Copy what stepping ``params`` may change (``records``: the optimizer's table; ``dispatcher``: the
        :class:`~lightning_baoc.optim.stepping.StepDispatcher` whose book-keeping moves with the step)."""
        entries = []
        for p in params:
            rec = records[p]
            part = local(p)
            views = [(t, _copy(t)) for t in (rec.views or {}).values()]
            correction = rec.master_correction
            entries.append(_Entry(rec, part, _copy(part), views,
                                  None if correction is None else (correction, _copy(correction)),
                                  rec.counts.clone(), rec.unread_skip))
        state = {"unread": list(dispatcher.unread), "warned": set(dispatcher.warned)}
        return cls(entries, state)

    def nbytes(self) -> int:
        """Bytes of the host copies."""
        total = 0
        for e in self.entries:
            total += e.saved_param.nbytes + sum(c.nbytes for _, c in e.views)
            total += 0 if e.correction is None else e.correction[1].nbytes
        return total

    @torch.no_grad()
    def restore(self, dispatcher: Any) -> None:
        """Write every copy back in place: the parameters, states, corrections and counts are as before the step."""
        for e in self.entries:
            e.param.copy_(e.saved_param)
            for t, saved in e.views:
                t.copy_(saved)
            if e.correction is not None:
                e.correction[0].copy_(e.correction[1])
            e.record.counts.copy_(e.counts)  # the record's current counts tensor (a plan may have rebound it)
            e.record.unread_skip = e.unread_skip
        dispatcher.unread[:] = self.dispatcher_state["unread"]
        dispatcher.warned.clear()
        dispatcher.warned.update(self.dispatcher_state["warned"])
        dispatcher.forget_plans()  # a plan built during the failed step is built again from what is restored

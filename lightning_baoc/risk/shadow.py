"""Shadow moments: exact fp32 AdamW moments of a fixed sample of each tensor's elements.

The risk model compares what a format would do with what fp32 AdamW does. When a block's state is
already held in a cheaper format (the warm-up runs in the start allocation; a re-evaluation finds
the allocation in force), its decoded state is not fp32 AdamW's: round-tripping an 8-bit state
through 8 bits again changes nothing, so the format in force would look free. The shadow keeps, for
every tensor, ``m`` and ``v`` of fp32 AdamW on a fixed random sample of its elements (1024-element
segments aligned to the 8-bit formats' super-blocks, at most ``max_elements`` per tensor), updated
from the same gradients at every optimizer step, with the optimizer's betas, skipping the steps the
optimizer skips (a non-finite gradient). The risk model then measures every format against these
moments, whatever format holds the state.

Sharded parameters (FSDP2): each rank shadows its own rows, so the moments differ per rank. A checkpoint
of such a shadow holds every rank's (:meth:`ShadowMoments.state_dict` gathers them, on every rank, as
a framework saves a checkpoint), and a load takes this rank's, checked against the world size.

Memory: 8 bytes per shadowed element, at most ``8 * max_elements`` per tensor (128 KiB at the
default 16384) plus the sampled super-blocks' numbers, on the parameter's device. Cost per step: one gather of the sampled gradient
elements and two fused updates per tensor.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any, Mapping

import torch
import torch.distributed as dist
from torch import Tensor

from lightning_baoc.formats.quant import SUPER
from lightning_baoc.optim.sharding import is_sharded, local, piece

#: Elements of each tensor shadowed (16 segments of 1024); smaller tensors are shadowed whole.
DEFAULT_SHADOW_ELEMENTS = 1 << 14


def choose_segments(numel: int, max_elements: int, generator: torch.Generator) -> Tensor | None:
    """Sorted random super-blocks (``SUPER`` elements each) covering <= max_elements, or None for all."""
    if numel <= max_elements:
        return None
    n_super = numel // SUPER  # whole super-blocks only: the tail is left out of the sample
    k = max(1, max_elements // SUPER)
    return torch.randperm(n_super, generator=generator)[:k].sort().values


def segment_index(segments: Tensor) -> Tensor:
    """The flat element indices of super-blocks ``segments``."""
    return (segments.unsqueeze(1) * SUPER + torch.arange(SUPER, device=segments.device)).reshape(-1)


def sample_segments(numel: int, max_elements: int, generator: torch.Generator) -> Tensor | None:
    """Indices of random super-block-aligned segments covering <= max_elements, or None for all."""
    segments = choose_segments(numel, max_elements, generator)
    return None if segments is None else segment_index(segments)


@dataclass
class ShadowEntry:
    """One tensor's shadow: the sampled super-blocks (None: every element), fp32 ``m`` and ``v``
    of the sampled elements, steps taken."""

    segments: Tensor | None
    exp_avg: Tensor
    exp_avg_sq: Tensor
    steps: int = 0

    @property
    def index(self) -> Tensor | None:
        """Flat indices of the sampled elements (None: every element)."""
        return None if self.segments is None else segment_index(self.segments)

    def corrected(self, betas: tuple[float, float]) -> tuple[Tensor, Tensor]:
        """Bias-corrected mean and mean square of the sampled gradient (fp64), for the ``betas`` the
        moments follow."""
        m = self.exp_avg.double() / (1.0 - betas[0] ** self.steps)
        v = self.exp_avg_sq.double() / (1.0 - betas[1] ** self.steps)
        return m, v

    def gather(self, flat: Tensor) -> Tensor:
        """The sampled elements of a flat tensor of the parameter's size."""
        if self.segments is None:
            return flat
        whole = flat.numel() // SUPER * SUPER
        return flat[:whole].view(-1, SUPER).index_select(0, self.segments).reshape(-1)


class ShadowMoments:
    """fp32 AdamW moments of a fixed sample of each parameter's elements (see the module docstring).

    Args:
        params: parameter name -> parameter (the optimizer's names).
        max_elements: elements shadowed per tensor (default: :data:`DEFAULT_SHADOW_ELEMENTS`).
        seed: seed of the sample.

    Example:
        >>> p = torch.nn.Parameter(torch.zeros(3)); p.grad = torch.ones(3)
        >>> shadow = ShadowMoments({"w": p})
        >>> shadow.update({"w": p}, {"w": (0.9, 0.999)})
        >>> shadow.entries["w"].exp_avg
        tensor([0.1000, 0.1000, 0.1000])
    """

    def __init__(self, params: Mapping[str, Tensor], max_elements: int = DEFAULT_SHADOW_ELEMENTS, seed: int = 0) -> None:
        generator = torch.Generator().manual_seed(seed)
        self.max_elements = int(max_elements)
        #: whether a parameter is sharded: the moments are this rank's (see the module docstring)
        self.sharded = any(is_sharded(p) or piece(p) is not None for p in params.values())
        self.entries: dict[str, ShadowEntry] = {}
        for name, p in params.items():
            numel = local(p).numel()  # a sharded parameter: this rank shadows its own rows
            segments = choose_segments(numel, self.max_elements, generator)
            n = numel if segments is None else segments.numel() * SUPER
            if segments is not None:
                segments = segments.to(p.device)
            zeros = torch.zeros(n, dtype=torch.float32, device=p.device)
            self.entries[name] = ShadowEntry(segments, zeros, zeros.clone())

    @torch.no_grad()
    def update(
        self, params: Mapping[str, Tensor], betas: Mapping[str, tuple[float, float]], grad_scale: float | None = None
    ) -> None:
        """One optimizer step's moments from the parameters' gradients (call before the step).

        One host synchronization per call (the finiteness of every sample, read at once), not one per
        tensor.
        """
        self.apply(self.samples(params, betas, grad_scale))

    @torch.no_grad()
    def samples(
        self, params: Mapping[str, Tensor], betas: Mapping[str, tuple[float, float]], grad_scale: float | None = None
    ) -> list[tuple[ShadowEntry, Tensor, tuple[float, float]]]:
        """The sampled gradient elements of ``params`` (copies: the gradients may go), for :meth:`apply`.

        :meth:`update` is the two at once; gradient release takes each parameter's sample in its hook
        and applies them all when the step's backward is done, with one synchronization."""
        out: list[tuple[ShadowEntry, Tensor, tuple[float, float]]] = []
        for name, p in params.items():
            entry = self.entries.get(name)
            if entry is None or p is None or p.grad is None:
                continue
            flat = local(p.grad).detach().reshape(-1)
            g = entry.gather(flat).to(torch.float32)
            if g.data_ptr() == flat.data_ptr():
                g = g.clone()
            if grad_scale is not None:
                g = g / grad_scale
            out.append((entry, g, betas[name]))
        return out

    @torch.no_grad()
    def apply(self, todo: list[tuple[ShadowEntry, Tensor, tuple[float, float]]]) -> None:
        """Advance the moments by the samples of :meth:`samples` (one host synchronization)."""
        if not todo:
            return
        finite = torch.stack([torch.isfinite(g).all().to(todo[0][1].device) for _, g, _ in todo]).tolist()
        for (entry, g, (beta1, beta2)), ok in zip(todo, finite):
            if not ok:
                continue  # the optimizer skips a non-finite gradient (its sample is a part of it)
            entry.exp_avg.lerp_(g, 1.0 - beta1)
            entry.exp_avg_sq.mul_(beta2).addcmul_(g, g, value=1.0 - beta2)
            entry.steps += 1

    def nbytes(self) -> int:
        """Bytes the shadow holds (moments and indices)."""
        out = 0
        for e in self.entries.values():
            out += e.exp_avg.nbytes + e.exp_avg_sq.nbytes + (e.segments.nbytes if e.segments is not None else 0)
        return out

    def state_dict(self) -> dict[str, Any]:
        """Moments, step counts and samples, as tensors and ints (for checkpoints).

        Of a sharded shadow in a process group of more than one rank: every rank's, gathered (a collective:
        call it on every rank, as Lightning and Fabric do when they save), under ``"ranks"`` with the
        ``"world"`` size; a framework that saves one rank's copy of the callback's state keeps them all."""
        entries = {
            name: {"segments": e.segments, "exp_avg": e.exp_avg, "exp_avg_sq": e.exp_avg_sq, "steps": e.steps}
            for name, e in self.entries.items()
        }
        if not (self.sharded and dist.is_available() and dist.is_initialized() and dist.get_world_size() > 1):
            return {"max_elements": self.max_elements, "entries": entries}
        host = {name: {k: (v.cpu() if isinstance(v, Tensor) else v) for k, v in e.items()} for name, e in entries.items()}
        ranks: list[Any] = [None] * dist.get_world_size()
        dist.all_gather_object(ranks, host)
        return {"max_elements": self.max_elements, "world": len(ranks), "ranks": ranks}

    def load_state_dict(self, state: Mapping[str, Any]) -> list[str]:
        """Restore :meth:`state_dict` for the tensors of both; returns the names that keep their fresh
        shadow, the reason in each: absent from the state, of another shape, or (a sharded state) saved by
        another world size."""
        entries = state.get("entries")
        if "ranks" in state:
            world = dist.get_world_size() if dist.is_available() and dist.is_initialized() else 1
            if int(state["world"]) != world or not self.sharded:
                return [f"{name} (saved by {state['world']} ranks, this run has {world})" for name in self.entries]
            entries = state["ranks"][dist.get_rank()]
        fresh = [f"{name} (not in the checkpoint)" for name in self.entries if name not in entries]
        for name, saved in entries.items():
            entry = self.entries.get(name)
            if entry is None:
                continue
            if saved["exp_avg"].shape != entry.exp_avg.shape:
                fresh.append(f"{name} (saved {tuple(saved['exp_avg'].shape)}, now {tuple(entry.exp_avg.shape)})")
                continue
            device = entry.exp_avg.device
            entry.segments = saved["segments"].to(device) if saved["segments"] is not None else None
            entry.exp_avg = saved["exp_avg"].to(device, torch.float32).clone()
            entry.exp_avg_sq = saved["exp_avg_sq"].to(device, torch.float32).clone()
            entry.steps = int(saved["steps"])
        return fresh


__all__ = ["DEFAULT_SHADOW_ELEMENTS", "ShadowEntry", "ShadowMoments", "choose_segments", "sample_segments", "segment_index"]

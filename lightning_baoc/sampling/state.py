"""The :class:`GradientSampler`'s checkpoint: its ring buffer and counts, saved and restored."""

from __future__ import annotations

import threading
from typing import Any, Callable, Mapping

from torch import Tensor

#: Format version of :meth:`GradientSampler.state_dict <SamplerStateMixin.state_dict>`.
STATE_VERSION = 1


class SamplerStateMixin:
    """``state_dict`` / ``load_state_dict`` of :class:`~lightning_baoc.sampling.GradientSampler`."""

    seed: int
    max_elements: int
    max_rows: int
    sample_every: int
    capacity: int
    _blocks: list[Any]
    _lock: threading.Lock
    _last_step: int | None
    _written: int
    _prev_row: tuple[int, int] | None
    _ring: Tensor
    _ring_valid: Tensor
    _ring_anisotropy: Tensor
    _ring_cosine: Tensor
    _ring_steps: Tensor

    # the sampler's: wait for the worker, clear the ring, its rows oldest first
    flush: Callable[[], None]
    _clear_ring: Callable[[], None]
    _order: Callable[[], Tensor]

    def state_dict(self) -> dict[str, Any]:
        """The ring buffer and counts, as tensors and primitives (loads with ``weights_only=True``).

        Indices are not stored: they follow from ``seed``, ``max_elements``, ``max_rows`` and the
        blocks, which are stored and checked on load. Size: about the ring's bytes.
        """
        self.flush()
        with self._lock:
            order = self._order()
            return {
                "version": STATE_VERSION,
                "seed": self.seed,
                "max_elements": self.max_elements,
                "max_rows": self.max_rows,
                "sample_every": self.sample_every,
                "capacity": self.capacity,
                "last_step": -1 if self._last_step is None else int(self._last_step),
                "blocks": {
                    b.name: {
                        "params": [s.name for s in b.segments],
                        "numel": b.numel,
                        "elements": b.elements,
                        "nonfinite": b.nonfinite,
                        "missing": b.missing,
                    }
                    for b in self._blocks
                },
                "samples": self._ring[order].clone(),
                "valid": self._ring_valid[order].clone(),
                "anisotropy": self._ring_anisotropy[order].clone(),
                "cosine": self._ring_cosine[order].clone(),
                "steps": self._ring_steps[order].clone(),
            }

    def load_state_dict(self, state_dict: Mapping[str, Any]) -> None:
        """Restore what :meth:`state_dict` saved; the sampler must be built the same way.

        A smaller ``capacity`` keeps the newest samples. Raises ``ValueError`` if the seed, the
        sampling bounds or the blocks differ (the saved samples would come from other indices).
        """
        if not isinstance(state_dict, Mapping) or state_dict.get("version") != STATE_VERSION:
            got = state_dict.get("version") if isinstance(state_dict, Mapping) else type(state_dict).__name__
            raise ValueError(
                f"state_dict is not a GradientSampler state of version {STATE_VERSION} (version {got!r}); "
                "pass what GradientSampler.state_dict() returned"
            )
        for key in ("seed", "max_elements", "max_rows"):
            if state_dict[key] != getattr(self, key):
                raise ValueError(
                    f"state_dict was saved with {key}={state_dict[key]!r}, this sampler has "
                    f"{key}={getattr(self, key)!r}; build the sampler with the saved value to load it"
                )
        saved = state_dict["blocks"]
        names = [b.name for b in self._blocks]
        if list(saved) != names:
            raise ValueError(
                f"state_dict has blocks {list(saved)[:8]}, this sampler {names[:8]}; "
                "build the sampler from the same partition to load it"
            )
        for b in self._blocks:
            s = saved[b.name]
            if list(s["params"]) != [seg.name for seg in b.segments] or int(s["numel"]) != b.numel:
                raise ValueError(
                    f"block {b.name!r} was saved with parameters {list(s['params'])} ({s['numel']} elements), "
                    f"here it has {[seg.name for seg in b.segments]} ({b.numel}); use the same partition"
                )
        n = min(int(state_dict["steps"].shape[0]), self.capacity)
        self.flush()
        with self._lock:
            self._clear_ring()
            if n:
                self._ring[:n] = state_dict["samples"][-n:]
                self._ring_valid[:n] = state_dict["valid"][-n:]
                self._ring_anisotropy[:n] = state_dict["anisotropy"][-n:]
                self._ring_cosine[:n] = state_dict["cosine"][-n:]
                self._ring_steps[:n] = state_dict["steps"][-n:]
            self._written = n
            # A follower sampled right after the resume still finds the ring row it belongs to.
            self._prev_row = (int(self._ring_steps[n - 1]), n - 1) if n else None
            for b in self._blocks:
                b.nonfinite = int(saved[b.name]["nonfinite"])
                b.missing = int(saved[b.name]["missing"])
        last = int(state_dict["last_step"])
        self._last_step = None if last < 0 else last

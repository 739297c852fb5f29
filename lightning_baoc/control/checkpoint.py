"""The controller's checkpointed state: what :meth:`BAOCController.state_dict` saves, and how a
resume re-applies it (the saved formats, the settings that shaped them, a changed partition).

A mixin of :class:`~lightning_baoc.control.controller.BAOCController`: the lifecycle owns the attributes,
this module owns their persistence.
"""

from __future__ import annotations

import logging
import warnings
from collections.abc import Mapping
from typing import Any

from lightning_baoc.config.settings import plain

log = logging.getLogger("lightning_baoc.control.controller")

#: Format version of :meth:`BAOCController.state_dict`.
STATE_VERSION = 1

#: The settings that shape the allocation, saved with the controller state and compared at resume.
ALLOCATION_SETTINGS = (
    "memory_budget",
    "time_budget",
    "formats",
    "granularity",
    "blocks",
    "min_8bit_numel",
    "max_block_risk",
    "corrections",
)


class CheckpointMixin:
    """State dict and resume of the controller (see the module docstring)."""

    # provided by the controller this is mixed into
    config: Any
    phase: str
    allocation: dict[str, str]
    block_params: dict[str, list[str]]
    pending: str | None
    best: float | None
    wait: int
    ring_samples: int
    steps: int
    history: list[dict[str, Any]]
    sampler: Any
    shadow: Any
    peak_state_bytes: int
    _peak: int
    optimizer: Any
    _loaded: dict[str, Any] | None
    _offered: list[str]
    installed: bool
    _apply_options: Any

    def state_dict(self) -> dict[str, Any]:
        """Phase, allocation, counters, the settings that shaped the allocation and the sampler's
        ring, as primitives and tensors.

        The optimizer's own (compact) state is saved by the framework with the optimizer.
        """
        return {
            "version": STATE_VERSION,
            "phase": self.phase,
            "allocation": dict(self.allocation),
            "blocks": {b: list(n) for b, n in self.block_params.items()},
            "pending": self.pending,
            "best": self.best,
            "wait": self.wait,
            "ring_samples": self.ring_samples,
            "steps": self.steps,
            "memory_budget": self.config.memory_budget,
            "time_budget": self.config.time_budget,
            "settings": self._settings(),
            "history": [dict(h) for h in self.history],
            "sampler": self.sampler.state_dict() if self.sampler is not None else None,
            "shadow": self.shadow.state_dict() if self.shadow is not None else None,
            "peak_state_bytes": self.peak_state_bytes,
            "rule": self.optimizer.rule if self.optimizer is not None else self._saved_rule(),
        }

    def _saved_rule(self) -> str | None:
        """The update rule of a state loaded but not applied yet (before install), else ``None``."""
        return None if self._loaded is None else self._loaded.get("rule")

    def _settings(self) -> dict[str, Any]:
        """:data:`ALLOCATION_SETTINGS` as primitives (the menu as a sorted list: order is not a change)."""
        out = {k: plain(getattr(self.config, k)) for k in ALLOCATION_SETTINGS}
        if out["formats"] is not None:
            out["formats"] = sorted(out["formats"])
        return out

    def load_state_dict(self, state_dict: Mapping[str, Any]) -> None:
        """Restore :meth:`state_dict`; before :meth:`install` (it is applied there) or after it.

        Installing with a saved allocation asks the optimizer for the saved formats, so a fresh
        optimizer is rebuilt heterogeneous; the optimizer's own ``load_state_dict`` then restores
        the compact states. If a setting that shapes the allocation (:data:`ALLOCATION_SETTINGS`:
        budgets, format menu, partition, ``min_8bit_numel``, ``max_block_risk``) differs from the
        saved one, a re-allocation runs before the next optimizer step (reason ``"settings"``,
        see :meth:`before_step`), from the states as they are: no step runs in a format the menu
        no longer holds. A changed partition maps the saved formats onto the new blocks parameter
        by parameter; where that is impossible it raises.

        Raises:
            ValueError: not a controller state; a state of another optimizer (AdamW's formats
                resumed with SGD); or a changed partition or model that leaves
                parameters of this run without a saved format (the message names the setting
                and the fix).
        """
        if not isinstance(state_dict, Mapping) or state_dict.get("version") != STATE_VERSION:
            got = state_dict.get("version") if isinstance(state_dict, Mapping) else type(state_dict).__name__
            raise ValueError(
                f"not a BAOC controller state of version {STATE_VERSION} (got version {got!r}); pass what "
                f"BAOCController.state_dict() returned"
            )
        if state_dict["phase"] not in ("warmup", "allocated"):
            raise ValueError(f"invalid BAOC phase {state_dict['phase']!r} in the state dict")
        self._loaded = dict(state_dict)
        if self.installed:
            self._apply_loaded()

    def _apply_loaded(self) -> None:
        sd, self._loaded = self._loaded, None
        assert sd is not None and self.optimizer is not None and self.sampler is not None
        # states written before SGD and Lion: AdamW's; None: saved before any install (no formats yet)
        saved_rule, rule = sd.get("rule", "adamw"), self.optimizer.rule
        if saved_rule is not None and saved_rule != rule:
            raise ValueError(
                f"BAOC cannot resume this checkpoint: its allocation holds {saved_rule} formats and the optimizer "
                f"is {type(self.optimizer).__name__} ({rule}); resume with the checkpoint's optimizer, or start a "
                f"new BAOC run from the weights (load them without ckpt_path)"
            )
        saved_blocks = {b: list(n) for b, n in sd["blocks"].items()}
        current = self._settings()
        # states written before the settings were saved carry the budgets only
        saved = sd.get("settings") or {**current, "memory_budget": sd["memory_budget"], "time_budget": sd["time_budget"]}
        changed = [k for k in ALLOCATION_SETTINGS if k in saved and saved[k] != current[k]]
        same_blocks = not saved_blocks or saved_blocks == self.block_params
        per_param = {}
        if not same_blocks and sd["phase"] == "allocated":
            per_param = self._map_allocation(saved_blocks, dict(sd["allocation"]), saved, changed)
        self.phase = sd["phase"]
        self.pending = sd["pending"]
        self.best = sd["best"]
        self.wait = int(sd["wait"])
        self.steps = int(sd["steps"])
        self.history = [dict(h) for h in sd["history"]]
        self._peak = max(self._peak, int(sd.get("peak_state_bytes", 0)))  # absent from older states
        if same_blocks:
            self.allocation = dict(sd["allocation"])
            self.ring_samples = int(sd["ring_samples"])
            if sd["sampler"] is not None:
                self.sampler.load_state_dict(sd["sampler"])
            if sd.get("shadow") is not None and self.shadow is not None:  # absent from older states
                self.shadow.load_state_dict(sd["shadow"])
            if self.allocation:
                self._apply_options(self.allocation, self.block_params)
        else:
            # the saved ring holds samples of other blocks: statistics start afresh
            self.ring_samples = 0
            if per_param:
                self._apply_options(per_param)
            self.allocation = {}
            for b, names in self.block_params.items():
                held = {per_param[n] for n in names if n in per_param}
                if len(held) == 1:
                    self.allocation[b] = held.pop()
            if self.phase == "warmup":
                warnings.warn(
                    f"BAOC: the blocks differ from the checkpoint's ({self._setting_change(saved, changed)}); "
                    f"the warm-up statistics gathered so far are dropped and sampling starts again.",
                    UserWarning,
                    stacklevel=3,
                )
        # a format the formats offered here lack (menu changed, or another device: offload
        # checkpointed on a GPU, resumed on a CPU) must not run a step, whatever the state says
        unoffered = {f for f in self.allocation.values() if f not in self._offered}
        if self.phase == "allocated" and (changed or not same_blocks or unoffered):
            self.pending = "settings"
            log.info("BAOC: %s changed since the checkpoint: re-allocating before the next step", changed or "blocks")

    def _map_allocation(
        self, saved_blocks: Mapping[str, list[str]], allocation: Mapping[str, str], saved: Mapping[str, Any], changed: list[str]
    ) -> dict[str, str]:
        """The saved formats per parameter, for this run's parameters; raises if one has none."""
        per_param = {n: allocation[b] for b, names in saved_blocks.items() if b in allocation for n in names}
        ours = [n for names in self.block_params.values() for n in names]
        missing = [n for n in ours if n not in per_param]
        if missing:
            raise ValueError(
                f"BAOC cannot resume this checkpoint's allocation: {len(missing)} of this run's {len(ours)} "
                f"parameters (e.g. {missing[:3]}) have no format in it ({self._setting_change(saved, changed)}). "
                f"Resume with the checkpoint's settings and model, or start a new BAOC run from the weights "
                f"(load them without ckpt_path), which warms up again."
            )
        return {n: per_param[n] for n in ours}

    def _setting_change(self, saved: Mapping[str, Any], changed: list[str]) -> str:
        """The partition settings that changed, as ``name=checkpoint's -> now``, or the model."""
        now = self._settings()
        parts = [f"{k}={saved[k]!r} in the checkpoint, {now[k]!r} now" for k in changed if k in ("granularity", "blocks")]
        return "; ".join(parts) if parts else "the model's trainable parameters differ from the checkpoint's"


__all__ = ["ALLOCATION_SETTINGS", "STATE_VERSION", "CheckpointMixin", "plain"]

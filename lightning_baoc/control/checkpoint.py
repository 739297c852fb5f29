"""The controller's checkpointed state: what :meth:`BAOCController.state_dict` saves, what a saved
state means for the run that resumes it (the saved formats, the settings that shaped them, a changed
partition).

:class:`ControllerCheckpoint` encodes the controller's state as primitives and tensors (it loads
under ``torch.load(weights_only=True)``), checks a state handed back, keeps it until the optimizer is
installed, and decodes it against this run's blocks and settings into a :class:`Resume`, which the
controller restores.
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any

from lightning_baoc.config.settings import BAOCConfig, plain

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


@dataclass
class Resume:
    """What a saved controller state restores in this run (:meth:`ControllerCheckpoint.resume`).

    Attributes:
        phase, pending, best, wait, steps, history: the lifecycle's saved values.
        peak_state_bytes: the peak state of the run so far (0 in states written before it was saved).
        same_blocks: whether the saved partition is this run's.
        allocation: block -> option in force after the resume: the saved one with the same blocks,
            else the blocks whose parameters all map to one saved option.
        per_param: parameter -> saved option, where the blocks changed after the first allocation.
        ring_samples, sampler, shadow: the saved statistics (the same blocks only: 0 and ``None`` else).
        changed: the :data:`ALLOCATION_SETTINGS` that differ from the saved ones.
        warning: what to say when the warm-up's statistics are dropped (``None``: nothing).
    """

    phase: str
    pending: str | None
    best: float | None
    wait: int
    steps: int
    history: list[dict[str, Any]]
    peak_state_bytes: int
    same_blocks: bool
    allocation: dict[str, str]
    per_param: dict[str, str]
    ring_samples: int
    sampler: Any
    shadow: Any
    changed: list[str]
    warning: str | None


class ControllerCheckpoint:
    """The codec of the controller's state dict, and the state loaded before install.

    Args:
        config: the settings; the :data:`ALLOCATION_SETTINGS` are saved from it and compared with
            the saved ones at resume.

    Attributes:
        loaded: a state handed to :meth:`accept` and not yet applied (``None``: none).

    Example:
        >>> codec = ControllerCheckpoint(BAOCConfig(memory_budget=0.5))
        >>> state = codec.encode(phase="warmup", allocation={}, blocks={"0": ["0", "1"]}, pending=None, best=None,
        ...                      wait=0, ring_samples=0, steps=3, history=[], sampler=None, shadow=None,
        ...                      peak_state_bytes=0, rule="adamw")
        >>> state["settings"]["memory_budget"], state["steps"]
        (0.5, 3)
        >>> codec.accept(state); resume = codec.resume(codec.take(), "adamw", "BlockwiseAdamW", {"0": ["0", "1"]})
        >>> resume.same_blocks, resume.changed, resume.steps
        (True, [], 3)
    """

    def __init__(self, config: BAOCConfig) -> None:
        self.config = config
        self.loaded: dict[str, Any] | None = None

    def settings(self) -> dict[str, Any]:
        """:data:`ALLOCATION_SETTINGS` as primitives (the menu as a sorted list: order is not a change)."""
        out = {k: plain(getattr(self.config, k)) for k in ALLOCATION_SETTINGS}
        if out["formats"] is not None:
            out["formats"] = sorted(out["formats"])
        return out

    def saved_rule(self) -> str | None:
        """The update rule of a state accepted but not applied yet (before install), else ``None``."""
        return None if self.loaded is None else self.loaded.get("rule")

    def encode(
        self,
        *,
        phase: str,
        allocation: Mapping[str, str],
        blocks: Mapping[str, list[str]],
        pending: str | None,
        best: float | None,
        wait: int,
        ring_samples: int,
        steps: int,
        history: list[dict[str, Any]],
        sampler: Any,
        shadow: Any,
        peak_state_bytes: int,
        rule: str | None,
    ) -> dict[str, Any]:
        """The state dict: the lifecycle's values, the settings that shaped the allocation and the
        instruments' states (``sampler``, ``shadow``: objects with ``state_dict()``, or ``None``)."""
        return {
            "version": STATE_VERSION,
            "phase": phase,
            "allocation": dict(allocation),
            "blocks": {b: list(n) for b, n in blocks.items()},
            "pending": pending,
            "best": best,
            "wait": wait,
            "ring_samples": ring_samples,
            "steps": steps,
            "memory_budget": self.config.memory_budget,
            "time_budget": self.config.time_budget,
            "settings": self.settings(),
            "history": [dict(h) for h in history],
            "sampler": sampler.state_dict() if sampler is not None else None,
            "shadow": shadow.state_dict() if shadow is not None else None,
            "peak_state_bytes": peak_state_bytes,
            "rule": rule,
        }

    def accept(self, state_dict: Mapping[str, Any]) -> None:
        """Check a state dict and keep it (:attr:`loaded`) until it is applied.

        Raises:
            ValueError: not a controller state of this version, or an unknown phase.
        """
        if not isinstance(state_dict, Mapping) or state_dict.get("version") != STATE_VERSION:
            got = state_dict.get("version") if isinstance(state_dict, Mapping) else type(state_dict).__name__
            raise ValueError(
                f"not a BAOC controller state of version {STATE_VERSION} (got version {got!r}); pass what "
                f"BAOCController.state_dict() returned"
            )
        if state_dict["phase"] not in ("warmup", "allocated"):
            raise ValueError(f"invalid BAOC phase {state_dict['phase']!r} in the state dict")
        self.loaded = dict(state_dict)

    def take(self) -> dict[str, Any] | None:
        """The state accepted, handed over once (:attr:`loaded` is cleared)."""
        sd, self.loaded = self.loaded, None
        return sd

    def resume(
        self, sd: Mapping[str, Any], rule: str, optimizer_name: str, block_params: Mapping[str, list[str]]
    ) -> Resume:
        """What ``sd`` restores for an optimizer of update rule ``rule`` over ``block_params``.

        A changed partition maps the saved formats onto the new blocks parameter by parameter.

        Raises:
            ValueError: a state of another update rule (AdamW's formats resumed with SGD), or a changed
                partition or model that leaves parameters of this run without a saved format (the
                message names the setting and the fix).
        """
        # states written before SGD and Lion: AdamW's; None: saved before any install (no formats yet)
        saved_rule = sd.get("rule", "adamw")
        if saved_rule is not None and saved_rule != rule:
            raise ValueError(
                f"BAOC cannot resume this checkpoint: its allocation holds {saved_rule} formats and the optimizer "
                f"is {optimizer_name} ({rule}); resume with the checkpoint's optimizer, or start a "
                f"new BAOC run from the weights (load them without ckpt_path)"
            )
        saved_blocks = {b: list(n) for b, n in sd["blocks"].items()}
        current = self.settings()
        # states written before the settings were saved carry the budgets only
        saved = sd.get("settings") or {**current, "memory_budget": sd["memory_budget"], "time_budget": sd["time_budget"]}
        changed = [k for k in ALLOCATION_SETTINGS if k in saved and saved[k] != current[k]]
        same_blocks = not saved_blocks or saved_blocks == block_params
        per_param: dict[str, str] = {}
        if not same_blocks and sd["phase"] == "allocated":
            per_param = self._map_allocation(saved_blocks, dict(sd["allocation"]), saved, changed, block_params)
        warning = None
        if same_blocks:
            allocation = dict(sd["allocation"])
        else:
            allocation = {}
            for b, names in block_params.items():
                held = {per_param[n] for n in names if n in per_param}
                if len(held) == 1:
                    allocation[b] = held.pop()
            if sd["phase"] == "warmup":
                warning = (
                    f"BAOC: the blocks differ from the checkpoint's ({self._setting_change(saved, changed)}); "
                    f"the warm-up statistics gathered so far are dropped and sampling starts again."
                )
        return Resume(
            phase=sd["phase"],
            pending=sd["pending"],
            best=sd["best"],
            wait=int(sd["wait"]),
            steps=int(sd["steps"]),
            history=[dict(h) for h in sd["history"]],
            peak_state_bytes=int(sd.get("peak_state_bytes", 0)),  # absent from older states
            same_blocks=same_blocks,
            allocation=allocation,
            per_param=per_param,
            # with other blocks the saved ring holds samples of those: statistics start afresh
            ring_samples=int(sd["ring_samples"]) if same_blocks else 0,
            sampler=sd["sampler"] if same_blocks else None,
            shadow=sd.get("shadow") if same_blocks else None,  # absent from older states
            changed=changed,
            warning=warning,
        )

    def _map_allocation(
        self,
        saved_blocks: Mapping[str, list[str]],
        allocation: Mapping[str, str],
        saved: Mapping[str, Any],
        changed: list[str],
        block_params: Mapping[str, list[str]],
    ) -> dict[str, str]:
        """The saved formats per parameter, for this run's parameters; raises if one has none."""
        per_param = {n: allocation[b] for b, names in saved_blocks.items() if b in allocation for n in names}
        ours = [n for names in block_params.values() for n in names]
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
        now = self.settings()
        parts = [f"{k}={saved[k]!r} in the checkpoint, {now[k]!r} now" for k in changed if k in ("granularity", "blocks")]
        return "; ".join(parts) if parts else "the model's trainable parameters differ from the checkpoint's"


__all__ = ["ALLOCATION_SETTINGS", "STATE_VERSION", "ControllerCheckpoint", "Resume"]

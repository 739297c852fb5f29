"""The controller's state-dict codec (``lightning_baoc.control.checkpoint.ControllerCheckpoint``), alone:
what it saves, what it refuses, and what a saved state restores in a run with the same or other
blocks and settings."""

from __future__ import annotations

import io
from typing import Any

import pytest
import torch

from lightning_baoc.config.settings import BAOCConfig
from lightning_baoc.control.checkpoint import ALLOCATION_SETTINGS, STATE_VERSION, ControllerCheckpoint

BLOCKS = {"a": ["0", "1"], "b": ["2"]}


class Saved:
    """An instrument with a state dict of a tensor."""

    def state_dict(self) -> dict[str, Any]:
        return {"ring": torch.arange(4.0)}


def _codec(**settings: Any) -> ControllerCheckpoint:
    return ControllerCheckpoint(BAOCConfig(**{"memory_budget": 0.5, **settings}))


def _state(codec: ControllerCheckpoint, phase: str = "allocated", blocks: dict[str, list[str]] = BLOCKS, **fields: Any) -> dict[str, Any]:
    values: dict[str, Any] = {
        "phase": phase,
        "allocation": {"a": "int8", "b": "bf16"} if phase == "allocated" else {},
        "blocks": blocks,
        "pending": None,
        "best": 0.5,
        "wait": 1,
        "ring_samples": 3,
        "steps": 40,
        "history": [{"step": 20, "reason": "warmup"}],
        "sampler": Saved(),
        "shadow": None,
        "peak_state_bytes": 1234,
        "rule": "adamw",
        **fields,
    }
    return codec.encode(**values)


def test_the_state_is_primitives_and_tensors_and_loads_weights_only() -> None:
    codec = _codec(formats=["int8", "fp32", "bf16"])
    state = _state(codec)
    assert state["version"] == STATE_VERSION and set(state["settings"]) == set(ALLOCATION_SETTINGS)
    assert state["settings"]["formats"] == ["bf16", "fp32", "int8"]  # sorted: the order is not a change
    assert state["memory_budget"] == 0.5 and state["time_budget"] is None
    buffer = io.BytesIO()
    torch.save(state, buffer)
    buffer.seek(0)
    loaded = torch.load(buffer, weights_only=True)
    assert torch.equal(loaded.pop("sampler")["ring"], torch.arange(4.0))
    assert loaded == {k: v for k, v in state.items() if k != "sampler"}


def test_states_of_another_version_or_phase_are_refused_and_one_is_kept_until_taken() -> None:
    codec = _codec()
    with pytest.raises(ValueError, match="not a BAOC controller state of version 1"):
        codec.accept({"version": 0})
    with pytest.raises(ValueError, match="got version 'list'"):
        codec.accept([])  # type: ignore[arg-type]
    with pytest.raises(ValueError, match="invalid BAOC phase 'done'"):
        codec.accept({**_state(codec), "phase": "done"})
    assert codec.loaded is None and codec.saved_rule() is None
    codec.accept(_state(codec, rule="sgd"))
    assert codec.saved_rule() == "sgd"
    assert codec.take() is not None and codec.take() is None and codec.loaded is None


def test_the_same_blocks_and_settings_restore_everything() -> None:
    codec = _codec()
    resume = codec.resume(_state(codec), "adamw", "BlockwiseAdamW", BLOCKS)
    assert resume.same_blocks and resume.changed == [] and resume.warning is None
    assert resume.allocation == {"a": "int8", "b": "bf16"} and resume.per_param == {}
    assert (resume.phase, resume.pending, resume.best, resume.wait, resume.steps) == ("allocated", None, 0.5, 1, 40)
    assert resume.ring_samples == 3 and torch.equal(resume.sampler["ring"], torch.arange(4.0))
    assert resume.history == [{"step": 20, "reason": "warmup"}] and resume.peak_state_bytes == 1234


def test_changed_settings_are_named() -> None:
    saved = _state(_codec(memory_budget=0.3, max_block_risk=0.1))
    resume = _codec().resume(saved, "adamw", "BlockwiseAdamW", BLOCKS)
    assert resume.changed == ["memory_budget", "max_block_risk"] and resume.same_blocks
    # a state written before the settings were saved carries the budgets only
    older = {k: v for k, v in saved.items() if k != "settings"}
    assert _codec().resume(older, "adamw", "BlockwiseAdamW", BLOCKS).changed == ["memory_budget"]


def test_a_changed_partition_maps_the_saved_formats_parameter_by_parameter() -> None:
    codec = _codec()
    merged = {"ab": ["0", "1", "2"]}
    resume = codec.resume(_state(codec), "adamw", "BlockwiseAdamW", merged)
    assert not resume.same_blocks and resume.per_param == {"0": "int8", "1": "int8", "2": "bf16"}
    assert resume.allocation == {}  # the new block holds two formats: none in force
    split = {"a0": ["0"], "a1": ["1"], "b": ["2"]}
    resume = codec.resume(_state(codec), "adamw", "BlockwiseAdamW", split)
    assert resume.allocation == {"a0": "int8", "a1": "int8", "b": "bf16"}
    assert resume.ring_samples == 0 and resume.sampler is None and resume.shadow is None  # other blocks' samples
    warm = codec.resume(_state(codec, phase="warmup"), "adamw", "BlockwiseAdamW", split)
    assert warm.per_param == {} and "the warm-up statistics gathered so far are dropped" in str(warm.warning)
    assert "the model's trainable parameters differ" in str(warm.warning)


def test_what_cannot_be_resumed_is_refused_naming_the_cause_and_the_fix() -> None:
    codec = _codec()
    with pytest.raises(ValueError, match=r"1 of this run's 4 parameters \(e.g. \['3'\]\) have no format in it"):
        codec.resume(_state(codec), "adamw", "BlockwiseAdamW", {**BLOCKS, "c": ["3"]})
    regrouped = _state(_codec(granularity="layer"))
    with pytest.raises(ValueError, match=r"granularity='layer' in the checkpoint, 'module' now"):
        codec.resume(regrouped, "adamw", "BlockwiseAdamW", {"c": ["3"]})
    with pytest.raises(ValueError, match=r"holds adamw formats and the optimizer is BlockwiseSGD \(sgd\)"):
        codec.resume(_state(codec), "sgd", "BlockwiseSGD", BLOCKS)
    older = {k: v for k, v in _state(codec).items() if k != "rule"}  # written before SGD and Lion: AdamW's
    with pytest.raises(ValueError, match="holds adamw formats"):
        codec.resume(older, "lion", "BlockwiseLion", BLOCKS)
    unset = _state(codec, rule=None, phase="warmup")  # saved before any install: any optimizer
    assert codec.resume(unset, "sgd", "BlockwiseSGD", BLOCKS).same_blocks

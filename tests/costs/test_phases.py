"""The optimizer state of a run's phases (``lightning_baoc.costs.phases``, ``AllocationProblem.phases``):
the start the planner reports is the start the training controller takes, byte for byte as allocated,
and a real conversion from the start to the steady allocation stays within the reported bound."""

from __future__ import annotations

import json
import math
from pathlib import Path

import pytest
import torch
from torch import nn

import lightning_baoc.costs.phases as phases_module
from lightning_baoc import BlockwiseAdamW
from lightning_baoc.control.controller import BAOCController
from lightning_baoc.costs import PHASES, AllocationProblem, StatePhases, state_phases
from lightning_baoc.costs.options import split_option
from lightning_baoc.formats import format_state_bytes, resolve_format
from lightning_baoc.risk.prior import block_kind
from lightning_baoc.sampling.blocks import partition


def _model() -> nn.Module:
    torch.manual_seed(0)
    return nn.Sequential(
        nn.Embedding(512, 64), nn.Linear(64, 256), nn.GELU(), nn.Linear(256, 256), nn.LayerNorm(256), nn.Linear(256, 64)
    )


def _step(model: nn.Module, opt: torch.optim.Optimizer) -> None:
    """One real optimizer step: the states are created."""
    for p in model.parameters():
        p.grad = torch.randn_like(p)
    opt.step()


def _problem(model: nn.Module) -> tuple[AllocationProblem, dict[str, str], dict[str, list[str]]]:
    named = dict(model.named_parameters())
    blocks = partition(model)
    shapes = {b: [tuple(named[n].shape) for n in names] for b, names in blocks.items()}
    return AllocationProblem(shapes, "cpu"), {b: block_kind(model, b) for b in blocks}, blocks


def _by_hand(problem: AllocationProblem, start: dict[str, str], steady: dict[str, str]) -> tuple[int, int, int]:
    """(start bytes, steady bytes, the conversion bound) from the tensors, on the CPU (no offload saving)."""
    before = after = transient = 0
    for block, shapes in problem.shapes.items():
        for s in shapes:
            old, new = format_state_bytes(start[block], s), format_state_bytes(steady[block], s)
            before, after = before + old, after + new
            if resolve_format(start[block], s) != resolve_format(steady[block], s):
                transient = max(transient, min(old, new))
    return before, after, max(before, after) + transient


@pytest.mark.parametrize("initial", [None, "mapping", "record"])
def test_the_start_phase_is_the_controllers_start_as_allocated(initial: str | None, tmp_path: Path) -> None:
    model = _model()
    problem, kinds, blocks = _problem(model)
    given: object = None
    if initial == "mapping":
        given = {"0": "bf16", "5": "fp32"}
    elif initial == "record":
        record = {"blocks": [{"name": b, "risk": {"fp32": 0.0, "factored": 0.001, "int8": 0.5}} for b in blocks]}
        given = tmp_path / "baoc_allocation.json"
        given.write_text(json.dumps(record))
    phases = problem.phases(kinds, 0.3, initial=given)

    ctl = BAOCController(memory_budget=0.3, warmup_steps=50, sample_every=5, initial=given)
    opt = ctl.install(torch.optim.AdamW(model.parameters(), lr=1e-3), model)
    _step(model, opt)
    assert phases.start.formats == ctl.start_allocation
    assert phases.start_bytes == phases.warmup_bytes == opt.state_bytes() == opt.peak_state_bytes()
    assert opt.state_bytes() <= ctl.memory_budget_bytes() == phases.budget_bytes
    # without measured risk the run is expected to stay where it started
    assert phases.steady.formats == phases.start.formats and phases.converted_tensors == 0
    assert phases.conversion_bytes == phases.start_bytes == phases.steady_bytes
    if initial == "mapping":
        assert ctl.start_allocation["0"] == "bf16" and ctl.start_allocation["5"] == "fp32"
    if initial == "record":
        assert set(ctl.start_allocation.values()) <= {"fp32", "factored"}
    ctl.close()


def test_a_conversion_peaks_within_the_reported_bound() -> None:
    model = _model()
    problem, kinds, blocks = _problem(model)
    measured = {b: {"fp32": 0.0, "factored": 0.001, "int8": 0.5} for b in blocks}
    phases = problem.phases(kinds, 0.35, steady_risk=measured)
    start, steady = dict(phases.start.formats), dict(phases.steady.formats)
    assert steady != start and phases.converted_tensors > 0
    assert (phases.start_bytes, phases.steady_bytes, phases.conversion_bytes) == _by_hand(problem, start, steady)
    assert phases.transient_bytes > 0
    assert [f.phase for f in phases.figures()] == list(PHASES) and not phases.exceeded()

    opt = BlockwiseAdamW(model.named_parameters(), lr=1e-3)
    opt.set_formats(start, blocks=blocks)
    _step(model, opt)
    assert opt.state_bytes() == phases.start_bytes
    opt.reset_peak_state_bytes()
    changed = opt.set_formats(steady, blocks=blocks)
    assert len(changed) == phases.converted_tensors
    assert opt.state_bytes() == phases.steady_bytes
    assert max(phases.start_bytes, phases.steady_bytes) <= opt.peak_state_bytes() <= phases.conversion_bytes


def test_phases_limits_and_json() -> None:
    model = _model()
    problem, kinds, blocks = _problem(model)
    phases = problem.phases(kinds, 0.5, steady_risk={b: {"fp32": 0.0, "int8": 0.5, "factored": 0.01} for b in blocks})
    figures = {f.phase: f for f in phases.figures()}
    assert figures["warm-up"].state_bytes == figures["start"].state_bytes
    assert figures["start"].limit_bytes == figures["steady"].limit_bytes == phases.budget_bytes
    assert figures["conversion"].limit_bytes == phases.budget_bytes + phases.largest_tensor_bytes
    largest = max(
        format_state_bytes(f, s) for allocation in (phases.start, phases.steady)
        for b, f in allocation.formats.items() for s in problem.shapes[b]
    )  # fmt: skip
    assert phases.largest_tensor_bytes == largest
    data = json.loads(json.dumps(phases.to_dict()))
    assert list(data["phases"]) == list(PHASES)
    assert data["phases"]["conversion"]["state_bytes"] == phases.conversion_bytes
    assert all(row["within"] for row in data["phases"].values())
    assert data["start_formats"] == phases.start.formats and data["converted_blocks"] == phases.converted_blocks
    assert "conversion <=" in phases.summary()


def test_an_allocation_above_its_budget_is_reported_exceeded() -> None:
    model = _model()
    problem, kinds, _ = _problem(model)
    phases = problem.phases(kinds, 0.3)
    fp32 = type(phases.start)(**{**phases.start.__dict__, "formats": {b: "fp32" for b in phases.start.formats}})
    old = phases_module.state_phases(problem.shapes, "cpu", fp32, phases.steady, phases.budget_bytes)
    assert isinstance(old, StatePhases)
    assert old.start_bytes == problem.fp32_bytes > phases.budget_bytes
    assert [f.phase for f in old.exceeded()] == ["start", "warm-up", "conversion"]


def test_offload_costs_no_device_bytes_on_an_accelerator() -> None:
    shapes = {"a": [(256, 256)], "b": [(256, 256)]}
    problem = AllocationProblem(shapes, "cuda", ["fp32", "int8", "offload"], timed=True)
    kinds = {"a": "other", "b": "other"}
    phases = problem.phases(kinds, 0.3, 20.0, steady_risk={"a": {"offload": 0.0}, "b": {"int8": 0.0}})
    assert phases.steady.formats == {"a": "offload", "b": "int8"}
    assert phases.steady_bytes == format_state_bytes("int8", (256, 256))


@pytest.mark.parametrize("initial", [None, "mapping"])
def test_with_corrections_the_start_is_the_controllers_states_and_corrections(initial: str | None) -> None:
    """bf16 weights, ``corrections``: the planned start names the controller's options, and its bytes are
    what the optimizer holds in states and corrections; a conversion counts changed corrections."""
    model = _model().to(torch.bfloat16)
    named = dict(model.named_parameters())
    blocks = partition(model)
    shapes = {b: [tuple(named[n].shape) for n in names] for b, names in blocks.items()}
    dtypes = {b: [named[n].dtype for n in names] for b, names in blocks.items()}
    baseline = sum(2 * p.numel() * p.element_size() for p in model.parameters())  # torch AdamW's bf16 moments
    corrections = ["none", "ecc8", "ecc16"]
    problem = AllocationProblem(shapes, "cpu", corrections=corrections, dtypes=dtypes, baseline_bytes=baseline)
    kinds = {b: block_kind(model, b) for b in blocks}
    given = {"0": "nomomentum_int8+ecc16", "3": "int8"} if initial == "mapping" else None
    phases = problem.phases(kinds, 0.6, initial=given)

    ctl = BAOCController(memory_budget=0.6, warmup_steps=50, sample_every=5, corrections=corrections, initial=given)
    opt = ctl.install(torch.optim.AdamW(model.parameters(), lr=1e-3), model)
    _step(model, opt)
    assert phases.start.formats == ctl.start_allocation
    assert any("+ecc" in o for o in phases.start.formats.values())
    assert phases.budget_bytes == ctl.memory_budget_bytes()
    assert phases.start_bytes == opt.state_bytes() + opt.weight_correction_bytes() <= phases.budget_bytes
    if given:
        assert {b: ctl.start_allocation[b] for b in given} == given
    ctl.close()

    # a steady allocation that drops every correction: each 16-bit tensor converts, by its correction at least
    steady = problem.solve({b: {o: (0.0 if "+" not in o else 1.0) for o in problem.allowed} for b in blocks}, 0.6)
    moved = state_phases(shapes, "cpu", phases.start, steady, phases.budget_bytes, dtypes=dtypes)
    corrected = sum(math.prod(s) * (2 if "ecc16" in phases.start.formats[b] else 1)
                    for b, ss in shapes.items() for s in ss if "+" in phases.start.formats[b])
    assert moved.start_bytes == phases.start_bytes and moved.steady_bytes == sum(
        format_state_bytes(steady.formats[b], s) for b, ss in shapes.items() for s in ss)
    assert moved.start_bytes - corrected == sum(
        format_state_bytes(split_option(phases.start.formats[b])[0], s) for b, ss in shapes.items() for s in ss)
    assert moved.converted_tensors >= sum(len(ss) for b, ss in shapes.items() if "+" in phases.start.formats[b])

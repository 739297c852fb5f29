"""The device's planned step (``lightning_baoc/optim/device_plan.py``) against the unplanned one, through
Triton's interpreter on the CPU (``TRITON_INTERPRET=1``, set by ``tests/conftest.py``): the same bits
through a run with skipped steps, a conversion, a 16-bit weight with its correction and steps of a subset
of the parameters; a plan built once and kept while it holds, rebuilt when what it read changes, and
dropped when a conversion replaces the states it holds."""

from __future__ import annotations

import copy
import gc
import os
import weakref

import numpy as np
import pytest
import torch
from torch import nn

if torch.cuda.is_available():  # pragma: no cover - the GPU runs the kernels compiled
    pytest.skip("CUDA present: tests/integrations/test_cuda.py runs the kernels on the GPU", allow_module_level=True)
if os.environ.get("TRITON_INTERPRET") != "1":  # tests/conftest.py sets it before triton is imported
    pytest.skip("TRITON_INTERPRET=1 is not set", allow_module_level=True)
pytest.importorskip("triton", reason="triton is not installed (the CUDA step's optional kernels)")

import lightning_baoc.optim.stepping as stepping  # noqa: E402
from lightning_baoc import BlockwiseAdamW, kernels  # noqa: E402
from lightning_baoc.optim import device_plan  # noqa: E402


@pytest.fixture
def builds(monkeypatch: pytest.MonkeyPatch) -> list[int]:
    """CPU parameters take the device's path (the Triton kernels, torch's fused AdamW for fp32); each
    plan built is recorded (its parameters)."""
    monkeypatch.setattr(kernels, "TRITON_DEVICES", {"cuda", "cpu"})
    monkeypatch.setattr(stepping, "kernel_serves", lambda *args: False)
    built: list[int] = []
    real = device_plan.DevicePlan.__init__

    def counted(self, params, *args, **kwargs):  # type: ignore[no-untyped-def]
        built.append(len(params))
        real(self, params, *args, **kwargs)

    monkeypatch.setattr(device_plan.DevicePlan, "__init__", counted)
    return built


def _model() -> list[tuple[str, nn.Parameter]]:
    gen = torch.Generator().manual_seed(0)
    shapes = {"a": (37, 101), "b": (300,), "c": (64, 64), "d": (5,), "e": (2, 1024), "f": (3, 11)}
    named = [(name, nn.Parameter(torch.randn(shape, generator=gen) * 0.1)) for name, shape in shapes.items()]
    named.append(("h", nn.Parameter((torch.randn(20, 50, generator=gen) * 0.1).to(torch.bfloat16))))
    return named


def _run(planned: bool, monkeypatch: pytest.MonkeyPatch) -> tuple[list[torch.Tensor], dict, dict]:
    """Eight steps of a model of int8, bf16, fp32 and bf16-weight (ecc8) parameters: NaNs at step 3 (an
    int8 and an fp32 tensor: the fused call's repair), conversions before step 5 (three formats change)
    and step 7 (``e`` back to fp32 with a momentum re-created, whose counts the fused kernel cannot take:
    the host decides it), step 6 with ``b`` and ``f`` without gradients."""
    with monkeypatch.context() as patch:
        if not planned:
            patch.setattr(stepping.StepDispatcher, "_planned",
                          lambda self, index, hyper, params, records, on: ([], list(zip(params, records))))
        named = _model()
        params = dict(named)
        opt = BlockwiseAdamW(named, lr=1e-2, state_format="int8", min_8bit_numel=0, weight_correction="ecc8")
        opt.set_formats({"b": "fp32", "d": "fp32", "f": "bf16", "e": "fp32"})
        gen = torch.Generator().manual_seed(1)
        for step in range(1, 9):
            if step == 5:
                opt.set_formats({"a": "bf16", "e": "nomomentum", "f": "fp32"})
            if step == 7:
                opt.set_formats({"e": "fp32"})
            for name, p in named:
                p.grad = None if step == 6 and name in ("b", "f") else (torch.randn(p.shape, generator=gen) * 1e-2).to(p.dtype)
            if step == 3:
                params["a"].grad[3, 7] = float("nan")
                params["d"].grad[1] = float("inf")
            with pytest.warns(RuntimeWarning) if step == 4 else _nothing():  # the device skips are applied at the next step
                opt.step()
        out = []
        for _, p in named:
            rec = opt._records[p]  # noqa: SLF001 - the state itself
            out += [p.detach().clone(), *(t.clone() for _, t in sorted(rec.views.items()))]
            if rec.master_correction is not None:
                out.append(rec.master_correction.clone())
        counts = {rec.name: (rec.step, rec.m_step) for rec in opt._records.values()}  # noqa: SLF001
        return out, counts, opt.nonfinite_counts


class _nothing:  # noqa: N801 - a context manager that does nothing (no warning expected)
    def __enter__(self) -> None:
        return None

    def __exit__(self, *args: object) -> None:
        return None


@pytest.mark.slow  # long; the route matrix's device route holds it by default (tests/optim/test_routes.py)
def test_the_planned_step_equals_the_unplanned_one(builds: list[int], monkeypatch: pytest.MonkeyPatch) -> None:
    planned, counts, skipped = _run(True, monkeypatch)
    # plans: the first step's, kept; after each conversion (they dropped them); step 6's subset
    assert builds == [7, 7, 5, 7]
    unplanned, counts_u, skipped_u = _run(False, monkeypatch)
    assert builds == [7, 7, 5, 7]  # the unplanned run built none
    assert skipped == skipped_u == {"a": 1, "d": 1}
    assert counts == counts_u == {"a": (7, 7), "b": (7, 7), "c": (8, 8), "d": (7, 7), "e": (8, 3), "f": (7, 7),
                                  "h": (8, 8)}
    assert len(planned) == len(unplanned)
    for x, y in zip(planned, unplanned):
        assert x.dtype == y.dtype and torch.equal(x, y)


def test_a_conversion_drops_the_plans_and_frees_the_old_state(builds: list[int]) -> None:
    p = nn.Parameter(torch.randn(64, 64))
    q = nn.Parameter(torch.randn(64, 64))
    opt = BlockwiseAdamW([("p", p), ("q", q)], state_format="fp32")
    for t in (p, q):
        t.grad = torch.randn(64, 64)
    opt.step()
    opt.step()
    assert builds == [2] and len(opt._stepper.plans) == 1  # noqa: SLF001 - built once, kept
    old = weakref.ref(opt._records[p].views["exp_avg"])  # noqa: SLF001 - the state the plan holds
    opt.set_formats({"p": "int8"})
    assert opt._stepper.plans == {}  # noqa: SLF001
    gc.collect()
    assert old() is None  # nothing holds the old fp32 state
    opt.step()
    assert builds == [2, 2]


def test_a_plan_whose_tensors_changed_is_built_again(builds: list[int], monkeypatch: pytest.MonkeyPatch) -> None:
    """A parameter's data replaced, a gradient of another layout: the plan is built again for the step (a
    gradient the kernel does not serve takes the host's step), with the unplanned step's results."""
    def run(planned: bool) -> list[torch.Tensor]:
        with monkeypatch.context() as patch:
            if not planned:
                patch.setattr(stepping.StepDispatcher, "_planned",
                          lambda self, index, hyper, params, records, on: ([], list(zip(params, records))))
            gen = torch.Generator().manual_seed(0)
            p, q = (nn.Parameter(torch.randn(40, 40, generator=gen)) for _ in range(2))
            opt = BlockwiseAdamW([("p", p), ("q", q)], state_format="bf16", min_8bit_numel=0)
            for step in range(4):
                if step == 2:
                    p.data = p.data.clone()  # new storage
                p.grad = torch.randn(40, 40, generator=gen)
                q.grad = torch.randn(40, 40, generator=gen)
                if step == 3:
                    q.grad = q.grad.t()  # not contiguous
                opt.step()
            return [p.detach().clone(), q.detach().clone(), *(t.clone() for r in opt._records.values()  # noqa: SLF001
                                                                   for t in r.views.values())]

    planned = run(True)
    assert builds == [2, 2, 2]  # the first step, the new data, the new layout
    for x, y in zip(planned, run(False)):
        assert torch.equal(x, y)


def test_the_plans_advance_rows_of_one_counts_array(builds: list[int]) -> None:
    """Every record's counts are a row of the optimizer's one counts array (a plan advances its rows with
    one numpy operation): two subsets stepping in turn keep their two plans, neither rebinding the other's
    counts; the counts are the steps each parameter took; a deep copy holds counts of its own."""
    gen = torch.Generator().manual_seed(0)
    params = {name: nn.Parameter(torch.randn(32, 32, generator=gen)) for name in "abc"}
    opt = BlockwiseAdamW(list(params.items()), state_format="int8", min_8bit_numel=0)
    for step in range(6):
        for name, p in params.items():
            p.grad = None if step % 2 and name == "c" else torch.randn(32, 32, generator=gen)
        opt.step()
    assert builds == [3, 2]  # one plan per subset, each kept
    array = opt._stepper.count_store.array  # noqa: SLF001 - the store itself
    records = opt._records.values()  # noqa: SLF001
    assert all(np.shares_memory(rec.counts.numpy(), array) for rec in records)
    assert {rec.name: (rec.step, rec.m_step) for rec in records} == {"a": (6, 6), "b": (6, 6), "c": (3, 3)}
    twin = copy.deepcopy(opt)
    for p in twin.param_groups[0]["params"]:
        p.grad = torch.randn(32, 32, generator=gen)
    twin.step()
    assert {rec.name: rec.step for rec in twin._records.values()} == {"a": 7, "b": 7, "c": 4}  # noqa: SLF001
    assert {rec.name: rec.step for rec in records} == {"a": 6, "b": 6, "c": 3}


@pytest.mark.slow  # long; the route matrix's device route holds it by default (tests/optim/test_routes.py)
def test_the_factored_formats_step_through_the_plan_as_unplanned(builds: list[int], monkeypatch: pytest.MonkeyPatch) -> None:
    """``factored`` and ``int8_factored`` tensors (fp32 and bf16 weights, an ecc8 correction) in the plan: their
    vectors and factors in two launches for all of them (kernels/triton_factored.py), the same bits as the
    unplanned step, a NaN skipping its tensor alone (its vectors kept)."""
    def run(planned: bool) -> tuple[list[torch.Tensor], dict]:
        with monkeypatch.context() as patch:
            if not planned:
                patch.setattr(stepping.StepDispatcher, "_planned",
                              lambda self, index, hyper, params, records, on: ([], list(zip(params, records))))
            gen = torch.Generator().manual_seed(0)
            shapes = {"a": (37, 101), "b": (64, 64), "c": (130, 20), "d": (300, 7)}
            named = [(n, nn.Parameter(torch.randn(s, generator=gen) * 0.1)) for n, s in shapes.items()]
            named.append(("h", nn.Parameter((torch.randn(20, 50, generator=gen) * 0.1).to(torch.bfloat16))))
            opt = BlockwiseAdamW(named, lr=1e-2, weight_decay=0.1, state_format="factored", min_8bit_numel=0,
                                 weight_correction="ecc8")
            opt.set_formats({"b": "int8_factored", "d": "int8_factored"})
            for step in range(6):
                for _, p in named:
                    p.grad = (torch.randn(p.shape, generator=gen) * 1e-2).to(p.dtype)
                if step == 2:
                    named[2][1].grad[5, 5] = float("nan")
                with pytest.warns(RuntimeWarning) if step == 3 else _nothing():
                    opt.step()
            if planned:  # the factored tensors are the plan's, none left to the unplanned step
                assert [len(plan.entries) for plan in opt._stepper.plans.values()] == [5]  # noqa: SLF001
            out = []
            for _, p in named:
                rec = opt._records[p]  # noqa: SLF001
                out += [p.detach().clone(), *(t.clone() for _, t in sorted(rec.views.items()))]
            return out, opt.nonfinite_counts

    planned, skipped = run(True)
    assert builds == [5]  # every tensor in one plan, kept
    unplanned, skipped_u = run(False)
    assert skipped == skipped_u == {"c": 1}
    for x, y in zip(planned, unplanned):
        assert x.dtype == y.dtype and torch.equal(x, y)

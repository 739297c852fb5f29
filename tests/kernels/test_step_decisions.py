"""The compiled step decides in the kernel: no tensor is read on the host to launch it.

- ``BlockwiseAdamW.step`` over CPU parameters in every compiled format reads no tensor value
  (``item``, ``tolist``, ``float``, ``int``, ``bool``, ``numpy``, ...), with finite gradients and
  with a non-finite one (the kernel says which it skipped); on CUDA the Triton kernels and torch's
  fused AdamW read each gradient's finiteness flag on the device: no synchronisation in ``step()``.
- A non-finite gradient skips its parameter (value, state and step counts untouched, the skip
  counted and warned once) and nothing else, in the same batch or another, and the compiled step
  stays bit-equal to the eager one through the skip and through a checkpoint resume after it.
- fp32 states whose momentum counts its own steps (re-created by a conversion) take the kernel's
  own fp32 loop, like every fp32 state: within a few ulps of the eager (foreach) step.
"""

from __future__ import annotations

import contextlib
import warnings
from typing import Iterator

import pytest
import torch
from torch import nn

from lightning_baoc import FORMATS, BlockwiseAdamW, kernels
from lightning_baoc.kernels import compiled

pytestmark = pytest.mark.skipif(not kernels.cpu_kernels().available, reason=f"no compiled kernels: {kernels.cpu_kernels().detail}")

COMPILED = [name for name, fmt in FORMATS.items() if fmt.kernel_kinds is not None]
#: The Tensor methods that read a value on the host (on CUDA: a device-to-host synchronisation).
READS = ("item", "tolist", "numpy", "__float__", "__int__", "__bool__", "__index__", "__array__", "__len__")


@contextlib.contextmanager
def no_tensor_reads() -> Iterator[list[str]]:
    """Make every host read of a tensor's value raise (and record it) inside the block."""
    seen: list[str] = []
    saved = {name: getattr(torch.Tensor, name) for name in READS}

    def refuse(name: str):  # type: ignore[no-untyped-def]
        def method(self, *args, **kwargs):  # type: ignore[no-untyped-def]
            seen.append(name)
            raise AssertionError(f"Tensor.{name} read on the step path")

        return method

    for name in READS:
        setattr(torch.Tensor, name, refuse(name))
    try:
        yield seen
    finally:
        for name, method in saved.items():
            setattr(torch.Tensor, name, method)


def _model() -> nn.Module:
    torch.manual_seed(0)
    return nn.Sequential(*[nn.Linear(48, 48) for _ in range(len(COMPILED))], nn.Linear(48, 3))


def _optimizer(model: nn.Module, policy: str = "compiled") -> BlockwiseAdamW:
    opt = BlockwiseAdamW(model.named_parameters(), lr=1e-2, weight_decay=0.1, min_8bit_numel=0, kernels=policy)
    opt.set_formats({f"{i}.weight": fmt for i, fmt in enumerate(COMPILED)})
    return opt


def _backward(model: nn.Module, seed: int) -> None:
    """Gradients drawn per step, independent of the parameters: the factored formats' ulps stay in
    their own parameters instead of reaching every gradient through the forward pass."""
    gen = torch.Generator().manual_seed(seed)
    for p in model.parameters():
        p.grad = torch.randn(p.shape, generator=gen) * 0.1


def test_the_compiled_step_reads_no_tensor() -> None:
    model = _model()
    opt = _optimizer(model)
    for seed in range(2):  # the states exist after the first step (their formats set above)
        _backward(model, seed)
        opt.step()
    assert {rec.format for rec in opt._records.values()} >= set(COMPILED)  # noqa: SLF001
    for seed in range(2, 5):
        _backward(model, seed)
        with no_tensor_reads() as seen:
            opt.step()
        assert seen == []
    # a non-finite gradient: the kernel skips it and says which, still without a read
    _backward(model, 5)
    model[2].weight.grad[3, 7] = float("nan")
    with pytest.warns(RuntimeWarning, match="non-finite gradient for '2.weight'"), no_tensor_reads() as seen:
        opt.step()
    assert seen == []
    assert opt.nonfinite_counts == {"2.weight": 1}
    assert opt.step_count("2.weight") == 5 and opt.step_count("1.weight") == 6


def test_the_guard_catches_a_read() -> None:
    """The guard itself: a step that reads the finiteness on the host (the eager one) is caught."""
    model = _model()
    opt = _optimizer(model, "eager")
    _backward(model, 0)
    opt.step()
    _backward(model, 1)
    with pytest.raises(AssertionError, match="read on the step path"), no_tensor_reads():
        opt.step()


@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
@pytest.mark.parametrize("fmt", ["fp32", "int8", "bf16", "nomomentum_int8", "factored", "int8_factored"])
def test_the_cuda_step_does_not_synchronise(fmt: str) -> None:
    """On CUDA the kernels read each gradient's finiteness flag on the device (the Triton kernels,
    torch's fused AdamW as found_inf): ``step()`` makes no device-to-host synchronisation."""
    pytest.importorskip("triton")
    model = _model().cuda()
    opt = BlockwiseAdamW(model.named_parameters(), lr=1e-2, state_format=fmt, min_8bit_numel=0)
    for p in model.parameters():
        p.grad = torch.randn_like(p)
    opt.step()  # the states exist and the kernels are compiled from here
    for i in range(3):
        for p in model.parameters():
            p.grad = torch.randn_like(p)
        torch.cuda.synchronize()
        if i == 1:
            next(model.parameters()).grad[0, 0] = float("nan")  # a skip decided on the device
        torch.cuda.set_sync_debug_mode("error")
        try:
            opt.step()
        finally:
            torch.cuda.set_sync_debug_mode(0)
        # nothing waited for this step's flags either (an event wait escapes the sync-debug mode)
        assert all(rec.unread_skip is not None for rec in opt._records.values())  # noqa: SLF001
    assert opt.nonfinite_counts == {"0.weight": 1}


def _run(policy: str, bad: dict[int, tuple[str, tuple[int, int]]], steps: int = 8) -> BlockwiseAdamW:
    model = _model()
    opt = _optimizer(model, policy)
    for i in range(steps):
        _backward(model, i)
        if i in bad:
            name, where = bad[i]
            dict(model.named_parameters())[name].grad[where] = float("inf") if i % 2 else float("nan")
        with warnings.catch_warnings():
            warnings.simplefilter("ignore", RuntimeWarning)
            opt.step()
    return opt


def _same(a: BlockwiseAdamW, b: BlockwiseAdamW) -> None:
    """Bit-equal: parameters, states and counts."""
    for (pa, ra), (pb, rb) in zip(a._records.items(), b._records.items()):  # noqa: SLF001
        assert ra.name == rb.name and ra.format == rb.format
        assert torch.equal(ra.counts, rb.counts), ra.name
        assert torch.equal(pa, pb), ra.name
        for key in ra.views:
            assert torch.equal(ra.views[key], rb.views[key]), (ra.name, key)


def test_a_skip_equals_the_eager_skip_and_touches_nothing_else() -> None:
    bad = {3: ("0.weight", (1, 2)), 4: ("5.weight", (0, 0)), 5: ("0.weight", (47, 47))}
    compiled_run, eager_run = _run("compiled", bad), _run("eager", bad)
    assert compiled_run.nonfinite_counts == eager_run.nonfinite_counts == {"0.weight": 2, "5.weight": 1}
    assert compiled_run.step_count("0.weight") == 6 and compiled_run.step_count("0.bias") == 8
    _same_elementwise(compiled_run, eager_run)


@pytest.mark.parametrize("fmt", [name for name in COMPILED if FORMATS[name].factored])
@pytest.mark.parametrize("value, skipped", [(float("nan"), True), (float("-inf"), True), (3e38, False)],
                         ids=["nan", "inf", "finite-squares-overflow"])
def test_the_factored_formats_test_their_gradients_through_their_sums(fmt: str, value: float, skipped: bool) -> None:
    """The factored formats learn a non-finite gradient from their row sums (no read of their own):
    an inf or a NaN skips the parameter as the eager step does; a finite gradient whose squares
    overflow the sums is told apart by the exact test and steps, as in the eager step."""
    def run(policy: str) -> tuple[BlockwiseAdamW, nn.Parameter]:
        p = nn.Parameter(torch.randn(40, 70, generator=torch.Generator().manual_seed(0)))
        opt = BlockwiseAdamW([("w", p)], lr=1e-2, state_format=fmt, min_8bit_numel=0, kernels=policy)
        gen = torch.Generator().manual_seed(1)
        for i in range(4):
            p.grad = torch.randn(40, 70, generator=gen)
            if i == 2:
                p.grad[17, 33] = value
            with warnings.catch_warnings():
                warnings.simplefilter("ignore", RuntimeWarning)
                opt.step()
        return opt, p

    (compiled_opt, pc), (eager_opt, pe) = run("compiled"), run("eager")
    assert compiled_opt.formats() == {"w": fmt}
    assert compiled_opt.nonfinite_counts == eager_opt.nonfinite_counts == ({"w": 1} if skipped else {})
    assert compiled_opt.step_count("w") == eager_opt.step_count("w") == (3 if skipped else 4)
    both_finite = torch.isfinite(pc) == torch.isfinite(pe)
    assert bool(both_finite.all())
    finite = torch.isfinite(pe)
    assert torch.allclose(pc[finite], pe[finite], rtol=1e-5, atol=1e-7)


def _same_elementwise(a: BlockwiseAdamW, b: BlockwiseAdamW) -> None:
    """Bit-equal but for the factored formats (their sums are ordered differently) and the fp32
    states (the eager step runs torch's fused AdamW, the compiled one its own loop): within ulps,
    tests/kernels/test_cpu_step.py; the counts equal."""
    for (pa, ra), (pb, rb) in zip(a._records.items(), b._records.items()):  # noqa: SLF001
        assert torch.equal(ra.counts, rb.counts), ra.name
        if FORMATS[ra.format].factored:
            assert torch.allclose(pa, pb, rtol=1e-5, atol=1e-7), ra.name
            continue
        if FORMATS[ra.format].kernel_kinds == (kernels.M_FP32, kernels.V_FP32):
            for x, y in ((pa, pb), *((ra.views[k], rb.views[k]) for k in ra.views)):
                assert torch.allclose(x, y, rtol=1e-5, atol=1e-7), ra.name
            continue
        assert torch.equal(pa, pb), ra.name
        for key in ra.views:
            assert torch.equal(ra.views[key], rb.views[key]), (ra.name, key)


def test_a_skipped_parameter_is_untouched_and_the_others_step(monkeypatch: pytest.MonkeyPatch) -> None:
    """Batches of 2,304 elements: the 48x48 weights fall into different batches; a skip in one
    leaves its parameter, state and counts exactly as they were and steps every other one."""
    monkeypatch.setattr(compiled, "BATCH_ELEMENTS", 48 * 48)
    model = _model()
    opt = _optimizer(model)
    for i in range(3):
        _backward(model, i)
        opt.step()
    before = {rec.name: (p.detach().clone(), {k: v.clone() for k, v in rec.views.items()}, rec.counts.clone())
              for p, rec in opt._records.items()}  # noqa: SLF001
    _backward(model, 3)
    for name in ("1.weight", "3.weight"):
        dict(model.named_parameters())[name].grad[5, 5] = float("nan")
    with pytest.warns(RuntimeWarning, match="non-finite gradient"):
        opt.step()
    for p, rec in opt._records.items():  # noqa: SLF001
        value, views, counts = before[rec.name]
        if rec.name in ("1.weight", "3.weight"):
            assert torch.equal(p, value) and torch.equal(rec.counts, counts + torch.tensor([0, 0, 1]))
            assert all(torch.equal(rec.views[k], views[k]) for k in views)
        else:
            assert not torch.equal(p, value), rec.name
            assert int(rec.counts[0]) == int(counts[0]) + 1


def test_a_skip_warns_once_per_parameter() -> None:
    model = _model()
    opt = _optimizer(model)
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        for i in range(4):
            _backward(model, i)
            model[0].weight.grad[0, 0] = float("nan")
            opt.step()
    messages = [str(w.message) for w in caught if "non-finite" in str(w.message)]
    assert len(messages) == 1 and "'0.weight'" in messages[0]
    assert opt.nonfinite_counts == {"0.weight": 4}


def test_resume_after_a_skip_is_bit_equal() -> None:
    bad = {2: ("1.weight", (4, 4))}
    whole = _run("compiled", bad, steps=8)
    model = _model()
    opt = _optimizer(model)
    for i in range(5):
        _backward(model, i)
        if i == 2:
            model[1].weight.grad[4, 4] = float("nan")
        with warnings.catch_warnings():
            warnings.simplefilter("ignore", RuntimeWarning)
            opt.step()
    saved_model = {k: v.clone() for k, v in model.state_dict().items()}
    saved = opt.state_dict()
    model2 = _model()
    model2.load_state_dict(saved_model)
    opt2 = BlockwiseAdamW(model2.named_parameters(), lr=1e-2, weight_decay=0.1, min_8bit_numel=0, kernels="compiled")
    opt2.load_state_dict(saved)
    for i in range(5, 8):
        _backward(model2, i)
        opt2.step()
    _same(opt2, whole)


def test_fp32_with_its_own_momentum_count_is_within_ulps_of_the_eager_step() -> None:
    """A momentum re-created by a conversion (nomomentum -> fp32) counts its own steps: the eager step
    leaves torch's fused kernel (one count for both corrections) for the foreach step; the compiled
    step's own fp32 loop takes each correction from its own count."""
    def run(policy: str) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        torch.manual_seed(0)
        p = nn.Parameter(torch.randn(300, 70))
        opt = BlockwiseAdamW([("w", p)], lr=1e-2, weight_decay=0.1, state_format="nomomentum", kernels=policy)
        gen = torch.Generator().manual_seed(1)
        for i in range(60):
            if i == 5:
                opt.set_formats({"w": "fp32"})
            p.grad = torch.randn(300, 70, generator=gen)
            opt.step()
        assert opt.momentum_step_count("w") != opt.step_count("w")
        state = opt.param_state("w")
        return p.detach().clone(), state.exp_avg, state.exp_avg_sq

    (pc, mc, vc), (pe, me, ve) = run("compiled"), run("eager")
    for a, b in ((mc, me), (vc, ve)):  # measured: equal
        assert int((a.view(torch.int32).long() - b.view(torch.int32).long()).abs().max()) <= 2
    # the parameters: an ulp of each update (a multiplication by 1/sqrt(bc2) where the reference
    # divides by sqrt(bc2)), many ulps only of values that cancel to near zero (measured: 5.8e-8 of
    # the largest value, 0.5% of elements beyond 4 ulps)
    assert float((pc - pe).abs().max() / pe.abs().max()) <= 1e-6


@pytest.mark.parametrize("threads", [1, 2])
@pytest.mark.parametrize("fmt", ["fp32", "bf16", "int8"])
def test_every_batch_tests_its_gradients_before_it_steps(monkeypatch: pytest.MonkeyPatch, fmt: str,
                                                         threads: int) -> None:
    """Batches of 30,000 elements over tensors of ragged sizes (under a super-block, over a batch, and
    large enough for 2 threads to share): an inf or a NaN at a tensor's first, middle or last element,
    in the first batch or a later one, skips that tensor and no other, as the eager step does, at 1
    and 2 threads."""
    monkeypatch.setattr(compiled, "BATCH_ELEMENTS", 30000)
    shapes = [(700,), (37, 110), (40000,), (1024,), (3, 15000), (2100,), (130, 300), (9,)]
    bad = {2: [(0, -1), (4, 22500)], 3: [(2, 0), (7, -1)], 4: [(6, -1), (5, 0), (1, 2000)]}

    def run(policy: str) -> BlockwiseAdamW:
        gen = torch.Generator().manual_seed(0)
        params = [nn.Parameter(torch.randn(s, generator=gen)) for s in shapes]
        opt = BlockwiseAdamW([(f"p{i}", p) for i, p in enumerate(params)], lr=1e-2, weight_decay=0.1,
                             state_format=fmt, min_8bit_numel=0, kernels=policy)
        for step in range(6):
            for p in params:
                p.grad = torch.randn(p.shape, generator=gen) * 0.1
            for k, (i, where) in enumerate(bad.get(step, [])):
                params[i].grad.view(-1)[where] = float("nan") if k % 2 else float("-inf")
            with warnings.catch_warnings():
                warnings.simplefilter("ignore", RuntimeWarning)
                opt.step()
        return opt

    saved = torch.get_num_threads()
    torch.set_num_threads(threads)
    try:
        compiled_opt, eager_opt = run("compiled"), run("eager")
    finally:
        torch.set_num_threads(saved)
    skips = {f"p{i}": sum(1 for hits in bad.values() for j, _ in hits if j == i) for i in range(len(shapes))}
    assert compiled_opt.nonfinite_counts == {name: n for name, n in skips.items() if n}
    for name, n in skips.items():
        assert compiled_opt.step_count(name) == 6 - n
    _same_elementwise(compiled_opt, eager_opt)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_the_gradient_test_finds_a_non_finite_value_in_every_part_of_its_read(dtype: torch.dtype) -> None:
    """The test reads a large gradient as eight parts side by side, 16 KiB of each in turn, then the rest: an inf
    or a NaN at the first and last element of a part, inside one, or in the rest is found, at 1 thread (one
    thread's share the whole tensor)."""
    width = 16384 // torch.empty((), dtype=dtype).element_size()
    part = 3 * width
    n = 8 * part + 1234
    where = [0, part - 1, part, 3 * part + 5, 7 * part + width, 8 * part - 1, 8 * part, n - 1]
    p = nn.Parameter(torch.zeros(n, dtype=dtype))
    opt = BlockwiseAdamW([("p", p)], lr=1e-2, state_format="bf16" if dtype == torch.bfloat16 else "fp32",
                         min_8bit_numel=0, kernels="compiled")
    saved = torch.get_num_threads()
    torch.set_num_threads(1)
    try:
        with warnings.catch_warnings():
            warnings.simplefilter("ignore", RuntimeWarning)
            for k, at in enumerate(where):
                p.grad = torch.full((n,), 1e-3, dtype=dtype)
                p.grad[at] = float("nan") if k % 2 else float("inf")
                opt.step()
                assert opt.nonfinite_counts == {"p": k + 1}, at
            p.grad = torch.full((n,), 1e-3, dtype=dtype)
            opt.step()
    finally:
        torch.set_num_threads(saved)
    assert opt.step_count("p") == 1 and bool((p.detach() != 0).all())

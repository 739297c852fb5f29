"""The optimizers and BAOC on a CUDA device (skipped where torch sees none).

- Every AdamW format steps on CUDA as on the CPU: fp32 within float rounding, the cheaper formats
  within a small fraction of the update (stochastic rounding and 8-bit codes may differ by a step);
  the state bytes each optimizer reports are the storage it allocated on the device.
- SGD (momentum, Nesterov, weight decay) in fp32 equals ``torch.optim.SGD`` on the device; Lion in
  fp32 equals itself on the CPU but for elements whose update direction is a rounding tie.
- Gradient release with bf16 weights, int8 states and an 8-bit correction steps exactly as ``step()``.
- BAOC under the Trainer on the GPU: warm-up, an allocation within the budget with its states on the
  device, a re-evaluation, and a crash and resume bit-equal to the uninterrupted run.
"""

from __future__ import annotations

import os
from pathlib import Path

import pytest
import torch
from support import lone_fp32_steps, ragged_shapes, record_grids, record_launches
from support_lightning import DigitsModule, fit_crash_resume
from torch import nn

from lightning_baoc import BAOC, FORMATS, BlockwiseAdamW, BlockwiseLion, BlockwiseSGD, kernels
from lightning_baoc.formats.base import FACTORED_SUMS

pytestmark = pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
# deterministic cuBLAS for the Trainer's deterministic=True (bit-equal resume)
os.environ.setdefault("CUBLAS_WORKSPACE_CONFIG", ":4096:8")
CUDA = torch.device("cuda")


def _model(device: torch.device, dtype: torch.dtype = torch.float32) -> nn.Module:
    torch.manual_seed(0)
    return nn.Sequential(nn.Linear(256, 512), nn.GELU(), nn.Linear(512, 512), nn.GELU(), nn.Linear(512, 10)).to(device, dtype)


def _steps(opt: torch.optim.Optimizer, model: nn.Module, steps: int = 5) -> None:
    gen = torch.Generator().manual_seed(1)
    for _ in range(steps):
        opt.zero_grad()
        for p in model.parameters():  # the same gradients on every device: drawn on the CPU
            p.grad = (torch.randn(p.shape, generator=gen) * 1e-2).to(p.device, p.dtype)
        opt.step()


@pytest.mark.parametrize("fmt", FORMATS)
def test_every_format_steps_on_cuda_as_on_the_cpu(fmt: str) -> None:
    runs = []
    for device in (torch.device("cpu"), CUDA):
        model = _model(device)
        start = [p.detach().cpu().clone() for p in model.parameters()]
        opt = BlockwiseAdamW(model.named_parameters(), lr=1e-3, state_format=fmt, min_8bit_numel=0)
        _steps(opt, model)
        runs.append([p.detach().cpu() for p in model.parameters()])
    cpu, gpu = runs
    for a, b, s in zip(cpu, gpu, start):
        update = (a - s).abs().max().item()
        assert update > 0
        tolerance = 1e-5 * max(1.0, s.abs().max().item()) if fmt in ("fp32", "offload") else 0.1 * update
        assert (a - b).abs().max().item() <= tolerance, fmt
    assert all(torch.isfinite(p).all() for p in gpu)


@pytest.mark.parametrize("fmt", [f for f in FORMATS if f != "offload"])
def test_state_bytes_are_the_storage_allocated_on_the_device(fmt: str) -> None:
    model = _model(CUDA)
    opt = BlockwiseAdamW(model.named_parameters(), lr=1e-3, state_format=fmt, min_8bit_numel=0)
    for p in model.parameters():
        p.grad = torch.randn_like(p)
    torch.cuda.synchronize()
    before = torch.cuda.memory_allocated()
    opt.step()  # the states are made here
    torch.cuda.synchronize()
    held = torch.cuda.memory_allocated() - before
    assert opt.state_bytes() > 0
    # the caching allocator rounds each block up to 512 bytes: a few KiB over the tensors' bytes
    assert abs(held - opt.state_bytes()) <= 64 * 1024 + 0.01 * opt.state_bytes(), (fmt, held, opt.state_bytes())


def test_sgd_in_fp32_equals_torch_sgd_on_cuda() -> None:
    ours, theirs = _model(CUDA), _model(CUDA)
    kwargs = dict(lr=0.05, momentum=0.9, nesterov=True, weight_decay=5e-4)
    opt = BlockwiseSGD(ours.named_parameters(), state_format="fp32", **kwargs)
    ref = torch.optim.SGD(theirs.parameters(), **kwargs)
    _steps(opt, ours, steps=50)
    _steps(ref, theirs, steps=50)
    for a, b in zip(ours.parameters(), theirs.parameters()):
        torch.testing.assert_close(a, b, rtol=0, atol=1e-6)


def test_lion_on_cuda_equals_lion_on_the_cpu() -> None:
    runs = []
    for device in (torch.device("cpu"), CUDA):
        model = _model(device)
        opt = BlockwiseLion(model.named_parameters(), lr=1e-4, weight_decay=0.1, state_format="fp32")
        _steps(opt, model, steps=20)
        runs.append(torch.cat([p.detach().cpu().flatten() for p in model.parameters()]))
    differ = ((runs[0] - runs[1]).abs() > 1e-6).float().mean().item()
    assert differ <= 1e-4  # a sign flips only where the interpolation rounds to a tie


@pytest.mark.parametrize("correction", ["ecc8", "ecc16"])
def test_gradient_release_with_bf16_weights_steps_as_step_on_cuda(correction: str) -> None:
    finals = []
    for release in (False, True):
        model = _model(CUDA, torch.bfloat16)
        opt = BlockwiseAdamW(model.named_parameters(), lr=1e-3, state_format="int8", min_8bit_numel=0,
                             weight_correction=correction)
        if release:
            opt.release_gradients()
        gen = torch.Generator().manual_seed(1)
        for _ in range(8):
            opt.zero_grad()
            x = torch.randn(16, 256, generator=gen).to(CUDA, torch.bfloat16)
            model(x).float().square().mean().backward()
            opt.step()
        finals.append([p.detach().clone() for p in model.parameters()])
        assert opt.weight_correction_bytes() > 0
    for a, b in zip(*finals):
        assert torch.equal(a, b)


class _DevicesAtTheEnd(DigitsModule):
    """Records the devices of the weights and of the optimizer's stored states (offload excepted) at the
    end of training, before the Trainer moves the module back to the CPU."""

    devices_at_the_end: set[str] = set()

    def on_train_end(self) -> None:
        opt = self.trainer.optimizers[0]
        views = [v for r in opt._records.values() if r.format != "offload" for v in r.views.values()]  # noqa: SLF001
        self.devices_at_the_end = {t.device.type for t in [*self.parameters(), *views]}


def test_baoc_under_the_trainer_on_the_gpu_resumes_bit_equal(tmp_path: Path) -> None:
    def fit(root: Path, crash_at: int | None = None, ckpt_path: str | None = None):  # type: ignore[no-untyped-def]
        torch.manual_seed(0)
        model = _DevicesAtTheEnd(lr=3e-3)
        baoc = BAOC(memory_budget=0.3, warmup_steps=12, sample_every=4, reevaluate_every_n_epochs=3, report=False)
        trainer = fit_crash_resume(root, model, baoc, 8, crash_at, ckpt_path, accelerator="gpu")
        return model, trainer, baoc

    ref_model, ref_trainer, ref_baoc = fit(tmp_path / "straight")
    opt = ref_trainer.optimizers[0]
    assert isinstance(opt, BlockwiseAdamW)
    history = ref_baoc.controller.history
    assert [h["reason"] for h in history][:2] == ["warmup", "epoch"] and history[0]["step"] == 12
    numel = sum(p.numel() for p in ref_model.parameters())
    assert opt.state_bytes() <= 0.3 * 8 * numel
    assert len(set(opt.formats().values())) >= 1 and set(opt.formats().values()) != {"fp32"}
    # where the weights and the stored states lived while training (the Trainer moves them back after)
    assert ref_model.devices_at_the_end == {"cuda"}

    crash_root = tmp_path / "crashed"
    fit(crash_root, crash_at=4)
    model, trainer, baoc = fit(crash_root, ckpt_path=str(crash_root / "ckpt" / "last.ckpt"))
    resumed = {k: v for k, v in model.losses.items() if k[0] >= 4}
    assert resumed == {k: v for k, v in ref_model.losses.items() if k[0] >= 4} and len(resumed) == 40
    assert baoc.allocation == ref_baoc.allocation
    for p, q in zip(model.parameters(), ref_model.parameters()):
        assert torch.equal(p, q)


TRITON_SERVED = [f for f, fmt in FORMATS.items() if fmt.kernel_kinds in kernels.TRITON_SERVED]


def _states_after(fmt: str, shapes: list[tuple[int, ...]], steps: int, device: torch.device, policy: str,
                  growth: float = 0.1, nan_at: tuple[int, int] | None = None) -> list[torch.Tensor]:
    """Parameters and states (on the CPU) after ``steps`` steps in ``fmt`` of tensors of ``shapes`` on
    ``device``, the gradients drawn on the CPU (scaled by ``1 + growth * step``); ``nan_at``: (step,
    tensor) whose gradient's last element is NaN."""
    gen = torch.Generator().manual_seed(0)
    params = [nn.Parameter(torch.randn(s, generator=gen).to(device)) for s in shapes]
    opt = BlockwiseAdamW([(f"w{i}", p) for i, p in enumerate(params)], lr=1e-2, state_format=fmt, min_8bit_numel=0,
                         kernels=policy)
    for i in range(steps):
        for p in params:
            p.grad = (torch.randn(p.shape, generator=gen) * (1.0 + growth * i)).to(device)
        if nan_at is not None and i == nan_at[0]:
            params[nan_at[1]].grad.view(-1)[-1] = float("nan")
        opt.step()
    if nan_at is not None:
        assert opt.nonfinite_counts == {f"w{nan_at[1]}": 1}
    return [t.detach().cpu() for p in params for t in [p, *(v for _, v in sorted(opt._records[p].views.items()))]]


@pytest.mark.parametrize("steps", [1, 50])
@pytest.mark.parametrize("fmt", TRITON_SERVED)
def test_the_triton_step_on_cuda_equals_the_eager_step_on_the_cpu(fmt: str, steps: int, monkeypatch: pytest.MonkeyPatch) -> None:
    """The CUDA step of the element-wise formats runs the Triton kernels (one launch per step over the
    tensors of a format) and computes the eager step's fp32 operations: bit-equal parameters, codes, scales and
    exponents to the eager step on the CPU, for ragged, small, 1-D and whole super-block shapes."""
    pytest.importorskip("triton")
    launches = record_launches(monkeypatch)
    shapes = [(37, 101), (3, 11), (1000,), (64, 1024)]
    runs = [_states_after(fmt, shapes, steps, device, policy) for device, policy in ((torch.device("cpu"), "eager"), (CUDA, "auto"))]
    assert sum(launches) == len(shapes) * steps  # every parameter, every step (a 1-D one in its fallback format)
    differ = []
    for a, b in zip(*runs):
        if not torch.equal(a, b):
            differ.append((a.dtype, a.numel(), int((a != b).sum()), (a.double() - b.double()).abs().max().item()))
    print(f"{fmt}, {steps} steps: {'bit-equal' if not differ else differ}")
    bound = FACTORED_SUMS  # across devices, every format within the factored sums' bounds of the registry
    for a, b in zip(*runs):  # fp32 within ulps, codes within 1 in <= 0.01%
        if a.dtype == torch.float32:
            assert float((a.double() - b.double()).norm() / b.double().norm().clamp_min(1e-30)) <= bound.bound
        elif a.dtype in (torch.int8, torch.uint8):
            d = (a.int() - b.int()).abs()
            assert int(d.max()) <= 1 and float((d > 0).double().mean()) <= bound.code_share
        else:  # bf16 moments, fp16 scales: bit-equal where the inputs were
            assert float((a != b).double().mean()) <= bound.code_share
    if not FORMATS[fmt].factored:  # their row and column sums are ordered otherwise: within the bounds above
        assert not differ  # measured bit-equal on an NVIDIA H200 (Triton 3.6); the bounds above say how far it may go


@pytest.mark.parametrize("fmt", ["int8", "bf16", "nomomentum_int8", "int8_factored"])
def test_many_tensors_step_in_one_launch_on_cuda(fmt: str, monkeypatch: pytest.MonkeyPatch) -> None:
    """41 tensors of 1 to 3000 elements (an empty one among them) in one launch per step, one NaN
    gradient skipped by its own flag on the device: as the eager step on the CPU (bit-equal for the
    element-wise formats; the factored ones within the bounds above)."""
    pytest.importorskip("triton")
    from lightning_baoc.kernels import triton_step

    grids = record_grids(monkeypatch, triton_step, "_adamw_tensors")
    shapes = ragged_shapes()
    with pytest.warns(RuntimeWarning, match="non-finite gradient for 'w17'"):
        runs = [_states_after(fmt, shapes, 3, device, policy, growth=0.0, nan_at=(1, 17))
                for device, policy in ((torch.device("cpu"), "eager"), (CUDA, "auto"))]
    assert len(grids) == 3 * (2 if FORMATS[fmt].factored else 1)  # a factored format's 1-D tensors: their own launch
    assert sum(grids) == 3 * sum(-(-torch.Size(s).numel() // 1024) for s in shapes)
    for a, b in zip(*runs):
        if a.numel() == 0 or not FORMATS[fmt].factored:
            assert torch.equal(a, b), (fmt, a.dtype, int((a != b).sum()))
        elif a.dtype == torch.float32:
            assert float((a.double() - b.double()).norm() / b.double().norm().clamp_min(1e-30)) <= FACTORED_SUMS.bound
        else:
            d = (a.int() - b.int()).abs()
            assert int(d.max()) <= 1 and float((d > 0).double().mean()) <= 1e-4


def test_fp32_tensors_take_one_fused_call_and_each_skips_alone_on_cuda(monkeypatch: pytest.MonkeyPatch) -> None:
    """fp32 states on CUDA: torch's fused AdamW once per step over all 41 tensors, its ``found_inf`` the flag
    of any non-finite gradient, and one Triton launch that steps the finite ones at a step the fused call
    skipped (and does nothing at the others): the eager step on the CPU, which skips the NaN's tensor alone,
    within the bound of fp32 on CUDA (torch's CUDA kernel rounds ``1 - beta2`` in fp32: its second moments
    differ from the CPU's by 1.3e-5 relative, measured on an H100)."""
    pytest.importorskip("triton")
    from lightning_baoc.kernels import triton_step

    calls: list[int] = []
    real = torch._fused_adamw_
    monkeypatch.setattr(torch, "_fused_adamw_", lambda *a, **k: (calls.append(len(a[0])), real(*a, **k))[1])
    grids = record_grids(monkeypatch, triton_step, "_adamw_tensors")
    shapes = ragged_shapes()
    with pytest.warns(RuntimeWarning, match="non-finite gradient for 'w17'"):
        cpu = _states_after("fp32", shapes, 3, torch.device("cpu"), "eager", growth=0.0, nan_at=(1, 17))
        calls.clear()
        cuda = _states_after("fp32", shapes, 3, CUDA, "auto", growth=0.0, nan_at=(1, 17))
    served = sum(1 for s in shapes if torch.Size(s).numel())
    assert calls == [served] * 3 and len(grids) == 3  # one fused call and one Triton launch per step
    for a, b in zip(cpu, cuda):
        assert a.shape == b.shape
        if a.numel():  # the bound of fp32 on CUDA against the CPU (test_every_format_steps_on_cuda_as_on_the_cpu)
            assert float((a - b).abs().max()) <= 1e-5 * max(1.0, float(a.abs().max()))


def test_a_lone_fp32_tensor_takes_its_own_flag_on_cuda_and_release_steps_as_step(monkeypatch: pytest.MonkeyPatch) -> None:
    """fp32 states on CUDA stepped one tensor at a time (a one-parameter optimizer, gradient release): torch's
    fused AdamW per tensor with the tensor's own flag as its ``found_inf`` and no Triton launch. A lone tensor
    skips its NaN step as the eager step on the CPU does (within fp32's CUDA bound); a model trained with
    gradient release ends bit-equal to the same training through ``step()`` (one fused call over all)."""
    pytest.importorskip("triton")
    from lightning_baoc.kernels import triton_step

    calls: list[int] = []
    real = torch._fused_adamw_
    monkeypatch.setattr(torch, "_fused_adamw_", lambda *a, **k: (calls.append(len(a[0])), real(*a, **k))[1])
    grids = record_grids(monkeypatch, triton_step, "_adamw_tensors")

    cpu = lone_fp32_steps(torch.device("cpu"), "eager")
    calls.clear()
    cuda = lone_fp32_steps(CUDA, "auto")
    assert calls == [1, 1, 1] and grids == []
    for a, b in zip(cpu, cuda):
        assert float((a - b).abs().max()) <= 1e-5 * max(1.0, float(a.abs().max()))

    finals = []
    for release in (False, True):
        calls.clear()
        model = _model(CUDA)
        opt = BlockwiseAdamW(model.named_parameters(), lr=1e-3, state_format="fp32")
        if release:
            opt.release_gradients()
        gen = torch.Generator().manual_seed(1)
        for _ in range(4):
            opt.zero_grad()
            model(torch.randn(16, 256, generator=gen).to(CUDA)).square().mean().backward()
            opt.step()
        served = len(list(model.parameters()))
        assert calls == ([1] * served * 4 if release else [served] * 4)
        finals.append([p.detach().clone() for p in model.parameters()])
    assert len(grids) == 4  # the batched call's repair launch, one per step(); none under release
    for a, b in zip(*finals):
        assert torch.equal(a, b)


@pytest.mark.parametrize("correction", ["none", "ecc8", "ecc16"])
@pytest.mark.parametrize("fmt", ["int8", "bf16"])
def test_the_triton_step_with_bf16_weights_equals_the_eager_step_on_the_cpu(fmt: str, correction: str) -> None:
    """bf16 weights and gradients with each master-weight correction: the kernel rebuilds, steps and
    splits the fp32 masters in its pass, bit-equal to the eager step on the CPU after 20 steps."""
    pytest.importorskip("triton")
    runs = []
    for device, policy in ((torch.device("cpu"), "eager"), (CUDA, "auto")):
        gen = torch.Generator().manual_seed(0)
        params = [nn.Parameter((torch.randn(s, generator=gen) * 0.1).to(device, torch.bfloat16)) for s in [(37, 101), (64, 1024)]]
        opt = BlockwiseAdamW([(f"w{i}", p) for i, p in enumerate(params)], lr=1e-3, state_format=fmt, min_8bit_numel=0,
                             kernels=policy, weight_correction=correction)
        for _ in range(20):
            for p in params:
                p.grad = (torch.randn(p.shape, generator=gen) * 1e-2).to(device, torch.bfloat16)
            opt.step()
        out = []
        for p in params:
            rec = opt._records[p]
            out += [p.detach().cpu(), *(v.cpu() for _, v in sorted(rec.views.items()))]
            out += [] if rec.master_correction is None else [rec.master_correction.cpu()]
        runs.append(out)
    assert len(runs[0]) == len(runs[1])
    for a, b in zip(*runs):
        assert torch.equal(a, b), (fmt, correction, a.dtype, int((a != b).sum()))

"""A conversion holds at most one parameter's old state above the steady state, measured on the allocator.

``set_formats`` converts one parameter at a time (those whose state shrinks first), streaming each
in slices of ``chunk_size`` elements (``lightning_baoc.optim.convert``). The bound documented in
``lightning_baoc.optim.pools``: at any moment the state allocated is at most
``max(before, after) + min(old, new)`` of the one parameter being converted, plus a few fp32 slices
of scratch. Here the allocator's own record of every allocation and free during the conversion
(torch's profiler with ``profile_memory=True`` on the CPU; ``torch.cuda.max_memory_allocated`` on
CUDA) gives the peak, whatever allocated it: pools, scratch, index tensors.
"""

from __future__ import annotations

import pytest
import torch
from support import one_thread, peak_above_start  # noqa: F401 - one_thread applies to the module
from torch import nn

from lightning_baoc import BlockwiseAdamW

CHUNK = 4096  # slices of 4096 elements: scratch of a few hundred KiB, far below one block's state


def _model(seed: int = 0) -> nn.Sequential:
    """46 parameters of mixed sizes; the largest weight is 384 x 384 (1.2 MB of fp32 AdamW state)."""
    torch.manual_seed(seed)
    widths = [64, 128, 192, 256, 320, 384] * 4
    layers: list[nn.Module] = []
    for a, b in zip(widths[:-1], widths[1:]):
        layers += [nn.Linear(a, b), nn.LayerNorm(b)]
    return nn.Sequential(*layers)


def _stepped(model: nn.Module, fmt: str = "fp32") -> BlockwiseAdamW:
    opt = BlockwiseAdamW(model.named_parameters(), lr=1e-3, state_format=fmt, min_8bit_numel=0, chunk_size=CHUNK)
    for _ in range(2):
        opt.zero_grad()
        model(torch.randn(8, 64)).square().mean().backward()
        opt.step()
    return opt


def _mixed_allocation(opt: BlockwiseAdamW) -> dict[str, str]:
    """A mix of shrinking and growing conversions (depending on where each parameter starts)."""
    cycle = ["int8", "factored", "bf16", "nomomentum_int8", "int8_factored", "fp32", "nomomentum"]
    out = {}
    for i, (name, p) in enumerate(opt.named_params.items()):
        fmt = cycle[i % len(cycle)]
        out[name] = fmt if (p.dim() == 2 or "factored" not in fmt) else "nomomentum"
    return out


@pytest.mark.slow  # long; the allocator measure is held by default in this file
@pytest.mark.parametrize(
    "start", ["fp32", pytest.param("int8", marks=pytest.mark.slow), pytest.param("mixed", marks=pytest.mark.slow)]
)  # int8: 10 s, mixed: 14 s on the 2-core machine
def test_conversion_transient_is_at_most_the_largest_old_state(start: str) -> None:
    figures: dict[str, int] = {}

    def setup() -> tuple[BlockwiseAdamW, dict[str, str]]:
        model = _model()
        opt = _stepped(model, "fp32" if start == "mixed" else start)
        if start == "mixed":
            opt.set_formats(_mixed_allocation(opt))
            targets = {n: "fp32" if f != "fp32" else "int8" for n, f in opt.formats().items()}
        elif start == "fp32":
            targets = _mixed_allocation(opt)
        else:
            targets = {n: "fp32" for n in opt.named_params}  # every state grows
        figures["before"] = opt.state_bytes()
        opt.reset_peak_state_bytes()
        figures["largest_old"] = max(
            sum(t.untyped_storage().nbytes() for t in opt._records[p].views.values())
            for p in opt.named_params.values()
        )
        return opt, targets

    peak, (opt, targets) = peak_above_start(setup, lambda made: made[0].set_formats(made[1]))
    before, after, largest_old = figures["before"], opt.state_bytes(), figures["largest_old"]
    transient = before + peak - max(before, after)
    print(f"{start}: before {before:,} B, after {after:,} B, peak {before + peak:,} B, "
          f"transient {transient:,} B, largest old state {largest_old:,} B")
    assert opt.formats() == targets and before != after  # the conversion really moved state
    assert 0 < transient <= largest_old
    # the optimizer's own high-water mark: at least the steady states, at most what the allocator saw
    assert max(before, after) < opt.peak_state_bytes() <= before + peak
    assert opt._pools.live_bytes == after


def test_the_allocator_measure_sees_a_copy_of_every_state() -> None:
    """The measure itself: building every new state before freeing the old ones (what a one-shot
    conversion does) shows up as a transient of the whole state, many times one parameter's."""

    def copy_all(opt: BlockwiseAdamW) -> None:
        copies = [{k: t.clone() for k, t in rec.views.items()} for rec in opt._records.values()]
        del copies

    peak, opt = peak_above_start(lambda: _stepped(_model()), copy_all)
    assert opt.state_bytes() <= peak < 1.01 * opt.state_bytes()


@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
def test_conversion_transient_on_cuda() -> None:
    torch.manual_seed(0)
    model = _model().cuda()
    opt = BlockwiseAdamW(model.named_parameters(), lr=1e-3, min_8bit_numel=0, chunk_size=CHUNK)
    for _ in range(2):
        opt.zero_grad()
        model(torch.randn(8, 64, device="cuda")).square().mean().backward()
        opt.step()
    targets = _mixed_allocation(opt)
    torch.cuda.synchronize()
    before = opt.state_bytes()
    largest_old = max(8 * p.numel() for p in opt.named_params.values())
    base = torch.cuda.memory_allocated()
    torch.cuda.reset_peak_memory_stats()
    opt.set_formats(targets)
    torch.cuda.synchronize()
    peak = torch.cuda.max_memory_allocated() - base
    after = opt.state_bytes()
    transient = before + peak - max(before, after)
    assert 0 < transient <= largest_old

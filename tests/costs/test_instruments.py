"""BAOC's instruments (the sampler's buffers and the shadow moments) sized with the model: measured
bytes within the allowance, the estimates an upper bound of what is allocated, nothing changed below
the floor."""

from __future__ import annotations

import pytest
import torch
from torch import nn

from lightning_baoc.control.controller import BAOCController
from lightning_baoc.costs.instruments import (
    INSTRUMENT_FLOOR,
    MIN_SAMPLED,
    instrument_allowance,
    sampler_bytes,
    shadow_bytes,
    size_instruments,
)
from lightning_baoc.report.allocation import build_record
from lightning_baoc.risk.shadow import DEFAULT_SHADOW_ELEMENTS, ShadowMoments
from lightning_baoc.sampling import DEFAULT_CAPACITY, DEFAULT_MAX_ELEMENTS, GradientSampler


def stack(layers: int, width: int) -> nn.Sequential:
    torch.manual_seed(0)
    return nn.Sequential(*[nn.Linear(width, width) for _ in range(layers)])


def shapes_of(model: nn.Module) -> dict[str, list[tuple[int, ...]]]:
    out: dict[str, list[tuple[int, ...]]] = {}
    for name, p in model.named_parameters():
        out.setdefault(name.split(".")[0], []).append(tuple(p.shape))
    return out


def measured(model: nn.Module, max_elements: int, shadow_elements: int) -> tuple[int, int]:
    blocks: dict[str, list[str]] = {}
    for name, _ in model.named_parameters():
        blocks.setdefault(name.split(".")[0], []).append(name)
    with GradientSampler(model, blocks, capacity=DEFAULT_CAPACITY, max_elements=max_elements) as sampler:
        ring = sampler.buffer_bytes()
    shadow = ShadowMoments(dict(model.named_parameters()), shadow_elements).nbytes()
    return ring, shadow


@pytest.mark.parametrize("layers,width", [(3, 40), (12, 300), (40, 256), (6, 2048)])
def test_estimates_bound_the_allocated_bytes(layers: int, width: int) -> None:
    model = stack(layers, width)
    shapes = shapes_of(model)
    for m in (MIN_SAMPLED, 1000, DEFAULT_MAX_ELEMENTS):
        for s in (1024, 5000, DEFAULT_SHADOW_ELEMENTS):
            ring, shadow = measured(model, m, s)
            assert ring <= sampler_bytes(shapes, DEFAULT_CAPACITY, m) <= 1.1 * ring + 4096, (m, ring)
            assert shadow == shadow_bytes(shapes, s)


def test_below_the_floor_nothing_changes() -> None:
    shapes = shapes_of(stack(3, 16))  # 816 parameters: ~130 KiB of instruments, the whole model sampled
    sizes = size_instruments(shapes, DEFAULT_CAPACITY, DEFAULT_MAX_ELEMENTS, DEFAULT_SHADOW_ELEMENTS,
                             instrument_allowance(8 * 816))
    assert not sizes.scaled
    assert (sizes.max_elements, sizes.shadow_elements) == (DEFAULT_MAX_ELEMENTS, DEFAULT_SHADOW_ELEMENTS)
    assert sizes.allowance == INSTRUMENT_FLOOR


def test_a_large_model_gets_at_most_its_share_measured() -> None:
    """40 x Linear(1024, 1024): 28 MiB of instruments at the defaults, 9% of AdamW's state; sized,
    they hold (measured) at most max(5% of it, 256 KiB), and use most of that."""
    model = stack(40, 1024)
    baseline = 8 * sum(p.numel() for p in model.parameters())
    shapes = shapes_of(model)
    ring, shadow = measured(model, DEFAULT_MAX_ELEMENTS, DEFAULT_SHADOW_ELEMENTS)
    assert ring + shadow > 0.08 * baseline
    allowance = instrument_allowance(baseline)
    sizes = size_instruments(shapes, DEFAULT_CAPACITY, DEFAULT_MAX_ELEMENTS, DEFAULT_SHADOW_ELEMENTS, allowance)
    assert sizes.scaled and sizes.max_elements < DEFAULT_MAX_ELEMENTS and sizes.shadow_elements < DEFAULT_SHADOW_ELEMENTS
    ring, shadow = measured(model, sizes.max_elements, sizes.shadow_elements)
    assert 0.85 * allowance <= ring + shadow <= allowance, (ring, shadow, allowance)
    # a larger share keeps the settings; a tiny one stops at the minimum sample
    wide = size_instruments(shapes, DEFAULT_CAPACITY, DEFAULT_MAX_ELEMENTS, DEFAULT_SHADOW_ELEMENTS,
                            instrument_allowance(baseline, 0.2))
    assert not wide.scaled
    least = size_instruments(shapes, DEFAULT_CAPACITY, DEFAULT_MAX_ELEMENTS, DEFAULT_SHADOW_ELEMENTS, 1)
    assert (least.max_elements, least.shadow_elements) == (MIN_SAMPLED, 1024)


def test_a_lower_setting_is_kept() -> None:
    shapes = shapes_of(stack(40, 1024))
    sizes = size_instruments(shapes, DEFAULT_CAPACITY, 300, DEFAULT_SHADOW_ELEMENTS, 10**12)
    assert sizes.max_elements == 300 and not sizes.scaled


def test_bad_share_is_refused() -> None:
    with pytest.raises(ValueError, match="instrument_share"):
        instrument_allowance(10**6, -0.1)


def test_controller_holds_its_instruments_within_the_allowance() -> None:
    """40 x Linear(256, 256) (2.6M parameters, 20 MiB of AdamW state): the default sample would
    hold 26 MiB of instruments; the controller's hold at most 5% of the state (measured), and
    ``instrument_share`` large enough keeps the full sample."""
    model = stack(40, 256)
    baseline = 8 * sum(p.numel() for p in model.parameters())
    for share, scaled in ((0.05, True), (2.0, False)):
        ctl = BAOCController(memory_budget=0.5, warmup_steps=4, sample_every=1, instrument_share=share)
        opt = ctl.install(torch.optim.AdamW(model.parameters(), lr=1e-3), model)
        try:
            for step in range(6):  # a warm-up of 4 steps, then the allocation
                opt.zero_grad()
                model(torch.randn(4, 256)).square().mean().backward()
                ctl.observe(step)
                opt.step()
                ctl.maybe_allocate(step + 1)
            event = ctl.last_event
            assert event is not None and event.instrument_bytes == ctl.instrument_bytes() > 0
            assert build_record(event)["instrument_bytes"] == ctl.instrument_bytes()
            assert ctl.instruments.scaled is scaled
            assert ctl.instrument_bytes() <= ctl.instruments.allowance
            held = ctl.sampler.buffer_bytes() + ctl.shadow.nbytes()
            assert held == ctl.instrument_bytes()
            if scaled:
                assert ctl.instruments.allowance == int(0.05 * baseline) > INSTRUMENT_FLOOR
                assert held > 0.85 * ctl.instruments.allowance
                assert ctl.sampler.statistics()["0"]["elements"] == ctl.instruments.max_elements < DEFAULT_MAX_ELEMENTS
            else:
                assert ctl.sampler.statistics()["0"]["elements"] == DEFAULT_MAX_ELEMENTS
        finally:
            ctl.close()


@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
def test_estimate_bounds_the_sampler_on_an_accelerator() -> None:
    model = stack(8, 512).cuda()
    shapes = shapes_of(model)
    blocks: dict[str, list[str]] = {}
    for name, _ in model.named_parameters():
        blocks.setdefault(name.split(".")[0], []).append(name)
    for p in model.parameters():
        p.grad = torch.randn_like(p)
    with GradientSampler(model, blocks, sample_every=1, max_elements=2048) as sampler:
        sampler.sample(0)
        sampler.flush()
        assert sampler.buffer_bytes() <= sampler_bytes(shapes, DEFAULT_CAPACITY, 2048, accelerator=True)

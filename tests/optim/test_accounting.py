"""state_bytes() is the storage really allocated, with the stated figures."""

from __future__ import annotations

import pytest
import torch
from torch import nn

from lightning_baoc import FORMATS, BlockwiseAdamW
from lightning_baoc.formats import format_state_bytes, resolve_format


def _allocated(opt: BlockwiseAdamW) -> int:
    """Summed untyped_storage().nbytes() of every state tensor, each storage counted once."""
    seen: dict[int, int] = {}
    for t in opt.state_tensors():
        storage = t.untyped_storage()
        seen[storage.data_ptr()] = storage.nbytes()
    return sum(seen.values())


def _step(model: nn.Module, opt: BlockwiseAdamW) -> None:
    opt.zero_grad()
    for p in model.parameters():
        p.grad = torch.randn_like(p)
    opt.step()


@pytest.fixture(scope="module")
def big_model() -> nn.Module:
    torch.manual_seed(0)
    # 2-D weights only, 1.31M parameters, shapes with and without multiples of 32
    return nn.Sequential(
        nn.Linear(512, 1024, bias=False), nn.Linear(1024, 700, bias=False), nn.Linear(700, 97, bias=False)
    )


@pytest.mark.parametrize(
    "fmt,low,high",
    [
        ("fp32", 8.0, 8.0),
        ("bf16_momentum", 6.0, 6.0),
        ("bf16", 4.0, 4.0),
        ("nomomentum", 4.0, 4.0),
        ("int8", 2.0, 2.2),
        ("int8_factored", 1.0, 1.1),
        ("nomomentum_int8", 1.0, 1.1),
        ("factored", 0.0, 0.1),
    ],
)
def test_bytes_per_param_and_storage(big_model: nn.Module, fmt: str, low: float, high: float) -> None:
    n = sum(p.numel() for p in big_model.parameters())
    assert n >= 1_000_000
    opt = BlockwiseAdamW(big_model.named_parameters(), state_format=fmt)
    assert opt.state_bytes() == 0  # lazily allocated, like torch.optim.AdamW
    _step(big_model, opt)
    per_param = opt.state_bytes() / n
    assert low <= per_param <= high, (fmt, per_param)
    assert opt.state_bytes() == _allocated(opt) == sum(opt.pool_bytes().values())
    assert len(opt.pool_bytes()) == 1  # one pool per (format, device), one segment per parameter
    expected = sum(format_state_bytes(fmt, p.shape) for p in big_model.parameters())
    assert opt.state_bytes() == expected


def test_mixed_formats_fallbacks_and_groups() -> None:
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(100, 300), nn.LayerNorm(300), nn.Linear(300, 33), nn.Conv2d(3, 8, 3))
    groups = [
        {"params": list(model[0].parameters()) + list(model[3].parameters()), "state_format": "int8"},
        {"params": list(model[1].parameters()) + list(model[2].parameters()), "state_format": "factored"},
    ]
    opt = BlockwiseAdamW(groups, param_names=model)
    _step(model, opt)
    formats = opt.formats()
    assert formats["0.weight"] == "int8"  # 30000 elements
    assert formats["0.bias"] == "fp32"  # under the 8-bit threshold
    assert formats["1.weight"] == "nomomentum"  # 1-D: no factored form
    assert formats["2.weight"] == "factored"
    opt.set_formats({"2": "int8_factored", "3": "bf16"})
    formats = opt.formats()
    assert formats["2.weight"] == "int8_factored" and formats["2.bias"] == "fp32"
    assert formats["3.weight"] == "bf16"
    by_group = opt.state_bytes(by_group=True)
    assert sum(by_group) == opt.state_bytes() == _allocated(opt)
    expected = [
        sum(format_state_bytes(opt.requested_format(p), p.shape) for p in g["params"]) for g in opt.param_groups
    ]
    assert by_group == expected


def test_layout_matches_stated_bytes_for_many_shapes() -> None:
    shapes = [(1,), (31,), (33,), (4096,), (7, 9), (64, 64), (3, 5, 7), (130, 2, 2), (1, 100), (100, 1)]
    for name, fmt in FORMATS.items():
        for shape in shapes:
            actual = resolve_format(name, shape, 0)
            model = nn.Module()
            model.w = nn.Parameter(torch.randn(shape))
            opt = BlockwiseAdamW(model.named_parameters(), state_format=name, min_8bit_numel=0)
            _step(model, opt)
            assert opt.formats()["w"] == actual
            assert opt.state_bytes() == FORMATS[actual].state_bytes(shape) == _allocated(opt), (name, shape)


def test_offload_counts_in_full_on_cpu() -> None:
    model = nn.Linear(64, 64)
    opt = BlockwiseAdamW(model.named_parameters(), state_format="offload")
    _step(model, opt)
    # on a CPU training device host memory is the device's memory: nothing is saved
    assert opt.state_bytes() == 8 * sum(p.numel() for p in model.parameters())
    assert opt.host_state_bytes() == 0

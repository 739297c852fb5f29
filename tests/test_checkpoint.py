"""Done-when 6 (issue 2): compact checkpoints, bit-equal resume, interchange with torch AdamW."""

from __future__ import annotations

import io

import pytest
import torch
from torch import nn

from lightning_baoc import FORMATS, BlockwiseAdamW

from conftest import mlp


def _save(obj) -> bytes:
    buf = io.BytesIO()
    torch.save(obj, buf)
    return buf.getvalue()


def _load(data: bytes):
    return torch.load(io.BytesIO(data), weights_only=True)


def _batches(n: int, seed: int = 0) -> list[tuple[torch.Tensor, torch.Tensor]]:
    gen = torch.Generator().manual_seed(seed)
    return [(torch.randn(32, 64, generator=gen), torch.randint(0, 10, (32,), generator=gen)) for _ in range(n)]


def _train(model: nn.Module, opt: torch.optim.Optimizer, batches) -> None:
    for x, y in batches:
        opt.zero_grad()
        nn.functional.cross_entropy(model(x), y).backward()
        opt.step()


def test_int8_checkpoint_is_compact() -> None:
    model = mlp((64, 512, 512, 10))
    sizes = {}
    for fmt in ("fp32", "int8"):
        opt = BlockwiseAdamW(model.named_parameters(), state_format=fmt)
        _train(model, opt, _batches(2))
        sd = opt.state_dict()
        assert all(t.dtype in (torch.int8, torch.uint8, torch.float16) for t in sd["state"]["3.weight"]["tensors"].values()) or fmt == "fp32"
        sizes[fmt] = len(_save(sd))
    print(f"state dict bytes: fp32 {sizes['fp32']}, int8 {sizes['int8']} ({sizes['int8'] / sizes['fp32']:.3f})")
    assert sizes["int8"] <= 0.30 * sizes["fp32"]


@pytest.mark.parametrize("fmt", list(FORMATS))
def test_save_load_continue_is_bit_equal(fmt: str) -> None:
    batches = _batches(40)
    model = mlp((64, 128, 128, 10))
    opt = BlockwiseAdamW(model.named_parameters(), lr=3e-3, state_format=fmt, min_8bit_numel=0)
    _train(model, opt, batches[:20])
    model_bytes, opt_bytes = _save(model.state_dict()), _save(opt.state_dict())
    _train(model, opt, batches[20:])

    resumed = mlp((64, 128, 128, 10), seed=123)  # other init: everything must come from the checkpoint
    resumed.load_state_dict(_load(model_bytes))
    opt2 = BlockwiseAdamW(resumed.named_parameters(), lr=1.0, min_8bit_numel=0)  # hyperparameters too
    opt2.load_state_dict(_load(opt_bytes))
    assert opt2.formats() == opt.formats()
    _train(resumed, opt2, batches[20:])
    for (name, a), b in zip(model.named_parameters(), resumed.parameters()):
        assert torch.equal(a, b), (fmt, name)


def test_state_is_keyed_by_name_not_position() -> None:
    model = mlp((64, 32, 10))
    opt = BlockwiseAdamW(model.named_parameters(), state_format="int8", min_8bit_numel=0)
    _train(model, opt, _batches(3))
    sd = _load(_save(opt.state_dict()))
    assert set(sd["state"]) == {n for n, _ in model.named_parameters()}
    # a fresh optimizer whose groups list the parameters in another order reloads it
    named = list(model.named_parameters())[::-1]
    opt2 = BlockwiseAdamW(named, state_format="fp32", min_8bit_numel=0)
    sd["param_groups"][0]["params"] = sd["param_groups"][0]["params"][::-1]
    opt2.load_state_dict(sd)
    for name in opt.named_params:
        a, b = opt.param_state(name), opt2.param_state(name)
        assert torch.equal(a.exp_avg, b.exp_avg) and torch.equal(a.exp_avg_sq, b.exp_avg_sq)


def test_plain_adamw_state_loads_and_continues() -> None:
    batches = _batches(30)
    a, b = mlp((64, 64, 10)), mlp((64, 64, 10))
    ref = torch.optim.AdamW(a.parameters(), lr=2e-3)
    _train(a, ref, batches[:15])
    b.load_state_dict(a.state_dict())
    ours = BlockwiseAdamW(b.named_parameters(), lr=2e-3)
    ours.load_state_dict(_load(_save(ref.state_dict())))
    _train(a, ref, batches[15:])
    _train(b, ours, batches[15:])
    assert max((p - q).abs().max().item() for p, q in zip(a.parameters(), b.parameters())) <= 1e-6


@pytest.mark.parametrize("fmt", ["fp32", "int8", "factored"])
def test_export_to_plain_adamw(fmt: str) -> None:
    batches = _batches(30)
    a, b = mlp((64, 64, 10)), mlp((64, 64, 10))
    ours = BlockwiseAdamW(a.named_parameters(), lr=2e-3, state_format=fmt, min_8bit_numel=0)
    _train(a, ours, batches[:15])
    exported = _load(_save(ours.to_adamw_state_dict()))
    b.load_state_dict(a.state_dict())
    ref = torch.optim.AdamW(b.parameters(), lr=2e-3)
    ref.load_state_dict(exported)
    for name, p in b.named_parameters():
        state = ours.param_state(name)
        assert torch.equal(ref.state[p]["exp_avg_sq"], state.dense_v())
    if fmt == "fp32":  # the same state continues identically
        ours_cont, ref_cont = a, b
        _train(ours_cont, ours, batches[15:])
        _train(ref_cont, ref, batches[15:])
        assert max((p - q).abs().max().item() for p, q in zip(a.parameters(), b.parameters())) <= 1e-6

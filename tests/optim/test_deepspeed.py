"""The blockwise optimizers as DeepSpeed's client optimizer (ZeRO 0-3) on the CPU, gloo, 1 and 2 ranks.

Every rank trains on the same batch, so the gradient DeepSpeed averages over the ranks is the one
process's bit for bit ((g + g) / 2 == g in floats) and the optimizers can be compared exactly: each
rank runs the one-process optimizer beside DeepSpeed's engine and compares the weights and every
fragment's state with the matching slice of the reference's. The model's sizes put partition edges
mid-row and mid-8-bit-group: ZeRO 1/2 on 2 ranks splits ``0.weight`` (16 x 37 = 592 elements) at
element 410 (inside a group of 32 and a row of 16); ZeRO-3 splits every parameter in halves (296 =
9 groups and 8 elements).
"""

from __future__ import annotations

import os

import pytest
import torch
from support_distributed import needs_gloo, on_gloo_ranks

pytest.importorskip("deepspeed")

STEPS = 4


def _model() -> torch.nn.Module:
    torch.manual_seed(0)
    return torch.nn.Sequential(torch.nn.Linear(16, 37), torch.nn.Tanh(), torch.nn.Linear(37, 40), torch.nn.Tanh(),
                               torch.nn.Linear(40, 5))


def _config(stage: int, offload: bool = False) -> dict:
    zero: dict = {"stage": stage}
    if offload:
        zero["offload_optimizer"] = {"device": "cpu"}
    return {"train_micro_batch_size_per_gpu": 8, "gradient_accumulation_steps": 1, "zero_optimization": zero,
            "zero_allow_untested_optimizer": True, "zero_force_ds_cpu_optimizer": False,
            "steps_per_print": 10**9}


def _deepspeed_env(rank: int, world: int) -> None:
    os.environ.update(DS_ACCELERATOR="cpu", RANK=str(rank), WORLD_SIZE=str(world), LOCAL_RANK=str(rank),
                      LOCAL_WORLD_SIZE=str(world))


def _batches() -> list[torch.Tensor]:
    g = torch.Generator().manual_seed(1)
    return [torch.randn(8, 16, generator=g) for _ in range(STEPS)]


def _full_params(engine, stage: int) -> dict[str, torch.Tensor]:
    import deepspeed

    params = dict(engine.module.named_parameters())
    if stage == 3:
        with deepspeed.zero.GatheredParameters(list(params.values())):
            return {n: p.detach().clone() for n, p in params.items()}
    return {n: p.detach().clone() for n, p in params.items()}


def _storage_bytes(opt) -> int:
    storages = {t.untyped_storage().data_ptr(): t.untyped_storage().nbytes() for t in opt.state_tensors()}
    return sum(storages.values())


def _parity(rank: int, world: int, stage: int, fmt: str, offload: bool) -> None:
    _deepspeed_env(rank, world)
    import deepspeed

    from lightning_baoc import BlockwiseAdamW
    from lightning_baoc.optim.deepspeed import zero_client

    reference_model = _model()
    reference = (torch.optim.AdamW(reference_model.parameters(), lr=1e-2) if fmt == "torch" else
                 BlockwiseAdamW(reference_model.named_parameters(), lr=1e-2, state_format=fmt, min_8bit_numel=0))
    model = _model()
    client = zero_client(BlockwiseAdamW(model.named_parameters(), lr=1e-2, state_format="fp32" if fmt == "torch" else fmt,
                                        min_8bit_numel=0))
    engine, _, _, _ = deepspeed.initialize(model=model, optimizer=client, config=_config(stage, offload),
                                           dist_init_required=False)
    client.bind()
    if fmt == "int8_factored" and world > 1:
        # ZeRO-3 halves every parameter: 2.weight (40 x 37) in whole rows keeps its factored form, 0.weight
        # (37 x 16, cut mid-row) takes the format's 1-D fallback; the reference holds the same formats
        assert client.formats()["2.weight"] == "int8_factored" and client.formats()["0.weight"] == "int8"
        reference.set_formats(client.formats())
    for x in _batches():
        loss = engine(x).square().mean()
        engine.backward(loss)
        engine.step()
        reference.zero_grad()
        reference_model(x).square().mean().backward()
        reference.step()
    got, want = _full_params(engine, stage), dict(reference_model.named_parameters())
    if fmt == "torch":
        worst = max((got[n] - want[n]).abs().max().item() for n in want)
        assert worst <= 1e-6, f"stage {stage}: fp32 differs from torch AdamW by {worst}"
        return
    # a factored second moment sums its column statistics over the ranks: equal within float summation order
    tolerance = 1e-6 if "factored" in fmt else 0.0
    for name in want:
        worst = (got[name] - want[name].detach()).abs().max().item()
        assert worst <= tolerance, f"stage {stage} {fmt}: {name} differs by {worst}"
    fmap = client.fragment_map
    split = 0
    for f in fmap.fragments:
        assert client.formats()[f.name] == reference.formats()[f.name]
        ours, theirs = client.param_state(f.name), reference.param_state(f.name)
        if not f.numel:
            continue
        split += f.numel < want[f.name].numel()
        for key in ("exp_avg", "exp_avg_sq"):
            a, b = getattr(ours, key), getattr(theirs, key)
            if b is None:
                assert a is None
                continue
            if a is None:  # a factored second moment: its row and column statistics
                a, b = ours.dense_v(), theirs.dense_v()
            piece = b.reshape(-1)[f.offset : f.offset + f.numel]
            assert torch.allclose(a.reshape(-1), piece, rtol=tolerance, atol=0.0), f"stage {stage} {fmt}: {f.name} {key}"
    if world > 1:
        assert split >= 1  # some parameter is split across the ranks
        if stage in (1, 2):
            cut = next(f for f in fmap.fragments if 0 < f.numel < want[f.name].numel())
            edge = cut.offset + cut.numel if cut.offset == 0 else cut.offset
            assert edge % 32 != 0  # the split falls inside an 8-bit group
    assert client.state_bytes() == _storage_bytes(client.inner)


def _cases(rank: int, world: int, cases: list[tuple[int, str]]) -> None:
    for stage, fmt in cases:
        _parity(rank, world, stage, fmt, False)


@needs_gloo
def test_zero_1_2_3_on_two_ranks() -> None:
    """fp32 under ZeRO-1 equals torch AdamW; int8 under ZeRO-2 and ZeRO-3 (partitions cutting 8-bit
    groups) equals one process's BlockwiseAdamW bit for bit; state bytes equal the storage."""
    on_gloo_ranks(_cases, 2, 2, [(1, "torch"), (2, "int8"), (3, "int8")])


@pytest.mark.slow
@needs_gloo
@pytest.mark.parametrize("stage", [2, 3])
def test_fp32_equals_torch_adamw(stage: int) -> None:
    on_gloo_ranks(_parity, 2, 2, stage, "torch", False)


@pytest.mark.slow
@needs_gloo
@pytest.mark.parametrize(("stage", "fmt"), [(1, "int8"), (2, "bf16"), (3, "bf16_momentum"), (2, "nomomentum_int8"),
                                            (3, "int8_factored")])
def test_formats_bit_equal_to_one_process_on_two_ranks(stage: int, fmt: str) -> None:
    on_gloo_ranks(_parity, 2, 2, stage, fmt, False)


@pytest.mark.slow
@needs_gloo
@pytest.mark.parametrize("stage", [2, 3])
def test_int8_bit_equal_on_one_rank(stage: int) -> None:
    on_gloo_ranks(_parity, 1, 1, stage, "int8", False)

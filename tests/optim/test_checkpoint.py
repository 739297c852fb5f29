"""Compact checkpoints, bit-equal resume, interchange with torch AdamW."""

from __future__ import annotations

import io
from typing import Any

import pytest
import torch
from support import mlp
from torch import nn

from lightning_baoc import FORMATS, BlockwiseAdamW


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


# ---------------------------------------------------------------------------- resumes of changed set-ups


def _trained(fmt: str = "int8", widths: tuple[int, ...] = (64, 64, 10), steps: int = 3) -> tuple[nn.Module, BlockwiseAdamW]:
    model = mlp(widths)
    opt = BlockwiseAdamW(model.named_parameters(), lr=2e-3, state_format=fmt, min_8bit_numel=0)
    _train(model, opt, _batches(steps))
    opt.set_formats({"3": "bf16"})  # heterogeneous: bf16 draws from the rounding generator
    _train(model, opt, _batches(1, seed=5))
    return model, opt


def _snapshot(opt: BlockwiseAdamW) -> bytes:
    """Everything a load could change, as bytes: state dict (with groups and generators) and formats."""
    return _save({"sd": opt.state_dict(), "groups": [{k: v for k, v in g.items() if k != "params"} for g in opt.param_groups],
                  "formats": opt.formats(), "requested": {n: opt.requested_format(p) for n, p in opt.named_params.items()}})


def test_torch_adamw_refuses_a_blockwise_state_at_load_naming_baoc_and_the_fix() -> None:
    model, opt = _trained()
    sd = _load(_save(opt.state_dict()))
    plain = torch.optim.AdamW(model.parameters(), lr=2e-3)
    with pytest.raises(ValueError, match=r"BlockwiseAdamW \(BAOC\).*BAOC callback.*export_adamw_state_dict"):
        plain.load_state_dict(sd)  # at load, not with KeyError: 'exp_avg' at the first step


def test_exported_state_resumes_as_plain_adamw() -> None:
    from lightning_baoc import export_adamw_state_dict

    batches = _batches(20)
    a, b = mlp((64, 64, 10)), mlp((64, 64, 10))
    ours = BlockwiseAdamW(a.named_parameters(), lr=2e-3)
    _train(a, ours, batches[:10])
    b.load_state_dict(a.state_dict())
    exported = _load(_save(export_adamw_state_dict(_load(_save(ours.state_dict())))))
    ref = torch.optim.AdamW(b.parameters(), lr=2e-3)
    ref.load_state_dict(exported)
    _train(a, ours, batches[10:])
    _train(b, ref, batches[10:])
    assert max((p - q).abs().max().item() for p, q in zip(a.parameters(), b.parameters())) <= 1e-6


def test_state_dict_of_version_1_still_loads() -> None:
    model, opt = _trained()
    sd = opt.state_dict()
    v1 = {
        "state": {n: {"format": e["format"], "step": e["steps"], "m_step": e["m_step"], "tensors": e["tensors"]} for n, e in sd["state"].items()},
        "param_groups": sd["param_groups"],
        "baoc": {k: v for k, v in sd["baoc"].items() if k in ("requested", "generators", "nonfinite")} | {"version": 1},
    }
    opt2 = BlockwiseAdamW(model.named_parameters(), min_8bit_numel=0)
    opt2.load_state_dict(_load(_save(v1)))
    assert _snapshot(opt2) == _snapshot(opt)


def _with_generators(sd: dict, generators: dict[str, torch.Tensor]) -> dict:
    from lightning_baoc.optim.checkpoint import seal_state_dict

    sd["baoc"]["generators"] = generators
    return seal_state_dict(sd)


def test_generator_states_of_earlier_releases_are_ignored() -> None:
    """Dicts of earlier releases carry stochastic-rounding generator states; the rounding is keyed by
    seed, name and step count now, so they change nothing: the resumed runs are bit-identical."""
    model, opt = _trained("bf16")
    sd = opt.state_dict()
    assert "generators" not in sd["baoc"]
    legacy = _with_generators(copy_sd(sd), {"cpu": torch.Generator().manual_seed(5).get_state(),
                                           "cuda:0": torch.zeros(16, dtype=torch.uint8)})
    results = []
    for state in (sd, legacy):
        twin = mlp((64, 64, 10))
        twin.load_state_dict(model.state_dict())
        opt2 = BlockwiseAdamW(twin.named_parameters(), min_8bit_numel=0, seed=0)
        opt2.load_state_dict(copy_sd(state))
        _train(twin, opt2, _batches(2, seed=9))
        results.append(torch.cat([p.detach().flatten() for p in twin.parameters()]))
    assert torch.equal(results[0], results[1])


def copy_sd(sd: dict) -> dict:
    return _load(_save(sd))


def test_failed_load_leaves_the_optimizer_unchanged() -> None:
    from lightning_baoc import CheckpointError
    from lightning_baoc.optim.checkpoint import seal_state_dict

    _, other = _trained(widths=(64, 32, 10))  # same names, other shapes
    model, opt = _trained()
    sd = other.state_dict()
    sd["param_groups"][0]["lr"] = 0.5
    sd["baoc"]["requested"] = {"0.weight": "factored"}
    sd = seal_state_dict(sd)  # sealed: the shapes, checked after the groups, are what is wrong
    before = _snapshot(opt)
    with pytest.raises(CheckpointError, match=r"'0\.weight'.*shape"):
        opt.load_state_dict(sd)
    assert _snapshot(opt) == before
    _train(model, opt, _batches(1))  # and it still steps


@pytest.mark.parametrize(
    "edit, match",
    [
        (lambda g: g.update(betas=(0.9, 1.5)), r"param_groups\[0\]\.betas\[1\]: 1\.5"),
        (lambda g: g.update(lr=float("nan")), r"param_groups\[0\]\.lr: nan"),
        (lambda g: g.update(eps=-1.0), r"param_groups\[0\]\.eps: -1\.0"),
        (lambda g: g.update(state_format="int3"), r"param_groups\[0\]\.state_format"),
    ],
)
@pytest.mark.parametrize("kind", ["blockwise", "torch"])
def test_invalid_hyperparameters_in_a_state_dict_are_refused(edit: Any, match: str, kind: str) -> None:
    from lightning_baoc import CheckpointError
    from lightning_baoc.optim.checkpoint import seal_state_dict

    model, opt = _trained()
    if kind == "blockwise":
        sd = opt.state_dict()
        edit(sd["param_groups"][0])
        sd = seal_state_dict(sd)  # a deliberate edit: only the value is wrong
    else:
        ref = torch.optim.AdamW(model.parameters())
        _train(model, ref, _batches(1))
        sd = ref.state_dict()
        edit(sd["param_groups"][0])
    before = _snapshot(opt)
    with pytest.raises(CheckpointError, match=match):
        opt.load_state_dict(sd)
    assert _snapshot(opt) == before


@pytest.mark.parametrize(
    "edit, match",
    [
        (lambda e: e.pop("format"), r"'0\.weight'.*'format' is missing"),
        (lambda e: e.update(steps=-5), r"'0\.weight'.*'steps'.*-5"),
        (lambda e: e.update(m_step=e["steps"] + 1), r"'0\.weight'.*'m_step'"),
        (lambda e: e.update(format="int3"), r"'0\.weight'.*'format'.*int3"),
        (lambda e: e["tensors"].pop("exp_avg_sq" if "exp_avg_sq" in e["tensors"] else next(iter(e["tensors"]))), r"'0\.weight'.*tensors"),
    ],
)
def test_malformed_state_entries_are_named(edit: Any, match: str) -> None:
    from lightning_baoc import CheckpointError
    from lightning_baoc.optim.checkpoint import seal_state_dict

    _, opt = _trained()
    sd = opt.state_dict()
    edit(sd["state"]["0.weight"])
    before = _snapshot(opt)
    with pytest.raises(CheckpointError, match=match):
        opt.load_state_dict(sd)
    with pytest.raises(CheckpointError, match=match):  # also when resealed: not only the checksum sees it
        opt.load_state_dict(seal_state_dict(sd))
    assert _snapshot(opt) == before


def test_torch_state_of_another_shape_with_the_same_numel_is_refused() -> None:
    from lightning_baoc import CheckpointError

    p = nn.Parameter(torch.randn(64, 80))
    ref = torch.optim.AdamW([nn.Parameter(torch.randn(80, 64))])
    ref.param_groups[0]["params"][0].grad = torch.randn(80, 64)
    ref.step()
    opt = BlockwiseAdamW([("w", p)])
    with pytest.raises(CheckpointError, match=r"'w'.*exp_avg.*\(80, 64\).*\(64, 80\)"):
        opt.load_state_dict(ref.state_dict())


def test_blockwise_state_of_another_shape_with_the_same_numel_is_refused() -> None:
    from lightning_baoc import CheckpointError

    a = BlockwiseAdamW([("w", nn.Parameter(torch.randn(80, 64)))], state_format="int8", min_8bit_numel=0)
    a.param_groups[0]["params"][0].grad = torch.randn(80, 64)
    a.step()
    b = BlockwiseAdamW([("w", nn.Parameter(torch.randn(64, 80)))], state_format="int8", min_8bit_numel=0)
    with pytest.raises(CheckpointError, match=r"'w'.*shape \[80, 64\].*\(64, 80\)"):
        b.load_state_dict(a.state_dict())


def test_bit_flip_in_an_int8_code_is_detected() -> None:
    from lightning_baoc import CheckpointError

    _, opt = _trained()
    sd = opt.state_dict()
    codes = sd["state"]["0.weight"]["tensors"]["exp_avg"]
    assert codes.dtype == torch.int8
    codes.view(torch.uint8)[123] ^= 4  # still a valid code
    with pytest.raises(CheckpointError, match=r"'0\.weight'.*checksum"):
        opt.load_state_dict(sd)


def test_truncated_file_is_named_as_such(tmp_path: Any) -> None:
    from lightning_baoc import CheckpointError, load_checkpoint

    _, opt = _trained()
    data = _save(opt.state_dict())
    path = tmp_path / "opt.pt"
    path.write_bytes(data[: len(data) // 2])
    with pytest.raises(CheckpointError, match=r"opt\.pt.*truncated or corrupted"):
        load_checkpoint(path)
    path.write_bytes(data)
    opt.load_state_dict(load_checkpoint(path))


def test_checksum_is_exact_for_any_chunking_and_large_bytes() -> None:
    from lightning_baoc.optim.checkpoint.layout import digest_bytes

    gen = torch.Generator().manual_seed(0)
    data = torch.randint(0, 256, (10_007,), generator=gen, dtype=torch.int64).to(torch.uint8)
    data[:3000] = 255  # worst case for overflow
    values = data.tolist()
    modulus = 2**31 - 1
    total = sum(values)
    weighted = sum((i % modulus + 1) * b for i, b in enumerate(values)) % modulus
    expected = ((total % 2**32) << 31) | weighted
    for chunk in (64, 1000, 1 << 20):
        assert digest_bytes([data], chunk=chunk) == expected
    flipped = data.clone()
    flipped[5000] ^= 1
    assert digest_bytes([flipped]) != expected


@pytest.mark.parametrize(("optimizer", "refused"), [
    ("adamw", r"BlockwiseAdamW \(BAOC\).*BAOC callback"),
    ("sgd", "different number of parameter groups"),  # torch's SGD reads no state entry: the added group
])
def test_lightning_resume_without_the_callback_fails_at_load(tmp_path: Any, optimizer: str, refused: str) -> None:
    from support_lightning import DigitsModule, loaders, make_trainer

    from lightning_baoc import BAOC

    threads = torch.get_num_threads()
    torch.set_num_threads(1)  # a tiny model on a shared machine: one thread is fastest
    try:
        train, _ = loaders(n_train=160)
        baoc = BAOC(memory_budget=0.3, warmup_steps=3, sample_every=1, report=False)
        trainer = make_trainer(tmp_path, max_epochs=1, callbacks=[baoc], limit_val_batches=0)
        trainer.fit(DigitsModule(optimizer=optimizer), train)
        assert baoc.controller.phase == "allocated"
        trainer.save_checkpoint(tmp_path / "baoc.ckpt")
        plain = make_trainer(tmp_path, max_epochs=2, limit_val_batches=0)
        with pytest.raises(ValueError, match=refused):
            plain.fit(DigitsModule(optimizer=optimizer), train, ckpt_path=tmp_path / "baoc.ckpt")
    finally:
        torch.set_num_threads(threads)

"""Checkpoint fuzzing: every damaged checkpoint is refused by name, nothing loads half-way.

Truncated files and dicts, bit flips (in saved files, and in the tensors and metadata of the
in-memory dict), deleted fields, and state dicts of another model each raise
:class:`lightning_baoc.CheckpointError` naming what is wrong, and the optimizer that refused the
load is unchanged (its state dict, param groups and formats equal to before) and still steps.
A flip that hits bytes the file format never reads may load: then what loads equals the original.
"""

from __future__ import annotations

import io
import random
import struct
from typing import Any, Callable

import pytest
import torch
from support import mlp, one_thread  # noqa: F401 - one_thread applies to the module
from torch import nn

from lightning_baoc import BlockwiseAdamW, CheckpointError, load_checkpoint
from lightning_baoc.optim.checkpoint import seal_state_dict

WIDTHS = (32, 48, 8)
FORMATS_USED = {"0": "int8", "3.weight": "bf16", "3.bias": "nomomentum"}  # 1 (LayerNorm) stays fp32


def _batch(seed: int) -> tuple[torch.Tensor, torch.Tensor]:
    gen = torch.Generator().manual_seed(seed)
    return torch.randn(16, WIDTHS[0], generator=gen), torch.randint(0, WIDTHS[-1], (16,), generator=gen)


def _train(model: nn.Module, opt: BlockwiseAdamW, seeds: range) -> None:
    for seed in seeds:
        x, y = _batch(seed)
        opt.zero_grad()
        nn.functional.cross_entropy(model(x), y).backward()
        opt.step()


def _optimizer(model: nn.Module, seeds: range, formats: dict[str, str] = FORMATS_USED) -> BlockwiseAdamW:
    opt = BlockwiseAdamW(model.named_parameters(), lr=2e-3, min_8bit_numel=0)
    _train(model, opt, seeds[:1])
    opt.set_formats(formats)
    _train(model, opt, seeds[1:])
    return opt


def _save(obj: Any) -> bytes:
    buf = io.BytesIO()
    torch.save(obj, buf)
    return buf.getvalue()


def _snapshot(opt: BlockwiseAdamW) -> bytes:
    groups = [{k: v for k, v in g.items() if k != "params"} for g in opt.param_groups]
    return _save({"sd": opt.state_dict(), "groups": groups, "formats": opt.formats()})


@pytest.fixture(scope="module")
def saved() -> dict[str, Any]:
    """The checkpoint every case corrupts: a heterogeneous optimizer after 4 steps."""
    model = mlp(WIDTHS)
    opt = _optimizer(model, range(4))
    data = _save(opt.state_dict())
    target = _fresh_target()
    target.load_state_dict(torch.load(io.BytesIO(data), weights_only=True))
    return {"data": data, "loaded": _snapshot(target)}


def _fresh_target() -> BlockwiseAdamW:
    """An optimizer with a state of its own (other steps, other formats) that must survive a refused load."""
    return _optimizer(mlp(WIDTHS, seed=1), range(10, 13), {"0": "bf16_momentum", "3": "int8_factored"})


def _sd(saved: dict[str, Any]) -> dict[str, Any]:
    return torch.load(io.BytesIO(saved["data"]), weights_only=True)


def _refused(sd: Any, match: str | None = None) -> CheckpointError:
    """Load ``sd`` into a fresh target: it must raise CheckpointError and leave the target unchanged."""
    target = _fresh_target()
    before = _snapshot(target)
    with pytest.raises(CheckpointError, match=match) as info:
        target.load_state_dict(sd)
    assert _snapshot(target) == before
    _train_params(target, target.param_groups[0]["params"])
    return info.value


def _train_params(opt: BlockwiseAdamW, params: list[torch.Tensor]) -> None:
    before = [p.detach().clone() for p in params]
    for p in params:
        p.grad = torch.ones_like(p)
    opt.step()
    assert all(not torch.equal(b, p) for b, p in zip(before, params))  # it still steps


# ---------------------------------------------------------------------------- truncated


def test_truncated_files(saved: dict[str, Any]) -> None:
    data = saved["data"]
    for length in (0, 1, 30, 200, len(data) // 4, len(data) // 2, len(data) - 200, len(data) - 22, len(data) - 1):
        with pytest.raises(CheckpointError, match=r"truncated or corrupted"):
            load_checkpoint(io.BytesIO(data[:length]))


def _paths(sd: dict[str, Any]) -> list[tuple[Any, ...]]:
    """Every key path of the state dict down to (but not into) tensors and scalars."""
    out: list[tuple[Any, ...]] = []

    def walk(node: Any, path: tuple[Any, ...]) -> None:
        if isinstance(node, dict):
            for k, v in node.items():
                out.append(path + (k,))
                walk(v, path + (k,))
        elif isinstance(node, list) and path[-1:] == ("param_groups",):
            for i, v in enumerate(node):
                out.append(path + (i,))
                walk(v, path + (i,))

    walk(sd, ())
    return out


def _delete(sd: dict[str, Any], path: tuple[Any, ...]) -> None:
    node = sd
    for key in path[:-1]:
        node = node[key]
    del node[path[-1]]


@pytest.mark.slow  # long; damaged checkpoints are held by default by tests/optim/test_checkpoint.py
def test_every_field_deleted(saved: dict[str, Any]) -> None:
    paths = _paths(_sd(saved))
    assert len(paths) > 60
    for path in paths:
        sd = _sd(saved)
        _delete(sd, path)
        message = str(_refused(sd))
        key = path[-1]
        named = {repr(key) if isinstance(key, str) else "param groups", "checksum"}
        if path[0] == "state" and len(path) > 2:
            named.add(repr(path[1]))  # the parameter whose entry lost a field
        assert any(n in message for n in named), (path, message)


# ---------------------------------------------------------------------------- bit flips


@pytest.mark.slow  # long; damaged checkpoints are held by default by tests/optim/test_checkpoint.py
def test_bit_flips_in_saved_files(saved: dict[str, Any]) -> None:
    data = saved["data"]
    rng = random.Random(0)
    outcomes = {"refused": 0, "identical": 0}
    for _ in range(150):
        bad = bytearray(data)
        bad[rng.randrange(len(bad))] ^= 1 << rng.randrange(8)
        try:
            sd = load_checkpoint(io.BytesIO(bytes(bad)))
        except CheckpointError:
            outcomes["refused"] += 1
            continue
        target = _fresh_target()
        before = _snapshot(target)
        try:
            target.load_state_dict(sd)
        except CheckpointError:
            assert _snapshot(target) == before
            outcomes["refused"] += 1
        else:  # the flip hit bytes nothing reads: what loaded is the original
            assert _snapshot(target) == saved["loaded"]
            outcomes["identical"] += 1
    assert outcomes["refused"] >= 100, outcomes


def _flip_tensor(t: torch.Tensor, rng: random.Random) -> None:
    raw = t.view(-1).view(torch.uint8) if t.dim() else t.view(1).view(torch.uint8)
    raw[rng.randrange(raw.numel())] ^= 1 << rng.randrange(8)


def _flip_float(value: float, rng: random.Random) -> float:
    (bits,) = struct.unpack("<Q", struct.pack("<d", value))
    return struct.unpack("<d", struct.pack("<Q", bits ^ (1 << rng.randrange(64))))[0]


@pytest.mark.parametrize("seed", range(6))
def test_bit_flips_in_tensors_of_the_dict(saved: dict[str, Any], seed: int) -> None:
    rng = random.Random(seed)
    sd = _sd(saved)
    name = rng.choice(sorted(sd["state"]))
    key = rng.choice(sorted(sd["state"][name]["tensors"]))
    tensor = sd["state"][name]["tensors"][key]
    if tensor.numel() == 0:
        pytest.skip("empty tensor")
    _flip_tensor(tensor, rng)
    _refused(sd, rf"{name}.*checksum")


METADATA: list[tuple[str, Callable[[dict[str, Any], random.Random], None]]] = [
    ("steps", lambda sd, r: sd["state"]["0.weight"].update(steps=sd["state"]["0.weight"]["steps"] ^ (1 << r.randrange(8)))),
    ("m_step", lambda sd, r: sd["state"]["3.weight"].update(m_step=sd["state"]["3.weight"]["m_step"] ^ 1)),
    ("shape", lambda sd, r: sd["state"]["0.weight"]["shape"].__setitem__(0, sd["state"]["0.weight"]["shape"][0] ^ 1)),
    ("format", lambda sd, r: sd["state"]["1.weight"].update(format="bf16")),
    ("lr", lambda sd, r: sd["param_groups"][0].update(lr=_flip_float(sd["param_groups"][0]["lr"], r))),
    ("betas", lambda sd, r: sd["param_groups"][0].update(betas=(sd["param_groups"][0]["betas"][0], _flip_float(0.999, r)))),
    ("params", lambda sd, r: sd["param_groups"][0]["params"].__setitem__(0, "0.weight_")),
    ("generators", lambda sd, r: _flip_tensor(sd["baoc"]["generators"]["cpu"], r)),  # a legacy field
    ("nonfinite", lambda sd, r: sd["baoc"]["nonfinite"].update({"0.bias": 1})),
    ("requested", lambda sd, r: sd["baoc"]["requested"].update({"0.weight": "fp32"})),
]


@pytest.mark.parametrize("field, flip", METADATA, ids=[m[0] for m in METADATA])
@pytest.mark.parametrize("seed", range(2))
def test_bit_flips_in_metadata_of_the_dict(saved: dict[str, Any], field: str, flip: Any, seed: int) -> None:
    sd = _sd(saved)
    if field == "generators":  # dicts of earlier releases carry them, under the checksum
        sd["baoc"]["generators"] = {"cpu": torch.Generator().manual_seed(seed).get_state()}
        sd = seal_state_dict(sd)
    flip(sd, random.Random(seed))
    _refused(sd, rf"checksum|{field}")  # the checksum sees it, or a range check of that field


# ---------------------------------------------------------------------------- another model


def _other(named: list[tuple[str, nn.Parameter]] | list[dict[str, Any]]) -> dict[str, Any]:
    opt = BlockwiseAdamW(named, min_8bit_numel=0, state_format="int8")
    params = [p for g in opt.param_groups for p in g["params"]]
    for p in params:
        p.grad = torch.randn_like(p)
    opt.step()
    return opt.state_dict()


def _same_names(shapes: dict[str, tuple[int, ...]]) -> list[tuple[str, nn.Parameter]]:
    model = mlp(WIDTHS)
    return [(n, nn.Parameter(torch.randn(shapes.get(n, tuple(p.shape))))) for n, p in model.named_parameters()]


def test_state_dicts_of_another_model() -> None:
    model = mlp(WIDTHS)
    wrapped = nn.ModuleDict({"net": mlp(WIDTHS)})
    named = list(model.named_parameters())
    cases = {
        "other names": (_other(list(wrapped.named_parameters())), r"unknown parameter"),
        "other shapes": (_other(_same_names({"0.weight": (40, 32), "0.bias": (40,)})), r"'0\.(weight|bias)'.*shape"),
        "same numel, other shape": (_other(_same_names({"0.weight": (32, 48)})), r"'0\.weight'.*shape \[32, 48\].*\(48, 32\)"),
        "other number of groups": (
            _other([{"params": [p for _, p in named[:2]], "param_names": [n for n, _ in named[:2]]},
                    {"params": [p for _, p in named[2:]], "param_names": [n for n, _ in named[2:]]}]),
            r"2 param groups.*1",
        ),
        "fewer parameters": (_other(named[:3]), r"param group 0.*parameters"),
        "torch AdamW of another model": (_torch_state(mlp((32, 40, 8))), r"shape"),
    }
    for case, (sd, match) in cases.items():
        _refused(sd, match)


def _torch_state(model: nn.Module) -> dict[str, Any]:
    opt = torch.optim.AdamW(model.parameters())
    for p in model.parameters():
        p.grad = torch.randn_like(p)
    opt.step()
    return opt.state_dict()

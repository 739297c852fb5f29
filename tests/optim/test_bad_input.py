"""BlockwiseAdamW refuses bad input is refused with errors naming argument, value and what is allowed."""

from __future__ import annotations

import pytest
import torch
from torch import nn

from lightning_baoc import FORMATS, BlockwiseAdamW


def _params() -> list[nn.Parameter]:
    return [nn.Parameter(torch.randn(64, 80))]


@pytest.mark.parametrize(
    "kwargs,error,pattern",
    [
        ({"state_format": "fp8"}, ValueError, r"Unknown state_format 'fp8'; allowed: \['fp32'"),
        ({"state_format": 8}, TypeError, r"state_format must be a format name \(str\), got 8"),
        ({"lr": -1e-3}, ValueError, r"Invalid lr: -0.001; expected a float >= 0"),
        ({"betas": (0.9, 1.0)}, ValueError, r"Invalid betas\[1\]: 1.0; expected a float in \[0, 1\)"),
        ({"betas": (-0.1, 0.999)}, ValueError, r"Invalid betas\[0\]: -0.1"),
        ({"eps": -1.0}, ValueError, r"Invalid eps: -1.0"),
        ({"weight_decay": -0.1}, ValueError, r"Invalid weight_decay: -0.1"),
        ({"min_8bit_numel": -1}, ValueError, r"Invalid min_8bit_numel: -1"),
    ],
)
def test_constructor_errors(kwargs: dict, error: type, pattern: str) -> None:
    with pytest.raises(error, match=pattern):
        BlockwiseAdamW(_params(), **kwargs)


def test_group_errors_name_the_group() -> None:
    with pytest.raises(ValueError, match=r"Unknown param_groups\[1\]\.state_format 'int4'; allowed"):
        BlockwiseAdamW([{"params": _params()}, {"params": _params(), "state_format": "int4"}])
    opt = BlockwiseAdamW(_params())
    with pytest.raises(ValueError, match=r"Invalid param_groups\[1\]\.lr: -1"):
        opt.add_param_group({"params": _params(), "lr": -1})
    assert len(opt.param_groups) == 1  # a refused group leaves nothing behind
    with pytest.raises(ValueError, match="amsgrad"):
        BlockwiseAdamW([{"params": _params(), "amsgrad": True}])


def test_non_floating_parameter() -> None:
    with pytest.raises(TypeError, match=r"real floating-point parameters only; parameter 0 of group 0 has dtype torch.int64"):
        BlockwiseAdamW([torch.zeros(3, dtype=torch.long)])


def test_sparse_gradients() -> None:
    emb = nn.Embedding(100, 8, sparse=True)
    opt = BlockwiseAdamW(emb.named_parameters())
    emb(torch.tensor([1, 2, 3])).sum().backward()
    with pytest.raises(TypeError, match=r"sparse gradients \(parameter 'weight'\); use torch.optim.SparseAdam"):
        opt.step()


def test_set_formats_errors() -> None:
    model = nn.Sequential(nn.Linear(4, 4))
    opt = BlockwiseAdamW(model.named_parameters())
    with pytest.raises(ValueError, match=r"Unknown format of '0.weight' 'int3'; allowed"):
        opt.set_formats({"0.weight": "int3"})
    with pytest.raises(TypeError, match=r"format of '0' must be a format name \(str\), got None"):
        opt.set_formats({"0": None})
    with pytest.raises(ValueError, match=r"'decoder' names no parameter, block or module"):
        opt.set_formats({"decoder": "int8"})
    with pytest.raises(ValueError, match=r"block 'b' names parameter 'x'"):
        opt.set_formats({"b": "int8"}, blocks={"b": ["x"]})


def test_load_state_dict_mismatch() -> None:
    a = BlockwiseAdamW([("w", nn.Parameter(torch.randn(64, 80)))])
    b = BlockwiseAdamW([("v", nn.Parameter(torch.randn(64, 80)))])
    with pytest.raises(ValueError, match=r"unknown parameters \['w'\]"):
        b.load_state_dict(a.state_dict())


@pytest.mark.parametrize("fmt", list(FORMATS))
@pytest.mark.parametrize("bad", [float("nan"), float("inf")])
def test_nonfinite_gradient_never_corrupts_state(fmt: str, bad: float) -> None:
    torch.manual_seed(0)
    p = nn.Parameter(torch.randn(64, 80))
    opt = BlockwiseAdamW([("w", p)], state_format=fmt, min_8bit_numel=0)
    for _ in range(3):
        p.grad = torch.randn_like(p)
        opt.step()
    state, value, steps = opt.param_state("w"), p.detach().clone(), opt.step_count("w")
    p.grad = torch.randn_like(p)
    p.grad[3, 7] = bad
    with pytest.warns(RuntimeWarning, match="non-finite gradient for 'w'; its update is skipped"):
        opt.step()
    after = opt.param_state("w")
    assert torch.equal(p.detach(), value) and opt.step_count("w") == steps
    for key in ("exp_avg", "exp_avg_sq", "row", "col"):
        if getattr(state, key) is not None:
            assert torch.equal(getattr(after, key), getattr(state, key))
    assert opt.nonfinite_counts == {"w": 1}
    p.grad = torch.randn_like(p)
    opt.step()  # training goes on with finite values
    assert torch.isfinite(p).all()
    assert all(torch.isfinite(t.float()).all() for t in opt.state_tensors())

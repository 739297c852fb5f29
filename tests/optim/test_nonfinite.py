"""Non-finite values: 8-bit states stay finite, and finite gradients whose norm overflows are applied.

Each test runs ``BlockwiseAdamW`` beside a ``torch.optim.AdamW`` twin fed the same gradients and
checks that the parameters stay finite and move as the twin's do, within the format's error.
"""

from __future__ import annotations

import warnings

import pytest
import torch
from torch import nn

from lightning_baoc import FORMATS, BlockwiseAdamW
from lightning_baoc.formats.base import Canonical, expand_factored

FP32_TINY = torch.finfo(torch.float32).tiny
#: Relative error of a parameter's movement against its torch AdamW twin's, by format: the
#: precision of its states (measured after a long idle conversion: int8 0.023, int8_factored
#: 0.035, nomomentum_int8 0.027, bf16 0.003, factored 3e-7).
TWIN_TOLERANCE = {
    "fp32": 1e-4,
    "offload": 1e-4,
    "nomomentum": 1e-4,
    "factored": 1e-4,
    "bf16": 0.02,
    "bf16_momentum": 0.02,
    "int8": 0.08,
    "int8_factored": 0.08,
    "nomomentum_int8": 0.08,
}


def _pair(
    fmt: str, shape: tuple[int, ...] = (64, 64)
) -> tuple[nn.Parameter, nn.Parameter, BlockwiseAdamW, torch.optim.AdamW, torch.Generator]:
    """A parameter in ``fmt`` (8-bit even when small), its torch AdamW twin, and their generator."""
    gen = torch.Generator().manual_seed(0)
    init = torch.randn(shape, generator=gen)
    p, q = nn.Parameter(init.clone()), nn.Parameter(init.clone())
    opt = BlockwiseAdamW([("w", p)], state_format=fmt, min_8bit_numel=0)
    return p, q, opt, torch.optim.AdamW([q]), gen


def _step(
    p: nn.Parameter, q: nn.Parameter, opt: BlockwiseAdamW, ref: torch.optim.AdamW, grad: torch.Tensor
) -> None:
    p.grad, q.grad = grad.clone(), grad.clone()
    opt.step()
    ref.step()


def _assert_state_finite(opt: BlockwiseAdamW) -> None:
    state = opt.param_state("w")
    assert torch.isfinite(state.dense_v()).all()
    if state.exp_avg is not None:
        assert torch.isfinite(state.exp_avg).all()


# ---------------------------------------------------------------------------- defect 1


@pytest.mark.parametrize("fmt", ["int8", "int8_factored"])
def test_int8_momentum_decaying_to_zero_stays_finite(fmt: str) -> None:
    """One gradient of randn * 1e-3, then zeros: the momentum decays past 2**-128 (NaN at ~670)."""
    p, q, opt, ref, gen = _pair(fmt)
    init = q.detach().clone()
    _step(p, q, opt, ref, torch.randn(64, 64, generator=gen) * 1e-3)
    for _ in range(800):
        _step(p, q, opt, ref, torch.zeros(64, 64))
        assert torch.isfinite(p).all()
    _assert_state_finite(opt)
    # the momentum decayed below fp32's normal range (1e-3 * 0.9**800 ~ 1e-40): flushed to 0
    assert float(opt.param_state("w").exp_avg.abs().max()) < FP32_TINY
    ours, theirs = (p - init).detach().view(-1), (q - init).detach().view(-1)
    assert float(theirs.abs().max()) > 0.03  # the first gradient moved the twin by ~0.04
    assert float(ours.norm() / theirs.norm()) == pytest.approx(1.0, abs=0.05)
    if fmt == "int8":
        assert float((ours - theirs).norm() / theirs.norm()) < 0.05  # measured 0.033
    else:  # the rank-1 estimate of a randn gradient's v turns the direction a little
        assert float(torch.nn.functional.cosine_similarity(ours, theirs, dim=0)) > 0.9  # measured 0.93


@pytest.mark.parametrize("fmt", list(FORMATS))
def test_tiny_gradient_keeps_parameters_finite(fmt: str) -> None:
    """A gradient of randn * 1e-34 (NaN at the next step in int8) changes nothing but weight decay."""
    p, q, opt, ref, gen = _pair(fmt)
    init = p.detach().clone()
    _step(p, q, opt, ref, torch.randn(64, 64, generator=gen) * 1e-34)
    for _ in range(3):
        _step(p, q, opt, ref, torch.zeros(64, 64))
    assert torch.isfinite(p).all()
    _assert_state_finite(opt)
    # updates of ~lr * 1e-34 / eps vanish: both only decayed, by (1 - lr * weight_decay) ** 4
    decayed = init * (1 - 1e-3 * 1e-2) ** 4
    assert not torch.equal(decayed, init)
    assert torch.allclose(p.detach(), decayed, rtol=1e-6, atol=0.0)
    assert torch.allclose(q.detach(), decayed, rtol=1e-6, atol=0.0)


@pytest.mark.parametrize("fmt", ["int8", "int8_factored", "nomomentum_int8", "bf16", "factored"])
def test_long_idle_fp32_state_converts_finite(fmt: str) -> None:
    """A state idle for 700 steps holds momentum ~1e-35: converted, it stays finite and usable."""
    p, q, opt, ref, gen = _pair("fp32")

    pattern = torch.outer(torch.randn(64, generator=gen), torch.randn(64, generator=gen)) * 1e-3

    def rank1_grad() -> torch.Tensor:  # one pattern, scaled: every v is of rank 1, factored exactly
        return pattern * float(torch.rand((), generator=gen) + 0.5)

    _step(p, q, opt, ref, rank1_grad())
    for _ in range(700):
        _step(p, q, opt, ref, torch.zeros(64, 64))
    assert 0 < float(opt.param_state("w").exp_avg.abs().max()) < 1e-34  # tiny, not yet zero in fp32
    opt.set_formats({"w": fmt})
    _assert_state_finite(opt)
    if not FORMATS[fmt].has_momentum:  # AdamW with beta1 = 0 is the update without momentum
        ref.param_groups[0]["betas"] = (0.0, 0.999)
    before = q.detach().clone()
    for _ in range(20):  # and it keeps training like AdamW
        _step(p, q, opt, ref, rank1_grad())
    assert torch.isfinite(p).all()
    _assert_state_finite(opt)
    moved = (q - before).detach()
    error = float((p - q).detach().norm() / moved.norm())
    assert error < TWIN_TOLERANCE[fmt], error


# ---------------------------------------------------------------------------- defect 5


def _no_warning_step(opt: BlockwiseAdamW) -> None:
    with warnings.catch_warnings():
        warnings.simplefilter("error")  # a skipped step warns: make it fail here
        opt.step()


def test_fp16_gradient_whose_norm_overflows_is_applied() -> None:
    """All 300.0 on 256x256 in fp16: the norm is 76,796 > 65,504, every value is finite."""
    init = torch.full((256, 256), 0.5, dtype=torch.float16)
    p, q = nn.Parameter(init.clone()), nn.Parameter(init.clone())
    opt, ref = BlockwiseAdamW([("w", p)]), torch.optim.AdamW([q])
    for _ in range(10):
        p.grad, q.grad = torch.full_like(p, 300.0), torch.full_like(q, 300.0)
        _no_warning_step(opt)
        ref.step()
    assert opt.nonfinite_counts == {}
    assert opt.step_count("w") == 10
    # AdamW's step on a constant gradient is lr per step: 0.5 -> ~0.49 (fp16 rounding aside)
    assert float((init.float() - p.detach().float()).mean()) == pytest.approx(0.01, rel=0.05)
    assert torch.allclose(p.float(), q.float(), atol=1e-3, rtol=0)


@pytest.mark.parametrize("fmt", list(FORMATS))
def test_fp32_gradient_of_1e19_is_applied(fmt: str) -> None:
    """Gradients of +-1e19: the fp32 norm overflows, every value and AdamW's v = 1e35 are finite."""
    p, q, opt, ref, gen = _pair(fmt, shape=(48, 40))
    init = q.detach().clone()
    sign = torch.randint(0, 2, (48, 40), generator=gen).float().mul_(2).sub_(1)
    rows = torch.outer(torch.ones(48), torch.ones(40))  # |g| constant: rank-1 square for factored
    for _ in range(20):
        p.grad, q.grad = sign * rows * 1e19, sign * rows * 1e19
        _no_warning_step(opt)
        ref.step()
    assert opt.nonfinite_counts == {}
    assert opt.step_count("w") == 20
    assert torch.isfinite(p).all()
    _assert_state_finite(opt)
    moved = (q - init).detach()
    assert float(moved.abs().mean()) == pytest.approx(20e-3, rel=0.05)  # ~lr per step, against the sign
    error = float((p - q).detach().norm() / moved.norm())
    assert error < 0.02, error


@pytest.mark.parametrize(
    "dtype,position,value",
    [
        (torch.float32, 0, float("nan")),
        (torch.float32, 70_000, float("nan")),  # deep inside a vectorized reduction
        (torch.float32, 131_071, float("inf")),
        (torch.float16, 65_535, float("-inf")),
        (torch.bfloat16, 12_345, float("nan")),
    ],
)
def test_nonfinite_gradient_is_still_skipped(dtype: torch.dtype, position: int, value: float) -> None:
    p = nn.Parameter(torch.zeros(512, 256, dtype=dtype))
    opt = BlockwiseAdamW([("w", p)])
    grad = torch.ones(512, 256, dtype=dtype)
    grad.view(-1)[position] = value
    p.grad = grad
    with pytest.warns(RuntimeWarning, match="non-finite gradient"):
        opt.step()
    assert opt.nonfinite_counts == {"w": 1}
    assert opt.step_count("w") == 0
    assert torch.count_nonzero(p) == 0


def test_empty_parameter_beside_others_steps() -> None:
    """An empty gradient has no maximum (torch refuses its inf-norm): it must not break the check."""
    empty, weight = nn.Parameter(torch.zeros(0, 4)), nn.Parameter(torch.ones(8, 4))
    opt = BlockwiseAdamW([("empty", empty), ("weight", weight)], weight_decay=0.0)
    empty.grad, weight.grad = torch.zeros(0, 4), torch.ones(8, 4)
    _no_warning_step(opt)
    assert torch.allclose(weight.detach(), torch.full((8, 4), 1.0 - 1e-3))  # Adam's first step: lr
    assert opt.nonfinite_counts == {}


# ---------------------------------------------------------------------------- the same class nearby


def test_factored_moments_of_1e19_gradients_are_exact() -> None:
    """Row/column means of g**2 = 1e38: a plain row sum overflows; the moments must not."""
    gen = torch.Generator().manual_seed(0)
    grad = torch.outer(torch.rand(48, generator=gen) + 0.5, torch.rand(40, generator=gen) + 0.5).mul_(0.6e19)
    p = nn.Parameter(torch.zeros(48, 40))
    opt = BlockwiseAdamW([("w", p)], state_format="factored", weight_decay=0.0)
    p.grad = grad
    opt.step()
    state = opt.param_state("w")
    square = grad.double().square()
    expected_row = 1e-3 * (square.mean(dim=1) + 1e-30)  # (1 - beta2) * (mean g**2 + EPS_SQUARE)
    expected_col = 1e-3 * (square.mean(dim=0) + 1e-30)
    assert torch.allclose(state.row.double(), expected_row, rtol=1e-5, atol=0)
    assert torch.allclose(state.col.double(), expected_col, rtol=1e-5, atol=0)
    # the first step of Adam is lr * sign(g), here exactly (the square is of rank 1)
    assert torch.allclose(p.detach(), torch.full_like(p, -1e-3), rtol=1e-4)


@pytest.mark.parametrize("magnitude", [1e36, 1e-40])
def test_expand_factored_at_fp32s_extremes(magnitude: float) -> None:
    """``row * col / mean(row)``: the product of two moments overflows (1e36) or underflows (1e-40)."""
    gen = torch.Generator().manual_seed(0)
    a = torch.rand(48, generator=gen, dtype=torch.float64) + 0.5
    v = torch.outer(a, torch.rand(40, generator=gen, dtype=torch.float64) + 0.5) * magnitude
    state = Canonical((48, 40), exp_avg_sq=v.float())
    row, col = state.factored_v()
    # 1e-40 is denormal in fp32: 2**-149 (1.4e-45) absolute precision per operation
    atol = 1e-43 if magnitude < 1 else 0.0
    assert torch.allclose(row.double(), v.mean(dim=1), rtol=1e-5, atol=atol)
    assert torch.allclose(col.double(), v.mean(dim=0), rtol=1e-5, atol=atol)
    dense = expand_factored(row, col)
    assert torch.isfinite(dense).all()
    assert torch.allclose(dense.double(), v, rtol=1e-4, atol=atol)  # rank 1: the estimate is v
    zero = expand_factored(torch.zeros(48), col)  # a row mean of 0: a zero estimate, no 0 / 0
    assert torch.count_nonzero(zero) == 0 and torch.isfinite(zero).all()


@pytest.mark.parametrize("fmt", ["bf16", "int8", "int8_factored", "nomomentum_int8", "factored"])
def test_overflowed_fp32_state_converts_to_a_finite_compact_state(fmt: str) -> None:
    """Gradients of 1e21 overflow fp32 AdamW's v to inf, as in torch; compact formats saturate it."""
    p, q, opt, ref, gen = _pair("fp32")
    sign = torch.randint(0, 2, (64, 64), generator=gen).float().mul_(2).sub_(1)
    for _ in range(3):
        _step(p, q, opt, ref, sign * 1e21)
    assert torch.isinf(opt.param_state("w").exp_avg_sq).all()  # as torch's own v: the update is 0
    assert torch.isinf(ref.state[q]["exp_avg_sq"]).all() and torch.equal(p, q)
    opt.set_formats({"w": fmt})
    _assert_state_finite(opt)
    for _ in range(3):
        p.grad = torch.randn(64, 64, generator=gen)
        opt.step()
    assert torch.isfinite(p).all()
    _assert_state_finite(opt)


# ---------------------------------------------------------------------------- the same class elsewhere


def test_sampler_statistics_of_1e19_gradients_are_those_of_unit_gradients() -> None:
    """Gradients scaled by 1e19 are finite: the sampler's row norms and cosines must not overflow
    into a dropped, 'non-finite' sample (the statistics are scale-invariant)."""
    from lightning_baoc.sampling import GradientSampler

    stats = {}
    for scale in (1.0, 1e19, 1e30):
        model = nn.Sequential(nn.Linear(64, 48), nn.Linear(48, 8))
        gen = torch.Generator().manual_seed(0)
        signal = {n: torch.randn(p.shape, generator=gen) for n, p in model.named_parameters()}
        rows = {n: torch.linspace(0.5, 2.0, p.shape[0]).view(-1, *([1] * (p.dim() - 1))) for n, p in model.named_parameters()}
        with GradientSampler(model, sample_every=1, capacity=8) as sampler:
            for step in range(12):
                for n, p in model.named_parameters():
                    noise = torch.randn(p.shape, generator=gen)
                    p.grad = (signal[n] + 0.5 * noise) * rows[n] * scale
                sampler.sample(step)
            stats[scale] = sampler.statistics()
            assert not any(sampler.nonfinite_count.values()), (scale, sampler.nonfinite_count)
    for scale in (1e19, 1e30):
        for block, row in stats[1.0].items():
            for key in ("stability", "persistence", "anisotropy"):
                assert stats[scale][block][key] == pytest.approx(row[key], rel=1e-4, abs=1e-6), (scale, block, key)


def test_factored_risk_of_moments_near_fp32s_maximum_is_finite_and_scale_free() -> None:
    from lightning_baoc.risk import risk_table

    gen = torch.Generator().manual_seed(0)
    v = torch.rand(96, 64, generator=gen) * 2 + 1  # v in [1, 3]: times 1e38 the row sums overflow fp32
    m = torch.randn(96, 64, generator=gen) * v.sqrt() * 0.3
    risks = {}
    for scale in (1.0, 1e19):
        p = nn.Parameter(torch.zeros(96, 64))
        opt = BlockwiseAdamW([("w", p)], min_8bit_numel=0)
        sd = {"state": {0: {"step": 1000, "steps": 1000, "exp_avg": m * scale, "exp_avg_sq": v * scale * scale}},
              "param_groups": [{"params": [0]}]}
        opt.load_state_dict(sd)
        risks[scale] = risk_table(opt, {"w": ["w"]}, formats=["factored", "int8_factored", "bf16"])["w"]
        assert all(torch.isfinite(torch.tensor(r)) for r in risks[scale].values()), risks[scale]
    for fmt, r in risks[1.0].items():
        # factored is deterministic; the others round stochastically, differently on other values
        assert risks[1e19][fmt] == pytest.approx(r, rel=1e-3 if fmt == "factored" else 0.1), fmt

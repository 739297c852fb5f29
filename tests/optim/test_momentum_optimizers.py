"""BlockwiseSGD and BlockwiseLion (``lightning_baoc/optim/sgd_lion.py``, ``formats/momentum.py``).

- Parity: fp32 SGD equals ``torch.optim.SGD`` (momentum, dampening, Nesterov, weight decay,
  maximize, none) within 1e-6 over 200 steps (to the bit, in practice); fp32 Lion equals the
  reference written here from the paper's pseudo-code; ``none`` is plain SGD and sign descent.
- Formats: the bytes each holds equal the storage allocated (4, 2, ~1.127 and 0 bytes per element);
  bf16 and int8 buffers stay within their rounding of the fp32 run's buffer; live conversions keep
  the buffer (within the target's rounding); SGD's buffer restarts from the gradient after ``none``.
- Checkpoints: a resumed run equals the uninterrupted one bit for bit in every format; the dicts of
  ``torch.optim.SGD`` load (``from_optimizer`` continues torch's run); a dict of another rule is
  refused by name.
- Gradient release, bf16 weights with a correction, the non-finite skip, copies, groups without
  momentum (no buffer, as torch), and the errors a user meets (Nesterov without momentum, an AdamW
  format name, BAOC refusing the momentum optimizers).
"""

from __future__ import annotations

import copy
import io
import pickle

import pytest
import torch
from torch import nn

from lightning_baoc import MOMENTUM_FORMATS, BlockwiseAdamW, BlockwiseLion, BlockwiseSGD, export_adamw_state_dict
from lightning_baoc.optim import CheckpointError

SGD_CASES = [
    dict(momentum=0.9),
    dict(momentum=0.9, nesterov=True, weight_decay=1e-2),
    dict(momentum=0.8, dampening=0.3, weight_decay=5e-3),
    dict(momentum=0.9, maximize=True),
    dict(),  # no momentum: format "none"
]


def _model(seed: int = 0, dtype: torch.dtype = torch.float32) -> nn.Module:
    torch.manual_seed(seed)
    return nn.Sequential(nn.Linear(32, 160), nn.Tanh(), nn.Linear(160, 8)).to(dtype)


def _train(models_and_opts: list[tuple[nn.Module, torch.optim.Optimizer]], steps: int, seed: int = 1) -> None:
    """Train every (model, optimizer) pair on the same batches, interleaved."""
    gen = torch.Generator().manual_seed(seed)
    for _ in range(steps):
        x = torch.randn(16, 32, generator=gen)
        for model, opt in models_and_opts:
            opt.zero_grad()
            dtype = next(model.parameters()).dtype
            model(x.to(dtype)).float().cos().mean().backward()  # bounded: maximize stays finite
            opt.step()


def _max_diff(a: nn.Module, b: nn.Module) -> float:
    return max((x.float() - y.float()).abs().max().item() for x, y in zip(a.parameters(), b.parameters()))


@pytest.mark.parametrize("kwargs", SGD_CASES, ids=lambda k: "-".join(f"{a}={b}" for a, b in k.items()) or "plain")
def test_fp32_sgd_matches_torch_sgd_over_200_steps(kwargs: dict) -> None:
    ref, ours = _model(), _model()
    torch_opt = torch.optim.SGD(ref.parameters(), lr=0.05, **kwargs)
    opt = BlockwiseSGD(ours.named_parameters(), lr=0.05, **kwargs)
    _train([(ref, torch_opt), (ours, opt)], 200)
    assert _max_diff(ref, ours) <= 1e-6
    expected = "fp32" if kwargs.get("momentum") else "none"
    assert set(opt.formats().values()) == {expected}
    if kwargs.get("momentum"):  # the buffers are torch's
        for p in ours.parameters():
            ref_p = dict(zip(ours.parameters(), ref.parameters()))[p]
            buf = torch_opt.state[ref_p]["momentum_buffer"]
            assert torch.allclose(opt.param_state(p).exp_avg, buf, rtol=0, atol=1e-6)


class ReferenceLion(torch.optim.Optimizer):
    """Lion as in Chen et al. (2023), Algorithm 2, written for readability (the tests' reference)."""

    def __init__(self, params, lr: float = 1e-4, betas: tuple[float, float] = (0.9, 0.99), weight_decay: float = 0.0) -> None:  # type: ignore[no-untyped-def]
        super().__init__(params, dict(lr=lr, betas=betas, weight_decay=weight_decay))

    @torch.no_grad()
    def step(self) -> None:  # type: ignore[override]
        for group in self.param_groups:
            beta1, beta2 = group["betas"]
            for p in group["params"]:
                if p.grad is None:
                    continue
                m = self.state[p].setdefault("exp_avg", torch.zeros_like(p))
                interpolated = beta1 * m + (1 - beta1) * p.grad   # c_t
                p.mul_(1 - group["lr"] * group["weight_decay"])     # decoupled weight decay
                p.sub_(group["lr"] * torch.sign(interpolated))      # the sign update
                m.copy_(beta2 * m + (1 - beta2) * p.grad)           # momentum tracks the gradient


@pytest.mark.parametrize("weight_decay", [0.0, 0.1])
def test_fp32_lion_matches_the_reference_over_200_steps(weight_decay: float) -> None:
    ref, ours = _model(), _model()
    ref_opt = ReferenceLion(ref.parameters(), lr=1e-3, betas=(0.9, 0.99), weight_decay=weight_decay)
    opt = BlockwiseLion(ours.named_parameters(), lr=1e-3, betas=(0.9, 0.99), weight_decay=weight_decay)
    _train([(ref, ref_opt), (ours, opt)], 200)
    # sign() turns an ulp of difference in c_t near zero into a full step of lr: count those elements
    assert _max_diff(ref, ours) <= 1e-6
    for p, q in zip(ref.parameters(), ours.parameters()):
        assert torch.allclose(ref_opt.state[p]["exp_avg"], opt.param_state(q).exp_avg, rtol=1e-5, atol=1e-7)


def test_none_is_plain_sgd_and_sign_descent() -> None:
    ref, sgd_model, lion_ref, lion_model = _model(), _model(), _model(), _model()
    torch_opt = torch.optim.SGD(ref.parameters(), lr=0.05, weight_decay=1e-3)
    sgd = BlockwiseSGD(sgd_model.named_parameters(), lr=0.05, momentum=0.9, weight_decay=1e-3, state_format="none")
    sign_ref = ReferenceLion(lion_ref.parameters(), lr=1e-3, betas=(0.0, 0.0))  # beta1 = 0: sign(g)
    lion = BlockwiseLion(lion_model.named_parameters(), lr=1e-3, state_format="none")
    _train([(ref, torch_opt), (sgd_model, sgd), (lion_ref, sign_ref), (lion_model, lion)], 50)
    assert _max_diff(ref, sgd_model) == 0.0
    assert _max_diff(lion_ref, lion_model) == 0.0
    assert sgd.state_bytes() == 0 and lion.state_bytes() == 0


def _allocated(opt: torch.optim.Optimizer) -> int:
    storages = {}
    for rec in opt._records.values():  # noqa: SLF001
        for t in (rec.views or {}).values():
            storages[t.untyped_storage().data_ptr()] = t.untyped_storage().nbytes()
    return sum(storages.values())


@pytest.mark.parametrize("cls", [BlockwiseSGD, BlockwiseLion])
def test_bytes_per_element_equal_the_storage_allocated(cls: type) -> None:
    per_element = {}
    for fmt in MOMENTUM_FORMATS:
        model = nn.Linear(1024, 1024, bias=False)
        kwargs = dict(momentum=0.9) if cls is BlockwiseSGD else {}
        opt = cls(model.named_parameters(), lr=1e-3, state_format=fmt, **kwargs)
        model(torch.randn(4, 1024)).sum().backward()
        opt.step()
        assert opt.state_bytes() == _allocated(opt)
        per_element[fmt] = _allocated(opt) / model.weight.numel()
    assert per_element["fp32"] == 4.0 and per_element["bf16"] == 2.0 and per_element["none"] == 0.0
    assert per_element["int8"] == pytest.approx(1 + 2 / 32 + 1 / 1024)  # codes, fp16 scales, exponents


@pytest.mark.parametrize("fmt,rel", [("bf16", 0.02), ("int8", 0.06)])
@pytest.mark.parametrize("cls", [BlockwiseSGD, BlockwiseLion])
def test_cheap_buffers_stay_within_their_rounding(cls: type, fmt: str, rel: float) -> None:
    """The same steps from the same weights: the buffer in ``fmt`` is within ``rel`` (relative to the
    buffer's norm) of the fp32 buffer after 20 steps."""
    kwargs = dict(momentum=0.9) if cls is BlockwiseSGD else {}
    exact_model, cheap_model = _model(), _model()
    exact = cls(exact_model.named_parameters(), lr=1e-3, **kwargs)
    cheap = cls(cheap_model.named_parameters(), lr=1e-3, state_format=fmt, min_8bit_numel=0, **kwargs)
    _train([(exact_model, exact), (cheap_model, cheap)], 20)
    for name in exact.named_params:
        a, b = exact.param_state(name).exp_avg, cheap.param_state(name).exp_avg
        assert (a - b).norm() <= rel * a.norm(), name
    assert set(cheap.formats().values()) == {fmt}


@pytest.mark.parametrize("cls", [BlockwiseSGD, BlockwiseLion])
def test_live_conversion_keeps_the_buffer(cls: type) -> None:
    kwargs = dict(momentum=0.9) if cls is BlockwiseSGD else {}
    model = _model()
    opt = cls(model.named_parameters(), lr=1e-3, min_8bit_numel=0, **kwargs)
    _train([(model, opt)], 5)
    before = {n: opt.param_state(n).exp_avg.clone() for n in opt.named_params}
    assert opt.set_formats({"0": "int8", "2": "bf16"}) == {n: ("fp32", "int8" if n.startswith("0") else "bf16") for n in before}
    for n, m in before.items():
        assert (opt.param_state(n).exp_avg - m).norm() <= 0.06 * m.norm()
        assert opt.step_count(n) == 5
    opt.set_formats({"0": "fp32", "2": "fp32"})
    for n, m in before.items():
        assert (opt.param_state(n).exp_avg - m).norm() <= 0.06 * m.norm()
    _train([(model, opt)], 2)


def test_sgd_buffer_restarts_from_the_gradient_after_none() -> None:
    """Dropping the buffer and re-creating it gives torch's fresh start: the next step's buffer is
    that step's gradient (torch's ``clone(d_p)``), not a decayed zero."""
    model, ref = _model(), _model()
    opt = BlockwiseSGD(model.named_parameters(), lr=0.05, momentum=0.9)
    _train([(model, opt)], 3)
    opt.set_formats({"0": "none", "2": "none"})
    opt.set_formats({"0": "fp32", "2": "fp32"})
    ref.load_state_dict(model.state_dict())
    torch_opt = torch.optim.SGD(ref.parameters(), lr=0.05, momentum=0.9)  # a fresh buffer
    _train([(model, opt), (ref, torch_opt)], 10, seed=7)
    assert _max_diff(model, ref) == 0.0


@pytest.mark.parametrize("fmt", list(MOMENTUM_FORMATS))
@pytest.mark.parametrize("cls", [BlockwiseSGD, BlockwiseLion])
def test_resume_is_bit_equal(cls: type, fmt: str) -> None:
    kwargs = dict(momentum=0.9, nesterov=True) if cls is BlockwiseSGD else dict(weight_decay=0.1)
    kwargs["state_format"] = fmt
    straight_model = _model()
    straight = cls(straight_model.named_parameters(), lr=1e-3, min_8bit_numel=0, **kwargs)
    _train([(straight_model, straight)], 6)
    buffer = io.BytesIO()
    torch.save({"model": straight_model.state_dict(), "opt": straight.state_dict()}, buffer)
    _train([(straight_model, straight)], 6, seed=2)
    buffer.seek(0)
    saved = torch.load(buffer, weights_only=True)
    resumed_model = _model(seed=5)
    resumed_model.load_state_dict(saved["model"])
    resumed = cls(resumed_model.named_parameters(), lr=1e-3, min_8bit_numel=0, **kwargs)
    resumed.load_state_dict(saved["opt"])
    _train([(resumed_model, resumed)], 6, seed=2)
    assert _max_diff(straight_model, resumed_model) == 0.0
    for name in straight.named_params:
        a, b = straight.param_state(name), resumed.param_state(name)
        assert (a.exp_avg is None) == (b.exp_avg is None)
        if a.exp_avg is not None:
            assert torch.equal(a.exp_avg, b.exp_avg)


def test_from_torch_sgd_continues_torch_run() -> None:
    ref, ours = _model(), _model()
    ref_opt = torch.optim.SGD(ref.parameters(), lr=0.05, momentum=0.9, weight_decay=1e-3)
    _train([(ref, ref_opt)], 5)
    ours.load_state_dict(ref.state_dict())
    torch_copy = torch.optim.SGD(ours.parameters(), lr=0.05, momentum=0.9, weight_decay=1e-3)
    torch_copy.load_state_dict(ref_opt.state_dict())
    opt = BlockwiseSGD.from_optimizer(torch_copy, ours)
    assert opt.param_groups[0]["momentum"] == 0.9 and opt.step_count("0.weight") == 1
    _train([(ref, ref_opt), (ours, opt)], 20, seed=3)
    assert _max_diff(ref, ours) <= 1e-6


def test_a_dict_of_another_rule_is_refused_by_name() -> None:
    model = _model()
    lion = BlockwiseLion(model.named_parameters(), lr=1e-3)
    _train([(model, lion)], 1)
    sd = lion.state_dict()
    with pytest.raises(CheckpointError, match="'lion' update rule, this is BlockwiseSGD"):
        BlockwiseSGD(model.named_parameters(), lr=0.1, momentum=0.9).load_state_dict(sd)
    adamw = BlockwiseAdamW(model.named_parameters())
    _train([(model, adamw)], 1)
    with pytest.raises(CheckpointError, match="'adamw' update rule, this is BlockwiseLion"):
        BlockwiseLion(model.named_parameters()).load_state_dict(adamw.state_dict())
    with pytest.raises(TypeError, match="to_adamw_state_dict exports AdamW's state.*to_torch_state_dict"):
        lion.to_adamw_state_dict()


@pytest.mark.parametrize("fmt", ["fp32", "int8"])
@pytest.mark.parametrize("cls", [BlockwiseSGD, BlockwiseLion])
def test_a_plain_optimizer_refuses_the_dict_and_takes_the_export(cls: type, fmt: str) -> None:
    """A BlockwiseSGD/Lion dict (saved and loaded as a file) is refused by torch's SGD and by a plain Lion
    at load, before it could drop the momentum; ``to_torch_state_dict()`` loads into them, and the plain
    run continues the blockwise one (bit-equal in fp32, within int8's rounding of the buffer)."""
    plain_cls = torch.optim.SGD if cls is BlockwiseSGD else ReferenceLion
    kwargs = dict(momentum=0.9, weight_decay=1e-3) if cls is BlockwiseSGD else dict(weight_decay=0.1)
    model = _model()
    opt = cls(model.named_parameters(), lr=1e-3, state_format=fmt, min_8bit_numel=0, **kwargs)
    _train([(model, opt)], 5)
    buffer = io.BytesIO()
    torch.save(opt.state_dict(), buffer)
    buffer.seek(0)
    saved = torch.load(buffer, weights_only=True)
    plain_model = copy.deepcopy(model)
    plain = plain_cls(plain_model.parameters(), lr=1e-3, **kwargs)
    with pytest.raises(ValueError, match="different number of parameter groups"):
        plain.load_state_dict(saved)
    assert not plain.state  # nothing was loaded
    assert b"to_torch_state_dict()" in saved["param_groups"][-1]["baoc_refusal"]  # what the dict says it is
    cls(_model().named_parameters(), lr=1e-3, state_format=fmt, min_8bit_numel=0, **kwargs).load_state_dict(saved)

    exported = opt.to_torch_state_dict()
    plain.load_state_dict(exported)
    key = "momentum_buffer" if cls is BlockwiseSGD else "exp_avg"
    for name, p in zip(opt.named_params, plain_model.parameters()):
        assert torch.equal(plain.state[p][key], opt.param_state(name).exp_avg)
    _train([(model, opt), (plain_model, plain)], 5, seed=2)
    # int8: the buffers differ by its rounding; a Lion element whose sign flips moves 2 lr a step the other way
    bound = 0.0 if fmt == "fp32" else 1e-3 if cls is BlockwiseSGD else 5 * 2 * 1e-3
    assert _max_diff(model, plain_model) <= bound


def test_a_dict_of_another_rule_refuses_the_adamw_export() -> None:
    model = _model()
    sgd = BlockwiseSGD(model.named_parameters(), lr=0.1, momentum=0.9)
    _train([(model, sgd)], 1)
    with pytest.raises(CheckpointError, match="state dict of a BlockwiseSGD.*to_torch_state_dict"):
        export_adamw_state_dict(sgd.state_dict())
    assert set(BlockwiseAdamW(model.named_parameters()).to_torch_state_dict()) == {"state", "param_groups"}


@pytest.mark.parametrize("cls,fmt", [(BlockwiseSGD, "int8"), (BlockwiseLion, "bf16"), (BlockwiseLion, "fp32")])
def test_gradient_release_steps_exactly_as_step(cls: type, fmt: str) -> None:
    kwargs = dict(momentum=0.9) if cls is BlockwiseSGD else {}
    plain_model, released_model = _model(), _model()
    plain = cls(plain_model.named_parameters(), lr=1e-3, state_format=fmt, min_8bit_numel=0, **kwargs)
    released = cls(released_model.named_parameters(), lr=1e-3, state_format=fmt, min_8bit_numel=0, **kwargs)
    released.release_gradients()
    _train([(plain_model, plain), (released_model, released)], 6)
    assert _max_diff(plain_model, released_model) == 0.0
    assert all(p.grad is None for p in released_model.parameters())


@pytest.mark.parametrize("cls", [BlockwiseSGD, BlockwiseLion])
def test_bf16_weights_keep_small_updates_with_a_correction(cls: type) -> None:
    """bf16 weights at a small learning rate: without a correction most updates fall under half a
    bf16 ulp and are lost; with ecc16 the fp32 master weights move (the motivation, measured)."""
    kwargs = dict(momentum=0.9) if cls is BlockwiseSGD else {}
    lr = 1e-4 if cls is BlockwiseSGD else 2e-5
    runs = {}
    for correction in ("none", "ecc16"):
        model = _model(dtype=torch.bfloat16)
        runs[correction] = (model, cls(model.named_parameters(), lr=lr, weight_correction=correction, **kwargs))
    initial = {n: p.detach().float().clone() for n, p in runs["none"][0].named_parameters()}
    _train(list(runs.values()), 30)
    total = sum(t.numel() for t in initial.values())
    moved_none = sum(int((p.detach().float() != initial[n]).sum()) for n, p in runs["none"][0].named_parameters())
    masters = runs["ecc16"][1].master_weights()
    moved_ecc16 = sum(int((masters[n] != initial[n]).sum()) for n in initial)
    assert moved_ecc16 / total > 0.95, moved_ecc16 / total
    assert moved_none / total < 0.5 * moved_ecc16 / total, (moved_none / total, moved_ecc16 / total)
    assert runs["ecc16"][1].weight_correction_bytes() == 2 * total


def test_a_nonfinite_gradient_skips_the_parameter() -> None:
    model = _model()
    opt = BlockwiseSGD(model.named_parameters(), lr=0.05, momentum=0.9, state_format="int8", min_8bit_numel=0)
    _train([(model, opt)], 2)
    before = model[0].weight.detach().clone()
    state = opt.param_state("0.weight").exp_avg.clone()
    opt.zero_grad()
    model(torch.randn(4, 32)).sum().backward()
    model[0].weight.grad[0, 0] = float("nan")
    with pytest.warns(RuntimeWarning, match="BlockwiseSGD: non-finite gradient for '0.weight'"):
        opt.step()
    assert torch.equal(model[0].weight, before) and torch.equal(opt.param_state("0.weight").exp_avg, state)
    assert opt.nonfinite_counts == {"0.weight": 1}
    assert opt.step_count("0.bias") == 3 and opt.step_count("0.weight") == 2


@pytest.mark.parametrize("cls", [BlockwiseSGD, BlockwiseLion])
def test_copies_and_pickles_train_alike(cls: type) -> None:
    kwargs = dict(momentum=0.9) if cls is BlockwiseSGD else {}
    model = _model()
    opt = cls(model.named_parameters(), lr=1e-3, state_format="int8", min_8bit_numel=0, **kwargs)
    _train([(model, opt)], 3)
    model2, opt2 = copy.deepcopy((model, opt))
    model3, opt3 = pickle.loads(pickle.dumps((model, opt)))
    assert type(opt3) is cls
    _train([(model, opt), (model2, opt2), (model3, opt3)], 3)
    assert _max_diff(model, model2) == 0.0 and _max_diff(model, model3) == 0.0


def test_groups_without_momentum_hold_no_buffer() -> None:
    """As torch's SGD: a group with momentum 0 keeps no buffer whatever format is asked (per group,
    whichever way round the constructor's default and the group's value are), and equals torch."""
    cases = [(dict(momentum=0.9), {"momentum": 0.0}), ({}, {"momentum": 0.9}),
             (dict(momentum=0.9, state_format="int8", min_8bit_numel=0), {"momentum": 0.0})]
    for kwargs, first in cases:
        ref, ours = _model(), _model()
        torch_kwargs = {k: v for k, v in kwargs.items() if k == "momentum"}
        torch_opt = torch.optim.SGD([{"params": ref[0].parameters(), **first}, {"params": ref[2].parameters()}],
                                    lr=0.05, **torch_kwargs)
        opt = BlockwiseSGD([{"params": list(ours[0].parameters()), **first}, {"params": list(ours[2].parameters())}],
                           lr=0.05, **kwargs)
        _train([(ref, torch_opt), (ours, opt)], 20)
        formats = opt.formats()
        held = [f for name, f in formats.items() if name in ("0", "1")], [f for name, f in formats.items() if name in ("2", "3")]
        no_buffer, buffer = (held[0], held[1]) if first["momentum"] == 0.0 else (held[1], held[0])
        assert set(no_buffer) == {"none"} and "none" not in buffer, formats
        if "state_format" not in kwargs:
            assert _max_diff(ref, ours) <= 1e-6
        opt.set_formats({"0": "int8"} if first["momentum"] == 0.0 else {"2": "int8"})  # asked, and still none
        assert all(opt.formats()[n] == "none" for n in (("0", "1") if first["momentum"] == 0.0 else ("2", "3")))


def test_errors_name_the_problem_and_the_fix() -> None:
    params = list(_model().named_parameters())
    with pytest.raises(ValueError, match="Nesterov momentum requires a momentum and zero dampening"):
        BlockwiseSGD(params, lr=0.1, nesterov=True)
    with pytest.raises(ValueError, match=r"Unknown state_format 'nomomentum'; allowed: \['fp32', 'bf16', 'int8', 'none'\]"):
        BlockwiseLion(params, state_format="nomomentum")
    with pytest.raises(ValueError, match="Invalid betas\\[1\\]"):
        BlockwiseLion(params, betas=(0.9, 1.0))
    with pytest.raises(ValueError, match="Invalid lr"):
        BlockwiseSGD(params, lr=-1.0)
    opt = BlockwiseLion(params)
    with pytest.raises(ValueError, match="Unknown format of '0' 'int8_factored'"):
        opt.set_formats({"0": "int8_factored"})


def test_baoc_takes_the_momentum_optimizers_over() -> None:
    from lightning_baoc.optim.swap import convert_optimizer

    model = _model()
    own = BlockwiseSGD(model.named_parameters(), lr=0.1, momentum=0.9)
    assert convert_optimizer(own, model) is own  # kept as is, like a BlockwiseAdamW
    torch_sgd = torch.optim.SGD(model.parameters(), lr=0.1, momentum=0.9, nesterov=True, weight_decay=1e-4)
    new = convert_optimizer(torch_sgd, model)
    assert isinstance(new, BlockwiseSGD) and type(new).__name__ == "SGD"
    assert new.param_groups[0]["nesterov"] and new.param_groups[0]["weight_decay"] == 1e-4
    assert set(new.formats().values()) == {"fp32"}


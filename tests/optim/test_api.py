"""BlockwiseAdamW as a drop-in ``torch.optim.AdamW``.

- Every constructor argument of ``torch.optim.AdamW`` is accepted, in the same positions; the inputs
  torch rejects raise torch's error type (the cases of torch's own optimizer test-suite,
  ``torch.testing._internal.common_optimizers.optim_error_inputs_func_adamw``, are replicated
  here because that module needs a test-only package; the real list runs too when it imports).
- Options whose semantics BlockwiseAdamW does not implement are refused with a ``ValueError``
  naming them; performance hints are accepted and change nothing.
- ``copy.deepcopy`` gives an independent, working optimizer; pickling round-trips in a fresh process.
- The optimizers are built of parts they hold, not of stacked mixins: at most 3 project classes in
  their MRO (an alias installed in place of a user's optimizer included); no part refers back to the
  optimizer, so a dropped one frees its states at once.
"""

from __future__ import annotations

import copy
import inspect
import os
import pickle
import subprocess
import sys
import textwrap
import warnings
from pathlib import Path
from typing import Any, Callable

import pytest
import torch
from support import mlp
from torch import nn

from lightning_baoc import BlockwiseAdamW
from lightning_baoc.control.controller import convert_optimizer

REFUSED = ("amsgrad", "capturable", "differentiable")  # semantics BlockwiseAdamW does not implement


def _param(seed: int = 0, shape: tuple[int, ...] = (2, 3)) -> nn.Parameter:
    return nn.Parameter(torch.randn(*shape, generator=torch.Generator().manual_seed(seed)))


def _grads(n: int, shape: tuple[int, ...], seed: int = 1) -> list[torch.Tensor]:
    gen = torch.Generator().manual_seed(seed)
    return [torch.randn(*shape, generator=gen) for _ in range(n)]


# ---------------------------------------------------------------------------- signature


def test_signature_accepts_every_adamw_argument_in_the_same_position() -> None:
    torch_sig = inspect.signature(torch.optim.AdamW).parameters
    ours = inspect.signature(BlockwiseAdamW).parameters
    for name, param in torch_sig.items():
        assert name in ours, name
        assert ours[name].kind == param.kind, (name, ours[name].kind, param.kind)
        if name != "params":
            assert ours[name].default == param.default, (name, ours[name].default, param.default)
    positional = [n for n, p in torch_sig.items() if p.kind is inspect.Parameter.POSITIONAL_OR_KEYWORD]
    assert [n for n, p in ours.items() if p.kind is inspect.Parameter.POSITIONAL_OR_KEYWORD] == positional


def test_positional_arguments_mean_what_they_mean_for_torch() -> None:
    p, q = _param(), _param()
    ours = BlockwiseAdamW([p], 2e-2, (0.8, 0.95), 1e-6, 0.05, False)
    ref = torch.optim.AdamW([q], 2e-2, (0.8, 0.95), 1e-6, 0.05, False)
    for g in _grads(5, tuple(p.shape)):
        p.grad, q.grad = g.clone(), g.clone()
        ours.step()
        ref.step()
    assert ours.param_groups[0]["betas"] == (0.8, 0.95) and ours.param_groups[0]["eps"] == 1e-6
    assert (p - q).abs().max().item() <= 1e-6


@pytest.mark.parametrize("hints", [dict(foreach=True), dict(foreach=False), dict(fused=True), dict(fused=False, foreach=None)])
def test_performance_hints_are_accepted_and_change_nothing(hints: dict[str, Any]) -> None:
    p, q = _param(), _param()
    hinted = BlockwiseAdamW([p], lr=1e-2, **hints)
    plain = BlockwiseAdamW([q], lr=1e-2)
    for g in _grads(4, tuple(p.shape)):
        p.grad, q.grad = g.clone(), g.clone()
        hinted.step()
        plain.step()
    assert torch.equal(p, q)


@pytest.mark.parametrize("option", REFUSED)
def test_unimplemented_options_are_refused_by_name(option: str) -> None:
    with pytest.raises(ValueError, match=rf"{option}=True.*{option}=False"):
        BlockwiseAdamW([_param()], **{option: True})


@pytest.mark.parametrize("name", ["BlockwiseAdamW", "BlockwiseSGD", "BlockwiseLion"])
def test_the_optimizers_hold_parts_instead_of_stacking_mixins(name: str) -> None:
    import lightning_baoc
    from lightning_baoc.optim import swap

    cls = getattr(lightning_baoc, name)
    classes = [c for c in cls.__mro__ if c.__module__.startswith("lightning_baoc")]
    assert len(classes) <= 3, classes
    if name != "BlockwiseLion":  # the class the swap installs in place of torch's, named like it
        named = getattr(swap, name.removeprefix("Blockwise"))
        assert issubclass(named, cls) and len([c for c in named.__mro__ if c.__module__.startswith("lightning_baoc")]) <= 3
    opt = cls([("w", _param())], lr=1e-3)
    assert {type(getattr(opt, part)).__name__ for part in ("_pools", "_stepper", "_masters", "_release", "_codec")} == {
        "StatePools", "StepDispatcher", "MasterWeights", "ReleaseHooks", "CheckpointCodec"}
    assert opt._pools.records is opt._records is opt._stepper.records  # noqa: SLF001 - one records table
    assert opt._pools.placements is opt._placements and type(opt._placements).__name__ == "Placements"  # noqa: SLF001


def test_a_dropped_optimizer_frees_its_states_at_once() -> None:
    """No part refers back to the optimizer: dropping it frees its pools without waiting for the cycle
    collector (an optimizer replaced mid-run gives its device memory back at once)."""
    import gc
    import weakref

    model = nn.Linear(64, 64)
    opt = BlockwiseAdamW(model.named_parameters(), state_format="int8", min_8bit_numel=0)
    model(torch.randn(4, 64)).sum().backward()
    opt.step()
    opt.release_gradients()
    opt.release_gradients(False)
    alive = weakref.ref(opt), weakref.ref(opt.state_tensors()[0])
    gc.disable()
    try:
        del opt
        assert alive[0]() is None and alive[1]() is None
    finally:
        gc.enable()


# ---------------------------------------------------------------------------- torch's own inputs

# torch 2.13, torch/testing/_internal/common_optimizers.py: get_error_inputs_for_all_optims and
# optim_error_inputs_func_adam (which optim_error_inputs_func_adamw returns), CPU and CUDA cases.
# Each: (description, params factory or None for [one parameter], kwargs, torch's error type).
ERROR_INPUTS: list[tuple[str, Callable[[], Any] | None, dict[str, Any], type]] = [
    ("invalid param type", lambda: _param(), {}, TypeError),
    ("duplicate parameters in a group", lambda: [P1, P1], {}, UserWarning),
    ("duplicate parameters across groups", lambda: [{"params": P1}, {"params": P1}], {}, ValueError),
    ("Tensor lr must be 1-element", None, dict(lr=torch.tensor([0.001, 0.001])), ValueError),
    ("params with and without names", lambda: [("weight", P1), P2], {}, ValueError),
    ("groups with and without names", lambda: [{"params": [P1], "lr": 1e-2}, {"params": [("weight", P2)]}], {}, ValueError),
    ("beta1 should be in [0, 1)", None, dict(lr=1e-2, betas=(1.0, 0.0)), ValueError),
    ("weight_decay should be >= 0", None, dict(lr=1e-2, weight_decay=-1), ValueError),
    ("Tensor lr with foreach and not capturable", None, dict(lr=torch.tensor(0.001), foreach=True), ValueError),
    ("betas float and Tensor", None, dict(lr=1e-2, betas=(0.9, torch.tensor(0.99))), ValueError),
    ("betas Tensor and float", None, dict(lr=1e-2, betas=(torch.tensor(0.9), 0.99)), ValueError),
    ("Tensor betas with foreach", None, dict(lr=1e-2, betas=(torch.tensor(0.9), torch.tensor(0.99)), foreach=True), ValueError),
    ("fused and foreach together", None, dict(foreach=True, fused=True), RuntimeError),
    ("fused and differentiable", None, dict(fused=True, differentiable=True), RuntimeError),
]
P1, P2 = _param(1, (1, 1)), _param(2, (1, 1))


def _raises_like(cls: type, factory: Callable[[], Any] | None, kwargs: dict[str, Any], expected: type) -> str:
    params = factory() if factory is not None else [_param()]
    if expected is UserWarning:
        with pytest.warns(UserWarning, match="duplicate parameters"):
            cls(params, **kwargs)
        return ""
    with pytest.raises(expected) as info:
        cls(params, **kwargs)
    return str(info.value)


@pytest.mark.parametrize("desc, factory, kwargs, expected", ERROR_INPUTS, ids=[e[0] for e in ERROR_INPUTS])
def test_torch_error_inputs_raise_torchs_error_type(desc: str, factory: Any, kwargs: dict[str, Any], expected: type) -> None:
    _raises_like(torch.optim.AdamW, factory, kwargs, expected)  # the case really is an error for torch
    message = _raises_like(BlockwiseAdamW, factory, kwargs, expected)
    if kwargs:
        assert any(key in message for key in kwargs), (desc, message)  # ours names the argument


def test_duplicate_parameter_in_a_group_is_held_once() -> None:
    p = _param()
    with pytest.warns(UserWarning, match="duplicate parameters"):
        opt = BlockwiseAdamW([p, p], lr=1e-2)
    ref_p = _param()
    ref = BlockwiseAdamW([ref_p], lr=1e-2)
    p.grad, ref_p.grad = torch.ones_like(p), torch.ones_like(p)
    opt.step()
    ref.step()
    assert list(opt.named_params) == ["0"] and torch.equal(p, ref_p)  # one update, not two


# torch 2.13 optim_inputs_func_adamw on CPU (plus its accelerator configs, which construct on CPU).
VALID_INPUTS: list[dict[str, Any]] = [
    {},
    {"lr": 0.01},
    {"weight_decay": 0.1},
    {"weight_decay": 0.1, "maximize": True},
    {"weight_decay": 0.1, "amsgrad": True},
    {"capturable": True},
    {"weight_decay": 0.1, "amsgrad": True, "capturable": True},
    {"lr": torch.tensor(0.001), "amsgrad": True, "capturable": True},
    {"lr": torch.tensor(0.001), "betas": (torch.tensor([[[0.9]]]), torch.tensor([[0.99]])), "amsgrad": True, "capturable": True},
    {"lr": torch.tensor(0.001), "betas": (torch.tensor(0.9), torch.tensor(0.99)), "amsgrad": False, "capturable": True},
    {"lr": torch.tensor(0.01)},
    {"lr": torch.tensor(0.01), "betas": (torch.tensor(0.8), torch.tensor(0.9))},
]


@pytest.mark.parametrize("kwargs", VALID_INPUTS, ids=[str(sorted(k)) for k in VALID_INPUTS])
def test_torch_valid_inputs_train_like_torch_or_are_refused_by_name(kwargs: dict[str, Any]) -> None:
    p, q = _param(), _param()
    ref = torch.optim.AdamW([q], **kwargs)
    refused = [k for k in REFUSED if kwargs.get(k)]
    if refused:
        with pytest.raises(ValueError, match=rf"{refused[0]}=True"):
            BlockwiseAdamW([p], **kwargs)
        return
    ours = BlockwiseAdamW([p], **kwargs)
    for g in _grads(5, tuple(p.shape)):
        p.grad, q.grad = g.clone(), g.clone()
        ours.step()
        ref.step()
    assert (p - q).abs().max().item() <= 1e-6


#: torch's own optimizer test inputs, checked in a child process: importing ``torch.testing._internal`` calls
#: ``torch.backends.disable_global_flags()``, after which every Lightning ``Trainer`` in that process fails
#: (it sets cuDNN's flags); a test must leave the process as it found it
_TORCH_OWN_INPUTS = """
import pytest, torch
from lightning_baoc import BlockwiseAdamW
from torch.testing._internal import common_optimizers as co
REFUSED = {refused!r}
param = lambda: torch.nn.Parameter(torch.zeros(3))
checked = 0
for case in co.optim_error_inputs_func_adamw("cpu", torch.float32):
    inp = case.optimizer_error_input
    params = inp.params if inp.params is not None else [param()]
    for cls in (torch.optim.AdamW, BlockwiseAdamW):
        if issubclass(case.error_type, Warning):
            with pytest.warns(case.error_type):
                cls(params, **inp.kwargs)
        else:
            with pytest.raises(case.error_type):
                cls(params, **inp.kwargs)
        checked += 1
for inp in co.optim_inputs_func_adamw("cpu", torch.float32):
    refused = [k for k in REFUSED if inp.kwargs.get(k)]
    if refused:
        with pytest.raises(ValueError, match=refused[0]):
            BlockwiseAdamW([param()], **inp.kwargs)
    else:
        BlockwiseAdamW([param()], **inp.kwargs)
    checked += 1
print("checked", checked)
"""


@pytest.mark.slow  # a child process importing torch's test suite; the inputs of the API are held by default in this file
def test_torch_own_optimizer_inputs_when_available() -> None:
    pytest.importorskip("expecttest")  # torch's test helpers need it
    code = _TORCH_OWN_INPUTS.format(refused=sorted(REFUSED))
    done = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=300,
                          cwd=Path(__file__).resolve().parents[2])
    assert done.returncode == 0, done.stderr[-3000:]
    assert int(done.stdout.split()[-1]) >= 10  # torch's cases ran
    assert not torch.backends.flags_frozen()  # this process's flags untouched


# ---------------------------------------------------------------------------- from_optimizer hints


@pytest.mark.parametrize(
    "hints, named",
    [(dict(fused=True), "fused=True"), (dict(foreach=True), "foreach=True"), (dict(foreach=False), "foreach=False")],
)
def test_from_optimizer_says_once_that_hints_are_not_used(hints: dict[str, Any], named: str) -> None:
    model = mlp((8, 8, 2))
    adamw = torch.optim.AdamW([{"params": [model[0].weight]}, {"params": [model[0].bias, model[-1].weight, model[-1].bias]}], **hints)
    with pytest.warns(UserWarning, match=rf"{named}.*(own kernels|not needed)") as record:
        BlockwiseAdamW.from_optimizer(adamw, model)
    assert len([w for w in record if named in str(w.message)]) == 1  # once, not once per group
    with pytest.warns(UserWarning, match=named):
        convert_optimizer(torch.optim.AdamW(model.parameters(), **hints), model)


def test_from_optimizer_is_silent_without_hints() -> None:
    model = mlp((8, 8, 2))
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        BlockwiseAdamW.from_optimizer(torch.optim.AdamW(model.parameters()), model)


@pytest.mark.parametrize("option", ["capturable", "differentiable"])
def test_from_optimizer_refuses_unimplemented_options_by_name(option: str) -> None:
    model = mlp((8, 8, 2))
    adamw = torch.optim.AdamW(model.parameters(), **{option: True})
    with pytest.raises(ValueError, match=rf"{option}=True"):
        BlockwiseAdamW.from_optimizer(adamw, model)


# ---------------------------------------------------------------------------- deepcopy and pickle


def _mixed(model: nn.Module) -> BlockwiseAdamW:
    opt = BlockwiseAdamW(model.named_parameters(), lr=3e-3, min_8bit_numel=0)
    _step(model, opt, seed=0)
    opt.set_formats({"0": "int8", "3": "bf16", "1": "nomomentum"})
    _step(model, opt, seed=1)
    return opt


def _step(model: nn.Module, opt: torch.optim.Optimizer, seed: int) -> None:
    gen = torch.Generator().manual_seed(seed)
    opt.zero_grad()
    model(torch.randn(16, 32, generator=gen)).square().mean().backward()
    opt.step()


def _pointers(opt: BlockwiseAdamW) -> set[int]:
    return {t.untyped_storage().data_ptr() for t in opt.state_tensors()}


def test_deepcopy_is_an_independent_working_optimizer() -> None:
    model = mlp((32, 64, 64, 8))
    opt = _mixed(model)
    model2, opt2 = copy.deepcopy((model, opt))
    assert opt2.formats() == opt.formats() and opt2.state_dict()["state"].keys() == opt.state_dict()["state"].keys()
    assert _pointers(opt2).isdisjoint(_pointers(opt))  # its own pools
    assert all(p2 is model2.get_parameter(n) for n, p2 in opt2.named_params.items())  # mapped through the memo
    for seed in (2, 3, 4):  # the copy steps exactly as the original
        _step(model, opt, seed)
        _step(model2, opt2, seed)
    for (name, a), b in zip(model.named_parameters(), model2.parameters()):
        assert torch.equal(a, b), name
    opt2.set_formats({"0": "fp32", "3": "int8_factored"})  # failed before: no attribute '_names'
    _step(model2, opt2, 5)
    assert opt.formats()["0.weight"] == "int8" and opt2.formats()["0.weight"] == "fp32"
    assert not torch.equal(model[0].weight, model2[0].weight)  # the copy trained alone


def test_deepcopy_does_not_keep_the_schedulers_step_wrapper() -> None:
    model = mlp((32, 64, 8))
    opt = _mixed(model)
    torch.optim.lr_scheduler.StepLR(opt, 5)  # wraps opt.step on the instance
    model2, opt2 = copy.deepcopy((model, opt))
    before = model[0].weight.detach().clone()
    _step(model2, opt2, 7)
    assert torch.equal(model[0].weight, before)  # stepping the copy never steps the original


SCRIPT = """
import pickle, sys, torch
with open(sys.argv[1], "rb") as f:
    model, opt = pickle.load(f)
assert type(opt).__name__ == "AdamW", type(opt).__name__
gen = torch.Generator().manual_seed(11)
opt.zero_grad()
model(torch.randn(16, 32, generator=gen)).square().mean().backward()
opt.step()
opt.set_formats({"0": "int8_factored"})
torch.save({n: p.detach() for n, p in model.named_parameters()}, sys.argv[2])
"""


@pytest.mark.slow  # a fresh process; pickling in this process is held by default
def test_pickle_round_trips_in_a_fresh_process(tmp_path: Path) -> None:
    model = mlp((32, 64, 8))
    adamw = torch.optim.AdamW(model.parameters(), lr=3e-3)
    opt = convert_optimizer(adamw, model, min_8bit_numel=0)
    _step(model, opt, 0)
    opt.set_formats({"0": "int8", "3": "bf16"})
    _step(model, opt, 1)
    assert type(opt).__name__ == "AdamW" and type(opt).__module__ == "lightning_baoc.optim.swap"
    assert pickle.loads(pickle.dumps(type(opt))) is type(opt)  # the class pickles by reference
    (tmp_path / "opt.pkl").write_bytes(pickle.dumps((model, opt)))
    script = tmp_path / "resume.py"
    script.write_text(textwrap.dedent(SCRIPT))
    out = tmp_path / "params.pt"
    root = str(Path(__file__).resolve().parents[2])  # the fresh process imports this checkout's package
    env = {**os.environ, "PYTHONPATH": os.pathsep.join(filter(None, [root, os.environ.get("PYTHONPATH", "")]))}
    subprocess.run([sys.executable, str(script), str(tmp_path / "opt.pkl"), str(out)], check=True, timeout=120, env=env)
    _step(model, opt, 11)
    theirs = torch.load(out, weights_only=True)
    for name, p in model.named_parameters():
        assert torch.equal(theirs[name], p.detach()), name


def test_state_dict_hooks_run_as_in_torch() -> None:
    model = mlp((32, 64, 8))
    opt = _mixed(model)
    calls: list[str] = []
    opt.register_state_dict_pre_hook(lambda o: calls.append("save-pre"))
    opt.register_state_dict_post_hook(lambda o, sd: {**sd, "extra": 7})
    opt.register_load_state_dict_pre_hook(lambda o, sd: {k: v for k, v in sd.items() if k != "extra"})
    opt.register_load_state_dict_post_hook(lambda o: calls.append("load-post"))
    sd = opt.state_dict()
    assert sd["extra"] == 7
    opt.load_state_dict(sd)
    assert calls == ["save-pre", "load-post"]


def test_torch_distributed_checkpoint_does_not_step_a_trained_optimizer() -> None:
    """torch.distributed.checkpoint's state-dict functions step an optimizer whose ``state`` is empty
    (with zero gradients, to create states); ``state`` names each parameter's format, so a trained
    BlockwiseAdamW keeps its step counts and moments."""
    from torch.distributed.checkpoint.state_dict import get_optimizer_state_dict

    model = nn.Linear(64, 64)
    opt = BlockwiseAdamW(model.named_parameters(), state_format="int8", min_8bit_numel=0)
    model(torch.randn(2, 64)).sum().backward()
    opt.step()
    opt.zero_grad()
    momentum = opt.param_state("weight").exp_avg.clone()
    assert opt.state[model.weight] == {"format": "int8"} and len(opt.state) == 2
    get_optimizer_state_dict(model, opt)
    assert opt.step_count("weight") == 1 and torch.equal(opt.param_state("weight").exp_avg, momentum)
    opt.set_formats({"weight": "bf16"})
    assert opt.state[model.weight] == {"format": "bf16"}

"""Gradient release (``lightning_baoc/optim/gradient_release.py``, ``lightning_baoc.GradientRelease``).

- Each parameter steps in backward exactly as ``step()`` would: bit-equal on the compiled and the
  eager step, fp32, int8, factored and bf16 weights with a correction; gradients are gone after
  backward.
- Gradient accumulation is refused before anything steps twice; a non-finite gradient is skipped and
  counted; release turns off.
- Under Lightning, ``GradientRelease`` trains like the same run without release (bf16-true, a
  correction) and refuses accumulation and clipping at setup, naming the setting (BAOC with release:
  ``tests/integrations/test_callback_release.py``).
- The part alone (:class:`~lightning_baoc.optim.gradient_release.ReleaseHooks`, over a records table
  and a ``step_one`` made here): each parameter that requires a gradient is handed to ``step_one`` once
  per window, observers first, in order, and its gradient freed; a second gradient in one window is
  refused; disabled, it holds no hook and no ``step_one`` (sharded parameters refused:
  ``tests/optim/test_sharding.py``).
"""

from __future__ import annotations

import copy

import warnings

import lightning.pytorch as pl
import pytest
import torch
from torch import nn

from lightning_baoc import BlockwiseAdamW, GradientRelease
from lightning_baoc.optim.gradient_release import GradientAccumulationError, ReleaseHooks
from lightning_baoc.optim.pools import Record

CASES = [("int8", torch.float32, "none"), ("fp32", torch.float32, "none"), ("int8_factored", torch.float32, "none"),
         ("bf16", torch.bfloat16, "ecc8"), ("int8", torch.bfloat16, "ecc16")]


def _run(release: bool, policy: str, fmt: str, dtype: torch.dtype, correction: str, steps: int = 8):  # type: ignore[no-untyped-def]
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(64, 64), nn.GELU(), nn.Linear(64, 8)).to(dtype)
    opt = BlockwiseAdamW(model.named_parameters(), lr=1e-3, state_format=fmt, min_8bit_numel=0, kernels=policy,
                         weight_correction=correction)
    if release:
        opt.release_gradients()
    gen = torch.Generator().manual_seed(1)
    for _ in range(steps):
        opt.zero_grad()
        model(torch.randn(16, 64, generator=gen).to(dtype)).float().square().mean().backward()
        if release:
            assert all(p.grad is None for p in model.parameters())
        opt.step()
    return model, opt


@pytest.mark.parametrize("policy", ["compiled", "eager"])
@pytest.mark.parametrize("fmt,dtype,correction", CASES, ids=[f"{c[0]}-{str(c[1])[6:]}-{c[2]}" for c in CASES])
def test_release_steps_exactly_as_step(policy: str, fmt: str, dtype: torch.dtype, correction: str) -> None:
    plain, plain_opt = _run(False, policy, fmt, dtype, correction)
    released, released_opt = _run(True, policy, fmt, dtype, correction)
    for a, b in zip(plain.parameters(), released.parameters()):
        assert torch.equal(a, b)
    for (ra, rb) in zip(plain_opt._records.values(), released_opt._records.values()):  # noqa: SLF001
        assert torch.equal(ra.counts, rb.counts)
        for key in ra.views:
            assert torch.equal(ra.views[key], rb.views[key]), (ra.name, key)


def test_accumulation_is_refused_before_a_second_step() -> None:
    model, opt = _run(True, "compiled", "int8", torch.float32, "none", steps=1)
    before = [p.detach().clone() for p in model.parameters()]
    model(torch.randn(4, 64)).square().mean().backward()  # the first backward of a window: steps
    stepped = [p.detach().clone() for p in model.parameters()]
    assert not all(torch.equal(a, b) for a, b in zip(before, stepped))
    with pytest.raises(GradientAccumulationError, match="second gradient before step.*accumulate_grad_batches=1"):
        model(torch.randn(4, 64)).square().mean().backward()
    # the refusal comes before the parameter steps again
    assert torch.equal(model[2].bias, stepped[-1])
    opt.zero_grad()
    opt.step()  # a new window
    model(torch.randn(4, 64)).square().mean().backward()


def test_a_nonfinite_gradient_is_skipped_and_release_turns_off() -> None:
    torch.manual_seed(0)
    w = nn.Parameter(torch.randn(32, 32))
    opt = BlockwiseAdamW([("w", w)], state_format="int8", min_8bit_numel=0)
    opt.release_gradients()
    start = w.detach().clone()
    with pytest.warns(RuntimeWarning, match="non-finite gradient for 'w'"):
        (w * torch.full_like(w, float("nan"))).sum().backward()
    assert torch.equal(w, start) and opt.nonfinite_counts == {"w": 1} and w.grad is None
    opt.step()
    opt.release_gradients(False)
    assert not opt.releases_gradients
    w.square().sum().backward()
    assert w.grad is not None  # kept for step()


class _Tiny(pl.LightningModule):
    def __init__(self, release: bool) -> None:
        super().__init__()
        torch.manual_seed(0)
        self.net = nn.Sequential(nn.Linear(32, 32), nn.GELU(), nn.Linear(32, 4))
        self.release = release

    def training_step(self, batch, batch_idx):  # type: ignore[no-untyped-def]
        x, y = batch
        return nn.functional.cross_entropy(self.net(x).float(), y)

    def configure_optimizers(self):  # type: ignore[no-untyped-def]
        return BlockwiseAdamW(self.net.named_parameters(), lr=1e-3, state_format="int8", min_8bit_numel=0,
                              weight_correction="ecc8")

    def train_dataloader(self):  # type: ignore[no-untyped-def]
        gen = torch.Generator().manual_seed(2)
        data = torch.utils.data.TensorDataset(torch.randn(64, 32, generator=gen), torch.randint(0, 4, (64,), generator=gen))
        return torch.utils.data.DataLoader(data, batch_size=8)


def _trainer(tmp_path, callbacks, **kwargs):  # type: ignore[no-untyped-def]
    return pl.Trainer(accelerator="cpu", devices=1, max_epochs=2, precision="bf16-true", callbacks=callbacks,
                      logger=False, enable_checkpointing=False, enable_progress_bar=False, enable_model_summary=False,
                      default_root_dir=tmp_path, **kwargs)


def test_lightning_release_trains_like_the_plain_run(tmp_path) -> None:  # type: ignore[no-untyped-def]
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        plain, released = _Tiny(False), _Tiny(True)
        _trainer(tmp_path, []).fit(plain)
        _trainer(tmp_path, [GradientRelease()]).fit(released)
    assert plain.net[0].weight.dtype == torch.bfloat16
    for a, b in zip(plain.parameters(), released.parameters()):
        assert torch.equal(a, b)


@pytest.mark.parametrize(
    "kwargs,callbacks,match",
    [
        ({"accumulate_grad_batches": 2}, [], "accumulate_grad_batches=2"),
        ({"gradient_clip_val": 1.0}, [], "gradient_clip_val=1.0"),
        ({}, [pl.callbacks.GradientAccumulationScheduler({0: 1, 1: 2})],
         r"GradientAccumulationScheduler\(scheduling=\{0: 1, 1: 2\}\): release steps every micro-batch"),
    ],
    ids=["accumulation", "clipping", "scheduled-accumulation"],
)
def test_lightning_refuses_what_release_cannot_do(tmp_path, kwargs, callbacks, match) -> None:  # type: ignore[no-untyped-def]
    with pytest.raises(ValueError, match=match):
        _trainer(tmp_path, [GradientRelease(), *callbacks], **kwargs).fit(_Tiny(True))


class _ClipsItself(_Tiny):
    def configure_gradient_clipping(self, optimizer, gradient_clip_val=None, gradient_clip_algorithm=None):  # type: ignore[no-untyped-def]
        torch.nn.utils.clip_grad_norm_(self.parameters(), 0.5)


def test_lightning_refuses_clipping_in_configure_gradient_clipping_before_any_step(tmp_path) -> None:  # type: ignore[no-untyped-def]
    """An overridden ``configure_gradient_clipping`` passed the setup check and clipped nothing (the gradients
    were stepped and freed in backward); and a scheduler's accumulation passed it and stepped the window's
    first micro-batch before failing at epoch 1. Both are refused at setup now, before the first step."""
    model = _ClipsItself(True)
    start = [p.detach().clone() for p in model.parameters()]
    with pytest.raises(ValueError, match="_ClipsItself.configure_gradient_clipping overridden: clipping runs after"):
        _trainer(tmp_path, [GradientRelease()]).fit(model)
    assert all(torch.equal(a, p) for a, p in zip(start, model.parameters()))
    scheduled = _Tiny(True)
    start = [p.detach().clone() for p in scheduled.parameters()]
    with pytest.raises(ValueError, match="GradientAccumulationScheduler"):
        _trainer(tmp_path, [GradientRelease(), pl.callbacks.GradientAccumulationScheduler({1: 2})]).fit(scheduled)
    assert all(torch.equal(a, p) for a, p in zip(start, scheduled.parameters()))


def test_a_group_added_while_release_is_on_is_released() -> None:
    """``add_param_group`` after ``release_gradients()`` (``BackboneFinetuning`` unfreezing a backbone): the new
    parameters' gradients stayed alive until step(); now they step in backward and are freed, as the others."""
    torch.manual_seed(0)
    head, backbone = nn.Linear(16, 4), nn.Linear(16, 16)
    opt = BlockwiseAdamW([{"params": list(head.parameters())}], lr=1e-3)
    opt.release_gradients()
    opt.add_param_group({"params": list(backbone.parameters()), "lr": 1e-4})
    twin_head, twin_backbone = copy.deepcopy(head), copy.deepcopy(backbone)
    twin = BlockwiseAdamW([{"params": list(twin_head.parameters())}, {"params": list(twin_backbone.parameters()), "lr": 1e-4}],
                          lr=1e-3)
    x = torch.randn(8, 16, generator=torch.Generator().manual_seed(1))
    for _ in range(3):
        head(backbone(x)).square().mean().backward()
        assert all(p.grad is None for p in backbone.parameters())  # stepped and freed in backward
        opt.step()
        twin_head(twin_backbone(x)).square().mean().backward()
        twin.step()
        twin.zero_grad()
    for a, b in zip([*head.parameters(), *backbone.parameters()], [*twin_head.parameters(), *twin_backbone.parameters()]):
        assert torch.equal(a, b)
    opt.release_gradients(False)
    opt.add_param_group({"params": [nn.Parameter(torch.ones(3))]})  # release off: kept for step()
    assert not opt.releases_gradients



def test_copies_release_on_their_own_parameters() -> None:
    """A deepcopy or an unpickled copy releases on its own parameters, and turning release off in
    the copy leaves the original's hooks in place."""
    import copy
    import pickle

    model, opt = _run(True, "compiled", "int8", torch.bfloat16, "ecc8", steps=1)
    for model2, opt2 in (copy.deepcopy((model, opt)), pickle.loads(pickle.dumps((model, opt)))):
        assert opt2.releases_gradients and opt2.weight_corrections == opt.weight_corrections
        model2(torch.randn(4, 64).to(torch.bfloat16)).float().square().mean().backward()
        assert all(p.grad is None for p in model2.parameters())
        assert opt2.step_count("0.weight") == 2 and opt.step_count("0.weight") == 1
        opt2.release_gradients(False)
    model(torch.randn(4, 64).to(torch.bfloat16)).float().square().mean().backward()
    assert all(p.grad is None for p in model.parameters()) and opt.step_count("0.weight") == 2


# ---------------------------------------------------------------------------- the part alone


def _part() -> tuple[nn.Linear, ReleaseHooks, list[str]]:
    layer = nn.Linear(4, 3)
    layer.bias.requires_grad_(False)
    records = {p: Record(name=name, group=0) for name, p in layer.named_parameters()}
    return layer, ReleaseHooks(records), []


def test_the_part_hands_each_gradient_to_step_one_once_per_window() -> None:
    layer, release, seen = _part()
    release.add_observer(lambda p: seen.append(f"first {p.grad is not None}"))
    handle = release.add_observer(lambda p: seen.append("second"))
    release.enable(layer.parameters(), lambda p: seen.append(f"step {p.grad.shape[0]}"))
    assert release.enabled and len(release.handles) == 1  # the bias requires no gradient: no hook
    layer(torch.randn(2, 4)).sum().backward()
    assert seen == ["first True", "second", "step 3"] and layer.weight.grad is None
    assert release.released == {layer.weight}
    with pytest.raises(GradientAccumulationError, match="'weight' received a second gradient before step"):
        layer(torch.randn(2, 4)).sum().backward()
    release.new_window()
    handle.remove()
    layer.weight.grad = None
    layer(torch.randn(2, 4)).sum().backward()
    assert seen[-2:] == ["first True", "step 3"]
    release.disable()
    assert not release.enabled and release.handles == [] and release._step_one is None  # noqa: SLF001
    layer(torch.randn(2, 4)).sum().backward()
    assert layer.weight.grad is not None  # no hook: the gradient stays
    with pytest.raises(TypeError, match="observer must be callable"):
        release.add_observer(3)  # type: ignore[arg-type]


class _Shared(nn.Module):
    """A block used twice, each use under reentrant activation checkpointing, then a head."""

    def __init__(self, plain_use_last: bool = False) -> None:
        super().__init__()
        torch.manual_seed(0)
        self.block, self.head = nn.Linear(16, 16), nn.Linear(16, 4)
        self.plain_use_last = plain_use_last

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        from torch.utils.checkpoint import checkpoint

        h = checkpoint(self.block, x, use_reentrant=True)
        if self.plain_use_last:
            return self.head(self.block(h))  # its plain use's gradient arrives before the checkpointed one's
        return self.head(checkpoint(self.block, h, use_reentrant=True))


def test_reentrant_checkpointing_over_a_module_used_twice_steps_on_the_whole_gradient() -> None:
    """The shared block stepped on the gradient of one use, then ``GradientAccumulationError`` blamed an
    accumulation that never happened. Now its gradient waits inside reentrant checkpointing for ``step()``: the
    run with release equals the run without, to the bit; and the head is still released in backward."""
    released, plain = _Shared(), _Shared()
    opt = BlockwiseAdamW(released.named_parameters(), lr=1e-2)
    ref = BlockwiseAdamW(plain.named_parameters(), lr=1e-2)
    opt.release_gradients()
    seen: list[str] = []
    opt.add_gradient_observer(lambda p: seen.append(opt.param_name(p)))
    x = torch.randn(8, 16, generator=torch.Generator().manual_seed(1), requires_grad=True)
    for _ in range(3):
        released(x).square().mean().backward()
        assert released.head.weight.grad is None and released.block.weight.grad is not None
        opt.step()
        plain(x).square().mean().backward()
        ref.step()
        ref.zero_grad()
    for a, b in zip(released.parameters(), plain.parameters()):
        assert torch.equal(a, b)
    assert seen.count("block.weight") == 3 and seen.count("head.weight") == 3  # observed once a step, whole


def test_a_part_from_reentrant_checkpointing_after_the_parameter_stepped_is_refused_naming_it() -> None:
    model = _Shared(plain_use_last=True)
    opt = BlockwiseAdamW(model.named_parameters(), lr=1e-2)
    opt.release_gradients()
    x = torch.randn(8, 16, generator=torch.Generator().manual_seed(1), requires_grad=True)
    with pytest.raises(GradientAccumulationError, match=r"'block\.(weight|bias)' received a part of its gradient from "
                                                        r"inside reentrant activation checkpointing.*use_reentrant=False"):
        model(x).square().mean().backward()

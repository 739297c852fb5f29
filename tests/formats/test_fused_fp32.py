"""The fp32 step through torch's fused AdamW kernel against the foreach reference, and its fallbacks.

``lightning_baoc.formats.fused_adam`` runs the ``fp32`` and ``offload`` updates through
``torch._fused_adamw_`` where it can and through ``foreach_dense_fp32`` (the reference) elsewhere.
Here: the two agree within a few ulps after 1 and 50 steps; every case the kernel cannot serve takes
the reference and gives its results bit for bit; BlockwiseAdamW equals ``torch.optim.AdamW(fused=True)``
bit for bit; the step allocates no full-size temporary.
"""

from __future__ import annotations

import pytest
import torch
from support import one_thread, peak_above_start  # noqa: F401 - one_thread applies to the module
from torch import Tensor, nn

from lightning_baoc import FORMATS, BlockwiseAdamW, kernels
from lightning_baoc.formats import StepHyper, StepItem, fused_adam
from lightning_baoc.formats.adam_math import foreach_dense_fp32
from lightning_baoc.formats.fused_adam import fused_dense_fp32, split_fused
from lightning_baoc.formats.offload import host_batches, host_update

#: Largest distance allowed between the fused and the reference step, in ulps of the larger of the
#: element's magnitude and the tensor's RMS (an element that crossed zero is measured at the
#: tensor's scale, where its rounding happened). Twice the largest measured over the cases below
#: after 1 and after 50 steps: parameters 4, momentum 2 (Adam's L2 decay), second moment 4. The two
#: paths order the same fp32 operations differently (the kernel multiplies lr / bc1 into m before
#: dividing, fuses the lerp), so they round differently in the last bit.
MAX_ULPS = 8.0
CPU = torch.device("cpu")

CASES = {
    "adamw": {"weight_decay": 0.1},
    "no decay": {"weight_decay": 0.0},
    "maximize": {"weight_decay": 0.1, "maximize": True},
    "adam l2": {"weight_decay": 0.1, "decoupled_weight_decay": False},
}
SHAPES = [(1023,), (5,), (37, 129), (1024, 1024)]


def ulps(a: Tensor, b: Tensor) -> float:
    """Largest ``|a - b|`` in ulps of ``max(|a|, |b|, rms(a))``, element by element (fp32)."""
    scale = torch.maximum(torch.maximum(a.abs(), b.abs()), a.square().mean().sqrt())
    spacing = torch.nextafter(scale, torch.full_like(scale, float("inf"))) - scale
    return float(((a - b).abs() / spacing).max()) if a.numel() else 0.0


def _hyper(**kwargs: object) -> StepHyper:
    base = {"lr": 1e-2, "beta1": 0.9, "beta2": 0.999, "eps": 1e-8, "weight_decay": 0.0}
    base.update(kwargs)
    return StepHyper(**base)  # type: ignore[arg-type]


def _items(shapes: list[tuple[int, ...]], dtype: torch.dtype = torch.float32, seed: int = 0) -> list[StepItem]:
    gen = torch.Generator().manual_seed(seed)
    items = []
    for shape in shapes:
        n = int(torch.Size(shape).numel())
        p = torch.randn(shape, generator=gen).to(dtype)
        views = {"exp_avg": torch.zeros(n), "exp_avg_sq": torch.zeros(n)}
        items.append(StepItem(p, torch.zeros(shape, dtype=dtype), views, 1.0, 1.0, None))
    return items


def _set_step(items: list[StepItem], hyper: StepHyper, t: int, gen: torch.Generator, t_m: int | None = None) -> None:
    """Fresh gradients and the corrections of step ``t`` (the momentum's of step ``t_m``)."""
    t_m = t if t_m is None else t_m
    for it in items:
        it.grad.copy_(torch.randn(it.grad.shape, generator=gen) * (1.0 + 0.1 * t))
        it.bias_correction1 = 1.0 - hyper.beta1**t_m
        it.bias_correction2 = 1.0 - hyper.beta2**t
        it.step_count = t if t_m == t else None


def _clone(items: list[StepItem]) -> list[StepItem]:
    return [
        StepItem(it.param.clone(), it.grad.clone(), {k: v.clone() for k, v in it.views.items()},
                 it.bias_correction1, it.bias_correction2, it.step_count)
        for it in items
    ]


def _run(items: list[StepItem], hyper: StepHyper, steps: int, update, m_younger_by: int = 0) -> None:  # type: ignore[no-untyped-def]
    """``steps`` steps of ``update``; the momentum counts ``m_younger_by`` steps fewer."""
    gen = torch.Generator().manual_seed(1)
    for t in range(1 + m_younger_by, steps + 1 + m_younger_by):
        _set_step(items, hyper, t, gen, t - m_younger_by)
        update(items, hyper, "exp_avg", "exp_avg_sq")


def _distances(a: list[StepItem], b: list[StepItem]) -> tuple[float, float, float]:
    return (
        max(ulps(x.param.float(), y.param.float()) for x, y in zip(a, b)),
        max(ulps(x.views["exp_avg"], y.views["exp_avg"]) for x, y in zip(a, b)),
        max(ulps(x.views["exp_avg_sq"], y.views["exp_avg_sq"]) for x, y in zip(a, b)),
    )


def _bit_equal(a: list[StepItem], b: list[StepItem]) -> bool:
    return all(
        torch.equal(x.param, y.param) and all(torch.equal(x.views[k], y.views[k]) for k in x.views)
        for x, y in zip(a, b)
    )


@pytest.mark.parametrize("steps", [1, 50])
@pytest.mark.parametrize("case", list(CASES))
def test_fused_step_is_within_ulps_of_the_foreach_reference(case: str, steps: int) -> None:
    hyper = _hyper(**CASES[case])
    fused = _items(SHAPES)
    reference = _clone(fused)
    launched: list[int] = []

    def spied(items, hyper, m_key, v_key):  # type: ignore[no-untyped-def]
        chosen, rest = split_fused(items, hyper, m_key, v_key)
        launched.append(len(chosen))
        assert not rest
        fused_dense_fp32(items, hyper, m_key, v_key)

    _run(fused, hyper, steps, spied)
    _run(reference, hyper, steps, foreach_dense_fp32)
    assert launched == [len(SHAPES)] * steps  # every item, one launch per step
    p, m, v = _distances(fused, reference)
    print(f"{case}, {steps} steps: ulps p {p}, m {m}, v {v}")
    assert max(p, m, v) <= MAX_ULPS, (case, steps, p, m, v)


@pytest.mark.parametrize("case", ["adamw", "maximize"])
def test_bf16_parameters_keep_the_working_copy_step(case: str) -> None:
    hyper = _hyper(**CASES[case])
    fused = _items([(37, 129), (1023,)], dtype=torch.bfloat16)
    reference = _clone(fused)
    _run(fused, hyper, 5, fused_dense_fp32)
    _run(reference, hyper, 5, foreach_dense_fp32)
    assert split_fused(fused, hyper, "exp_avg", "exp_avg_sq")[0] == []
    assert _bit_equal(fused, reference)


def test_a_recreated_momentum_keeps_the_reference_step() -> None:
    """A momentum three steps younger than the second moment: two corrections from two counts."""
    hyper = _hyper(weight_decay=0.1)
    fused = _items([(37, 129), (1024,)])
    reference = _clone(fused)
    _run(fused, hyper, 10, fused_dense_fp32, m_younger_by=3)
    _run(reference, hyper, 10, foreach_dense_fp32, m_younger_by=3)
    assert all(it.step_count is None for it in fused)
    assert _bit_equal(fused, reference)
    # a count that does not give the item's corrections is not trusted either
    item = _items([(8,)])[0]
    item.bias_correction1, item.bias_correction2, item.step_count = 1 - 0.9**2, 1 - 0.999**3, 3
    assert split_fused([item], hyper, "exp_avg", "exp_avg_sq")[0] == []


def test_the_optimizer_passes_one_count_only_where_momentum_and_variance_agree(monkeypatch) -> None:  # type: ignore[no-untyped-def]
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(8, 16), nn.Linear(16, 4))
    opt = BlockwiseAdamW(model.named_parameters(), lr=1e-2, kernels="eager")  # the eager step's items
    seen: dict[int, int | None] = {}
    update = FORMATS["fp32"].update

    def spy(items, hyper):  # type: ignore[no-untyped-def]
        seen.update({id(it.param): it.step_count for it in items})
        update(items, hyper)

    monkeypatch.setattr(FORMATS["fp32"], "update", spy)
    for step in range(6):
        if step == 3:
            opt.set_formats({"0.weight": "nomomentum"})
            opt.set_formats({"0.weight": "fp32"})  # momentum re-created: its own count
        opt.zero_grad()
        model(torch.randn(4, 8)).square().mean().backward()
        opt.step()
    w = model[0].weight
    assert opt.momentum_step_count(w) != opt.step_count(w)
    assert seen[id(w)] is None
    assert seen[id(model[1].weight)] == opt.step_count(model[1].weight) == 6


def test_non_contiguous_and_empty_parameters() -> None:
    hyper = _hyper(weight_decay=0.1)
    fused = _items([(129, 37), (0,), (0, 7), (64,)])
    fused[0].param = fused[0].param.t()  # a transposed view: 37 x 129, not contiguous
    fused[0].grad = torch.zeros(37, 129)
    reference = _clone(fused)  # clones keep the strides
    _set_step(fused, hyper, 1, torch.Generator().manual_seed(0))
    chosen, rest = split_fused(fused, hyper, "exp_avg", "exp_avg_sq")
    assert [it for it in rest] == [fused[0]] and len(chosen) == 3
    _run(fused, hyper, 3, fused_dense_fp32)
    _run(reference, hyper, 3, foreach_dense_fp32)
    assert not fused[0].param.is_contiguous()
    assert torch.equal(fused[0].param, reference[0].param)  # the transposed one: the reference step
    assert torch.equal(fused[0].views["exp_avg"], reference[0].views["exp_avg"])
    assert ulps(fused[3].param, reference[3].param) <= MAX_ULPS
    assert fused[1].param.numel() == 0 and fused[2].param.shape == (0, 7)


def test_counts_beyond_fp32_exact_integers_keep_the_reference_step() -> None:
    hyper = _hyper()
    item = _items([(8,)])[0]
    t = fused_adam.MAX_FUSED_STEP + 1
    item.bias_correction1, item.bias_correction2, item.step_count = 1 - 0.9**t, 1 - 0.999**t, t
    assert split_fused([item], hyper, "exp_avg", "exp_avg_sq")[0] == []


@pytest.mark.parametrize("how", ["missing", "raises"])
def test_without_the_kernel_the_step_falls_back_to_the_same_results(monkeypatch, how: str) -> None:  # type: ignore[no-untyped-def]
    monkeypatch.setattr(fused_adam, "_AVAILABLE", {})
    if how == "missing":
        monkeypatch.delattr(torch, "_fused_adamw_")
    else:
        def broken(*args, **kwargs):  # type: ignore[no-untyped-def]
            raise RuntimeError("no kernel for this device")

        monkeypatch.setattr(torch, "_fused_adamw_", broken)
    assert not fused_adam.fused_available(CPU)
    assert fused_adam._AVAILABLE == {("cpu", True): False}  # probed once, cached
    hyper = _hyper(weight_decay=0.1)
    fused = _items(SHAPES[:3])
    reference = _clone(fused)
    _run(fused, hyper, 5, fused_dense_fp32)
    _run(reference, hyper, 5, foreach_dense_fp32)
    assert _bit_equal(fused, reference)
    # through the whole optimizer's eager step: torch's foreach AdamW, which the reference follows
    # op for op (the compiled step's fallback, its own fp32 loop, is measured in tests/kernels)
    eager = {"kernels": "eager"}
    assert _pair_with_torch({"lr": 3e-3, "weight_decay": 0.1}, eager, torch_impl="foreach", steps=5) == (0.0, 0.0, 0.0)


def test_the_fused_step_holds_no_full_size_temporary() -> None:
    """The allocator's peak above the start during an fp32 update of 5.1M elements: the fused
    kernel allocates only its 0-d step counts; the reference holds its denominators (and, with
    ``maximize``, a negated gradient) for one batch of ``FOREACH_ELEMENTS`` elements."""
    shapes = [(2048, 2048), (1024, 1024), (1024,), (37, 129)]

    def setup() -> list[StepItem]:
        items = _items(shapes)
        _set_step(items, _hyper(), 1, torch.Generator().manual_seed(0))
        return items

    fused_adam.fused_available(CPU)  # the probe, outside the measure
    figures = {}
    for maximize in (False, True):
        hyper = _hyper(weight_decay=0.1, maximize=maximize)
        for name, update in (("fused", fused_dense_fp32), ("foreach", foreach_dense_fp32)):
            figures[(name, maximize)], _ = peak_above_start(
                setup, lambda items, update=update, hyper=hyper: update(items, hyper, "exp_avg", "exp_avg_sq")
            )
    print(figures)
    for maximize in (False, True):
        assert figures[("fused", maximize)] <= 64  # measured: 4 bytes, one step count
        assert figures[("foreach", maximize)] >= 4 * 2**20  # the measure sees the reference's slices
        assert figures[("fused", maximize)] <= figures[("foreach", maximize)]


def _pair_with_torch(
    kwargs: dict, ours: dict | None = None, steps: int = 50, fmt: str = "fp32", torch_impl: str = "fused"
) -> tuple[float, float, float]:
    """BlockwiseAdamW against torch's AdamW (or Adam) with ``torch_impl`` on a small model: the
    largest ulp distances of the parameters, momenta and second moments after ``steps`` steps."""
    def make() -> nn.Module:
        torch.manual_seed(0)
        return nn.Sequential(nn.Linear(20, 37), nn.LayerNorm(37), nn.GELU(), nn.Linear(37, 129), nn.GELU(), nn.Linear(129, 5))

    a, b = make(), make()
    cls = torch.optim.AdamW if (ours or {}).get("decoupled_weight_decay", True) else torch.optim.Adam
    ref = cls(a.parameters(), **{torch_impl: True}, **kwargs)
    opt = BlockwiseAdamW(b.named_parameters(), state_format=fmt, **kwargs, **(ours or {}))
    gen = torch.Generator().manual_seed(1)
    x, y = torch.randn(256, 20, generator=gen), torch.randint(0, 5, (256,), generator=gen)
    for step in range(steps):
        batch = slice(step % 8 * 32, (step % 8 + 1) * 32)
        for model, o in ((a, ref), (b, opt)):
            o.zero_grad()
            nn.functional.cross_entropy(model(x[batch]), y[batch]).backward()
            o.step()
    pairs = list(zip(a.parameters(), b.parameters()))
    return (
        max(ulps(p.detach(), q.detach()) for p, q in pairs),
        max(ulps(ref.state[p]["exp_avg"], opt.param_state(q).exp_avg) for p, q in pairs),
        max(ulps(ref.state[p]["exp_avg_sq"], opt.param_state(q).exp_avg_sq) for p, q in pairs),
    )


@pytest.mark.parametrize(
    "kwargs, ours",
    [
        ({"lr": 3e-3}, None),
        ({"lr": torch.tensor(3e-3)}, None),
        ({"lr": 3e-3, "weight_decay": 0.0}, None),
        ({"lr": 3e-3, "maximize": True}, None),
        ({"lr": 3e-3, "weight_decay": 0.1}, {"decoupled_weight_decay": False}),
    ],
    ids=["float lr", "tensor lr", "no decay", "maximize", "adam l2"],
)
def test_blockwise_equals_torch_fused_adamw(kwargs: dict, ours: dict | None) -> None:
    """50 steps of a small model, the eager step: the same kernel on the same inputs, so bit for bit (0 ulps)."""
    assert _pair_with_torch(kwargs, {**(ours or {}), "kernels": "eager"}) == (0.0, 0.0, 0.0)


def test_offload_on_the_cpu_equals_torch_fused_adamw() -> None:
    assert _pair_with_torch({"lr": 3e-3}, {"kernels": "eager"}, fmt="offload") == (0.0, 0.0, 0.0)


#: The compiled CPU step's AdamW (``adam_math.chunk_adamw``'s order) against torch's fused kernel
#: after 50 steps of training, in the ulps of :func:`ulps`: parameters, momenta, second moments.
#: Twice the largest measured over the cases below (17, 24.5, 11): each step's last-bit difference
#: feeds the next step's gradients, so the distance grows with training, as between any two AdamW
#: implementations (torch's foreach and fused ones included).
COMPILED_ULPS = (40.0, 50.0, 24.0)


@pytest.mark.skipif(not kernels.cpu_kernels().available, reason="no compiled kernels")
@pytest.mark.parametrize("fmt", ["fp32", "offload"])
@pytest.mark.parametrize("kwargs, ours", [({"lr": 3e-3}, None), ({"lr": 3e-3, "weight_decay": 0.1}, {"decoupled_weight_decay": False})],
                         ids=["adamw", "adam l2"])
def test_the_compiled_step_stays_within_ulps_of_torch_fused_adamw(fmt: str, kwargs: dict, ours: dict | None) -> None:
    distances = _pair_with_torch(kwargs, {**(ours or {}), "kernels": "compiled"}, fmt=fmt)
    assert all(d <= bound for d, bound in zip(distances, COMPILED_ULPS)), distances
    assert distances != (0.0, 0.0, 0.0)  # the compiled step ran, not torch's kernel


def test_host_update_runs_batches_like_one_fused_step() -> None:
    """The offloaded update's host path (here with parameters already on the host): batches of
    whole parameters under the element limit, each one fused launch, the same result as one."""
    items = _items([(37, 129), (1024,), (300,), (5000,)])
    batches = list(host_batches(items, limit=4800))
    assert [[it.param.numel() for it in b] for b in batches] == [[4773], [1024, 300], [5000]]
    one = _clone(items)
    hyper = _hyper(weight_decay=0.1)
    gen_a, gen_b = torch.Generator().manual_seed(1), torch.Generator().manual_seed(1)
    for t in range(1, 4):
        _set_step(items, hyper, t, gen_a)
        _set_step(one, hyper, t, gen_b)
        for batch in host_batches(items, limit=4800):
            host_update(batch, hyper)
        fused_dense_fp32(one, hyper, "exp_avg", "exp_avg_sq")
    assert _bit_equal(items, one)

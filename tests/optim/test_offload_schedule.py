"""The scheduled update of ``offload`` states (``lightning_baoc/optim/offload_schedule.py``), on the CPU standing in
for the device: every schedule held to the ``fp32`` step over 50 steps, with skipped steps, a conversion, a
resume, gradient accumulation, overlap with backward and clipping."""

from __future__ import annotations

import copy
import io

import pytest
import torch
import torch.nn.functional as F
from torch import Tensor, nn

from lightning_baoc import BlockwiseAdamW
from lightning_baoc.optim.offload_model import Hardware, calibrated, hardware
from lightning_baoc.optim.offload_schedule import DeferredLanes, OffloadSchedule, pack, resolve_schedule

#: Subgroups of 4096 fp32 elements: the model below packs into 4, in backward's order: the head (1066 elements), the
#: 9216-element weight alone, a bias, the first weight (4608, alone).
SUBGROUP_BYTES = 4 * 4096
#: Rates that interleave these small subgroups (the model's answer: host, device, host, device, on h100-pcie5's
#: copies with a slower CPU).
MIXED = calibrated(hardware("h100-pcie5"), cpu_adam=2e8)
#: Copies so fast that every subgroup goes to the device (the model's answer: all on the device).
FAST_PCIE = Hardware("fast", h2d=1e15, d2h=1e15, cpu_adam=1e9, gpu_adam=1e12, latency=0.0)
#: The device path's distance from the fp32 step after 50 steps, in ulps of each tensor's scale (torch's fused
#: AdamW against the compiled kernel: the same fp32 operations, ordered differently; measured at most 17.5 over
#: every case below).
MAX_ULPS = 32.0
STEPS = 50
NONFINITE_AT = (7, 31)  # steps whose gradient of "2.weight" holds a NaN: skipped, as the fp32 step skips them


def ulps(a: Tensor, b: Tensor) -> float:
    """Largest ``|a - b|`` in ulps of ``max(|a|, |b|, rms(a))``, element by element (fp32)."""
    a, b = a.float(), b.float()
    scale = torch.maximum(torch.maximum(a.abs(), b.abs()), a.square().mean().sqrt())
    spacing = torch.nextafter(scale, torch.full_like(scale, float("inf"))) - scale
    return float(((a - b).abs() / spacing).max()) if a.numel() else 0.0


def _model() -> nn.Module:
    torch.manual_seed(0)
    return nn.Sequential(nn.Linear(48, 96), nn.Tanh(), nn.Linear(96, 96), nn.Tanh(), nn.Linear(96, 10))


def _batch(step: int, micro: int) -> tuple[Tensor, Tensor]:
    gen = torch.Generator().manual_seed(1000 * step + micro)
    return torch.randn(16, 48, generator=gen), torch.randint(0, 10, (16,), generator=gen)


def _optimizer(model: nn.Module, fmt: str, schedule: object, kernels: str | None,
               lanes: int | None = None) -> BlockwiseAdamW:
    """The optimizer of the runs; ``lanes``: the seed of :class:`DeferredLanes` (asynchronous stand-in streams)."""
    opt = BlockwiseAdamW(model.named_parameters(), lr=3e-3, weight_decay=0.1, state_format=fmt,
                         offload_schedule=schedule, kernels=kernels)
    if lanes is not None:
        opt._offload.lane_factory = DeferredLanes(lanes)
    return opt


def _train(fmt: str, schedule: object = None, *, accumulate: int = 1, clip: float | None = None,
           convert_at: int | None = None, resume_at: int | None = None, skip_window_at: int | None = None,
           kernels: str | None = None, nan_in_backward: bool = False,
           lanes: int | None = None) -> tuple[nn.Module, BlockwiseAdamW]:
    """50 steps of the model; ``convert_at``: ``fp32`` -> ``fmt`` there (the run starts in ``fp32``), and one
    layer back to ``fp32`` 15 steps later; ``resume_at``: save, reload (``weights_only``) into a new model and
    optimizer, go on; ``skip_window_at``: a backward whose step never comes (AMP's skipped step) before it;
    ``nan_in_backward``: the NaN of the skipped steps comes from backward itself (a tensor hook), not written after."""
    model = _model()
    opt = _optimizer(model, "fp32" if convert_at is not None else fmt, schedule, kernels, lanes)
    for step in range(STEPS):
        if convert_at is not None and step == convert_at:
            opt.set_formats({"0": fmt, "2": fmt, "4": fmt})
        if convert_at is not None and step == convert_at + 15:
            opt.set_formats({"4": "fp32"})
        if step == skip_window_at:
            x, y = _batch(step, 99)
            F.cross_entropy(model(x), y).backward()
            opt.zero_grad()  # the step was skipped: its gradients go
        poison = None
        if nan_in_backward and step in NONFINITE_AT:
            poison = model[2].weight.register_hook(lambda g: g.index_put((torch.tensor([3]), torch.tensor([5])),
                                                                         torch.tensor(float("nan"))))
        for micro in range(accumulate):
            x, y = _batch(step, micro)
            (F.cross_entropy(model(x), y) / accumulate).backward()
        if poison is not None:
            poison.remove()
        elif step in NONFINITE_AT:
            model[2].weight.grad[3, 5] = float("nan")
        if clip is not None:
            torch.nn.utils.clip_grad_norm_(model.parameters(), clip)
        opt.step()
        opt.zero_grad()
        if step == resume_at:
            buffer = io.BytesIO()
            torch.save({"model": model.state_dict(), "optimizer": opt.state_dict()}, buffer)
            buffer.seek(0)
            saved = torch.load(buffer, weights_only=True)
            model = _model()
            model.load_state_dict(saved["model"])
            opt = _optimizer(model, fmt, schedule, kernels, lanes)
            opt.load_state_dict(saved["optimizer"])
    return model, opt


def _distance(a: tuple[nn.Module, BlockwiseAdamW], b: tuple[nn.Module, BlockwiseAdamW]) -> float:
    """Largest distance in ulps over the parameters and both moments of every parameter."""
    (ma, oa), (mb, ob) = a, b
    worst = 0.0
    for (name, pa), pb in zip(ma.named_parameters(), mb.parameters()):
        sa, sb = oa.param_state(name), ob.param_state(name)
        worst = max(worst, ulps(pa.detach(), pb.detach()), ulps(sa.exp_avg, sb.exp_avg),
                    ulps(sa.dense_v(), sb.dense_v()))
        assert oa.step_count(name) == ob.step_count(name)
    return worst


@pytest.fixture(scope="module")
def reference() -> dict[str, tuple[nn.Module, BlockwiseAdamW]]:
    """The fp32 step of each variant of the run (compiled kernels and the eager step)."""
    return {key: _train("fp32", **kwargs) for key, kwargs in _VARIANTS.items()}


_VARIANTS = {
    "plain": {},
    "clip": {"clip": 0.5},
    "accumulate": {"accumulate": 2},
    "resume": {"resume_at": 24},
    "skipped window": {"skip_window_at": 12},
    "eager": {"kernels": "eager"},
}

SCHEDULES = {
    "host": OffloadSchedule("host", subgroup_bytes=SUBGROUP_BYTES),
    "device": OffloadSchedule("device", subgroup_bytes=SUBGROUP_BYTES, hardware=MIXED),
    "interleaved": OffloadSchedule("interleaved", subgroup_bytes=SUBGROUP_BYTES, hardware=MIXED),
    "fast pcie": OffloadSchedule("interleaved", subgroup_bytes=SUBGROUP_BYTES, hardware=FAST_PCIE),
    "no staging": OffloadSchedule("interleaved", subgroup_bytes=SUBGROUP_BYTES, hardware=FAST_PCIE, staging_bytes=0),
}


def _with(schedule: OffloadSchedule, **changes: object) -> OffloadSchedule:
    from dataclasses import replace

    return replace(schedule, **changes)


@pytest.mark.parametrize("variant", list(_VARIANTS))
@pytest.mark.parametrize("name", list(SCHEDULES))
@pytest.mark.parametrize("overlap", [False, True], ids=["no overlap", "overlap"])
def test_every_schedule_equals_the_fp32_step_over_50_steps(reference, name: str, variant: str, overlap: bool) -> None:
    """Host-only is the fp32 step bit for bit (the same compiled CPU kernel over host copies); a schedule with the
    device path within fp32 ulps (torch's fused AdamW there). Skipped steps skip alike (their counts too)."""
    kwargs = dict(_VARIANTS[variant])
    accumulate = int(kwargs.get("accumulate", 1))  # type: ignore[call-overload]
    schedule = _with(SCHEDULES[name], overlap=overlap, accumulate_grad_batches=accumulate)
    run = _train("offload", schedule, **kwargs)  # type: ignore[arg-type]
    last = run[1]._offload.last["cpu"]
    paths = last["on_device"]
    expected = {"host": [False] * 4, "device": [True] * 4, "interleaved": [False, True, False, True],
                "fast pcie": [True] * 4, "no staging": [False] * 4}[name]
    assert last["subgroups"] == 4 and last["elements"] == [1066, 9216, 96, 4608] and paths == expected, last
    distance = _distance(reference[variant], run)
    if not any(paths):
        assert distance == 0.0, distance
    else:
        assert distance <= MAX_ULPS, distance
    assert run[1].nonfinite_counts == ({"2.weight": len(NONFINITE_AT)} if "clip" not in kwargs else
                                       {n: len(NONFINITE_AT) for n, _ in run[0].named_parameters()})
    counters = run[1]._offload.counters
    if overlap:
        # every transfer started in backward was used, or taken again where it no longer held: a host-path
        # gradient that clipping (every one) or the NaN written in changed after it (moments staged for the device
        # path hold whatever happens to the gradients)
        assert counters["prefetched"] >= STEPS // 2 - 1, counters  # at least one subgroup a step (resumed: half the steps)
        assert counters["reused"] + counters["retaken"] + counters["dropped"] == counters["prefetched"], counters
        # the window whose step was skipped: its copies (each host-path subgroup's, the first two device-path ones')
        dropped = 0 if "skip_window_at" not in kwargs else paths.count(False) + min(paths.count(True), 2)
        assert counters["dropped"] == dropped, counters
        host_path = not all(paths)
        if "clip" in kwargs and host_path:
            assert counters["retaken"] >= STEPS // 2, counters
        if "clip" not in kwargs or not host_path or any(paths):
            assert counters["reused"] > 0, counters
    else:
        assert counters == {"prefetched": 0, "reused": 0, "retaken": 0, "dropped": 0, "updated_in_backward": 0}


@pytest.mark.parametrize("name", ["host", "interleaved"])
def test_a_conversion_into_and_out_of_offload_keeps_the_fp32_trajectory(name: str) -> None:
    """fp32 -> offload at step 10 (the states move to the schedule whole), one layer back to fp32 at step 25."""
    reference = _train("fp32")
    run = _train("offload", SCHEDULES[name], convert_at=10)
    assert run[1].formats() == {"0.weight": "offload", "0.bias": "offload", "2.weight": "offload",
                                "2.bias": "offload", "4.weight": "fp32", "4.bias": "fp32"}
    distance = _distance(reference, run)
    assert distance == 0.0 if name == "host" else distance <= MAX_ULPS, distance


def test_the_plain_offload_step_is_unchanged_on_the_cpu_and_counts_as_device_memory() -> None:
    """Without ``offload_schedule`` the CPU keeps its own step (nothing scheduled); with one, the state is still
    the training device's memory (8 bytes per element): offload never makes a CPU budget look met."""
    plain = _train("offload")
    assert plain[1]._offload.last == {} and _distance(_train("fp32"), plain) == 0.0
    model, opt = _train("offload", SCHEDULES["interleaved"])
    n = sum(p.numel() for p in model.parameters())
    assert opt.state_bytes() == 8 * n and opt.host_state_bytes() == 0
    # the host path keeps a copy of each of its weights (fp32 here) and two gradient buffers
    host = [p for g, d in zip(pack(list(model.parameters())[::-1], SUBGROUP_BYTES), [False, True, False, True])
            if not d for p in g]
    assert opt._offload.host_bytes() >= 4 * sum(p.numel() for p in host)


def test_a_weight_written_outside_the_step_is_brought_down_again() -> None:
    """The host copy of a host-path weight holds only while nothing else wrote the weight: an in-place write (a
    model load) is seen by its version counter, and the next step brings the weight down."""
    torch.manual_seed(0)
    runs = []
    for schedule in (None, SCHEDULES["host"]):
        model = _model()
        opt = _optimizer(model, "offload" if schedule else "fp32", schedule, None)
        for step in range(6):
            if step == 3:
                with torch.no_grad():
                    model[0].weight.mul_(0.5)
            x, y = _batch(step, 0)
            F.cross_entropy(model(x), y).backward()
            opt.step()
            opt.zero_grad()
        runs.append((model, opt))
    assert _distance(runs[0], runs[1]) == 0.0


def test_bf16_weights_move_at_their_width_and_step_as_the_plain_offload_step() -> None:
    """bf16 weights and gradients: the host path copies them at 2 bytes an element and steps them with the
    compiled kernel, as the CPU's own offload step does; the device path through fp32 working copies."""
    results = {}
    for key, schedule in (("plain", None), ("host", SCHEDULES["host"]), ("device", SCHEDULES["device"])):
        model = _model().to(torch.bfloat16)
        opt = _optimizer(model, "offload", schedule, None)
        for step in range(10):
            x, y = _batch(step, 0)
            F.cross_entropy(model(x.bfloat16()).float(), y).backward()
            opt.step()
            opt.zero_grad()
        results[key] = (model, opt)
        if schedule is not None:
            grad_buffers = [b for (d, name), b in opt._offload.host_buffers.items() if name[0] == "slot"]
            if key == "host":
                assert max(b.numel() for b in grad_buffers) < 4 * 9216 + 64  # bf16 gradients: 2 bytes an element
    for key in ("host", "device"):
        for pa, pb in zip(results["plain"][0].parameters(), results[key][0].parameters()):
            assert pa.dtype == pb.dtype == torch.bfloat16
            if key == "host":
                assert torch.equal(pa, pb)
            else:  # one bf16 rounding apart at most, where the fp32 updates differ in their last bits
                assert torch.allclose(pa.float(), pb.float(), rtol=2**-7, atol=1e-6)


def test_the_model_s_choices_follow_the_rates_and_the_memory() -> None:
    """Very fast copies: every subgroup on the device; no staging memory: every one on the host; a device-only
    schedule that cannot stage is refused with the fix named."""
    for schedule, expected in ((SCHEDULES["fast pcie"], [True] * 4), (SCHEDULES["no staging"], [False] * 4)):
        _, opt = _train("offload", schedule)
        assert opt._offload.last["cpu"]["on_device"] == expected
    model = _model()
    opt = _optimizer(model, "offload", OffloadSchedule("device", subgroup_bytes=SUBGROUP_BYTES, staging_bytes=100), None)
    x, y = _batch(0, 0)
    F.cross_entropy(model(x), y).backward()
    with pytest.raises(RuntimeError, match="stages .* bytes .* more than the 100 bytes free on cpu. Use a smaller "
                                           "subgroup_bytes, 'interleaved'"):
        opt.step()


def test_the_schedule_argument_is_validated_with_the_allowed_values() -> None:
    model = _model()
    with pytest.raises(ValueError, match="Invalid offload_schedule: 'sideways'; allowed: 'interleaved', 'host', 'device'"):
        BlockwiseAdamW(model.parameters(), offload_schedule="sideways")
    with pytest.raises(TypeError, match="Invalid offload_schedule: 3; expected"):
        BlockwiseAdamW(model.parameters(), offload_schedule=3)  # type: ignore[arg-type]
    with pytest.raises(ValueError, match="Invalid offload subgroup_bytes: 2; expected an int >= 4"):
        OffloadSchedule(subgroup_bytes=2)
    with pytest.raises(ValueError, match="Invalid offload accumulate_grad_batches: 0"):
        OffloadSchedule(accumulate_grad_batches=0)
    with pytest.raises(ValueError, match="Unknown hardware profile 'h100'"):
        OffloadSchedule(hardware="h100")
    assert resolve_schedule("host") == OffloadSchedule("host") and resolve_schedule(None) is None


def test_a_copy_keeps_the_schedule() -> None:
    model, opt = _train("offload", SCHEDULES["interleaved"])
    twin = copy.deepcopy(opt)
    assert twin._offload.settings == SCHEDULES["interleaved"]


def _steps(model: nn.Module, opt: BlockwiseAdamW, steps: int, between: object = None, frozen_at: int | None = None) -> None:
    for step in range(steps):
        x, y = _batch(step, 0)
        F.cross_entropy(model(x), y).backward()
        if step == frozen_at:
            model[0].weight.grad = None  # a step where one parameter has no gradient
        if callable(between):
            between(step, opt)
        opt.step()
        opt.zero_grad()


def test_groups_of_their_own_hyperparameters_share_subgroups_and_a_missing_gradient_is_left_out() -> None:
    """Two param groups (their own learning rate and decay) mixed in subgroups, and a step where one weight has
    no gradient (its subgroup is laid out again without it): the fp32 step's numbers."""
    runs = []
    for fmt, schedule in (("fp32", None), ("offload", _with(SCHEDULES["interleaved"], overlap=True))):
        model = _model()
        groups = [{"params": [p for n, p in model.named_parameters() if n.endswith("weight")], "lr": 2e-3},
                  {"params": [p for n, p in model.named_parameters() if n.endswith("bias")], "lr": 5e-3,
                   "weight_decay": 0.0}]
        opt = BlockwiseAdamW(groups, state_format=fmt, offload_schedule=schedule, param_names=model)
        _steps(model, opt, 20, frozen_at=9)
        runs.append((model, opt))
    assert _distance(runs[0], runs[1]) <= MAX_ULPS
    assert runs[1][1].step_count("0.weight") == 19


def test_a_conversion_between_backward_and_step_drops_the_moments_staged_in_backward() -> None:
    """Overlap stages device-path moments in backward; a format change before ``step()`` replaces the states, and
    the staged copies are not used (taken again from the new states)."""
    def convert(step: int, opt: BlockwiseAdamW) -> None:
        if step == 5:
            opt.set_formats({"2": "fp32"})
        if step == 6:
            opt.set_formats({"2": "offload"})

    runs = []
    for fmt, schedule in (("fp32", None), ("offload", _with(SCHEDULES["device"], overlap=True))):
        model = _model()
        opt = _optimizer(model, fmt, schedule, None)
        _steps(model, opt, 12, between=convert)
        runs.append((model, opt))
    assert _distance(runs[0], runs[1]) <= MAX_ULPS
    assert runs[1][1]._offload.counters["reused"] > 0


@pytest.mark.parametrize("case", ["atomic_step", "weight_correction", "release"])
def test_what_the_schedule_does_not_serve_takes_the_optimizer_s_own_step(case: str) -> None:
    """An atomic step (its journal covers the optimizer's own step), a bf16 weight with a master-weight correction,
    and gradient release: the optimizer's own offload step, nothing scheduled, the same numbers as without a
    schedule."""
    runs = []
    for schedule in (None, SCHEDULES["interleaved"]):
        model = _model()
        kwargs: dict[str, object] = {}
        if case == "atomic_step":
            kwargs["atomic_step"] = True
        if case == "weight_correction":
            model = model.to(torch.bfloat16)
            kwargs["weight_correction"] = "ecc8"
        opt = BlockwiseAdamW(model.named_parameters(), lr=3e-3, state_format="offload", offload_schedule=schedule,
                             **kwargs)  # type: ignore[arg-type]
        if case == "release":
            opt.release_gradients()
        for step in range(6):
            x, y = _batch(step, 0)
            F.cross_entropy(model(x.to(next(model.parameters()).dtype)).float(), y).backward()
            opt.step()
            opt.zero_grad()
        runs.append((model, opt))
        if schedule is not None:
            assert opt._offload.last == {}
    for pa, pb in zip(runs[0][0].parameters(), runs[1][0].parameters()):
        assert torch.equal(pa, pb)


_IN_BACKWARD = {"plain": {}, "accumulate": {"accumulate": 2}, "resume": {"resume_at": 24}, "eager": {"kernels": "eager"}}


@pytest.mark.parametrize("variant", list(_IN_BACKWARD))
@pytest.mark.parametrize("name", ["host", "interleaved"])
def test_updates_in_backward_equal_the_fp32_step(name: str, variant: str) -> None:
    """``update_in_backward``: each host-path subgroup is updated in its hook, on the last micro-batch; skipped steps
    (a NaN from backward) skip alike; the same numbers as the fp32 step (host-only: to the bit)."""
    kwargs = dict(_IN_BACKWARD[variant], nan_in_backward=True)
    schedule = _with(SCHEDULES[name], overlap=True, update_in_backward=True,
                     accumulate_grad_batches=int(kwargs.get("accumulate", 1)))  # type: ignore[call-overload]
    reference = _train("fp32", **kwargs)  # type: ignore[arg-type]
    run = _train("offload", schedule, **kwargs)  # type: ignore[arg-type]
    distance = _distance(reference, run)
    assert distance == 0.0 if name == "host" else distance <= MAX_ULPS, distance
    assert run[1].nonfinite_counts == {"2.weight": len(NONFINITE_AT)}
    steps = STEPS - 1 - int(kwargs.get("resume_at", -1))  # type: ignore[call-overload] - the resumed optimizer's
    host_groups = 4 if name == "host" else 2
    assert run[1]._offload.counters["updated_in_backward"] == host_groups * (steps - 1), run[1]._offload.counters


@pytest.mark.parametrize("case", ["clip", "skipped window"])
def test_updates_in_backward_refuse_clipping_and_a_skipped_step_naming_the_setting(case: str) -> None:
    schedule = _with(SCHEDULES["host"], overlap=True, update_in_backward=True)
    kwargs = {"clip": 0.5} if case == "clip" else {"skip_window_at": 12}
    message = "written after its update ran in backward" if case == "clip" else "received a gradient again before step"
    with pytest.raises(RuntimeError, match=message + ".*update_in_backward=False"):
        _train("offload", schedule, nan_in_backward=True, **kwargs)  # type: ignore[arg-type]
    with pytest.raises(ValueError, match="update_in_backward=True needs overlap=True"):
        OffloadSchedule(update_in_backward=True)


def test_amp_s_scaler_unscaling_and_skipping_keep_overlap_exact() -> None:
    """``torch.amp.GradScaler``: ``unscale_`` rewrites every gradient after its transfer in backward (taken again in
    ``step()``), and a step the scaler skips (an inf from backward) leaves its copies behind at the next backward:
    the fp32 step's numbers, to the bit (host-only)."""
    runs = []
    for fmt, schedule in (("fp32", None), ("offload", _with(SCHEDULES["host"], overlap=True))):
        model = _model()
        opt = _optimizer(model, fmt, schedule, None)
        scaler = torch.amp.GradScaler("cpu", init_scale=2.0**12)
        for step in range(12):
            poison = model[2].weight.register_hook(lambda g: g * float("inf")) if step == 5 else None
            x, y = _batch(step, 0)
            scaler.scale(F.cross_entropy(model(x), y)).backward()
            if poison is not None:
                poison.remove()
            scaler.step(opt)  # skipped at step 5: the scaler found the inf
            scaler.update()
            opt.zero_grad()
        runs.append((model, opt))
    assert _distance(runs[0], runs[1]) == 0.0
    assert runs[1][1].step_count("0.weight") == 11 and runs[1][1]._offload.counters["retaken"] > 0


def test_a_step_the_scaler_skipped_updates_nothing_here() -> None:
    """AMP's ``found_inf`` handed to the step (``amp_scaling``): every parameter goes to the optimizer's own step,
    which skips the whole step; nothing is updated or counted here."""
    model = _model()
    opt = _optimizer(model, "offload", SCHEDULES["interleaved"], None)
    for found in (None, torch.ones(1)):
        x, y = _batch(0, 0)
        F.cross_entropy(model(x), y).backward()
        if found is None:
            opt.step()
            continue
        before = [p.detach().clone() for p in model.parameters()]
        batches = [(0, opt.param_groups[0], list(model.parameters()))]
        assert opt._offload.step(batches, opt._hyper, found) == batches
        assert all(torch.equal(a, b) for a, b in zip(before, model.parameters()))
        assert opt.step_count("0.weight") == 1


def test_the_update_phase_s_working_memory_is_reported_and_bounded_by_staging_bytes() -> None:
    """The device path stages two subgroups' moments at most (8 bytes an element, double-buffered), within
    ``staging_bytes``; a bound below that keeps the largest subgroups on the host."""
    _, opt = _train("offload", SCHEDULES["device"])
    last = opt._offload.last["cpu"]
    assert last["staging_bytes"] == 2 * 8 * 9216  # two buffers of the largest subgroup's m and v
    bound = 2 * 8 * 4608  # room for the smaller subgroups only
    _, opt = _train("offload", _with(SCHEDULES["fast pcie"], staging_bytes=bound))
    last = opt._offload.last["cpu"]
    assert last["on_device"][1] is False and any(last["on_device"]), last  # the 9216-element one stays on the host
    assert 0 < last["staging_bytes"] <= bound, last


def test_the_staging_is_counted_as_working_memory_in_the_planned_peak() -> None:
    """``offload_working_bytes()``: before a step the most the schedule may stage (two buffers of the largest
    subgroup's moments, within ``staging_bytes``; none under ``"host"``), after one what it staged; the planned
    peak counts it beside BAOC's own working memory."""
    from lightning_baoc.costs.peak import PlannedPeak

    model = _model()
    opt = _optimizer(model, "offload", SCHEDULES["device"], None)
    largest = max(p.numel() for p in model.parameters())
    subgroup = SCHEDULES["device"].subgroup_bytes // 4
    assert opt.offload_working_bytes() == 2 * 8 * max(largest, subgroup)
    _, trained = _train("offload", SCHEDULES["device"])
    assert trained.offload_working_bytes() == trained._offload.last["cpu"]["staging_bytes"] == 2 * 8 * 9216
    bounded = _optimizer(_model(), "offload", _with(SCHEDULES["device"], staging_bytes=1000), None)
    assert bounded.offload_working_bytes() == 1000
    assert _optimizer(_model(), "offload", OffloadSchedule("host"), None).offload_working_bytes() == 0
    assert _optimizer(_model(), "fp32", None, None).offload_working_bytes() == 0
    peak = PlannedPeak(gradients=100, state=200, instruments=10, working=20, staging=2 * 8 * 9216)
    assert peak.total == 330 + 2 * 8 * 9216 and "offload staging <= 144 KiB (activations" in peak.line()
    assert "offload staging" not in PlannedPeak(100, 200, 10, 20).line()


def test_without_a_profile_the_model_plans_with_the_measured_rates() -> None:
    """No ``hardware``: the CPU's AdamW rate measured by its wall time replaces the profile's, and the layout is
    chosen again at those rates."""
    _, opt = _train("offload", OffloadSchedule("interleaved", subgroup_bytes=SUBGROUP_BYTES))
    measured = opt._offload.measured
    assert measured["cpu_adam"] > 0
    rates = opt._offload.hardware(torch.device("cpu"), opt._offload.settings)
    assert rates.cpu_adam == measured["cpu_adam"] and rates.name == "h100-pcie5 (calibrated)"


def _exact_gradients_run(device: torch.device, fmt: str, schedule: object, steps: int = 20) -> list[Tensor]:
    """The model on ``device`` trained on gradients drawn on the CPU and delivered by backward exactly (the loss
    ``sum(p * G)``), so that runs on two devices see the same gradients; its weights after ``steps``, on the CPU."""
    model = _model().to(device)
    opt = _optimizer(model, fmt, schedule, None)
    gen = torch.Generator().manual_seed(7)
    for step in range(steps):
        grads = [(torch.randn(p.shape, generator=gen) * 1e-2).to(device) for p in model.parameters()]
        if step == 9:
            grads[2][0, 0] = float("nan")  # "2.weight": skipped
        sum((p * g).sum() for p, g in zip(model.parameters(), grads)).backward()
        opt.step()
        opt.zero_grad()
    if device.type == "cuda":
        assert opt._offload.last["cuda:0"]["subgroups"] == 4
    return [p.detach().cpu() for p in model.parameters()]


@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")
@pytest.mark.parametrize("overlap", ["off", "transfers", "update"])
@pytest.mark.parametrize("name", ["host", "interleaved", "device"])
def test_on_cuda_every_schedule_steps_as_the_cpu_s_fp32_step(name: str, overlap: str) -> None:
    """On a GPU, with its streams, events, pinned buffers and (updates in backward) the worker thread: host-only is
    the CPU's fp32 step bit for bit (the same compiled kernel on the same gradients); the device path (torch's fused
    CUDA AdamW) within fp32 ulps."""
    schedule = _with(SCHEDULES[name], overlap=overlap != "off", update_in_backward=overlap == "update")
    reference = _exact_gradients_run(torch.device("cpu"), "fp32", None)
    run = _exact_gradients_run(torch.device("cuda"), "offload", schedule)
    worst = max(ulps(a, b) for a, b in zip(reference, run))
    assert worst == 0.0 if name == "host" else worst <= MAX_ULPS, worst


def test_exact_gradients_through_backward_on_the_cpu() -> None:
    """The CUDA test's harness on the CPU standing in: every schedule the fp32 step (host-only to the bit)."""
    reference = _exact_gradients_run(torch.device("cpu"), "fp32", None)
    for name in ("host", "interleaved", "device"):
        for overlap in ("off", "transfers", "update"):
            schedule = _with(SCHEDULES[name], overlap=overlap != "off", update_in_backward=overlap == "update")
            run = _exact_gradients_run(torch.device("cpu"), "offload", schedule)
            worst = max(ulps(a, b) for a, b in zip(reference, run))
            assert worst == 0.0 if name == "host" else worst <= MAX_ULPS, (name, overlap, worst)


@pytest.mark.parametrize("seed", [0, pytest.param(1, marks=pytest.mark.slow), pytest.param(2, marks=pytest.mark.slow)])  # more seeds: slow
@pytest.mark.parametrize("name", ["host", "interleaved", "device"])
@pytest.mark.parametrize("overlap", ["off", "transfers", "update"])
def test_with_streams_that_run_later_every_wait_is_in_place(name: str, overlap: str, seed: int) -> None:
    """The lanes as a GPU runs its streams (:class:`DeferredLanes`): each task later, in its lane's order and after
    the events it waits for, the lanes interleaved at random. A copy that ran before the data it copies, a buffer
    reused before its last reader, a weight read before its upload: each would move the numbers. They are the fp32
    step's (host-only to the bit) over 50 steps with skipped steps, accumulation over two micro-batches and a
    resume, whatever the interleaving."""
    schedule = _with(SCHEDULES[name], overlap=overlap != "off", update_in_backward=overlap == "update",
                     accumulate_grad_batches=2)
    kwargs = {"accumulate": 2, "resume_at": 24, "nan_in_backward": True}
    reference = _train("fp32", **kwargs)  # type: ignore[arg-type]
    run = _train("offload", schedule, lanes=seed, **kwargs)  # type: ignore[arg-type]
    distance = _distance(reference, run)
    assert distance == 0.0 if name == "host" else distance <= MAX_ULPS, distance
    hub = run[1]._offload.lane_factory
    assert isinstance(hub, DeferredLanes) and sum(lane.ran for lane in hub.lanes) > 100  # the tasks went through it


def test_a_missing_wait_shows_under_streams_that_run_later(monkeypatch: pytest.MonkeyPatch) -> None:
    """The stand-in catches what it is for: with the device path's wait for its step taken out of the lane that copies
    the moments back, they go down before the step wrote them (the host keeps stale moments), and the numbers move."""
    from lightning_baoc.optim import offload_schedule as S

    waits = []
    original = S._DeferredLane.wait

    def forgetful(self, event):  # the lane of the moments' way down (the fifth made: dev_d2h) forgets its waits
        waits.append(event)
        if self is not self.hub.lanes[4]:
            original(self, event)

    monkeypatch.setattr(S._DeferredLane, "wait", forgetful)
    reference = _train("fp32")[0]
    moved = []
    for seed in range(3):
        run = _train("offload", SCHEDULES["device"], lanes=seed)[0]
        moved.append(max(ulps(a.detach(), b.detach()) for a, b in zip(reference.parameters(), run.parameters())))
    # stale moments move the numbers by millions of ulps, or to NaN (a buffer's leftovers): any of them shows it
    assert waits and any(not m <= 1e3 for m in moved), moved
